"""Bounded disk: `rlpipe prune --keep K` drops old rounds' checkpoints; what needs one stops and says how
to restore it; `dvc repro --allow-missing` carries on; `dvc pull` brings a pruned round back."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from rlpipe.scratch_project import scratch_env
from scratch import dvc, make_project


def rlpipe(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["rlpipe", *args], cwd=root, env=scratch_env(), capture_output=True, text=True, timeout=300)


def unique_bytes(*dirs: Path) -> int:
    seen, total = set(), 0
    for d in dirs:
        for path in d.rglob("*"):
            info = path.lstat()
            if path.is_file() and info.st_ino not in seen:
                seen.add(info.st_ino)
                total += info.st_size
    return total


@pytest.fixture(scope="module")
def three_rounds(tmp_path_factory):
    base = tmp_path_factory.mktemp("retention")
    params = yaml.safe_load((Path(__file__).parent / "params_mini.yaml").read_text())
    params["rounds"] = 3
    params["tracking"]["enabled"] = False
    (base / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    root = make_project(base / "project", base / "params.yaml")
    dvc(root, "repro")
    remote = base / "remote"
    dvc(root, "remote", "add", "-d", "storage", str(remote))
    return root


def test_outputs_and_cache_share_every_byte(three_rounds):
    """cache.type hardlink: the workspace's outputs and the cache are the same files, and no stage wrote
    through a link (every cached object still hashes to its name)."""
    import hashlib

    root = three_rounds
    weights = root / "runs/policy/r2/model.safetensors"
    assert weights.stat().st_nlink == 2
    runs, cache = unique_bytes(root / "runs"), unique_bytes(root / ".dvc/cache/files")
    assert unique_bytes(root / "runs", root / ".dvc/cache/files") < 1.02 * max(runs, cache)
    for obj in (root / ".dvc/cache/files/md5").rglob("*"):
        if obj.is_file() and not obj.name.endswith(".dir"):
            assert hashlib.md5(obj.read_bytes()).hexdigest() == obj.parent.name + obj.name, obj


def test_prune_keeps_the_latest_rounds_and_stops_what_needs_the_others(three_rounds, tmp_path):
    import shutil

    root = tmp_path / "project"
    shutil.copytree(three_rounds, root, symlinks=True)
    before = unique_bytes(root / "runs", root / ".dvc/cache")
    done = rlpipe(root, "prune", "--keep", "1", "--remote", "storage")
    assert done.returncode == 0, done.stderr
    assert not (root / "runs/policy/r1").exists() and not (root / "runs/critic/r2").exists()
    assert (root / "runs/policy/r0").is_dir() and (root / "runs/policy/r3").is_dir()
    assert unique_bytes(root / "runs", root / ".dvc/cache") < 0.6 * before

    # a stage that needs a pruned checkpoint stops before loading anything, naming it and the fix
    stage = subprocess.run(["python", "stages/rollout.py", "r2"], cwd=root, env=scratch_env(), capture_output=True,
                           text=True, timeout=300)
    assert stage.returncode == 1
    message = stage.stderr.strip().splitlines()[-1]
    assert message.startswith("rollout@r2: runs/policy/r1, which this stage reads, was pruned by `rlpipe prune --keep 1`")
    assert "`dvc pull rounds/r1/dvc.yaml:update` restores it from remote 'storage'" in message
    # plain repro wants every output present: it stops at the first pruned round, with the same message
    repro = subprocess.run(["dvc", "repro"], cwd=root, env=scratch_env(), capture_output=True, text=True, timeout=600)
    assert repro.returncode != 0 and "was pruned by `rlpipe prune --keep 1`" in repro.stdout + repro.stderr
    # --allow-missing skips the pruned rounds: nothing else changed
    assert "Data and pipelines are up to date" in dvc(root, "repro", "--allow-missing")
    # and the remote brings a pruned round back, byte for byte
    dvc(root, "pull", "rounds/r1/dvc.yaml:update")
    assert (root / "runs/policy/r1/optimizer.pt").is_file()
    assert (root / "runs/policy/r1/model.safetensors").read_bytes() == \
        (three_rounds / "runs/policy/r1/model.safetensors").read_bytes()


def test_a_missing_optimizer_state_stops_the_update(three_rounds, tmp_path):
    """Never a fresh optimizer in place of a lost one."""
    import shutil

    root = tmp_path / "project"
    shutil.copytree(three_rounds, root, symlinks=True)
    (root / "runs/policy/r1/optimizer.pt").unlink()
    shutil.rmtree(root / "runs/policy/r2")
    done = subprocess.run(["python", "stages/update.py", "r2"], cwd=root, env=scratch_env(), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 1
    assert "runs/policy/r1/optimizer.pt: the optimizer state of this trained checkpoint is missing" in done.stderr
    assert not (root / "runs/policy/r2").exists()
