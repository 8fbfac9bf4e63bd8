"""The DP wrapper around Flower strategies: what it gives back has the form it was given, the wrapped
strategy's aggregation and server optimizer act on the privatized model, and replies it cannot interpret
are refused with a reason."""

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAdam, FedAvg, FedAvgM, FedProx, FedYogi

from dpfl.clients.mods import make_dp_privatize_mod
from dpfl.dpcore.privacy import protocol as keys
from dpfl.strategies import DifferentialPrivacy
from dpfl.strategies.loop.wrapped import reply_message
from dpfl_tools.inprocess import InProcessGrid

M = 4
STEP = np.float32(0.01)  # what each client adds to every floating-point weight


def model() -> ArrayRecord:
    """Named arrays of several dtypes, one of them an integer counter (BatchNorm's num_batches_tracked)."""
    return ArrayRecord(
        {
            "fc.weight": Array(np.ones((3, 2), np.float32)),
            "fc.bias": Array(np.zeros(2, np.float64)),
            "bn.num_batches_tracked": Array(np.array(5, np.int64)),
            "half": Array(np.full(4, 0.5, np.float16)),
        }
    )


def weights_client(mods=()) -> ClientApp:
    """A Flower client as in quickstart-pytorch: it replies with its new weights (named), and bumps the counter."""
    app = ClientApp()

    @app.train(mods=list(mods))
    def train(msg: Message, context: Context) -> Message:
        sent = msg.content["arrays"]
        new = {}
        for k in sent.keys():
            a = sent[k].numpy()
            new[k] = Array(np.asarray(a + 7 if a.dtype.kind == "i" else (a + STEP).astype(a.dtype)))
        return Message(
            RecordDict({"arrays": ArrayRecord(new), "metrics": MetricRecord({"num-examples": 10})}), reply_to=msg
        )

    return app


def run(strategy, app=None, rounds=1):
    grid = InProcessGrid(app or weights_client(), M, {})
    result = strategy.start(grid, model(), num_rounds=rounds)
    return result, grid


def no_noise(inner=None, **kw) -> DifferentialPrivacy:
    return DifferentialPrivacy(
        inner, clipping_norm=100.0, noise_multiplier=0.0, sample_rate=1.0, min_available_nodes=M, **kw
    )


def test_keys_order_shapes_and_dtypes_come_back_and_integers_pass_through():
    result, _ = run(no_noise())
    out, start = result.arrays, model()
    assert list(out.keys()) == list(start.keys())
    for k in start.keys():
        assert out[k].numpy().dtype == start[k].numpy().dtype and out[k].numpy().shape == start[k].numpy().shape
    assert int(out["bn.num_batches_tracked"].numpy()) == 5  # the clients' +7 is not averaged in, nor noised
    # weights replies: the update is derived on the server (w_i - w), then averaged: w + STEP exactly
    np.testing.assert_allclose(out["fc.weight"].numpy(), 1 + STEP, rtol=1e-6)
    np.testing.assert_allclose(out["half"].numpy(), np.float16(0.5) + np.float16(STEP), rtol=1e-3)


def test_an_unmodified_client_works_under_central_noise_with_the_right_noise():
    sigma, clip = 2.0, 0.05
    strategy = DifferentialPrivacy(
        FedAvg(fraction_evaluate=0.0),
        clipping_norm=clip,
        noise_multiplier=sigma,
        sample_rate=1.0,
        min_available_nodes=M,
        noise_placement="central",
    )
    big = ArrayRecord({"w": Array(np.zeros(200_000, np.float32))})
    grid = InProcessGrid(weights_client(), M, {})
    result = strategy.start(grid, big, num_rounds=1)
    delta = result.arrays["w"].numpy()
    clipped = clip / np.sqrt(200_000)  # each client's +STEP update clipped to norm C: C/sqrt(d) per coordinate
    assert delta.mean() == pytest.approx(clipped, abs=5 * sigma * clip / M / np.sqrt(200_000))
    assert delta.std() == pytest.approx(sigma * clip / M, rel=0.01)  # N(0, sigma^2 C^2) on the sum, / m


def test_distributed_noise_refuses_a_client_without_the_mod_and_takes_it_with_the_mod():
    plain = DifferentialPrivacy(
        clipping_norm=1.0, noise_multiplier=0.5, sample_rate=1.0, min_available_nodes=M, noise_placement="distributed"
    )
    run(plain)
    record = plain.record.history[-1]
    assert record["clients"] == 0 and record["rejected"] == M
    assert all("not privatized" in p and "dp_privatize_mod" in p for p in record["problems"])
    with_mod = DifferentialPrivacy(
        clipping_norm=1.0, noise_multiplier=0.5, sample_rate=1.0, min_available_nodes=M, noise_placement="distributed"
    )
    result, _ = run(with_mod, weights_client([make_dp_privatize_mod(seed=3)]))
    assert with_mod.record.history[-1]["clients"] == M and with_mod.record.history[-1]["rejected"] == 0
    assert int(result.arrays["bn.num_batches_tracked"].numpy()) == 5


