"""Critics from `critic_pretrain_variants.py` against the ceiling, on one probe none of them trained on.

    python scripts/critic_pretrain_variants.py OUT '{}'                      # OUT/critic-0, samples-512.pkl
    python scripts/critic_pretrain_variants.py OUT '{"prompts": 2048, ...}'  # OUT/critic-1, samples-2048.pkl
    python scripts/critic_ceiling_probe.py OUT 256 OUT/critic-0 OUT/critic-1

The value_pretrain stage measures the ceiling on `value.oracle_ev.max_responses` (64) of its own held-out
responses, so two variants with other prompts are probed on different responses, and 64 are few (the
critic's EV on them and on all held-out responses differ by up to 0.2). This probes N responses, drawn
from the held-out prompts of every sample file in OUT (value pretraining's prompts of one seed are the
start of one permutation, so a larger file holds a smaller one's prompts), with the oracle of
`rlpipe.rollout.oracle` under `value.oracle_ev.continuations` (8 where params.yaml has 0; drawn as
`continuation_means` draws them for the stages, equal states sharing theirs), and prints
each critic's EV on them, the oracle EV and the fraction: the stage's figures, on common ground, with
95% bootstrap intervals over the probed responses (each fraction, and each critic's difference from the
first critic named). Then, by where a state is (the answer marker `#` written or not, the text still on
track to a right response or not, `on_track_labels`, and how many tokens are left), the share of the
squared error around the mean return that the oracle and each critic explain, beside what the state's
coarse features alone explain (`coarse_values`), and those with the carries of the additions still to
come: where the critic falls short. And each critic (and the oracle) set to 0 on the states off track
(`print_check_bound`): what a perfect check of the written text could add. The oracle's values are kept
in OUT/probe-N.pt, so a rerun with other critics samples nothing. Run it in the project the samples came
from (its params.yaml and runs/policy/r0).
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import torch

from rlpipe import paths
from rlpipe.config import load_params


def main(out: Path, count: int, critic_dirs: list[Path]) -> None:
    from rlpipe.data.tasks import right_responses
    from rlpipe.models.critic import (explained_variance, fraction_of_ceiling, load_critic,
                                      oracle_explained_variance)
    from rlpipe.models.sequences import pad_ragged
    from rlpipe.models.store import ModelStore
    from rlpipe.rollout import rollout_backend
    from rlpipe.rollout.oracle import continuation_means, probed_rows
    from rlpipe.stages.value_pretrain import pretraining_prompts
    from rlpipe.train.critic import (ValueTargets, held_out_groups, monte_carlo_returns, on_track_labels,
                                     predict)

    params = load_params()
    samples = {int(f.stem.split("-")[1]): pickle.loads(f.read_bytes()) for f in sorted(out.glob("samples-*.pkl"))}
    largest = max(samples)
    prompts = pretraining_prompts(params, largest)
    trained_on: set[str] = set()  # prompts some sample file trained a critic on
    for *_, file_groups in samples.values():
        n_groups = max(file_groups) + 1
        held_out = held_out_groups(params.seed, n_groups)
        trained_on |= {prompts["prompt"][g] for g in range(n_groups) if g not in held_out}
    prompt_ids, response_ids, rewards, groups = samples[largest]
    candidates = [i for i, g in enumerate(groups) if prompts["prompt"][g] not in trained_on]
    rows = [candidates[k] for k in probed_rows(len(candidates), count, params.seed, "critic_ceiling_probe")]
    print(f"{len(rows)} probed responses of {len(candidates)} held out from every critic ({largest} prompts' samples)")

    probe_prompts, probe_responses = [prompt_ids[i] for i in rows], [response_ids[i] for i in rows]
    mask = pad_ragged(probe_responses, 0, torch.long)[1]
    returns = monte_carlo_returns(torch.tensor([rewards[i] for i in rows]), mask, params.algorithm.resolve().gamma)
    cache = out / f"probe-{count}.pt"
    if cache.is_file():
        oracle, noise = torch.load(cache)
    else:
        # as every stage measures the oracle (equal states share their continuations); a probe measured
        # before that shared nothing, and its cache above keeps the values it drew
        backend = rollout_backend(ModelStore(), paths.policy_dir("r0"), params.rollout, params.model.dtype)
        oracle, noise = continuation_means(params, backend, probe_prompts, probe_responses,
                                           [prompts["answer"][groups[i]] for i in rows],
                                           [prompts["meta"][groups[i]] for i in rows],
                                           params.value.oracle_ev.continuations or 8, "critic_ceiling_probe")
        torch.save((oracle, noise), cache)
    ceiling = oracle_explained_variance(returns, mask, oracle, noise)
    print(f"oracle EV {ceiling:.3f} (uncorrected {oracle_explained_variance(returns, mask, oracle):.3f}) "
          f"over {int(mask.sum())} states")
    targets = ValueTargets(probe_prompts, probe_responses, returns, None, mask)
    explained = {"oracle": oracle}
    for critic_dir in critic_dirs:
        critic, tokenizer = load_critic(critic_dir)
        # keyed by the path as given: two critics of one name (runs/critic/r0 of two projects) stay apart
        explained[str(critic_dir)] = values = predict(critic, targets, params, tokenizer.pad_token_id)
        ev = explained_variance(values, returns, mask)
        print(f"{critic_dir}: critic EV {ev:.3f}, fraction of the ceiling {fraction_of_ceiling(ev, ceiling):.2f}")
    print_bootstrap(returns, mask, oracle, noise, {name: v for name, v in explained.items() if name != "oracle"})
    right = [right_responses(prompts["answer"][groups[i]], prompts["meta"][groups[i]], params.data.task) for i in rows]
    on_track = pad_ragged([on_track_labels(r, response, tokenizer) for r, response in zip(right, probe_responses)],
                          0.0, torch.float32)[0]

    print_check_bound(returns, mask, ceiling, on_track, explained)
    folds = [groups[i] % 2 for i in rows]  # by prompt: no prompt's responses on both sides
    explained["coarse"] = coarse_values(oracle, mask, probe_prompts, probe_responses, on_track, tokenizer, folds)
    explained["coarse + carries to come"] = coarse_values(oracle, mask, probe_prompts, probe_responses, on_track,
                                                          tokenizer, folds, with_carries=True)
    marker = tokenizer.convert_tokens_to_ids("#")
    # 0: steps (or nothing) written, on track; 1: the same, off track; 2: after `#`; 3: eos next
    where = torch.zeros_like(mask, dtype=torch.long)
    for b, response in enumerate(probe_responses):
        seen = False
        for t, token in enumerate(response):
            where[b, t] = 3 if t == len(response) - 1 else 2 if seen else int(on_track[b, t] < 0.5)
            seen |= token == marker
    total = ((returns - returns[mask].mean()) ** 2 * mask).sum()
    print("states | count | share of the squared error | " + " | ".join(f"{name} explains" for name in explained))
    labels = ["before the answer marker, on track", "before the answer marker, off track", "after `#`, digits to go",
              "eos next"]
    for code, label in enumerate(labels):
        at = mask & (where == code)
        share = float(((returns - returns[mask].mean()) ** 2 * at).sum() / total)
        gains = [share - float(((returns - v) ** 2 * at).sum() / total) for v in explained.values()]
        gains[0] += float((noise * at).sum() / total)  # the oracle's own sampling noise, as in its EV
        print(f"{label} | {int(at.sum())} | {share:.3f} | " + " | ".join(f"{g:.3f}" for g in gains))


def print_check_bound(returns, mask, ceiling, on_track, values: dict) -> None:
    """What a perfect check of the written text could add to each critic (and where the oracle would go
    with it): the EV of its values set to 0 on every state that has left the track (`on_track_labels`). A
    critic whose gated EV is hardly above its own loses little to a poor check; an off-track state is not
    always lost (a policy can slip in a copied running sum and still add the right numbers), so gating can
    also cost, as the oracle's line shows."""
    from rlpipe.models.critic import explained_variance, fraction_of_ceiling

    for name, v in values.items():  # the oracle's EV here is its plain one, without the noise correction
        plain, gated = (explained_variance(x * mask, returns, mask) for x in (v, v * on_track))
        print(f"{name} set to 0 off track: EV {plain:.3f} -> {gated:.3f}, fraction of the ceiling "
              f"{fraction_of_ceiling(plain, ceiling):.2f} -> {fraction_of_ceiling(gated, ceiling):.2f}")


