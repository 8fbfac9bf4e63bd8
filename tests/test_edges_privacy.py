"""Integrity at the edges, privacy and reliability (issue 26, second part): every sampled round charged on
every path, the target a hard cap, what travels beside the update, bounded SecAgg+ sums, ALI-DPFL's
trust in client numbers, failed runs that say so. Epsilons are checked against dp-accounting."""

from types import SimpleNamespace

import pytest
from flwr.app import Context, RecordDict
from flwr.client.mod import secaggplus_mod
from flwr.clientapp import ClientApp
from flwr.common import ndarrays_to_parameters
from flwr.server import ServerApp, ServerAppComponents, ServerConfig

from dpfl.strategies.dp_fedavg import DPFedAvg
from dpfl.strategies.legacy.adapter import LegacyDPFedAvg
from dpfl.strategies.legacy.secagg import SecAggPlusDPFedAvg
from dpfl_tools.inprocess import InProcessGrid
from tests.independent_accountant import dp_accounting_epsilons
from tests.test_dropin import dp_mod, initial_weights, legacy_client_fn, legacy_evaluate

# ---------------------------------------------------------------- 1. every sampled round is charged

SKIP_NODES, SKIP_Q, SKIP_SIGMA, SKIP_DELTA, SKIP_ROUNDS = 3, 0.3, 1.0, 1e-3, 60


def small_sample_dp() -> DPFedAvg:
    """3 nodes at q = 0.3: a third of the samples are empty, three quarters have fewer than 2 nodes."""
    return DPFedAvg(
        sample_rate=SKIP_Q,
        clipping_norm=1.0,
        noise_multiplier=SKIP_SIGMA,
        noise_placement="distributed",
        delta=SKIP_DELTA,
        seed=5,
        secure_rng=False,
    )


@pytest.mark.slow
@pytest.mark.parametrize("secure", [False, True], ids=["legacy", "secagg+"])
def test_every_sampled_round_is_charged_on_the_legacy_and_secagg_paths(secure):
    """60 sampled rounds cost the 60-round sampled Gaussian, whatever the samples held: a round whose sample
    was empty (or, under SecAgg+, smaller than 2) releases the model with noise only and is charged. Before:
    the legacy adapter printed 4.74 and SecAgg+ 3.25 (those rounds skipped and not charged), where 60 sampled
    rounds cost 5.57 (dp-accounting)."""
    dp = small_sample_dp()
    if secure:
        strategy = SecAggPlusDPFedAvg(
            dp, evaluate_fn=legacy_evaluate, initial_parameters=ndarrays_to_parameters(initial_weights())
        )
        mods = [secaggplus_mod, dp_mod]
    else:
        strategy = LegacyDPFedAvg(
            dp, evaluate_fn=legacy_evaluate, initial_parameters=ndarrays_to_parameters(initial_weights())
        )
        mods = [dp_mod]
    server_app = ServerApp(
        server_fn=lambda context: ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds=SKIP_ROUNDS))
    )
    if secure:
        server_app = secagg_server_app(strategy)
    grid = InProcessGrid(ClientApp(client_fn=legacy_client_fn, mods=mods), SKIP_NODES, {})
    server_app(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}))
    expected, _ = dp_accounting_epsilons(SKIP_SIGMA, SKIP_Q, SKIP_ROUNDS, SKIP_DELTA)
    assert [r["round"] for r in strategy.record.history] == list(range(1, SKIP_ROUNDS + 1))
    assert sum(steps for _, _, steps in strategy.ledger.model.history) == SKIP_ROUNDS
    assert strategy.describe()["epsilon"] == pytest.approx(expected, rel=0.02)
    assert strategy.describe()["epsilon"] >= expected * 0.995
    # the short rounds happened, and are diagnostics
    short = [r for r in strategy.record.history if r["clients"] < (2 if secure else 1)]
    assert short and all(any("noise only" in p for p in r["problems"]) for r in short)


def secagg_server_app(strategy):
    from flwr.server import LegacyContext
    from flwr.server.workflow import DefaultWorkflow

    from dpfl.strategies.legacy.secagg import DPSecAggPlusWorkflow

    app = ServerApp()

    @app.main()
    def main(grid, context):
        legacy = LegacyContext(context, config=ServerConfig(num_rounds=SKIP_ROUNDS), strategy=strategy)
        DefaultWorkflow(fit_workflow=DPSecAggPlusWorkflow())(grid, legacy)

    return app


# ---------------------------------------------------------------- 2. the target is a hard cap on every path

CAP_TARGET = 2.7


def calibrated_dp() -> DPFedAvg:
    return DPFedAvg(
        sample_rate=1.0,
        clipping_norm=1.0,
        noise_multiplier=0.0,
        noise_placement="distributed",
        delta=1e-3,
        target_epsilon=CAP_TARGET,
        target_epsilon_mode="calibrate",
        seed=1,
        secure_rng=False,
    )


