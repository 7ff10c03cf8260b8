"""The critic: the LM backbone with a scalar value head (its training is in `rlpipe.train.critic`).

It is a transformers token-classification model with one label (as verl's critic), so
`AutoModelForTokenClassification.from_pretrained(dir)` reloads backbone and head from the directory
alone. It starts from the init policy (or `value.model.path`). V_t = V(s_t) is the head's output at the
position that predicts response token t, i.e. the state before t. Critic-free presets write a marker
file instead, with no model load.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from rlpipe import paths
from rlpipe.models import transformers_warnings_off
from rlpipe.dvc_state import stage_output_directory

CRITIC_OPTIMIZER_FILE = "critic_optimizer.pt"


def write_no_critic_marker(out_dir: Path, preset: str) -> dict:
    with stage_output_directory(out_dir) as tmp:
        (tmp / paths.NO_CRITIC_MARKER).write_text(json.dumps({"critic": None, "preset": preset}) + "\n")
    return {"value/critic": 0}


def load_critic(path: str | Path, dtype: str = "float32", from_policy: bool = False):
    """(critic, tokenizer). With `from_policy`, a fresh value head on the policy's backbone."""
    from transformers import AutoConfig, AutoModelForTokenClassification, AutoTokenizer

    from rlpipe.models.policy import torch_dtype

    path = str(path)
    if (Path(path) / paths.NO_CRITIC_MARKER).is_file():
        raise FileNotFoundError(f"{path}: holds no critic (it was written for a critic-free preset); "
                                f"rerun value_pretrain for a preset with a critic")
    config = AutoConfig.from_pretrained(path)
    if from_policy:  # one scalar head; no dropout on it (the generic head defaults to 0.1)
        config.num_labels, config.classifier_dropout = 1, 0.0
    # transformers logs a "LOAD REPORT" table for every key it did not find; from a policy the value
    # head is new by design, so the report is checked here instead, and anything else is an error. With
    # that logger above WARNING, transformers 5.19 checks the model's tensor-parallel plan (used by no
    # stage) and lists the layers it leaves unsharded, so that logger is held too.
    with transformers_warnings_off("transformers.modeling_utils", "transformers.distributed.tensor_parallel"):
        critic, loading = AutoModelForTokenClassification.from_pretrained(
            path, config=config, dtype=torch_dtype(dtype), output_loading_info=True)
    check_critic_keys(path, critic.base_model_prefix, loading, from_policy)
    critic.eval()
    return critic, AutoTokenizer.from_pretrained(path)


def check_critic_keys(path: str, backbone_prefix: str, loading: dict, from_policy: bool) -> None:
    """Raise unless the checkpoint held every backbone weight, and the head too unless the critic is new
    (`from_policy`: a policy's LM head is then left over, and the value head starts fresh)."""
    def head_only(keys) -> bool:
        return all(not key.startswith(backbone_prefix + ".") for key in keys)

    def listed(keys) -> str:
        keys = sorted(keys)
        return ", ".join(keys[:6]) + (" ..." if len(keys) > 6 else "")

    missing, unexpected = loading["missing_keys"], loading["unexpected_keys"]
    if missing and not (from_policy and head_only(missing)):
        raise ValueError(f"{path}: not a complete critic checkpoint: missing {listed(missing)}")
    if unexpected and not (from_policy and head_only(unexpected)):
        raise ValueError(f"{path}: holds weights a critic of its config does not have: {listed(unexpected)}")


def critic_forward(critic, batch):
    """(B, T) values of the states before each response token (all positions materialised)."""
    out = critic(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                 position_ids=batch.position_ids, use_cache=False)
    width = batch.response_ids.shape[1]
    scores = out.logits[..., 0]
    values = scores[:, batch.prompt_width - 1 : batch.prompt_width - 1 + width]
    return values.float().masked_fill(~batch.response_mask, 0.0)


