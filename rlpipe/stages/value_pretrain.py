"""value_pretrain: the round-0 critic (VAPO / PPO / ORZ), fitted before round 1.

Samples `value.pretrain.prompts` prompts x M responses from the init policy through the configured
rollout backend, verifies them, and fits a fresh value head to their Monte-Carlo returns
(`rlpipe.train.critic.pretrain_critic`), or to their mean with continuations sampled from each state
(`value.pretrain.target_continuations`); with `value.pretrain.verifier_steps`, from a critic that first
learnt to check sums (`pretrain_verifier`, kept in a temporary directory), and with
`value.pretrain.process_steps` from one that then learnt the check on the init policy's own responses
(`pretrain_process`). Critic-free presets get a small marker file and no model load.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from rlpipe import paths
from rlpipe.data.splits import read_prompts, round_prompt_rows
from rlpipe.models.critic import write_no_critic_marker
from rlpipe.rewards import verify
from rlpipe.rollout import rollout_backend
from rlpipe.rewards.shaping import overlong_penalty

STREAM = "value_pretrain"
MC_TARGETS_STREAM = "mc_targets"  # the continuations of `value.pretrain.target_continuations`
PROCESS_STREAM = "process_rows"  # the responses of the process phase (`value.pretrain.process_steps`)


@dataclass
class PretrainingSamples:
    """Responses of the init policy to value pretraining's prompts, row by row."""

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    rewards: list[float]  # shaped as the rounds shape them (overlong penalty where the preset has it)
    groups: list[int]  # the prompt (group) of each row
    answers: list[str]
    metas: list[str]


def pretraining_prompts(params, count: int) -> dict[str, list]:
    """The first `count` prompts of value pretraining's seeded draw from the train split, as columns; a
    smaller count is the start of a larger one's."""
    table = read_prompts(paths.TRAIN)
    return table.take(round_prompt_rows(table.num_rows, count, params.seed, STREAM)).to_pydict()


def pretraining_samples(params, backend) -> PretrainingSamples:
    """`value.pretrain.prompts` prompts x M responses from the policy `backend` generates from, scored."""
    from rlpipe.rollout.base import SamplingSpec
    from rlpipe.rollout.generate import generate_groups

    cfg, spec, m = params.rollout, params.algorithm.resolve(), params.rollout.samples_per_prompt
    prompts = pretraining_prompts(params, params.value.pretrain.prompts)
    groups = generate_groups(backend, prompts["prompt"], prompts["prompt_id"], greedy_pattern=[False] * m, stream=STREAM,
                             seed=params.seed, spec=SamplingSpec(cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p),
                             data=params.data, desc="value pretrain: sample")
    answers, metas = groups.per_row(prompts["answer"]), groups.per_row(prompts["meta"])
    verdicts = verify(params.resolved_verifier(), groups.texts, answers, metas, desc="value pretrain: score")
    response_ids = groups.output.response_ids
    rewards = [v.reward + (overlong_penalty(len(r), cfg.max_new_tokens, params.reward.overlong_cache_len)
                           if spec.overlong_shaping else 0.0) for v, r in zip(verdicts, response_ids)]
    return PretrainingSamples(groups.prompt_ids, response_ids, rewards,
                              groups.per_row(list(range(len(prompts["prompt"])))), answers, metas)


def held_out_prompts(params) -> set[str]:
    """The prompts whose responses value pretraining holds out (`held_out_groups`; group k is prompt k): no
    phase before it trains on them, so its held-out EV stays a measure on unseen prompts."""
    from rlpipe.train.critic import held_out_groups

    texts = pretraining_prompts(params, params.value.pretrain.prompts)["prompt"]
    return {texts[g] for g in held_out_groups(params.seed, len(texts))}


