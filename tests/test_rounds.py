"""One round of every preset, in process, on the miniature task: rollout -> reward -> advantage -> update.

Checks what lives outside the loss: the greedy ReMax baseline, dynamic sampling, the critic path, the
optimizer state carried into the next round, and that critic-free presets never load a value model.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
import yaml

from conftest import REPO
from rlpipe import artifacts, paths
from rlpipe.config import PRESETS
from rlpipe.config import params_from_dict

MINI = yaml.safe_load((REPO / "tests" / "params_mini.yaml").read_text())


def mini_params(**overrides):
    raw = json.loads(json.dumps(MINI))
    for dotted, value in overrides.items():
        section, key = dotted.split(".", 1)
        raw[section][key] = value
    raw["tracking"]["enabled"] = False
    return params_from_dict(raw)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """Prepared data and an initial tiny policy, shared by every preset's round."""
    import os

    from rlpipe.data.splits import write_splits
    from rlpipe.stages.init import init_policy

    root = tmp_path_factory.mktemp("rounds")
    params = mini_params()
    torch.manual_seed(0)
    write_splits(params.data, params.seed, root / paths.TRAIN, root / paths.TEST)
    init_policy(params, root / paths.TRAIN, root / paths.policy_dir("r0"))
    old = os.getcwd()
    yield root
    os.chdir(old)


def run_round(root: Path, params, monkeypatch, name: str | None = None,
              before_update: Callable[[Path], None] | None = None) -> Path:
    """Run round r1 of `params` in a fresh copy of the workspace (`name`, default the preset); returns
    that copy. The params are also written to its params.yaml, which torchrun's ranks read.
    `before_update(copy)` runs just before the update stage (to start another node)."""
    import shutil

    from rlpipe.runner import execute

    work = root / (name or params.algorithm.preset)
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(root / "runs", work / "runs")
    (work / "params.yaml").write_text(yaml.safe_dump(params.model_dump(mode="json")))
    monkeypatch.chdir(work)
    execute("value_pretrain", params)  # each stage seeds torch, as each stage process does
    for stage in ("rollout", "reward", "advantage"):
        execute(stage, params, "r1")
    if before_update is not None:
        before_update(work)
    execute("update", params, "r1")
    return work


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_one_round_of_every_preset(workspace, monkeypatch, preset):
    params = mini_params(**{"algorithm.preset": preset})
    work = run_round(workspace, params, monkeypatch)
    batch = artifacts.read_table(work / paths.batch_path("r1"), artifacts.BATCH).to_pydict()
    spec = params.algorithm.resolve()
    kept = [i for i, k in enumerate(batch["kept"]) if k]
    assert kept, "no group kept"
    assert all(len(batch["advantages"][i]) == len(batch["response_ids"][i]) for i in kept)
    assert (work / paths.policy_dir("r1") / "optimizer.pt").is_file()
    state = json.loads((work / paths.policy_dir("r1") / paths.TRAINER_STATE).read_text())
    assert state["global_step"] >= 1
    critic_marker = (work / paths.critic_dir("r1") / paths.NO_CRITIC_MARKER).is_file()
    assert critic_marker == (not spec.needs_critic)
    if spec.needs_critic:
        assert all(len(batch["values"][i]) == len(batch["response_ids"][i]) for i in kept)
        assert all(len(batch["returns"][i]) == len(batch["response_ids"][i]) for i in kept)


def test_remax_greedy_sample_is_the_baseline_and_not_trained_on(workspace, monkeypatch):
    params = mini_params(**{"algorithm.preset": "remax", "algorithm.kl_beta": 0.0})
    work = run_round(workspace, params, monkeypatch)
    batch = pq.read_table(work / paths.batch_path("r1")).to_pydict()
    m = params.rollout.samples_per_prompt
    for group in set(batch["group"]):
        rows = [i for i, g in enumerate(batch["group"]) if g == group]
        greedy = [i for i in rows if batch["is_greedy"][i]]
        assert len(greedy) == 1 and len(rows) == m + 1
        assert not batch["kept"][greedy[0]]  # never in the update
        baseline = batch["shaped_reward"][greedy[0]]
        for i in rows:
            if not batch["is_greedy"][i]:
                # beta = 0: every token's advantage is r - r(greedy)
                assert batch["advantages"][i] == pytest.approx([batch["shaped_reward"][i] - baseline] * len(batch["advantages"][i]))


