"""Presets x seeds through `dvc exp run`, resumable, with a report that carries its uncertainty.

`scripts/preset_sweep.py` is the command line. A sweep lives in one directory (`--out`):

- `project/`: a scratch git + DVC project (`rlpipe.scratch_project`) holding a copy of this checkout's
  code and the sweep's params file, made once. Every run is `dvc exp run --temp -n <run>-s<seed>`
  in it, so all runs share its DVC cache and run cache (a seed's data and warm start are computed once,
  by a warm-up run per seed before the presets start) and its MLflow store (`project/mlflow.db`). Its
  stages import the copied code (PYTHONPATH), so editing the checkout during a sweep changes nothing.
- `runs/<run>-s<seed>.json`: one record per finished run, written atomically as soon as it finishes:
  eval.json from the experiment's commit, every stage's metrics from MLflow, and the wall time. A sweep
  started again skips the runs that have a record: killing it loses at most the runs in flight.
- `sweep.json`: what the sweep is (code commit, params, overrides, presets, seeds). A restart may add
  presets or seeds; one with other params or overrides is refused rather than mixed into the same table.
- `report.md` and `*.png`: `rlpipe.sweep_report` over whatever records exist, partial sweeps included
  (each row says how many seeds it has).

- `slots/<i>/`: one git clone of the project per job, sharing the project's DVC cache (and so its run
  cache) and MLflow store. A slot runs one experiment at a time; each finished experiment's ref is
  fetched into the project, so `dvc exp show` there lists them all.

Runs go `--jobs` at a time (threads, each waiting on its own `dvc exp run --temp` in a slot of its own,
which is what `dvc queue start -j N` does as well, without a Celery worker to clean up after a kill).
Two `dvc exp run --temp` in one repository race: each runs the first entry of the one stash they share
(dvc/repo/experiments/queue/tempdir.py), so one that ends as the other starts takes the other's entry,
and the other runs the same stash commit again with no name. Measured in CI on 2026-12-05: five
experiment refs for four runs, one of them `exp-8a16f`. A clone per slot gives each its own stash.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rlpipe.atomic import atomic_write_text
from rlpipe.scratch_project import CHECKOUT, copy_pipeline, scratch_env


@dataclass(frozen=True)
class SweepSpec:
    """What a sweep runs; stored as sweep.json and compared on every restart."""
    params_file: str
    """The params file copied into the project as its params.yaml (as given on the command line)."""
    params_text: str
    """Its contents when the sweep started."""
    overrides: tuple[str, ...]
    """`-S key=value` applied to every run."""
    presets: tuple[str, ...]
    """Run entries: a preset, or a preset with its own overrides (`vapo+value.pretrain.max_steps=0`)."""
    seeds: tuple[int, ...]
    code_commit: str = ""
    """The checkout's commit when the project was made (with `+dirty` for uncommitted changes)."""

    def run_names(self) -> list[tuple[str, int]]:
        """Seed-major: a partial sweep has every preset at the first seeds, not some presets at all seeds."""
        return [(preset, seed) for seed in self.seeds for preset in self.presets]


def named_ref(repo: Path, name: str) -> str | None:
    """The ref of the DVC experiment called `name` in the git repository `repo`, if any."""
    refs = subprocess.run(["git", "for-each-ref", "--format=%(refname)", "refs/exps"], cwd=repo,
                          capture_output=True, text=True, check=True).stdout.split()
    return next((ref for ref in refs if ref.rsplit("/", 1)[-1] == name), None)


def parse_entry(entry: str) -> tuple[str, list[str]]:
    """`vapo+value.pretrain.max_steps=0` -> ("vapo", ["value.pretrain.max_steps=0"])."""
    preset, *overrides = entry.split("+")
    return preset, overrides


def run_name(entry: str, seed: int) -> str:
    """The experiment's name and the record's file name: a git ref name, so only letters, digits and -."""
    return f"{re.sub(r'[^A-Za-z0-9]+', '-', entry).strip('-')}-s{seed}"


def code_commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=CHECKOUT, capture_output=True, text=True).stdout.strip()

    sha = git("rev-parse", "--short", "HEAD")
    # the sweep's own files run no stage, so their edits do not make the runs' code dirty
    changed = git("status", "--porcelain", "--", "rlpipe", "stages", ":!rlpipe/sweep.py", ":!rlpipe/sweep_report.py")
    return sha + ("+dirty" if changed else "")


