"""The pipeline's stages on the device machine's GPU, cold and through the warm worker, with and without
`runtime.deterministic`; whether their artifacts are the same bytes. `scripts/device_check.sh` runs it
after device_check.py, in the same command.

The device image has torch and transformers but neither DVC nor MLflow, so the stages run by hand, in the
pipeline's order, as `python stages/<stage>.py [round]` in a project of their own, with tracking off (a
stage run by hand joins the warm worker of the execution that RLPIPE_EXECUTION_ID names, README "The warm
worker").
1. One project (the checkout's pipeline, and its params.yaml or --params, with the --set changes): the
   stages before the rounds (fingerprint, prepare, init, value_pretrain), cold.
2. Four copies of it, each with its own `runtime` settings, run the rounds and evaluate: cold and warm,
   with `runtime.deterministic` on and off.
3. The sha256 of every artifact (`artifact_hashes`: data, checkpoints, round tables) compared: warm
   against cold at each setting, and the two cold runs against each other.

The figures (JSON): each stage's wall seconds and its own metrics (on a GPU with its peak and held GPU
memory, `stage/gpu_peak_gib`, `stage/gpu_held_gib`), each variant's greedy pass@1, the files that
differ. The file is rewritten after every stage, so a run cut off by its time limit keeps what
it did; --budget skips the variants that would start after that many seconds. On the CPU it runs
with the test's miniature params in about two minutes (tests/test_device_check.py), and there every
pair is the same bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

CHECKOUT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(CHECKOUT))

from rlpipe import paths  # noqa: E402
from rlpipe.scratch_project import artifact_hashes, differing_artifacts, write_project  # noqa: E402
from rlpipe.stages import STAGES  # noqa: E402
from rlpipe.worker.client import signal_workers  # noqa: E402

# (name, runtime.warm_worker, runtime.deterministic): the deterministic pair first, the claim that matters
VARIANTS = (("cold_deterministic", False, True), ("warm_deterministic", True, True),
            ("cold", False, False), ("warm", True, False))
COMPARISONS = (("warm_deterministic", "cold_deterministic"), ("warm", "cold"), ("cold", "cold_deterministic"))


def stage_commands(rounds: int) -> tuple[list[list[str]], list[list[str]]]:
    """The stages before the rounds (`fingerprint` first), and the rounds' stages followed by the stages
    after them, in the pipeline's order (`STAGES`), as stage-script arguments."""
    before, per_round, last = [["fingerprint"]], [], []
    for name, spec in STAGES.items():
        if spec.per_round:
            per_round.append(name)
        else:
            (last if per_round else before).append([name])
    return before, [[name, f"r{r}"] for r in range(1, rounds + 1) for name in per_round] + last


def set_key(params: dict, dotted: str, value) -> None:
    *sections, key = dotted.split(".")
    node = params
    for section in sections:
        node = node.setdefault(section, {})
    node[key] = value


def with_project(root: Path) -> str:
    """PYTHONPATH for a stage of the project at `root`: its own rlpipe first (the stages check that they
    run the project's code), then what the caller had (the device image's carried wheels)."""
    return os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)


def run_stage(root: Path, args: list[str], env: dict, timeout: float) -> dict:
    """One stage script, as a user runs it by hand: its seconds, exit and the metrics it wrote."""
    began = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, f"stages/{args[0]}.py", *args[1:]], cwd=root, env=env,
                              capture_output=True, text=True, timeout=max(1.0, timeout))
        ok, stderr = done.returncode == 0, done.stderr
    except subprocess.TimeoutExpired as err:  # its output comes as bytes, text=True or not
        ok, stderr = False, f"timed out after {err.timeout:.0f} s\n{(err.stderr or b'').decode(errors='replace')}"
    record = {"stage": "@".join(args), "seconds": round(time.perf_counter() - began, 3), "ok": ok}
    if not ok:
        record["error"] = stderr[-3000:]
    metrics = root / paths.stage_metrics_path(*args)
    if ok and metrics.is_file():
        record["metrics"] = json.loads(metrics.read_text())
    return record