def test_dynamic_sampling_keeps_exactly_the_groups_with_signal(workspace, monkeypatch):
    params = mini_params(**{"algorithm.preset": "dapo", "rollout.oversample": 2.0})
    work = run_round(workspace, params, monkeypatch)
    batch = pq.read_table(work / paths.batch_path("r1")).to_pydict()
    groups = sorted(set(batch["group"]))
    assert len(groups) == 2 * params.rollout.prompts_per_round  # over-sampled
    informative = [g for g in groups if len({batch["correct"][i] for i, x in enumerate(batch["group"]) if x == g}) > 1]
    kept_groups = sorted({batch["group"][i] for i, k in enumerate(batch["kept"]) if k})
    assert kept_groups == informative[: params.rollout.prompts_per_round]
    for i, group in enumerate(batch["group"]):
        if group not in kept_groups:
            assert not batch["kept"][i] and set(batch["advantages"][i]) <= {0.0}


def test_critic_free_presets_never_load_a_value_model(workspace, monkeypatch):
    import rlpipe.models.critic as critic_model
    import rlpipe.train.critic as critic_training

    loads = []
    real = critic_model.load_critic

    def counting(*args, **kwargs):
        loads.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(critic_model, "load_critic", counting)
    monkeypatch.setattr(critic_training, "load_critic", counting)
    for preset in ("grpo", "rloo", "dapo"):
        run_round(workspace, mini_params(**{"algorithm.preset": preset}), monkeypatch)
    assert loads == []
    run_round(workspace, mini_params(**{"algorithm.preset": "ppo"}), monkeypatch)
    assert len(loads) >= 3  # pretraining, values in advantage, the critic update


@pytest.mark.parametrize("bf16", [False, True])
def test_reference_logprobs_are_computed_in_the_updates_precision(workspace, monkeypatch, bf16):
    """Round 1's reference is the policy that sampled it. In fp32 the rollout's logprobs stand in for
    pi_ref; with `update.bf16` the reference is run under the update's bf16 autocast, as the update will
    compute its own logprobs, and the batch holds exactly that forward's values."""
    from rlpipe.models.policy import load_policy
    from rlpipe.models.sequences import batched_response_logprobs
    from rlpipe.train.policy import update_autocast

    params = mini_params(**{"algorithm.preset": "grpo", "update.bf16": bf16})
    work = run_round(workspace, params, monkeypatch, name=f"grpo-bf16-{bf16}")
    batch = artifacts.read_table(work / paths.batch_path("r1"), artifacts.BATCH).to_pydict()
    kept = [i for i, k in enumerate(batch["kept"]) if k]
    width = max(len(batch["response_ids"][i]) for i in kept)
    model, tokenizer = load_policy(work / paths.policy_dir("r0"), params.model.dtype)
    with update_autocast(params, "cpu"):
        expected = batched_response_logprobs(model, [batch["prompt_ids"][i] for i in kept],
                                             [batch["response_ids"][i] for i in kept], tokenizer.pad_token_id,
                                             params.rollout.temperature, params.update.micro_batch_tokens, width)
    for row, i in enumerate(kept):
        reference, behaviour = batch["ref_logprobs"][i], batch["behaviour_logprobs"][i]
        if bf16:
            assert reference == expected[row, :len(reference)].tolist()
        else:
            assert reference == behaviour
    if bf16:  # bf16 rounding is visible against the rollout's fp32 logprobs
        assert any(batch["ref_logprobs"][i] != batch["behaviour_logprobs"][i] for i in kept)


PARALLEL_BASE = {"algorithm.preset": "ppo", "runtime.torch_threads": 2}
"""The round the parallel updates are compared on: PPO, so that the critic trains on the ranks too."""


@pytest.fixture(scope="module")
def ppo_one_process(workspace):
    """Round r1 of PARALLEL_BASE with the update in this process: what every parallel update must give."""
    with pytest.MonkeyPatch.context() as patch:
        return run_round(workspace, mini_params(**PARALLEL_BASE), patch, name="ppo-nproc1")


