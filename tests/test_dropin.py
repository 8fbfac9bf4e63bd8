"""Drop-in use: a foreign app (its own numpy model, data and clients; nothing from fl_app's model or
client) gains DP through our mod and strategy, on both Flower APIs, in simulation (InProcessGrid)."""

import logging
import math
import re

import dp_accounting
import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.client import NumPyClient
from flwr.client.mod import secaggplus_mod
from flwr.clientapp import ClientApp
from flwr.common import FitIns, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.compat.common import recorddict_compat as compat
from flwr.server import LegacyContext, ServerApp, ServerAppComponents, ServerConfig
from flwr.server.workflow import DefaultWorkflow
from sklearn.datasets import load_digits

from dpfl.clients.mods import make_dp_privatize_mod, uniform_weight_mod
from dpfl.dpcore.privacy.accountants import epsilon_of
from dpfl.dpcore.privacy.mechanisms import flatten
from dpfl.strategies.dp_fedavg import DPFedAvg
from dpfl.strategies.legacy.adapter import LegacyDPFedAvg
from dpfl.strategies.legacy.secagg import DPSecAggPlusWorkflow, SecAggPlusDPFedAvg
from dpfl_tools.inprocess import InProcessGrid
from tests.foreign_app.foreign.task import train as softmax_regression_steps

NODES, ROUNDS, C, SIGMA = 10, 8, 1.0, 0.7
dp_mod = make_dp_privatize_mod(seed=0)  # seeded: the test is reproducible

# ---------------------------------------------------------------- the foreign app: softmax regression on digits
_X, _Y = load_digits(return_X_y=True)
_X = (_X / 16.0).astype(np.float32)
_TEST = np.arange(len(_Y)) % 5 == 0


def shard(pid: int, n: int):
    idx = np.flatnonzero(~_TEST)[pid::n]
    return _X[idx], _Y[idx]


def initial_weights():
    return [np.zeros((64, 10), np.float32), np.zeros(10, np.float32)]


def local_training(weights, pid, n, steps=20, lr=0.5):
    x, y = shard(pid, n)
    return softmax_regression_steps(weights, x, y, steps, lr), len(y)


def accuracy(weights) -> float:
    w, b = weights
    return float(np.mean(np.argmax(_X[_TEST] @ w + b, 1) == _Y[_TEST]))


def message_api_app(mods, other_model_on: int = -1) -> ClientApp:
    app = ClientApp()

    @app.train(mods=mods)
    def train(msg: Message, context: Context) -> Message:
        pid = int(context.node_config["partition-id"])
        weights, n = local_training(
            msg.content["arrays"].to_numpy_ndarrays(), pid, int(context.node_config["num-partitions"])
        )
        if pid == other_model_on:  # this node runs a different model (9 classes)
            weights = [weights[0][:, :9], weights[1][:9]]
        return Message(
            RecordDict({"arrays": ArrayRecord(weights), "metrics": MetricRecord({"num-examples": n})}), reply_to=msg
        )

    return app


class ForeignClient(NumPyClient):
    def __init__(self, pid, n):
        self.pid, self.n = pid, n

    def fit(self, parameters, config):
        weights, n = local_training(parameters, self.pid, self.n)
        return weights, n, {"loss-ish": 1.0}

    def evaluate(self, parameters, config):
        return 0.0, 1, {"accuracy": accuracy(parameters)}


def legacy_client_fn(context: Context):
    return ForeignClient(
        int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    ).to_client()


def dp() -> DPFedAvg:
    return DPFedAvg(
        sample_rate=1.0, clipping_norm=C, noise_multiplier=SIGMA, noise_placement="distributed", delta=1e-3, seed=1
    )


def expected_epsilon():
    return epsilon_of([(SIGMA, 1.0, ROUNDS)], 1e-3)


# ---------------------------------------------------------------- tests
def test_reference_without_dp_learns():
    weights = initial_weights()
    for _ in range(ROUNDS):
        weights = [np.mean(a, 0) for a in zip(*[local_training(weights, i, NODES)[0] for i in range(NODES)])]
    assert accuracy(weights) > 0.85


