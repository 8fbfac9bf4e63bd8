"""Adaptive clipping (issue 27, item 3; Andrew et al., arXiv 1905.03871): Theorem 1's update noise, the ledger's
charge at sigma checked against dp-accounting used directly, the geometric update toward the target quantile
(server-side from the norms it measures, client-side from noisy bits), refused settings, and the run-config route."""

import logging
import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting import pld, rdp
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from dpfl.clients.adaptive_clipping import make_clip_bit_mod
from dpfl.clients.mods import make_dp_privatize_mod
from dpfl.dpcore.privacy import protocol as keys
from dpfl.dpcore.privacy.settings import SettingError
from dpfl.fl_app.client_app import app as client_app
from dpfl.fl_app.config import ConfigError, validate
from dpfl.fl_app.results import read_metrics
from dpfl.fl_app.server_app import run_federated
from dpfl.strategies import DifferentialPrivacy
from dpfl.strategies.loop.run_record import published_keys
from dpfl.strategies.parts.adaptive_clipping import AdaptiveClipping, update_noise_multiplier
from dpfl_tools.inprocess import InProcessGrid

logging.getLogger("absl").setLevel(logging.ERROR)
DIM = 400


def test_theorem_1_update_noise_and_the_ledger_charges_sigma_against_dp_accounting():
    sigma, sigma_b, q, rounds, delta = 1.0, 10.0, 0.1, 100, 1e-5
    sigma_delta = update_noise_multiplier(sigma, sigma_b)
    assert sigma_delta == pytest.approx((1 - 1 / 400) ** -0.5, rel=1e-12) == pytest.approx(1.0012523, rel=1e-6)
    # dp-accounting directly: the round is one sampled vector mechanism, the update sum (sensitivity C, noise
    # sigma_Delta C) and the centred count (sensitivity 1/2, noise sigma_b, i.e. multiplier 2 sigma_b)
    joint = dp_accounting.PoissonSampledDpEvent(
        q,
        dp_accounting.ComposedDpEvent(
            [dp_accounting.GaussianDpEvent(sigma_delta), dp_accounting.GaussianDpEvent(2 * sigma_b)]
        ),
    )
    single = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma))
    accountants = []
    for event in (joint, single):
        acc = rdp.RdpAccountant()
        acc.compose(event, rounds)
        accountants.append(acc.get_epsilon(delta))
    assert accountants[0] == pytest.approx(accountants[1], rel=1e-9)
    exact = pld.PLDAccountant(value_discretization_interval=1e-4)
    exact.compose(single, rounds)
    strategy = DifferentialPrivacy(
        clipping_norm=1.0,
        noise_multiplier=sigma,
        sample_rate=q,
        delta=delta,
        noise_placement="central",
        adaptive_clipping=AdaptiveClipping(0.5, 0.2, sigma_b),
    )
    strategy.setup_population(100)
    for _ in range(rounds):
        strategy.ledger.record_round(strategy.accounted_noise_multiplier(), q, strategy.population.noise_shares)
    assert strategy.update_noise_multiplier() == sigma_delta
    assert strategy.ledger.epsilon() == pytest.approx(exact.get_epsilon(delta), rel=0.02)
    assert strategy.ledger.epsilon() <= accountants[0]


def test_imaginary_update_noise_is_refused_naming_the_keys():
    with pytest.raises(SettingError, match="clip-count-noise-multiplier.*noise-multiplier"):
        DifferentialPrivacy(
            clipping_norm=1.0,
            noise_multiplier=2.0,
            sample_rate=0.5,
            adaptive_clipping=AdaptiveClipping(count_noise_multiplier=1.0),
        )
    with pytest.raises(ConfigError, match="clip-count-noise-multiplier"):
        validate(
            {
                "algorithm": "dp-fedavg",
                "adaptive-clipping": True,
                "noise-multiplier": 2.0,
                "clip-count-noise-multiplier": 1.0,
            }
        )
    with pytest.raises(ConfigError, match="adaptive-clipping"):
        validate({"algorithm": "dp-fedavg", "adaptive-clipping": True, "noise-placement": "local"})
    with pytest.raises(ConfigError, match="adaptive-clipping"):
        validate({"algorithm": "dp-fedavg-wav", "adaptive-clipping": True, "noise-placement": "central"})


def norms_client(mods=()) -> ClientApp:
    """Client on node 100 + i replies with the update of norm 0.01 (i + 1), marked as an update."""
    app = ClientApp()

    @app.train(mods=list(mods))
    def train(msg: Message, context: Context) -> Message:
        i = int(context.node_config["partition-id"])
        update = np.full(DIM, 0.01 * (i + 1.5) / math.sqrt(DIM), np.float32)
        return Message(
            RecordDict(
                {
                    "arrays": ArrayRecord({"w": Array(update)}),
                    "metrics": MetricRecord({keys.UPLOAD_KIND: keys.UPLOAD_UPDATE, keys.UPDATE_NORM: 0.01 * (i + 1.5)}),
                }
            ),
            reply_to=msg,
        )

    return app


