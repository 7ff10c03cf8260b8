"""Advantage estimators of docs/algorithms.md, vectorised over the batch (GAE loops over time only).

Shapes: B responses, T padded response length, S padded step count, N groups (one group = the M
responses of one prompt). Every estimator takes an `AdvantageBatch` and `AdvantageParams` and returns
per-token advantages that are 0 at masked positions. Group statistics use scatter/index_add over the
group index; std is the population std (ddof = 0) unless `std_ddof = 1`, and every division by a std
adds eps to the denominator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlpipe.registry import Registry


@dataclass
class AdvantageBatch:
    """The tensors of one round's kept responses; only what the chosen estimator needs must be set."""

    rewards: torch.Tensor  # (B,) outcome reward r_b after shaping
    response_mask: torch.Tensor  # (B, T) bool
    group_index: torch.Tensor  # (B,) long in [0, N)
    kl: torch.Tensor | None = None  # (B, T) per-token KL estimate (in-reward KL), None = 0
    values: torch.Tensor | None = None  # (B, T) V(s_t), gae only
    baseline_rewards: torch.Tensor | None = None  # (B,) reward of the greedy sample of b's prompt (remax)
    step_ends: torch.Tensor | None = None  # (B, S) long: index of the last token of step k
    step_rewards: torch.Tensor | None = None  # (B, S)
    step_mask: torch.Tensor | None = None  # (B, S) bool

    @property
    def mask(self) -> torch.Tensor:
        return self.response_mask.to(self.rewards.dtype)

    @property
    def num_groups(self) -> int:
        return int(self.group_index.max()) + 1 if self.group_index.numel() else 0


@dataclass(frozen=True)
class AdvantageParams:
    """Plain-number hyperparameters of the estimators; every field is required (no hidden defaults)."""

    kl_beta: float  # beta of the KL folded into the reward (0 when the KL is not in the reward)
    gamma: float
    lam: float | torch.Tensor  # GAE lambda of the policy advantages: scalar or (B,) per response
    lambda_critic: float | torch.Tensor  # GAE lambda of the critic's returns (decoupled GAE): scalar or (B,)
    whiten: bool  # whiten the advantages over all valid tokens (ppo)
    std_ddof: int
    eps: float


@dataclass
class AdvantageResult:
    advantages: torch.Tensor  # (B, T), 0 at masked positions
    returns: torch.Tensor | None = None  # (B, T) critic targets (gae only)


ADVANTAGE_ESTIMATORS: Registry = Registry("advantage estimator")


# --- helpers ------------------------------------------------------------------------------------
def group_mean_std(values: torch.Tensor, group_index: torch.Tensor, num_groups: int, ddof: int):
    """Per-row mean, std and size of the row's group. values (B,) -> three (B,) tensors."""
    count = group_sum(torch.ones_like(values), group_index, num_groups)
    mean = group_sum(values, group_index, num_groups) / count.clamp(min=1)
    squares = group_sum((values - mean[group_index]) ** 2, group_index, num_groups)
    # ddof = 1 on a group of one would divide by 0; its advantage is 0 anyway (callers test count > 1)
    var = squares / (count - ddof).clamp(min=1)
    return mean[group_index], var.sqrt()[group_index], count[group_index]


def group_sum(values: torch.Tensor, group_index: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Sum of (B,) `values` per group -> (N,)."""
    return values.new_zeros(num_groups).index_add_(0, group_index, values)


def masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x on valid positions, exactly 0 elsewhere, whatever (even inf) the padding holds. x may be a
    (B, 1) column: it is broadcast, with no (B, T) temporary."""
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))


