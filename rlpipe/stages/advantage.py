"""advantage@rK: from scored rollouts to the round's training batch.

In order: reward shaping (overlong penalty, when the algorithm asks for it), dynamic sampling (drop
groups that carry no signal, keep at most `prompts_per_round`), old logprobs (behaviour logprobs, or a
trainer recompute when the rollout engine differs), reference logprobs (when a KL term is used),
critic values (GAE presets), then the algorithm's advantage estimator on the kept rows, and, with
`value.oracle_ev`, the critic's ceiling on them (rlpipe.rollout.oracle).
ReMax's greedy rows give their group's baseline reward and are not kept.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

from rlpipe import artifacts, paths
from rlpipe.config import Params, ResolvedAlgorithm


@dataclass
class GroupSelection:
    kept_rows: list[int]
    """Sampled rows of the kept groups, in artifact order."""
    generated: int
    dropped: int
    kept: int


def select_groups(spec: ResolvedAlgorithm, columns: artifacts.Columns, shaped: list[float], target: int) -> GroupSelection:
    """Dynamic sampling: groups whose outcomes are all equal carry no signal and are dropped; at most
    `target` groups are kept (the first ones, in rollout order). Without it every group is kept."""
    import torch

    from rlpipe.algorithms.build import zero_variance_groups

    sampled = [i for i, greedy in enumerate(columns["is_greedy"]) if not greedy]
    groups = [columns["group"][i] for i in sampled]
    generated = len(set(groups))
    if not spec.dynamic_sampling:
        return GroupSelection(sampled, generated, 0, generated)
    signal = [float(columns["correct"][i]) for i in sampled] if spec.dynamic_sampling_metric == "correct" \
        else [shaped[i] for i in sampled]
    flat = zero_variance_groups(torch.tensor(signal, dtype=torch.float64), torch.tensor(groups))
    informative = sorted({g for g, no_signal in zip(groups, flat.tolist()) if not no_signal})
    kept_groups = set(informative[:target])
    kept_rows = [i for i, g in zip(sampled, groups) if g in kept_groups]
    return GroupSelection(kept_rows, generated, generated - len(informative), len(kept_groups))


def advantage(ctx) -> dict:
    ctx.init_torch()
    name, prev = ctx.round_name, ctx.prev_round
    return build_batch(ctx.params, name, paths.rewards_path(name), paths.policy_dir(prev), paths.policy_dir("r0"),
                       paths.critic_dir(prev), paths.batch_path(name), ctx.models)


def needs_old_recompute(params: Params) -> bool:
    mode = params.rollout.recompute_old_logprobs
    return mode == "always" or (mode == "auto" and params.rollout.backend != "hf")


def build_batch(params: Params, round_name: str, rewards_path: Path, policy_path: Path, ref_path: Path,
                critic_path: Path, out_path: Path, models=None) -> dict:
    from rlpipe.models.policy import check_compatible
    from rlpipe.models.store import ModelStore

    models = models or ModelStore()
    spec, cfg = params.algorithm.resolve(), params.rollout
    table = artifacts.read_round_table(rewards_path, artifacts.REWARDS, cfg.samples_per_prompt, int(spec.greedy_baseline))
    check_compatible({"policy": policy_path, **({"reference": ref_path} if spec.needs_reference else {}),
                      **({"critic": critic_path} if spec.needs_critic else {})})
    columns = artifacts.Columns.of(table)
    penalty = columns["overlong_penalty"] if spec.overlong_shaping else [0.0] * len(columns)
    shaped = [r + p for r, p in zip(columns["reward"], penalty)]
    selection = select_groups(spec, columns, shaped, cfg.prompts_per_round)
    metrics = {"dynamic_sampling/generated": selection.generated, "dynamic_sampling/dropped": selection.dropped,
               "dynamic_sampling/kept": selection.kept}
    if selection.kept < cfg.prompts_per_round and spec.dynamic_sampling:
        warnings.warn(f"{round_name}: only {selection.kept} of {cfg.prompts_per_round} groups carry signal "
                      f"({selection.dropped} dropped); training on those. Raise rollout.oversample to keep more.")

    n = len(columns)
    old = [list(lp) for lp in columns["behaviour_logprobs"]]
    empty: list[list[float]] = [[] for _ in range(n)]
    out = {**columns.data, "kept": [False] * n, "shaped_reward": shaped, "old_logprobs": old,
           "ref_logprobs": empty, "values": empty, "advantages": [[0.0] * len(r) for r in old], "returns": empty}
    if selection.kept_rows:
        token_inputs = KeptRows(params, columns, selection.kept_rows, models)
        metrics.update(token_inputs.logprobs_and_values(policy_path, ref_path, critic_path))
        metrics.update(token_inputs.advantages(shaped, out))
        if spec.needs_critic and params.value.oracle_ev.continuations:
            metrics.update(token_inputs.oracle(policy_path, round_name))
    else:
        warnings.warn(f"{round_name}: no group carries signal; the update of this round will be skipped")
    artifacts.write_table(out_path, out, artifacts.BATCH)
    return metrics


class KeptRows:
    """The kept rows of a round as padded (B, T) tensors: their old, reference and critic values, then
    their advantages, written back into the batch's columns."""

    def __init__(self, params: Params, columns: artifacts.Columns, rows: list[int], models):
        import torch

        from rlpipe.models.sequences import pad_ragged

        self.params, self.columns, self.rows, self.models = params, columns, rows, models
        self.spec = params.algorithm.resolve()
        self.prompt_ids = [columns["prompt_ids"][i] for i in rows]
        self.response_ids = [columns["response_ids"][i] for i in rows]
        self.width = max(len(r) for r in self.response_ids)
        self.mask = pad_ragged(self.response_ids, 0, torch.long, width=self.width)[1]
        self.old_logp = pad_ragged([columns["behaviour_logprobs"][i] for i in rows], 0.0, torch.float32, width=self.width)[0]
        self.ref_logp = self.values = self.returns = None

    def logprobs_and_values(self, policy_path: Path, ref_path: Path, critic_path: Path) -> dict:
        """pi_old (recomputed by the trainer for another engine), pi_ref (for a KL term), V (for GAE)."""
        metrics = {}
        logprobs = RoundLogprobs(self.params, self.prompt_ids, self.response_ids, self.width, self.models)
        recompute = needs_old_recompute(self.params)
        if recompute:
            recomputed = logprobs.of(policy_path)
            drift = (recomputed - self.old_logp).abs()[self.mask]
            metrics.update({"logprob_drift/mean": drift.mean().item(), "logprob_drift/max": drift.max().item()})
            self.old_logp = recomputed
        if self.spec.needs_reference:
            same = Path(ref_path).resolve() == Path(policy_path).resolve()
            # pi_old stands in for pi_ref (round 1) only if it was computed as the trainer computes: the
            # rollout's fp32 logprobs are not what a bf16 update would see
            trainer_side = recompute or not self.params.update.bf16
            self.ref_logp = self.old_logp if same and trainer_side else logprobs.of(ref_path)
        if self.spec.needs_critic:
            from rlpipe.models.critic import critic_values

            critic, critic_tokenizer = self.models.critic(critic_path, self.params.model.dtype)
            self.values = critic_values(critic, critic_tokenizer.pad_token_id, self.prompt_ids, self.response_ids,
                                        self.width, self.params.update.micro_batch_tokens)
        return metrics

    def advantages(self, shaped: list[float], out: dict) -> dict:
        """The estimator on the kept rows; their columns of `out` filled in place."""
        import torch

        from rlpipe.algorithms.build import compute_round_advantages
        from rlpipe.models.sequences import pad_ragged

        columns, rows, n = self.columns, self.rows, len(self.columns)
        dense = {g: k for k, g in enumerate(sorted({columns["group"][i] for i in rows}))}
        baseline = None
        if self.spec.greedy_baseline:
            greedy_reward = {columns["group"][i]: shaped[i] for i in range(n) if columns["is_greedy"][i]}
            baseline = torch.tensor([greedy_reward[columns["group"][i]] for i in rows], dtype=torch.float32)
        step_ends, step_mask = pad_ragged([columns["step_ends"][i] for i in rows], 0, torch.long)
        step_rewards = pad_ragged([columns["step_rewards"][i] for i in rows], 0.0, torch.float32)[0]
        result = compute_round_advantages(
            self.spec,
            rewards=torch.tensor([shaped[i] for i in rows], dtype=torch.float32),
            response_mask=self.mask,
            group_index=torch.tensor([dense[columns["group"][i]] for i in rows]),
            old_logp=self.old_logp, ref_logp=self.ref_logp, values=self.values, baseline_rewards=baseline,
            step_ends=step_ends, step_rewards=step_rewards, step_mask=step_mask,
        )
        self.returns = result.returns
        lengths = self.mask.sum(dim=1).tolist()
        for column, tensor in (("old_logprobs", self.old_logp), ("ref_logprobs", self.ref_logp), ("values", self.values),
                               ("advantages", result.advantages), ("returns", result.returns)):
            if tensor is not None:
                out[column] = list(out[column])
                for i, row, length in zip(rows, tensor.tolist(), lengths):
                    out[column][i] = row[:length]
        for i in rows:
            out["kept"][i] = True
        return advantage_metrics(result.advantages, self.mask, self.old_logp, self.ref_logp)

    def oracle(self, policy_path: Path, round_name: str) -> dict:
        """The critic's ceiling on these rows: the oracle EV from Monte-Carlo continuations under the
        policy that sampled them (rlpipe.rollout.oracle), beside the critic's EV on the same rows."""
        from rlpipe.rollout import rollout_backend
        from rlpipe.rollout.oracle import oracle_metrics

        backend = rollout_backend(self.models, policy_path, self.params.rollout, self.params.model.dtype)
        return oracle_metrics(self.params, backend, self.prompt_ids, self.response_ids,
                              [self.columns["answer"][i] for i in self.rows], [self.columns["meta"][i] for i in self.rows],
                              self.returns, self.values, self.mask, stream=f"oracle@{round_name}")


