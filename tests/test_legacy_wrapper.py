"""`LegacyDifferentialPrivacy(strategy, noise_multiplier, clipping_norm, num_sampled_clients)`, Flower's legacy
DP wrapper signature, around the app's own legacy FedAvg, FedProx and FedAdam: a legacy app (tests.test_dropin's
foreign NumPyClients, no mod: server-side clipping) run under ServerApp(server_fn=...) in process. Flower's own log
is kept less what epsilon does not cover (`strategies.legacy.log`)."""

import logging
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server import Server, ServerApp, ServerAppComponents, ServerConfig
from flwr.server.client_manager import SimpleClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import (
    Bulyan,
    FaultTolerantFedAvg,
    FedAdam,
    FedAvg,
    FedAvgM,
    FedMedian,
    FedProx,
    FedYogi,
    Krum,
    QFedAvg,
)
from flwr.serverapp.strategy import FedAvg as MessageFedAvg

from dpfl import LegacyDifferentialPrivacy, SecAggPlusDifferentialPrivacy
from dpfl.dpcore.privacy import protocol as keys
from dpfl.dpcore.privacy.mechanisms import flatten, unflatten
from dpfl.dpcore.privacy.settings import SettingError
from dpfl.strategies import DifferentialPrivacy
from dpfl.strategies.legacy.log import FlowerLegacyLog
from dpfl.strategies.loop.log_line import parse_log_line
from dpfl.strategies.loop.sample_epsilon import max_sample_epsilon, max_sample_epsilon_records
from dpfl.strategies.loop.wrapped import reply_message
from dpfl_tools.inprocess import InProcessGrid
from tests.test_dropin import NODES, accuracy, initial_weights, legacy_client_fn, shard

ROUNDS, C, SIGMA, M = 3, 1.0, 0.5, 5
DIM = 64 * 10 + 10


def dp_bound() -> float:
    """||DP average - global|| <= C (m clipped updates over the fixed denominator m) plus the norm of
    N(0, (sigma C / m)^2 I_d), below (sqrt(d) + 8) sigma C / m except with probability < e^-32."""
    return C + (math.sqrt(DIM) + 8) * SIGMA * C / M


class KeepHistory(Server):
    """Flower's legacy Server, keeping the History its run returns (ServerApp(server_fn=...) drops it)."""

    def fit(self, num_rounds, timeout):
        self.history, elapsed = super().fit(num_rounds, timeout)
        return self.history, elapsed


def serve(strategy, rounds: int, caplog) -> KeepHistory:
    """The legacy app under ServerApp(server_fn=...), Flower's own legacy server loop: its Server and History."""
    server = KeepHistory(client_manager=SimpleClientManager(), strategy=strategy)
    with caplog.at_level("DEBUG", logger="flwr"):
        server_app = ServerApp(
            server_fn=lambda context: ServerAppComponents(server=server, config=ServerConfig(num_rounds=rounds))
        )
        grid = InProcessGrid(ClientApp(client_fn=legacy_client_fn), NODES, {})
        server_app(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}))
    return server


def test_flowers_legacy_server_threads_get_one_exchange_at_a_time():
    """Flower's legacy Server asks each client from a thread of its pool; in one process their ClientApps run one
    after the other (dpfl_tools.inprocess: two threads parsing at once can make CPython 3.11 raise a SystemError)."""
    running, most = [0], [0]
    lock = threading.Lock()

    def app(msg, context):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.02)
        with lock:
            running[0] -= 1
        return Message(RecordDict({"metrics": MetricRecord({"x": 1.0})}), reply_to=msg)

    grid = InProcessGrid(app, 8, {})
    message = lambda node: grid.create_message(RecordDict(), "train", node, "1")  # noqa: E731
    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda node: grid.send_and_receive([message(node)]), grid.get_node_ids()))
    assert [len(r) for r in replies] == [1] * 8 and not any(r[0].has_error() for r in replies)
    assert most[0] == 1


def shown(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]


def log_filters() -> list:
    return [f for f in logging.getLogger("flwr").filters if isinstance(f, FlowerLegacyLog)]


