"""The dataset catalogue: which datasets exist, their shapes and normalization, and the arrays they load into.

`dataset_info` gives a dataset's input shape and number of classes without loading it; `ArrayDataset` holds
normalized NCHW float32 images and their labels (`dpcore.task.data` loads them).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_MNIST_MEAN, _MNIST_STD = (0.1307,), (0.3081,)


@dataclass(frozen=True)
class _Spec:
    input_shape: tuple[int, int, int]
    num_classes: int
    mean: tuple[float, ...] = ()  # per channel; empty: the pool's own mean/std (digits)
    std: tuple[float, ...] = ()


SPECS = {
    "mnist-embedded": _Spec((1, 28, 28), 10, _MNIST_MEAN, _MNIST_STD),
    "digits": _Spec((1, 8, 8), 10),
    "mnist": _Spec((1, 28, 28), 10, _MNIST_MEAN, _MNIST_STD),
    "fashion-mnist": _Spec((1, 28, 28), 10, (0.2860,), (0.3530,)),
    "emnist": _Spec((1, 28, 28), 62, _MNIST_MEAN, _MNIST_STD),
    "cifar10": _Spec((3, 32, 32), 10, (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": _Spec((3, 32, 32), 100, (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "femnist": _Spec((1, 28, 28), 62, _MNIST_MEAN, _MNIST_STD),
}
DATASETS = tuple(SPECS)


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


def check_dataset(name: str) -> _Spec:
    if name not in SPECS:
        raise ValueError(f"dataset={name!r} is not one of: {', '.join(DATASETS)}")
    return SPECS[name]


def dataset_info(name: str) -> dict:
    """{"input_shape": (C, H, W), "num_classes": int} of a dataset, without loading it."""
    spec = check_dataset(name)
    return {"input_shape": spec.input_shape, "num_classes": spec.num_classes}
