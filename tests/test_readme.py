"""The README's tutorial commands run as written, on the miniature pipeline.

Every `dvc ...` and `python stages/...` line of the tutorial's sections 2-4 (change the preset, compare,
rerun one stage) is taken from README.md itself, in order, and run in a copy of a finished miniature
project (2 rounds: the tutorial's round 2 exists). So a command the README shows that stops working, or
a README edited to show one that does not work, fails here.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import REPO
from rlpipe.scratch_project import scratch_env

pytestmark = pytest.mark.slow


def tutorial_commands() -> list[str]:
    """The dvc, rlpipe and stage-script lines of the README's tutorial sections 2-4, comments dropped."""
    text = (REPO / "README.md").read_text()
    tutorial = text[text.index("### 2. Change the preset"):text.index("### 5. Scale")]
    blocks = re.findall(r"```bash\n(.*?)```", tutorial, flags=re.S)
    lines = [line.split("  #")[0].strip() for block in blocks for line in block.splitlines()]
    return [line for line in lines if line.startswith(("dvc ", "rlpipe ", "python stages/"))]


def test_the_tutorial_lists_its_commands():
    commands = tutorial_commands()
    assert any(c.startswith("dvc exp run") for c in commands)
    assert any(c.startswith("dvc repro -s rounds/r2/") for c in commands)
    assert any(c.startswith("python stages/") for c in commands)
    assert any(c.startswith(("rlpipe runs", "dvc exp show")) for c in commands)


def test_the_tutorial_commands_run_as_written(mini_run, tmp_path):
    root = tmp_path / "project"
    shutil.copytree(mini_run[0], root, ignore=shutil.ignore_patterns("mlruns", "mlflow.db", "tmp"))
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["tracking"]["enabled"] = False
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    subprocess.run(["git", "commit", "-qam", "tracking off"], cwd=root, check=True, env=scratch_env())
    outputs = {}
    for command in tutorial_commands():
        argv = shlex.split(command)
        if argv[0] == "python":
            argv[0] = sys.executable
        elif argv[0] == "rlpipe":  # this venv's console script
            argv[0] = str(Path(sys.executable).parent / "rlpipe")
        done = subprocess.run(argv, cwd=root, env=scratch_env(), capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, f"README command `{command}` failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
        outputs[command] = done.stdout + done.stderr
    # the experiments' table (`rlpipe runs`, or `dvc exp show`) lists every experiment run before it
    commands = list(outputs)
    table = next(i for i, c in enumerate(commands) if c.startswith(("rlpipe runs", "dvc exp show")))
    names = [c.split("-n ")[1].split()[0] for c in commands[:table] if c.startswith("dvc exp run") and "-n " in c]
    assert names and all(name in outputs[commands[table]] for name in names), outputs[commands[table]][-2000:]
    plots = next((out for command, out in outputs.items() if command.startswith("dvc plots")), "")
    assert "not iterable" not in plots and "WARNING" not in plots, plots
    html = next(root.glob("dvc_plots/index.html"), None)
    if html is not None:  # `dvc plots diff` writes a page; its spec must hold the curve, not `{}`
        page = html.read_text()
        assert "var spec = {}" not in page and json.dumps("pass@1")[1:-1] in page
