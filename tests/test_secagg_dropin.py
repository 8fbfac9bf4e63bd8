"""Issue 34 items 2-4 under SecAgg+: a Flower legacy SecAgg+ app (fl-dp-sa's shape: @app.main, LegacyContext,
DefaultWorkflow with a SecAgg+ fit workflow, mods=[secaggplus_mod, the DP mod]) run in process. Flower's fl-dp-sa
itself runs with only its imports changed (SecAggPlusDifferentialPrivacy, DPSecAggPlusWorkflow, dp_privatize_mod):
the DP average is the decoded sum over m, bit for bit SecAggPlusDPFedAvg's at the same seeds, the ledger charges
fixed-size sampling of m as dp-accounting does; the app's fit metrics stay with the clients unless they send them
knowingly; Flower's log is kept less its node counts. DPSecAggPlusWorkflow takes SecAggPlusWorkflow's arguments as
written, the rounds come from the ServerConfig, and Flower's plain SecAggPlusWorkflow (or central noise under
SecAgg+) is refused before any client trains, naming the change."""

import logging
import random
from functools import partial
from types import SimpleNamespace

import numpy as np
import pytest
from flwr.app import Context, MessageType, RecordDict
from flwr.client.mod import secaggplus_mod
from flwr.clientapp import ClientApp
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.compat.common import recorddict_compat as compat
from flwr.server import LegacyContext, ServerApp, ServerConfig
from flwr.server.client_manager import SimpleClientManager
from flwr.server.strategy import FedAdam, FedAvg
from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow

from dpfl import (
    DPFedAvg,
    DPSecAggPlusWorkflow,
    LegacyDifferentialPrivacy,
    LegacyDPFedAvg,
    SecAggPlusDifferentialPrivacy,
    SecAggPlusDPFedAvg,
    make_dp_privatize_mod,
)
from dpfl.dpcore.privacy.mechanisms import flatten
from dpfl.strategies.legacy.log import FlowerLegacyLog
from dpfl.strategies.legacy.secagg import SECAGG_APP_FIT_METRICS_NOTE, SECAGG_FIT_METRICS_NOTE
from dpfl_tools.inprocess import InProcessGrid
from tests.test_dropin import (
    NODES,
    SIGMA,
    C,
    ForeignClient,
    dp,
    dp_mod,
    initial_weights,
    legacy_client_fn,
    legacy_evaluate,
)
from tests.test_fixed_sampling import unamplified, without_replacement

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
    # num_shares odd: with an even integer Flower's clients raise IndexError in its share-keys stage (every client
    # failed silently here before issue 55 stopped such a run at round 1)
    workflow = DPSecAggPlusWorkflow(
        5, 0.5, max_weight=1000.0, clipping_range=8.0, quantization_range=4194304, modulus_range=4294967296, timeout=30
    )
    assert (workflow.num_shares, workflow.reconstruction_threshold, workflow.max_weight) == (5, 0.5, 1.0)
    assert workflow.timeout == 30 and workflow.modulus_range == 2**32
    strategy = secagg_strategy()
    with caplog.at_level("INFO", logger="flwr"):
        run_legacy_app(strategy, workflow)
    text = [r.getMessage() for r in caplog.records]
    assert [r["round"] for r in strategy.record.history] == [1, 2]
    assert sum(t.startswith("Round 1/2: ") for t in text) == 1 and sum(t.startswith("Round 2/2: ") for t in text) == 1
    assert not any(t.startswith("Round 1/0") for t in text)
    assert strategy.dp.record.num_rounds == ROUNDS
    assert sum("max_weight=1000.0, clipping_range=8.0, quantization_range=4194304 replaced" in t for t in text) == 1
    assert text.count(SECAGG_FIT_METRICS_NOTE) == 1  # said once, not every round
    assert all(r["clients"] == NODES for r in strategy.record.history)  # every client in the sum
    assert strategy.secagg_settings["num_shares"] == 5 and strategy.secagg_settings["max_weight"] == 1.0
    assert strategy.describe()["secagg"] is strategy.secagg_settings
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
    assert grid.sent == [] and strategy.record.history == []