def critic_values(critic, pad_id: int, prompt_ids, response_ids, width: int, token_budget: int):
    """(B, width) values of every response's states under `critic`, in token-budget chunks."""
    import torch

    from rlpipe.models.device import model_device
    from rlpipe.models.sequences import pack, token_budget_chunks

    out = torch.zeros((len(prompt_ids), width))
    device = model_device(critic)
    with torch.no_grad():
        for rows in token_budget_chunks([len(p) + width for p in prompt_ids], token_budget):
            batch = pack(prompt_ids[rows], response_ids[rows], pad_id, response_width=width).to(device)
            out[rows] = critic_forward(critic, batch).to(out.device)
    return out


def explained_variance(values, returns, mask) -> float:
    """1 - Var(G - V) / Var(G) over valid tokens (1 = perfect, 0 = no better than the mean)."""
    g, v = returns[mask], values[mask]
    var = g.var(unbiased=False)
    return float(1 - (g - v).var(unbiased=False) / var) if var > 0 else float("nan")


def oracle_explained_variance(returns, mask, oracle_values, oracle_noise=None) -> float:
    """The ceiling of `explained_variance` on a batch: the EV of the oracle critic V*(s_t), the expected
    return of each response prefix under the current policy, over the same returns and tokens.

    No critic that sees only the prefix can do better where G_t is the Monte-Carlo return of the outcome
    (lambda = gamma = 1, no per-token reward): V* = E[G | s_t] minimises E[(G - V)^2]. All (B, T).
    `oracle_values` are Monte-Carlo estimates of V* (the mean reward of K continuations); their sampling
    error adds to Var(G - V) and pulls the EV down, so `oracle_noise`, an unbiased estimate of each
    estimate's variance (the continuations' sample variance / K), is subtracted from it when given.
    """
    g, v = returns[mask], oracle_values[mask]
    var = g.var(unbiased=False)
    if not var > 0:
        return float("nan")
    residual = (g - v).var(unbiased=False)
    if oracle_noise is not None:
        residual = residual - oracle_noise[mask].mean()
    return float(1 - residual / var)


def fraction_of_ceiling(critic_ev: float, ceiling: float) -> float:
    """The critic's explained variance as a fraction of the oracle's; NaN where there is no ceiling (<= 0
    or NaN: returns without variance, or an estimate swamped by its noise)."""
    return critic_ev / ceiling if ceiling > 0 else float("nan")


def bootstrap_fractions(returns, mask, oracle_values, oracle_noise, critics: dict, resamples: int = 1000,
                        seed: int = 0) -> dict[str, list[float]]:
    """Each critic's fraction of the ceiling (its `explained_variance` over `oracle_explained_variance`)
    on `resamples` draws of the batch's responses with replacement, the ceiling taken on each draw too, so
    that the fractions of one draw share it and two critics can be compared draw by draw. `critics` maps a
    name to its (B, T) values; the rest as `oracle_explained_variance`."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    fractions = {name: [] for name in critics}
    for _ in range(resamples):
        rows = torch.randint(0, len(returns), (len(returns),), generator=generator)
        drawn_returns, drawn_mask = returns[rows], mask[rows]
        ceiling = oracle_explained_variance(drawn_returns, drawn_mask, oracle_values[rows],
                                            None if oracle_noise is None else oracle_noise[rows])
        for name, values in critics.items():
            fractions[name].append(fraction_of_ceiling(explained_variance(values[rows], drawn_returns, drawn_mask),
                                                       ceiling))
    return fractions


def percentile_interval(draws: list[float], level: float = 0.95) -> tuple[float, float]:
    """The central `level` interval of bootstrap draws; draws that are not finite (a ceiling of 0 on a
    tiny batch) are left out, and (nan, nan) when none is."""
    ordered = sorted(d for d in draws if math.isfinite(d))
    if not ordered:
        return float("nan"), float("nan")
    tail = (1 - level) / 2
    return ordered[int(tail * len(ordered))], ordered[int((1 - tail) * len(ordered)) - 1]
