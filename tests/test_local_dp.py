"""Local DP (issue 27, item 2): each client's mod clips and noises its own update, keeps its own ledger in
Context.state and reports its epsilon; the server adds no noise and publishes the local epsilon. Figures against
dp-accounting used directly."""

import logging

import dp_accounting
import numpy as np
import pytest
from dp_accounting import pld
from flwr.app import Array, ArrayRecord

from dpfl.clients.local_dp import make_local_dp_mod
from dpfl.dpcore.privacy import protocol as keys
from dpfl.fl_app.client_app import app as client_app
from dpfl.fl_app.config import ConfigError, validate
from dpfl.fl_app.results import read_metrics
from dpfl.fl_app.server_app import run_federated
from dpfl.strategies import DifferentialPrivacy
from dpfl_tools.inprocess import InProcessGrid
from tests.test_wrapper import weights_client

logging.getLogger("absl").setLevel(logging.ERROR)
M, C, SIGMA, DELTA = 4, 0.05, 2.0, 1e-5


def gaussian_epsilon(multiplier: float, releases: int, delta: float = DELTA) -> float:
    """dp-accounting directly: `releases` Gaussian mechanisms with this multiplier, composed (PLD)."""
    acc = pld.PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(dp_accounting.GaussianDpEvent(multiplier), releases)
    return acc.get_epsilon(delta)


def local_strategy(sample_rate=1.0, sigma=SIGMA, **kw):
    return DifferentialPrivacy(
        clipping_norm=C,
        noise_multiplier=sigma,
        sample_rate=sample_rate,
        min_available_nodes=M,
        noise_placement="local",
        delta=DELTA,
        **kw,
    )


def test_each_upload_is_dp_on_its_own_and_the_model_epsilon_is_the_local_one():
    strategy = local_strategy()
    grid = InProcessGrid(weights_client([make_local_dp_mod(C, SIGMA, DELTA, seed=5)]), M, {})
    result = strategy.start(grid, ArrayRecord({"w": Array(np.zeros(100_000, np.float32))}), num_rounds=3)
    one = gaussian_epsilon(SIGMA / 2, 1)  # sensitivity 2C (replace-one), noise std sigma C: multiplier sigma / 2
    assert one == pytest.approx(gaussian_epsilon(1.0, 1), rel=1e-9)
    for rnd, record in enumerate(strategy.record.history, 1):
        assert record["epsilon"] == pytest.approx(gaussian_epsilon(SIGMA / 2, rnd), rel=0.01)
        assert record["epsilon_against_server"] == record["epsilon"]
        assert record["server_noise_std"] == 0.0 and record["clients"] == M
    replies = [m.content["metrics"] for m in grid.received]
    assert all(r[keys.LOCAL_EPSILON_ROUND] == pytest.approx(one, rel=0.01) for r in replies)
    last = replies[-M:]  # every client took part in 3 rounds: its composed epsilon is the model's
    assert all(r[keys.LOCAL_ROUNDS] == 3 for r in last)
    assert all(r[keys.LOCAL_EPSILON] == pytest.approx(strategy.record.history[-1]["epsilon"], rel=1e-6) for r in last)
    assert set(replies[0].keys()) == {
        keys.UPLOAD_KIND,
        keys.NUM_EXAMPLES,
        keys.LOCAL_NOISE_MULTIPLIER,
        keys.LOCAL_EPSILON_ROUND,
        keys.LOCAL_EPSILON,
        keys.LOCAL_ROUNDS,
        keys.LOCAL_DELTA,
    }  # nothing else computed from the data
    # the released average: the clipped update (C / sqrt(d) per coordinate, 3 rounds) plus the k = M local noises / m
    w = result.arrays["w"].numpy()
    assert w.std() == pytest.approx(SIGMA * C * np.sqrt(3 * M) / M, rel=0.02)
    assert w.mean() == pytest.approx(3 * C / np.sqrt(100_000), abs=5 * w.std() / np.sqrt(100_000))


