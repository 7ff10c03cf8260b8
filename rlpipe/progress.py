"""Progress for generation, scoring and training: tqdm bars on a terminal; elsewhere (a log file, CI,
`nohup`) a plain line a minute for work that lasts longer than that, so that an hour-long phase is not
silent.

`RLPIPE_PROGRESS=1` forces bars on (e.g. under a pager), `RLPIPE_PROGRESS=0` turns bars and lines off.
"""

from __future__ import annotations

import os
import sys
import time

LINE_INTERVAL_SECONDS = 60.0
"""Least time between two progress lines off a terminal."""


def bars_enabled() -> bool:
    forced = os.environ.get("RLPIPE_PROGRESS")
    if forced is not None:
        return forced not in ("0", "false", "")
    return sys.stderr.isatty()


def progress(total: int | None = None, desc: str = "", unit: str = "it"):
    """A tqdm bar on a terminal; off one, `ProgressLines` unless `RLPIPE_PROGRESS` turned progress off."""
    from tqdm import tqdm

    if bars_enabled():
        return tqdm(total=total, desc=desc, unit=unit, leave=False, dynamic_ncols=True)
    # off a terminal, torchrun's other ranks stay quiet: their lines would repeat rank 0's
    if os.environ.get("RLPIPE_PROGRESS") is None and os.environ.get("RANK", "0") == "0":
        return ProgressLines(total, desc, unit)
    return tqdm(total=total, disable=True)


class ProgressLines:
    """The part of tqdm's interface the loops use (`update`, `set_postfix`, a context manager), written as
    one line to stderr at most every `interval` seconds, and a last line at the end if any was written:
    `value pretrain: 1200/4000 step (30%), 5m12s, loss=0.0123 ev=0.412`. Work shorter than `interval`
    prints nothing."""

    def __init__(self, total: int | None, desc: str, unit: str, interval: float = LINE_INTERVAL_SECONDS):
        self.total, self.desc, self.unit, self.interval = total, desc, unit, interval
        self.count, self.postfix, self.lines = 0, "", 0
        self.started = self.last_line = time.monotonic()

    def __enter__(self) -> "ProgressLines":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:  # a loop that raised is not done; its error says the rest
            self.close()

    def update(self, n: int = 1) -> None:
        self.count += n
        if time.monotonic() - self.last_line >= self.interval:
            self.write()

    def set_postfix(self, ordered_dict=None, refresh: bool = True, **values) -> None:
        self.postfix = " ".join(f"{k}={v}" for k, v in {**(ordered_dict or {}), **values}.items())

    def close(self) -> None:
        if self.lines:
            self.write(last=True)

    def write(self, last: bool = False) -> None:
        now = time.monotonic()
        elapsed = int(now - self.started)
        done = f"{self.count}/{self.total}" if self.total else f"{self.count}"
        share = f" ({100 * self.count / self.total:.0f}%)" if self.total else ""
        parts = [f"{done} {self.unit}{share}", f"{elapsed // 60}m{elapsed % 60:02d}s" + (" (done)" if last else "")]
        if self.postfix:
            parts.append(self.postfix)
        print(f"{self.desc}: {', '.join(parts)}", file=sys.stderr, flush=True)
        self.lines += 1
        self.last_line = now