def test_calibrated_run_resumed_with_more_rounds_stops_at_its_target():
    """Calibrated for 5 rounds, resumed to 10: it stops before the round that would exceed the target
    (before: all 10 rounds ran at the 5-round sigma and printed 4.152 against 2.7)."""
    from flwr.app import ArrayRecord

    from tests.test_dropin import message_api_app

    grid = InProcessGrid(message_api_app([dp_mod]), 4, {})
    first = calibrated_dp()
    result = first.start(grid, ArrayRecord(initial_weights()), num_rounds=5)
    assert len(first.record.history) == 5 and first.record.history[-1]["epsilon"] <= CAP_TARGET
    resumed = calibrated_dp()
    resumed.load_state_dict(first.state_dict())
    resumed.start(grid, result.arrays, num_rounds=10)
    printed = [r["epsilon"] for r in resumed.record.history]
    assert max(printed) <= CAP_TARGET and resumed.ledger.epsilon() <= CAP_TARGET
    assert len(resumed.record.history) < 10 and "target epsilon 2.7 reached" in resumed.record.stop_reason


def test_legacy_strategy_with_fewer_rounds_than_its_server_config_stops_at_its_target():
    """LegacyDPFedAvg(num_rounds=5) under ServerConfig(num_rounds=15): calibrated for 5, it stops at the target
    instead of running 15 rounds (before: 15 rounds, 5.369 against 2.7)."""
    strategy = LegacyDPFedAvg(
        calibrated_dp(), initial_parameters=ndarrays_to_parameters(initial_weights()), num_rounds=5
    )
    server_app = ServerApp(
        server_fn=lambda context: ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds=15))
    )
    grid = InProcessGrid(ClientApp(client_fn=legacy_client_fn, mods=[dp_mod]), 4, {})
    server_app(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}))
    assert max(r["epsilon"] for r in strategy.record.history) <= CAP_TARGET
    assert strategy.describe()["epsilon"] <= CAP_TARGET and len(strategy.record.history) == 5


# ---------------------------------------------------------------- 3. every figure that is no guarantee says so


def run_small(tmp_path, name, caplog, **overrides):
    import json
    import logging
    from pathlib import Path

    from dpfl.fl_app.client_app import app as client_app
    from dpfl.fl_app.config import validate
    from dpfl.fl_app.results import read_metrics
    from dpfl.fl_app.server_app import run_federated
    from tests.test_dashboards import events

    cfg = validate(
        {
            "dataset": "digits",
            "model": "mlp",
            "partitioner": "iid",
            "local-steps": 2,
            "num-rounds": 2,
            "sample-rate": 0.5,
            "results-dir": str(tmp_path / name),
            **overrides,
        }
    )
    with caplog.at_level(logging.INFO, logger="flwr"):
        run_federated(InProcessGrid(client_app, 4, cfg), cfg)
    run = Path(cfg.output.results_dir)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Round ")]
    caplog.clear()
    return (
        read_metrics(run),
        lines,
        json.loads((run / "summary.json").read_text()),
        set(events(run).Tags()["scalars"]),
    )


@pytest.mark.parametrize(
    "case,mark,tag",
    [
        ("distributed", "epsilon_against_server_is_guarantee", "privacy/epsilon_against_server_NOT_a_guarantee"),
        ("local evaluate", "epsilon_against_server_is_guarantee", "privacy/epsilon_against_server_NOT_a_guarantee"),
        ("top-k fixed", "epsilon_is_guarantee", "privacy/epsilon_NOT_a_guarantee"),
        ("wavelet paper", "claimed_epsilon_is_guarantee", "privacy/epsilon_claimed_by_paper_NOT_a_guarantee"),
    ],
)
def test_figures_that_are_no_guarantee_say_so_on_every_per_round_output(case, mark, tag, tmp_path, caplog):
    """Distributed noise without SecAgg+: clients send their norm before clipping, loss and example count in the
    clear, so epsilon_against_server is no guarantee; top-k after distributed noise under fixed sampling (the
    zeros reveal who took part) and the wavelet's paper-calibrated claim neither. Every round's metrics.jsonl
    record, log line and TensorBoard tag say so, not only summary.json (before: only the summary, and nothing for
    the server figure)."""
    overrides = {
        "distributed": {},
        "local evaluate": {"noise-placement": "local", "fraction-evaluate": 0.5},
        "top-k fixed": {"algorithm": "dp-fedsam-topk", "sparsity": 0.5, "client-sampling": "fixed"},
        "wavelet paper": {"algorithm": "dp-fedavg-wav", "noise-placement": "central", "wavelet-calibration": "paper"},
    }[case]
    rows, lines, summary, tags = run_small(tmp_path, case.replace(" ", "-"), caplog, **overrides)
    assert len(rows) == 2 and all(r[mark] is False for r in rows)
    assert len(lines) == 2 and all(f"{mark}=False" in line for line in lines)
    assert tag in tags and tag.removesuffix("_NOT_a_guarantee") not in tags
    if case == "distributed":
        assert summary["epsilon_against_server_is_guarantee"] is False
        assert "update norm" in summary["epsilon_against_server_caveats"][0]
    if case == "local evaluate":  # local DP's uploads are covered, its clients' evaluate replies are not
        assert summary["epsilon_against_server_is_guarantee"] is False
        assert summary["epsilon_against_server_caveats"] == [
            "clients' evaluate replies (loss, accuracy, example count; fraction-evaluate > 0) reach the server "
            "in the clear: epsilon_against_server covers the noisy uploads only, not those replies"
        ]
    if case == "top-k fixed":
        assert summary["epsilon_is_guarantee"] is False


