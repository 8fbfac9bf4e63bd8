"""Datasets, partitioners and the model zoo."""

import functools
import os
import socket
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from opacus import GradSampleModule
from opacus.validators import ModuleValidator

from dpfl.dpcore.task import data, data_files, partitions
from dpfl.dpcore.task.catalogue import dataset_info
from dpfl.dpcore.task.data import load_dataset
from dpfl.dpcore.task.models import MODELS, build_model, count_parameters, head_parameter_names
from dpfl.dpcore.task.partitions import load_partition, partition_indices

torch.set_num_threads(1)

# The full MNIST as the four IDX .gz files (train/t10k images/labels), e.g. from yann.lecun.com or a
# Flower/torchvision download: `DPFL_MNIST_DIR=/path/to/mnist python -m pytest` (README, "Tests").
MNIST_DIR = Path(os.environ.get("DPFL_MNIST_DIR", "") or "/nonexistent-dpfl-mnist")


@pytest.fixture
def fresh_cache(monkeypatch, tmp_path_factory):
    """Empty dataset and partition caches for a test that fakes a source; the real caches stay as they are
    (in memory and on disk: the decoded arrays are cached on disk too, dpcore.task.mapped)."""
    monkeypatch.setenv("DPFL_CACHE_DIR", str(tmp_path_factory.mktemp("fresh-cache")))
    for module, cached in ((data, "_load_dataset"), (partitions, "_dataset_partitions")):
        monkeypatch.setattr(module, cached, functools.lru_cache(getattr(module, cached).__wrapped__))


def _online() -> bool:
    try:
        socket.create_connection(("huggingface.co", 443), timeout=3).close()
        return True
    except OSError:
        return False


# ---------------------------------------------------------------- datasets


def test_mnist_embedded():
    pool, test = load_dataset("mnist-embedded")
    assert pool.x.shape == (4000, 1, 28, 28) and test.x.shape == (1000, 1, 28, 28)
    assert pool.x.dtype == np.float32 and pool.y.dtype == np.int64 and len(pool) == 4000
    assert pool.num_classes == test.num_classes == 10
    assert set(np.unique(pool.y)) == set(range(10))
    assert abs(pool.x.mean()) < 0.2 and 0.8 < pool.x.std() < 1.2
    assert load_dataset("mnist-embedded") is load_dataset("mnist-embedded")  # cached


def test_digits():
    pool, test = load_dataset("digits")
    assert pool.x.shape == (1500, 1, 8, 8) and test.x.shape == (297, 1, 8, 8)
    assert abs(pool.x.mean()) < 1e-3 and abs(pool.x.std() - 1) < 1e-3


@pytest.mark.skipif(
    not MNIST_DIR.is_dir(),
    reason="full MNIST not found: set DPFL_MNIST_DIR to a folder with the four MNIST IDX .gz files to run this test",
)
def test_full_mnist_from_idx_files():
    pool, test = load_dataset("mnist", data_dir=str(MNIST_DIR))
    assert pool.x.shape == (60000, 1, 28, 28) and test.x.shape == (10000, 1, 28, 28)
    hist = np.bincount(test.y, minlength=10)
    assert hist.sum() == 10000 and hist.min() >= 850 and hist.max() <= 1200
    assert abs(pool.x.mean()) < 0.01 and abs(pool.x.std() - 1) < 0.01  # the MNIST constants fit


def test_dataset_info_matches_loaded_data():
    assert dataset_info("cifar100") == {"input_shape": (3, 32, 32), "num_classes": 100}
    assert dataset_info("femnist")["num_classes"] == 62
    for name in ("mnist-embedded", "digits"):
        pool, _ = load_dataset(name)
        assert dataset_info(name) == {"input_shape": pool.x.shape[1:], "num_classes": pool.num_classes}
    with pytest.raises(ValueError, match="dataset='foo' is not one of: mnist-embedded, digits"):
        dataset_info("foo")


def test_offline_download_fails_fast_and_names_data_dir():
    if _online():
        pytest.skip("this machine is online: the test would download CIFAR-10")
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match="data-dir") as err:
        load_dataset("cifar10")
    assert time.perf_counter() - t0 < 60
    assert "offline" in str(err.value) and "cifar-10-batches-py" in str(err.value)


def test_data_dir_without_the_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="t10k-images-idx3-ubyte.gz"):
        load_dataset("mnist", data_dir=str(tmp_path))


def _write_idx(path: Path, array: np.ndarray):
    header = bytes([0, 0, 8, array.ndim]) + np.asarray(array.shape, ">i4").tobytes()
    path.write_bytes(header + array.astype(np.uint8).tobytes())


