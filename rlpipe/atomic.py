"""Atomic writes: a file or a whole directory appears complete at its path, or not at all.

Writers write to a temporary sibling, fsync, then rename, so a killed stage never leaves a half-written
output that DVC or the next stage would accept. A path is never opened for writing in place: with
DVC's linked cache, an output file may be a hard link (or symlink) into the cache, and writing through
it would corrupt the cached copy; a rename replaces the link instead. Needs nothing beyond the
standard library, so that the thin stage client can use it.
"""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Iterator


def fsync_path(path: Path) -> None:
    flags = os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0)
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _temp_sibling(path: Path) -> Path:
    """A fresh temporary beside `path` (same filesystem, so the final rename is atomic). Temporaries a
    killed writer left behind are removed first; .dvcignore keeps them out of DVC's hashes meanwhile."""
    for stale in path.parent.glob(f".{path.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink(missing_ok=True)
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_sibling(path)
    with open(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


@contextmanager
def atomic_directory(path: Path, md5s: dict[Path, str] | None = None) -> Iterator[Path]:
    """Yield a temporary directory to fill; on success it replaces `path` whole, on error it vanishes.
    Given a dict `md5s`, it is filled with the md5 of every file written, keyed by its final path, hashed
    as the writers go (rlpipe/file_md5.py)."""
    from rlpipe.file_md5 import hashing  # here: a stage's thin client imports this module, never hashes

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_sibling(path)
    tmp.mkdir()
    try:
        with (hashing() if md5s is not None else nullcontext()) as hasher:
            yield tmp
            written = sorted(child for child in tmp.rglob("*") if child.is_file())
            for file in written if hasher else ():
                hasher.hash_file(file)  # what no writer announced, hashed while the files are fsynced
            for file in written:
                fsync_path(file)
            digests = hasher.digests(written) if hasher else {}
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
        fsync_path(path.parent)
        if md5s is not None:  # a rename keeps each file's inode and mtime: the digests stay true
            md5s.update({path / file.relative_to(tmp): digest for file, digest in digests.items()})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