def assert_same_round(one: Path, two: Path) -> None:
    """Policy and critic with their optimizer states, and the weights equal the single process's up to
    float summation order."""
    from safetensors.torch import load_file

    for directory, optimizer in ((paths.policy_dir("r1"), "optimizer.pt"),
                                 (paths.critic_dir("r1"), "critic_optimizer.pt")):
        assert (two / directory / optimizer).is_file()
        start = load_file(one / directory.parent / "r0" / "model.safetensors")
        a, b = load_file(one / directory / "model.safetensors"), load_file(two / directory / "model.safetensors")
        assert sorted(a) == sorted(b) and any(not torch.equal(a[k], start[k]) for k in a), directory
        worst = max((a[k] - b[k]).abs().max().item() for k in a)
        assert worst < 1e-5, f"{directory}: weights differ by {worst}"
    state_one = json.loads((one / paths.critic_dir("r1") / paths.TRAINER_STATE).read_text())
    state_two = json.loads((two / paths.critic_dir("r1") / paths.TRAINER_STATE).read_text())
    assert state_two["value/value_loss_mean"] == pytest.approx(state_one["value/value_loss_mean"], rel=1e-4)


def test_torchrun_update_of_policy_and_critic_matches_one_process(workspace, ppo_one_process, monkeypatch):
    """update.nproc = 2 through the stage's torchrun launch: both ranks train policy and critic, rank 0
    writes both."""
    two = run_round(workspace, mini_params(**PARALLEL_BASE, **{"update.nproc": 2}), monkeypatch, name="ppo-nproc2")
    assert_same_round(ppo_one_process, two)


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_two_node_update_matches_one_process(workspace, ppo_one_process, monkeypatch):
    """update.nnodes = 2 on one machine: node 0 is the stage's torchrun launch (with update.nproc 1, which
    alone would train in process), node 1 is `rlpipe update-node`, started first as on a real second
    machine; one process each, meeting at a free port of 127.0.0.1. Node 0 holds rank 0, so the round's
    checkpoints are written (and its metrics reach the stage), equal to the single process's."""
    import subprocess
    import sys

    params = mini_params(**PARALLEL_BASE, **{"update.nnodes": 2, "update.rdzv_endpoint": f"127.0.0.1:{free_port()}",
                                             "update.rdzv_timeout": 120})
    nodes: list[subprocess.Popen] = []

    def start_node_1(work: Path) -> None:
        command = [str(Path(sys.executable).parent / "rlpipe"), "update-node", "--round", "r1", "--node-rank", "1"]
        nodes.append(subprocess.Popen(command, cwd=work))

    try:
        two = run_round(workspace, params, monkeypatch, name="ppo-2nodes", before_update=start_node_1)
        assert nodes[0].wait(timeout=120) == 0
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    assert_same_round(ppo_one_process, two)