def fedadam(**kw) -> FedAdam:
    return FedAdam(fraction_evaluate=0.0, eta=0.1, eta_l=0.1, beta_1=0.9, beta_2=0.99, tau=1e-3, **kw)


@pytest.mark.parametrize(
    "make",
    [
        fedadam,
        lambda: FedYogi(fraction_evaluate=0.0, eta=0.1, eta_l=0.1, tau=1e-3),
        lambda: FedAvgM(fraction_evaluate=0.0, server_momentum=0.9),
    ],
)
def test_a_server_optimizer_steps_on_the_privatized_average(make):
    """DP-FedAdam (one line): the wrapped optimizer's output equals the same optimizer run on the DP average."""
    result, _ = run(no_noise(make()), rounds=2)
    reference = make()  # the same optimizer fed the DP average (w + STEP) directly, twice
    arrays = model()
    for rnd in (1, 2):
        list(reference.configure_train(rnd, arrays, ConfigRecord(), StubGrid()))
        moved = ArrayRecord(
            {
                k: Array(np.asarray(arrays[k].numpy() + (STEP if arrays[k].numpy().dtype.kind == "f" else 0)))
                for k in arrays.keys()
            }
        )
        arrays, _ = reference.aggregate_train(
            rnd, [reply_message(1, RecordDict({"arrays": moved, "metrics": MetricRecord({"num-examples": 1})}))]
        )
    for k in ("fc.weight", "fc.bias"):
        np.testing.assert_allclose(result.arrays[k].numpy(), arrays[k].numpy(), rtol=1e-5)
    assert not np.allclose(result.arrays["fc.weight"].numpy(), 1 + 2 * STEP)  # not plain averaging


class StubGrid:
    def get_node_ids(self):
        return [1, 2]


def test_dp_fedprox_sends_the_proximal_term_and_our_keys():
    strategy = no_noise(FedProx(fraction_evaluate=0.0, proximal_mu=0.25))
    _, grid = run(strategy)
    config = grid.sent[0].content["config"]
    assert config["proximal-mu"] == 0.25 and config[keys.CLIPPING_NORM] == 100.0
    assert len(grid.sent) == M  # every node (q = 1), whatever FedProx's own fraction_train would pick


def test_fraction_evaluate_belongs_to_the_wrapped_strategy():
    with pytest.raises(ValueError, match="fraction_evaluate"):
        DifferentialPrivacy(FedAvg(), clipping_norm=1.0, noise_multiplier=1.0, sample_rate=1.0, fraction_evaluate=0.5)
    with pytest.raises(TypeError, match="Message-API strategy"):
        DifferentialPrivacy(object(), clipping_norm=1.0, noise_multiplier=1.0, sample_rate=1.0)


def test_replies_it_cannot_interpret_are_refused_with_a_reason():
    strategy = no_noise()
    strategy.setup_population(M)
    strategy.begin_round(model())
    good = {k: model()[k].numpy() for k in model().keys()}
    bad = [
        RecordDict({"metrics": MetricRecord({"num-examples": 1})}),  # no arrays
        RecordDict({"arrays": ArrayRecord([np.ones((3, 2), np.float32)]), "metrics": MetricRecord({})}),  # 1 of 4
        RecordDict(
            {
                "arrays": ArrayRecord(
                    {**{k: Array(v) for k, v in good.items()}, "bn.num_batches_tracked": Array(np.zeros(3, np.int64))}
                ),
                "metrics": MetricRecord({}),
            }
        ),  # the counter reshaped
    ]
    arrays, metrics = strategy.aggregate_train(1, [reply_message(100 + i, c) for i, c in enumerate(bad)])
    assert metrics["rejected"] == 3 and metrics["clients"] == 0
    assert len(strategy.round.problems) == 3
    np.testing.assert_array_equal(arrays["fc.weight"].numpy(), good["fc.weight"])