def test_central_noise_under_flowers_plain_secaggplus_is_refused_at_round_1():
    """LegacyDPFedAvg would count SecAgg+'s one sum as separate clients' updates: refused at round 1."""
    central = DPFedAvg(sample_rate=1.0, clipping_norm=1.0, noise_multiplier=0.7, delta=1e-3, seed=1)
    strategy = LegacyDPFedAvg(central, initial_parameters=ndarrays_to_parameters(initial_weights()))
    with pytest.raises(ValueError, match="one SecAgg\\+ sum .* DPSecAggPlusWorkflow in place of SecAggPlusWorkflow"):
        run_legacy_app(strategy, SecAggPlusWorkflow(1.0, 0.5))
    assert strategy.record.history == [] and strategy.ledger is not None


# ---------------------------------------------------------------- Flower's fl-dp-sa, only its imports changed
M, SHARES, THRESHOLD = 5, 3, 2  # m of the NODES clients a round; SecAgg+'s num_shares and reconstruction_threshold


def weighted_average(metrics):  # fl-dp-sa's, as written: it indexes the clients' train_loss
    examples = [num_examples for num_examples, _ in metrics]
    train_losses = [num_examples * m["train_loss"] for num_examples, m in metrics]
    return {"train_loss": sum(train_losses) / sum(examples)}


class TrainLossClient(ForeignClient):
    """fl-dp-sa's client sends its training results as fit metrics: here its partition id as train_loss."""

    def fit(self, parameters, config):
        weights, n, _ = super().fit(parameters, config)
        return weights, n, {"train_loss": float(self.pid)}


def train_loss_client_fn(context: Context):
    node = context.node_config
    return TrainLossClient(int(node["partition-id"]), int(node["num-partitions"])).to_client()


def fl_dp_sa(
    DifferentialPrivacyClientSideFixedClipping,  # noqa: N803 (the example's names, as its imports give them)
    SecAggPlusWorkflow,  # noqa: N803
    fixedclipping_mod,
    make_strategy=FedAvg,
    grid: InProcessGrid | None = None,
) -> tuple:
    """Flower's examples/fl-dp-sa (server_app.py and client_app.py) with its imported names passed in, in process;
    fraction_fit and min_fit_clients as the example derives them. (strategy, Flower's History, the grid)."""
    server_app, out = ServerApp(), {}

    @server_app.main()
    def main(grid, context: Context) -> None:
        num_sampled_clients = M
        fraction_fit = 0.2
        min_fit_clients = int(num_sampled_clients * fraction_fit)
        strategy = make_strategy(
            fraction_fit=fraction_fit,
            fraction_evaluate=0.0,
            min_fit_clients=min_fit_clients,
            fit_metrics_aggregation_fn=weighted_average,
            initial_parameters=ndarrays_to_parameters(initial_weights()),
        )
        strategy = DifferentialPrivacyClientSideFixedClipping(
            strategy, noise_multiplier=SIGMA, clipping_norm=C, num_sampled_clients=num_sampled_clients
        )
        context = LegacyContext(context=context, config=ServerConfig(num_rounds=ROUNDS), strategy=strategy)
        workflow = DefaultWorkflow(
            fit_workflow=SecAggPlusWorkflow(num_shares=SHARES, reconstruction_threshold=THRESHOLD)
        )
        out.update(strategy=strategy, history=context.history)
        workflow(grid, context)

    client_app = ClientApp(client_fn=train_loss_client_fn, mods=[secaggplus_mod, fixedclipping_mod])
    grid = grid or InProcessGrid(client_app, NODES, {})
    random.seed(0)  # SecAgg+ shuffles the nodes (random) and rounds stochastically (NumPy's global generator)
    np.random.seed(0)
    server_app(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}))
    return out["strategy"], out["history"], grid


# the test's settings, beside the example's code: the ledger's delta, seeded sampling and noise (reproducible)
OURS = partial(SecAggPlusDifferentialPrivacy, delta=1e-3, seed=1, secure_rng=False)


def recording(mod, uploads: dict):
    """`mod`, recording each privatized upload (the update a client masks) by (round, node)."""

    def recorded(msg, context, call_next):
        reply = mod(msg, context, call_next)
        if msg.metadata.message_type == MessageType.TRAIN and reply.content.array_records:
            fitres = compat.recorddict_to_fitres(reply.content, keep_input=True)
            config = compat.recorddict_to_fitins(msg.content, keep_input=True).config
            uploads[(config["server-round"], msg.metadata.dst_node_id)] = flatten(
                parameters_to_ndarrays(fitres.parameters)
            )
        return reply

    return recorded