def test_message_api_app_with_mod_and_dpfedavg():
    strategy = dp()
    grid = InProcessGrid(message_api_app([dp_mod]), NODES, {})
    result = strategy.start(
        grid,
        ArrayRecord(initial_weights()),
        num_rounds=ROUNDS,
        evaluate_fn=lambda rnd, arrays: MetricRecord({"accuracy": accuracy(arrays.to_numpy_ndarrays())}),
    )
    assert (
        result.evaluate_metrics_serverapp[ROUNDS]["accuracy"] > 0.6 > result.evaluate_metrics_serverapp[0]["accuracy"]
    )
    assert strategy.describe()["epsilon"] == pytest.approx(expected_epsilon())
    assert strategy.record.history[-1]["clients"] == NODES and strategy.record.history[-1]["clipped_fraction"] > 0


def legacy_evaluate(rnd, ndarrays, config):
    return 0.0, {"accuracy": accuracy(ndarrays)}


def test_legacy_numpyclient_with_mod_and_legacy_strategy_server_fn():
    """The usual legacy deployment: ServerApp(server_fn=...) + ClientApp(client_fn=..., mods=[...])."""
    strategy = LegacyDPFedAvg(
        dp(), evaluate_fn=legacy_evaluate, initial_parameters=ndarrays_to_parameters(initial_weights())
    )
    server_app = ServerApp(
        server_fn=lambda context: ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds=ROUNDS))
    )
    grid = InProcessGrid(ClientApp(client_fn=legacy_client_fn, mods=[dp_mod]), NODES, {})
    server_app(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}))
    assert len(strategy.record.history) == ROUNDS
    assert strategy.record.history[-1]["accuracy"] > 0.6
    assert strategy.describe()["epsilon"] == pytest.approx(expected_epsilon())
    # the per-update figure against a server that sees every upload is far weaker
    assert strategy.describe()["epsilon_against_server"] > 5 * strategy.describe()["epsilon"]


def test_legacy_strategy_stops_on_the_privacy_budget():
    """The legacy path stops before the round that would exceed target_epsilon, like DPFedAvg.start."""
    target = epsilon_of([(SIGMA, 1.0, 2)], 1e-3) + 1e-6  # exactly two rounds fit
    budgeted = DPFedAvg(
        sample_rate=1.0,
        clipping_norm=C,
        noise_multiplier=SIGMA,
        noise_placement="distributed",
        delta=1e-3,
        seed=1,
        target_epsilon=target,
    )
    strategy = LegacyDPFedAvg(budgeted, initial_parameters=ndarrays_to_parameters(initial_weights()))
    server_app = ServerApp(
        server_fn=lambda context: ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds=ROUNDS))
    )
    grid = InProcessGrid(ClientApp(client_fn=legacy_client_fn, mods=[dp_mod]), NODES, {})
    server_app(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}))
    assert len(strategy.record.history) == 2
    assert budgeted.record.stop_reason == "target epsilon %s reached: round 3 would spend more" % target
    assert strategy.describe()["epsilon"] <= target


@pytest.mark.flower_version
@pytest.mark.slow
def test_legacy_numpyclient_with_mod_under_secaggplus():
    """@app.main with LegacyContext + DefaultWorkflow(DPSecAggPlusWorkflow), mods=[secaggplus_mod, dp mod]."""
    strategy = SecAggPlusDPFedAvg(
        dp(), evaluate_fn=legacy_evaluate, initial_parameters=ndarrays_to_parameters(initial_weights())
    )
    server_app = ServerApp()

    @server_app.main()
    def main(grid, context):
        legacy = LegacyContext(context, config=ServerConfig(num_rounds=ROUNDS), strategy=strategy)
        DefaultWorkflow(fit_workflow=DPSecAggPlusWorkflow())(grid, legacy)

    grid = InProcessGrid(ClientApp(client_fn=legacy_client_fn, mods=[secaggplus_mod, dp_mod]), NODES, {})
    server_app(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}))
    assert len(strategy.record.history) == ROUNDS and strategy.record.history[-1]["accuracy"] > 0.6
    described, diagnostics = strategy.describe(), strategy.describe_diagnostics()
    assert described["epsilon"] == pytest.approx(expected_epsilon())
    # against the server: the unamplified sum of the shares that arrived (a diagnostic: it depends on how many)
    assert "epsilon_against_server" not in described
    assert diagnostics["epsilon_against_server"] >= described["epsilon"]


