"""The DP wrapper around Flower strategies: what it gives back has the form it was given, the wrapped
strategy's aggregation and server optimizer act on the privatized model, and replies it cannot interpret
are refused with a reason."""

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAdam, FedAvg, FedAvgM, FedProx, FedYogi

from clients.mods import make_dp_privatize_mod
from dpcore.privacy import protocol as keys
from dpfl_tools.inprocess import InProcessGrid
from strategies import DifferentialPrivacy
from strategies.wrapped import reply_message

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
    record = plain.history[-1]
    assert record["clients"] == 0 and record["rejected"] == M
    assert all("not privatized" in p and "dp_privatize_mod" in p for p in record["problems"])
    with_mod = DifferentialPrivacy(
        clipping_norm=1.0, noise_multiplier=0.5, sample_rate=1.0, min_available_nodes=M, noise_placement="distributed"
    )
    result, _ = run(with_mod, weights_client([make_dp_privatize_mod(seed=3)]))
    assert with_mod.history[-1]["clients"] == M and with_mod.history[-1]["rejected"] == 0
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
    from fl_app.client_app import app as client_app
    from fl_app.config import validate
    from fl_app.server_app import run_federated

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
    from strategies.dp_fedavg import noise_to_signal_warning

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