def run(make_strategy, caplog, **dp_keywords):
    evaluated, fit_metrics_seen, handed, released = {}, [], [], []

    def evaluate_fn(rnd, ndarrays, config):
        evaluated[rnd] = [a.copy() for a in ndarrays]
        return 0.0, {"accuracy": accuracy(ndarrays)}

    def fit_metrics(results):  # the app's own: sees what the clients sent
        fit_metrics_seen.append(results)
        return {"loss_ish": float(np.mean([m["loss-ish"] for _, m in results]))}

    inner = make_strategy(
        fraction_fit=0.3,
        min_fit_clients=3,
        initial_parameters=ndarrays_to_parameters(initial_weights()),
        evaluate_fn=evaluate_fn,
        fit_metrics_aggregation_fn=fit_metrics,
    )
    own_aggregate_fit = inner.aggregate_fit

    def spy(server_round, results, failures):  # what the app's strategy is handed, and what it returns
        handed.append(
            [(res.num_examples, dict(res.metrics), parameters_to_ndarrays(res.parameters)) for _, res in results]
        )
        out = own_aggregate_fit(server_round, results, failures)
        released.append(parameters_to_ndarrays(out[0]))
        return out

    inner.aggregate_fit = spy
    with caplog.at_level("INFO", logger="flwr"):
        strategy = LegacyDifferentialPrivacy(inner, SIGMA, C, M, delta=1e-3, seed=1, **dp_keywords)
    server = serve(strategy, ROUNDS, caplog)
    return strategy, evaluated, fit_metrics_seen, handed, released, server.history


@pytest.mark.parametrize(
    "make_strategy",
    [
        FedAvg,
        lambda **kw: FedProx(proximal_mu=0.1, **kw),
        lambda **kw: FedAdam(eta=0.05, **kw),
        lambda **kw: FedYogi(eta=0.05, **kw),
        lambda **kw: FedAvgM(server_momentum=0.9, **kw),
    ],
    ids=["FedAvg", "FedProx", "FedAdam", "FedYogi", "FedAvgM"],
)
def test_legacy_dp_wraps_the_apps_own_strategy(make_strategy, caplog):
    strategy, evaluated, fit_metrics_seen, handed, released, history = run(make_strategy, caplog)
    name = type(strategy.strategy).__name__
    assert sorted(evaluated) == [0, 1, 2, 3]  # the app's evaluate_fn: initial model, then every round
    assert len(strategy.record.history) == ROUNDS
    # the app's fit_metrics_aggregation_fn: exactly what the m sampled clients sent, every round
    shard_sizes = {len(shard(i, NODES)[1]) for i in range(NODES)}
    assert [len(r) for r in fit_metrics_seen] == [M] * ROUNDS
    assert all(m == {"loss-ish": 1.0} and n in shard_sizes for r in fit_metrics_seen for n, m in r)
    # the app's strategy gets the DP average as its only result (weight 1, no metrics), within the DP bound of the
    # model it was computed from; what it returns is the released model
    assert [[(n, m) for n, m, _ in h] for h in handed] == [[(1, {})]] * ROUNDS
    for rnd in range(1, ROUNDS + 1):
        dp_average = handed[rnd - 1][0][2]
        move = float(np.linalg.norm(flatten(dp_average) - flatten(evaluated[rnd - 1])))
        assert 0.1 < move <= dp_bound(), (rnd, move, dp_bound())
        assert np.array_equal(flatten(evaluated[rnd]), flatten(released[rnd - 1]))
        assert evaluated[rnd][0].dtype == np.float32
        if name in ("FedAdam", "FedYogi") or (name == "FedAvgM" and rnd > 1):  # their step acts on the DP average
            assert not np.allclose(flatten(evaluated[rnd]), flatten(dp_average))
        else:
            assert np.array_equal(flatten(evaluated[rnd]), flatten(dp_average))
    # epsilon is printed each round and is the ledger's; the settings the wrapper cannot honour are named once
    lines = [parse_log_line(r.getMessage()) for r in caplog.records]
    printed = [p for p, _ in filter(None, lines)]
    assert [p["round"] for p in printed] == [1, 2, 3]
    assert printed[-1]["epsilon"] == pytest.approx(strategy.describe()["epsilon"], rel=1e-3)
    assert strategy.describe()["epsilon"] == pytest.approx(strategy.ledger.epsilon(), rel=1e-12)
    assert 0 < printed[-1]["epsilon"] < math.inf
    text = [r.getMessage() for r in caplog.records]
    assert history.metrics_distributed_fit["loss_ish"] == [(1, 1.0), (2, 1.0), (3, 1.0)]  # the app's, in History
    assert sum(f"{name}'s fraction_fit=0.3 and min_fit_clients=3 are not used" in t for t in text) == 1
    assert strategy.record.history[-1]["clients"] == M


