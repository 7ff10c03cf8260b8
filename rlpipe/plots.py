"""PNG pictures of a run: accuracy, reward, response length and the two KLs, per round.

Drawn by `evaluate` from its per-round curve into `runs/plots/`, and logged as MLflow artifacts. One
quantity per panel, each with its y-axis label; rates on [0, 1] with a band of +-1 standard error where
the curve has one (held-out pass@1: binomial over the test prompts); lengths from 0, so that a
0.02-token wobble does not look like a swing. Every figure names its run and preset, so two runs'
pictures cannot be mistaken for each other. Uses matplotlib's Agg backend (no screen).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Panel:
    stem: str
    title: str
    ylabel: str
    series: tuple[tuple[str, str], ...]
    """(curve key, legend label); a series missing from the curve is left out."""
    rate: bool = False
    """A fraction: the axis spans [0, 1]."""
    from_zero: bool = False
    """A non-negative size: the axis starts at 0."""


PANELS = (
    Panel("accuracy", "Accuracy per round", "fraction correct",
          (("pass@1", "test pass@1 (greedy), +-1 s.e."), ("train_accuracy", "rollout accuracy (sampled)")), rate=True),
    Panel("reward", "Reward per round", "mean shaped reward", (("train_reward_mean", "rollouts"),)),
    Panel("response_length", "Response length per round", "tokens per response",
          (("train_response_length_mean", "rollout mean"),), from_zero=True),
    Panel("kl_ref", "KL to the reference per round", "k3 KL per token (nats)",
          (("train_kl_ref_mean", "update, mean over tokens"),), from_zero=True),
    Panel("kl_old", "KL to the behaviour policy per round", "approx. KL per token (nats)",
          (("train_approx_kl_mean", "update, mean over steps"),), from_zero=True),
)


def draw(ax, panel: Panel, curve: list[dict]) -> None:
    for key, label in panel.series:
        points = [p for p in curve if key in p]
        if not points:
            continue
        xs, ys = [p["round"] for p in points], [p[key] for p in points]
        line, = ax.plot(xs, ys, marker="o", markersize=3, label=label)
        errors = [p.get(f"{key}_stderr") for p in points]
        if all(e is not None for e in errors):
            ax.fill_between(xs, [y - e for y, e in zip(ys, errors)], [y + e for y, e in zip(ys, errors)],
                            color=line.get_color(), alpha=0.2, linewidth=0)
    ax.set_title(panel.title, fontsize=10)
    ax.set_xlabel("round")
    ax.set_ylabel(panel.ylabel)
    ax.grid(alpha=0.3)
    if panel.rate:
        ax.set_ylim(0, 1)
    elif panel.from_zero:
        ax.set_ylim(bottom=0, top=max(ax.get_ylim()[1], 1e-6))
    if ax.get_lines():
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "not measured in this run", ha="center", va="center", transform=ax.transAxes, alpha=0.6)


def plot_rounds(curve: list[dict], out_dir: Path, run_label: str) -> list[Path]:
    """One PNG per panel and an overview of all of them; `run_label` (run name, preset) titles each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    fig_all, axes = plt.subplots(2, 3, figsize=(14, 7))
    for panel, ax_all in zip(PANELS, axes.flat):
        fig, ax = plt.subplots(figsize=(5.5, 3.8))
        draw(ax, panel, curve)
        draw(ax_all, panel, curve)
        fig.suptitle(run_label, fontsize=9)
        fig.tight_layout()
        path = out_dir / f"{panel.stem}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    for ax in list(axes.flat)[len(PANELS):]:
        ax.axis("off")
    fig_all.suptitle(run_label)
    fig_all.tight_layout()
    overview = out_dir / "overview.png"
    fig_all.savefig(overview, dpi=100)
    plt.close(fig_all)
    return [overview, *written]
