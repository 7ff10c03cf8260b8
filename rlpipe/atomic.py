"""Atomic writes: a file or a whole directory appears complete at its path, or not at all.

Writers write to a temporary sibling, fsync, then rename, so a killed stage never leaves a half-written
output that DVC or the next stage would accept. A path is never opened for writing in place: with
DVC's linked cache, an output file may be a hard link (or symlink) into the cache, and writing through
it would corrupt the cached copy; a rename replaces the link instead. Needs nothing beyond the
standard library, so that the thin stage client can use it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
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


HASH_CHUNK_BYTES = 8 << 20


def md5_of_file(path: Path) -> str:
    digest = hashlib.md5()
    with open(path, "rb") as handle:
        while chunk := handle.read(HASH_CHUNK_BYTES):
            digest.update(chunk)  # releases the GIL for chunks this size
    return digest.hexdigest()


def fsync_files(files: list[Path], with_md5: bool) -> dict[Path, str]:
    """fsync each file; with `with_md5`, hash them meanwhile and return each one's md5. The hashing
    reads the page cache on threads of its own while fsync waits on the disk, so it costs little wall
    time where the fsync is slow."""
    if not with_md5:
        for file in files:
            fsync_path(file)
        return {}
    with ThreadPoolExecutor(max(1, min(4, os.cpu_count() or 1))) as pool:
        digests = {file: pool.submit(md5_of_file, file) for file in files}
        for file in files:
            fsync_path(file)
        return {file: digest.result() for file, digest in digests.items()}


@contextmanager
def atomic_directory(path: Path, md5s: dict[Path, str] | None = None) -> Iterator[Path]:
    """Yield a temporary directory to fill; on success it replaces `path` whole, on error it vanishes.
    Given a dict `md5s`, it is filled with the md5 of every file written, keyed by its final path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_sibling(path)
    tmp.mkdir()
    try:
        yield tmp
        written = sorted(child for child in tmp.rglob("*") if child.is_file())
        digests = fsync_files(written, with_md5=md5s is not None)
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
        fsync_path(path.parent)
        if md5s is not None:  # a rename keeps each file's inode and mtime: the digests stay true
            md5s.update({path / file.relative_to(tmp): digest for file, digest in digests.items()})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