def test_a_failing_fit_metrics_function_does_not_stop_the_run(caplog):
    def make(**kw):
        kw["fit_metrics_aggregation_fn"] = lambda results: 1 / 0
        return FedAvg(**kw)

    strategy, evaluated, _, _, _, _ = run(make, caplog)
    assert len(strategy.record.history) == ROUNDS and sorted(evaluated) == [0, 1, 2, 3]
    assert "fit_metrics_aggregation_fn failed (ZeroDivisionError" in str(strategy.record.history[-1])


def test_num_sampled_clients_above_the_population_is_refused_before_round_1():
    """fl-dp-sa's m = 20 on 10 nodes (issue 39 item 11): an error naming m and the node count, no round."""
    strategy = LegacyDifferentialPrivacy(
        FedAvg(initial_parameters=ndarrays_to_parameters(initial_weights())), SIGMA, C, 50, delta=1e-3
    )
    server_app = ServerApp(
        server_fn=lambda context: ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds=1))
    )
    grid = InProcessGrid(ClientApp(client_fn=legacy_client_fn), NODES, {})
    with pytest.raises(SettingError, match=rf"num_sampled_clients=50 .*more than the {NODES} nodes connected"):
        server_app(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}))
    strategy.flower_log.uninstall()  # a run that raised leaves its log filter (the next run replaces it)
    assert strategy.record.history == [] and grid.sent == []


def loss_ish_mean(results):  # the app's fit_metrics_aggregation_fn
    return {"loss_ish": float(np.mean([m["loss-ish"] for _, m in results]))}


def evaluated_fedavg(**kw) -> FedAvg:
    """The app's FedAvg with its own fit metrics, the server's evaluation and the clients' (fraction_evaluate=1)."""
    return FedAvg(
        fraction_evaluate=1.0,
        initial_parameters=ndarrays_to_parameters(initial_weights()),
        evaluate_fn=lambda rnd, ndarrays, config: (0.0, {"accuracy": accuracy(ndarrays)}),
        fit_metrics_aggregation_fn=loss_ish_mean,
        **kw,
    )


COUNT_LINE_STARTS = ("configure_fit", "aggregate_fit", "configure_evaluate", "aggregate_evaluate")


def test_flowers_legacy_log_is_kept_less_what_epsilon_does_not_cover(caplog):
    """[INIT], [ROUND r], [SUMMARY], `Run finished` and the History stay; the node-count lines go; the printed History
    holds the ledger's fit metrics and the server's evaluation, not the app's fit metrics nor the clients' evaluation,
    which Flower's History keeps; one line names what was withheld. The strategy filters Flower's log itself, for
    its run only: nothing is installed when it is built, nothing is left after its [SUMMARY]."""
    strategy = LegacyDifferentialPrivacy(evaluated_fedavg(), SIGMA, C, M, delta=1e-3, seed=1)
    assert log_filters() == []
    history = serve(strategy, ROUNDS, caplog).history
    assert log_filters() == []
    lines = shown(caplog)
    for kept in ("[INIT]", "[ROUND 1]", "[ROUND 2]", "[ROUND 3]", "[SUMMARY]"):
        assert lines.count(kept) == 1, kept
    assert sum(line.startswith("Run finished 3 round(s) in ") for line in lines) == 1
    assert not [line for line in lines if line.startswith(COUNT_LINE_STARTS)]
    summary = "\n".join(lines[lines.index("[SUMMARY]") :])
    printed, note = summary.split("\nLeft out of Flower's lines in the log, as epsilon does not cover them: ")
    assert "History (metrics, distributed, fit):" in printed and "History (metrics, centralized):" in printed
    assert f"(3, {strategy.ledger.epsilon()!r})" in printed  # the ledger's epsilon, as Flower prints its History
    assert "History (loss, centralized):" in printed
    for withheld in ("loss_ish", "History (loss, distributed)", "History (metrics, distributed, evaluate)"):
        assert withheld not in printed, withheld
    assert note.startswith("History's fit metrics loss_ish (fit_metrics_aggregation_fn); the clients' evaluation")
    assert "History's distributed loss, accuracy" in note and "publish_diagnostics=True prints them all" in note
    assert sum(line.startswith("Left out of Flower's lines in the log, as epsilon") for line in lines) == 1
    # Flower's History holds everything: the ledger's figures, the app's fit metrics, both evaluations
    assert set(history.metrics_distributed_fit) == {"epsilon", "delta", "loss_ish"}
    assert history.metrics_distributed_fit["epsilon"][-1] == (3, strategy.ledger.epsilon())
    assert [r for r, _ in history.losses_distributed] == [1, 2, 3] and "accuracy" in history.metrics_distributed
    assert [r for r, _ in history.losses_centralized] == [0, 1, 2, 3]


