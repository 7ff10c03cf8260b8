"""The worker's stdout and stderr, routed to the stage being served.

The worker's fds 1 and 2 are pipes it owns for its whole life; a thread per pipe forwards what arrives to
the current sink: the client's stdout or stderr (passed with the request) while a stage runs, the worker's
log otherwise. The client's own descriptors are never handed to anything else, which matters because
the stage's work can start processes that outlive it (the vLLM engine, the math-verify pool): those
inherit the worker's pipes, so their later output goes to whichever stage is running then, and the
client's stdout closes (DVC, or a test reading it, sees end of file) as soon as its stage has ended.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading

SENTINEL = b"\x00rlpipe-drain\x00"


class OutputRouter:
    def __init__(self, log_fd: int):
        self.log_fd = log_fd
        self.lock = threading.Lock()
        self.sinks = {1: log_fd, 2: log_fd}
        self.drained = {1: threading.Event(), 2: threading.Event()}
        for fd in (1, 2):
            read_end, write_end = os.pipe()
            os.dup2(write_end, fd)
            os.close(write_end)
            threading.Thread(target=self._forward, args=(read_end, fd), daemon=True).start()

    def _forward(self, read_end: int, fd: int) -> None:
        pending = b""
        while True:
            chunk = os.read(read_end, 1 << 16)
            if not chunk:
                return
            pending += chunk
            while SENTINEL in pending:
                before, pending = pending.split(SENTINEL, 1)
                self._write(fd, before)
                self.drained[fd].set()
            # keep back a tail that could be the start of a sentinel split across reads
            keep = next((n for n in range(len(SENTINEL) - 1, 0, -1) if pending.endswith(SENTINEL[:n])), 0)
            self._write(fd, pending[: len(pending) - keep])
            pending = pending[len(pending) - keep:]

    def _write(self, fd: int, data: bytes) -> None:
        with self.lock:
            target = self.sinks[fd]
        while data:
            try:
                written = os.write(target, data)
            except OSError:  # the client is gone: what it would have printed is dropped
                return
            data = data[written:]

    def _drain(self) -> None:
        """Wait until everything written to fds 1 and 2 so far has been forwarded."""
        sys.stdout.flush()
        sys.stderr.flush()
        for fd in (1, 2):
            self.drained[fd].clear()
            os.write(fd, SENTINEL)
        for fd in (1, 2):
            self.drained[fd].wait(timeout=10)

    @contextlib.contextmanager
    def to(self, stdout_fd: int, stderr_fd: int):
        """Forward the worker's output to these descriptors (a stage's client) for the block."""
        self._drain()
        with self.lock:
            self.sinks = {1: stdout_fd, 2: stderr_fd}
        try:
            yield
        finally:
            self._drain()
            with self.lock:
                self.sinks = {1: self.log_fd, 2: self.log_fd}
            os.close(stdout_fd)
            os.close(stderr_fd)