def test_local_dp_without_client_evaluation_is_a_server_guarantee(tmp_path, caplog):
    rows, lines, summary, tags = run_small(tmp_path, "local", caplog, **{"noise-placement": "local"})
    assert not any(k.endswith("_is_guarantee") for r in rows for k in r)
    assert summary.get("epsilon_against_server_is_guarantee", True) is True
    assert "privacy/epsilon_against_server" in tags


def test_secagg_and_central_rounds_carry_no_mark(tmp_path, caplog):
    rows, lines, summary, tags = run_small(tmp_path, "central", caplog, **{"noise-placement": "central"})
    assert not any(k.endswith("_is_guarantee") for r in rows for k in r)
    assert "privacy/epsilon" in tags and "is_guarantee" not in "".join(lines)


# ---------------------------------------------------------------- 4. outputs beside the model: covered or declared


def test_short_secagg_rounds_leave_no_counting_line_in_the_log(caplog):
    """SecAgg+ halting on a sample of one node logged 'The number of samples should be greater than 1.' at
    ERROR (a round with few clients, in the published log), and the legacy adapter its 'no aggregate' warning.
    Now both are the round's diagnostics only."""
    import logging

    from flwr.app import ArrayRecord

    strategy = SecAggPlusDPFedAvg(small_sample_dp())
    grid = InProcessGrid(ClientApp(client_fn=legacy_client_fn, mods=[secaggplus_mod, dp_mod]), SKIP_NODES, {})
    with caplog.at_level(logging.DEBUG, logger="flwr"):
        strategy.start(grid, ArrayRecord(initial_weights()), num_rounds=8)
    assert [r for r in strategy.record.history if r["clients"] < 2], "the seed gives short rounds"
    visible = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    for text in ("number of samples", "Insufficient", "should be odd", "no aggregate", "Not enough shares"):
        assert not [m for m in visible if text in m], text
    assert any(m.startswith("Round 8/8") for m in visible)


def test_tensorboard_events_do_not_time_the_rounds(tmp_path, caplog):
    from tests.test_dashboards import events

    run_small(tmp_path, "tb", caplog)
    acc = events(tmp_path / "tb")
    assert {e.wall_time for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)} == {0.0}


def test_outputs_that_epsilon_does_not_cover_are_listed_in_the_privacy_doc():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "privacy.md").read_text()
    section = text[text.index("Outputs beside the model that epsilon does **not** cover") :]
    section = section[: section.index("## Threat model")]
    for output in (
        "checkpoint.npz",
        "epsilon_per_client",
        "_runtime",
        "wall_time",
        "quiet_workflow_logs",
        "The number of samples",
    ):
        assert output in section, output


# ---------------------------------------------------------------- 5. ALI-DPFL's server mu never sees the test set


