"""The md5 of each file a stage writes, computed on threads of its own while the stage goes on writing.

DVC reads every output again to hash it once the stage has ended (rlpipe/dvc_state.py says why that
matters). Hashing the same bytes while they are written costs little wall time: the stage's thread
serialises the next file while the md5 of the last one runs on the other cores. Inside an
`atomic_directory` that collects md5s, writers say when a file is complete (`files_written`), or write
through `open_for_writing`, whose md5 comes from the bytes as they pass; anything they did not announce
is hashed at the end, while the files are fsynced. Elsewhere both are plain writes. Standard library
only, like rlpipe/atomic.py.

A digest is used only while the file still has the size, mtime and inode it had when its hashing began
(`FileHasher.digests`): a file rewritten after it was announced is hashed again from disk.
"""

from __future__ import annotations

import hashlib
import os
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import BinaryIO, Iterator

HASH_CHUNK_BYTES = 8 << 20

_waited = [0.0]
"""Seconds this process's writers have waited on hashing (a full queue, digests not ready): what hashing
adds to a stage's wall time, reported as `stage/hash_wait_seconds`."""


def hash_wait_seconds() -> float:
    return _waited[0]


class _Waiting:
    def __enter__(self):
        self.started = time.perf_counter()

    def __exit__(self, *exc):
        _waited[0] += time.perf_counter() - self.started


def md5_of_file(path: Path) -> str:
    digest = hashlib.md5()
    with open(path, "rb") as handle:
        while chunk := handle.read(HASH_CHUNK_BYTES):
            digest.update(chunk)  # releases the GIL for chunks this size
    return digest.hexdigest()


def identity(path: Path) -> tuple[int, int, int]:
    info = os.stat(path)
    return info.st_size, info.st_mtime_ns, info.st_ino


class FileHasher:
    """The md5s of the files written under one directory, each computed as soon as it is complete."""

    def __init__(self):
        self.pool = ThreadPoolExecutor(max(1, min(4, os.cpu_count() or 1)), thread_name_prefix="md5")
        self.pending: dict[Path, tuple[tuple[int, int, int], Future | str]] = {}

    def hash_file(self, path: Path) -> None:
        path = Path(path)
        if path not in self.pending:
            self.pending[path] = (identity(path), self.pool.submit(md5_of_file, path))

    def streamed(self, path: Path, md5: str) -> None:
        self.pending[Path(path)] = (identity(path), md5)

    def digests(self, files: list[Path]) -> dict[Path, str]:
        """Each file's md5, waiting for the hashing still running; what changed since is hashed again."""
        for file in files:
            self.hash_file(file)
        out = {}
        with _Waiting():
            for file in files:
                seen, digest = self.pending[file]
                digest = digest if isinstance(digest, str) else digest.result()
                out[file] = digest if identity(file) == seen else md5_of_file(file)
        return out

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


_active: ContextVar[FileHasher | None] = ContextVar("rlpipe_file_hasher", default=None)


@contextmanager
def hashing() -> Iterator[FileHasher]:
    """Collect md5s: `files_written` and `open_for_writing` inside feed the hasher yielded."""
    hasher = FileHasher()
    token = _active.set(hasher)
    try:
        yield hasher
    finally:
        _active.reset(token)
        hasher.close()


def files_written(directory: Path) -> None:
    """Every file now under `directory` is complete: start hashing it (when md5s are being collected)."""
    hasher = _active.get()
    if hasher is not None:
        for file in sorted(Path(directory).rglob("*")):
            if file.is_file():
                hasher.hash_file(file)


class _HashingStream:
    """A binary file whose md5 a thread computes from the bytes written, as they are written."""

    def __init__(self, handle: BinaryIO):
        self.handle = handle
        self.md5 = hashlib.md5()
        self.chunks: queue.Queue = queue.Queue(maxsize=4)  # bounds the bytes held: a few writes' worth
        self.thread = threading.Thread(target=self._hash, name="md5-stream", daemon=True)
        self.thread.start()

    def _hash(self) -> None:
        while (chunk := self.chunks.get()) is not None:
            self.md5.update(chunk)

    def write(self, data) -> int:
        with _Waiting():
            chunk = bytes(data)  # the caller may reuse its buffer once write returns
            self.chunks.put(chunk)
        return self.handle.write(chunk)

    def flush(self) -> None:
        self.handle.flush()

    def hexdigest(self) -> str:
        with _Waiting():
            self.chunks.put(None)
            self.thread.join()
        return self.md5.hexdigest()


@contextmanager
def open_for_writing(path: Path) -> Iterator[BinaryIO]:
    """`open(path, "wb")`; when md5s are being collected, the file's md5 is computed from the bytes as
    they are written. For writers that take a file object and only append (torch.save does)."""
    hasher = _active.get()
    with open(path, "wb") as handle:
        if hasher is None:
            yield handle
            return
        stream = _HashingStream(handle)
        try:
            yield stream  # type: ignore[misc]
        finally:
            md5 = stream.hexdigest()
    hasher.streamed(path, md5)
