"""PNG pictures of a run: reward, accuracy, response length and KL per round.

Drawn by `evaluate` from its per-round curve into `runs/plots/`, and logged as MLflow artifacts.
Uses matplotlib's Agg backend (no screen).
"""

from __future__ import annotations

from pathlib import Path

# (file stem, title, [(curve key, label), ...]); a series missing from the curve is left out.
PANELS = [
    ("accuracy", "Accuracy per round", [("pass@1", "test pass@1 (greedy)"), ("train_accuracy", "rollout accuracy")]),
    ("reward", "Reward per round", [("train_reward_mean", "mean shaped reward")]),
    ("response_length", "Response length per round", [("train_response_length_mean", "mean tokens")]),
    ("kl", "KL to the reference per round", [("train_kl_ref_mean", "k3 KL (update)"),
                                              ("train_approx_kl_mean", "approx KL to old")]),
]


def plot_rounds(curve: list[dict], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    fig_all, axes = plt.subplots(2, 2, figsize=(10, 7))
    for (stem, title, series), ax_all in zip(PANELS, axes.flat):
        fig, ax = plt.subplots(figsize=(5, 3.5))
        for target in (ax, ax_all):
            for key, label in series:
                points = [(p["round"], p[key]) for p in curve if key in p]
                if points:
                    xs, ys = zip(*points)
                    target.plot(xs, ys, marker="o", label=label)
            target.set_title(title)
            target.set_xlabel("round")
            target.grid(alpha=0.3)
            if target.get_lines():
                target.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / f"{stem}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    fig_all.tight_layout()
    overview = out_dir / "overview.png"
    fig_all.savefig(overview, dpi=100)
    plt.close(fig_all)
    return [overview, *written]
