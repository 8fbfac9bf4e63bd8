"""Cold start of a ClientApp process: Opacus and flwr-datasets are imported only where needed, and the
embedded data and its partitions come from a binary cache that is rebuilt when what it depends on changes."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from dpfl.dpcore.task import data, partitions

PROBE = """
import sys, json
import dpfl.fl_app.client_app
from dpfl.dpcore.task.partitions import load_partition
train, test = load_partition("mnist-embedded", 3, 50, "dirichlet", alpha=0.5, seed=42)
print(json.dumps({"n": len(train), "loaded": [m for m in ("opacus", "flwr_datasets", "datasets") if m in sys.modules]}))
"""


def fresh_process(cache) -> dict:
    env = {**os.environ, "DPFL_CACHE_DIR": str(cache)}
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        cwd=data.Path(data.__file__).parents[2],
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_client_app_for_dp_fedsam_imports_neither_opacus_nor_flwr_datasets_once_cached(tmp_path):
    first = fresh_process(tmp_path)
    assert "opacus" not in first["loaded"]  # only DP-SGD (ali-dpfl) needs it
    assert "flwr_datasets" in first["loaded"]  # the first process partitions ...
    second = fresh_process(tmp_path)
    assert second == {"n": first["n"], "loaded": []}  # ... the next ones read the cache


def test_cache_is_rebuilt_when_the_source_or_the_partition_settings_change(tmp_path, monkeypatch):
    monkeypatch.setenv("DPFL_CACHE_DIR", str(tmp_path))
    calls = []
    real = data._EMBEDDED["digits"][0]

    def counting_source():
        path, decode = real()

        def counted():
            calls.append(1)
            return decode()

        return path, counted

    monkeypatch.setitem(data._EMBEDDED, "digits", (counting_source, 1500))
    x1, _ = data._embedded_images("digits")
    x2, _ = data._embedded_images("digits")
    assert len(calls) == 1 and np.array_equal(x1, x2)  # decoded once, then read from the cache
    monkeypatch.setattr(data, "file_digest", lambda path: "another-source-file")
    data._embedded_images("digits")
    assert len(calls) == 2  # a changed source file means a new decode

    def partition_files():
        return sorted(p.name for p in tmp_path.glob("partitions-*.npz"))

    partitions._dataset_partitions.__wrapped__("digits", "", 5, "dirichlet", 0.5, 2, 1)
    partitions._dataset_partitions.__wrapped__("digits", "", 5, "dirichlet", 0.5, 2, 1)
    assert len(partition_files()) == 1
    for changed in [
        ("digits", "", 6, "dirichlet", 0.5, 2, 1),
        ("digits", "", 5, "iid", 0.5, 2, 1),
        ("digits", "", 5, "dirichlet", 0.3, 2, 1),
        ("digits", "", 5, "dirichlet", 0.5, 2, 2),
    ]:
        partitions._dataset_partitions.__wrapped__(*changed)
    assert len(partition_files()) == 5


def test_cached_partitions_equal_freshly_computed_ones(tmp_path, monkeypatch):
    monkeypatch.setenv("DPFL_CACHE_DIR", str(tmp_path))
    cached = partitions._dataset_partitions.__wrapped__("mnist-embedded", "", 10, "dirichlet", 0.5, 2, 7)
    cached_again = partitions._dataset_partitions.__wrapped__("mnist-embedded", "", 10, "dirichlet", 0.5, 2, 7)
    pool, _ = data.load_dataset("mnist-embedded")
    fresh = partitions.partition_indices(pool.y, 10, "dirichlet", alpha=0.5, seed=7)
    for a, b, c in zip(cached, cached_again, fresh):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)


FIRST_TRAINING = """
import sys, json, torch
from flwr.app import Context, RecordDict
from dpfl.fl_app.algorithms import ALGORITHMS
from dpfl.fl_app.client_app import build_client
from dpfl.fl_app.config import validate
from dpfl.fl_app.server_app import shared_weights
from dpfl.dpcore.task.torch_helpers import get_weights
out = {}
for algorithm in ("dp-fedsam", "dp2-fedsam"):
    cfg = validate({"algorithm": algorithm, "local-steps": 2})
    client = build_client(Context(run_id=1, node_id=1, node_config={"partition-id": 3, "num-partitions": 50},
                                  state=RecordDict(), run_config=cfg.run_config()))
    before = [w.copy() for w in get_weights(client.model)]
    client.fit(shared_weights(client.model, cfg, ALGORITHMS[cfg.run.algorithm]), {"server-round": 1})
    out[algorithm] = any((a != b).any() for a, b in zip(get_weights(client.model), before))
