"""`rlpipe compare`: every preset's token coefficients on one round's cached batch, side by side.

The same rollouts (the kept rows of `runs/rounds/rK/batch.parquet`, with their old and reference
logprobs, critic values and step rewards) go through each preset's `token_coefficient`, so differences
are the estimators' and aggregations' alone. Coefficients are compared after dividing each preset's
by its mean |c| (the batch-wide constants differ by preset). Reported per preset:

- `mean_abs_c`: the raw scale; `sign_agreement`: share of tokens whose c has the sign of the
  group-centred reward (tokens with a centred reward of 0 left out); `variance`: of the normalised c;
- `length_corr`: correlation between a response's summed |c| and its length;
- the effective weight of a prompt (mean summed |c| of its responses) against its success rate p(x).

A round without a critic gives the GAE presets V = 0; one without greedy rows gives ReMax the group
mean as baseline; both are stated in the report.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from rlpipe import artifacts
from rlpipe.algorithms.build import token_coefficient
from rlpipe.config import PRESETS
from rlpipe.config import AlgorithmConfig
from rlpipe.models.sequences import pad_ragged

P_BINS = (0.0, 0.25, 0.5, 0.75, 1.0)


@dataclass
class RoundTensors:
    rewards: torch.Tensor
    correct: torch.Tensor
    mask: torch.Tensor
    groups: torch.Tensor
    old: torch.Tensor
    ref: torch.Tensor
    values: torch.Tensor
    baseline: torch.Tensor
    step_ends: torch.Tensor
    step_rewards: torch.Tensor
    step_mask: torch.Tensor
    truncated: torch.Tensor
    notes: list[str]

    @property
    def lengths(self) -> torch.Tensor:
        return self.mask.sum(1)


def load_round(batch_path: Path) -> RoundTensors:
    columns = artifacts.Columns.of(artifacts.read_table(batch_path, artifacts.BATCH))
    rows = [i for i, k in enumerate(columns["kept"]) if k]
    if not rows:
        raise artifacts.ArtifactError(f"{batch_path}: no kept rows to compare")
    notes = []
    width = max(len(columns["response_ids"][i]) for i in rows)

    def padded(name: str, fallback: str | None = None) -> torch.Tensor:
        source = name if all(len(columns[name][i]) for i in rows) else fallback
        if source is None:
            return torch.zeros((len(rows), width), dtype=torch.float64)
        return pad_ragged([columns[source][i] for i in rows], 0.0, torch.float64, width=width)[0]

    if not all(len(columns["values"][i]) for i in rows):
        notes.append("this round has no critic values: the GAE presets (ppo, orz, vapo) use V = 0")
    if not all(len(columns["ref_logprobs"][i]) for i in rows):
        notes.append("this round has no reference logprobs: KL terms are 0 (reference = old policy)")
    dense = {g: k for k, g in enumerate(sorted({columns["group"][i] for i in rows}))}
    greedy = {columns["group"][i]: columns["shaped_reward"][i] for i, g in enumerate(columns["is_greedy"]) if g}
    rewards = torch.tensor([columns["shaped_reward"][i] for i in rows], dtype=torch.float64)
    groups = torch.tensor([dense[columns["group"][i]] for i in rows])
    if greedy:
        baseline = torch.tensor([greedy[columns["group"][i]] for i in rows], dtype=torch.float64)
    else:
        notes.append("this round has no greedy samples: remax uses the group mean reward as its baseline")
        sums = torch.zeros(len(dense), dtype=torch.float64).index_add_(0, groups, rewards)
        counts = torch.zeros(len(dense), dtype=torch.float64).index_add_(0, groups, torch.ones_like(rewards))
        baseline = (sums / counts)[groups]
    step_ends, step_mask = pad_ragged([columns["step_ends"][i] for i in rows], 0, torch.long)
    return RoundTensors(
        rewards=rewards, correct=torch.tensor([columns["correct"][i] for i in rows]),
        mask=pad_ragged([columns["response_ids"][i] for i in rows], 0, torch.long, width=width)[1],
        groups=groups, old=padded("old_logprobs"), ref=padded("ref_logprobs", "old_logprobs"),
        values=padded("values"), baseline=baseline, step_ends=step_ends,
        step_rewards=pad_ragged([columns["step_rewards"][i] for i in rows], 0.0, torch.float64)[0],
        step_mask=step_mask, truncated=torch.tensor([columns["finish_reason"][i] == "length" for i in rows]),
        notes=notes,
    )


def coefficients(data: RoundTensors, max_new_tokens: int) -> dict[str, torch.Tensor]:
    """Every preset's total token coefficient c (B, T) on the round's kept rows."""
    out = {}
    for preset in sorted(PRESETS):
        spec = AlgorithmConfig(preset=preset).resolve()
        out[preset] = token_coefficient(
            spec, rewards=data.rewards, response_mask=data.mask, group_index=data.groups, old_logp=data.old,
            ref_logp=data.ref, values=data.values, baseline_rewards=data.baseline, step_ends=data.step_ends,
            step_rewards=data.step_rewards, step_mask=data.step_mask, correct=data.correct,
            truncated=data.truncated, max_new_tokens=max_new_tokens,
        ).total
    return out


def group_mean(values: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    n = int(groups.max()) + 1
    sums = torch.zeros(n, dtype=values.dtype).index_add_(0, groups, values)
    counts = torch.zeros(n, dtype=values.dtype).index_add_(0, groups, torch.ones_like(values))
    return sums / counts


def summarise(preset: str, c: torch.Tensor, data: RoundTensors) -> dict:
    mask = data.mask
    scale = float(c[mask].abs().mean())
    normalised = c / scale if scale > 0 else c
    centred = (data.rewards - group_mean(data.rewards, data.groups)[data.groups]).unsqueeze(1).expand_as(c)
    signed = mask & (centred.abs() > 1e-12) & (c.abs() > 1e-12)
    agreement = float((torch.sign(c[signed]) == torch.sign(centred[signed])).double().mean()) if signed.any() else math.nan
    per_response = (normalised.abs() * mask).sum(1)
    lengths = data.lengths.double()
    corr = float(torch.corrcoef(torch.stack([per_response, lengths]))[0, 1]) if lengths.std() > 0 else math.nan
    p = group_mean(data.correct.double(), data.groups)
    weight = group_mean(per_response, data.groups)
    row = {"preset": preset, "estimator": AlgorithmConfig(preset=preset).resolve().estimator,
           "loss_agg": AlgorithmConfig(preset=preset).resolve().loss_agg, "mean_abs_c": scale,
           "sign_agreement": agreement, "variance": float(normalised[mask].var(correction=0)), "length_corr": corr}
    for lo, hi in zip(P_BINS, P_BINS[1:]):
        inside = (p >= lo) & ((p < hi) if hi < 1 else (p <= hi))
        row[f"weight_p_{lo:.2f}_{hi:.2f}"] = float(weight[inside].mean()) if inside.any() else math.nan
    return row


def write_report(rows: list[dict], data: RoundTensors, source: Path, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path, md_path = out_dir / "compare.csv", out_dir / "compare.md"
    with open(csv_path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    shown = ["preset", "estimator", "loss_agg", "mean_abs_c", "sign_agreement", "variance", "length_corr"]
    bins = [k for k in rows[0] if k.startswith("weight_p_")]
    lines = [f"# Estimators compared on {source}", "",
             f"{int(data.mask.shape[0])} kept responses in {int(data.groups.max()) + 1} groups. "
             "Coefficients are divided by each preset's mean |c| before the variance, length and weight columns.", ""]
    lines += [f"- {note}" for note in data.notes] + ([""] if data.notes else [])
    header = shown + ["w(p " + b.removeprefix("weight_p_").replace("_", "-") + ")" for b in bins]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [row[k] if isinstance(row[k], str) else f"{row[k]:.4g}" for k in shown + bins]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    md_path.write_text("\n".join(lines) + "\n")
    return [md_path, csv_path, *plot(rows, bins, out_dir)]


def plot(rows: list[dict], bins: list[str], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    centres = [(P_BINS[i] + P_BINS[i + 1]) / 2 for i in range(len(P_BINS) - 1)]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.set_prop_cycle(color=plt.cm.tab20.colors[: len(rows)])
    for row in rows:
        ax.plot(centres, [row[b] for b in bins], marker="o", label=row["preset"])
    ax.set_xlabel("prompt success rate p(x) (bin centre)")
    ax.set_ylabel("effective weight (mean summed |c| / mean |c|)")
    ax.set_title("Effective weight per prompt against p(x)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    weight_png = out_dir / "compare_weight_vs_p.png"
    fig.savefig(weight_png, dpi=100)
    plt.close(fig)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    names = [r["preset"] for r in rows]
    axes[0].barh(names, [r["length_corr"] for r in rows])
    axes[0].set_title("correlation of summed |c| with length")
    axes[1].barh(names, [r["sign_agreement"] for r in rows])
    axes[1].set_xlim(0, 1.05)
    axes[1].set_title("sign agreement with the centred reward")
    fig.tight_layout()
    bars_png = out_dir / "compare_length_sign.png"
    fig.savefig(bars_png, dpi=100)
    plt.close(fig)
    return [weight_png, bars_png]


def compare_round(batch_path: Path, out_dir: Path, max_new_tokens: int) -> tuple[list[dict], list[Path]]:
    data = load_round(batch_path)
    coefs = coefficients(data, max_new_tokens)
    rows = [summarise(preset, c, data) for preset, c in coefs.items()]
    return rows, write_report(rows, data, batch_path, out_dir)
