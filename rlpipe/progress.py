"""Progress bars for generation, scoring and training: tqdm on a terminal, silent otherwise.

`RLPIPE_PROGRESS=1` forces bars on (e.g. under a pager), `RLPIPE_PROGRESS=0` forces them off.
"""

from __future__ import annotations

import os
import sys


def bars_enabled() -> bool:
    forced = os.environ.get("RLPIPE_PROGRESS")
    if forced is not None:
        return forced not in ("0", "false", "")
    return sys.stderr.isatty()


def progress(total: int | None = None, desc: str = "", unit: str = "it"):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, disable=not bars_enabled(), leave=False, dynamic_ncols=True)