def test_publish_diagnostics_prints_flowers_log_whole(caplog):
    strategy = LegacyDifferentialPrivacy(evaluated_fedavg(), SIGMA, C, M, delta=1e-3, seed=1, publish_diagnostics=True)
    serve(strategy, ROUNDS, caplog)
    lines = shown(caplog)
    assert lines.count(f"configure_fit: strategy sampled {M} clients (out of {NODES})") == ROUNDS
    assert lines.count(f"aggregate_fit: received {M} results and 0 failures") == ROUNDS
    summary = "\n".join(lines[lines.index("[SUMMARY]") :])
    assert "'loss_ish': [(1, 1.0), (2, 1.0), (3, 1.0)]" in summary and "History (loss, distributed)" in summary
    assert "Left out of Flower's lines" not in summary


def test_a_run_that_raised_leaves_its_filter_only_until_the_next_runs_init(caplog):
    """A run that raises before its [SUMMARY] (here: calibrate without the number of rounds, refused at round 1)
    leaves its filter on the flwr logger; the next legacy run's [INIT] removes it, so a run with Flower's plain
    FedAvg prints its count lines."""
    refused = LegacyDifferentialPrivacy(
        evaluated_fedavg(), SIGMA, C, M, target_epsilon=5.0, target_epsilon_mode="calibrate"
    )
    with pytest.raises(ValueError, match="needs the number of rounds"):
        serve(refused, 1, caplog)
    assert len(log_filters()) == 1
    caplog.clear()
    serve(FedAvg(initial_parameters=ndarrays_to_parameters(initial_weights())), 1, caplog)
    assert log_filters() == []
    assert f"configure_fit: strategy sampled {NODES} clients (out of {NODES})" in shown(caplog)


@pytest.mark.parametrize("num_rounds", [0, 2])
def test_round_lines_name_the_total_only_where_it_is_known(num_rounds, caplog):
    """Under ServerApp(server_fn=...), Flower's ServerConfig never reaches the strategy (Flower's legacy Server calls
    no strategy method with it): the line reads `Round r:`, never `Round r/0`; num_rounds= names the total."""
    strategy = LegacyDifferentialPrivacy(
        FedAvg(initial_parameters=ndarrays_to_parameters(initial_weights())), SIGMA, C, M, num_rounds=num_rounds
    )
    serve(strategy, 2, caplog)
    round_lines = [line for line in shown(caplog) if line.startswith("Round ")]
    total = f"/{num_rounds}" if num_rounds else ""
    assert [line.split(": ")[0] for line in round_lines] == [f"Round 1{total}", f"Round 2{total}"]
    assert [parse_log_line(line)[0]["round"] for line in round_lines] == [1, 2]
    assert parse_log_line(round_lines[-1])[0]["epsilon"] == pytest.approx(strategy.ledger.epsilon(), rel=1e-3)


