"""The report of a preset sweep (`rlpipe.sweep`): tables with 95% intervals over seeds, and plots.

It reads `runs/*.json` of a sweep directory and writes `report.md`, `pass_at_1.png`, `lengths.png` and
`difficulty.png` beside them. Partial sweeps are reported as they are: every row says how many seeds
it has, and a preset with one seed has no interval.

Intervals are Student-t intervals of the mean over seeds (n = 3 gives mean +- 4.30 s / sqrt(3)). A
difference between two presets is taken seed by seed: the same seed gives both the same data, warm start
and test prompts, so the pairing removes what the seed does to both (`paired_difference`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from rlpipe.atomic import atomic_write_text

DEFAULT_TARGET = 0.65
"""pass@1 for the rounds-to-target column: above every preset's first round on the reasoning task
(grpo: 0.56 after round 1) and below where they end (0.70-0.74), so that it separates fast from slow."""

# -- statistics -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Estimate:
    mean: float
    half_width: float | None
    """Of the 95% interval; None with fewer than 2 values."""
    n: int

    def __str__(self) -> str:
        if self.n == 0:
            return "-"
        return f"{self.mean:.3f}" + (f" ± {self.half_width:.3f}" if self.half_width is not None else "")

    def signed(self, scale: float = 1.0, digits: int = 3) -> str:
        if self.n == 0:
            return "-"
        text = f"{self.mean * scale:+.{digits}f}"
        return text + (f" ± {self.half_width * scale:.{digits}f}" if self.half_width is not None else "")

    @property
    def excludes_zero(self) -> bool:
        return self.half_width is not None and abs(self.mean) > self.half_width


def estimate(values: list[float]) -> Estimate:
    """Mean and the half-width of its 95% Student-t interval."""
    # MLflow stores an infinite metric as +-1.797e308; either way it is no measurement
    values = [v for v in values if v is not None and math.isfinite(v) and abs(v) < 1e308]
    n = len(values)
    if n == 0:
        return Estimate(float("nan"), None, 0)
    mean = sum(values) / n
    if n < 2:
        return Estimate(mean, None, n)
    from scipy.stats import t

    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    return Estimate(mean, float(t.ppf(0.975, n - 1)) * sd / math.sqrt(n), n)


def paired_difference(a: dict[int, float | None], b: dict[int, float | None]) -> Estimate:
    """Mean of a - b over the seeds both have, with its 95% interval."""
    return estimate([a[s] - b[s] for s in sorted(a.keys() & b.keys()) if a[s] is not None and b[s] is not None])


# -- what a run record holds ----------------------------------------------------------------------

@dataclass
class RunRecord:
    preset: str
    """The run's entry: a preset, or a preset with its own overrides (`vapo+value.pretrain.max_steps=0`)."""
    seed: int
    raw: dict

    @property
    def eval(self) -> dict:
        return self.raw["eval"]

    @property
    def curve(self) -> list[dict]:
        return sorted(self.eval["curve"], key=lambda p: p["round"])

    @property
    def rounds(self) -> int:
        return max(p["round"] for p in self.curve)

    def stage(self, stage: str, round_index: int | None = None) -> dict:
        round_name = "" if round_index is None else f"r{round_index}"
        # MLflow names a round's stage run `reward@r1`; its rlpipe.round tag says `r1`
        return next((s["metrics"] for s in self.raw["stages"]
                     if s["stage"].partition("@")[0] == stage and s["round"] == round_name), {})

    def per_round(self, stage: str, key: str) -> list[float | None]:
        """The metric of rounds 1..N (None where the stage did not log it)."""
        return [self.stage(stage, k).get(key) for k in range(1, self.rounds + 1)]

    def rounds_to(self, target: float) -> int | None:
        return next((p["round"] for p in self.curve if p["pass@1"] >= target), None)


def load_records(out: Path) -> list[RunRecord]:
    records = []
    for path in sorted((out / "runs").glob("*.json")):
        raw = json.loads(path.read_text())
        records.append(RunRecord(raw.get("label", raw["preset"]), raw["seed"], raw))
    return records


def pretraining_metrics(record: RunRecord, records: list[RunRecord]) -> dict:
    """The value pretraining a run's critic started from: its own where it logged one (the first critic
    preset of its seed, or an entry with value overrides), else the one its seed's first critic preset
    logged (the others restored it from the run cache). Critic-free presets log only `value/critic: 0`."""
    def trained(r: RunRecord) -> dict:
        return m if "value/explained_variance" in (m := r.stage("value_pretrain")) else {}

    return trained(record) or next((m for r in records if r.seed == record.seed and (m := trained(r))), {})


