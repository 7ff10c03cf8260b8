"""Bounded disk for long runs: `rlpipe prune --keep K [--remote NAME]` drops old rounds' checkpoints.

What a run stores each round, and what needs it later:
- the round's tables (`runs/rounds/rK/*.parquet`): small (a few MB); kept;
- the policy checkpoint `runs/policy/rK` (weights, tokenizer and the AdamW state, twice the weights'
  size) and the critic `runs/critic/rK`: the bulk (1.36 GB a round at 113M parameters, tens of GB at 7B).
  The next round needs the last one; a rerun of round K needs round K-1's; evaluate's learning curve
  reads every round's policy.

`prune --keep K` keeps r0 (the reference) and the latest K rounds' checkpoints, and removes the older
ones from the workspace and from the local DVC cache (after `dvc push` to the remote, when one is named;
objects a kept output shares, such as an unchanged tokenizer file, stay). The lock files keep their
hashes, so `dvc pull rounds/rK/dvc.yaml:update` brings a round back from the remote. `runs/pruned.json`
records what was pruned. A 200-round run then keeps K + 1 checkpoints locally instead of 201.

Afterwards:
- `dvc repro --allow-missing` skips the pruned rounds (their outputs are missing, nothing else changed)
  and runs what is new;
- a stage that would need a pruned checkpoint (plain `dvc repro`, which wants every output present, a
  rerun of an old round, evaluate's curve) stops before it loads anything, naming the pruned path and the
  command that restores it (`check_inputs`): never a silent recompute of the run from round 1, and never a
  fresh optimizer in place of a pruned one (`rlpipe.train.loop.saved_optimizer`);
- `rlpipe prune --clear` forgets the record, for when the pruned rounds should be recomputed.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import yaml

from rlpipe import paths
from rlpipe.errors import PipelineError

MANIFEST = paths.RUNS / "pruned.json"


class PrunedInputError(PipelineError):
    """A stage needs a checkpoint `rlpipe prune` removed."""


def producer(path: Path) -> str:
    """The DVC address of the stage that writes a round's checkpoint (runs/policy/rK, runs/critic/rK)."""
    return f"rounds/{Path(path).name}/dvc.yaml:update"


def load_manifest(root: Path) -> dict:
    path = root / MANIFEST
    return json.loads(path.read_text()) if path.is_file() else {"pruned": {}}


def check_inputs(stage: str, round_name: str | None, params_rounds: int, root: Path) -> None:
    """Stop a stage that reads, or would rewrite, a checkpoint that was pruned and is not back on disk."""
    from rlpipe.pipeline import stage_data

    pruned = load_manifest(root)["pruned"]
    if not pruned:
        return
    reads, writes = stage_data(stage, round_name)
    if stage == "evaluate":  # the learning curve reads every round's policy
        reads = [*reads, *(paths.policy_dir(f"r{k}") for k in range(1, params_rounds + 1))]
    reads = [Path(str(p).replace("${rounds}", str(params_rounds))) for p in reads]
    for path, role in [*((p, "reads") for p in reads), *((p, "writes") for p in writes)]:
        entry = pruned.get(path.as_posix())
        if entry is None or (root / path).exists():
            continue
        source = f"from remote '{entry['remote']}'" if entry["remote"] else "(it was not pushed to a remote)"
        restore = f"`dvc pull {producer(path)}` restores it {source}" if entry["remote"] else \
            f"it can only be recomputed {source}: `rlpipe prune --clear`, then `dvc repro`"
        raise PrunedInputError(
            f"{path}, which this stage {role}, was pruned by `rlpipe prune --keep {entry['keep']}` on "
            f"{entry['when']}; {restore}. `dvc repro --allow-missing` skips the pruned rounds instead.")


def cache_objects(root: Path, out: dict) -> set[str]:
    """The cache objects (md5s) of one lock-file output: a file, or a directory and every file in it."""
    digest = out.get("md5")
    if not digest:
        return set()
    objects = {digest}
    if digest.endswith(".dir"):
        manifest = root / ".dvc/cache/files/md5" / digest[:2] / digest[2:]
        if manifest.is_file():
            objects |= {entry["md5"] for entry in json.loads(manifest.read_text())}
    return objects


def lock_outputs(root: Path) -> dict[str, dict]:
    """Every output recorded in the project's lock files: path -> its lock entry."""
    outputs = {}
    for lock in [root / "dvc.lock", *sorted((root / "rounds").glob("r*/dvc.lock"))]:
        if lock.is_file():
            for stage in (yaml.safe_load(lock.read_text()) or {}).get("stages", {}).values():
                outputs.update({out["path"]: out for out in stage.get("outs", [])})
    return outputs


def prune(root: Path, keep: int, rounds: int, remote: str | None = None) -> list[Path]:
    """Remove the checkpoints of rounds 1 .. rounds-keep from the workspace and the local cache (pushing
    them to `remote` first); returns what was removed."""
    if keep < 1:
        raise PipelineError("rlpipe prune: --keep must be at least 1 (the next round starts from the last one)")
    targets = [p for k in range(1, rounds - keep + 1) for p in (paths.policy_dir(f"r{k}"), paths.critic_dir(f"r{k}"))]
    targets = [p for p in targets if (root / p).exists()]
    if not targets:
        return []
    if remote:
        stages = sorted({producer(p) for p in targets})
        done = subprocess.run(["dvc", "push", "-r", remote, *stages], cwd=root, capture_output=True, text=True)
        if done.returncode != 0:
            raise PipelineError(f"rlpipe prune: `dvc push -r {remote}` failed, nothing was removed:\n{done.stderr}")
    outputs = lock_outputs(root)
    pruned = {p.as_posix() for p in targets}
    keep_objects = set().union(*(cache_objects(root, out) for path, out in outputs.items() if path not in pruned))
    drop = set().union(*(cache_objects(root, outputs[p]) for p in pruned if p in outputs)) - keep_objects
    for digest in drop:
        (root / ".dvc/cache/files/md5" / digest[:2] / digest[2:]).unlink(missing_ok=True)
    for path in targets:
        shutil.rmtree(root / path)
    manifest = load_manifest(root)
    when = time.strftime("%Y-%m-%d %H:%M")
    manifest["pruned"].update({p: {"keep": keep, "remote": remote, "when": when} for p in pruned})
    (root / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return targets


def clear(root: Path) -> bool:
    """Forget what was pruned (the stages that need it will then be recomputed by `dvc repro`)."""
    path = root / MANIFEST
    existed = path.is_file()
    path.unlink(missing_ok=True)
    return existed