def test_the_note_names_at_most_twenty_withheld_keys(caplog):
    """The app's function may return any number of keys (from what clients sent): the note names 20 and counts
    the rest, as the Message-API wrapper's does."""
    many = FedAvg(
        initial_parameters=ndarrays_to_parameters(initial_weights()),
        fit_metrics_aggregation_fn=lambda results: {f"k{i:02d}": 1.0 for i in range(25)},
    )
    history = serve(LegacyDifferentialPrivacy(many, SIGMA, C, M), 1, caplog).history
    (note,) = [line for line in shown(caplog) if line.startswith("Left out of Flower's lines")]
    assert "History's fit metrics k00, k01," in note and "k19 and 5 more (fit_metrics_aggregation_fn)" in note
    assert "k20" not in note and len(history.metrics_distributed_fit) == 25 + 2


@pytest.mark.parametrize("publish_diagnostics", [False, True])
def test_the_summary_ends_by_naming_the_bound_the_printed_epsilon_is(publish_diagnostics, caplog):
    """sigma 2e-6: dp-accounting's PLD overflows, so the ledger's bound is RDP's; the end of Flower's [SUMMARY] says
    so once (as the Message-API wrapper's log does at its end), whether or not the diagnostics are published."""
    strategy = LegacyDifferentialPrivacy(
        evaluated_fedavg(), 2e-6, C, M, delta=1e-3, seed=1, publish_diagnostics=publish_diagnostics
    )
    serve(strategy, 2, caplog)
    lines = shown(caplog)
    said = [i for i, line in enumerate(lines) if line.startswith("The epsilon printed is the bound of rdp")]
    assert len(said) == 1 and said[0] > lines.index("[SUMMARY]"), lines[-8:]
    # fixed-size sampling of m is charged under the replace-one relation: the Gaussian at sigma / 2, named
    assert "(pld failed at a noise multiplier of 1e-06 charged" in lines[said[0]]
    assert lines[said[0]].endswith("not of the accountant asked for (pld)")
    assert strategy.dp.privacy_spent().accounting_method.startswith("rdp")


# ---------------------------------------------------------------- the wrapped strategy's own steps (issue 39 item 5)
SHAPES = [(4, 3), (5,)]


class RecordingProxy(ClientProxy):
    """A legacy client as Flower's legacy Server reaches it: records each FitIns config it is sent and replies with
    an update of norm C / 2 and `metrics`."""

    def __init__(self, node_id: int, metrics: dict | None = None) -> None:
        super().__init__(str(node_id))
        self.node_id = node_id
        self.metrics = metrics or {}
        self.configs: list[dict] = []

    def fit(self, ins, timeout, group_id):
        self.configs.append(dict(ins.config))
        weights = parameters_to_ndarrays(ins.parameters)
        return honest_fit_res(weights, self.metrics)

    def evaluate(self, ins, timeout, group_id):
        raise NotImplementedError

    def get_properties(self, ins, timeout, group_id):
        raise NotImplementedError

    def get_parameters(self, ins, timeout, group_id):
        raise NotImplementedError

    def reconnect(self, ins, timeout, group_id):
        raise NotImplementedError


def honest_fit_res(weights: list[np.ndarray], metrics: dict, num_examples: int = 10) -> FitRes:
    """The client's new weights: the global ones plus an update of norm C / 2."""
    step = np.full(sum(a.size for a in weights), 0.5 * C / math.sqrt(sum(a.size for a in weights)), np.float32)
    new = unflatten(flatten(weights) + step, [a.shape for a in weights])
    return FitRes(Status(Code.OK, ""), ndarrays_to_parameters(new), num_examples, dict(metrics))


def connected(proxies) -> SimpleClientManager:
    manager = SimpleClientManager()
    for proxy in proxies:
        manager.register(proxy)
    return manager


def zeros() -> list[np.ndarray]:
    return [np.zeros(s, np.float32) for s in SHAPES]