print(json.dumps({"trained": out, "dynamo": "torch._dynamo" in sys.modules}))
"""


@pytest.mark.slow
def test_local_training_in_a_fresh_process_does_not_import_torch_dynamo(tmp_path):
    """A torch.optim.Optimizer's first construction imports torch._dynamo (about 1 s in every new process);
    local training uses clients.base.LocalSGD instead."""
    out = subprocess.run(
        [sys.executable, "-c", FIRST_TRAINING],
        env={**os.environ, "DPFL_CACHE_DIR": str(tmp_path)},
        capture_output=True,
        text=True,
        check=True,
        cwd=data.Path(data.__file__).parents[2],
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"trained": {"dp-fedsam": True, "dp2-fedsam": True}, "dynamo": False}


def test_local_sgd_equals_torch_sgd_bit_for_bit():
    import torch

    from dpfl.clients.base import LocalSGD

    torch.manual_seed(0)
    for momentum, weight_decay in ((0.0, 0.0), (0.5, 5e-4), (0.9, 1e-2)):
        nets = [torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3)) for _ in range(2)]
        nets[1].load_state_dict(nets[0].state_dict())
        unused = [torch.nn.Parameter(torch.ones(2)) for _ in range(2)]  # grad stays None: skipped by both
        ours = LocalSGD([*nets[0].parameters(), unused[0]], lr=0.1, momentum=momentum, weight_decay=weight_decay)
        theirs = torch.optim.SGD(
            [*nets[1].parameters(), unused[1]], lr=0.1, momentum=momentum, weight_decay=weight_decay
        )
        for step in range(5):
            x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
            for net, opt in zip(nets, (ours, theirs)):
                opt.zero_grad()
                torch.nn.functional.cross_entropy(net(x), y).backward()
                opt.step()
            for a, b in zip(nets[0].parameters(), nets[1].parameters()):
                assert torch.equal(a, b), (momentum, weight_decay, step)
        assert torch.equal(unused[0], torch.ones(2)) and torch.equal(unused[1], torch.ones(2))
        ours.zero_grad()
        assert all(p.grad is None for p in nets[0].parameters())  # set to None, as torch.optim does


BLAS_THREADS = """
import json
import numpy
from threadpoolctl import threadpool_info
before = [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]
from dpfl.fl_app.client_app import app
from dpfl.fl_app.config import validate
from dpfl_tools.inprocess import InProcessGrid
from dpfl.fl_app.server_app import run_federated
cfg = validate({"dataset": "digits", "model": "mlp", "num-rounds": 1, "sample-rate": 1.0, "local-steps": 1,
                "tensorboard": False, "results-dir": RESULTS})
run_federated(InProcessGrid(app, 2, cfg), cfg)
after = [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]
print(json.dumps({"before": before, "after": after}))
"""


@pytest.mark.slow
def test_a_run_puts_numpy_blas_on_one_thread(tmp_path):
    """OpenBLAS' worker threads busy-wait after each call and, on a loaded machine, take the core training needs
    (dpcore.task.threads): the ServerApp and every ClientApp call limit it to one thread."""
    code = BLAS_THREADS.replace("RESULTS", repr(str(tmp_path / "run")))
    env = {k: v for k, v in os.environ.items() if not k.endswith("_NUM_THREADS")}
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**env, "OPENBLAS_NUM_THREADS": "2", "DPFL_CACHE_DIR": str(tmp_path)},
        capture_output=True,
        text=True,
        check=True,
        cwd=data.Path(data.__file__).parents[2],
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["before"] == [2], result  # numpy's own
    assert result["after"] and set(result["after"]) == {1}, result  # numpy's and scipy's (loaded by the ledger)
