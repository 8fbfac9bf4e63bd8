"""Files a crash cannot leave half done: writes that leave the old version or the new one (`atomic_write`), and
lock files that tell whether their holder still lives (`lock_held`)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def atomic_write(path: Path | str, write: Callable[[BinaryIO], None]) -> None:
    """write(f) into a temp file in the same folder, fsync, os.replace onto `path`, fsync the folder.

    A crash (or an exception) during the write leaves the previous file as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(exc, OSError) and exc.errno is not None and exc.filename is None:  # a full disk: which file
            exc.filename = str(path)
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable (POSIX)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def lock_held(lock: Path) -> bool:
    """Does a live process hold an flock on the file `lock`? The kernel drops a dead process's flock (SIGKILL, a
    crash), so a process that died holds none; False where the file does not exist."""
    try:
        fd = os.open(lock, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # also releases the shared lock just taken
    return False