def test_the_client_ledger_counts_only_the_rounds_it_took_part_in():
    strategy = local_strategy(sample_rate=0.5, secure_rng=False, seed=3)
    grid = InProcessGrid(weights_client([make_local_dp_mod(C, SIGMA, DELTA, seed=5)]), M, {})
    strategy.start(grid, ArrayRecord({"w": Array(np.zeros(10, np.float32))}), num_rounds=6)
    per_node: dict[int, dict] = {}
    for sent, reply in zip(grid.sent, grid.received):
        per_node[sent.metadata.dst_node_id] = reply.content["metrics"]
    assert per_node
    for node, metrics in per_node.items():
        taken = sum(1 for m in grid.sent if m.metadata.dst_node_id == node)
        assert metrics[keys.LOCAL_ROUNDS] == taken
        assert metrics[keys.LOCAL_EPSILON] == pytest.approx(gaussian_epsilon(SIGMA / 2, taken), rel=0.01)
        assert (
            metrics[keys.LOCAL_EPSILON] <= strategy.record.history[-1]["epsilon"] + 1e-9
        )  # the published one bounds it
    assert strategy.record.history[-1]["epsilon"] == pytest.approx(gaussian_epsilon(SIGMA / 2, 6), rel=0.01)


def test_uploads_without_local_noise_or_with_less_are_refused():
    plain = local_strategy()
    plain.start(
        InProcessGrid(weights_client(), M, {}), ArrayRecord({"w": Array(np.zeros(10, np.float32))}), num_rounds=1
    )
    assert plain.record.history[-1]["rejected"] == M and plain.record.history[-1]["clients"] == 0
    weak = local_strategy()
    weak.start(
        InProcessGrid(weights_client([make_local_dp_mod(C, SIGMA / 2, DELTA, seed=1)]), M, {}),
        ArrayRecord({"w": Array(np.zeros(10, np.float32))}),
        num_rounds=1,
    )
    assert weak.record.history[-1]["rejected"] == M
    assert all("below the configured" in p for p in weak.record.history[-1]["problems"])


def test_run_config_route_rules():
    assert validate({"noise-placement": "local", "algorithm": "dp-fedavg"}).privacy.noise_placement == "local"
    with pytest.raises(ConfigError, match="calibrate"):
        validate(
            {
                "noise-placement": "local",
                "algorithm": "dp-fedavg",
                "target-epsilon": 5.0,
                "target-epsilon-mode": "calibrate",
            }
        )
    with pytest.raises(ConfigError, match="top-k"):
        validate({"noise-placement": "local", "algorithm": "dp-fedsam-topk"})


def test_the_app_under_local_noise(tmp_path):
    cfg = validate(
        {
            "dataset": "digits",
            "model": "mlp",
            "partitioner": "iid",
            "local-steps": 2,
            "batch-size": 16,
            "num-rounds": 2,
            "sample-rate": 1.0,
            "min-nodes": 4,
            "algorithm": "dp-fedavg",
            "noise-placement": "local",
            "noise-multiplier": 4.0,
            "results-dir": str(tmp_path),
        }
    )
    grid = InProcessGrid(client_app, 4, cfg)
    summary = run_federated(grid, cfg)
    printed = [r["epsilon"] for r in read_metrics(tmp_path)]
    assert printed == pytest.approx(
        [gaussian_epsilon(2.0, 1, summary["delta"]), gaussian_epsilon(2.0, 2, summary["delta"])], rel=0.01
    )
    train_replies = [r.content["metrics"] for r in grid.received if keys.LOCAL_EPSILON in r.content["metrics"]]
    assert len(train_replies) == 8 and max(r[keys.LOCAL_EPSILON] for r in train_replies) == pytest.approx(printed[-1])
    assert "local DP" in summary["server_threat_model"]