def coarse_values(oracle, mask, prompt_ids, response_ids, on_track, tokenizer, folds: list[int],
                  with_carries: bool = False):
    """What a state's coarse features alone are worth: the oracle's mean value over the probe's states that
    share the prompt's operand count, the tokens written, the response's first token (its format: steps or
    the answer alone) and the on-track label; `with_carries` adds `carries_to_come` to the key. Each state
    gets the mean over the states of the other fold (`folds`, 0 or 1 for each response, by its prompt), so
    the column is measured on prompts it was not fit on, as the critics are; a key the other fold lacks
    falls back to a shorter one (the key without the carries, the operand count alone, every state). A
    critic that explains no more than the plain column has learnt the prompt's length, the response's
    format and progress, and whether it slipped, but not which of the policy's additions are hard; the
    carries are the first thing that makes an addition hard."""
    from collections import defaultdict

    keys, sums, counts = {}, defaultdict(float), defaultdict(int)
    for b, (prompt, response) in enumerate(zip(prompt_ids, response_ids)):
        prompt_text = tokenizer.decode(prompt, skip_special_tokens=True)
        operands = prompt_text.count("+") + 1
        for t in range(len(response)):
            key = (operands, t, response[0] if t else None, bool(on_track[b, t] > 0.5))
            if with_carries:
                key += carries_to_come(prompt_text, tokenizer.decode(response[:t], skip_special_tokens=True))
            # the key, then shorter ones to fall back on
            keys[b, t] = levels = [key, key[:4], key[:1], ()]
            for level in levels:
                sums[folds[b], level] += float(oracle[b, t])
                counts[folds[b], level] += 1
    values = torch.zeros_like(oracle)
    for (b, t), levels in keys.items():
        other = 1 - folds[b]
        level = next(level for level in levels if counts[other, level])
        values[b, t] = sums[other, level] / counts[other, level]
    return values * mask


