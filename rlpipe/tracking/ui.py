"""Addresses of MLflow UI pages for rlpipe's runs (MLflow 3's single-page app routes)."""

from __future__ import annotations

import json
import urllib.parse

HELD_OUT_CURVE = "curve/pass_at_1"
"""The parent run's held-out greedy pass@1, one point per round (step = round)."""


def metric_page(server: str, experiment_id: str, run_ids: list[str], metric: str = HELD_OUT_CURVE) -> str:
    """MLflow's page that overlays one metric's history for several runs, by step, with a point per step:
    what "Compare" then a metric's name opens."""
    query = {"runs": json.dumps(run_ids), "metric": json.dumps(metric), "experiments": json.dumps([experiment_id]),
             "plot_metric_keys": json.dumps([metric]), "x_axis": "step", "show_point": "true"}
    return f"{server}/#/metric?" + urllib.parse.urlencode(query, quote_via=urllib.parse.quote)
