"""Which library files a stage's work can run: the code dependencies `dvc.yaml` declares for it.

A static walk of the import graph from `rlpipe.stages.<name>`: every `import` and `from ... import`
of an rlpipe module, at module level or inside a function (the library imports heavy modules lazily),
followed transitively, with the `__init__.py` of every package on the way (importing a submodule runs
them). Only `.py` files are listed, so nothing that is not source (bytecode, editor files, temporaries)
enters a dependency's hash.

Exempt are the modules that move or observe results but never compute them (`EXEMPT`): a change there
cannot change an artifact's bytes, and declaring them would rerun every stage for nothing. The rule,
and the test that holds the library to it (tests/test_dependencies.py), are in docs/pipeline.md.

DVC hashes these files in the project, but a stage runs the rlpipe its interpreter imports: an editable
install of another clone, a copy in site-packages, or, in the warm worker, modules loaded before an edit.
`check_running_code` stops a stage whose code differs from the project's, so that DVC never records
outputs of one code under the hash of another.
"""

from __future__ import annotations

import ast
import hashlib
from functools import lru_cache
from pathlib import Path

from rlpipe.errors import PipelineError

PACKAGE_ROOT = Path(__file__).resolve().parent
REPO_ROOT = PACKAGE_ROOT.parent

EXEMPT = (
    "rlpipe.errors",  # error types: what a failure says, not what a success writes
    "rlpipe.progress",  # progress bars
    "rlpipe.tracking",  # MLflow: the daemon and the stages' client
    "rlpipe.runner",  # the stage command line: argument parsing, the stage-metrics log, exit codes
    "rlpipe.worker",  # the warm worker: runs the same stage functions (warm = cold, tested byte for byte)
    "rlpipe.local_service",  # the sockets of the tracking daemon and the worker
    "rlpipe.pipeline",  # generates and checks these very declarations
    "rlpipe.codedeps",
    "rlpipe.retention",  # prunes old checkpoints, and stops a stage that needs a pruned one
    # writes the round stages' declarations (and checks them before a stage runs): only the `fingerprint`
    # stage's outputs depend on it, and that stage declares it (`bookkeeping_code_files`)
    "rlpipe.fingerprints",
)


def is_exempt(module: str) -> bool:
    return any(module == e or module.startswith(e + ".") for e in EXEMPT)


def module_file(module: str) -> Path | None:
    """The source file of an rlpipe module (a package's __init__.py), or None if there is none."""
    parts = module.split(".")
    if parts[0] != "rlpipe":
        return None
    base = PACKAGE_ROOT.joinpath(*parts[1:])
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _runtime_nodes(tree: ast.AST):
    """Every node of `tree` but those under `if TYPE_CHECKING:` (imports for annotations never run)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and getattr(child.test, "id", getattr(child.test, "attr", None)) == "TYPE_CHECKING":
                todo.extend(child.orelse)
                continue
            todo.append(child)


def _imported(module: str, tree: ast.AST) -> set[str]:
    """rlpipe modules named by the import statements anywhere in `tree` (of module `module`)."""
    package = module if module_file(module).name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            found.add(base)
            # `from rlpipe.models import policy` imports the submodule rlpipe.models.policy
            found.update(f"{base}.{alias.name}" for alias in node.names if module_file(f"{base}.{alias.name}"))
    return {name for name in found if name.split(".")[0] == "rlpipe" and module_file(name)}


@lru_cache(maxsize=None)
def _direct_imports(module: str) -> frozenset[str]:
    tree = ast.parse(module_file(module).read_text(), filename=str(module_file(module)))
    return frozenset(_imported(module, tree))


def with_parents(module: str) -> set[str]:
    """The module and every package above it (importing it runs their __init__.py)."""
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts) + 1)}


def reachable_modules(*starts: str) -> set[str]:
    """Every rlpipe module importing `starts` can run, exempt modules included (not followed further)."""
    seen: set[str] = set()
    todo = [m for start in starts for m in with_parents(start)]
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        if is_exempt(module):
            continue
        for imported in _direct_imports(module):
            todo.extend(with_parents(imported) - seen)
    return seen


def code_files(*starts: str) -> list[str]:
    """Repo-relative paths of the non-exempt rlpipe modules importing `starts` can run, sorted."""
    modules = [m for m in reachable_modules(*starts) if not is_exempt(m)]
    return sorted({module_file(m).relative_to(REPO_ROOT).as_posix() for m in modules})


def bookkeeping_code_files(module: str) -> list[str]:
    """The code of a bookkeeping stage whose module is exempt from the other stages' deps: the module's
    own file and the non-exempt files its imports can run."""
    own = module_file(module).relative_to(REPO_ROOT).as_posix()
    return sorted({own, *code_files(*_direct_imports(module))})


def stage_code_files(stage: str) -> list[str]:
    """Repo-relative paths of the source files stage `stage` depends on: its entry script and every
    non-exempt rlpipe module its work can import. Two come in through objects rather than imports, and
    are added: the config (every stage reads `ctx.params`, whose methods resolve presets and defaults),
    and the model store, for stages that get their models through `ctx.models`."""
    from rlpipe.stages import STAGES

    starts = [f"rlpipe.stages.{stage}", "rlpipe.config"] + (["rlpipe.models.store"] if STAGES[stage].uses_models else [])
    return [f"stages/{stage}.py", *code_files(*starts)]


def source_md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


@lru_cache(maxsize=1)
def running_code() -> dict[str, str]:
    """The md5 of every source file of the rlpipe package this process imports, by repo-relative name,
    read at the first call. The warm worker calls it before it imports the stages' modules: a module once
    loaded stays as loaded when its file changes, so these stand for the code it runs all execution long."""
    return {path.relative_to(REPO_ROOT).as_posix(): source_md5(path) for path in PACKAGE_ROOT.rglob("*.py")}


def check_running_code(stage: str, root: Path) -> None:
    """Stop stage `stage` when a library file its work depends on (`stage_code_files`) differs between the
    rlpipe this process runs and the project at `root`, whose files DVC hashes. Exempt modules may differ:
    they cannot change an artifact's bytes."""
    running = running_code()
    differ = [name for name in stage_code_files(stage)
              if name.startswith("rlpipe/")
              and (not (root / name).is_file() or running.get(name) != source_md5(root / name))]
    if not differ:
        return
    listed = ", ".join(differ[:5]) + (f" and {len(differ) - 5} more" if len(differ) > 5 else "")
    if PACKAGE_ROOT == (root / "rlpipe").resolve():
        raise PipelineError(f"{listed} changed on disk after this process loaded them (edited during the "
                            f"run?): the stage would run the old code while DVC records the new; run "
                            f"`dvc repro` again")
    raise PipelineError(f"this stage runs the rlpipe installed at {PACKAGE_ROOT}, not the project's "
                        f"({root.resolve() / 'rlpipe'}), and the two differ in {listed}: DVC would record "
                        f"outputs of that code under the project's hashes. Install the project into this "
                        f"environment (`pip install -e {root.resolve()}`), put it first on the import path "
                        f"(`PYTHONPATH={root.resolve()} dvc repro`, for a second clone sharing this "
                        f"environment), or run `dvc` from the environment it is installed in")
