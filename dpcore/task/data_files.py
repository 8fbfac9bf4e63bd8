"""Dataset files: the readers of local files (IDX, CIFAR python batches, Hugging Face parquet) and the downloads.

`read_local` reads a `data_dir` folder and `download` fetches from the Hugging Face hub (EMNIST: from NIST via
torchvision), raising a RuntimeError that says which files to put where when offline; both return the raw
uint8 images (`RawImages`) that `dpcore.task.data` normalizes.
"""

from __future__ import annotations

import gzip
import io
import math
import urllib.error
import urllib.request
import zlib
from pathlib import Path
from typing import NamedTuple

import numpy as np

from dpfl.dpcore.task.catalogue import SPECS

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


class DataFileError(ValueError):
    """A dataset file that cannot be used (corrupted, truncated, another format); the message names it."""


class RawImages(NamedTuple):
    """Images as uint8 (N, H, W) or (N, H, W, C) before normalization; test may be missing."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray | None = None
    y_test: np.ndarray | None = None
    writers_train: np.ndarray | None = None


def read_local(name: str, folder: Path) -> RawImages:
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


def _check_raw(name: str, raw: RawImages, folder: Path) -> None:
    """The images have the dataset's size and the labels its classes; DataFileError naming the folder if not."""
    spec = SPECS[name]
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


def _read_idx_folder(folder: Path, stems: tuple[str, ...]) -> RawImages | None:
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
            return RawImages(*arrays)
    return None


def _read_cifar(name: str, folder: Path) -> RawImages | None:
    """torchvision's CIFAR python batches under `folder` (or `folder` itself); None if absent."""
    from torchvision.datasets import CIFAR10, CIFAR100

    sub = _CIFAR_FOLDERS[name]
    root = folder.parent if folder.name == sub else folder
    if not (root / sub).is_dir():
        return None
    cls = CIFAR10 if name == "cifar10" else CIFAR100
    train, test = cls(str(root), train=True, download=False), cls(str(root), train=False, download=False)
    return RawImages(train.data, np.asarray(train.targets), test.data, np.asarray(test.targets))


def _read_parquet_folder(name: str, folder: Path) -> RawImages | None:
    """A Hugging Face parquet export: train*.parquet (and test*.parquet) anywhere under `folder`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    files = {split: sorted(folder.rglob(f"{split}*.parquet")) for split in ("train", "test")}
    if not files["train"]:
        return None
    return _raw_from_tables(
        name, {split: pa.concat_tables(pq.read_table(f) for f in paths) for split, paths in files.items() if paths}
    )


def _raw_from_tables(name: str, tables: dict) -> RawImages:
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
    return RawImages(train[0], train[1], test[0], test[1], train[2])


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


def download(name: str) -> RawImages:
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


def _download_emnist() -> RawImages:
    from torchvision.datasets import EMNIST

    _check_online("emnist", _EMNIST_URL)
    try:  # the download holds every split: load the small test split only, then read the IDX files
        EMNIST(str(_EMNIST_CACHE), split="byclass", train=False, download=True)
    except Exception as exc:  # any download problem: network, server, disk
        raise _offline_error("emnist", f"downloading {_EMNIST_URL} failed ({exc})") from exc
    return read_local("emnist", _EMNIST_CACHE)