def process_rows(params, backend):
    """(prompt_ids, response_ids, labels, groups): `value.pretrain.process_samples` responses of `backend`
    (the init policy) to each train prompt that value pretraining does not hold out, sampled as the rounds
    sample, each labelled state by state (`on_track_labels`) against the prompt's `right_responses`."""
    from rlpipe.data.tasks import right_responses
    from rlpipe.rollout.base import SamplingSpec
    from rlpipe.rollout.generate import generate_groups
    from rlpipe.train.critic import on_track_labels

    table = read_prompts(paths.TRAIN).to_pydict()
    held_out = held_out_prompts(params)
    kept = [i for i, prompt in enumerate(table["prompt"]) if prompt not in held_out]
    cfg = params.rollout
    sampled = generate_groups(backend, [table["prompt"][i] for i in kept], [table["prompt_id"][i] for i in kept],
                              greedy_pattern=[False] * params.value.pretrain.process_samples, stream=PROCESS_STREAM,
                              seed=params.seed, spec=SamplingSpec(cfg.max_new_tokens, cfg.temperature, cfg.top_k,
                                                                  cfg.top_p),
                              data=params.data, desc="process phase: sample")
    groups = sampled.per_row(list(range(len(kept))))
    response_ids = sampled.output.response_ids
    labels = [on_track_labels(right_responses(table["answer"][kept[g]], table["meta"][kept[g]], params.data.task),
                              response, backend.tokenizer) for g, response in zip(groups, response_ids)]
    return sampled.prompt_ids, response_ids, labels, groups


def value_pretrain(ctx) -> dict:
    params = ctx.params
    if not params.algorithm.resolve().needs_critic:
        return write_no_critic_marker(paths.critic_dir("r0"), params.algorithm.preset)
    torch = ctx.init_torch()
    from rlpipe.train.critic import pretrain_critic, pretrain_process, pretrain_verifier

    backend = rollout_backend(ctx.models, paths.policy_dir("r0"), params.rollout, params.model.dtype)
    samples = pretraining_samples(params, backend)
    # the critic trains beside the policy that samples for it: with vLLM on the same GPU, the engine stays
    # awake through this stage, so `rollout.vllm.gpu_memory_utilization` must leave the critic its room
    device = ctx.models.device
    backbone = params.value.model.path or paths.policy_dir("r0")
    from rlpipe.rollout.oracle import continuation_means, oracle_metrics

    def picked(rows):  # the prompt ids, response ids, answers and metas of these rows
        return [[column[i] for i in rows] for column in (samples.prompt_ids, samples.response_ids, samples.answers,
                                                         samples.metas)]

    def oracle(rows, returns, values, mask):  # the ceiling on the held-out rows, under the init policy
        return oracle_metrics(params, backend, *picked(rows), returns, values, mask, stream="oracle@value_pretrain")

    def means(rows):  # the training rows' continuations, under the init policy
        return continuation_means(params, backend, *picked(rows), params.value.pretrain.target_continuations,
                                  stream=MC_TARGETS_STREAM)[0]
    with tempfile.TemporaryDirectory(prefix="rlpipe-verifier-") as scratch:
        verifier, process = {}, {}
        if params.value.pretrain.verifier_steps:  # the critic starts as a verifier, an intermediate model only
            verifier = pretrain_verifier(params, Path(backbone), paths.TRAIN, Path(scratch) / "verifier", device)
            backbone = Path(scratch) / "verifier"
        if params.value.pretrain.process_steps:  # then learns the check on the policy's own responses
            process = pretrain_process(params, *process_rows(params, backend), Path(backbone),
                                       Path(scratch) / "process", device)
            backbone = Path(scratch) / "process"
        metrics = pretrain_critic(params, samples.prompt_ids, samples.response_ids, torch.tensor(samples.rewards),
                                  samples.groups, backbone, paths.critic_dir("r0"), ctx.tracker, ctx.models,
                                  oracle if params.value.oracle_ev.continuations else None, means, device=device)
    return {**metrics, **verifier, **process}
