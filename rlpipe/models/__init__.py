"""The models: the policy (and reference), the critic, the embedded tokenizer, and how token ids become
model inputs and per-token logprobs (`sequences`)."""