# ---------------------------------------------------------------- the mod itself
def instruction(api: str, config: dict, weights) -> Message:
    if api == "legacy":
        content = compat.fitins_to_recorddict(FitIns(ndarrays_to_parameters(weights), config), keep_input=True)
    else:
        content = RecordDict({"arrays": ArrayRecord(weights), "config": ConfigRecord(config)})
    return Message(content, dst_node_id=7, message_type=MessageType.TRAIN)


def weights_of(api: str, reply: Message):
    if api == "legacy":
        fitres = compat.recorddict_to_fitres(reply.content, keep_input=True)
        return [np.asarray(a) for a in parameters_to_ndarrays(fitres.parameters)], fitres.num_examples, fitres.metrics
    metrics = dict(reply.content["metrics"])
    return reply.content["arrays"].to_numpy_ndarrays(), metrics.get("num-examples"), metrics


def fake_client(api: str, local):
    """call_next: a client whose training lands on `local`, reporting 50 examples."""

    def call_next(msg, context):
        if api == "legacy":
            from flwr.common import Code, FitRes, Status

            return Message(
                compat.fitres_to_recorddict(
                    FitRes(Status(Code.OK, ""), ndarrays_to_parameters(local), 50, {"loss": 0.3}), True
                ),
                reply_to=msg,
            )
        return Message(
            RecordDict({"arrays": ArrayRecord(local), "metrics": MetricRecord({"num-examples": 50})}), reply_to=msg
        )

    return call_next


CTX = Context(run_id=1, node_id=7, node_config={}, state=RecordDict(), run_config={})


@pytest.mark.parametrize("api", ["message", "legacy"])
def test_mod_turns_weights_into_clipped_update(api):
    glob = [np.ones((3, 4), np.float32), np.zeros(4, np.float32)]
    local = [glob[0] + 2.0, glob[1] - 1.0]  # update norm sqrt(12 * 4 + 4) = sqrt(52)
    config = {"server-round": 1, "clipping-norm": 0.5, "privatize": True, "noise-std": 0.0}
    reply = dp_mod(instruction(api, config, glob), CTX, fake_client(api, local))
    upload, n, metrics = weights_of(api, reply)
    update = flatten(upload)
    assert np.linalg.norm(update) == pytest.approx(0.5, rel=1e-5)
    assert np.allclose(update / np.linalg.norm(update), (flatten(local) - flatten(glob)) / math.sqrt(52), atol=1e-6)
    assert metrics["update-norm"] == pytest.approx(math.sqrt(52))
    # central placement: the raw update goes up, the server clips
    reply = dp_mod(instruction(api, {**config, "privatize": False}, glob), CTX, fake_client(api, local))
    assert np.allclose(flatten(weights_of(api, reply)[0]), flatten(local) - flatten(glob))


def test_mod_noise_share_std():
    glob = [np.zeros(20000, np.float32)]
    config = {"server-round": 3, "clipping-norm": 1.0, "privatize": True, "noise-std": 0.2}
    reply = dp_mod(instruction("message", config, glob), CTX, fake_client("message", glob))
    noise = flatten(weights_of("message", reply)[0])
    assert abs(noise.std() / 0.2 - 1) < 5 / math.sqrt(2 * noise.size)


def test_mod_under_secure_aggregation_sends_weight_one_and_no_metrics():
    glob = [np.zeros(5, np.float32)]
    config = {"server-round": 1, "clipping-norm": 1.0, "privatize": True, "noise-std": 0.0, "secure-aggregation": True}
    for mod in (dp_mod, uniform_weight_mod):
        _, n, metrics = weights_of(
            "legacy", mod(instruction("legacy", config, glob), CTX, fake_client("legacy", [np.ones(5, np.float32)]))
        )
        assert n == 1 and metrics == {}