def run_stages(root: Path, commands: list[list[str]], env: dict, deadline: float, log: list, save) -> bool:
    for args in commands:
        record = run_stage(root, args, env, deadline - time.monotonic())
        log.append(record)
        save()
        print(f"{root.name}: {record['stage']} {'ok' if record['ok'] else 'FAILED'} in {record['seconds']:.1f} s",
              flush=True)
        if not record["ok"]:
            print(record["error"], file=sys.stderr, flush=True)
            return False
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=Path, default=CHECKOUT / "params.yaml", help="the project's params (default: the checkout's)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a params change, the value read as YAML (repeatable)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--budget", type=float, default=270.0, help="seconds after which no variant starts (default 270)")
    parser.add_argument("--timeout", type=float, default=315.0,
                        help="seconds from the start after which a running stage is stopped (default 315)")
    parser.add_argument("--out", type=Path, default=Path("runs/device_check/device_pipeline.json"))
    parser.add_argument("--keep", type=Path, help="build the projects here and keep them (default: a temporary folder)")
    args = parser.parse_args()

    import torch

    started = time.monotonic()
    deadline = started + args.timeout
    params = yaml.safe_load(args.params.read_text())
    for change in args.set:
        key, _, value = change.partition("=")
        set_key(params, key, yaml.safe_load(value))
    params["rounds"] = args.rounds
    set_key(params, "tracking.enabled", False)  # no MLflow on the device image
    figures = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
               "torch": torch.__version__, "params_changes": args.set, "rounds": args.rounds,
               "stages": {}, "pass_at_1": {}, "differing_files": {}, "skipped": []}
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        figures["seconds"] = round(time.monotonic() - started, 1)
        args.out.write_text(json.dumps(figures, indent=2) + "\n")

    work = args.keep or Path(tempfile.mkdtemp(prefix="rlpipe-device-pipeline-"))
    before, after = stage_commands(args.rounds)
    base = write_project(work / "base", yaml.safe_dump(params, sort_keys=False))
    env = {**os.environ, "PYTHONPATH": with_project(base), "RLPIPE_PROGRESS": "0", "RLPIPE_EXECUTION_ID": ""}
    ok = run_stages(base, before, env, deadline, figures["stages"].setdefault("before_rounds", []), save)
    hashes = {}
    for name, warm, deterministic in VARIANTS if ok else ():
        if time.monotonic() - started > args.budget:
            figures["skipped"].append(name)
            continue
        root = work / name
        shutil.copytree(base, root, ignore=shutil.ignore_patterns("__pycache__", "tmp"))
        variant = yaml.safe_load((root / "params.yaml").read_text())
        set_key(variant, "runtime.warm_worker", warm)
        set_key(variant, "runtime.deterministic", deterministic)
        (root / "params.yaml").write_text(yaml.safe_dump(variant, sort_keys=False))
        # one execution for every stage of the variant, as under `dvc repro`: the warm ones share a worker
        variant_env = {**env, "PYTHONPATH": with_project(root), "RLPIPE_EXECUTION_ID": f"device-pipeline-{name}-{os.getpid()}"}
        try:
            done = run_stages(root, [["fingerprint"], *after], variant_env, deadline,
                              figures["stages"].setdefault(name, []), save)
        finally:
            signal_workers(root, signal.SIGKILL)
        if done:
            hashes[name] = artifact_hashes(root)
            evaluation = root / paths.EVAL
            if evaluation.is_file():
                scores = json.loads(evaluation.read_text())
                figures["pass_at_1"][name] = {"init": scores.get("pass@1_init"), "last_round": scores.get("pass@1")}
        for a, b in COMPARISONS:
            if a in hashes and b in hashes:
                figures["differing_files"][f"{a} vs {b}"] = differing_artifacts(hashes[a], hashes[b])
        figures["artifacts_compared"] = len(next(iter(hashes.values()), {}))
        save()
    if args.keep is None:
        shutil.rmtree(work, ignore_errors=True)
    save()
    print(json.dumps({k: figures[k] for k in ("device", "pass_at_1", "differing_files", "skipped", "seconds")}, indent=2))
    failed = [r["stage"] for runs in figures["stages"].values() for r in runs if not r["ok"]]
    return 1 if failed or not ok else 0


if __name__ == "__main__":
    sys.exit(main())