@dataclass
class Sweep:
    out: Path
    spec: SweepSpec
    _lock: threading.Lock = field(default_factory=threading.Lock)
    free_slots: queue.Queue = field(default_factory=queue.Queue)
    """Slots no run holds now: `run` fills it, each `exp_run` takes one and gives it back."""

    @property
    def project(self) -> Path:
        return self.out / "project"

    @property
    def records(self) -> Path:
        return self.out / "runs"

    def record_path(self, entry: str, seed: int) -> Path:
        return self.records / f"{run_name(entry, seed)}.json"

    def say(self, text: str) -> None:
        with self._lock:
            print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)

    # -- the project ---------------------------------------------------------------------------------

    def prepare(self) -> None:
        """Make the project and sweep.json, or check that they are this sweep's."""
        spec_path = self.out / "sweep.json"
        if spec_path.exists():
            stored = json.loads(spec_path.read_text())
            mine = asdict(self.spec)
            # presets and seeds only list runs: a restart may add some; what every run shares may not change
            differ = [k for k in ("params_text", "overrides") if json.dumps(stored.get(k)) != json.dumps(mine[k])]
            if differ:
                raise SystemExit(f"{spec_path}: this sweep was started with other {', '.join(differ)}; "
                                 f"use another --out, or delete {self.out} to start over")
            self.spec = SweepSpec(**{**mine, "code_commit": stored.get("code_commit", ""),
                                     "presets": tuple(dict.fromkeys([*stored["presets"], *mine["presets"]])),
                                     "seeds": tuple(dict.fromkeys([*stored["seeds"], *mine["seeds"]]))})
        if not (self.project / ".git").exists():
            copy_pipeline(self.project, self.spec.params_text, committer="rlpipe-sweep")
            self.spec = SweepSpec(**{**asdict(self.spec), "code_commit": code_commit()})
        self.out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(spec_path, json.dumps(asdict(self.spec), indent=2) + "\n")
        self.records.mkdir(exist_ok=True)

    def slot(self, index: int) -> Path:
        """The clone that runs the `index`th job's experiments, made on first use: its DVC cache is the
        project's, so every slot hits the run cache that any slot filled."""
        path = self.out / "slots" / str(index)
        if not path.exists():
            partial = path.with_name(f"{index}.partial")  # renamed into place when complete
            shutil.rmtree(partial, ignore_errors=True)  # left by a kill
            partial.parent.mkdir(parents=True, exist_ok=True)
            subprocess.run(["git", "clone", "-q", str(self.project.resolve()), str(partial)], check=True)
            cache = (self.project / ".dvc" / "cache").resolve()
            subprocess.run(["dvc", "config", "--local", "cache.dir", str(cache)], cwd=partial, check=True,
                           capture_output=True, env=self.env())
            partial.rename(path)
        return path

    def slots(self) -> list[Path]:
        return sorted(p for p in (self.out / "slots").glob("*") if p.name.isdigit())

    def env(self) -> dict[str, str]:
        # the copied code, not the checkout's editable install: the sweep's code is frozen at its start
        # and this interpreter's dvc and python, whichever shell started the sweep; one MLflow store
        # for every slot, the project's
        env = scratch_env()
        return {**env, "PYTHONPATH": str(self.project.resolve()),
                "MLFLOW_TRACKING_URI": f"sqlite:///{(self.project / 'mlflow.db').resolve()}",
                "PATH": os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])}

    def experiment_ref(self, name: str) -> str | None:
        """The project's ref of experiment `name`, fetched from the slot that ran it if need be (a kill
        between a run's end and the fetch)."""
        ref = named_ref(self.project, name)
        if ref:
            return ref
        for slot in self.slots():
            ref = named_ref(slot, name)
            if ref:
                subprocess.run(["git", "fetch", "-q", str(slot.resolve()), f"{ref}:{ref}"], cwd=self.project,
                               check=True, capture_output=True)
                return ref
        return None

    # -- running -------------------------------------------------------------------------------------

    def exp_run(self, name: str, overrides: list[str], targets: list[str] = ()) -> float:
        args = ["exp", "run", "--temp", "-n", name]
        for override in [*self.spec.overrides, *overrides]:
            args += ["-S", override]
        slot = self.free_slots.get()
        try:
            started = time.monotonic()
            done = subprocess.run(["dvc", *args, *targets], cwd=slot, capture_output=True, text=True, env=self.env())
            wall = time.monotonic() - started
            if done.returncode == 0:
                self.experiment_ref(name)  # fetched into the project while the slot is still this run's
        finally:
            self.free_slots.put(slot)
        if done.returncode != 0:
            (self.out / "failed").mkdir(exist_ok=True)
            (self.out / "failed" / f"{name}.log").write_text(done.stdout + done.stderr)
            raise RuntimeError(f"{name}: dvc exp run failed (exit {done.returncode}); "
                               f"log in {self.out / 'failed' / (name + '.log')}")
        return wall

    def warm_up(self, seed: int) -> None:
        """Data and warm start of one seed, so that the presets after it hit the run cache."""
        name = f"warm-s{seed}"
        if self.experiment_ref(name):
            return
        self.say(f"seed {seed}: data and warm start ...")
        wall = self.exp_run(name, [f"seed={seed}"], ["init"])
        self.say(f"seed {seed}: warm start done, {wall:.0f} s")

    def run_one(self, entry: str, seed: int) -> None:
        name = run_name(entry, seed)
        if self.record_path(entry, seed).exists():
            return
        wall = None
        if not self.experiment_ref(name):  # else it finished before a kill, and only its record is missing
            self.say(f"{name} ...")
            preset, overrides = parse_entry(entry)
            wall = self.exp_run(name, [f"seed={seed}", f"algorithm.preset={preset}", *overrides])
        record = self.collect(name, entry, seed, wall)
        atomic_write_text(self.record_path(entry, seed), json.dumps(record, indent=1) + "\n")
        self.say(f"{name}: pass@1 {record['eval']['pass@1_init']:.3f} -> {record['eval']['pass@1']:.3f}"
                 + (f", {wall:.0f} s" if wall else ""))

    def collect(self, name: str, entry: str, seed: int, wall: float | None) -> dict:
        ref = self.experiment_ref(name)
        eval_json = subprocess.run(["git", "show", f"{ref}:runs/metrics/eval.json"], cwd=self.project,
                                   capture_output=True, text=True, check=True).stdout
        return {"preset": parse_entry(entry)[0], "label": entry, "seed": seed, "experiment": name, "wall_seconds": wall,
                "code_commit": self.spec.code_commit, "eval": json.loads(eval_json), "stages": self.stage_metrics(name)}

    def stage_metrics(self, name: str) -> list[dict]:
        """Every stage run of the experiment in MLflow: stage, round, and its metrics' last values. Stages
        the run cache restored did not run, so they are absent (value pretraining after the first critic
        preset of a seed: `rlpipe.sweep_report` takes it from that seed's first)."""
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=self.env()["MLFLOW_TRACKING_URI"])
        experiments = [e.experiment_id for e in client.search_experiments()]
        runs = client.search_runs(experiments, filter_string=f"tags.`dvc.exp_name` = '{name}'", max_results=5000)
        return sorted(({"stage": run.data.tags.get("rlpipe.stage", ""), "round": run.data.tags.get("rlpipe.round", ""),
                        "metrics": run.data.metrics} for run in runs if run.data.tags.get("rlpipe.stage") != "pipeline"),
                      key=lambda s: (s["round"], s["stage"]))

    def run(self, jobs: int) -> list[str]:
        """Every missing run, `jobs` at a time; returns the failures (the others still run)."""
        self.prepare()
        for index in range(jobs):
            self.free_slots.put(self.slot(index))
        todo = [(p, s) for p, s in self.spec.run_names() if not self.record_path(p, s).exists()]
        self.say(f"{len(self.spec.run_names()) - len(todo)} of {len(self.spec.run_names())} runs recorded; "
                 f"{len(todo)} to go, {jobs} at a time, in {self.project}")
        failures: list[str] = []

        def attempt(job) -> bool:
            try:
                job()
                return True
            except Exception as err:  # one bad run must not stop the sweep; it is reported at the end
                failures.append(str(err))
                self.say(str(err))
                return False

        def after_warm_up(entry: str, seed: int) -> None:
            if not warmed[seed].result():
                raise RuntimeError(f"{run_name(entry, seed)}: not run, the warm-up of seed {seed} failed")
            self.run_one(entry, seed)

        with ThreadPoolExecutor(jobs) as pool:
            # the warm-ups first, so that no thread waits on a warm-up queued behind it
            warmed = {seed: pool.submit(attempt, lambda seed=seed: self.warm_up(seed))
                      for seed in dict.fromkeys(s for _, s in todo)}
            runs = [pool.submit(attempt, lambda p=p, s=s: after_warm_up(p, s)) for p, s in todo]
            for future in runs:
                future.result()
        return failures