def test_mod_errors_are_clear():
    glob = [np.zeros((2, 2), np.float32)]
    with pytest.raises(ValueError, match="no 'clipping-norm'"):
        dp_mod(instruction("message", {"server-round": 1}, glob), CTX, fake_client("message", glob))
    config = {"server-round": 1, "clipping-norm": 1.0, "privatize": True, "noise-std": 0.0}
    with pytest.raises(
        ValueError, match=r"does not match the global model: array 0 has shape \(3,\), expected \(2, 2\)"
    ):
        dp_mod(instruction("message", config, glob), CTX, fake_client("message", [np.zeros(3, np.float32)]))


def test_mod_passes_evaluate_through():
    msg = Message(
        RecordDict({"arrays": ArrayRecord(initial_weights())}), dst_node_id=7, message_type=MessageType.EVALUATE
    )
    sentinel = Message(RecordDict({"metrics": MetricRecord({"accuracy": 0.5})}), reply_to=msg)
    assert dp_mod(msg, CTX, lambda m, c: sentinel) is sentinel


def test_mismatched_client_fails_alone_and_the_round_goes_on():
    strategy = dp()
    result = strategy.start(
        InProcessGrid(message_api_app([dp_mod], other_model_on=3), NODES, {}),
        ArrayRecord(initial_weights()),
        num_rounds=2,
    )
    record = strategy.record.history[-1]
    assert record["failures"] == 1 and record["clients"] == NODES - 1
    assert "does not match the global model" in record["failed_nodes"][0]
    assert np.all(np.isfinite(flatten(result.arrays.to_numpy_ndarrays())))


def legacy_server_app(strategy, rounds):
    return ServerApp(
        server_fn=lambda context: ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds=rounds))
    )


@pytest.mark.flower_version
@pytest.mark.slow  # 2-9 s together: the fast tier keeps its 5-minute margin on 2 cores
def test_legacy_calibrate_needs_the_number_of_rounds_and_then_lands_on_the_target():
    """As the deployment guide shows it (ServerConfig(num_rounds=...)): without num_rounds the strategy
    refuses before any client trains; with it, sigma is calibrated for all the rounds and the last
    printed epsilon is at most the target."""

    def calibrated():
        return DPFedAvg(
            sample_rate=1.0,
            clipping_norm=C,
            noise_multiplier=0.0,
            noise_placement="distributed",
            delta=1e-3,
            target_epsilon=3.0,
            target_epsilon_mode="calibrate",
        )

    grid = InProcessGrid(ClientApp(client_fn=legacy_client_fn, mods=[dp_mod]), NODES, {})
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={})
    with pytest.raises(ValueError, match="num_rounds"):
        legacy_server_app(
            LegacyDPFedAvg(calibrated(), initial_parameters=ndarrays_to_parameters(initial_weights())), 10
        )(grid, context)
    assert grid.sent == []
    strategy = LegacyDPFedAvg(calibrated(), initial_parameters=ndarrays_to_parameters(initial_weights()), num_rounds=10)
    legacy_server_app(strategy, 10)(grid, context)
    assert len(strategy.record.history) == 10
    assert 2.9 <= strategy.record.history[-1]["epsilon"] <= 3.0


def test_legacy_start_evaluates_every_n_rounds_and_after_the_last():
    """eval_every on the legacy path follows the round loop's evaluation_due: rounds 0 (Flower's initial), 2, 4, 5."""
    strategy = LegacyDPFedAvg(dp(), initial_parameters=ndarrays_to_parameters(initial_weights()))
    evaluated = []

    def evaluate_fn(rnd: int, arrays: ArrayRecord) -> MetricRecord:
        evaluated.append(rnd)
        return MetricRecord({"accuracy": accuracy(arrays.to_numpy_ndarrays()), "loss": 0.0})

    grid = InProcessGrid(ClientApp(client_fn=legacy_client_fn, mods=[dp_mod]), NODES, {})
    strategy.start(grid, ArrayRecord(initial_weights()), num_rounds=5, evaluate_fn=evaluate_fn, eval_every=2)
    assert evaluated == [0, 2, 4, 5]