def zero_padding_(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`masked` in place, for a (B, T) buffer this module just allocated: one pass, no new tensor.
    (On these sizes every fresh (B, T) tensor costs about as much as a pass over it, in page faults.)"""
    return x.masked_fill_(~mask, 0)


def zeros(batch: AdvantageBatch) -> torch.Tensor:
    """(B, T) zeros in the rewards' dtype (without first materialising `batch.mask`)."""
    return batch.rewards.new_zeros(batch.response_mask.shape)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, ddof: int, eps: float) -> torch.Tensor:
    """(x - mean) / (std + eps) over the valid tokens of the whole batch; 0 at masked positions. (B, T)."""
    valid = x[mask]
    if valid.numel() == 0:
        return torch.zeros_like(x)
    mean = valid.mean()
    std = valid.var(correction=ddof).sqrt() if valid.numel() > ddof else valid.new_zeros(())
    return zero_padding_((x - mean).div_(std + eps), mask)


def reverse_cumsum(x: torch.Tensor) -> torch.Tensor:
    """y_t = sum_{t' >= t} x_t' along the last dim. (B, T)."""
    return x.flip(-1).cumsum_(-1).flip(-1)


def masked_kl(batch: AdvantageBatch) -> torch.Tensor:
    """(B, T) per-token KL, 0 at padding; all 0 when no KL is folded into the reward."""
    if batch.kl is None:
        return zeros(batch)
    return masked(batch.kl.to(batch.rewards.dtype), batch.response_mask)


def broadcast(per_response: torch.Tensor, batch: AdvantageBatch) -> torch.Tensor:
    """(B,) -> (B, T), the same value on every valid token."""
    return masked(per_response.unsqueeze(1), batch.response_mask)


def minus_kl_to_go(baseline_free: torch.Tensor, batch: AdvantageBatch, kl_beta: float) -> torch.Tensor:
    """(B,) c_b -> (B, T) c_b - beta sum_{t' >= t} kl_bt' on valid tokens, 0 elsewhere; built in the
    reverse-cumsum buffer, so one (B, T) tensor in all."""
    if batch.kl is None:
        return broadcast(baseline_free, batch)
    to_go = reverse_cumsum(masked_kl(batch))
    return zero_padding_(to_go.mul_(-kl_beta).add_(baseline_free.unsqueeze(1)), batch.response_mask)


def adaptive_lambda(lengths: torch.Tensor, alpha: float) -> torch.Tensor:
    """VAPO's length-adaptive lambda (Yue 2025): clamp(1 - 1 / (alpha T_b), 0, 1). lengths (B,) -> (B,)
    float64 (callers cast to their dtype)."""
    return (1 - 1 / (alpha * lengths.clamp(min=1).to(torch.float64))).clamp(0, 1)


# --- estimators ---------------------------------------------------------------------------------
@ADVANTAGE_ESTIMATORS.register("reinforce")
def reinforce(batch: AdvantageBatch, hp: AdvantageParams) -> AdvantageResult:
    """A_bt = r_b - beta sum_t' kl_bt' (Williams 1992, KL-penalised reward)."""
    total_kl = masked_kl(batch).sum(dim=1)
    return AdvantageResult(broadcast(batch.rewards - hp.kl_beta * total_kl, batch))


@ADVANTAGE_ESTIMATORS.register("reinforce_kl_to_go")
def reinforce_kl_to_go(batch: AdvantageBatch, hp: AdvantageParams) -> AdvantageResult:
    """A_bt = r_b - beta sum_{t' >= t} kl_bt' (the "KL trick": KL reward-to-go)."""
    return AdvantageResult(minus_kl_to_go(batch.rewards, batch, hp.kl_beta))


@ADVANTAGE_ESTIMATORS.register("reinforce_pp")
def reinforce_pp(batch: AdvantageBatch, hp: AdvantageParams) -> AdvantageResult:
    """REINFORCE++ (Hu 2025): the KL reward-to-go advantage, whitened over all valid tokens of the batch."""
    raw = reinforce_kl_to_go(batch, hp).advantages
    return AdvantageResult(masked_whiten(raw, batch.response_mask, hp.std_ddof, hp.eps))