def test_emnist_idx_files_in_torchvision_layout(tmp_path, fresh_cache):
    raw = tmp_path / "EMNIST" / "raw"
    raw.mkdir(parents=True)
    images = np.zeros((5, 28, 28), np.uint8)
    images[:, 0, 27] = 255  # stored transposed: row 0, last column -> last row, column 0
    for split, n in (("train", 5), ("test", 3)):
        _write_idx(raw / f"emnist-byclass-{split}-images-idx3-ubyte", images[:n])
        _write_idx(raw / f"emnist-byclass-{split}-labels-idx1-ubyte", np.arange(n) + 50)
    pool, test = load_dataset("emnist", data_dir=str(tmp_path))
    assert pool.x.shape == (5, 1, 28, 28) and test.x.shape == (3, 1, 28, 28) and pool.num_classes == 62
    assert pool.x[0, 0, 27, 0] > 2 and pool.x[0, 0, 0, 27] < 0  # transposed back to upright
    assert pool.y.tolist() == [50, 51, 52, 53, 54]


def _fake_hf_split(n: int, label_col: str, writers: np.ndarray | None = None, white_background=False):
    import datasets
    from PIL import Image

    rng = np.random.default_rng(0)
    images = np.zeros((n, 28, 28), np.uint8)
    images[:, 10:18, 12:16] = 255  # a stroke
    if white_background:
        images = 255 - images
    columns = {"image": [Image.fromarray(im) for im in images], label_col: rng.integers(0, 10, n)}
    features = {"image": datasets.Image(), label_col: datasets.Value("int64")}
    if writers is not None:
        columns["writer_id"] = [str(w) for w in writers]
        features["writer_id"] = datasets.Value("string")
    return datasets.Dataset.from_dict(columns, features=datasets.Features(features))


def test_parquet_export_in_data_dir(tmp_path, fresh_cache):
    _fake_hf_split(30, "label").to_parquet(tmp_path / "mnist" / "train-00000-of-00001.parquet")
    _fake_hf_split(10, "label").to_parquet(tmp_path / "mnist" / "test-00000-of-00001.parquet")
    pool, test = load_dataset("mnist", data_dir=str(tmp_path))
    assert pool.x.shape == (30, 1, 28, 28) and test.x.shape == (10, 1, 28, 28)
    assert pool.y.dtype == np.int64


def test_femnist_download_writer_split_and_natural_partitions(monkeypatch, fresh_cache):
    import datasets

    writers = np.repeat(np.arange(20), 6)
    fake = datasets.DatasetDict({"train": _fake_hf_split(len(writers), "character", writers, white_background=True)})
    monkeypatch.setattr(data_files, "_check_online", lambda name, url: None)
    monkeypatch.setattr(datasets, "load_dataset", lambda hub_id: fake)
    pool, test = load_dataset("femnist")
    assert len(pool) == 108 and len(test) == 12  # 2 of the 20 writers are held out for the server
    assert len(np.unique(pool.writer_ids)) == 18
    background = (0 - 0.1307) / 0.3081
    assert np.isclose(pool.x[0, 0, 0, 0], background, atol=1e-5)  # white background inverted like MNIST
    parts = partition_indices(pool.y, 5, "natural", seed=0, writer_ids=pool.writer_ids)
    assert all(len(np.unique(pool.writer_ids[p])) == 1 and len(p) == 6 for p in parts)
    train, held = load_partition("femnist", 0, 5, "natural")
    assert (len(train), len(held)) == (5, 1)
    with pytest.raises(ValueError, match="more than the 18 writers"):
        partition_indices(pool.y, 19, "natural", writer_ids=pool.writer_ids)


# ---------------------------------------------------------------- partitioning


@pytest.mark.parametrize("partitioner", ["iid", "dirichlet", "pathological"])
def test_partitions_disjoint_deterministic_seeded(partitioner):
    labels = load_dataset("mnist-embedded")[0].y
    parts = partition_indices(labels, 10, partitioner, seed=1)
    assert len(parts) == 10
    flat = np.concatenate(parts)
    assert len(flat) == len(np.unique(flat)) and flat.min() >= 0 and flat.max() < len(labels)
    if partitioner == "iid":
        assert np.array_equal(np.sort(flat), np.arange(len(labels)))
        assert {len(p) for p in parts} == {400}
    again = partition_indices(labels, 10, partitioner, seed=1)
    other = partition_indices(labels, 10, partitioner, seed=2)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))
    assert any(set(a.tolist()) != set(b.tolist()) for a, b in zip(parts, other))


def test_pathological_classes_per_client():
    labels = load_dataset("mnist-embedded")[0].y
    for k in (1, 2):
        parts = partition_indices(labels, 20, "pathological", classes_per_client=k, seed=0)
        assert all(len(np.unique(labels[p])) <= k for p in parts)
        assert set(np.unique(labels[np.concatenate(parts)])) == set(range(10))  # every label is used


def test_dirichlet_alpha_controls_skew():
    labels = load_dataset("mnist-embedded")[0].y

    def mean_max_class_fraction(alpha):
        parts = partition_indices(labels, 10, "dirichlet", alpha=alpha, seed=0)
        return np.mean([np.bincount(labels[p], minlength=10).max() / len(p) for p in parts])

    skewed, uniform = mean_max_class_fraction(0.05), mean_max_class_fraction(100.0)
    assert skewed > 0.5 and uniform < 0.2 and skewed > uniform + 0.3