def test_legacy_app_keeps_its_evaluate_metrics_and_logs_nothing_outside_the_ledger(caplog):
    """A legacy NumPyClient app with its own federated evaluation and its own metrics aggregation: its metrics
    come through (Flower's History), and the fit metrics Flower's History prints are the ledger's only."""
    seen = []

    def mean_accuracy(results):  # the app's own aggregation function: unweighted mean
        seen.append(len(results))
        return {"mean_accuracy": float(np.mean([m["accuracy"] for _, m in results]))}

    wrapped = DPFedAvg(
        sample_rate=1.0,
        clipping_norm=C,
        noise_multiplier=SIGMA,
        noise_placement="distributed",
        delta=1e-3,
        seed=1,
        fraction_evaluate=1.0,
    )
    strategy = LegacyDPFedAvg(
        wrapped,
        evaluate_metrics_aggregation_fn=mean_accuracy,
        initial_parameters=ndarrays_to_parameters(initial_weights()),
    )
    context = LegacyContext(
        Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}),
        config=ServerConfig(num_rounds=3),
        strategy=strategy,
    )
    grid = InProcessGrid(ClientApp(client_fn=legacy_client_fn, mods=[dp_mod]), NODES, {})
    with caplog.at_level("DEBUG", logger="flwr"):
        DefaultWorkflow()(grid, context)
    assert seen == [NODES] * 3
    history = context.history.metrics_distributed["mean_accuracy"]
    assert [r for r, _ in history] == [1, 2, 3] and history[-1][1] > 0.5
    fit_metrics = context.history.metrics_distributed_fit
    assert set(fit_metrics) == {"epsilon", "delta", "epsilon_against_server"}, set(fit_metrics)
    logged = "\n".join(r.getMessage() for r in caplog.records if r.levelno >= 20)
    for private in ("update_norm", "clipped_fraction", "'clients'", "rejected"):
        assert private not in logged, private


def test_flowers_accountant_keyword_sets_the_budget_and_the_ledger_computes_the_figure():
    """Issue 39 item 11: Flower's `accountant=RdpAccountant(PrivacyConfig(max_epsilon=...))` was refused with an
    error naming a run-config key. Now its target_delta is the ledger's delta, its max_epsilon a budget to stop at,
    and the ledger (RDP) computes the epsilon: dp-accounting's, fixed-size sampling of all M nodes (sigma / 2)."""
    from flwr.serverapp.strategy import FedAvg
    from flwr.supercore.privacy_accounting import NeighboringRelation, PrivacyConfig, SamplingMethod
    from flwr.supercore.privacy_accounting.rdp_accountant import RdpAccountant

    from dpfl import DifferentialPrivacy
    from tests.independent_accountant import dp_accounting_epsilons
    from tests.test_wrapper import model, weights_client

    sigma, nodes, delta = 2.0, 4, 1e-5
    _, after_2 = dp_accounting_epsilons(sigma / 2, 1.0, 2, delta)
    _, after_3 = dp_accounting_epsilons(sigma / 2, 1.0, 3, delta)
    config = PrivacyConfig(
        target_delta=delta,
        population_size=nodes,
        neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
        sampling_method=SamplingMethod.NO_AMPLIFICATION,
        max_epsilon=(after_2 + after_3) / 2,
    )
    strategy = DifferentialPrivacy(FedAvg(fraction_evaluate=0.0), sigma, 1.0, nodes, accountant=RdpAccountant(config))
    assert (strategy.privacy.accountant, strategy.privacy.target_epsilon, strategy.privacy.delta) == (
        "rdp",
        config.max_epsilon,
        delta,
    )
    strategy.start(InProcessGrid(weights_client(), nodes, {}), model(), num_rounds=5)
    assert len(strategy.record.history) == 2  # the third round would pass max_epsilon
    spent = strategy.privacy_spent()
    assert spent.delta == delta and spent.num_releases == 2
    assert spent.epsilon == pytest.approx(after_2, rel=0.01)
    with pytest.raises(ValueError, match="delta=0.001 and Flower's accountant"):
        DifferentialPrivacy(FedAvg(), sigma, 1.0, nodes, accountant=config, delta=1e-3)


