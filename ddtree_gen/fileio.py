"""Safe file writes: atomic replacement and inter-process locks (artifacts, refs, KDTR)."""
from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
from pathlib import Path


def atomic_write(path, data: bytes | str) -> None:
    """Write a file so that readers see the old or the new content, never a torn one.

    A hidden temporary file in the same folder (mode 0666 minus the umask, like any new file),
    fsync, then rename over the target; the temporary file is removed on failure.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = data.encode() if isinstance(data, str) else data
    tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(6)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def file_lock(path):
    """An exclusive advisory lock held while the block runs; the lock file is removed when it is released.

    Removal is safe against a waiter: a process that was waiting on the removed file finds, once it holds
    the lock, that the path no longer names the file it locked, and locks the new one instead."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        f = open(path, "a+b")
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            try:
                same = os.stat(path).st_ino == os.fstat(f.fileno()).st_ino
            except FileNotFoundError:
                same = False
            if not same:          # removed (and maybe re-created) while we waited: lock the current one
                continue
            try:
                yield
            finally:
                with contextlib.suppress(OSError):
                    os.unlink(path)   # under the lock: no one else holds this file
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)
            return
        finally:
            f.close()
