"""Issue 34 item 3: a Flower legacy SecAgg+ app (fl-dp-sa's shape: @app.main, LegacyContext, DefaultWorkflow with a
SecAgg+ fit workflow, mods=[secaggplus_mod, the DP mod]) run in process: DPSecAggPlusWorkflow takes
SecAggPlusWorkflow's arguments as written, the rounds come from the ServerConfig, Flower's plain SecAggPlusWorkflow
is refused at round 1 naming the change, and what happens to the fit metrics is said once."""

import pytest
from flwr.app import Context, RecordDict
from flwr.client.mod import secaggplus_mod
from flwr.clientapp import ClientApp
from flwr.common import ndarrays_to_parameters
from flwr.server import LegacyContext, ServerApp, ServerConfig
from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow

from dpfl import DPFedAvg, DPSecAggPlusWorkflow, LegacyDPFedAvg, SecAggPlusDPFedAvg
from dpfl_tools.inprocess import InProcessGrid
from strategies.secagg import SECAGG_FIT_METRICS_NOTE
from tests.test_dropin import NODES, dp, dp_mod, initial_weights, legacy_client_fn, legacy_evaluate

ROUNDS = 2


def run_legacy_app(strategy, fit_workflow, mods=(secaggplus_mod, dp_mod)) -> InProcessGrid:
    server_app = ServerApp()

    @server_app.main()
    def main(grid, context):
        legacy = LegacyContext(context, config=ServerConfig(num_rounds=ROUNDS), strategy=strategy)
        DefaultWorkflow(fit_workflow=fit_workflow)(grid, legacy)

    grid = InProcessGrid(ClientApp(client_fn=legacy_client_fn, mods=list(mods)), NODES, {})
    server_app(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}))
    return grid


def secagg_strategy() -> SecAggPlusDPFedAvg:
    return SecAggPlusDPFedAvg(
        dp(), evaluate_fn=legacy_evaluate, initial_parameters=ndarrays_to_parameters(initial_weights())
    )


def test_flowers_secaggplus_arguments_as_written_and_rounds_from_the_server_config(caplog):
    workflow = DPSecAggPlusWorkflow(
        4, 0.5, max_weight=1000.0, clipping_range=8.0, quantization_range=4194304, modulus_range=4294967296, timeout=30
    )
    assert (workflow.num_shares, workflow.reconstruction_threshold, workflow.max_weight) == (4, 0.5, 1.0)
    assert workflow.timeout == 30 and workflow.modulus_range == 2**32
    strategy = secagg_strategy()
    with caplog.at_level("INFO", logger="flwr"):
        run_legacy_app(strategy, workflow)
    text = [r.getMessage() for r in caplog.records]
    assert [r["round"] for r in strategy.history] == [1, 2]
    assert sum(t.startswith("Round 1/2: ") for t in text) == 1 and sum(t.startswith("Round 2/2: ") for t in text) == 1
    assert not any(t.startswith("Round 1/0") for t in text)
    assert strategy.dp.num_rounds == ROUNDS
    assert sum("max_weight=1000.0, clipping_range=8.0, quantization_range=4194304 replaced" in t for t in text) == 1
    assert text.count(SECAGG_FIT_METRICS_NOTE) == 1  # said once, not every round
    assert strategy.secagg_settings["num_shares"] == 4 and strategy.secagg_settings["max_weight"] == 1.0
    assert strategy.secagg_settings["clipping_range"] != 8.0


def test_flowers_plain_secaggplus_workflow_is_refused_before_any_client_trains():
    grid = InProcessGrid(ClientApp(client_fn=legacy_client_fn, mods=[secaggplus_mod, dp_mod]), NODES, {})
    strategy = secagg_strategy()
    server_app = ServerApp()

    @server_app.main()
    def main(g, context):
        DefaultWorkflow(fit_workflow=SecAggPlusWorkflow(1.0, 0.5))(g, LegacyContext(context, ServerConfig(1), strategy))

    with pytest.raises(ValueError, match=r"replace SecAggPlusWorkflow\(\.\.\.\) with DPSecAggPlusWorkflow"):
        server_app(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}))
    assert grid.sent == [] and strategy.history == []


def test_central_noise_under_flowers_plain_secaggplus_is_refused_at_round_1():
    """LegacyDPFedAvg would count SecAgg+'s one sum as separate clients' updates: refused at round 1."""
    central = DPFedAvg(sample_rate=1.0, clipping_norm=1.0, noise_multiplier=0.7, delta=1e-3, seed=1)
    strategy = LegacyDPFedAvg(central, initial_parameters=ndarrays_to_parameters(initial_weights()))
    with pytest.raises(ValueError, match="one SecAgg\\+ sum .* DPSecAggPlusWorkflow in place of SecAggPlusWorkflow"):
        run_legacy_app(strategy, SecAggPlusWorkflow(1.0, 0.5))
    assert strategy.history == [] and strategy.ledger is not None
