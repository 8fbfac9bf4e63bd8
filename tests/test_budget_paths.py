"""No path exceeds a target: each strategy path of the app (Message API, SecAgg+ through the legacy
adapter, top-k, ALI-DPFL) run past its budget stops before the round that would exceed it, and the
last epsilon it printed is at most the target. (The legacy drop-in: tests/test_dropin.py.)"""

import pytest

from dpfl.dpcore.privacy.accountants import epsilon_of
from dpfl.fl_app.client_app import app as client_app
from dpfl.fl_app.config import validate
from dpfl.fl_app.results import read_metrics
from dpfl.fl_app.server_app import run_federated
from dpfl_tools.inprocess import InProcessGrid

SMALL = {
    "dataset": "digits",
    "model": "mlp",
    "partitioner": "iid",
    "local-steps": 2,
    "batch-size": 16,
    "num-rounds": 12,
    "sample-rate": 1.0,
    "min-nodes": 4,
}
TARGET = 4.0
PATHS = {
    "message api": {"algorithm": "dp-fedavg", "noise-multiplier": 2.0},
    "secagg+": {"algorithm": "dp-fedavg", "secure-aggregation": True, "noise-multiplier": 2.0},
    "top-k": {"algorithm": "dp-fedsam-topk", "sparsity": 0.5, "noise-multiplier": 2.0},
    "ali-dpfl": {
        "algorithm": "ali-dpfl",
        "batch-sample-rate": 0.2,
        "sample-noise-multiplier": 1.0,
        "adaptive": False,
        "local-steps": 3,
    },
}


@pytest.mark.parametrize("path", sorted(PATHS))
def test_every_path_stops_at_its_target(path, tmp_path):
    cfg = validate({**SMALL, **PATHS[path], "target-epsilon": TARGET, "results-dir": str(tmp_path)})
    summary = run_federated(InProcessGrid(client_app, 4, cfg), cfg)
    printed = [r["epsilon"] for r in read_metrics(tmp_path)]
    assert 0 < summary["rounds_completed"] < cfg.run.num_rounds, summary["stop_reason"]
    assert max(printed) <= TARGET and summary["epsilon"] <= TARGET
    assert str(TARGET) in summary["stop_reason"]
    if path != "ali-dpfl":  # one more round would have exceeded the target
        sigma, rounds = cfg.privacy.noise_multiplier, summary["rounds_completed"]
        assert epsilon_of([(sigma, 1.0, rounds + 1)], summary["delta"]) > TARGET