@pytest.mark.parametrize("server_strategy, wrapped", [("fedadam", "FedAdam"), ("fedavgm", "FedAvgM")])
def test_the_app_runs_the_wrapper_around_the_configured_flower_strategy(tmp_path, server_strategy, wrapped):
    """`server-strategy` in the run config: the app's DP wrapper around Flower's optimizer; the model learns."""
    from dpfl.fl_app.client_app import app as client_app
    from dpfl.fl_app.config import validate
    from dpfl.fl_app.server_app import run_federated

    cfg = validate(
        {
            "dataset": "digits",
            "model": "mlp",
            "partitioner": "iid",
            "num-rounds": 4,
            "sample-rate": 1.0,
            "noise-multiplier": 0.3,
            "local-steps": 5,
            "server-strategy": server_strategy,
            "server-lr": 0.05 if server_strategy == "fedadam" else 1.0,
            "min-nodes": 5,
            "results-dir": str(tmp_path / "run"),
            "tensorboard": False,
        }
    )
    summary = run_federated(InProcessGrid(client_app, 5, cfg), cfg)
    assert summary["wrapped_strategy"] == wrapped
    assert summary["final_accuracy"] > 0.3, summary["final_accuracy"]  # 10 classes: chance is 0.1


def test_settings_that_cannot_learn_are_warned_about_at_start(caplog):
    """sigma sqrt(d) / m above 10: a warning with the ratio and the number of clients per round that fixes it."""
    from dpfl.strategies.dp_fedavg import noise_to_signal_warning

    assert noise_to_signal_warning(1.0, 25, 26010) is None  # the default job: 6.45, it learns
    warning = noise_to_signal_warning(1.0, 10, 26010)  # 10 clients a round: 16.1
    assert "16.1 times" in warning and "about 17 or more clients per round" in warning
    strategy = DifferentialPrivacy(clipping_norm=0.5, noise_multiplier=1.0, sample_rate=0.5, min_available_nodes=2)
    big = ArrayRecord({"w": Array(np.zeros(26010, np.float32))})
    with caplog.at_level("WARNING", logger="flwr"):
        strategy.start(InProcessGrid(weights_client(), 2, {}), big, num_rounds=1)
    assert sum("the model will hardly learn" in r.getMessage() for r in caplog.records) == 1  # once: m = 1


def test_sampling_returns_the_exact_64_bit_node_ids():
    """Flower's node ids are 64-bit; numpy would turn them into floats (2**64 - 3 -> 1.8446744073709552e19)
    and the sampled 'nodes' would not exist. Fixed-size sampling and the Poisson truncation pick indices."""
    ids = [2**64 - 3, 2**64 - 1001, 2**63 + 7, 2**62 + 11, 12345678901234567]
    fixed = DifferentialPrivacy(clipping_norm=1.0, noise_multiplier=1.0, sample_rate=0.6, client_sampling="fixed")
    fixed.setup_population(len(ids))
    for rnd in range(1, 20):
        sampled = fixed.sample_clients(rnd, ids)
        assert len(sampled) == 3 and set(sampled) <= set(ids) and all(type(n) is int for n in sampled)
    poisson = DifferentialPrivacy(clipping_norm=1.0, noise_multiplier=1.0, sample_rate=0.9)
    poisson.setup_population(2)  # the pool grew after the population was fixed: samples get truncated to n_s
    for rnd in range(1, 20):
        assert set(poisson.sample_clients(rnd, ids)) <= set(ids)


def metrics_client(metrics_of) -> ClientApp:
    """weights_client's update, with the metrics `metrics_of(partition id)` (a dict) in its reply."""
    app = ClientApp()
    inner = weights_client()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        reply = inner(msg, context)
        return Message(
            RecordDict(
                {
                    "arrays": reply.content["arrays"],
                    "metrics": MetricRecord(metrics_of(context.node_config["partition-id"])),
                }
            ),
            reply_to=msg,
        )

    return app


def test_a_user_fedavg_subclass_gets_the_accepted_replies_metrics_and_its_log_lines_are_printed(caplog):
    """A FedAvg subclass of the app's own (issue 39 item 11): its aggregate_train reads each reply's `train_loss`
    and logs; under the wrapper it receives one reply per accepted client, with that client's metrics and the
    privatized model, and its line is printed (Flower's own node-count lines are not)."""
    from logging import INFO

    from flwr.common import log

    seen = []

    class OwnFedAvg(FedAvg):
        def aggregate_train(self, server_round, replies):
            replies = list(replies)
            losses = [r.content["metrics"]["train_loss"] for r in replies]
            seen.append(losses)
            log(INFO, "OwnFedAvg: round %d, mean train loss %.3f", server_round, sum(losses) / len(losses))
            return super().aggregate_train(server_round, replies)

    strategy = no_noise(OwnFedAvg(fraction_evaluate=0.0))
    app = metrics_client(lambda i: {"num-examples": 10 * (i + 1), "train_loss": float(i)})
    with caplog.at_level("INFO", logger="flwr"):
        result, _ = run(strategy, app)
    assert seen == [[0.0, 1.0, 2.0, 3.0]]
    assert "OwnFedAvg: round 1, mean train loss 1.500" in caplog.text
    assert "Its own aggregate_train receives one reply per accepted client" in caplog.text  # said at start
    assert "aggregate_train: Received" not in caplog.text  # Flower's count line stays withheld
    # its weighted mean of the losses (weights 10, 20, 30, 40) reaches the Result; the model is still w + STEP
    assert result.train_metrics_clientapp[1]["train_loss"] == pytest.approx((10 * 0 + 20 + 60 + 120) / 100)
    np.testing.assert_allclose(result.arrays["fc.weight"].numpy(), 1 + STEP, rtol=1e-6)