def test_natural_needs_femnist_and_partitioner_names():
    with pytest.raises(ValueError, match="partitioner='natural'.*dataset='mnist-embedded'"):
        load_partition("mnist-embedded", 0, 10, "natural")
    with pytest.raises(ValueError, match="partitioner='shards' is not one of: iid, dirichlet"):
        partition_indices(np.zeros(10), 2, "shards")


def test_load_partition_90_10_split():
    labels = load_dataset("mnist-embedded")[0].y
    for pid in (0, 7):
        part = partition_indices(labels, 10, "dirichlet", seed=3)[pid]
        train, test = load_partition("mnist-embedded", pid, 10, "dirichlet", seed=3)
        assert len(train) + len(test) == len(part) and len(test) == max(1, len(part) // 10)
        assert train.x.shape[1:] == (1, 28, 28) and train.num_classes == 10
        assert sorted(np.concatenate([train.y, test.y]).tolist()) == sorted(labels[part].tolist())
    train, test = load_partition("mnist-embedded", 2, 10, "iid", seed=0)
    assert (len(train), len(test)) == (360, 40)
    with pytest.raises(ValueError, match="partition_id=10"):
        load_partition("mnist-embedded", 10, 10)


# ---------------------------------------------------------------- models

SHAPES = [(1, 28, 28), (1, 8, 8), (3, 32, 32)]


@pytest.mark.parametrize("name", MODELS)
def test_model_shapes_seed_opacus_head(name):
    for shape in SHAPES:
        model = build_model(name, shape, 10, seed=0)
        assert model(torch.randn(2, *shape)).shape == (2, 10)
        assert ModuleValidator.validate(model, strict=False) == []
        last_linear = [m for m in model.modules() if isinstance(m, torch.nn.Linear)][-1]
        params = dict(model.named_parameters())
        head = head_parameter_names(model)
        assert len(head) == 2 and params[head[0]] is last_linear.weight and params[head[1]] is last_linear.bias
    assert build_model(name, (1, 28, 28), 62)(torch.randn(1, 1, 28, 28)).shape == (1, 62)
    same = model.state_dict()  # SHAPES[-1], seed 0
    again, other = (build_model(name, SHAPES[-1], 10, seed=s).state_dict() for s in (0, 1))
    assert all(torch.equal(same[k], again[k]) for k in same)
    assert not all(torch.equal(same[k], other[k]) for k in same)


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
@pytest.mark.parametrize("name", MODELS)
def test_opacus_per_sample_gradients(name):
    model = GradSampleModule(build_model(name, (1, 8, 8), 10))
    torch.nn.functional.cross_entropy(model(torch.randn(3, 1, 8, 8)), torch.tensor([0, 1, 2])).backward()
    assert all(p.grad_sample.shape == (3, *p.shape) for p in model.parameters())


def test_build_model_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_model("mlp", (1, 8, 8), 10, seed=7)
    assert torch.equal(torch.rand(3), expected)


def test_parameter_counts():
    assert count_parameters(build_model("cnn-cifar10-dp2", (3, 32, 32), 10)) == 667_402  # as in DP2-FedSAM
    assert count_parameters(build_model("cnn-emnist", (1, 28, 28), 10)) == 1_663_370  # the FedAvg CNN
    assert count_parameters(build_model("cnn-mnist", (1, 28, 28), 10)) == 26_010
    assert 11.0e6 <= count_parameters(build_model("resnet18-gn", (3, 32, 32), 10)) <= 11.3e6


def test_head_prefix():
    model = build_model("cnn-mnist", (1, 28, 28), 10)
    assert head_parameter_names(model, "classifier") == [
        "classifier.1.weight",
        "classifier.1.bias",
        "classifier.3.weight",
        "classifier.3.bias",
    ]
    with pytest.raises(ValueError, match="head_prefix='fc'.*features, classifier"):
        head_parameter_names(model, "fc")
    with pytest.raises(ValueError, match="model='vgg' is not one of"):
        build_model("vgg", (1, 28, 28), 10)


def test_validation_split_is_held_out_from_every_client():
    """validation-fraction 0.1: the server's validation set is 10% of the pool, no client partition touches it,
    and the partitions cover the rest exactly once."""
    from dpfl.dpcore.task.partitions import _dataset_partitions, load_validation, validation_split

    pool, _ = load_dataset("digits")
    clients, held = validation_split(len(pool), 0.1)
    assert len(held) == round(0.1 * len(pool)) and not set(clients) & set(held)
    parts = _dataset_partitions("digits", "", 5, "iid", 0.5, 2, 7, 0.1)
    assert sorted(np.concatenate(parts).tolist()) == sorted(clients.tolist())
    validation = load_validation("digits", "", 0.1)
    np.testing.assert_array_equal(validation.x, pool.x[held])
    assert load_validation("digits", "", 0.0) is None
    # without a validation split the partitions are what they always were
    assert all(
        np.array_equal(a, b)
        for a, b in zip(
            _dataset_partitions("digits", "", 5, "iid", 0.5, 2, 7, 0.0), partition_indices(pool.y, 5, "iid", seed=7)
        )
    )