def test_flowers_accountant_keyword_is_said_to_differ_and_its_budget_held_under_the_ledgers_figure(caplog):
    """Issue 55 item 3: Flower's `DifferentialPrivacyServerSideFixedClipping(FedAvg(), 1.0, C, m,
    accountant=RdpAccountant(PrivacyConfig(max_epsilon=12, add-or-remove-one, no-amplification)))` with our class
    swapped in. Flower's accountant charges the Gaussian at sigma = 1 a round (add/remove-one: 4.73 after round 1,
    10.73 after 4); the ledger charges fixed-size sampling of all M = m = 4 nodes as replace-one, the Gaussian at
    sigma / 2 (10.73 after round 1, 16.51 after 2). One warning, when the wrapper is built, names the relation and
    both round-1 figures (dp-accounting's RDP, computed here: the ledger's accountant is RDP, as the RdpAccountant
    asks), and the run stops before round 2, which would pass max_epsilon under the ledger's figure."""
    from flwr.serverapp.strategy import FedAvg
    from flwr.supercore.privacy_accounting import NeighboringRelation, PrivacyConfig, SamplingMethod
    from flwr.supercore.privacy_accounting.rdp_accountant import RdpAccountant

    from dpfl import DifferentialPrivacy
    from tests.test_wrapper import model, weights_client

    sigma, nodes, delta = 1.0, 4, 1e-5

    def rdp_epsilon(noise_multiplier: float, rounds: int) -> float:  # dp-accounting's RDP of the Gaussian, composed
        accountant = dp_accounting.rdp.RdpAccountant()
        accountant.compose(dp_accounting.GaussianDpEvent(noise_multiplier), rounds)
        return accountant.get_epsilon(delta)

    ours_1, ours_2, flowers_1 = rdp_epsilon(sigma / 2, 1), rdp_epsilon(sigma / 2, 2), rdp_epsilon(sigma, 1)
    assert (round(ours_1, 2), round(ours_2, 2), round(flowers_1, 2)) == (10.73, 16.51, 4.73)
    flower = RdpAccountant(
        PrivacyConfig(delta, nodes, NeighboringRelation.ADD_OR_REMOVE_ONE, SamplingMethod.NO_AMPLIFICATION, 12.0)
    )
    with caplog.at_level(logging.INFO, logger="flwr"):
        strategy = DifferentialPrivacy(FedAvg(fraction_evaluate=0.0), sigma, 1.0, nodes, accountant=flower)
        strategy.start(InProcessGrid(weights_client(), nodes, {}), model(), num_rounds=5)
    notes = [r.getMessage() for r in caplog.records if "Flower's accountant=" in r.getMessage()]
    assert len(notes) == 1 and caplog.records[[r.getMessage() for r in caplog.records].index(notes[0])].levelno == 30
    figures = re.fullmatch(
        r"Flower's accountant= is read, not composed into: this wrapper charges replace-one, fixed-size sampling: "
        r"Gaussian mechanism with sensitivity 2C; .* \(rdp accountant\), epsilon ([0-9.]+) at delta 1e-05 after round "
        r"1, where Flower's RdpAccountant \(add-or-remove-one, no-amplification, population_size=4\) would report "
        r"epsilon ([0-9.]+) at delta 1e-05; max_epsilon=12 is held under this wrapper's figure",
        notes[0],
    )
    assert figures, notes[0]
    assert float(figures[1]) == pytest.approx(ours_1, rel=1e-3) and float(figures[2]) == pytest.approx(
        flowers_1, rel=1e-3
    )
    assert flower.num_releases == 0  # the user's object is read, not composed into
    assert len(strategy.record.history) == 1 and strategy.record.stop_reason.startswith("target epsilon 12.0 reached")
    spent = strategy.privacy_spent().epsilon
    assert spent == pytest.approx(ours_1, rel=1e-3) and spent <= 12.0 < ours_2