def spied(make_strategy, handed: list):
    """The app's strategy, recording the DP average its aggregate_fit is handed and what it releases."""

    def make(**kw):
        inner = make_strategy(**kw)
        own = inner.aggregate_fit

        def aggregate_fit(server_round, results, failures):
            parameters, metrics = own(server_round, results, failures)
            handed.append(
                (flatten(parameters_to_ndarrays(results[0][1].parameters)), flatten(parameters_to_ndarrays(parameters)))
            )
            return parameters, metrics

        inner.aggregate_fit = aggregate_fit
        return inner

    return make


@pytest.mark.parametrize("make_strategy", [FedAvg, lambda **kw: FedAdam(eta=0.05, **kw)], ids=["FedAvg", "FedAdam"])
def test_fl_dp_sa_runs_with_only_its_imports_changed(make_strategy, caplog):
    """from dpfl import SecAggPlusDifferentialPrivacy as DifferentialPrivacyClientSideFixedClipping,
    DPSecAggPlusWorkflow as SecAggPlusWorkflow, dp_privatize_mod as fixedclipping_mod: each round m clients clip and
    add their noise share, the server reads only their sum (sum = k * mean), and the app's strategy takes its step
    on the DP average (sum + top-up) / m; the ledger charges fixed-size sampling of m, as dp-accounting does."""
    uploads, handed = {}, []
    with caplog.at_level("INFO", logger="flwr"):
        strategy, history, grid = fl_dp_sa(
            OURS, DPSecAggPlusWorkflow, recording(dp_mod, uploads), make_strategy=spied(make_strategy, handed)
        )
    assert [r["round"] for r in strategy.record.history] == list(range(1, ROUNDS + 1))
    assert all(r["clients"] == M and r["rejected"] == 0 for r in strategy.record.history)
    assert strategy.dp.population.client_sampling == "fixed" and strategy.dp.population.sample_rate == M / NODES
    # the DP average is the decoded sum over m (every sampled client finished: no share to top up), within the
    # quantization error of SecAgg+ (at most one step per coordinate per client, over m)
    step = strategy.aggregation.settings["quantization_step"]
    previous = flatten(initial_weights())
    for rnd, (dp_average, released) in enumerate(handed, start=1):
        sent = [u for (r, _), u in uploads.items() if r == rnd]
        assert len(sent) == M
        assert np.max(np.abs((dp_average - previous) - np.sum(sent, axis=0) / M)) <= step
        assert 0.1 < np.linalg.norm(dp_average - previous)
        if make_strategy is FedAvg:
            assert np.array_equal(released, dp_average.astype(released.dtype))
        else:  # FedAdam's step on the DP average: post-processing
            assert not np.allclose(released, dp_average)
        previous = released
    assert strategy.dp.round.server_noise_std == 0.0
    # each upload is a clipped update plus a noise share of std sigma C / sqrt(m)
    noise_share = SIGMA * C / np.sqrt(M)
    assert all(np.linalg.norm(u) <= C + (np.sqrt(u.size) + 8) * noise_share for u in uploads.values())
    # epsilon: fixed-size sampling of m out of NODES, as the ledger charges it and as dp-accounting computes it
    independent = min(without_replacement(NODES, M, SIGMA, ROUNDS, 1e-3), unamplified(SIGMA, ROUNDS, 1e-3))
    assert strategy.ledger.epsilon() == pytest.approx(independent, rel=0.01)
    assert history.metrics_distributed_fit["epsilon"][-1] == (ROUNDS, strategy.ledger.epsilon())
    text = [r.getMessage() for r in caplog.records]
    assert sum(t.startswith(f"Round {ROUNDS}/{ROUNDS}: ") and "epsilon=" in t for t in text) == 1


def test_fl_dp_sa_equals_secaggplus_dpfedavg_at_the_same_seed():
    """The wrapper's SecAgg+ round is SecAggPlusDPFedAvg's (one SecureSum): at the same seeds, the same sample, the
    same released model, the same epsilon."""
    ours, _, _ = fl_dp_sa(OURS, DPSecAggPlusWorkflow, dp_mod)
    reference = SecAggPlusDPFedAvg(
        DPFedAvg(
            noise_multiplier=SIGMA,
            clipping_norm=C,
            sample_rate=M / NODES,
            client_sampling="fixed",
            noise_placement="distributed",
            delta=1e-3,
            seed=1,
            secure_rng=False,
        ),
        initial_parameters=ndarrays_to_parameters(initial_weights()),
    )
    random.seed(0)
    np.random.seed(0)
    run_legacy_app(reference, DPSecAggPlusWorkflow(SHARES, THRESHOLD))
    assert (
        [r["clients"] for r in ours.record.history] == [r["clients"] for r in reference.record.history] == [M] * ROUNDS
    )
    ours_model = flatten(ours.result.arrays.to_numpy_ndarrays())
    reference_model = flatten(reference.result.arrays.to_numpy_ndarrays())
    assert np.array_equal(ours_model, reference_model)  # the same seeds: bit for bit, SecAgg+'s quantization included
    assert ours.ledger.epsilon() == reference.ledger.epsilon()