def privatizing_norms_client() -> ClientApp:
    """norms_client's update through dp_privatize_mod (clip + noise share), then the clipped bit."""
    app = ClientApp()

    @app.train(mods=[make_clip_bit_mod(seed=2), make_dp_privatize_mod(seed=1)])
    def train(msg: Message, context: Context) -> Message:
        i = int(context.node_config["partition-id"])
        sent = msg.content["arrays"]["w"].numpy()
        return Message(
            RecordDict(
                {
                    "arrays": ArrayRecord({"w": Array(sent + np.float32(0.01 * (i + 1.5) / math.sqrt(DIM)))}),
                    "metrics": MetricRecord({"num-examples": 1}),
                }
            ),
            reply_to=msg,
        )

    return app


@pytest.mark.slow
@pytest.mark.parametrize("placement", ["central", "distributed"])
def test_the_clipping_norm_follows_the_geometric_rule_to_the_target_quantile(placement):
    clients, eta, gamma = 20, 0.5, 0.5
    strategy = DifferentialPrivacy(
        clipping_norm=0.01,
        noise_multiplier=0.1,
        sample_rate=1.0,
        min_available_nodes=clients,
        noise_placement=placement,
        delta=1e-5,
        secure_rng=False,
        seed=4,
        adaptive_clipping=AdaptiveClipping(gamma, eta, count_noise_multiplier=0.1),
    )
    app = norms_client() if placement == "central" else privatizing_norms_client()
    grid = InProcessGrid(app, clients, {})
    strategy.start(grid, ArrayRecord({"w": Array(np.zeros(DIM, np.float32))}), num_rounds=30)
    for record in strategy.record.history:
        c_t = record["clipping_norm"]
        assert record["clipping_norm_next"] == pytest.approx(
            c_t * math.exp(-eta * (record["unclipped_fraction_noisy"] - gamma)), rel=1e-9
        )
        true_fraction = sum(0.01 * (i + 1.5) <= c_t for i in range(clients)) / clients
        assert record["unclipped_fraction_noisy"] == pytest.approx(true_fraction, abs=0.05)  # noise: 0.1 / 20
    final = strategy.record.history[-1]["clipping_norm_next"]
    assert 0.085 <= final <= 0.14  # the median of 0.015 ... 0.205
    assert published_keys(strategy) >= {"clipping_norm", "clipping_norm_next"}
    if placement == "distributed":  # the clients' noise shares carry sigma_Delta
        sigma_delta = update_noise_multiplier(0.1, 0.1)
        config = grid.sent[-1].content["config"]
        assert config[keys.NOISE_STD] == pytest.approx(
            sigma_delta * strategy.record.history[-1]["clipping_norm"] / math.sqrt(strategy.population.noise_shares),
            rel=1e-9,
        )
        assert config[keys.CLIP_COUNT_NOISE_STD] == pytest.approx(0.1 / math.sqrt(strategy.population.noise_shares))


def test_distributed_replies_without_the_bit_are_refused():
    strategy = DifferentialPrivacy(
        clipping_norm=0.1,
        noise_multiplier=0.1,
        sample_rate=1.0,
        min_available_nodes=4,
        noise_placement="distributed",
        adaptive_clipping=AdaptiveClipping(),
    )
    app = ClientApp()

    @app.train(mods=[make_dp_privatize_mod(seed=1)])
    def train(msg: Message, context: Context) -> Message:
        return Message(RecordDict({"arrays": msg.content["arrays"], "metrics": MetricRecord({})}), reply_to=msg)

    strategy.start(InProcessGrid(app, 4, {}), ArrayRecord({"w": Array(np.zeros(8, np.float32))}), num_rounds=1)
    assert strategy.record.history[-1]["rejected"] == 4
    assert all("clipped bit" in p for p in strategy.record.history[-1]["problems"])


def test_the_app_publishes_the_clipping_norm_per_round(tmp_path):
    cfg = validate(
        {
            "dataset": "digits",
            "model": "mlp",
            "partitioner": "iid",
            "local-steps": 2,
            "batch-size": 16,
            "num-rounds": 3,
            "sample-rate": 1.0,
            "min-nodes": 4,
            "algorithm": "dp-fedavg",
            "adaptive-clipping": True,
            "clip-count-noise-multiplier": 2.0,
            "results-dir": str(tmp_path),
        }
    )
    summary = run_federated(InProcessGrid(client_app, 4, cfg), cfg)
    rounds = read_metrics(tmp_path)
    assert [r["clipping_norm"] for r in rounds][0] == cfg.privacy.clipping_norm
    for before, after in zip(rounds, rounds[1:]):
        assert after["clipping_norm"] == pytest.approx(before["clipping_norm_next"])
    # charged at sigma, as the same run without adaptive clipping: q = 1, 3 rounds (dp-accounting's PLD)
    exact = pld.PLDAccountant(value_discretization_interval=1e-4)
    exact.compose(dp_accounting.GaussianDpEvent(cfg.privacy.noise_multiplier), 3)
    assert summary["epsilon"] == pytest.approx(exact.get_epsilon(summary["delta"]), rel=0.02)
    assert summary["adaptive_clipping"]["clip_count_noise_multiplier"] == 2.0
