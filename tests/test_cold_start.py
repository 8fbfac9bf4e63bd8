"""Cold start of a ClientApp process: Opacus and flwr-datasets are imported only where needed, and the
embedded data and its partitions come from a binary cache that is rebuilt when what it depends on changes."""

import json
import os
import subprocess
import sys

import numpy as np

from fl_app.task import data

PROBE = """
import sys, json
import fl_app.client_app
from fl_app.task.data import load_partition
train, test = load_partition("mnist-embedded", 3, 50, "dirichlet", alpha=0.5, seed=42)
print(json.dumps({"n": len(train), "loaded": [m for m in ("opacus", "flwr_datasets", "datasets") if m in sys.modules]}))
"""


def fresh_process(cache) -> dict:
    env = {**os.environ, "DPFL_CACHE_DIR": str(cache)}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True,
                         cwd=data.Path(data.__file__).parents[2])
    return json.loads(out.stdout.strip().splitlines()[-1])


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
    monkeypatch.setattr(data, "_file_digest", lambda path: "another-source-file")
    data._embedded_images("digits")
    assert len(calls) == 2  # a changed source file means a new decode

    def partition_files():
        return sorted(p.name for p in tmp_path.glob("partitions-*.npz"))

    data._dataset_partitions.__wrapped__("digits", "", 5, "dirichlet", 0.5, 2, 1)
    data._dataset_partitions.__wrapped__("digits", "", 5, "dirichlet", 0.5, 2, 1)
    assert len(partition_files()) == 1
    for changed in [("digits", "", 6, "dirichlet", 0.5, 2, 1), ("digits", "", 5, "iid", 0.5, 2, 1),
                    ("digits", "", 5, "dirichlet", 0.3, 2, 1), ("digits", "", 5, "dirichlet", 0.5, 2, 2)]:
        data._dataset_partitions.__wrapped__(*changed)
    assert len(partition_files()) == 5


def test_cached_partitions_equal_freshly_computed_ones(tmp_path, monkeypatch):
    monkeypatch.setenv("DPFL_CACHE_DIR", str(tmp_path))
    cached = data._dataset_partitions.__wrapped__("mnist-embedded", "", 10, "dirichlet", 0.5, 2, 7)
    cached_again = data._dataset_partitions.__wrapped__("mnist-embedded", "", 10, "dirichlet", 0.5, 2, 7)
    pool, _ = data.load_dataset("mnist-embedded")
    fresh = data.partition_indices(pool.y, 10, "dirichlet", alpha=0.5, seed=7)
    for a, b, c in zip(cached, cached_again, fresh):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)