@pytest.mark.slow
def test_torchrun_update_with_lora_matches_one_process(workspace, monkeypatch):
    """model.lora under DDP (update.nproc = 2): the ranks attach the same seeded adapters, and rank 0
    writes adapters equal to the single process's up to float summation order."""
    from safetensors.torch import load_file

    lora = {"rank": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
    base = {"algorithm.preset": "grpo", "runtime.torch_threads": 2, "model.lora": lora, "update.lr": 0.003}
    one = run_round(workspace, mini_params(**base), monkeypatch, name="lora-nproc1")
    two = run_round(workspace, mini_params(**base, **{"update.nproc": 2}), monkeypatch, name="lora-nproc2")
    a = load_file(one / paths.policy_dir("r1") / "adapter_model.safetensors")
    b = load_file(two / paths.policy_dir("r1") / "adapter_model.safetensors")
    assert sorted(a) == sorted(b) and any(bool(t.abs().sum() > 0) for k, t in a.items() if "lora_B" in k)
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst < 1e-5, f"adapters differ by {worst}"


def value_pretrain_in_a_copy(workspace, monkeypatch, name: str, **pretrain):
    """Run ppo's value_pretrain stage in a fresh copy of the workspace's runs/, with these
    `value.pretrain` keys; (the copy, the stage's metrics)."""
    import shutil

    from rlpipe.runner import execute

    params = mini_params(**{"algorithm.preset": "ppo", "value.pretrain": {**MINI["value"]["pretrain"], **pretrain}})
    work = workspace / name
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(workspace / "runs", work / "runs")
    monkeypatch.chdir(work)
    return work, execute("value_pretrain", params)


def test_value_pretraining_of_zero_steps_reports_the_fresh_critics_explained_variance(workspace, monkeypatch):
    """`value.pretrain.max_steps: 0` keeps the fresh head, and its held-out EV is measured, not the -inf
    the training loop starts from (the sweep's VAPO-without-pretraining runs read it)."""
    _, metrics = value_pretrain_in_a_copy(workspace, monkeypatch, "no-pretraining", max_steps=0)
    assert metrics["value/pretrain_steps"] == 0
    assert -10 < metrics["value/explained_variance"] <= 1


def test_the_verifier_phase_trains_the_critic_value_pretraining_starts_from(workspace, monkeypatch):
    """`value.pretrain.verifier_steps`: the critic first learns sums against near misses, then value
    pretraining starts from it (same seed, same samples), so its critic differs from the one started from
    the policy; the phase's figures are in the stage's metrics and nothing of it is left in runs/."""
    from safetensors.torch import load_file

    from rlpipe.train.critic import near_miss, on_track_labels, verifier_rows

    critics = {}
    for steps in (0, 3):
        # with the phase, average_from 0: the mean of both steps is written
        work, metrics = value_pretrain_in_a_copy(workspace, monkeypatch, f"verifier-{steps}", max_steps=2,
                                                 verifier_steps=steps, verifier_prompts=16,
                                                 average_from=0.0 if steps else None)
        assert ("value/verifier_explained_variance" in metrics) == bool(steps)
        assert metrics.get("value/averaged_steps") == (2 if steps else None)
        critics[steps] = load_file(work / paths.critic_dir("r0") / "model.safetensors")
        assert [p.name for p in (work / "runs" / "critic").iterdir()] == ["r0"]
        assert not [p for p in work.rglob("*verifier*")]
    assert metrics["value/verifier_steps"] == 3 and metrics["value/verifier_rows"] == 32
    assert any(not torch.equal(critics[0][k], critics[3][k]) for k in critics[0])

    from transformers import AutoTokenizer

    params = mini_params(**{"value.pretrain": {**MINI["value"]["pretrain"], "verifier_prompts": 16}})
    tokenizer = AutoTokenizer.from_pretrained(workspace / paths.policy_dir("r0"))
    prompt_ids, response_ids, rewards, groups, rights = verifier_rows(params, tokenizer, workspace / paths.TRAIN)
    assert rewards == [1.0, 0.0] * 16 and groups == [g for g in range(16) for _ in range(2)]
    for k in range(0, 32, 2):
        right, wrong = tokenizer.decode(response_ids[k][:-1]), tokenizer.decode(response_ids[k + 1][:-1])
        assert len(right) == len(wrong) and sum(a != b for a, b in zip(right, wrong)) == 1
        assert response_ids[k][-1] == response_ids[k + 1][-1] == tokenizer.eos_token_id
        assert rights[k] == rights[k + 1] == [right]
        # `verifier_targets: on_track`: the right row is 1 throughout; the near miss is 1 up to the state
        # before its wrong digit (which the right row shares) and 0 from the state after it on
        slip = next(i for i, (a, b) in enumerate(zip(right, wrong)) if a != b)
        assert on_track_labels(rights[k], response_ids[k], tokenizer) == [1.0] * len(response_ids[k])
        assert on_track_labels(rights[k], response_ids[k + 1], tokenizer) == (
            [1.0] * (slip + 1) + [0.0] * (len(response_ids[k + 1]) - slip - 1))
    import random

    assert all(near_miss("5", random.Random(s)) != "5" for s in range(20))
    assert all(not near_miss("12", random.Random(s)).startswith("0") for s in range(50))


def test_value_pretraining_on_continuation_targets_samples_them_through_the_stage(workspace, monkeypatch):
    """`value.pretrain.target_continuations: 2` through the stage: the continuations are drawn from the init
    policy (the oracle's sampler) for every training state, and the critic fitted to them differs from
    the one fitted to the returns alone, from the same samples and seed."""
    from safetensors.torch import load_file

    critics = {}
    for continuations in (0, 2):
        work, metrics = value_pretrain_in_a_copy(workspace, monkeypatch, f"continuations-{continuations}", max_steps=2,
                                                 target_continuations=continuations)
        assert metrics.get("value/target_continuations") == (continuations or None)
        critics[continuations] = load_file(work / paths.critic_dir("r0") / "model.safetensors")
    assert metrics["value/target_continuation_seconds"] > 0
    assert any(not torch.equal(critics[0][k], critics[2][k]) for k in critics[0])


def test_the_process_phase_runs_in_the_stage_on_prompts_value_pretraining_does_not_hold_out(workspace,
                                                                                              monkeypatch):
    """`value.pretrain.process_steps`: the init policy answers every train prompt but value pretraining's
    held-out ones, the critic learns their labels, then value pretraining starts from it; its figures are in
    the stage's metrics and nothing of it is left in runs/."""
    from safetensors.torch import load_file

    from rlpipe.stages.value_pretrain import held_out_prompts

    critics = {}
    for steps in (0, 2):
        work, metrics = value_pretrain_in_a_copy(workspace, monkeypatch, f"process-{steps}", max_steps=2,
                                                 process_steps=steps, process_samples=2)
        assert ("value/process_explained_variance" in metrics) == bool(steps)
        critics[steps] = load_file(work / paths.critic_dir("r0") / "model.safetensors")
        assert [p.name for p in (work / "runs" / "critic").iterdir()] == ["r0"]
        assert not [p for p in work.rglob("*process*")]
    params = mini_params(**{"algorithm.preset": "ppo"})
    held_out = held_out_prompts(params)
    assert len(held_out) == MINI["value"]["pretrain"]["prompts"] // 4
    assert metrics["value/process_steps"] == 2
    train = artifacts.read_parquet(paths.TRAIN, columns=["prompt"]).column("prompt").to_pylist()
    assert len(train) == MINI["data"]["num_train"] and held_out <= set(train)
    assert metrics["value/process_rows"] == 2 * sum(prompt not in held_out for prompt in train)
    assert 0 < metrics["value/process_on_track_share"] < 1
    assert any(not torch.equal(critics[0][k], critics[2][k]) for k in critics[0])


def test_the_process_phase_refuses_data_without_right_responses():
    from rlpipe.errors import PipelineError

    with pytest.raises(PipelineError, match="value.pretrain.process_steps"):
        params_from_dict({"data": {"source": "file", "train_file": "a.jsonl", "test_file": "b.jsonl"},
                          "value": {"pretrain": {"process_steps": 10}}})
    params_from_dict({"data": {"task": "chain"}, "value": {"pretrain": {"process_steps": 10}}})


def test_the_verifier_rows_of_the_reasoning_task_slip_once_and_carry_the_slip():
    """Reasoning: the right solution; the same with one running sum wrong by a digit and every later step
    adding correctly to it, so the marked answer is wrong; then the marked answer alone and a near miss."""
    import random

    from rlpipe.data.tasks import final_answer, reasoning_example
    from rlpipe.train.critic import verifier_texts

    rng = random.Random(0)
    for _ in range(200):
        example = reasoning_example(rng, 2, 2, 5)
        (right, r1), (wrong, r0), (jump, j1), (jump_wrong, j0) = verifier_texts("reasoning", example.prompt,
                                                                                 example.answer, rng)
        assert (r1, r0, j1, j0) == (1.0, 0.0, 1.0, 0.0)
        assert right == example.meta and jump == f"#{example.answer}"
        assert final_answer(wrong) != example.answer and final_answer(jump_wrong) != example.answer
        assert len(jump_wrong) == len(jump) and sum(a != b for a, b in zip(jump, jump_wrong)) == 1
        steps = wrong.split("#")[0].rstrip(";").split(";")
        numbers = [int(n) for n in example.prompt.rstrip("=").split("+")]
        sums = [(int(a), int(b), int(c)) for a, b, c in (step.replace("=", "+").split("+") for step in steps)]
        assert [b for _, b, _ in sums] == numbers[1:] and sums[0][0] == numbers[0]
        assert sum(a + b != c for a, b, c in sums) == 1  # one slip
        assert all(sums[k + 1][0] == sums[k][2] for k in range(len(sums) - 1))  # carried on from the wrong sum
        assert final_answer(wrong) == str(sums[-1][2])


def test_the_verifier_phase_refuses_tasks_without_near_misses():
    from rlpipe.errors import PipelineError

    with pytest.raises(PipelineError, match="value.pretrain.verifier_steps"):
        params_from_dict({"data": {"task": "chain"}, "value": {"pretrain": {"verifier_steps": 10}}})
    params_from_dict({"data": {"task": "reasoning"}, "value": {"pretrain": {"verifier_steps": 10}}})
