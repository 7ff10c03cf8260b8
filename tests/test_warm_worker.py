"""The warm worker: the same bytes as cold stage processes, nothing stale ever served, a killed worker
repaired by the next `dvc repro`, bad params rejected before any worker starts.

Stages run by hand join a worker when RLPIPE_EXECUTION_ID names an execution, which is how these tests
drive one worker through several requests; `dvc repro` gets its own worker per execution.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from rlpipe.scratch_project import scratch_env
from rlpipe.worker.client import signal_workers, worker_pids
from scratch import artifact_hashes, differing_artifacts, dvc, dvc_target, make_project, ran_stages

WORKER_LOG = Path(".dvc/tmp/rlpipe-worker.log")


def worker_env(execution: str) -> dict:
    return {**scratch_env(), "RLPIPE_EXECUTION_ID": execution}


def by_hand(root: Path, stage: str, round_name: str, env: dict) -> dict:
    """Run one stage script as a user would; returns its metrics file."""
    done = subprocess.run([sys.executable, f"stages/{stage}.py", round_name], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads((root / f"runs/stage_metrics/{stage}_{round_name}.json").read_text())


def stop_workers(root: Path) -> None:
    signal_workers(root, signal.SIGKILL)


def with_params(root: Path, **changes) -> None:
    params = yaml.safe_load((root / "params.yaml").read_text())
    for dotted, value in changes.items():
        section, key = dotted.split(".")
        params[section][key] = value
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    # the stages here run as one execution (RLPIPE_EXECUTION_ID), as under DVC, which would rerun the
    # fingerprint stage after the edit
    subprocess.run([sys.executable, "stages/fingerprint.py"], cwd=root, env=scratch_env(), check=True)


@pytest.fixture
def project_copy(mini_run, tmp_path):
    root = tmp_path / "project"
    shutil.copytree(mini_run[0], root, ignore=shutil.ignore_patterns("mlruns", "mlflow.db", "tmp"))
    with_params(root, **{"tracking.enabled": False})
    yield root
    stop_workers(root)


def test_the_mini_run_used_the_worker_and_its_models(mini_run):
    """The default run is warm: stages after the first load nothing the worker holds."""
    root, _ = mini_run
    rollout = json.loads((root / "runs/stage_metrics/rollout_r2.json").read_text())
    update = json.loads((root / "runs/stage_metrics/update_r2.json").read_text())
    assert rollout["stage/worker_loads"] == 0 and rollout["stage/worker_reused"] == 1  # policy r1, as written
    assert update["stage/worker_loads"] == 0  # policy r1 and its optimizer, as written
    assert rollout["stage/import_seconds"] < 0.5  # torch was imported once, by the worker
    # value_pretrain of grpo (critic-free) wrote its marker in its own process, not queued behind the
    # worker's imports: its metrics carry no worker counts
    value_pretrain = json.loads((root / "runs/stage_metrics/value_pretrain.json").read_text())
    assert "stage/worker_loads" not in value_pretrain and value_pretrain["value/critic"] == 0


def test_a_checkpoint_changed_on_disk_is_loaded_again(project_copy):
    """Each way a checkpoint changes under a running worker: edited by hand, checked out by DVC, written
    by another experiment. Each time the worker loads it again, and writes what a cold stage writes."""
    root, env = project_copy, worker_env(f"stale-{os.getpid()}")
    rollouts = root / "runs/rounds/r2/rollouts.parquet"
    weights = root / "runs/policy/r1/model.safetensors"

    def rollout_r2() -> tuple[dict, bytes]:
        metrics = by_hand(root, "rollout", "r2", env)
        return metrics, rollouts.read_bytes()

    def cold_rollout_r2() -> bytes:
        by_hand(root, "rollout", "r2", scratch_env())  # no execution named: a cold stage process
        return rollouts.read_bytes()

    first, original = rollout_r2()
    assert first["stage/worker_loads"] == 1  # a new worker: policy r1 from disk
    again, same = rollout_r2()
    assert again["stage/worker_loads"] == 0 and same == original  # held, unchanged on disk: reused

    # 1. edited by hand: other weights under the same path
    from safetensors.torch import load_file, save_file

    tensors = load_file(weights)
    save_file({k: v * 1.05 for k, v in tensors.items()}, weights, metadata={"format": "pt"})
    edited, warm_bytes = rollout_r2()
    assert edited["stage/worker_loads"] == 1
    assert warm_bytes != original and warm_bytes == cold_rollout_r2()

    # 2. checked out by DVC: the committed checkpoint comes back
    shutil.rmtree(root / "runs/policy/r1")
    dvc(root, "checkout", dvc_target("update@r1"))
    restored, restored_bytes = rollout_r2()
    assert restored["stage/worker_loads"] == 1 and restored_bytes == original

    # 3. written by another experiment: a cold update with another learning rate rewrites runs/policy/r1
    with_params(root, **{"update.lr": 0.01})
    by_hand(root, "update", "r1", scratch_env())
    other, other_bytes = rollout_r2()
    assert other["stage/worker_loads"] == 1
    assert other_bytes != original and other_bytes == cold_rollout_r2()


def test_processes_the_worker_starts_do_not_hold_the_stage_output(project_copy):
    """The math verifier's process pool outlives the reward stage in the worker. It must not inherit the
    stage's stdout and stderr, or whoever reads them (DVC, a pipe, this test) would wait forever."""
    root, env = project_copy, worker_env(f"pool-{os.getpid()}")
    with_params(root, **{"reward.verifier": "math"})
    for _ in range(2):  # the second call finds the pool already running
        done = subprocess.run([sys.executable, "stages/reward.py", "r1"], cwd=root, env=env, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr
    metrics = json.loads((root / "runs/stage_metrics/reward_r1.json").read_text())
    assert metrics["reward/accuracy"] > 0


def test_bad_params_fail_before_any_worker_starts(tmp_path):
    root = make_project(tmp_path / "project")
    text = (root / "params.yaml").read_text().replace("  temperature: 1.0\n", "  temprature: 1.0\n", 1)
    (root / "params.yaml").write_text(text)
    done = subprocess.run(["dvc", "repro"], cwd=root, env=scratch_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "rollout.temprature: unknown key; did you mean rollout.temperature?" in done.stdout + done.stderr
    assert not (root / WORKER_LOG).exists()  # rejected by the stage process, before it called a worker


def test_a_running_worker_rejects_bad_params_before_it_loads_anything(project_copy):
    """Once a worker runs, a stage process leaves validation to it (the thin client imports no pydantic):
    a bad key still fails the stage with the key named, and the models the worker holds stay held."""
    root, env = project_copy, worker_env(f"badkey-{os.getpid()}")
    assert by_hand(root, "rollout", "r2", env)["stage/worker_loads"] == 1
    good = (root / "params.yaml").read_text()
    (root / "params.yaml").write_text(good.replace("  temperature: 1.0\n", "  temprature: 1.0\n", 1))
    done = subprocess.run([sys.executable, "stages/rollout.py", "r2"], cwd=root, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 1
    assert "rollout@r2: " in done.stderr and "rollout.temprature: unknown key" in done.stderr
    assert "Traceback" not in done.stderr
    (root / "params.yaml").write_text(good)
    again = by_hand(root, "rollout", "r2", env)
    assert again["stage/worker_loads"] == 0 and again["stage/worker_reused"] == 1
    assert len(worker_pids(root)) == 1  # the same worker served all three


def test_the_fingerprint_stage_starts_the_worker_the_stages_then_use(project_copy):
    """The fingerprint stage starts the execution's worker once params.yaml is valid, without waiting for
    it; the next stage finds it (it listens before it imports) and no second worker starts."""
    root, env = project_copy, worker_env(f"early-{os.getpid()}")
    started = time.monotonic()
    subprocess.run([sys.executable, "stages/fingerprint.py"], cwd=root, env=env, check=True, timeout=120)
    assert time.monotonic() - started < 20  # it did not wait for the worker's imports
    # the worker logs its pid once it listens, which may be just after the fingerprint stage has exited
    while not worker_pids(root) and time.monotonic() - started < 60:
        time.sleep(0.05)
    assert len(worker_pids(root)) == 1
    assert by_hand(root, "rollout", "r2", env)["stage/worker_loads"] == 1
    subprocess.run([sys.executable, "stages/fingerprint.py"], cwd=root, env=env, check=True, timeout=120)
    assert len(worker_pids(root)) == 1  # one serves this execution already: no second one


def test_fingerprint_starts_no_worker_when_warm_worker_is_off_or_run_by_hand(project_copy):
    root = project_copy
    subprocess.run([sys.executable, "stages/fingerprint.py"], cwd=root, env=scratch_env(), check=True, timeout=120)
    with_params(root, **{"runtime.warm_worker": False})
    subprocess.run([sys.executable, "stages/fingerprint.py"], cwd=root, env=worker_env(f"off-{os.getpid()}"),
                   check=True, timeout=120)
    assert worker_pids(root) == []


def test_a_worker_that_cannot_import_its_libraries_sends_the_stage_to_run_cold(tmp_path):
    """The stage waiting on a worker whose imports fail is told so, and runs in its own process. Here a
    broken `torch` shadows the real one: the worker fails on it; `prepare` needs no torch and succeeds."""
    root = make_project(tmp_path / "project")
    broken = tmp_path / "broken"
    (broken / "torch").mkdir(parents=True)
    (broken / "torch" / "__init__.py").write_text("raise ImportError('a torch broken on purpose by the test')\n")
    env = {**worker_env(f"broken-{os.getpid()}"), "PYTHONPATH": str(broken)}
    done = subprocess.run([sys.executable, "stages/prepare.py"], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    # told by the worker, or (when it failed before the stage connected) by its exit
    assert ("the warm worker could not import its libraries" in done.stderr
            or "the warm worker did not start" in done.stderr)
    assert "running this stage in its own process" in done.stderr
    assert (root / "runs/data/train.parquet").is_file()
    log = (root / WORKER_LOG).read_text()
    assert "could not start" in log and "a torch broken on purpose by the test" in log


def test_a_stage_reads_the_answer_of_a_worker_that_closed_before_taking_its_request(tmp_path):
    """The race the test above can hit: the failing worker answers the stage waiting in its backlog and
    closes before the stage has sent its request. The send then fails (broken pipe), and the answer that
    already arrived is what counts; with none, the stage is told to run in its own process."""
    from rlpipe.worker.client import run_in_worker

    for answer in ({"ok": False, "kind": "unavailable", "error": "the warm worker could not import its libraries"}, None):
        stage_end, worker_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        if answer is not None:
            worker_end.sendall((json.dumps(answer) + "\n").encode())
        worker_end.close()
        got = run_in_worker(stage_end, "prepare", None, tmp_path)
        assert got["kind"] == "unavailable" and not got["ok"]
        assert got == answer if answer else "before taking the stage" in got["error"]


@pytest.mark.slow
def test_killed_worker_fails_the_stage_clearly_and_repro_completes(mini_run, tmp_path):
    """SIGKILL the worker as soon as it has started init: the stage fails with one clear message and
    leaves no output; the next `dvc repro` writes what an uninterrupted run wrote."""
    reference = artifact_hashes(mini_run[0])
    root = make_project(tmp_path / "project")
    proc = subprocess.Popen(["dvc", "repro"], cwd=root, env=scratch_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    while "rlpipe worker: init started" not in ((root / WORKER_LOG).read_text() if (root / WORKER_LOG).is_file() else ""):
        assert time.monotonic() < deadline and proc.poll() is None, "the run ended before init started"
        time.sleep(0.05)
    # at once: the miniature warm start (100 steps) can write its checkpoint within 0.5 s of starting, and a
    # worker killed after that write but before its answer fails the stage with the output complete
    os.kill(worker_pids(root)[-1], signal.SIGKILL)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0
    assert "init: the warm worker stopped in the middle of the stage" in out, out
    assert not (root / "runs/policy/r0").exists()
    log = dvc(root, "repro")
    assert "init" in ran_stages(log)
    assert artifact_hashes(root) == reference


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["grpo", "ppo"])
def test_warm_and_cold_runs_write_the_same_bytes(preset, tmp_path):
    """Three rounds of the miniature pipeline through the worker and as cold processes: every artifact of
    every stage of every round is byte-identical."""
    hashes = {}
    for warm in (True, False):
        root = make_project(tmp_path / f"{preset}-{warm}")
        params = yaml.safe_load((root / "params.yaml").read_text())
        params["algorithm"]["preset"] = preset
        params["runtime"]["warm_worker"] = warm
        params["rounds"] = 3
        (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        subprocess.run(["rlpipe", "pipeline"], cwd=root, check=True, env=scratch_env(), capture_output=True)
        dvc(root, "repro")
        metrics = json.loads((root / "runs/stage_metrics/rollout_r3.json").read_text())
        assert ("stage/worker_loads" in metrics) == warm
        hashes[warm] = artifact_hashes(root)
    assert len(hashes[True]) > 40
    differ = differing_artifacts(hashes[True], hashes[False])
    assert not differ, differ