def oversubscription_warning(params_file: Path, overrides: tuple[str, ...], jobs: int) -> str | None:
    """A warning when `jobs` runs of `runtime.torch_threads` threads each ask for more threads than the
    machine has cores. Measured on 2 cores (`python -m benchmarks.oversubscription`): with 2 threads a run,
    two warm starts at once took 4.3x as long as one alone (OpenMP's threads wait on one another); with 1
    thread a run, two at once took no longer than one alone."""
    from rlpipe.config import load_params

    threads = load_params(params_file).runtime.torch_threads
    for override in overrides:
        key, _, value = override.lstrip("+").partition("=")
        if key == "runtime.torch_threads":
            threads = int(value)
    cores = os.cpu_count() or 1
    if jobs * threads <= cores:
        return None
    return (f"--jobs {jobs} x runtime.torch_threads {threads} = {jobs * threads} threads on {cores} cores: the runs "
            f"will slow each other down many times over; use --jobs {max(1, cores // threads)} or "
            f"-S runtime.torch_threads={max(1, cores // jobs)}")


def main(argv: list[str] | None = None) -> int:
    import argparse

    from rlpipe.config import PRESETS

    parser = argparse.ArgumentParser(prog="preset_sweep.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("presets", nargs="*", help="presets to run (default: all); PRESET+KEY=VALUE[+KEY=VALUE] "
                        "runs a preset with overrides of its own, as a row of its own")
    parser.add_argument("--params", default="params.yaml", help="params file the project starts from")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="seeds to run each preset with")
    parser.add_argument("-S", dest="overrides", action="append", default=[],
                        help="`dvc exp run -S key=value` for every run")
    parser.add_argument("--out", type=Path, required=True, help="the sweep's directory (made, or resumed)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once")
    parser.add_argument("--target", type=float, default=None,
                        help="pass@1 for the report's rounds-to-target column (default: the report's)")
    parser.add_argument("--report-only", action="store_true", help="write the report from the records; run nothing")
    args = parser.parse_args(argv)
    unknown = [p for p in args.presets if parse_entry(p)[0] not in PRESETS]
    if unknown:
        parser.error(f"unknown preset(s) {', '.join(unknown)}; choose from {', '.join(PRESETS)}")
    malformed = [o for p in args.presets for o in parse_entry(p)[1] if "=" not in o]
    if malformed:
        parser.error(f"override(s) without a value: {', '.join(malformed)}; write PRESET+KEY=VALUE")
    if not args.report_only:
        params_file = Path(args.params)
        if not params_file.is_file():
            parser.error(f"--params: no file {params_file}")
        spec = SweepSpec(params_file=args.params, params_text=params_file.read_text(), overrides=tuple(args.overrides),
                         presets=tuple(args.presets or PRESETS), seeds=tuple(args.seeds))
        warning = oversubscription_warning(params_file, spec.overrides, args.jobs)
        if warning:
            print(f"warning: {warning}", file=sys.stderr)
        failures = Sweep(args.out, spec).run(args.jobs)
    elif not (args.out / "runs").is_dir():
        parser.error(f"--out: {args.out} holds no sweep (no runs/ directory)")
    else:
        failures = []
    from rlpipe.sweep_report import write_report

    report = write_report(args.out, **({"target": args.target} if args.target is not None else {}))
    print(report.read_text())
    for failure in failures:
        print(f"failed: {failure}", file=sys.stderr)
    return 1 if failures else 0
