"""The binary cache of decoded data and partitions: one .npz file per key under `cache_dir()`, written
atomically, rebuilt (with a warning naming it) when it cannot be read."""

from __future__ import annotations

import contextlib
import hashlib
import os
import warnings
import zipfile
import zlib
from pathlib import Path

import numpy as np

from dpfl.dpcore.task.atomic import atomic_write

CACHE_VERSION = 1  # bump when decoding or partitioning changes what a cached file holds


def cache_dir() -> Path:
    """$DPFL_CACHE_DIR, else $XDG_CACHE_HOME/dpfl, else ~/.cache/dpfl."""
    if os.environ.get("DPFL_CACHE_DIR"):
        return Path(os.environ["DPFL_CACHE_DIR"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dpfl"


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


_CACHE_READ_ERRORS = (OSError, EOFError, ValueError, zipfile.BadZipFile, zlib.error)


def _read_cache(path: Path, valid) -> dict[str, np.ndarray] | None:
    """The arrays of a cache file, or None (with a warning naming the file) when it is unreadable or `valid`
    refuses what it holds: the caller rebuilds it."""
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {k: data[k] for k in data.files}
        problem = None if valid(arrays) else f"it holds {sorted(arrays)} with other shapes or keys than expected"
    except _CACHE_READ_ERRORS as exc:
        problem = f"{type(exc).__name__}: {exc}"
    if problem is None:
        return arrays
    warnings.warn(f"cache file {path} is corrupted ({problem}): rebuilding it", stacklevel=3)
    return None


def cached_arrays(key: str, build, valid=lambda arrays: True) -> dict[str, np.ndarray]:
    """The arrays stored under `key` in the cache, or `build()`'s, stored first; a cache file that cannot be
    read or fails `valid` (a predicate on the arrays) is rebuilt and replaced, with a warning naming it."""
    path = cache_dir() / f"{key}.npz"
    if path.exists():
        arrays = _read_cache(path, valid)
        if arrays is not None:
            return arrays
    arrays = build()
    with contextlib.suppress(OSError):  # a read-only home: work without the cache
        atomic_write(path, lambda f: np.savez(f, **arrays))  # concurrent readers never see half a file
    return arrays