def test_fedprox_proximal_mu_and_the_apps_fit_config_reach_the_sampled_clients():
    """FedProx's configure_fit adds proximal_mu to the FitIns config (and FedAvg's puts on_fit_config_fn's): under the
    wrapper each of the m clients it samples gets that config plus the DP keys, through Flower's legacy Server; the
    wrapped strategy's own sampling (fraction_fit=0.1) is not used."""
    proxies = [RecordingProxy(node) for node in range(1, 9)]
    inner = FedProx(
        proximal_mu=0.25,
        fraction_fit=0.1,
        fraction_evaluate=0.0,
        on_fit_config_fn=lambda rnd: {"local-epochs": 2, "round-seen": rnd},
        initial_parameters=ndarrays_to_parameters(zeros()),
    )
    strategy = LegacyDifferentialPrivacy(inner, SIGMA, C, 3, delta=1e-3, seed=1)
    server = Server(client_manager=connected(proxies), strategy=strategy)
    try:
        server.fit(num_rounds=2, timeout=None)
    finally:
        strategy.flower_log.uninstall()
    sent = [config for proxy in proxies for config in proxy.configs]
    assert len(sent) == 2 * 3  # m = 3 a round, not FedProx's fraction_fit of 8
    assert all(config["proximal_mu"] == 0.25 and config["local-epochs"] == 2 for config in sent)
    assert sorted(config["round-seen"] for config in sent) == [1, 1, 1, 2, 2, 2]
    assert all(config["clipping-norm"] == C for config in sent)  # the DP keys beside them
    assert [r["clients"] for r in strategy.record.history] == [3, 3]


def test_the_apps_fit_config_cannot_override_the_dp_keys():
    proxy = RecordingProxy(1)
    inner = FedAvg(on_fit_config_fn=lambda rnd: {"clipping-norm": 100.0}, min_available_clients=1)
    strategy = LegacyDifferentialPrivacy(inner, SIGMA, C, 1, delta=1e-3)
    ((_, fit_ins),) = strategy.configure_fit(1, ndarrays_to_parameters(zeros()), connected([proxy]))
    assert fit_ins.config["clipping-norm"] == C


class MyBulyan(Bulyan):
    """An app's own subclass of a strategy the wrapper refuses."""


class MyFedAvg(FedAvg):
    """An app's own FedAvg subclass: wrapped."""


@pytest.mark.parametrize(
    "make, named",
    [
        (lambda: Bulyan(num_malicious_clients=0, to_keep=0), "cannot wrap Bulyan: "),
        (lambda: QFedAvg(), "cannot wrap QFedAvg: "),
        (
            lambda: MyBulyan(num_malicious_clients=0, to_keep=0),
            r"cannot wrap MyBulyan \(a subclass of Flower's Bulyan\)",
        ),
        (lambda: Krum(), "cannot wrap Krum: "),
        (lambda: FedMedian(), "cannot wrap FedMedian: "),
    ],
)
@pytest.mark.parametrize("wrapper", [LegacyDifferentialPrivacy, SecAggPlusDifferentialPrivacy])
def test_strategies_whose_aggregation_cannot_be_privatized_are_refused_by_name(make, named, wrapper):
    """Bulyan and QFedAvg (FedAvg subclasses) raised out of aggregate_fit in round 1: refused when the wrapper is
    built, naming the class and what is allowed."""
    with pytest.raises(TypeError, match=named) as refused:
        wrapper(make(), SIGMA, C, M, delta=1e-3)
    assert str(refused.value).endswith(
        "Allowed: FedAvg, FedProx, FedAdam, FedYogi, FedAdagrad, FedAvgM, FaultTolerantFedAvg, or a subclass of one "
        "of them that does not override aggregate_fit"
    )


def test_a_subclass_of_an_allowed_strategy_is_wrapped():
    strategy = LegacyDifferentialPrivacy(MyFedAvg(), SIGMA, C, M, delta=1e-3)
    assert isinstance(strategy.strategy, MyFedAvg)


class OwnAggregation(FedAvg):
    """An app's FedAvg whose aggregate_fit aggregates the clients' results itself."""

    def aggregate_fit(self, server_round, results, failures):
        return super().aggregate_fit(server_round, results, failures)


class BelowOwnAggregation(OwnAggregation):
    """Its subclass: inherits that aggregate_fit."""


@pytest.mark.parametrize("make", [OwnAggregation, BelowOwnAggregation])
def test_a_subclass_that_overrides_aggregate_fit_is_refused_naming_the_method(make):
    with pytest.raises(TypeError) as refused:
        LegacyDifferentialPrivacy(make(), SIGMA, C, M, delta=1e-3)
    assert str(refused.value).startswith(
        f"LegacyDifferentialPrivacy cannot wrap {make.__name__} (a subclass of Flower's FedAvg): "
        "OwnAggregation.aggregate_fit overrides FedAvg's aggregation; the wrapper hands the strategy's aggregate_fit "
        "one result, the DP average,"
    )