def test_fl_dp_sa_fit_metrics_stay_with_the_clients_by_default(caplog):
    """dp_privatize_mod sends weight 1 and no fit metrics under SecAgg+: the app's weighted_average (which indexes
    train_loss) is not called and the run does not crash; History's fit metrics are the ledger's; the log says
    once what happens to them and how to pass them through."""
    calls = []

    def counted_average(metrics):
        calls.append(metrics)
        return weighted_average(metrics)

    with caplog.at_level("INFO", logger="flwr"):
        strategy, history, _ = fl_dp_sa(OURS, DPSecAggPlusWorkflow, dp_mod, make_strategy=fedavg_with(counted_average))
    assert strategy.fit_metrics_aggregation_fn is counted_average and calls == []
    assert set(history.metrics_distributed_fit) == {"epsilon", "delta"}
    assert not any("fit_metrics_aggregation_fn failed" in str(r.get("problems")) for r in strategy.record.history)
    text = [r.getMessage() for r in caplog.records]
    assert text.count(SECAGG_APP_FIT_METRICS_NOTE) == 1
    assert "make_dp_privatize_mod(send_fit_metrics=True)" in SECAGG_APP_FIT_METRICS_NOTE


def test_fl_dp_sa_fit_metrics_passed_through_knowingly(caplog):
    """make_dp_privatize_mod(send_fit_metrics=True): each client's train_loss travels in plaintext beside the sum
    (weight 1); the app's weighted_average gets exactly those of the m clients that trained, and History keeps
    what it returns; the printed [SUMMARY] does not show it (outside epsilon) and the log names it."""
    seen = []

    def counted_average(metrics):
        seen.append(metrics)
        return weighted_average(metrics)

    disclosing = make_dp_privatize_mod(seed=0, send_fit_metrics=True)
    with caplog.at_level("INFO", logger="flwr"):
        strategy, history, _ = fl_dp_sa(
            OURS, DPSecAggPlusWorkflow, disclosing, make_strategy=fedavg_with(counted_average)
        )
    assert [len(m) for m in seen] == [M] * ROUNDS
    assert all(n == 1 and set(metrics) == {"train_loss"} for m in seen for n, metrics in m)
    means = [np.mean([metrics["train_loss"] for _, metrics in m]) for m in seen]
    assert history.metrics_distributed_fit["train_loss"] == [(r, pytest.approx(v)) for r, v in enumerate(means, 1)]
    lines = [r.getMessage() for r in caplog.records]
    summary = "\n".join(lines[lines.index("[SUMMARY]") :])
    printed, note = summary.split("\nLeft out of Flower's lines in the log, as epsilon does not cover them: ")
    assert "'epsilon': [(1," in printed and "train_loss" not in printed
    assert note.startswith("History's fit metrics train_loss (fit_metrics_aggregation_fn); Flower's node-count lines")


def fedavg_with(fit_metrics_aggregation_fn):
    """FedAvg as the example builds it, with another fit_metrics_aggregation_fn (a spy around weighted_average)."""
    return lambda **kw: FedAvg(**{**kw, "fit_metrics_aggregation_fn": fit_metrics_aggregation_fn})


def test_fl_dp_sa_log_keeps_flowers_lines_but_no_node_counts(caplog):
    with caplog.at_level("DEBUG", logger="flwr"):
        fl_dp_sa(OURS, DPSecAggPlusWorkflow, dp_mod)
    lines = [r.getMessage() for r in caplog.records]
    for kept in ("[INIT]", *(f"[ROUND {r}]" for r in range(1, ROUNDS + 1)), "[SUMMARY]"):
        assert lines.count(kept) == 1, kept
    assert sum(line.startswith(f"Run finished {ROUNDS} round(s)") for line in lines) == 1
    counting = ("configure_fit", "aggregate_fit", "configure_evaluate", "aggregate_evaluate", "[Stage", "Secure agg")
    assert not [line for line in lines if line.startswith(counting)]
    assert logging_filters() == []


