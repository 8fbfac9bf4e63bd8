"""Flower users' habits with our wrapper. Flower's DP wrappers' signature on ours: `DifferentialPrivacy(strategy, noise_multiplier, clipping_norm,
num_sampled_clients)` samples m nodes a round by fixed-size sampling, accounted as fixed-size sampling is (the
same epsilon as `client_sampling='fixed'` at q = m / M), caps at the connected nodes with a line that says so, and
answers `privacy_spent()` from the ledger, as Flower's wrappers do. The clients' own train metrics reach the
Result as Flower's FedAvg aggregates them."""

import logging

import pytest
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg
from flwr.supercore.privacy_accounting import PrivacySpent

from dpfl import DifferentialPrivacy as DifferentialPrivacyServerSideFixedClipping
from dpfl.dpcore.privacy.settings import SettingError
from dpfl_tools.inprocess import InProcessGrid
from tests.test_wrapper import model, weights_client

NODES, SIGMA, C = 6, 1.5, 0.5


def run(strategy, rounds=3, nodes=NODES):
    grid = InProcessGrid(weights_client(), nodes, {})
    strategy.start(grid, model(), num_rounds=rounds)
    return [
        len(
            {
                m.metadata.dst_node_id
                for m in grid.sent
                if m.metadata.message_type == "train" and int(m.content["config"]["server-round"]) == r
            }
        )
        for r in range(1, rounds + 1)
    ]


def flower_call(m: int, **kw):
    """The line of a Flower app, with only its import changed."""
    return DifferentialPrivacyServerSideFixedClipping(FedAvg(fraction_evaluate=0.0), SIGMA, C, m, seed=1, **kw)


def test_flowers_positional_signature_samples_m_nodes_and_charges_fixed_size_sampling():
    ours = flower_call(4)
    assert run(ours) == [4, 4, 4]
    same = DifferentialPrivacyServerSideFixedClipping(
        FedAvg(fraction_evaluate=0.0),
        noise_multiplier=SIGMA,
        clipping_norm=C,
        sample_rate=4 / NODES,
        client_sampling="fixed",
        seed=1,
    )
    run(same)
    assert ours.privacy_metrics() == same.privacy_metrics()  # accounted exactly as fixed-size sampling is
    assert 0 < ours.privacy_metrics()["epsilon"] < float("inf")
    keywords = DifferentialPrivacyServerSideFixedClipping(
        FedAvg(fraction_evaluate=0.0), noise_multiplier=SIGMA, clipping_norm=C, num_sampled_clients=4, seed=1
    )
    run(keywords)
    assert keywords.privacy_metrics() == ours.privacy_metrics()  # Flower's keywords too


def test_fewer_connected_nodes_than_m_are_refused_before_round_1():
    """m = 10 on 6 nodes (issue 39 item 11, fl-dp-sa's m = 20 on 10): refused, naming m and the node count,
    before anything is sent (it used to sample all 6 and noise the mean with sigma C / 6, twice m's promise)."""
    grid = InProcessGrid(weights_client(), NODES, {})
    with pytest.raises(SettingError, match=r"num_sampled_clients=10 .*more than the 6 nodes connected at round 1"):
        flower_call(10).start(grid, model(), num_rounds=3)
    assert grid.sent == []


def test_privacy_spent_is_the_ledgers_figure_in_flowers_form():
    strategy = flower_call(4)
    assert strategy.privacy_spent() is None  # before round 1, as Flower's without an accountant
    run(strategy, rounds=2)
    spent = strategy.privacy_spent()
    assert isinstance(spent, PrivacySpent)
    assert spent.epsilon == strategy.privacy_metrics()["epsilon"] and spent.delta == strategy.privacy_metrics()["delta"]
    assert spent.num_releases == 2 and spent.accounting_method


def test_num_sampled_clients_is_a_fixed_size_sample_only():
    with pytest.raises(ValueError, match="num_sampled_clients"):
        DifferentialPrivacyServerSideFixedClipping(
            FedAvg(),
            noise_multiplier=SIGMA,
            clipping_norm=C,
            sample_rate=0.5,
            num_sampled_clients=3,
            client_sampling="poisson",
        )


def test_the_clients_own_train_metrics_reach_the_result_as_sent_and_no_figure_is_written_by_a_client():
    """A quickstart-pytorch client reports `train_loss` (not this project's `train-loss`): the Result's train
    metrics carry Flower's weighted average of it, not a NaN; a client's `accuracy` or `epsilon` never lands in
    the round's record (those are figures only the run writes)."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        node = context.node_id - 100  # the in-process grid's nodes are 100, 101, ...
        new = {k: Array(msg.content["arrays"][k].numpy()) for k in msg.content["arrays"].keys()}
        metrics = {"num-examples": 10 * (node + 1), "train_loss": float(node), "accuracy": 0.99, "epsilon": 0.0}
        return Message(RecordDict({"arrays": ArrayRecord(new), "metrics": MetricRecord(metrics)}), reply_to=msg)

    strategy = DifferentialPrivacyServerSideFixedClipping(
        FedAvg(fraction_evaluate=0.0), noise_multiplier=0.0, clipping_norm=100.0, sample_rate=1.0, seed=1
    )
    result = strategy.start(InProcessGrid(app, 3, {}), model(), num_rounds=1)
    metrics = dict(result.train_metrics_clientapp[1])
    assert metrics["train_loss"] == pytest.approx((0 * 10 + 1 * 20 + 2 * 30) / 60)  # Flower's weighted average
    assert "accuracy" not in metrics and metrics["epsilon"] == strategy.privacy_metrics()["epsilon"]
    assert "accuracy" not in strategy.record.history[0]


def test_the_log_says_when_the_printed_epsilon_is_not_the_accountant_asked_fors(caplog):
    """sigma 1e-6, q = 1: dp-accounting's PLD overflows, so the ledger's bound is RDP's; the log and
    privacy_spent() say so, instead of printing an RDP figure under the PLD name."""
    strategy = DifferentialPrivacyServerSideFixedClipping(
        FedAvg(fraction_evaluate=0.0), noise_multiplier=1e-6, clipping_norm=C, sample_rate=1.0, seed=1
    )
    with caplog.at_level(logging.INFO, logger="flwr"):
        run(strategy, rounds=1)
    assert (
        "The epsilon printed is the bound of rdp (pld failed at a noise multiplier of 1e-06 charged: OverflowError"
        in caplog.text
    )
    assert "not of the accountant asked for (pld)" in caplog.text
    assert strategy.privacy_spent().accounting_method.startswith("rdp")