def test_one_reply_without_num_examples_costs_only_its_own_metrics():
    """Issue 39 item 6: a reply without `num-examples` used to make Flower's averaging raise and every client
    metric of the round was dropped, `sample-epsilon-max` included; now only its own metrics are left out of the
    average, the largest sample-level epsilon counts every accepted reply, and `sample-delta` is shown."""

    def metrics_of(i: int) -> dict:
        own = {"train_loss": float(i), keys.SAMPLE_EPSILON: 1.0 + i, keys.SAMPLE_DELTA: 1e-5}
        return own if i == 3 else {"num-examples": 10, **own}  # the last node sends no num-examples

    strategy = no_noise()
    result, _ = run(strategy, metrics_client(metrics_of))
    metrics = result.train_metrics_clientapp[1]
    assert metrics["clients"] == M  # its update is averaged in (the DP average is uniform)
    assert metrics["train_loss"] == pytest.approx(1.0)  # the mean of 0, 1, 2: the other three's average
    assert metrics["sample-epsilon-max"] == 4.0 and metrics[keys.SAMPLE_DELTA] == pytest.approx(1e-5)
    problems = strategy.record.history[-1]["problems"]
    assert problems == [
        "metrics of node 103 not aggregated: metric 'num-examples' = None is not a positive finite number"
    ]


def test_failed_and_rejected_replies_get_a_warning_line_a_round_and_one_hint_when_none_is_usable(caplog):
    """Issue 39 item 11: clients without the mod under distributed noise (fl-dp-sa with only the server
    converted) used to leave normal-looking rounds and no line about the replies; now a round without a usable
    reply says how many replies failed or were rejected and why, and the first one adds a hint. A round where only
    some failed says so at DEBUG (a non-private count), at WARNING with publish_diagnostics."""
    strategy = DifferentialPrivacy(
        clipping_norm=1.0, noise_multiplier=0.5, sample_rate=1.0, min_available_nodes=M, noise_placement="distributed"
    )
    with caplog.at_level("WARNING", logger="flwr"):
        run(strategy, rounds=2)
    lines = [
        r.getMessage() for r in caplog.records if "client replies failed, were rejected or unusable" in r.getMessage()
    ]
    assert len(lines) == 2 and lines[0].startswith(
        f"Round 1: client replies failed, were rejected or unusable ({M}): {M} x "
    )
    assert "not privatized" in lines[0] and "dp_privatize_mod" in lines[0]
    assert sum(r.getMessage().startswith("No client reply of the round was usable") for r in caplog.records) == 1
    caplog.clear()
    for publish in (False, True):  # one node of four raises: its line (a warning only with publish_diagnostics)
        crashing = no_noise(publish_diagnostics=publish)
        with caplog.at_level("DEBUG", logger="flwr"):
            crashing.start(InProcessGrid(weights_client(), M, {}, fail=lambda node, msg: node == 101), model(), 1)
        line = [r for r in caplog.records if "client replies failed" in r.getMessage()]
        assert len(line) == 1 and line[0].levelname == ("WARNING" if publish else "DEBUG")
        assert (
            line[0]
            .getMessage()
            .startswith(
                "Round 1: client replies failed, were rejected or unusable (1): 1 x a node failed: RuntimeError: a node "
                "crashed"
            )
        )
        assert "No client reply of the round was usable" not in caplog.text
        caplog.clear()


def test_a_budget_stop_before_round_1_returns_the_initial_model_and_no_privacy_spent():
    """Issue 39 item 11: the Result held no arrays and privacy_spent() said epsilon 0.0."""
    strategy = DifferentialPrivacy(
        clipping_norm=1.0, noise_multiplier=0.5, sample_rate=1.0, min_available_nodes=M, target_epsilon=0.01
    )  # one round at sigma 0.5 spends far more than 0.01
    result, grid = run(strategy, rounds=3)
    assert grid.sent == [] and strategy.record.history == []
    assert list(result.arrays.keys()) == list(model().keys())
    for k in model().keys():
        np.testing.assert_array_equal(result.arrays[k].numpy(), model()[k].numpy())
    assert strategy.privacy_spent() is None