# -- the seed's claims, as paired contrasts ------------------------------------------------------

def last_round(record: RunRecord, stage: str, key: str) -> float | None:
    return record.stage(stage, record.rounds).get(key)


def bucket_gain(record: RunRecord, predicate) -> float | None:
    """Mean gain of held-out greedy pass@1 (last round - init) over the difficulty buckets `predicate` picks."""
    gains = [b["pass@1"] - b["pass@1_init"] for name, b in record.eval.get("by_difficulty", {}).items() if predicate(name)]
    return sum(gains) / len(gains) if gains else None


def operands(bucket: str) -> int:
    return int(bucket.split("-")[0][1:])


def mean_over_rounds(record: RunRecord, stage: str, key: str) -> float | None:
    values = [v for v in record.per_round(stage, key) if v is not None]
    return sum(values) / len(values) if values else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def difference(a: float | None, b: float | None) -> float | None:
    return a - b if a is not None and b is not None else None


NO_PRETRAINING = "vapo+value.pretrain.max_steps=0"
"""The sweep entry of VAPO without value pretraining (its critic starts from the init policy's weights)."""


@dataclass(frozen=True)
class Contrast:
    """One claim of the seed as a difference between two presets, seed by seed."""
    claim: str
    treated: str
    reference: str
    measure: str
    """What is compared, in words (the report's column)."""
    value: object
    """RunRecord -> float | None."""
    predicted: int
    """The sign the claim predicts for treated - reference."""
    scale: float = 1.0
    """For display: 100 shows a rate in points."""


CONTRASTS = (
    Contrast("GRPO's 1/T prefers short correct answers", "grpo", "dr_grpo",
             "length of correct responses, last round (tokens)",
             lambda r: last_round(r, "reward", "reward/length_correct_mean"), -1),
    Contrast("GRPO's 1/T prefers short correct answers", "grpo", "dr_grpo",
             "length of correct responses, mean over rounds (tokens)",
             lambda r: mean_over_rounds(r, "reward", "reward/length_correct_mean"), -1),
    Contrast("DAPO's 1/T-hat favours prompts whose answers are short on average", "dapo", "dr_grpo",
             "gain on 2-operand prompts minus gain on 5-operand prompts (points)",
             lambda r: difference(bucket_gain(r, lambda b: operands(b) == 2), bucket_gain(r, lambda b: operands(b) == 5)),
             +1, 100),
    Contrast("1/sqrt(p(1-p)) weights hard prompts up (GRPO against Dr.GRPO)", "grpo", "dr_grpo",
             "gain on carry prompts of 4-5 operands (points)",
             lambda r: bucket_gain(r, lambda b: operands(b) >= 4 and b.endswith("-carry")), +1, 100),
    # both estimate grad J without bias, so E|g|^2 = |grad J|^2 + tr Cov(g) differs by the variance alone
    Contrast("REINFORCE without a baseline has high variance (against RLOO)", "reinforce", "rloo",
             "gradient norm before clipping, mean over rounds", lambda r: mean_over_rounds(r, "update", "update/grad_norm_mean"), +1),
    Contrast("PPO's advantage is biased by a poor critic; ORZ's lambda = gamma = 1 removes it", "orz", "ppo",
             "final pass@1 (points)", lambda r: r.eval["pass@1"], +1, 100),
    Contrast("REINFORCE++ adapts its step size (its gradient shrinks as rewards saturate)", "reinforce_pp", "grpo",
             "grad norm, last round / round 1",
             lambda r: ratio(last_round(r, "update", "update/grad_norm_mean"),
                             r.stage("update", 1).get("update/grad_norm_mean")), -1),
    Contrast("Dr.GRPO adapts its step size (its gradient shrinks as rewards saturate)", "dr_grpo", "grpo",
             "grad norm, last round / round 1",
             lambda r: ratio(last_round(r, "update", "update/grad_norm_mean"),
                             r.stage("update", 1).get("update/grad_norm_mean")), -1),
    Contrast("VAPO needs a pretrained critic for token-level credit", "vapo", NO_PRETRAINING,
             "critic EV on round 1's batch", lambda r: r.stage("update", 1).get("value/explained_variance"), +1),
    Contrast("VAPO needs a pretrained critic for token-level credit", "vapo", NO_PRETRAINING,
             "final pass@1 (points)", lambda r: r.eval["pass@1"], +1, 100),
)


def verdict(difference: Estimate, predicted: int) -> str:
    """What the interval says; whether that tests the claim is the reader's call (README, "What the seed
    predicts, and what training shows")."""
    if difference.n < 2:
        return "too few seeds"
    if not difference.excludes_zero:
        return "includes 0"
    return "excludes 0, as predicted" if (difference.mean > 0) == (predicted > 0) else "excludes 0, opposite"


