"""Packing and the shared-prompt forward: the same logprobs and gradients as one full forward."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from rlpipe.models.sequences import pack, prompt_runs, response_logprobs


def _groups(tokenizer, seed: int):
    """Ragged prompts, each repeated 1-4 times in consecutive rows, with ragged responses."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(4, 14) for _ in range(rng.randrange(2, 8))] for _ in range(6)]
    rows = [p for p in prompts for _ in range(rng.randrange(1, 5))]
    responses = [[rng.randrange(4, 14) for _ in range(rng.randrange(1, 6))] + [tokenizer.eos_token_id] for _ in rows]
    return rows, responses


def _logprobs_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    logp, entropy = response_logprobs(model, batch, temperature=0.7, with_entropy=True)
    (logp.sum() + 0.1 * entropy.sum()).backward()
    return logp.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_shared_prompt_forward_matches_the_full_forward(tiny_model, tokenizer, attention):
    model = tiny_model
    model.set_attn_implementation(attention)
    model.train()
    try:
        for seed in range(3):
            batch = pack(*_groups(tokenizer, seed), tokenizer.pad_token_id)
            assert batch.prompt_runs is not None and int(batch.prompt_runs.max()) > 1
            shared_logp, shared_grads = _logprobs_and_grads(model, batch)
            full_logp, full_grads = _logprobs_and_grads(model, dataclasses.replace(batch, prompt_runs=None))
            torch.testing.assert_close(shared_logp, full_logp, atol=1e-5, rtol=1e-5)
            for shared, full in zip(shared_grads, full_grads):
                torch.testing.assert_close(shared, full, atol=1e-5, rtol=1e-4)
    finally:
        model.set_attn_implementation("sdpa")
        model.eval()
        model.zero_grad(set_to_none=True)


def test_the_shared_prompt_forward_runs_each_prompt_once(tiny_model, tokenizer):
    seen = []
    hook = tiny_model.register_forward_hook(lambda m, a, kw, out: seen.append(tuple(kw["input_ids"].shape)),
                                            with_kwargs=True)
    try:
        batch = pack([[5, 6, 7]] * 3 + [[8, 9]], [[4], [5, 6], [7, 8, 9], [4]], tokenizer.pad_token_id)
        with torch.no_grad():
            response_logprobs(tiny_model, batch)
    finally:
        hook.remove()
    # 2 distinct prompts x their first 2 columns, then all 4 rows x (last prompt column + 3 response columns)
    assert seen == [(2, 2), (4, 4)]


def test_gradient_checkpointing_takes_the_full_forward(tokenizer):
    from rlpipe.config import TinyModelConfig
    from rlpipe.models.policy import build_tiny_model

    model = build_tiny_model(TinyModelConfig(layers=1, hidden=16, heads=2, intermediate=32), tokenizer, seed=0)
    batch = pack(*_groups(tokenizer, 0), tokenizer.pad_token_id)
    reference, _ = _logprobs_and_grads(model.train(), batch)
    model.gradient_checkpointing_enable()
    checkpointed, grads = _logprobs_and_grads(model, batch)  # the cache is off: must not try to share it
    torch.testing.assert_close(checkpointed, reference, atol=1e-5, rtol=1e-5)
    assert all(g is not None for g in grads)


def test_prompt_runs_compare_ids_and_mask():
    pad = 0
    prompts = torch.tensor([[0, 5, 6], [0, 5, 6], [0, 5, 6], [1, 2, 3]])
    mask = torch.tensor([[0, 1, 1], [0, 1, 1], [1, 1, 1], [1, 1, 1]], dtype=torch.bool)
    # row 2 has the same ids as rows 0-1, but its first 0 is a real token (pad id = a vocabulary id)
    assert prompt_runs(prompts, mask).tolist() == [2, 1, 1]
    assert prompt_runs(prompts[2:], mask[2:]) is None  # no row repeats its predecessor
    assert prompt_runs(prompts[:1], mask[:1]) is None
    assert pack([[5, 6]] * 3, [[7]] * 3, pad).prompt_runs.tolist() == [3]


def test_update_attention_auto_picks_eager_only_for_short_sequences_on_cpu():
    from rlpipe.config import UpdateConfig
    from rlpipe.train.policy import EAGER_ATTENTION_MAX_TOKENS, update_attention

    auto = UpdateConfig()
    assert update_attention(auto, "cpu", 13) == "eager"
    assert update_attention(auto, "cpu", EAGER_ATTENTION_MAX_TOKENS + 1) == "sdpa"
    assert update_attention(auto, "cuda:0", 13) == "sdpa"
    assert update_attention(UpdateConfig(attention="sdpa"), "cpu", 13) == "sdpa"
    assert update_attention(UpdateConfig(attention="eager"), "cuda:0", 4096) == "eager"


def test_bf16_autocasts_the_update_on_cpu(tiny_model, tokenizer):
    from rlpipe.config import params_from_dict
    from rlpipe.train.policy import update_autocast

    batch = pack(*_groups(tokenizer, 1), tokenizer.pad_token_id)
    for bf16, dtype in ((True, torch.bfloat16), (False, torch.float32)):
        params = params_from_dict({"update": {"bf16": bf16}})
        seen = []
        hook = tiny_model.lm_head.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
        try:
            with torch.no_grad(), update_autocast(params, "cpu"):
                logp, _ = response_logprobs(tiny_model, batch)
        finally:
            hook.remove()
        assert set(seen) == {dtype}
        assert logp.dtype == torch.float32  # the log-softmax runs in fp32 either way


def test_pad_ragged_pads_each_row_in_place_and_rejects_a_row_too_wide():
    from rlpipe.models.sequences import pad_ragged

    rows = [[1.5, 2.5], [], [3.0, 4.0, 5.0]]
    right, right_mask = pad_ragged(rows, -1.0, torch.float32)
    assert right.tolist() == [[1.5, 2.5, -1.0], [-1.0, -1.0, -1.0], [3.0, 4.0, 5.0]]
    assert right_mask.tolist() == [[True, True, False], [False] * 3, [True] * 3]
    left, left_mask = pad_ragged(rows, 0, torch.long, left=True, width=4)
    assert left.tolist() == [[0, 0, 1, 2], [0, 0, 0, 0], [0, 3, 4, 5]]
    assert left_mask.tolist() == [[False, False, True, True], [False] * 4, [False, True, True, True]]
    empty, empty_mask = pad_ragged([], 0.0, torch.float32)
    assert empty.shape == empty_mask.shape == (0, 0)
    with pytest.raises(ValueError, match="a row of 3 values does not fit a width of 2"):
        pad_ragged(rows, 0.0, torch.float32, width=2)


def test_a_stage_process_freezes_only_what_its_imports_created():
    """The cyclic GC skips torch's and transformers' objects (`gc.freeze`, once): a later stage's
    objects stay collectable."""
    import subprocess
    import sys

    probe = """
import gc
from rlpipe.config import params_from_dict
from rlpipe.stages import StageContext
ctx = StageContext("rollout", params_from_dict({}), "r1", None, None)
ctx.init_torch()
frozen = gc.get_freeze_count()
garbage = [[i] for i in range(10000)]
ctx.init_torch()
print(frozen > 100000, gc.get_freeze_count() == frozen)
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "True"]
