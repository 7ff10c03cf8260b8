"""Nothing lost, nothing half-written: corrupt stage inputs end in one clear message and no output;
two runs with one seed give byte-identical artifacts; a SIGKILL at any moment of rollout, advantage
or update is repaired by the next `dvc repro`, which ends with the same bytes as an uninterrupted run.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import yaml

from rlpipe.scratch_project import scratch_env
from scratch import artifact_hashes, differing_artifacts, dvc, dvc_target, make_project, ran_stages

ROUND_DIR = Path("runs/rounds/r1")


def copy_project(root: Path, dst: Path) -> Path:
    """A copy of a finished mini project whose stages run by hand with tracking off."""
    shutil.copytree(root, dst, ignore=shutil.ignore_patterns("cache", "mlruns", "mlflow.db", "tmp"))
    params = yaml.safe_load((dst / "params.yaml").read_text())
    params["tracking"]["enabled"] = False
    (dst / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return dst


def run_stage_script(root: Path, stage: str, round_name: str = "r1") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, f"stages/{stage}.py", round_name], cwd=root, capture_output=True,
                          text=True, env=scratch_env(), timeout=300)


def rewrite(path: Path, change) -> None:
    pq.write_table(change(pq.read_table(path)), path)


def set_column(table: pa.Table, name: str, values) -> pa.Table:
    return table.set_column(table.column_names.index(name), name, pa.array(values, type=table.schema.field(name).type))


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def with_nan_reward(table: pa.Table) -> pa.Table:
    rewards = table.column("reward").to_pylist()
    rewards[5] = math.nan
    return set_column(table, "reward", rewards)


def with_nan_advantage(table: pa.Table) -> pa.Table:
    advantages = table.column("advantages").to_pylist()
    row = next(i for i, a in enumerate(advantages) if a)
    advantages[row] = [math.nan] * len(advantages[row])
    return set_column(table, "advantages", advantages)


# (stage, artifact it reads, corruption, what the message must name besides the file)
CORRUPTIONS = {
    "truncated parquet": ("advantage", "rewards.parquet", truncate, "not a readable Parquet file"),
    "missing column": ("advantage", "rewards.parquet",
                       lambda p: rewrite(p, lambda t: t.drop_columns(["reward"])), "'reward' is missing"),
    "wrong dtype": ("advantage", "rewards.parquet",
                    lambda p: rewrite(p, lambda t: t.set_column(t.column_names.index("reward"), "reward",
                                                                pc.cast(t.column("reward"), pa.string()))),
                    "'reward' has type string"),
    "NaN rewards": ("advantage", "rewards.parquet", lambda p: rewrite(p, with_nan_reward), "'reward' row 5 is not finite"),
    "empty rewards": ("advantage", "rewards.parquet", lambda p: rewrite(p, lambda t: t.slice(0, 0)), "empty"),
    "empty batch": ("update", "batch.parquet", lambda p: rewrite(p, lambda t: t.slice(0, 0)), "empty"),
    "NaN advantages": ("update", "batch.parquet", lambda p: rewrite(p, with_nan_advantage), "'advantages' row"),
    "ragged logprobs": ("update", "batch.parquet",
                        lambda p: rewrite(p, lambda t: set_column(t, "old_logprobs", [
                            lp[:-1] if i == 3 else lp for i, lp in enumerate(t.column("old_logprobs").to_pylist())])),
                        "'old_logprobs' row 3"),
}
OUTPUT_OF = {"advantage": ROUND_DIR / "batch.parquet", "update": Path("runs/policy/r1")}


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_corrupt_input_fails_clearly_and_writes_nothing(case, mini_run, tmp_path):
    stage, artifact, corrupt, expected = CORRUPTIONS[case]
    root = copy_project(mini_run[0], tmp_path / "project")
    corrupt(root / ROUND_DIR / artifact)
    output = root / OUTPUT_OF[stage]
    shutil.rmtree(output) if output.is_dir() else output.unlink()

    done = run_stage_script(root, stage)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    message = done.stderr.strip().splitlines()[-1]
    assert message.startswith(f"{stage}@r1: ") and artifact in message and expected in message, message
    assert not output.exists()
    leftovers = [p.name for p in output.parent.iterdir() if ".tmp-" in p.name]
    assert not leftovers, leftovers


def test_every_group_dropped_skips_the_round_with_a_message(mini_run, tmp_path):
    """Dynamic sampling with no group carrying signal: the round is skipped (issue 5), not crashed."""
    root = copy_project(mini_run[0], tmp_path / "project")
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["algorithm"]["dynamic_sampling"] = True
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    rewards = root / ROUND_DIR / "rewards.parquet"
    rewrite(rewards, lambda t: set_column(set_column(t, "reward", [0.0] * t.num_rows), "correct", [False] * t.num_rows))

    advantage = run_stage_script(root, "advantage")
    assert advantage.returncode == 0, advantage.stderr
    assert "no group carries signal" in advantage.stderr
    batch = pq.read_table(root / ROUND_DIR / "batch.parquet")
    assert not any(batch.column("kept").to_pylist())

    update = run_stage_script(root, "update")
    assert update.returncode == 0, update.stderr
    assert "carried over unchanged" in update.stderr
    before = (root / "runs/policy/r0/model.safetensors").read_bytes()
    assert (root / "runs/policy/r1/model.safetensors").read_bytes() == before


# ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def second_run(tmp_path_factory):
    root = make_project(tmp_path_factory.mktemp("determinism") / "project")
    dvc(root, "repro")
    return root


@pytest.mark.slow
def test_two_runs_with_one_seed_give_identical_artifacts(mini_run, second_run):
    first, second = artifact_hashes(mini_run[0]), artifact_hashes(second_run)
    assert len(first) > 20 and first.keys() == second.keys()
    differ = [name for name in first if first[name] != second[name]]
    assert not differ, differ


KILLS_PER_STAGE = 10


def lock_file(root: Path, stage: str) -> tuple[Path, str]:
    """The lock file that records `advantage@r1`, and its name there."""
    path, _, name = dvc_target(stage).rpartition(":")
    return root / (path.replace("dvc.yaml", "dvc.lock") if path else "dvc.lock"), name or stage


def forget_cached_outputs(root: Path, stage: str) -> None:
    """Remove the stage's outputs (per its lock file) from the DVC cache, and the run cache."""
    lock, name = lock_file(root, stage)
    for out in yaml.safe_load(lock.read_text())["stages"][name]["outs"]:
        digest = out["md5"]
        (root / ".dvc/cache/files/md5" / digest[:2] / digest[2:]).unlink(missing_ok=True)
    shutil.rmtree(root / ".dvc/cache/runs", ignore_errors=True)


