"""value_pretrain: the round-0 critic (VAPO / PPO / ORZ), fitted before round 1.

Samples `value.pretrain.prompts` prompts x M responses from the init policy through the configured
rollout backend, verifies them, and fits a fresh value head to their Monte-Carlo returns
(`rlpipe.train.critic.pretrain_critic`). Critic-free presets get a small marker file and no model load.
"""

from __future__ import annotations

from rlpipe import paths
from rlpipe.data.splits import read_prompts, round_prompt_rows
from rlpipe.models.critic import write_no_critic_marker
from rlpipe.rewards import verify
from rlpipe.rollout import rollout_backend
from rlpipe.rewards.shaping import overlong_penalty

STREAM = "value_pretrain"


def value_pretrain(ctx) -> dict:
    params = ctx.params
    if not params.algorithm.resolve().needs_critic:
        return write_no_critic_marker(paths.critic_dir("r0"), params.algorithm.preset)
    torch = ctx.init_torch()
    from rlpipe.rollout.base import SamplingSpec
    from rlpipe.rollout.generate import generate_groups
    from rlpipe.train.critic import pretrain_critic

    cfg, spec, m = params.rollout, params.algorithm.resolve(), params.rollout.samples_per_prompt
    table = read_prompts(paths.TRAIN)
    prompts = table.take(round_prompt_rows(table.num_rows, params.value.pretrain.prompts, params.seed, STREAM)).to_pydict()
    backend = rollout_backend(ctx.models, paths.policy_dir("r0"), cfg, params.model.dtype)
    groups = generate_groups(backend, prompts["prompt"], prompts["prompt_id"], greedy_pattern=[False] * m, stream=STREAM,
                             seed=params.seed, spec=SamplingSpec(cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p),
                             data=params.data, desc="value pretrain: sample")
    verdicts = verify(params.resolved_verifier(), groups.texts, groups.per_row(prompts["answer"]),
                      groups.per_row(prompts["meta"]), desc="value pretrain: score")
    response_ids = groups.output.response_ids
    rewards = [v.reward + (overlong_penalty(len(r), cfg.max_new_tokens, params.reward.overlong_cache_len)
                           if spec.overlong_shaping else 0.0) for v, r in zip(verdicts, response_ids)]
    group_of_row = groups.per_row(list(range(len(prompts["prompt"]))))
    backbone = params.value.model.path or paths.policy_dir("r0")
    oracle = None
    if params.value.oracle_ev.continuations:
        from rlpipe.rollout.oracle import oracle_metrics

        answers, metas = groups.per_row(prompts["answer"]), groups.per_row(prompts["meta"])

        def oracle(rows, returns, values, mask):  # the ceiling on the held-out rows, under the init policy
            return oracle_metrics(params, backend, [groups.prompt_ids[i] for i in rows], [response_ids[i] for i in rows],
                                  [answers[i] for i in rows], [metas[i] for i in rows], returns, values, mask,
                                  stream="oracle@value_pretrain")
    return pretrain_critic(params, groups.prompt_ids, response_ids, torch.tensor(rewards), group_of_row, backbone,
                           paths.critic_dir("r0"), ctx.tracker, ctx.models, oracle)
