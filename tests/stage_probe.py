"""Run one stage in this (fresh) process and report what it read: the params keys and the rlpipe modules.

    python tests/stage_probe.py STAGE [ROUND]     (in a project directory; prints one JSON line)

The stage runs as the pipeline runs it (`rlpipe.stages.execute`), with its params wrapped in
`RecordingParams`; afterwards every rlpipe module in `sys.modules` is one its work imported.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

if __name__ == "__main__":
    from params_recorder import RecordingParams

    from rlpipe.config import load_params
    from rlpipe.runner import execute
    from rlpipe.tracking.client import StageTracker

    os.environ["RLPIPE_TRACKING"] = "0"
    stage, round_name = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else None)
    params = load_params()
    read: set[str] = set()
    execute(stage, RecordingParams(params, read), round_name, StageTracker(params, stage, round_name))
    modules = sorted(m for m in sys.modules if m.split(".")[0] == "rlpipe")
    print(json.dumps({"stage": stage, "round": round_name, "params": sorted(read), "modules": modules}))