def repair_dvc_files_cut_by_the_kill(root: Path, lock: Path, committed_lock: str) -> None:
    """DVC 3 rewrites its own files by truncating them and then writing (not atomically), so a SIGKILL
    of dvc itself can cut one short. The README says what a user does, and so does this:
    - `.dvc/tmp/rwlock` (it only lists live dvc processes) is deleted when it does not parse;
    - the stage's lock file is checked out again (here: the copy taken before the kill) when it does not
      parse."""
    rwlock = root / ".dvc/tmp/rwlock"
    try:
        json.loads(rwlock.read_text())
    except FileNotFoundError:
        pass
    except json.JSONDecodeError:
        rwlock.unlink()
    try:
        parsed = yaml.safe_load(lock.read_text())
    except yaml.YAMLError:
        parsed = None
    if not isinstance(parsed, dict) or "stages" not in parsed:
        lock.write_text(committed_lock)


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["rollout@r1", "advantage@r1", "update@r1"])
def test_sigkill_at_random_moments_then_repro_restores_the_same_bytes(stage, mini_run, second_run):
    """`dvc repro -f -s STAGE` is killed (SIGKILL to dvc and the stage, its process group) at random
    moments; each time a plain `dvc repro` must complete and leave every artifact as an uninterrupted
    run wrote it. The stage's outputs are dropped from the DVC cache (and the run cache emptied) before
    each kill, as on a first run of these params: otherwise `dvc repro` would check them out of the
    cache instead of rerunning the stage."""
    reference = artifact_hashes(mini_run[0])
    root = second_run
    env = scratch_env()
    command = ["dvc", "repro", "-f", "-s", dvc_target(stage)]
    lock, _ = lock_file(root, stage)
    started = time.monotonic()
    subprocess.run(command, cwd=root, env=env, check=True, capture_output=True)
    duration = time.monotonic() - started
    rng, reran = random.Random(stage), 0
    for kill in range(KILLS_PER_STAGE):
        forget_cached_outputs(root, stage)
        committed_lock = lock.read_text()
        proc = subprocess.Popen(command, cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        time.sleep(rng.uniform(0.05, 1.0) * duration)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        repair_dvc_files_cut_by_the_kill(root, lock, committed_lock)
        reran += stage in ran_stages(dvc(root, "repro"))
        now = artifact_hashes(root)
        differ = differing_artifacts(now, reference)
        assert not differ, f"kill {kill} of {stage}: {differ}"
    # most kills must have landed while the stage ran (its outputs gone or partial, so repro reran it)
    assert reran >= KILLS_PER_STAGE // 2, f"only {reran} of {KILLS_PER_STAGE} kills interrupted {stage}"