@ADVANTAGE_ESTIMATORS.register("rloo")
def rloo(batch: AdvantageBatch, hp: AdvantageParams) -> AdvantageResult:
    """RLOO (Ahmadian 2024): A_b = S_b - mean of the other S in the group, S_b = r_b - beta sum_t kl_bt."""
    score = batch.rewards - hp.kl_beta * masked_kl(batch).sum(dim=1)
    n = batch.num_groups
    total = group_sum(score, batch.group_index, n)[batch.group_index]
    count = group_sum(torch.ones_like(score), batch.group_index, n)[batch.group_index]
    leave_one_out = (total - score) / (count - 1).clamp(min=1)
    advantage = torch.where(count > 1, score - leave_one_out, torch.zeros_like(score))
    return AdvantageResult(broadcast(advantage, batch))


@ADVANTAGE_ESTIMATORS.register("remax")
def remax(batch: AdvantageBatch, hp: AdvantageParams) -> AdvantageResult:
    """ReMax (Li 2023): A_bt = r_b - r(x, y_greedy) - beta sum_{t' >= t} kl_bt'."""
    if batch.baseline_rewards is None:
        raise ValueError("remax needs baseline_rewards: the reward of each prompt's greedy sample")
    centred = batch.rewards - batch.baseline_rewards.to(batch.rewards.dtype)
    return AdvantageResult(minus_kl_to_go(centred, batch, hp.kl_beta))


def _gae(deltas: torch.Tensor, decay: torch.Tensor) -> torch.Tensor:
    """A_t = sum_{t' >= t} decay^(t' - t) delta_t', one backward pass over time (the only loop allowed:
    the recursion is sequential in t). deltas (B, T), decay (B, 1) = gamma * lambda per response."""
    # Time-major copies, so that each step reads and writes one contiguous row of B values (a column
    # of the (B, T) layout is strided by T: about 10x slower), and addcmul writes in place.
    by_time = deltas.t().contiguous()
    out = torch.empty_like(by_time)
    factor = decay.reshape(-1).expand(deltas.shape[0]).contiguous()
    steps = by_time.shape[0]
    if steps:
        out[steps - 1] = by_time[steps - 1]
    for t in range(steps - 2, -1, -1):
        torch.addcmul(by_time[t], factor, out[t + 1], out=out[t])
    return out.t().contiguous()


