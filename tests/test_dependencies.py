"""What a stage reads is what the pipeline files declare, so DVC never serves a stale result.

- The committed pipeline files are what `rlpipe pipeline` generates from the code and params.yaml.
- Each stage of the miniature pipeline, run in a fresh process with its params recorded
  (tests/stage_probe.py), reads only declared params keys and imports only declared library files
  (or exempt ones: `rlpipe.codedeps.EXEMPT`). grpo here; ppo, dapo and remax (critic, dynamic sampling,
  greedy baseline paths) in the slow suite.
- Bytecode the library writes never changes `dvc status`.
- The import directions: the math imports no config, I/O or tracking; config, the stage client and the
  stage table import no torch; no import cycles.
The checks are functions (`undeclared_*`) fed a declaration with a key or a file removed, to show they fail.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from conftest import REPO
from params_recorder import covered
from rlpipe.codedeps import is_exempt, module_file
from rlpipe.scratch_project import scratch_env
from scratch import MINI_PARAMS, dvc, dvc_target, make_project, ran_stages

PROBE = REPO / "tests" / "stage_probe.py"
ONCE = ("prepare", "init", "value_pretrain", "evaluate")
PER_ROUND = ("rollout", "reward", "advantage", "update")


def declared(root: Path, stage: str, round_name: str | None) -> dict:
    """What a stage declares: its entry in the project's pipeline files (round stages: rounds/rK/dvc.yaml),
    with a round stage's params keys and code files taken from its fingerprint, as the run wrote it."""
    path = root / (dvc_target(f"{stage}@{round_name}").split(":")[0] if round_name else "dvc.yaml")
    entry = yaml.safe_load(path.read_text())["stages"][stage]
    if round_name is not None:
        from rlpipe.paths import fingerprint_path

        assert fingerprint_path(stage).as_posix() in entry["deps"]
        written = json.loads((root / fingerprint_path(stage)).read_text())
        entry = {**entry, "params": list(written["params"]), "deps": [*entry["deps"], *written["code"]]}
    return entry


