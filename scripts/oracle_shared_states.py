"""The oracle with and without shared states, side by side on the same responses (docs/critic.md, "The
critic's ceiling"):

    python scripts/critic_pretrain_variants.py OUT '{"prompts": 2048, "steps": 0}'   # draws OUT/samples-2048.pkl
    python scripts/oracle_shared_states.py OUT/samples-2048.pkl 64 8 2

in a project whose params.yaml has a critic preset, after `dvc repro init`. Takes the responses of the
first G prompts of the sample file, and runs `prefix_values` with K continuations on them R times each way,
alternating: every state drawn apart (`tasks=None`), and equal states sharing their first occurrence's
draws (`tasks`, as `continuation_means` passes them). Prints each run's seconds and oracle EV, and the
median ratio of the shared runs' seconds to the others'.
"""

from __future__ import annotations

import pickle
import statistics
import sys
import time
from pathlib import Path

import torch

from rlpipe import paths
from rlpipe.config import load_params


def main(samples_path: Path, n_groups: int, continuations: int, repeats: int) -> None:
    from rlpipe.models.critic import oracle_explained_variance
    from rlpipe.models.sequences import pad_ragged
    from rlpipe.models.store import ModelStore
    from rlpipe.rollout import rollout_backend
    from rlpipe.rollout.base import SamplingSpec
    from rlpipe.rollout.oracle import outcome_scorer, prefix_values
    from rlpipe.stages.value_pretrain import pretraining_prompts
    from rlpipe.train.critic import monte_carlo_returns

    params = load_params()
    prompt_ids, response_ids, rewards, groups = pickle.loads(samples_path.read_bytes())
    rows = [i for i, g in enumerate(groups) if g < n_groups]
    prompts = pretraining_prompts(params, max(groups) + 1)
    answers, metas = [prompts["answer"][groups[i]] for i in rows], [prompts["meta"][groups[i]] for i in rows]
    backend = rollout_backend(ModelStore(), paths.policy_dir("r0"), params.rollout, params.model.dtype)
    rollout = params.rollout
    spec = SamplingSpec(rollout.max_new_tokens, rollout.temperature, rollout.top_k, rollout.top_p)
    probe_prompts, probe_responses = [prompt_ids[i] for i in rows], [response_ids[i] for i in rows]
    mask = pad_ragged(probe_responses, 0, torch.long)[1]
    returns = monte_carlo_returns(torch.tensor([rewards[i] for i in rows]), mask, params.algorithm.resolve().gamma)
    seconds: dict[str, list[float]] = {"apart": [], "shared": []}
    for _ in range(repeats):
        for label, tasks in (("apart", None), ("shared", list(zip(answers, metas)))):
            started = time.perf_counter()
            values, noise = prefix_values(backend, probe_prompts, probe_responses,
                                          outcome_scorer(params, backend.tokenizer, answers, metas),
                                          continuations=continuations, stream="oracle_shared_states",
                                          seed=params.seed, spec=spec, tasks=tasks)
            seconds[label].append(time.perf_counter() - started)
            print(f"{label}: {seconds[label][-1]:.1f} s, oracle EV {oracle_explained_variance(returns, mask, values, noise):.4f} "
                  f"(uncorrected {oracle_explained_variance(returns, mask, values):.4f}); {len(rows)} responses, "
                  f"{int(mask.sum())} states", flush=True)
    ratios = [shared / apart for shared, apart in zip(seconds["shared"], seconds["apart"])]
    print(f"shared / apart: median {statistics.median(ratios):.2f}x over {repeats} pairs "
          f"({min(ratios):.2f}x - {max(ratios):.2f}x)")


if __name__ == "__main__":  # math-verify's process pool re-imports this module
    if len(sys.argv) != 5:
        sys.exit(__doc__)
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
