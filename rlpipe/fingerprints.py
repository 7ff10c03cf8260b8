"""A round stage's fingerprint: the params values and the code it depends on, in one small file.

DVC's cost for a stage grows with what the stage declares: `dvc status` and a no-op `dvc repro` parse
every lock file and read params.yaml once per stage with params. Declared directly, each of the 4 x N
round stages listed about 30 library files and 7 params sections, so a round's lock was 700 lines, and
a 200-round project's `dvc status` parsed 140,000 lock lines and params.yaml 800 times: 34 s, 75% of it
in YAML parsing (profile in BENCHMARKS.md, section f). With fingerprints a round's lock is about 100
lines.

So the round stages declare their params and code through one file per stage family instead:
`runs/fingerprints/<stage>.json`, written by the `fingerprint` stage (root dvc.yaml), holds
- `params`: the value of every params key the stage reads (`rlpipe.pipeline.STAGE_PARAMS`), taken from
  the validated params, defaults included;
- `code`: the md5 of the stage's entry script and of every library file its work can import
  (`rlpipe.codedeps.stage_code_files`).
The `fingerprint` stage declares the union of those params and files itself, reruns on any change (in
about a second: no torch), and rewrites the four files; a file whose content did not change keeps its
hash, so only the round stages whose own params or code changed rerun (an estimator change reruns
advantage and update, never rollout and reward).

A round stage run by DVC checks at start that its fingerprint matches the params and code it runs with
now (`check_fingerprint`): it stops when the `fingerprint` stage has not run since an edit, as with
`dvc repro -s <round stage>`, naming what changed and the command to run. (A stage run by hand, outside
DVC, is recorded nowhere, and DVC reruns a stage whose outputs it did not write.)
"""

from __future__ import annotations

import json
from pathlib import Path

from rlpipe import paths
from rlpipe.atomic import atomic_write_text
from rlpipe.codedeps import source_md5, stage_code_files
from rlpipe.config import Params
from rlpipe.errors import PipelineError

STAGE = "fingerprint"
ROUND_STAGES = ("rollout", "reward", "advantage", "update")


class StaleFingerprintError(PipelineError):
    """A round stage's fingerprint was written for other params or code than the stage has now."""


def params_values(params: Params, keys: list[str]) -> dict:
    """The value of each dotted key (`algorithm.preset`, or a whole section) in the validated params."""
    dumped = params.model_dump(mode="json")
    values = {}
    for key in keys:
        value = dumped
        for part in key.split("."):
            value = value[part]
        values[key] = value
    return values


def fingerprint(stage: str, params: Params, root: Path) -> dict:
    """What round stage `stage` depends on besides its data: params values and code hashes."""
    from rlpipe.pipeline import STAGE_PARAMS

    return {"stage": stage,
            "params": params_values(params, STAGE_PARAMS[stage]),
            "code": {name: source_md5(root / name) for name in stage_code_files(stage)}}


def render(content: dict) -> str:
    return json.dumps(content, indent=1, sort_keys=True) + "\n"


def write_fingerprints(params: Params, root: Path) -> list[Path]:
    """The `fingerprint` stage's work: write runs/fingerprints/<stage>.json for every round stage."""
    written = []
    for stage in ROUND_STAGES:
        path = root / paths.fingerprint_path(stage)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, render(fingerprint(stage, params, root)))
        written.append(path)
    return written


def _differences(have: dict, want: dict) -> list[str]:
    keys = sorted(set(have) | set(want))
    return [key for key in keys if have.get(key) != want.get(key)]


def check_fingerprint(stage: str, params: Params, root: Path) -> None:
    """Stop round stage `stage` when its fingerprint differs from the params and code it runs with now."""
    path = paths.fingerprint_path(stage)
    run = f"run `dvc repro` (it reruns the `fingerprint` stage first; before a single-stage " \
          f"`dvc repro -s`, run `dvc repro -s {STAGE}`)"
    if not (root / path).is_file():
        raise StaleFingerprintError(f"{path} is missing; {run}")
    text, want = (root / path).read_text(), fingerprint(stage, params, root)
    if text == render(want):
        return
    have = json.loads(text)
    changed = [f"params {k}" for k in _differences(have.get("params", {}), want["params"])]
    changed += _differences(have.get("code", {}), want["code"])
    raise StaleFingerprintError(f"{path} was written for other params or code than this stage has now "
                                f"(changed: {', '.join(changed)}); {run}")


def main() -> None:
    """stages/fingerprint.py: validate params.yaml, check the stage's own declaration, write the files."""
    import sys

    from rlpipe.config import load_params
    from rlpipe.pipeline import check_stage

    root = Path.cwd()
    try:
        params = load_params()
    except PipelineError as err:
        sys.exit(f"{STAGE}: {err}")
    # Once params.yaml is valid, and before the declarations' check: that check parses the library's
    # import graph (0.2-0.3 s), and the worker's imports are what round 1 waits on. A worker started for
    # a check that then fails exits with the dvc process.
    if params.runtime.warm_worker:
        from rlpipe.worker.client import start_early

        start_early(root.resolve())
    try:
        check_stage(STAGE, None, params, root)
    except PipelineError as err:
        sys.exit(f"{STAGE}: {err}")
    write_fingerprints(params, root)
