"""Local services (the tracking daemon, the warm worker) that serve their owner only.

- The socket is a file in a directory only the owner can enter (`service_dir`: mode 0700, owned by this
  uid, refused otherwise), not an abstract socket, which has no permissions at all.
- Every accepted connection is checked with SO_PEERCRED: a peer of another uid is dropped (`peer_is_owner`).
- A connection that sends nothing for `idle_s` is dropped (`read_line`), so a client that holds its
  connection open cannot stall the service.
- Paths a client names are acted on only inside the project's run directory (`inside`).
"""

from __future__ import annotations

import hashlib
import os
import socket
import stat
import struct
import tempfile
import time
from pathlib import Path


class ServiceError(OSError):
    """The service's directory or socket cannot be trusted or reached."""


def service_dir() -> Path:
    """A directory for this user's sockets that only this user can enter: $XDG_RUNTIME_DIR/rlpipe, else
    <tmp>/rlpipe-<uid>. Created 0700; an existing one that another user owns, or that others can enter,
    is refused rather than used."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    path = Path(base) / "rlpipe" if base and Path(base).is_dir() else Path(tempfile.gettempdir()) / f"rlpipe-{os.getuid()}"
    try:
        path.mkdir(mode=0o700, exist_ok=True)
    except OSError as err:
        raise ServiceError(f"{path}: cannot create the directory for rlpipe's local sockets ({err})") from None
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise ServiceError(f"{path}: not a private directory of uid {os.getuid()} (owner {info.st_uid}, "
                           f"mode {oct(info.st_mode & 0o777)}); remove it so that rlpipe can create its own")
    return path


def socket_path(kind: str, *identity: str) -> Path:
    """The socket of one service instance (`kind` = tracking or worker), named by a hash of its identity.
    Short enough for AF_UNIX's 108-byte limit."""
    digest = hashlib.sha256("|".join(identity).encode()).hexdigest()[:20]
    return service_dir() / f"{kind}-{digest}.sock"


def listen(path: Path) -> socket.socket | None:
    """Bind and listen on `path`; None if a live service already listens there. A stale socket file (its
    service died) is replaced."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(str(path))
    except OSError:
        if can_connect(path):
            listener.close()
            return None
        path.unlink(missing_ok=True)
        listener.bind(str(path))
    os.chmod(path, 0o600)
    listener.listen(16)
    return listener


def can_connect(path: Path) -> bool:
    try:
        connect(path).close()
        return True
    except OSError:
        return False


def connect(path: Path, timeout: float | None = None) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(str(path))
    except OSError:
        sock.close()
        raise
    sock.settimeout(None)
    return sock


def wait_for(path: Path, deadline_s: float, alive=lambda: True) -> socket.socket:
    """Connect to a service that is starting; give up after `deadline_s` or once `alive()` is False."""
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            return connect(path)
        except OSError:
            if time.monotonic() > deadline or not alive():
                raise
            time.sleep(0.02)


def peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def peer_is_owner(conn: socket.socket) -> bool:
    """Whether the connected process runs as this process's uid (Linux SO_PEERCRED)."""
    try:
        return peer_uid(conn) == os.getuid()
    except OSError:
        return False


def inside(path: str | Path, root: Path) -> bool:
    """Whether `path` (resolved, symlinks followed) lies inside `root`."""
    try:
        return Path(path).resolve().is_relative_to(root.resolve())
    except (OSError, ValueError):
        return False


def process_alive(pid: int | None) -> bool:
    """Whether process `pid` still runs (None: no owner to watch). A zombie (exited, not yet reaped by
    its parent) counts as gone: a `dvc` that has finished is one until whoever started it reads its exit."""
    if pid is None:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True
