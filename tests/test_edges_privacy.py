"""Integrity at the edges, privacy and reliability (issue 26, second part): every sampled round charged on
every path, the target a hard cap, what travels beside the update, bounded SecAgg+ sums, ALI-DPFL's
trust in client numbers, failed runs that say so. Epsilons are checked against dp-accounting."""

import pytest
from flwr.app import Context, RecordDict
from flwr.client.mod import secaggplus_mod
from flwr.clientapp import ClientApp
from flwr.common import ndarrays_to_parameters
from flwr.server import ServerApp, ServerAppComponents, ServerConfig

from fl_app.inprocess import InProcessGrid
from strategies.dp_fedavg import DPFedAvg
from strategies.legacy import LegacyDPFedAvg
from strategies.secagg import SecAggPlusDPFedAvg
from tests.independent_accountant import dp_accounting_epsilons
from tests.test_dropin import dp_mod, initial_weights, legacy_client_fn, legacy_evaluate

# ---------------------------------------------------------------- 1. every sampled round is charged

SKIP_NODES, SKIP_Q, SKIP_SIGMA, SKIP_DELTA, SKIP_ROUNDS = 3, 0.3, 1.0, 1e-3, 60


def small_sample_dp() -> DPFedAvg:
    """3 nodes at q = 0.3: a third of the samples are empty, three quarters have fewer than 2 nodes."""
    return DPFedAvg(sample_rate=SKIP_Q, clipping_norm=1.0, noise_multiplier=SKIP_SIGMA,
                    noise_placement="distributed", delta=SKIP_DELTA, seed=5, secure_rng=False)


@pytest.mark.parametrize("secure", [False, True], ids=["legacy", "secagg+"])
def test_every_sampled_round_is_charged_on_the_legacy_and_secagg_paths(secure):
    """60 sampled rounds cost the 60-round sampled Gaussian, whatever the samples held: a round whose sample
    was empty (or, under SecAgg+, smaller than 2) releases the model with noise only and is charged. Before:
    the legacy adapter printed 4.74 and SecAgg+ 3.25 (those rounds skipped and not charged), where 60 sampled
    rounds cost 5.57 (dp-accounting)."""
    dp = small_sample_dp()
    if secure:
        strategy = SecAggPlusDPFedAvg(dp, evaluate_fn=legacy_evaluate,
                                      initial_parameters=ndarrays_to_parameters(initial_weights()))
        mods = [secaggplus_mod, dp_mod]
    else:
        strategy = LegacyDPFedAvg(dp, evaluate_fn=legacy_evaluate,
                                  initial_parameters=ndarrays_to_parameters(initial_weights()))
        mods = [dp_mod]
    server_app = ServerApp(server_fn=lambda context: ServerAppComponents(
        strategy=strategy, config=ServerConfig(num_rounds=SKIP_ROUNDS)))
    if secure:
        server_app = secagg_server_app(strategy)
    grid = InProcessGrid(ClientApp(client_fn=legacy_client_fn, mods=mods), SKIP_NODES, {})
    server_app(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}))
    expected, _ = dp_accounting_epsilons(SKIP_SIGMA, SKIP_Q, SKIP_ROUNDS, SKIP_DELTA)
    assert [r["round"] for r in strategy.history] == list(range(1, SKIP_ROUNDS + 1))
    assert sum(steps for _, _, steps in strategy.ledger.model.history) == SKIP_ROUNDS
    assert strategy.describe()["epsilon"] == pytest.approx(expected, rel=0.02)
    assert strategy.describe()["epsilon"] >= expected * 0.995
    # the short rounds happened, and are diagnostics
    short = [r for r in strategy.history if r["clients"] < (2 if secure else 1)]
    assert short and all(any("noise only" in p for p in r["problems"]) for r in short)


def secagg_server_app(strategy):
    from flwr.server import LegacyContext
    from flwr.server.workflow import DefaultWorkflow

    from strategies.secagg import DPSecAggPlusWorkflow

    app = ServerApp()

    @app.main()
    def main(grid, context):
        legacy = LegacyContext(context, config=ServerConfig(num_rounds=SKIP_ROUNDS), strategy=strategy)
        DefaultWorkflow(fit_workflow=DPSecAggPlusWorkflow())(grid, legacy)

    return app


# ---------------------------------------------------------------- 2. the target is a hard cap on every path

CAP_TARGET = 2.7


def calibrated_dp() -> DPFedAvg:
    return DPFedAvg(sample_rate=1.0, clipping_norm=1.0, noise_multiplier=0.0, noise_placement="distributed",
                    delta=1e-3, target_epsilon=CAP_TARGET, target_epsilon_mode="calibrate", seed=1, secure_rng=False)


def test_calibrated_run_resumed_with_more_rounds_stops_at_its_target():
    """Calibrated for 5 rounds, resumed to 10: it stops before the round that would exceed the target
    (before: all 10 rounds ran at the 5-round sigma and printed 4.152 against 2.7)."""
    from flwr.app import ArrayRecord

    from tests.test_dropin import message_api_app

    grid = InProcessGrid(message_api_app([dp_mod]), 4, {})
    first = calibrated_dp()
    result = first.start(grid, ArrayRecord(initial_weights()), num_rounds=5)
    assert len(first.history) == 5 and first.history[-1]["epsilon"] <= CAP_TARGET
    resumed = calibrated_dp()
    resumed.load_state_dict(first.state_dict())
    resumed.start(grid, result.arrays, num_rounds=10)
    printed = [r["epsilon"] for r in resumed.history]
    assert max(printed) <= CAP_TARGET and resumed.ledger.epsilon() <= CAP_TARGET
    assert len(resumed.history) < 10 and "target epsilon 2.7 reached" in resumed.stop_reason


def test_legacy_strategy_with_fewer_rounds_than_its_server_config_stops_at_its_target():
    """LegacyDPFedAvg(num_rounds=5) under ServerConfig(num_rounds=15): calibrated for 5, it stops at the target
    instead of running 15 rounds (before: 15 rounds, 5.369 against 2.7)."""
    strategy = LegacyDPFedAvg(calibrated_dp(), initial_parameters=ndarrays_to_parameters(initial_weights()),
                              num_rounds=5)
    server_app = ServerApp(server_fn=lambda context: ServerAppComponents(strategy=strategy,
                                                                         config=ServerConfig(num_rounds=15)))
    grid = InProcessGrid(ClientApp(client_fn=legacy_client_fn, mods=[dp_mod]), 4, {})
    server_app(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}))
    assert max(r["epsilon"] for r in strategy.history) <= CAP_TARGET
    assert strategy.describe()["epsilon"] <= CAP_TARGET and len(strategy.history) == 5
