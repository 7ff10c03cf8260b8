"""Handing DVC the md5 of the files a stage has just written, so that DVC does not read them again.

After a stage, DVC hashes every output to record it in dvc.lock and its cache: one more pass over a
checkpoint that the stage has only just written. For benchmark g's 1.36 GB checkpoint that pass was
2.26 s of a 9.6 s round. A stage's directory outputs (`stage_output_directory`) are hashed as they are
written, on threads of their own (rlpipe/file_md5.py), and the digests go into DVC's own state
database through DVC's own API (`dvc_data`'s `State.save_many`): the same entry DVC would write after
hashing the file itself, keyed by the file's path, inode, mtime and size. DVC then finds the hash where
it always looks first.

Why this cannot serve a stale hash: an entry only matches while the file keeps the inode, mtime and size
it had when it was recorded, and the digest is of the bytes on disk after the file was closed. If
anything goes wrong (DVC missing, another state layout, the path in no DVC repository), nothing is
recorded and DVC hashes the file as before. Outside a DVC stage (`DVC_STAGE` unset: a stage run by hand,
a script) nothing is hashed at all.
"""

from __future__ import annotations

import os
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from rlpipe.atomic import atomic_directory

_state_dirs: dict[Path, str] = {}
"""DVC repository root -> its state directory (DVC's `site_cache_dir`), computed once per process."""


def running_as_dvc_stage() -> bool:
    return bool(os.environ.get("DVC_STAGE"))  # DVC sets it for every stage command


@contextmanager
def stage_output_directory(path: Path) -> Iterator[Path]:
    """`atomic_directory(path)`; when this runs as a DVC stage, the md5 of every file it holds is then
    recorded in DVC's state database."""
    if not running_as_dvc_stage():
        with atomic_directory(path) as tmp:
            yield tmp
        return
    md5s: dict[Path, str] = {}
    with atomic_directory(path, md5s) as tmp:
        yield tmp
    record_md5s(md5s)


def record_md5s(md5s: dict[Path, str]) -> bool:
    """Record each file's md5 in the state database of the DVC repository that holds it, as DVC would
    after hashing it. True when recorded; False (with a warning) when DVC's API was not there to do it."""
    if not md5s:
        return False
    where = next(iter(md5s)).resolve().parent
    try:
        from dvc.exceptions import NotDvcRepoError
        from dvc.fs import LocalFileSystem
        from dvc.repo import Repo
        from dvc_data.hashfile.hash_info import HashInfo
        from dvc_data.hashfile.state import State

        try:
            root = Path(Repo.find_root(str(where)))
        except NotDvcRepoError:
            return False
        state = State(str(root), state_dir(root))
        try:
            state.save_many([(str(path.resolve()), HashInfo("md5", md5), None) for path, md5 in md5s.items()],
                            LocalFileSystem())
        finally:
            state.close()
        return True
    except Exception as err:  # DVC will hash the files itself, as it always did; only slower
        warnings.warn(f"could not hand DVC the md5 of {len(md5s)} file(s) under {where}; "
                      f"DVC will hash them itself: {err!r}")
        return False


def state_dir(root: Path) -> str:
    if root not in _state_dirs:
        from dvc.repo import Repo

        # site_cache_dir depends on the root, the user, DVC's major version and .dvc/tmp/btime: ask DVC
        with Repo(str(root)) as repo:
            _state_dirs[root] = repo.site_cache_dir
    return _state_dirs[root]
