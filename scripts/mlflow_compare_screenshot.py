"""Render MLflow's compare view of two pipeline runs' held-out curves headless to a PNG (needs Chromium).

    python scripts/mlflow_compare_screenshot.py                       # the two newest parent runs
    python scripts/mlflow_compare_screenshot.py --runs sweep-grpo sweep-rloo --out compare.png

Starts `mlflow server` on 127.0.0.1 over the same sqlite store the pipeline writes (mlflow.db at the repo
root unless --store), opens the page that overlays one metric of the two parent runs (found by their DVC
experiment name, or the newest two; the metric is the held-out curve `curve/pass_at_1` unless --metric)
in headless Chromium (Debian's `chromium`), saves the screenshot, and stops the server by its process
group. tests/test_experiments.py checks the same page draws one line per run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

from rlpipe.tracking.ui import HELD_OUT_CURVE, metric_page


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def api(url: str, path: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"{url}/api/2.0/mlflow/{path}", data=data,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def wait_until_up(url: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit("mlflow server did not come up")
            time.sleep(0.5)


def pick_runs(url: str, experiment: str, names: list[str] | None) -> tuple[str, list[str]]:
    found = api(url, "experiments/get-by-name?" + urllib.parse.urlencode({"experiment_name": experiment}))
    exp_id = found["experiment"]["experiment_id"]
    runs = api(url, "runs/search", {"experiment_ids": [exp_id], "max_results": 1000,
                                    "filter": "tags.`rlpipe.stage` = 'pipeline'",
                                    "order_by": ["attributes.start_time DESC"]}).get("runs", [])
    by_name = {}
    for run in runs:
        tags = {t["key"]: t["value"] for t in run["data"].get("tags", [])}
        by_name.setdefault(tags.get("dvc.exp_name") or run["info"]["run_name"], run["info"]["run_id"])
    if names:
        missing = [n for n in names if n not in by_name]
        if missing:
            raise SystemExit(f"no parent run named {', '.join(missing)}; have {', '.join(by_name)}")
        return exp_id, [by_name[n] for n in names]
    if len(runs) < 2:
        raise SystemExit(f"experiment {experiment!r} has {len(runs)} parent run(s); need two")
    return exp_id, [r["info"]["run_id"] for r in runs[:2]]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", default="mlflow.db", help="the sqlite store (default mlflow.db)")
    parser.add_argument("--experiment", default="rlpipe", help="MLflow experiment (params: tracking.experiment)")
    parser.add_argument("--runs", nargs=2, metavar="NAME", help="the two parent runs, by DVC experiment name")
    parser.add_argument("--out", default="runs/plots/mlflow_compare.png")
    parser.add_argument("--metric", default=HELD_OUT_CURVE, help=f"the metric to overlay (default {HELD_OUT_CURVE})")
    parser.add_argument("--size", default="1280,800", help="window width,height")
    args = parser.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("chromium not found: apt-get install chromium")
    store = Path(args.store).resolve()
    if not store.is_file():
        raise SystemExit(f"{store}: no such MLflow store; run the pipeline first")

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    mlflow = os.path.join(os.path.dirname(sys.executable), "mlflow")
    server = subprocess.Popen([mlflow, "server", "--backend-store-uri", f"sqlite:///{store}", "--host", "127.0.0.1",
                               "--port", str(port), "--workers", "1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_until_up(url, server)
        exp_id, run_ids = pick_runs(url, args.experiment, args.runs)
        page = metric_page(url, exp_id, run_ids, args.metric)
        out = Path(args.out).resolve()
        out.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                        f"--window-size={args.size}", "--virtual-time-budget=20000", f"--screenshot={out}", page],
                       check=True, capture_output=True, timeout=180)
        print(f"{page}\nwrote {out}")
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
    return 0


if __name__ == "__main__":
    sys.exit(main())