def contrasts_table(records: list[RunRecord]) -> list[str]:
    runs = {(r.preset, r.seed): r for r in records}
    lines = ["| claim | treated - reference | measure | predicted | treated | reference | paired difference "
             "(95% CI) | seeds | the interval |", "|---|---|---|---|---|---|---|---|---|"]
    for c in CONTRASTS:
        treated = {s: c.value(r) for (p, s), r in runs.items() if p == c.treated}
        reference = {s: c.value(r) for (p, s), r in runs.items() if p == c.reference}
        if not treated or not reference:
            continue
        difference = paired_difference(treated, reference)
        digits = 1 if c.scale != 1 else 3
        mean = lambda values: estimate(list(values.values())).mean * c.scale
        lines.append(f"| {c.claim} | {c.treated} - {c.reference} | {c.measure} | {'+' if c.predicted > 0 else '-'} | "
                     f"{mean(treated):.{digits}f} | {mean(reference):.{digits}f} | "
                     f"{difference.signed(c.scale, digits)} | {difference.n} | {verdict(difference, c.predicted)} |")
    return lines if len(lines) > 2 else []


# -- the report -----------------------------------------------------------------------------------

def by_preset(records: list[RunRecord]) -> dict[str, list[RunRecord]]:
    groups: dict[str, list[RunRecord]] = {}
    for record in records:
        groups.setdefault(record.preset, []).append(record)
    return groups