def logging_filters() -> list:
    return [f for f in logging.getLogger("flwr").filters if isinstance(f, FlowerLegacyLog)]


def test_flowers_plain_secaggplus_workflow_left_in_is_refused_before_any_client_trains():
    grid = InProcessGrid(ClientApp(client_fn=train_loss_client_fn, mods=[secaggplus_mod, dp_mod]), NODES, {})
    with pytest.raises(ValueError, match=r"replace SecAggPlusWorkflow\(\.\.\.\) with DPSecAggPlusWorkflow"):
        fl_dp_sa(OURS, SecAggPlusWorkflow, dp_mod, grid=grid)
    assert grid.sent == []


def test_central_noise_under_dpsecaggplus_workflow_is_refused_naming_the_secagg_form():
    """LegacyDifferentialPrivacy clips and noises on the server, which under SecAgg+ sees only the sum: refused
    before round 1 samples, naming SecAggPlusDifferentialPrivacy."""
    grid = InProcessGrid(ClientApp(client_fn=train_loss_client_fn, mods=[secaggplus_mod, dp_mod]), NODES, {})
    with pytest.raises(TypeError, match="SecAggPlusDifferentialPrivacy in place of LegacyDifferentialPrivacy"):
        fl_dp_sa(partial(LegacyDifferentialPrivacy, delta=1e-3), DPSecAggPlusWorkflow, dp_mod, grid=grid)
    assert grid.sent == []


# ---------------------------------------------------------------- the sum's nodes (issue 39 item 7)
@pytest.mark.parametrize("extra", ["none", "duplicate", "unsampled", "unknown"])
def test_the_secure_sum_counts_only_sampled_unique_known_nodes(extra):
    """SecAgg+'s workflow hands the strategy one result per node that finished the protocol, each carrying the mean of
    their uploads. The nodes are checked by the reply gate's rule (`reply_gate.node_problem`), as every other path
    checks replies: the m = 5 sampled nodes are read as a sum of 5 (sigma 0: the model moves by exactly the mean);
    with a node listed twice, a connected node not sampled or a node never connected among them, the sum (which holds
    that node's upload) is refused and counted 0, naming the node; the round releases noise only (none at sigma 0).
    It once counted them all: 6 clients out of m = 5."""
    manager = SimpleClientManager()
    for node in range(1, 9):
        manager.register(SimpleNamespace(cid=str(node), node_id=node))
    strategy = SecAggPlusDifferentialPrivacy(FedAvg(), 0.0, C, M, delta=1e-3, seed=1)
    strategy.aggregation.settings = {"quantization_step": 0.0}  # as DPSecAggPlusWorkflow sets it each round
    start = [np.zeros((4, 3), np.float32), np.zeros(5, np.float32)]
    sampled = [proxy for proxy, _ in strategy.configure_fit(1, ndarrays_to_parameters(start), manager)]
    assert len(sampled) == M
    mean = [np.full((4, 3), 0.05, np.float32), np.full(5, -0.05, np.float32)]  # norm 0.21 < C
    parameters = ndarrays_to_parameters(mean)  # SecAgg+ hands every result the same Parameters
    outsider = next(n for n in range(1, 9) if n not in {p.node_id for p in sampled})
    node = {"none": None, "duplicate": sampled[0].node_id, "unsampled": outsider, "unknown": 999}[extra]
    proxies = sampled + ([SimpleNamespace(cid=str(node), node_id=node)] if node is not None else [])
    released, _ = strategy.aggregate_fit(1, [(p, FitRes(Status(Code.OK, ""), parameters, 1, {})) for p in proxies], [])
    record = strategy.result.train_metrics_clientapp[1]
    moved = flatten(parameters_to_ndarrays(released)) - flatten(start)
    if extra == "none":
        assert (record["clients"], record["rejected"]) == (M, 0)
        np.testing.assert_allclose(moved, flatten(mean), rtol=1e-6)
    else:
        assert (record["clients"], record["rejected"]) == (0, M + 1)
        assert not moved.any()
        reason = {"duplicate": "a second reply", "unsampled": "not sampled this round", "unknown": "an unknown node"}
        (problem,) = strategy.dp.round.problems
        assert (
            problem.startswith(f"rejected the secure sum of {M + 1} updates: node {node}: ")
            and reason[extra] in problem
        )
