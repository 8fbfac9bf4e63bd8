"""Datasets kept as memory-mapped .npy files, so that a process holds in memory only the samples it reads.

With thousands of simulated clients every ClientApp process (each Ray worker) and the ServerApp load the
dataset, and each used to hold all of it in its own memory: the normalized MNIST training pool alone is
188 MB per process, of which a client with 6 samples reads 19 KB. `memory_mapped` writes the arrays of
the datasets a builder returns once into a cache folder (atomically: a folder renamed into place) and
maps them read-only in every later call: the pages a process touches are read from the page cache and
shared, the rest never enter its memory. The arrays are read-only; indexing them with a list of samples
(a client's partition) makes an ordinary in-memory copy of those samples.

The kernel maps more than the pages a read touches (fault-around: the neighbouring pages already in the page
cache, 64 KB here, whatever `madvise` says), so a process that copies a few scattered samples per client
ends up mapping all of the file after a few thousand samples (measured: 3,000 random MNIST samples mapped
168 of its 188 MB). `release_pages` drops the mapping's pages from the process after such a copy
(MADV_DONTNEED: the page cache keeps them, the next read maps them again).
"""

from __future__ import annotations

import dataclasses
import json
import mmap
import os
import secrets
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import numpy as np

T = TypeVar("T")
MANIFEST = "manifest.json"


def memory_mapped(folder: Path, build: Callable[[], Sequence[T]], cls: type[T]) -> tuple[T, ...]:
    """The `cls` dataclass instances that `build()` returns, with their numpy arrays memory-mapped read-only
    from `folder` (written from `build()` by the first call; its other fields, ints and None, kept in a
    manifest). Where the folder cannot be written (a read-only cache), the built instances, in memory."""
    if not (folder / MANIFEST).exists():
        built = tuple(build())
        try:
            _write(folder, built)
        except OSError:
            return built
    return _read(folder, cls)


def _write(folder: Path, items: Sequence) -> None:
    """Each item's array fields as <index>-<field>.npy, the rest in the manifest; renamed into place whole, so
    a reader sees all of it or nothing (a concurrent writer that lost the race discards its copy)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    temp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    temp.mkdir()
    try:
        manifest = []
        for i, item in enumerate(items):
            fields = {}
            for field in dataclasses.fields(item):
                value = getattr(item, field.name)
                if isinstance(value, np.ndarray):
                    fields[field.name] = {"array": f"{i}-{field.name}.npy", "object": value.dtype == object}
                    np.save(temp / fields[field.name]["array"], _storable(value), allow_pickle=False)
                else:
                    fields[field.name] = {"value": value}
            manifest.append(fields)
        (temp / MANIFEST).write_text(json.dumps(manifest))
        try:
            temp.rename(folder)
        except OSError:
            if not (folder / MANIFEST).exists():
                raise
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def _storable(array: np.ndarray) -> np.ndarray:
    """The array as .npy stores it without pickling: an object array of strings (FEMNIST's writer ids) as a
    fixed-width string array (read back into an object array, in memory)."""
    if array.dtype != object:
        return np.ascontiguousarray(array)
    if not all(isinstance(v, str) for v in array.flat):
        raise OSError("an object array other than strings cannot be stored without pickling")
    return np.asarray(array.tolist(), dtype=str)


def _read(folder: Path, cls: type[T]) -> tuple[T, ...]:
    manifest = json.loads((folder / MANIFEST).read_text())

    def value(spec: dict):
        if "array" not in spec:
            return spec["value"]
        if spec["object"]:
            return np.load(folder / spec["array"], allow_pickle=False).astype(object)
        # a plain ndarray view of the read-only map (the map stays alive as its base)
        return np.load(folder / spec["array"], mmap_mode="r", allow_pickle=False).view(np.ndarray)

    return tuple(cls(**{name: value(spec) for name, spec in fields.items()}) for fields in manifest)


def release_pages(array: np.ndarray) -> None:
    """Unmap from this process the pages of the file map behind `array` (nothing for an in-memory array)."""
    base = array
    while base is not None and not isinstance(base, np.memmap):
        base = getattr(base, "base", None)
    if base is not None and getattr(base, "_mmap", None) is not None:
        base._mmap.madvise(mmap.MADV_DONTNEED)