def test_flowers_fault_tolerant_fedavg_is_wrapped_and_runs_a_round():
    """Issue 55 item 8: FaultTolerantFedAvg (a FedAvg subclass with its own aggregate_fit, which on the DP average
    alone returns it) was refused. Wrapped, it runs a round through Flower's legacy Server and releases the DP
    average of the m = 3 clipped updates."""
    proxies = [RecordingProxy(node) for node in range(1, 5)]
    inner = FaultTolerantFedAvg(fraction_evaluate=0.0, initial_parameters=ndarrays_to_parameters(zeros()))
    own_aggregate_fit, handed, released = inner.aggregate_fit, [], []

    def spy(server_round, results, failures):
        handed.append(flatten(parameters_to_ndarrays(results[0][1].parameters)))
        out = own_aggregate_fit(server_round, results, failures)
        released.append(flatten(parameters_to_ndarrays(out[0])))
        return out

    inner.aggregate_fit = spy
    strategy = LegacyDifferentialPrivacy(inner, SIGMA, C, 3, delta=1e-3, seed=1)
    server = Server(client_manager=connected(proxies), strategy=strategy)
    try:
        server.fit(num_rounds=1, timeout=None)
    finally:
        strategy.flower_log.uninstall()
    assert [r["clients"] for r in strategy.record.history] == [3] and len(handed) == 1
    assert np.array_equal(released[0], handed[0])  # its aggregate_fit on the DP average alone: the average itself
    d = handed[0].size  # each update C / 2 along the ones vector; noise N(0, (sigma C / m)^2 I)
    noise = float(np.linalg.norm(handed[0] - 0.5 * C / math.sqrt(d)))
    assert 0 < noise <= (math.sqrt(d) + 8) * SIGMA * C / 3
    assert strategy.describe()["epsilon"] == strategy.ledger.epsilon() > 0


def test_sample_epsilon_max_shows_inf_for_an_honest_sigma_0_client_as_the_message_api_wrapper_does():
    """A client training at sigma 0 reports sample-epsilon = inf; the largest over the round is inf. The Message-API
    wrapper (FedAvg with max_sample_epsilon_records) puts inf into the round's train metrics; the legacy wrapper's
    History gets inf too (it once dropped non-finite values, so the figure vanished)."""
    reported = [
        {keys.SAMPLE_EPSILON: 1.5, keys.SAMPLE_DELTA: 1e-5},
        {keys.SAMPLE_EPSILON: math.inf, keys.SAMPLE_DELTA: 1e-5},
    ]
    # the Message-API wrapper
    message_api = DifferentialPrivacy(
        MessageFedAvg(train_metrics_aggr_fn=max_sample_epsilon_records),
        clipping_norm=C,
        noise_multiplier=0.0,
        sample_rate=1.0,
        min_available_nodes=2,
    )
    message_api.setup_population(2)
    arrays = ArrayRecord(zeros())
    message_api.begin_round(arrays)
    replies = [
        reply_message(
            node,
            RecordDict(
                {
                    "arrays": ArrayRecord(parameters_to_ndarrays(honest_fit_res(zeros(), {}).parameters)),
                    "metrics": MetricRecord({keys.NUM_EXAMPLES: 10, **metrics}),
                }
            ),
        )
        for node, metrics in zip((1, 2), reported)
    ]
    _, message_metrics = message_api.aggregate_train(1, replies)
    assert message_metrics["sample-epsilon-max"] == math.inf
    # the legacy wrapper
    proxies = [RecordingProxy(node, metrics) for node, metrics in zip((1, 2), reported)]
    legacy = LegacyDifferentialPrivacy(FedAvg(fit_metrics_aggregation_fn=max_sample_epsilon), 0.0, C, 2, delta=1e-3)
    instructions = legacy.configure_fit(1, ndarrays_to_parameters(zeros()), connected(proxies))
    results = [(proxy, proxy.fit(ins, None, "")) for proxy, ins in instructions]
    _, legacy_metrics = legacy.aggregate_fit(1, results, [])
    assert legacy_metrics["sample-epsilon-max"] == message_metrics["sample-epsilon-max"] == math.inf
    assert legacy_metrics[keys.SAMPLE_DELTA] == 1e-5
