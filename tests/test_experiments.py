"""Two miniature experiments (grpo, rloo) compared the way a user would: a real `mlflow server` over
the same sqlite store, queried over its REST API, and `dvc exp show --csv`."""

from __future__ import annotations

import csv
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
import re
import shutil
import urllib.request
from pathlib import Path

import pytest
import yaml

from rlpipe.tracking.ui import metric_page
from scratch import dvc, make_project, start_queue, stop_queue_workers, tracked_stages

CHROMIUM = next((shutil.which(name) for name in ("chromium", "chromium-browser", "google-chrome")
                 if shutil.which(name)), None)

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


@pytest.fixture(scope="module")
def two_experiments(tmp_path_factory):
    root = make_project(tmp_path_factory.mktemp("experiments") / "project")
    logs = {}
    for preset in ("grpo", "rloo"):
        logs[preset] = dvc(root, "exp", "run", "--temp", "-n", f"mini-{preset}", "-S", f"algorithm.preset={preset}")
    return root, logs


@pytest.fixture(scope="module")
def mlflow_server(two_experiments):
    root, _ = two_experiments
    port = free_port()
    mlflow = os.path.join(os.path.dirname(sys.executable), "mlflow")
    proc = subprocess.Popen(
        [mlflow, "server", "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--host", "127.0.0.1",
         "--port", str(port), "--workers", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("mlflow server did not come up")
                time.sleep(0.5)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the server's own process group: gunicorn and its workers
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def test_rest_api_shows_two_parents_with_a_child_per_stage(two_experiments, mlflow_server):
    _, logs = two_experiments
    with urllib.request.urlopen(f"{mlflow_server}/api/2.0/mlflow/experiments/get-by-name?experiment_name=rlpipe-test",
                                timeout=30) as response:
        experiment = json.loads(response.read())["experiment"]
    runs = post(f"{mlflow_server}/api/2.0/mlflow/runs/search",
                {"experiment_ids": [experiment["experiment_id"]], "max_results": 1000})["runs"]

    def tags(run):
        return {t["key"]: t["value"] for t in run["data"].get("tags", [])}

    parents = [r for r in runs if tags(r).get("rlpipe.stage") == "pipeline"]
    assert sorted(tags(p)["dvc.exp_name"] for p in parents) == ["mini-grpo", "mini-rloo"]
    for parent in parents:
        preset = tags(parent)["dvc.exp_name"].removeprefix("mini-")
        children = [r for r in runs if tags(r).get("mlflow.parentRunId") == parent["info"]["run_id"]]
        assert sorted(r["info"]["run_name"] for r in children) == sorted(tracked_stages(logs[preset]))
        metrics = {m["key"]: m["value"] for m in parent["data"].get("metrics", [])}
        assert "pass_at_1" in metrics
        params = {p["key"]: p["value"] for p in parent["data"].get("params", [])}
        assert params["algorithm.preset"] == preset
        assert tags(parent)["rlpipe.preset"] == preset


@pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium (Debian: apt install chromium) to open the MLflow UI")
def test_mlflow_overlays_the_two_experiments_held_out_curves(two_experiments, mlflow_server, tmp_path):
    """The two parents' `curve/pass_at_1` (held-out pass@1 per round) in MLflow's compare view, as a browser
    draws it: one line per experiment, each with a point per round. RLPIPE_SCREENSHOT_DIR keeps the picture
    (the README's is made so)."""
    with urllib.request.urlopen(f"{mlflow_server}/api/2.0/mlflow/experiments/get-by-name?experiment_name=rlpipe-test",
                                timeout=30) as response:
        experiment_id = json.loads(response.read())["experiment"]["experiment_id"]
    runs = post(f"{mlflow_server}/api/2.0/mlflow/runs/search", {
        "experiment_ids": [experiment_id], "filter": "tags.`rlpipe.stage` = 'pipeline'", "max_results": 10})["runs"]
    names = {r["info"]["run_id"]: r["info"]["run_name"] for r in runs}
    assert sorted(names.values()) == ["mini-grpo", "mini-rloo"]
    url = metric_page(mlflow_server, experiment_id, sorted(names), "curve/pass_at_1")
    browser = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
               "--virtual-time-budget=30000", "--window-size=1280,800"]
    dom = subprocess.run([*browser, "--dump-dom", url], capture_output=True, text=True, timeout=180).stdout
    for name in names.values():
        assert f"{name} (curve/pass_at_1)" in dom  # the legend
    lines = set(re.findall(r'<path class="js-line" d="(M[^"]+)"', dom))
    rounds = yaml.safe_load((two_experiments[0] / "params.yaml").read_text())["rounds"]
    assert len(lines) == 2 and all(line.count("L") == rounds for line in lines), lines  # rounds 0..N
    picture = Path(os.environ.get("RLPIPE_SCREENSHOT_DIR") or tmp_path) / "mlflow_compare.png"
    subprocess.run([*browser, f"--screenshot={picture}", url], capture_output=True, timeout=180, check=True)
    assert picture.stat().st_size > 20_000  # a drawn page, not a blank one


def test_rlpipe_runs_gives_one_readable_row_per_experiment(two_experiments):
    """The curated view: preset, changed params, pass@1 before and after (the same figures as eval.json in
    each experiment), and the wall time of its MLflow parent run."""
    from rlpipe.runs import main as runs

    root, _ = two_experiments
    rows = {row["name"]: row for row in json.loads(runs(root, all_branches=False, mlflow=True, wide=False, as_json=True))}
    assert {"mini-grpo", "mini-rloo", "workspace"} <= set(rows)
    shown = {row["Experiment"]: row for row in csv.DictReader(io.StringIO(dvc(root, "exp", "show", "--csv")))
             if row.get("Experiment")}
    for name in ("mini-grpo", "mini-rloo"):
        row = rows[name]
        assert row["params"]["algorithm.preset"] == name.removeprefix("mini-")
        final = next(v for k, v in shown[name].items() if k.split(":")[-1] == "pass@1")
        assert row["metrics"]["pass@1"] == pytest.approx(float(final))
        assert 0 <= row["metrics"]["pass@1_init"] <= 1
        assert 1 < row["wall_seconds"] < 3600
    baseline_preset = rows["workspace"]["params"]["algorithm.preset"]
    for name in ("mini-grpo", "mini-rloo"):
        preset = name.removeprefix("mini-")
        assert rows[name]["changed"] == ({} if preset == baseline_preset else {"algorithm.preset": preset})
    table = runs(root, all_branches=False, mlflow=True, wide=False, as_json=False)
    lines = table.splitlines()
    assert lines[0].startswith("| experiment | base | preset | changed params")
    assert any(line.startswith("| mini-rloo |") and "| rloo |" in line for line in lines)
    assert all(len(line) < 200 for line in lines)  # readable in a terminal, unlike exp show's 512 columns


def test_dvc_exp_show_lists_both_with_pass_at_1(two_experiments):
    root, _ = two_experiments
    table = list(csv.DictReader(io.StringIO(dvc(root, "exp", "show", "--csv"))))
    by_name = {row["Experiment"]: row for row in table if row.get("Experiment")}
    assert {"mini-grpo", "mini-rloo"} <= set(by_name)
    # the metrics files are committed into each experiment, so each row carries its own eval results
    # (dvc prefixes a column with its file only where two files share a key)
    columns = list(table[0])
    final = next(c for c in columns if c.split(":")[-1] == "pass@1")
    initial = next(c for c in columns if c.split(":")[-1] == "pass@1_init")
    for name in ("mini-grpo", "mini-rloo"):
        row = by_name[name]
        assert row["algorithm.preset"] == name.removeprefix("mini-")
        assert 0.0 <= float(row[final]) <= 1.0
        assert 0.0 <= float(row[initial]) <= 1.0


def test_a_two_experiment_queue_runs_in_parallel_and_exp_show_lists_both(tmp_path):
    """`dvc exp run --queue` twice, `dvc queue start -j 2`: each experiment is its own pipeline execution
    (its own warm worker), and `dvc exp show` lists both with their results."""
    root = make_project(tmp_path / "project")
    for name, preset in (("q-grpo", "grpo"), ("q-dr-grpo", "dr_grpo")):
        dvc(root, "exp", "run", "--queue", "-n", name, "-S", f"algorithm.preset={preset}")
    start_queue(root, 2, tmp_path / "queue-start.log")
    try:
        deadline = time.monotonic() + 900
        while True:
            status = dvc(root, "queue", "status")
            if "Queued" not in status and "Running" not in status:
                break
            assert time.monotonic() < deadline, status
            time.sleep(5)
    finally:
        stop_queue_workers(root)
    assert status.count("Success") == 2, status
    table = list(csv.DictReader(io.StringIO(dvc(root, "exp", "show", "--csv"))))
    by_name = {row["Experiment"]: row for row in table if row.get("Experiment")}
    final = next(c for c in table[0] if c.split(":")[-1] == "pass@1")
    for name, preset in (("q-grpo", "grpo"), ("q-dr-grpo", "dr_grpo")):
        assert by_name[name]["algorithm.preset"] == preset
        assert 0.0 <= float(by_name[name][final]) <= 1.0
