"""The embedded character-level tokenizer, built locally with `tokenizers` (no download).

Saved as a plain `tokenizer.json` + config so that `AutoTokenizer.from_pretrained(dir)` loads it from the
directory alone. Paired with a Llama config: with a Qwen2 config, AutoTokenizer swaps in a BPE
tokenizer that drops characters.
"""

from __future__ import annotations

from rlpipe.data.tasks import TASK_ALPHABET

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)


def build_char_tokenizer(alphabet: str = TASK_ALPHABET):
    """A `PreTrainedTokenizerFast`: one token per character, `<bos>` prepended, ids 0..3 special."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *dict.fromkeys(alphabet)])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, vocab[BOS])])
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK
    )
