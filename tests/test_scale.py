"""What 10,000 simulated clients need: memory-mapped datasets (docs/scale.md has the measured runs:
python -m benchmarks.scale)."""

import dataclasses
import warnings

import numpy as np
import pytest
import torch

from dpfl.dpcore.task.catalogue import ArrayDataset
from dpfl.dpcore.task.data import load_dataset
from dpfl.dpcore.task.mapped import memory_mapped
from dpfl.dpcore.task.models import build_model
from dpfl.dpcore.task.partitions import load_partition
from dpfl.dpcore.task.torch_helpers import as_tensors, evaluate_model


# ---------------------------------------------------------------- memory-mapped datasets
def two_datasets():
    rng = np.random.default_rng(0)
    return (
        ArrayDataset(rng.standard_normal((50, 1, 4, 4), dtype=np.float32), np.arange(50) % 10, 10),
        ArrayDataset(
            np.ones((7, 1, 4, 4), np.float32),
            np.zeros(7, np.int64),
            10,
            np.array([f"w{i % 3}" for i in range(7)], dtype=object),
        ),
    )


def test_memory_mapped_datasets_are_written_once_and_mapped_read_only(tmp_path):
    built = two_datasets()
    train, test = memory_mapped(tmp_path / "d", lambda: built, ArrayDataset)
    assert np.array_equal(train.x, built[0].x) and test.writer_ids.tolist() == built[1].writer_ids.tolist()
    assert test.writer_ids.dtype == object  # FEMNIST's writer ids: strings, stored without pickling
    assert (train.num_classes, train.writer_ids) == (10, None)
    assert isinstance(train.x.base, np.memmap) and not train.x.flags.writeable

    def fail():
        raise AssertionError("built again")

    again, _ = memory_mapped(tmp_path / "d", fail, ArrayDataset)
    assert np.array_equal(again.x, built[0].x)
    part = again.subset(np.array([3, 1]))  # a client's samples: an ordinary, writable copy
    assert part.x.flags.writeable and np.array_equal(part.y, [3, 1])
    assert [p.name for p in tmp_path.iterdir()] == ["d"]  # no temporary folder left behind


def test_a_second_writer_keeps_the_first_copy(tmp_path):
    first = two_datasets()
    memory_mapped(tmp_path / "d", lambda: first, ArrayDataset)
    other = tuple(dataclasses.replace(d, x=d.x + 1) for d in first)
    write = memory_mapped.__globals__["_write"]
    write(tmp_path / "d", other)  # lost the race: discarded without an error
    train, _ = memory_mapped(tmp_path / "d", lambda: other, ArrayDataset)
    assert np.array_equal(train.x, first[0].x) and len(list(tmp_path.iterdir())) == 1


def test_an_unwritable_cache_gives_the_datasets_in_memory(tmp_path):
    (tmp_path / "file").write_text("x")
    train, _ = memory_mapped(tmp_path / "file" / "d", two_datasets, ArrayDataset)
    assert train.x.flags.writeable and train.x.shape == (50, 1, 4, 4)


def test_the_app_reads_the_mapped_dataset_without_copies_or_warnings():
    pool, test = load_dataset("mnist-embedded")
    assert isinstance(pool.x.base, np.memmap) and not test.x.flags.writeable
    train, _ = load_partition("mnist-embedded", 1, 20, "iid", seed=3)
    assert train.x.flags.writeable and len(train) == 180
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns on tensors over read-only arrays
        x, y = as_tensors(test, slice(0, 16))
        loss, accuracy = evaluate_model(build_model("cnn-mnist", (1, 28, 28), 10), test)
    assert x.shape == (16, 1, 28, 28) and y.dtype == torch.int64 and np.isfinite(loss) and 0 <= accuracy <= 1


def mapped_kib(path: str) -> int:
    """KiB of this process's memory mapped from the file `path` (summed over its mappings in /proc/self/smaps)."""
    total, current = 0, ""
    for line in open("/proc/self/smaps"):
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line: address range ... path
            current = fields[5] if len(fields) >= 6 else ""
        elif fields[0] == "Rss:" and current == path:
            total += int(fields[1])
    return total


@pytest.mark.slow  # 2-9 s together: the fast tier keeps its 5-minute margin on 2 cores
def test_a_process_keeps_only_the_samples_its_clients_copied():
    """The kernel maps far more than the samples a client copies (here one client's 40 samples mapped most
    of the 12 MB pool); load_partition drops the pool's pages again."""
    pool, _ = load_dataset("mnist-embedded")
    path = next(p for p in open("/proc/self/maps").read().split() if p.endswith("0-x.npy") and "normalized-" in p)
    for pid in range(0, 100, 2):
        train, _ = load_partition("mnist-embedded", pid, 100, "iid", seed=5)
        assert mapped_kib(path) < 64, pid  # without release_pages: 10-12 MB
    assert len(train) == 36 and np.isfinite(train.x).all()