@pytest.mark.parametrize("validation_fraction", [0.0, 0.1])
def test_server_mu_is_estimated_on_held_out_data_never_on_what_accuracy_is_measured_on(
    validation_fraction, tmp_path, monkeypatch
):
    """mu steers tau (training), so the data it is estimated on must not be the test data the reported accuracy is
    measured on (the validation set, held out of the training data, is model-selection data: val_accuracy). Before: every mu gradient was taken on the server's test set (256 of its samples, all of them
    evaluated); now on the validation split, or on 256 test samples that evaluation leaves out."""
    import numpy as np

    import dpfl.fl_app.server_app as server_app
    from dpfl.fl_app.client_app import app as client_app
    from dpfl.fl_app.config import validate

    mu_rows, evaluated_rows = set(), set()
    real_gradient, real_evaluate = server_app.loss_gradient, server_app.evaluate_model

    def rows(dataset, n=0):
        x = dataset.x[:n] if n else dataset.x
        return {hash(np.ascontiguousarray(row).tobytes()) for row in x}

    def spy_gradient(model, dataset, max_samples=0, **kw):
        mu_rows.update(rows(dataset, max_samples))
        return real_gradient(model, dataset, max_samples, **kw)

    calls = []

    def spy_evaluate(model, dataset, *args, **kw):  # each evaluation: the test set, then the validation set if any
        calls.append(dataset)
        if validation_fraction == 0 or len(calls) % 2 == 1:
            evaluated_rows.update(rows(dataset))
        return real_evaluate(model, dataset, *args, **kw)

    monkeypatch.setattr(server_app, "loss_gradient", spy_gradient)
    monkeypatch.setattr(server_app, "evaluate_model", spy_evaluate)
    cfg = validate(
        {
            "dataset": "digits",
            "model": "mlp",
            "partitioner": "iid",
            "algorithm": "ali-dpfl",
            "num-rounds": 2,
            "sample-rate": 1.0,
            "batch-sample-rate": 0.2,
            "target-epsilon": 20.0,
            "mu-source": "server",
            "adaptive": True,
            "validation-fraction": validation_fraction,
            "tensorboard": False,
            "results-dir": str(tmp_path / "run"),
        }
    )
    server_app.run_federated(InProcessGrid(client_app, 3, cfg), cfg)
    assert len(mu_rows) > 100 and evaluated_rows
    assert not mu_rows & evaluated_rows


# ---------------------------------------------------------------- 6. one derivation of the SecAgg+ server figure


@pytest.mark.slow
@pytest.mark.parametrize("sampling", ["poisson", "fixed"])
def test_secagg_server_figure_is_one_derivation_sensitivity_2c(sampling):
    """Against the server (it chose the sample, so it knows who is in the sum) each SecAgg+ round is the
    Gaussian mechanism at sensitivity 2C, multiplier sigma sqrt(k / n_s) / 2, under either client sampling.
    Before: Poisson-sampled runs charged sensitivity C (91.8 for sigma = 1, 100 rounds, delta 1e-5), fixed-size
    runs 2C (284.4). dp-accounting's Gaussian: 284.4."""
    import dp_accounting
    from dp_accounting import pld

    from dpfl.dpcore.privacy.ledger import ClientLevelLedger
    from dpfl.strategies.parts.noise_placement import server_view

    ledger = ClientLevelLedger(
        1e-5, server_view=server_view("distributed"), secure_aggregation=True, client_sampling=sampling
    )
    for _ in range(100):
        ledger.record_round(1.0, 0.1, 10, received=10)
    independent = pld.PLDAccountant(value_discretization_interval=1e-4)
    independent.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(0.5), 100))
    assert ledger.epsilon_against_server() == pytest.approx(independent.get_epsilon(1e-5), rel=0.01)
    assert ledger.epsilon_against_server() == pytest.approx(284.4, abs=0.5)


# ---------------------------------------------------------------- 7. SecAgg+: the unmasked sum is bounded


def test_secagg_refuses_a_sum_above_what_honest_clients_can_produce():
    """A sum 200x above k C plus the noise bound was aggregated (65 rounds seen). Now the sum is refused whole
    (the round moves by the full noise only, topped up for every share) and an honest sum passes."""
    import numpy as np
    from flwr.app import ArrayRecord
    from flwr.common import Code, FitRes, Status, parameters_to_ndarrays

    from dpfl.dpcore.privacy.mechanisms import flatten, l2_norm

    dp = DPFedAvg(sample_rate=1.0, clipping_norm=1.0, noise_multiplier=0.0, noise_placement="distributed")
    strategy = SecAggPlusDPFedAvg(dp)
    dp.setup_population(3)
    weights = [np.zeros(50, np.float32)]

    def round_with(mean: np.ndarray):
        strategy._global = weights
        dp.begin_round(ArrayRecord(weights))
        res = FitRes(Status(Code.OK, ""), ndarrays_to_parameters([mean]), 1, {})
        parameters, _ = strategy.aggregate_fit(1, [(SimpleNamespace(node_id=n), res) for n in (1, 2, 3)], [])
        return flatten(parameters_to_ndarrays(parameters)), dict(strategy.result.train_metrics_clientapp[1])

    honest = np.full(50, 1.0 / np.sqrt(50), np.float32)  # each client's update at norm C: the sum has norm 3C
    moved, metrics = round_with(honest)
    assert metrics["clients"] == 3 and l2_norm(moved) == pytest.approx(1.0, rel=1e-4)  # the sum 3C over m = 3
    moved, metrics = round_with(200 * honest)  # a sum 200x above what 3 honest clients can produce
    assert metrics["clients"] == 0 and metrics["rejected"] == 3
    assert "above the bound" in dp.round.problems[0] and l2_norm(moved) == 0  # sigma = 0: no noise either
