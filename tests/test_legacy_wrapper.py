"""`LegacyDifferentialPrivacy(strategy, noise_multiplier, clipping_norm, num_sampled_clients)`, Flower's legacy
DP wrapper signature, around the app's own legacy FedAvg, FedProx and FedAdam: a legacy app (tests.test_dropin's
foreign NumPyClients, no mod: server-side clipping) run under ServerApp(server_fn=...) in process."""

import math

import numpy as np
import pytest
from flwr.app import Context, RecordDict
from flwr.clientapp import ClientApp
from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server import ServerApp, ServerAppComponents, ServerConfig
from flwr.server.strategy import FedAdam, FedAvg, FedAvgM, FedProx, FedYogi

from dpcore.privacy.mechanisms import flatten
from dpfl import LegacyDifferentialPrivacy
from dpfl_tools.inprocess import InProcessGrid
from strategies.round_loop import parse_log_line
from tests.test_dropin import NODES, accuracy, initial_weights, legacy_client_fn, shard

ROUNDS, C, SIGMA, M = 3, 1.0, 0.5, 5
DIM = 64 * 10 + 10


def dp_bound() -> float:
    """||DP average - global|| <= C (m clipped updates over the fixed denominator m) plus the norm of
    N(0, (sigma C / m)^2 I_d), below (sqrt(d) + 8) sigma C / m except with probability < e^-32."""
    return C + (math.sqrt(DIM) + 8) * SIGMA * C / M


def run(make_strategy, caplog):
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
        strategy = LegacyDifferentialPrivacy(inner, SIGMA, C, M, delta=1e-3, seed=1)
        server_app = ServerApp(
            server_fn=lambda context: ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds=ROUNDS))
        )
        grid = InProcessGrid(ClientApp(client_fn=legacy_client_fn), NODES, {})
        server_app(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}))
    return strategy, evaluated, fit_metrics_seen, handed, released


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
    strategy, evaluated, fit_metrics_seen, handed, released = run(make_strategy, caplog)
    name = type(strategy.strategy).__name__
    assert sorted(evaluated) == [0, 1, 2, 3]  # the app's evaluate_fn: initial model, then every round
    assert len(strategy.history) == ROUNDS
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
    assert "'loss_ish': [(1, 1.0), (2, 1.0), (3, 1.0)]" in caplog.text  # the app's fit metrics in Flower's History
    assert sum(f"{name}'s fraction_fit=0.3 and min_fit_clients=3 are not used" in t for t in text) == 1
    assert strategy.history[-1]["clients"] == M


def test_a_failing_fit_metrics_function_does_not_stop_the_run(caplog):
    def make(**kw):
        kw["fit_metrics_aggregation_fn"] = lambda results: 1 / 0
        return FedAvg(**kw)

    strategy, evaluated, _, _, _ = run(make, caplog)
    assert len(strategy.history) == ROUNDS and sorted(evaluated) == [0, 1, 2, 3]
    assert "fit_metrics_aggregation_fn failed (ZeroDivisionError" in str(strategy.history[-1])


def test_num_sampled_clients_above_the_population_is_capped_with_a_line(caplog):
    strategy = LegacyDifferentialPrivacy(
        FedAvg(initial_parameters=ndarrays_to_parameters(initial_weights())), SIGMA, C, 50, delta=1e-3
    )
    with caplog.at_level("INFO", logger="flwr"):
        server_app = ServerApp(
            server_fn=lambda context: ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds=1))
        )
        grid = InProcessGrid(ClientApp(client_fn=legacy_client_fn), NODES, {})
        server_app(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}))
    assert strategy.history[-1]["clients"] == NODES
    assert f"num_sampled_clients=50 but {NODES} nodes are connected: {NODES} are sampled a round" in caplog.text