def column_carries(a: int, b: int) -> int:
    """How many columns of a + b carry."""
    carries = carry = 0
    while a or b:
        carry = int(a % 10 + b % 10 + carry >= 10)
        carries, a, b = carries + carry, a // 10, b // 10
    return carries


def carries_to_come(prompt: str, written: str) -> tuple[int, int]:
    """(carries in the additions of the running sum not yet written as steps, carries in the next one) for
    a prompt "a+b+...=" and the response written so far: a step ends at each step separator, so a
    response that went straight to the answer marker has every addition still to do in its head."""
    from itertools import accumulate

    from rlpipe.data.tasks import ANSWER_MARKER, REASONING_STEP_SEPARATOR, prompt_operands

    numbers = prompt_operands(prompt)
    running = list(accumulate(numbers))
    additions = [column_carries(running[k], numbers[k + 1]) for k in range(len(numbers) - 1)]
    done = 0 if written.startswith(ANSWER_MARKER) else written.count(REASONING_STEP_SEPARATOR)
    left = additions[done:]
    return sum(left), left[0] if left else -1


def print_bootstrap(returns, mask, oracle, noise, critics: dict, resamples: int = 2000) -> None:
    """95% intervals of each critic's fraction of the ceiling, and of its difference from the first
    critic's, over the probe's responses drawn again with replacement (`bootstrap_fractions`): how far the
    probe's N responses let two fractions be told apart."""
    from rlpipe.models.critic import bootstrap_fractions, percentile_interval

    fractions = bootstrap_fractions(returns, mask, oracle, noise, critics, resamples)

    def interval(draws: list[float]) -> str:
        low, high = percentile_interval(draws)
        return f"[{low:.2f}, {high:.2f}]"

    first = next(iter(critics), None)
    for name, draws in fractions.items():
        line = f"{name}: fraction of the ceiling, 95% interval over {resamples} resamples of the responses {interval(draws)}"
        if name != first:
            line += f"; minus {first}'s, paired: {interval([a - b for a, b in zip(draws, fractions[first])])}"
        print(line)


if __name__ == "__main__":
    if len(sys.argv) < 4:
        sys.exit("usage: critic_ceiling_probe.py OUT N CRITIC_DIR [CRITIC_DIR ...]")
    main(Path(sys.argv[1]), int(sys.argv[2]), [Path(p) for p in sys.argv[3:]])
