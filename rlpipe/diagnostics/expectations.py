"""`rlpipe check-expectations`: the seed's second table, checked on an environment where the truth is exact.

The environment: X prompts, each a softmax policy over K tokens with explicit logits; a response is one
token; a subset of tokens is correct (binary reward). Then p(x), V(x) = p(x) and the exact policy
gradient grad J = (1/X) sum_x grad p(x) come from enumeration. With one-token responses every
aggregation normaliser is 1/B, so multiplying a preset's token coefficient by B strips it.

Each preset's expected gradient is estimated by Monte Carlo, M samples per prompt, many groups per
prompt, the coefficients computed by the library's own `token_coefficient` (autograd through the
update's loss), with beta = 0. The claims checked (docs/algorithms.md, "Expected-value properties"):
reinforce, rloo, remax and orz (exact V) are unbiased; dr_grpo is scaled by (M - 1)/M; reinforce_pp
by about 1/sigma (the batch's reward std); reinforce_pp_baseline by ((M - 1)/M)/sigma_c (sigma_c: the
batch std of the group-centred rewards); grpo_r1 weighs prompt x by w(p_x), whose exact value comes
from enumerating the other M - 1 outcomes, so it is not proportional to grad J when p differs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from rlpipe.algorithms.build import token_coefficient
from rlpipe.config import PRESETS
from rlpipe.config import AlgorithmConfig

EPS = 1e-6


@dataclass
class TabularEnv:
    logits: torch.Tensor  # (X, K)
    correct: torch.Tensor  # (X, K) bool

    @classmethod
    def default(cls, prompts: int = 5, tokens: int = 6) -> "TabularEnv":
        """Prompts with success probabilities from about 0.1 to 0.85 (they must differ for grpo_r1's claim)."""
        g = torch.Generator().manual_seed(0)
        logits = torch.randn((prompts, tokens), generator=g, dtype=torch.float64) * 0.5
        correct = torch.zeros((prompts, tokens), dtype=torch.bool)
        correct[:, :2] = True
        offsets = torch.linspace(-2.0, 1.5, prompts, dtype=torch.float64)
        logits[:, :2] += offsets.unsqueeze(1)
        return cls(logits, correct)

    @property
    def probs(self) -> torch.Tensor:
        return torch.softmax(self.logits, dim=-1)

    @property
    def p(self) -> torch.Tensor:
        """(X,) success probability = V(x)."""
        return (self.probs * self.correct).sum(-1)

    def grad_p(self) -> torch.Tensor:
        """(X, K): d p(x) / d logits_x = pi (1[correct] - p), exactly."""
        return self.probs * (self.correct.double() - self.p.unsqueeze(1))

    def grad_j(self) -> torch.Tensor:
        """(X, K) exact grad of J = (1/X) sum_x p(x)."""
        return self.grad_p() / self.logits.shape[0]

    def greedy_reward(self) -> torch.Tensor:
        return self.correct.gather(1, self.probs.argmax(-1, keepdim=True)).squeeze(1).double()


def exact_group_norm_weight(p: float, m: int, ddof: int = 0) -> float:
    """w(p) = E[z | r = 1] - E[z | r = 0] for GRPO's z = (r - mean)/(std + eps) in a group of m, by
    enumerating k ~ Bin(m - 1, p) correct among the others. E[z grad log pi] = w(p) grad p."""
    total = 0.0
    for k in range(m):
        weight = math.comb(m - 1, k) * p**k * (1 - p) ** (m - 1 - k)
        for r, ones in ((1.0, k + 1), (0.0, k)):
            mean = ones / m
            var = (ones * (1 - mean) ** 2 + (m - ones) * mean**2) / (m - ddof)
            z = (r - mean) / (math.sqrt(var) + EPS)
            total += weight * (z if r == 1.0 else -z)
    return total


def asymptotic_grpo_r1_weight(p: float, m: int) -> float:
    """((M-1)/M)/sigma [1 + (1/2 - (1-2p)^2/(8 sigma^2))/M], sigma = sqrt(p(1-p)) (docs/algorithms.md)."""
    sigma = math.sqrt(p * (1 - p))
    return ((m - 1) / m) / sigma * (1 + (0.5 - (1 - 2 * p) ** 2 / (8 * sigma**2)) / m)


def sample_batch(env: TabularEnv, m: int, groups_per_prompt: int, generator: torch.Generator):
    """One big batch: groups_per_prompt groups of m one-token responses for every prompt."""
    x = torch.arange(env.logits.shape[0]).repeat_interleave(groups_per_prompt * m)
    tokens = torch.multinomial(env.probs[x], 1, generator=generator).squeeze(1)
    logp = torch.log(env.probs[x, tokens]).unsqueeze(1)
    rewards = env.correct[x, tokens].double()
    groups = torch.arange(len(x)) // m
    return x, tokens, logp, rewards, groups


@dataclass(frozen=True)
class BatchSpread:
    """The batch statistics a whitening preset divides by."""

    reward_std: float  # reinforce_pp's sigma
    centred_std: float  # reinforce_pp_baseline's sigma_c: the std of r - (its group's mean)


def mc_gradient(preset: str, env: TabularEnv, m: int, groups_per_prompt: int, seed: int) -> tuple[torch.Tensor, BatchSpread]:
    """(X, K) Monte-Carlo expected gradient of the preset with the 1/B normaliser stripped; and the
    batch's spreads."""
    g = torch.Generator().manual_seed(seed)
    x, tokens, logp, rewards, groups = sample_batch(env, m, groups_per_prompt, g)
    spec = AlgorithmConfig(preset=preset, kl_beta=0.0, kl_placement="none").resolve()
    mask = torch.ones_like(logp, dtype=torch.bool)
    c = token_coefficient(
        spec, rewards=rewards, response_mask=mask, group_index=groups, old_logp=logp, ref_logp=logp,
        values=env.p[x].unsqueeze(1), baseline_rewards=env.greedy_reward()[x],
        step_ends=torch.zeros((len(x), 1), dtype=torch.long), step_rewards=rewards.unsqueeze(1),
        step_mask=mask, correct=rewards.bool(), max_new_tokens=1,
    ).policy.squeeze(1) * len(x)
    # grad log pi(a | x) w.r.t. logits_x = e_a - pi_x; average the coefficient-weighted sum per prompt
    score = torch.nn.functional.one_hot(tokens, env.logits.shape[1]).double() - env.probs[x]
    grad = torch.zeros_like(env.logits).index_add_(0, x, c.unsqueeze(1) * score)
    per_prompt = groups_per_prompt * m
    group_means = torch.zeros(int(groups.max()) + 1, dtype=rewards.dtype).index_add_(0, groups, rewards) / m
    spread = BatchSpread(float(rewards.std(correction=0)), float((rewards - group_means[groups]).std(correction=0)))
    return grad / per_prompt / env.logits.shape[0], spread


@dataclass
class Row:
    preset: str
    bias: float  # ||g_hat - grad J|| / ||grad J||
    scale: float  # <g_hat, grad J> / ||grad J||^2
    cosine: float
    claim: str = ""
    holds: bool | None = None
    detail: dict = field(default_factory=dict)
    per_prompt: list[float] = field(default_factory=list)
    """Per prompt x, the estimate projected on grad p_x: the weight the preset gives that prompt."""


def compare(estimate: torch.Tensor, truth: torch.Tensor) -> tuple[float, float, float]:
    e, t = estimate.flatten(), truth.flatten()
    return (float((e - t).norm() / t.norm()), float(e @ t / (t @ t)),
            float(e @ t / (e.norm() * t.norm() + 1e-30)))


def check_expectations(m: int = 4, groups_per_prompt: int = 20000, seed: int = 0, tolerance: float = 0.05) -> list[Row]:
    env = TabularEnv.default()
    truth = env.grad_j()
    rows = []
    for preset in sorted(PRESETS):
        estimate, spread = mc_gradient(preset, env, m, groups_per_prompt, seed)
        sigma = spread.reward_std
        row = Row(preset, *compare(estimate, truth))
        row.per_prompt = [float(estimate[i] @ truth[i] / (truth[i] @ truth[i])) for i in range(len(truth))]
        if preset in ("reinforce", "rloo", "remax", "orz"):
            row.claim = "unbiased: scale 1, cosine 1"
            row.holds = abs(row.scale - 1) < tolerance and row.cosine > 1 - tolerance / 5
        elif preset == "dr_grpo":
            row.claim = f"scaled by (M-1)/M = {(m - 1) / m:.3f}"
            row.holds = abs(row.scale - (m - 1) / m) < tolerance and row.cosine > 1 - tolerance / 5
        elif preset == "reinforce_pp":
            row.claim = f"scaled by ~1/sigma = {1 / sigma:.3f} (batch reward std {sigma:.3f})"
            row.holds = abs(row.scale * sigma - 1) < tolerance and row.cosine > 1 - tolerance / 5
        elif preset == "reinforce_pp_baseline":
            expected = (m - 1) / m / spread.centred_std
            row.claim = (f"scaled by ((M-1)/M)/sigma_c = {expected:.3f} (std of the group-centred rewards "
                         f"{spread.centred_std:.3f})")
            row.holds = abs(row.scale / expected - 1) < tolerance and row.cosine > 1 - tolerance / 5
        elif preset == "grpo_r1":
            # the expectation for prompt x is w(p_x) grad p_x / X: project the estimate on the truth row
            exact = [exact_group_norm_weight(float(p), m) for p in env.p]
            row.detail = {"p": [round(float(p), 3) for p in env.p], "w_mc": [round(float(w), 3) for w in row.per_prompt],
                          "w_exact": [round(w, 3) for w in exact],
                          "w_asymptotic": [round(asymptotic_grpo_r1_weight(float(p), m), 3) for p in env.p]}
            spread = max(exact) / min(exact)
            row.claim = (f"weights prompt x by w(p_x) (exact, by enumeration), {min(exact):.2f}-{max(exact):.2f} "
                         f"across prompts: not proportional to grad J")
            row.holds = all(abs(a - b) / b < tolerance for a, b in zip(row.per_prompt, exact)) and spread > 1.03
        rows.append(row)
    return rows


def plot_expectations(rows: list[Row], m: int, path) -> None:
    """Left: each preset's scale against grad J (1 = unbiased). Right: the weight each preset gives a
    prompt against its success rate p(x), with grpo_r1's exact w(p) from enumeration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = [float(v) for v in TabularEnv.default().p]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    names = [r.preset for r in rows]
    colours = ["tab:green" if r.holds else ("tab:red" if r.holds is False else "tab:gray") for r in rows]
    left.barh(names, [r.scale for r in rows], color=colours)
    left.axvline(1.0, color="black", lw=0.8)
    left.axvline((m - 1) / m, color="black", lw=0.8, ls=":")
    left.set_xlabel("scale <g_hat, grad J> / |grad J|^2  (green: claim holds, grey: no claim)")
    left.set_title(f"Expected gradient against the exact grad J (M = {m})")
    order = sorted(range(len(p)), key=p.__getitem__)
    right.set_prop_cycle(color=plt.cm.tab20.colors[: len(rows)])
    for r in rows:
        right.plot([p[i] for i in order], [r.per_prompt[i] for i in order], marker="o", ms=3, lw=1, label=r.preset)
    grid = [i / 100 for i in range(2, 99)]
    right.plot(grid, [exact_group_norm_weight(x, m) for x in grid], color="black", ls="--", lw=1,
               label="grpo_r1 exact w(p)")
    right.set_xlabel("prompt success rate p(x)")
    right.set_ylabel("weight on grad p(x)")
    right.set_title("Per-prompt weight (1 = proportional to grad J)")
    right.grid(alpha=0.3)
    right.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def format_table(rows: list[Row]) -> str:
    lines = ["| preset | bias | scale | cosine | claim | holds |", "|---|---:|---:|---:|---|---|"]
    for r in rows:
        holds = "" if r.holds is None else ("yes" if r.holds else "NO")
        lines.append(f"| {r.preset} | {r.bias:.3f} | {r.scale:.3f} | {r.cosine:.4f} | {r.claim} | {holds} |")
    for r in rows:
        if r.detail:
            lines.append("")
            lines.append(f"{r.preset} per prompt: " + "; ".join(f"{k} = {v}" for k, v in r.detail.items()))
    return "\n".join(lines)