def probe(root: Path, stage: str, round_name: str | None) -> dict:
    args = [sys.executable, str(PROBE), stage] + ([round_name] if round_name else [])
    done = subprocess.run(args, cwd=root, env=scratch_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def undeclared_params(read: list[str], entry: dict) -> list[str]:
    from rlpipe.pipeline import EXEMPT_PARAMS

    return [key for key in read if not covered(key, [*entry.get("params", []), *EXEMPT_PARAMS])]


def undeclared_modules(modules: list[str], entry: dict) -> list[str]:
    files = set(entry["deps"])
    return [m for m in modules if not is_exempt(m) and module_file(m).relative_to(REPO).as_posix() not in files]


def check_every_stage(root: Path) -> dict[str, dict]:
    found = {}
    for stage, round_name in [(s, None) for s in ONCE] + [(s, "r1") for s in PER_ROUND]:
        report, entry = probe(root, stage, round_name), declared(root, stage, round_name)
        found[stage] = {"params": undeclared_params(report["params"], entry),
                        "modules": undeclared_modules(report["modules"], entry), "report": report}
    return found


def assert_all_declared(found: dict[str, dict]) -> None:
    missing = {stage: {k: v for k, v in f.items() if k != "report" and v} for stage, f in found.items()}
    assert not any(missing.values()), missing


@pytest.fixture(scope="module")
def grpo_reads(mini_run, tmp_path_factory):
    root = tmp_path_factory.mktemp("deps") / "project"
    shutil.copytree(mini_run[0], root, ignore=shutil.ignore_patterns("mlruns", "mlflow.db", "tmp"))
    return check_every_stage(root)


def test_committed_pipeline_files_are_generated():
    from rlpipe.config import load_params
    from rlpipe.pipeline import stale_files

    stale = stale_files(load_params(REPO / "params.yaml"), REPO)
    assert not stale, f"run `rlpipe pipeline`: {stale}"


def test_grpo_stages_read_only_what_they_declare(grpo_reads):
    assert_all_declared(grpo_reads)
    # the probe saw real reads: the model stages' sampling keys and their library
    rollout = grpo_reads["rollout"]["report"]
    assert "rollout.temperature" in rollout["params"] and "rlpipe.rollout.hf" in rollout["modules"]


def test_the_checks_fail_on_a_missing_declaration(grpo_reads, mini_run):
    """A declaration without one key, or without one library file, is caught."""
    root = mini_run[0]
    report = grpo_reads["advantage"]["report"]
    entry = declared(root, "advantage", "r1")
    narrowed = {**entry, "params": [p for p in entry["params"] if p != "algorithm"] + ["algorithm.preset"]}
    assert "algorithm.std_ddof" in undeclared_params(report["params"], narrowed)
    without = {**entry, "deps": [d for d in entry["deps"] if d != "rlpipe/algorithms/advantages.py"]}
    assert undeclared_modules(report["modules"], without) == ["rlpipe.algorithms.advantages"]


def test_a_stale_pipeline_file_stops_the_stage(mini_run, tmp_path):
    """A stage whose entry lacks a library file its work now imports refuses to run, naming the file; for
    the round stages, the entry that lists their code is the `fingerprint` stage's."""
    from rlpipe.config import load_params
    from rlpipe.errors import PipelineError
    from rlpipe.pipeline import check_stage

    root = tmp_path / "project"
    shutil.copytree(mini_run[0], root, ignore=shutil.ignore_patterns("runs", "mlruns", "mlflow.db", ".dvc", ".git"))
    path = root / "dvc.yaml"
    pipeline = yaml.safe_load(path.read_text())
    pipeline["stages"]["fingerprint"]["deps"].remove("rlpipe/algorithms/kl.py")
    path.write_text(yaml.safe_dump(pipeline, sort_keys=False))
    params = load_params(root / "params.yaml")
    check_stage("advantage", "r1", params, root)  # the other entries are current
    check_stage("prepare", None, params, root)
    with pytest.raises(PipelineError, match="undeclared: rlpipe/algorithms/kl.py; run `rlpipe pipeline`"):
        check_stage("fingerprint", None, params, root)


def test_local_inputs_named_in_params_are_declared(tmp_path):
    """What params.yaml points a stage at outside the pipeline's artifacts is a dep of that stage: the data
    files, a local policy or critic backbone, a process reward model. A hub name is no file."""
    from rlpipe.config import params_from_dict
    from rlpipe.pipeline import once_stage, round_stage

    (tmp_path / "models/base").mkdir(parents=True)
    params = params_from_dict({"data": {"source": "file", "train_file": "data/train.jsonl", "test_file": "/abs/test.jsonl"},
                               "model": {"path": "models/base"}, "value": {"model": {"path": "Qwen/Qwen2.5-0.5B"}},
                               "reward": {"process_model": "models/prm"}})
    synthetic = params_from_dict({})
    prepare = once_stage("prepare", params, tmp_path)["deps"]
    assert prepare == [*once_stage("prepare", synthetic, tmp_path)["deps"], "data/train.jsonl", "/abs/test.jsonl"]
    assert once_stage("init", params, tmp_path)["deps"] == [*once_stage("init", synthetic, tmp_path)["deps"], "models/base"]
    assert once_stage("value_pretrain", params, tmp_path) == once_stage("value_pretrain", synthetic, tmp_path)
    local_critic = params_from_dict({"value": {"model": {"path": "models/base"}}})
    assert once_stage("value_pretrain", local_critic, tmp_path)["deps"] == \
        [*once_stage("value_pretrain", synthetic, tmp_path)["deps"], "models/base"]
    # the scorer needs a directory: declared even before it exists, so that DVC names a missing one
    assert round_stage("reward", 2, params, tmp_path)["deps"] == [*round_stage("reward", 2, synthetic, tmp_path)["deps"],
                                                                  "models/prm"]


def test_a_data_file_edited_in_place_reruns_prepare(tmp_path):
    """Same name, same params, new content: DVC sees the declared file change and reruns `prepare`, whose
    splits then hold the new row. Another file named in params.yaml stops the stage until `rlpipe
    pipeline` declares it."""
    from rlpipe.config import load_params
    from rlpipe.errors import PipelineError
    from rlpipe.pipeline import check_stage

    raw = yaml.safe_load(MINI_PARAMS.read_text())
    raw["data"] = {"source": "file", "train_file": "data/train.jsonl", "test_file": "data/test.jsonl"}
    params_file = tmp_path / "params.yaml"
    params_file.write_text(yaml.safe_dump(raw, sort_keys=False))
    root = make_project(tmp_path / "project", params_file)
    (root / "data").mkdir()
    rows = [{"question": f"{a}+{a}=", "answer": str(2 * a)} for a in range(6)]
    for name, part in (("train", rows[:4]), ("test", rows[4:])):
        (root / f"data/{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    assert ran_stages(dvc(root, "repro", "prepare")) == ["prepare"]
    assert "prepare" not in dvc(root, "status", "prepare")
    with open(root / "data/train.jsonl", "a") as train:
        train.write(json.dumps({"question": "9+9=", "answer": "18"}) + "\n")
    assert "modified:           data/train.jsonl" in dvc(root, "status", "prepare")
    assert ran_stages(dvc(root, "repro", "prepare")) == ["prepare"]
    assert pq.read_table(root / "runs/data/train.parquet").num_rows == 5

    raw["data"]["train_file"] = "data/more.jsonl"
    (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    with pytest.raises(PipelineError, match="undeclared: data/more.jsonl; run `rlpipe pipeline`"):
        check_stage("prepare", None, load_params(root / "params.yaml"), root)


def test_a_stale_fingerprint_stops_the_round_stage(mini_run, tmp_path):
    """After an edit the `fingerprint` stage has not seen (a single-stage `dvc repro -s`), a round stage
    whose params or code changed stops, naming what changed; the others run."""
    from rlpipe.config import load_params
    from rlpipe.fingerprints import StaleFingerprintError, check_fingerprint

    root = tmp_path / "project"
    shutil.copytree(mini_run[0], root, ignore=shutil.ignore_patterns("mlruns", "mlflow.db", ".dvc", ".git"))
    params = load_params(root / "params.yaml")
    for stage in PER_ROUND:
        check_fingerprint(stage, params, root)
    changed = params.model_copy(update={"algorithm": params.algorithm.model_copy(update={"std_ddof": 1})})
    check_fingerprint("rollout", changed, root)
    with pytest.raises(StaleFingerprintError, match=r"runs/fingerprints/advantage.json .*changed: params algorithm\);"
                                                     r" run `dvc repro`.*`dvc repro -s fingerprint`"):
        check_fingerprint("advantage", changed, root)
    code = root / "rlpipe/algorithms/kl.py"
    code.write_text(code.read_text() + "\n# edited\n")
    check_fingerprint("reward", params, root)
    with pytest.raises(StaleFingerprintError, match="changed: rlpipe/algorithms/kl.py"):
        check_fingerprint("update", params, root)


def test_a_round_stage_after_an_edit_runs_with_its_fingerprint_refreshed(mini_run, tmp_path):
    """After a params edit, `dvc repro <round stage>` reruns the fingerprint first, then the stage;
    `dvc repro -s` finds the stage's own inputs unchanged and skips it, and forced (`-f`), it stops,
    naming the command, rather than record a run under the old fingerprint."""
    root = tmp_path / "project"
    shutil.copytree(mini_run[0], root, ignore=shutil.ignore_patterns("mlruns", "mlflow.db", "tmp"))
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["algorithm"]["eps_low"] = 0.17  # a value no other test runs: DVC's run cache holds none for it
    params["tracking"]["enabled"] = False
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    target = dvc_target("advantage@r1")
    assert "didn't change, skipping" in dvc(root, "repro", "-s", target)
    forced = subprocess.run(["dvc", "repro", "-s", "-f", target], cwd=root, env=scratch_env(),
                            capture_output=True, text=True, timeout=600)
    assert forced.returncode != 0
    assert "changed: params algorithm" in forced.stderr and "`dvc repro -s fingerprint`" in forced.stderr
    assert ran_stages(dvc(root, "repro", target)) == ["fingerprint", "advantage@r1"]
    assert "rollout" not in dvc(root, "status", dvc_target("rollout@r1"))


def test_bytecode_never_changes_dvc_status(mini_run, tmp_path):
    """Importing the library (its bytecode written beside the sources, as running the tests does) leaves a
    finished run up to date: code deps are .py files, and .dvcignore drops __pycache__."""
    root = tmp_path / "project"
    shutil.copytree(mini_run[0], root, ignore=shutil.ignore_patterns("mlruns", "mlflow.db"))
    imports = "import pkgutil, importlib, rlpipe\n" \
              "for m in pkgutil.walk_packages(rlpipe.__path__, 'rlpipe.'): importlib.import_module(m.name)\n"
    env = {**scratch_env(), "PYTHONPATH": str(root)}
    subprocess.run([sys.executable, "-c", imports], cwd=root, env=env, check=True, capture_output=True)
    subprocess.run([sys.executable, "-m", "compileall", "-q", "rlpipe", "stages", "tests"], cwd=root, env=env,
                   check=False, capture_output=True)
    assert any((root / "rlpipe").rglob("*.pyc"))
    assert "Data and pipelines are up to date" in dvc(root, "status")


# --- import directions ------------------------------------------------------------------------------
def runtime_imports(path: Path) -> set[str]:
    """rlpipe and third-party top-level modules a file imports outside `if TYPE_CHECKING:`."""
    from rlpipe.codedeps import _runtime_nodes

    found = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


def library_files(package: str) -> list[Path]:
    return sorted((REPO / "rlpipe" / package).rglob("*.py"))


@pytest.mark.parametrize("package, forbidden", [
    ("algorithms", ("rlpipe.config", "rlpipe.artifacts", "rlpipe.atomic", "rlpipe.tracking", "rlpipe.paths",
                    "rlpipe.stages", "rlpipe.train", "rlpipe.models", "rlpipe.rollout", "pyarrow", "mlflow")),
    ("config", ("torch", "transformers", "pyarrow", "rlpipe.models", "rlpipe.train", "rlpipe.algorithms")),
    ("models", ("rlpipe.train", "rlpipe.stages", "rlpipe.rollout", "rlpipe.tracking")),
    ("rollout", ("rlpipe.train", "rlpipe.stages", "rlpipe.tracking")),
    ("rewards", ("rlpipe.train", "rlpipe.stages", "rlpipe.tracking", "rlpipe.rollout")),
    ("train", ("rlpipe.stages", "rlpipe.tracking", "rlpipe.rollout")),
])
def test_import_directions(package, forbidden):
    bad = {f"{path.relative_to(REPO)}: {name}" for path in library_files(package) for name in runtime_imports(path)
           if any(name == f or name.startswith(f + ".") for f in forbidden)}
    assert not bad, sorted(bad)


@pytest.mark.parametrize("modules, absent", [
    # the stage client, the config and the pipeline generator: no torch, transformers, pyarrow or MLflow
    (("rlpipe.runner", "rlpipe.config", "rlpipe.stages", "rlpipe.worker.client", "rlpipe.pipeline"),
     ("torch", "transformers", "pyarrow", "mlflow")),
    # the thin client (a stage handed to a running worker) imports only what `rlpipe.runner` and the worker
    # client import at module level: no pydantic or YAML either (0.2 s a stage); the worker validates
    (("rlpipe.runner", "rlpipe.worker.client"), ("pydantic", "yaml", "rlpipe.config", "torch")),
])
def test_light_entry_points_stay_light(modules, absent):
    code = f"import sys, {', '.join(modules)}\nprint(sorted(m for m in {absent!r} if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={**os.environ, "RLPIPE_PROGRESS": "0"})
    assert done.stdout.strip() == "[]"


def test_no_import_cycles_at_module_level():
    """Module-level imports between rlpipe modules form no cycle (lazy imports inside functions may)."""
    graph: dict[str, set[str]] = {}
    for path in (REPO / "rlpipe").rglob("*.py"):
        module = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        tree = ast.parse(path.read_text())
        names = set()
        for node in tree.body:  # module level only
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rlpipe"):
                names.add(node.module)
                names.update(f"{node.module}.{a.name}" for a in node.names if module_file(f"{node.module}.{a.name}"))
            elif isinstance(node, ast.Import):
                names.update(a.name for a in node.names if a.name.startswith("rlpipe"))
        graph[module] = {n for n in names if module_file(n) and n != module}
    state: dict[str, int] = {}

    def visit(module: str, trail: list[str]) -> None:
        state[module] = 1
        for nxt in graph.get(module, ()):
            if state.get(nxt) == 1:
                raise AssertionError(f"import cycle: {' -> '.join(trail[trail.index(nxt):] + [nxt])}")
            if not state.get(nxt):
                visit(nxt, trail + [nxt])
        state[module] = 2

    for module in graph:
        if not state.get(module):
            visit(module, [module])


# --- the other presets' paths ---------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("preset", ["ppo", "dapo", "remax"])
def test_other_presets_read_only_what_they_declare(preset, tmp_path):
    params = yaml.safe_load((REPO / "tests/params_mini.yaml").read_text())
    params["algorithm"]["preset"] = preset
    params["tracking"]["enabled"] = False
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    root = make_project(tmp_path / "project", tmp_path / "params.yaml")
    dvc(root, "repro")
    assert_all_declared(check_every_stage(root))


# --- the code a stage runs is the project's ---------------------------------------------------------
def test_a_stage_refuses_library_code_other_than_the_projects(tmp_path):
    """DVC hashes the project's rlpipe/*.py, but a stage runs the rlpipe its interpreter imports (another
    clone's editable install, a copy in site-packages). Where the two differ in a file the stage depends
    on, the stage stops before any work, naming the file and both places; a difference only in a file it
    does not depend on, or in an exempt one, lets it run. End to end: the stage's process exits 1 with
    that one message."""
    from rlpipe.codedeps import check_running_code
    from rlpipe.errors import PipelineError

    root = make_project(tmp_path / "project")
    check_running_code("update", root)
    exempt = root / "rlpipe/runner.py"
    exempt.write_text(exempt.read_text() + "\n# edited\n")
    check_running_code("update", root)
    code = root / "rlpipe/algorithms/kl.py"
    code.write_text(code.read_text() + "\n# edited\n")
    check_running_code("reward", root)
    with pytest.raises(PipelineError, match=rf"installed at {re.escape(str(REPO / 'rlpipe'))}, not the project's .*differ in "
                                            r"rlpipe/algorithms/kl.py: .*`pip install -e "):
        check_running_code("update", root)

    data_code = root / "rlpipe/data/__init__.py"
    data_code.write_text(data_code.read_text() + "\n# edited\n")
    stage = subprocess.run([sys.executable, "stages/prepare.py"], cwd=root, env=scratch_env(),
                           capture_output=True, text=True, timeout=300)
    assert stage.returncode == 1, stage.stderr
    assert "differ in rlpipe/data/__init__.py" in stage.stderr and "Traceback" not in stage.stderr
    assert not (root / "runs/data").exists()
    # the message's second way out: the project's own rlpipe first on the import path
    assert f"PYTHONPATH={root.resolve()} dvc repro" in stage.stderr
    stage = subprocess.run([sys.executable, "stages/prepare.py"], cwd=root, env={**scratch_env(), "PYTHONPATH": str(root)},
                           capture_output=True, text=True, timeout=300)
    assert stage.returncode == 0, stage.stderr
    assert (root / "runs/data/train.parquet").is_file()


def test_a_library_file_edited_after_it_was_loaded_stops_the_stages_it_touches(tmp_path):
    """Where the imported rlpipe is the project's own (an editable install of this clone), an edit made
    after the process read the code (the warm worker reads it at its start, then serves a whole `dvc
    repro`) stops the stages that depend on the file, naming it, rather than run the old code under the
    new file's hash."""
    root = tmp_path / "project"
    shutil.copytree(REPO / "rlpipe", root / "rlpipe", ignore=shutil.ignore_patterns("__pycache__"))
    script = ("import sys\nfrom pathlib import Path\n"
              "from rlpipe.codedeps import check_running_code, running_code\n"
              "from rlpipe.errors import PipelineError\n"
              "root = Path.cwd()\nrunning_code()\ncheck_running_code('update', root)\n"
              "code = root / 'rlpipe/algorithms/kl.py'\ncode.write_text(code.read_text() + '# edited\\n')\n"
              "check_running_code('reward', root)\n"
              "try:\n    check_running_code('update', root)\nexcept PipelineError as err:\n    sys.exit(str(err))\n")
    run = subprocess.run([sys.executable, "-c", script], cwd=root, env={**scratch_env(), "PYTHONPATH": str(root)},
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stderr
    assert run.stderr.startswith("rlpipe/algorithms/kl.py changed on disk after this process loaded them")
    assert "run `dvc repro` again" in run.stderr