def _per_response(value: float | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A scalar or (B,) hyperparameter as a (B, 1) column on `like`'s device and dtype."""
    column = torch.as_tensor(value, dtype=like.dtype, device=like.device).reshape(-1, 1)
    return column.expand(like.shape[0], 1)


@ADVANTAGE_ESTIMATORS.register("gae")
def gae(batch: AdvantageBatch, hp: AdvantageParams) -> AdvantageResult:
    """GAE (Schulman 2016) with a per-response lambda and a separate lambda for the critic target.

    delta_t = 1[t = T_b - 1] r_b - beta kl_t + gamma V_{t+1} - V_t, with V_{T_b} = 0;
    A = GAE(lam), returns = GAE(lambda_critic) + V (decoupled GAE, VAPO, Yue 2025). The valid tokens
    of a row are a prefix (a response starts at t = 0), so T_b = the row's mask count.
    """
    if batch.values is None:
        raise ValueError("gae needs values: the critic's V(s_t) on the batch")
    valid, rewards = batch.response_mask, batch.rewards
    values = masked(batch.values.to(rewards.dtype), valid)
    # deltas, in one buffer: gamma V_{t+1} - V_t - beta kl_t, plus r_b on the last valid token
    deltas = torch.empty_like(values)
    deltas[:, :-1] = values[:, 1:]
    deltas[:, -1:] = 0  # V_{T_b} = 0: beyond a row's last token, values are already masked to 0
    deltas.mul_(hp.gamma).sub_(values)
    if batch.kl is not None:
        deltas.sub_(batch.kl.to(rewards.dtype), alpha=hp.kl_beta)
    rows = torch.arange(len(rewards), device=rewards.device)
    last = (valid.sum(dim=1) - 1).clamp(min=0)
    deltas.index_put_((rows, last), rewards, accumulate=True)  # an empty row's slot is zeroed next
    # exactly 0 on padding (whatever inf the kl held there), so the recursion below leaves 0 there too
    zero_padding_(deltas, valid)
    lam, critic_lam = _per_response(hp.lam, values), _per_response(hp.lambda_critic, values)
    advantages = _gae(deltas, hp.gamma * lam)
    same_lambda = torch.equal(critic_lam, lam)  # the common case: one pass serves both
    critic_advantages = advantages if same_lambda else _gae(deltas, hp.gamma * critic_lam)
    return AdvantageResult(advantages, critic_advantages + values)


@ADVANTAGE_ESTIMATORS.register("group_norm")
def group_norm(batch: AdvantageBatch, hp: AdvantageParams) -> AdvantageResult:
    """GRPO (Shao 2024): (r_b - mean(R_g)) / (std(R_g) + eps); a group of one gets 0."""
    mean, std, count = group_mean_std(batch.rewards, batch.group_index, batch.num_groups, hp.std_ddof)
    advantage = torch.where(count > 1, (batch.rewards - mean) / (std + hp.eps), torch.zeros_like(mean))
    return AdvantageResult(broadcast(advantage, batch))


@ADVANTAGE_ESTIMATORS.register("group_mean")
def group_mean(batch: AdvantageBatch, hp: AdvantageParams) -> AdvantageResult:
    """Dr. GRPO (Liu 2025): r_b - mean(R_g), no std."""
    mean, _, count = group_mean_std(batch.rewards, batch.group_index, batch.num_groups, hp.std_ddof)
    advantage = torch.where(count > 1, batch.rewards - mean, torch.zeros_like(mean))
    return AdvantageResult(broadcast(advantage, batch))


@ADVANTAGE_ESTIMATORS.register("group_process")
def group_process(batch: AdvantageBatch, hp: AdvantageParams) -> AdvantageResult:
    """GRPO with process supervision (Shao 2024, 4.1.3): the step rewards of a group's responses are
    pooled and normalised by their mean/std; A_t = sum of the normalised rewards of the steps ending at
    or after t."""
    if batch.step_ends is None or batch.step_rewards is None:
        raise ValueError("group_process needs step_ends and step_rewards")
    step_mask = batch.step_mask.bool() if batch.step_mask is not None else torch.ones_like(batch.step_ends).bool()
    rho = batch.step_rewards.to(batch.rewards.dtype)
    step_group = batch.group_index.unsqueeze(1).expand_as(batch.step_ends)[step_mask]
    pooled = rho[step_mask]
    mean, std, _ = group_mean_std(pooled, step_group, batch.num_groups, hp.std_ddof)
    normalised = torch.zeros_like(rho)
    normalised[step_mask] = (pooled - mean) / (std + hp.eps)
    # padded steps add 0 wherever their (garbage) end points; the clamp only keeps the index in range
    ends = batch.step_ends.clamp(0, batch.response_mask.shape[1] - 1)
    at_step_end = zeros(batch).scatter_add_(1, ends, normalised)
    return AdvantageResult(zero_padding_(reverse_cumsum(at_step_end), batch.response_mask))


def compute_advantages(name: str, batch: AdvantageBatch, hp: AdvantageParams) -> AdvantageResult:
    """The named estimator, then whitening of the advantages when asked (returns stay unwhitened)."""
    result = ADVANTAGE_ESTIMATORS.get(name)(batch, hp)
    if hp.whiten:
        result = AdvantageResult(masked_whiten(result.advantages, batch.response_mask, hp.std_ddof, hp.eps),
                                 result.returns)
    return result