def _f(value: float | None, digits: int = 1) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def headline_table(groups: dict[str, list[RunRecord]], target: float) -> list[str]:
    # the seeds' warm starts differ more than the presets do: paired with the first preset, seed by seed
    first_preset = next(iter(groups), "")
    reference = {r.seed: r.eval["pass@1"] for r in groups.get(first_preset, [])}
    lines = [f"| preset | seeds | pass@1 init | pass@1 final (95% CI) | final - {first_preset}'s, paired (points) | gain | "
             f"pass@k final | rounds to {target} (per seed) | length correct / incorrect, round 1 | the same, last round |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for preset, runs in groups.items():
        paired = paired_difference({r.seed: r.eval["pass@1"] for r in runs}, reference)
        reached = [r.rounds_to(target) for r in sorted(runs, key=lambda r: r.seed)]
        first = [estimate([r.stage("reward", 1).get(f"reward/length_{k}_mean") for r in runs]) for k in ("correct", "incorrect")]
        last = [estimate([r.stage("reward", r.rounds).get(f"reward/length_{k}_mean") for r in runs])
                for k in ("correct", "incorrect")]
        lines.append(
            f"| {preset} | {len(runs)} | {estimate([r.eval['pass@1_init'] for r in runs]).mean:.3f} | "
            f"{estimate([r.eval['pass@1'] for r in runs])} | "
            f"{'-' if preset == first_preset else paired.signed(100, 1)} | "
            f"{estimate([r.eval['pass@1'] - r.eval['pass@1_init'] for r in runs]).signed()} | "
            f"{estimate([r.eval['pass@k'] for r in runs])} | "
            f"{', '.join('never' if k is None else str(k) for k in reached)} | "
            f"{_f(first[0].mean)} / {_f(first[1].mean)} | {_f(last[0].mean)} / {_f(last[1].mean)} |")
    return lines


def lengths_table(groups: dict[str, list[RunRecord]]) -> list[str]:
    rounds = max(r.rounds for runs in groups.values() for r in runs)
    lines = ["| preset | " + " | ".join(f"r{k}" for k in range(1, rounds + 1)) + " |",
             "|---|" + "---|" * rounds]
    for preset, runs in groups.items():
        cells = []
        for k in range(rounds):
            correct = estimate([r.per_round("reward", "reward/length_correct_mean")[k] for r in runs if k < r.rounds])
            wrong = estimate([r.per_round("reward", "reward/length_incorrect_mean")[k] for r in runs if k < r.rounds])
            cells.append(f"{_f(correct.mean)} / {_f(wrong.mean)}")
        lines.append(f"| {preset} | " + " | ".join(cells) + " |")
    return lines


def buckets_of(groups: dict[str, list[RunRecord]]) -> list[str]:
    buckets = {b for runs in groups.values() for r in runs for b in r.eval.get("by_difficulty", {})}

    def order(bucket: str) -> tuple:  # "n4-carry": by operand count, then by name
        count, _, kind = bucket.partition("-")
        return (int(count[1:]) if count[1:].isdigit() else 0, kind)

    return sorted(buckets, key=order)


def bucket_estimate(runs: list[RunRecord], bucket: str, key: str = "pass@1") -> Estimate:
    """A difficulty bucket's held-out greedy pass@1 (`pass@1_init`: the init policy's) over the runs."""
    return estimate([r.eval["by_difficulty"][bucket][key] for r in runs if bucket in r.eval.get("by_difficulty", {})])


def difficulty_table(groups: dict[str, list[RunRecord]]) -> list[str]:
    buckets = buckets_of(groups)
    if not buckets:
        return []
    runs0 = next(iter(groups.values()))
    init = [bucket_estimate(runs0, b, "pass@1_init") for b in buckets]
    lines = ["| preset | " + " | ".join(buckets) + " |", "|---|" + "---|" * len(buckets),
             "| (init) | " + " | ".join(f"{e.mean:.2f}" for e in init) + " |"]
    for preset, runs in groups.items():
        cells = [bucket_estimate(runs, b) for b in buckets]
        lines.append(f"| {preset} | " + " | ".join(
            f"{e.mean:.2f}" + (f" ± {e.half_width:.2f}" if e.half_width is not None else "") for e in cells) + " |")
    return lines


def critic_table(groups: dict[str, list[RunRecord]], records: list[RunRecord]) -> list[str]:
    critics = {p: runs for p, runs in groups.items() if any(r.stage("update", 1).get("value/explained_variance")
                                                           is not None for r in runs)}
    if not critics:
        return []
    rounds = max(r.rounds for runs in critics.values() for r in runs)
    lines = ["Each cell: the critic's EV on the round's batch (update, the critic of the round before) / the "
             "ceiling, the oracle's EV on the probed responses / the critic's EV on those responses as a fraction "
             "of the ceiling (advantage); after pretraining, the same on its held-out responses. Means over seeds.", "",
             "| preset | after pretraining | " + " | ".join(f"r{k}" for k in range(1, rounds + 1)) + " |",
             "|---|---|" + "---|" * rounds]
    for preset, runs in critics.items():
        pre = [pretraining_metrics(r, records) for r in runs]
        pretrained = " / ".join(_f(estimate([m.get(key) for m in pre]).mean, 2) for key in (
            "value/explained_variance", "value/oracle_explained_variance", "value/ev_fraction_of_ceiling"))
        cells = []
        for k in range(1, rounds + 1):
            ev = estimate([r.stage("update", k).get("value/explained_variance") for r in runs])
            ceiling, frac = (estimate([r.stage("advantage", k).get(key) for r in runs])
                             for key in ("value/oracle_explained_variance", "value/ev_fraction_of_ceiling"))
            cells.append(f"{_f(ev.mean, 2)} / {_f(ceiling.mean, 2)} / {_f(frac.mean, 2)}")
        lines.append(f"| {preset} | {pretrained} | " + " | ".join(cells) + " |")
    return lines


def batches_table(groups: dict[str, list[RunRecord]]) -> list[str]:
    """What the update saw: the sampled responses' accuracy and reward std, and the gradient norm, in the
    first and the last round (means over seeds)."""
    lines = ["| preset | accuracy r1 / last | reward std r1 / last | grad norm r1 / last |", "|---|---|---|---|"]
    for preset, runs in groups.items():
        cells = []
        for stage, key in (("reward", "reward/accuracy"), ("reward", "reward/std"), ("update", "update/grad_norm_mean")):
            first = estimate([r.stage(stage, 1).get(key) for r in runs]).mean
            last = estimate([last_round(r, stage, key) for r in runs]).mean
            cells.append(f"{_f(first, 3)} / {_f(last, 3)}")
        lines.append(f"| {preset} | " + " | ".join(cells) + " |")
    return lines


def write_report(out: Path, target: float = DEFAULT_TARGET) -> Path:
    records = load_records(out)
    spec = json.loads((out / "sweep.json").read_text()) if (out / "sweep.json").exists() else {}
    groups = by_preset(sorted(records, key=lambda r: (spec.get("presets", []).index(r.preset)
                                                      if r.preset in spec.get("presets", []) else 99, r.seed)))
    planned = len(spec.get("presets", [])) * len(spec.get("seeds", []))
    lines = [f"# Preset sweep: {spec.get('params_file', '?')}", "",
             f"{len(records)} of {planned or '?'} runs recorded; code {spec.get('code_commit', '?')}; "
             f"overrides {' '.join(spec.get('overrides', [])) or 'none'}. Intervals are 95% Student-t over seeds.", ""]
    if records:
        lines += ["## Held-out pass@1 (greedy), and lengths of the round's sampled responses", "",
                  *headline_table(groups, target), "",
                  "## Mean length of correct / incorrect sampled responses per round (training samples)", "",
                  *lengths_table(groups), ""]
        if table := difficulty_table(groups):
            lines += ["## Held-out greedy pass@1 by difficulty after the last round (95% CI over seeds)", "", *table, ""]
        if table := critic_table(groups, records):
            lines += ["## The critic", "", *table, ""]
        lines += ["## The training batches", "", *batches_table(groups), ""]
        if table := contrasts_table(records):
            lines += ["## The seed's claims as paired contrasts", "",
                      "Each difference is treated - reference seed by seed (the same data, warm start and test "
                      "prompts), with its 95% interval; the last column says whether the interval excludes 0, and "
                      "on which side.", "", *table, ""]
        pictures = plot_sweep(groups, out)
        lines += [f"![{p.stem}]({p.name})" for p in pictures]
    path = out / "report.md"
    atomic_write_text(path, "\n".join(lines) + "\n")
    return path


# -- plots ----------------------------------------------------------------------------------------

def plot_sweep(groups: dict[str, list[RunRecord]], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pictures = []

    def band(ax, xs, estimates, label):
        means = [e.mean for e in estimates]
        line, = ax.plot(xs, means, marker="o", markersize=3, label=label)
        if all(e.half_width is not None for e in estimates):
            ax.fill_between(xs, [e.mean - e.half_width for e in estimates], [e.mean + e.half_width for e in estimates],
                            color=line.get_color(), alpha=0.12)

    # pass@1 per round; the seeds' warm starts differ by more than the presets do, so the gain over each
    # seed's own init policy (right) is what separates presets
    fig, axes = plt.subplots(1, 2, figsize=(12.5, 4.2))
    for preset, runs in groups.items():
        rounds = min(r.rounds for r in runs)
        xs = list(range(rounds + 1))
        band(axes[0], xs, [estimate([r.curve[k]["pass@1"] for r in runs]) for k in xs], f"{preset} (n={len(runs)})")
        band(axes[1], xs, [estimate([r.curve[k]["pass@1"] - r.curve[0]["pass@1"] for r in runs]) for k in xs],
             f"{preset} (n={len(runs)})")
    axes[0].set(xlabel="round", ylabel="held-out pass@1 (greedy)", title="pass@1, mean and 95% CI over seeds")
    axes[1].set(xlabel="round", ylabel="pass@1 - the seed's init pass@1",
                title="gain over the init policy, mean and 95% CI over seeds")
    axes[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    pictures.append(_save(fig, out / "pass_at_1.png"))

    # lengths of correct and incorrect responses per round
    fig, axes = plt.subplots(1, 2, figsize=(12.5, 4.2), sharey=True)
    for ax, kind in zip(axes, ("correct", "incorrect")):
        for preset, runs in groups.items():
            rounds = min(r.rounds for r in runs)
            band(ax, list(range(1, rounds + 1)),
                 [estimate([r.per_round("reward", f"reward/length_{kind}_mean")[k] for r in runs]) for k in range(rounds)],
                 preset)
        ax.set(xlabel="round", ylabel=f"mean length of {kind} responses (tokens)",
               title=f"{kind} sampled responses, mean and 95% CI over seeds")
    axes[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    pictures.append(_save(fig, out / "lengths.png"))

    # accuracy by difficulty after the last round
    buckets = buckets_of(groups)
    if buckets:
        fig, ax = plt.subplots(figsize=(max(8.5, 1.3 * len(buckets)), 4.5))
        width = 0.8 / max(len(groups), 1)
        for i, (preset, runs) in enumerate(groups.items()):
            cells = [bucket_estimate(runs, b) for b in buckets]
            ax.bar([j + (i - (len(groups) - 1) / 2) * width for j in range(len(buckets))], [e.mean for e in cells],
                   width, yerr=[e.half_width or 0 for e in cells], capsize=2, label=preset)
        runs0 = next(iter(groups.values()))
        ax.scatter(range(len(buckets)), [bucket_estimate(runs0, b, "pass@1_init").mean for b in buckets],
                   marker="_", s=900, color="black", zorder=3, label="init policy")
        ax.set_xticks(range(len(buckets)), buckets, rotation=30, fontsize=8)
        # a t interval of 3 seeds can pass 0 or 1; the axis stays on the rate's range
        ax.set(xlabel="difficulty bucket (operands, carry)", ylabel="held-out pass@1 (greedy), last round",
               title="accuracy by difficulty, mean and 95% CI over seeds", ylim=(0, 1.02))
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
        pictures.append(_save(fig, out / "difficulty.png"))
    return pictures


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    tmp.replace(path)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