class RoundLogprobs:
    """Trainer-side logprobs of the round's kept responses under a given checkpoint."""

    def __init__(self, params: Params, prompt_ids, response_ids, width: int, models):
        self.params, self.prompt_ids, self.response_ids, self.width = params, prompt_ids, response_ids, width
        self.models = models

    def of(self, model_path: Path):
        """Under the update's precision (`update.bf16`): the update's loss compares its own logprobs with
        these (the KL term with pi_ref, the ratio with a recomputed pi_old), so that both sides of each
        comparison come from the same precision."""
        from rlpipe.models.sequences import batched_response_logprobs
        from rlpipe.train.policy import update_autocast

        model, tokenizer = self.models.policy(model_path, self.params.model.dtype)
        with update_autocast(self.params, model.device.type):
            return batched_response_logprobs(
                model, self.prompt_ids, self.response_ids, tokenizer.pad_token_id, self.params.rollout.temperature,
                self.params.update.micro_batch_tokens, self.width,
            )


def advantage_metrics(advantages, mask, old_logp, ref_logp) -> dict:
    valid = advantages[mask]
    metrics = {
        "advantage/mean": valid.mean().item(),
        "advantage/std": valid.std(unbiased=False).item(),
        "advantage/abs_mean": valid.abs().mean().item(),
        "advantage/kept_tokens": int(mask.sum()),
    }
    if ref_logp is not None:
        metrics["kl/ref_k1_mean"] = (old_logp - ref_logp)[mask].mean().item()
    return metrics
