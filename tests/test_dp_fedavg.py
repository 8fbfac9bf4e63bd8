"""DPFedAvg: noise std in both placements, dropouts with top-up, clipping, rejection, budget."""

import math

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord
from torch import nn

from dpfl.dpcore.privacy.accountants import epsilon_of
from dpfl.dpcore.privacy.mechanisms import flatten
from dpfl.dpcore.privacy.settings import SettingError
from dpfl.dpcore.task.torch_helpers import get_weights
from dpfl.strategies.dp_fedavg import DPFedAvg
from dpfl_tools.inprocess import InProcessGrid
from tests.stub_clients import stub_app, zero_update

C, SIGMA = 0.5, 1.3


def initial():
    torch.manual_seed(0)
    return ArrayRecord(get_weights(nn.Linear(1000, 100)))


def run_one_round(strategy, grid, rnd=1):
    arrays = initial()
    if strategy.ledger is None:
        strategy.setup_population(len(grid.get_node_ids()))
    replies = grid.send_and_receive(strategy.configure_train(rnd, arrays, _cfg(), grid))
    new, metrics = strategy.aggregate_train(rnd, replies)
    return flatten(new.to_numpy_ndarrays()) - flatten(arrays.to_numpy_ndarrays()), metrics


def _cfg():
    from flwr.app import ConfigRecord

    return ConfigRecord()


def assert_std(sample, expected):
    n = sample.size
    assert abs(sample.std() / expected - 1) < 5 / math.sqrt(2 * n), (sample.std(), expected)
    assert abs(sample.mean()) < 5 * expected / math.sqrt(n)


@pytest.mark.parametrize("placement", ["central", "distributed"])
def test_aggregated_noise_std_is_sigma_c_over_m(placement):
    grid = InProcessGrid(stub_app(zero_update), 20, {})
    s = DPFedAvg(
        sample_rate=0.5, clipping_norm=C, noise_multiplier=SIGMA, noise_placement=placement, client_sampling="fixed"
    )
    delta, metrics = run_one_round(s, grid)
    m = 10
    assert metrics["clients"] == m and s.population.expected_clients == m
    assert_std(delta, SIGMA * C / m)
    # in distributed mode the server adds nothing when all m shares arrived
    assert s.round.server_noise_std == (SIGMA * C if placement == "central" else 0.0)


def test_distributed_dropouts_are_topped_up():
    dead = {100, 101, 102, 103}
    grid = InProcessGrid(stub_app(zero_update), 10, {}, fail=lambda node, msg: node in dead)
    s = DPFedAvg(
        sample_rate=1.0, clipping_norm=C, noise_multiplier=SIGMA, noise_placement="distributed", client_sampling="fixed"
    )
    delta, metrics = run_one_round(s, grid)
    assert metrics["failures"] == 4 and metrics["clients"] == 6
    assert s.round.server_noise_std == pytest.approx(SIGMA * C * math.sqrt(4 / 10))
    assert_std(delta, SIGMA * C / 10)


def test_poisson_sampling_rate():
    grid = InProcessGrid(stub_app(zero_update), 200, {})
    s = DPFedAvg(sample_rate=0.2, clipping_norm=C, noise_multiplier=1.0, secure_rng=False)
    s.setup_population(200)
    counts = [len(s.sample_clients(r, list(grid.get_node_ids()))) for r in range(1, 101)]
    # Binomial(200, 0.2) per round: mean 40, sd of the mean over 100 rounds ~0.57
    assert abs(np.mean(counts) - 40) < 3
    assert len(set(counts)) > 5  # it really varies
    assert s.sample_clients(7, list(range(200))) == s.sample_clients(7, list(range(200)))  # seeded: reproducible
    secure = DPFedAvg(sample_rate=0.2, clipping_norm=C, noise_multiplier=1.0)  # the default: OS entropy
    assert secure.sample_clients(7, list(range(200))) != secure.sample_clients(7, list(range(200)))


def test_central_clipping_and_uniform_average():
    def big(pid, rnd, size):  # every client: norm 10 along the first axis
        v = np.zeros(size, np.float32)
        v[0] = 10.0 * (pid + 1)
        return v

    grid = InProcessGrid(stub_app(big), 8, {})
    s = DPFedAvg(sample_rate=0.5, clipping_norm=C, noise_multiplier=0.0, client_sampling="fixed")
    delta, metrics = run_one_round(s, grid)
    # 4 clients, each clipped to C along e_0, divided by m = 4
    assert delta[0] == pytest.approx(C, rel=1e-6)
    assert np.all(delta[1:] == 0)
    assert metrics["clipped_fraction"] == 1.0
    assert metrics["update_norm_mean"] > 10


def test_distributed_client_clips_before_upload():
    def big(pid, rnd, size):
        return np.full(size, 1.0, np.float32)

    grid = InProcessGrid(stub_app(big), 4, {})
    s = DPFedAvg(
        sample_rate=1.0, clipping_norm=C, noise_multiplier=1e-9, noise_placement="distributed", client_sampling="fixed"
    )
    delta, metrics = run_one_round(s, grid)
    assert np.linalg.norm(delta) == pytest.approx(C, rel=1e-4)  # average of 4 identical clipped updates
    assert metrics["update_norm_mean"] == pytest.approx(math.sqrt(delta.size), rel=1e-5)
    for reply in grid.received:  # what left each client has norm <= C (+ tiny noise)
        assert np.linalg.norm(flatten(reply.content["arrays"].to_numpy_ndarrays())) <= C * (1 + 1e-4)


@pytest.mark.parametrize("bad", ["nan", "inf", "shape"])
def test_malformed_updates_are_rejected_not_averaged(bad):
    def update(pid, rnd, size):
        v = np.full(size, 0.01, np.float32)
        if pid == 0 and bad in ("nan", "inf"):
            v[3] = np.nan if bad == "nan" else np.inf
        return v

    app = stub_app(update)
    if bad == "shape":
        inner = app

        def app(msg, ctx):  # node 100 sends an extra array
            reply = inner(msg, ctx)
            if ctx.node_config["partition-id"] == 0:
                arrays = reply.content["arrays"].to_numpy_ndarrays() + [np.zeros(3, np.float32)]
                reply.content["arrays"] = ArrayRecord(arrays)
            return reply

    grid = InProcessGrid(app, 5, {})
    s = DPFedAvg(sample_rate=1.0, clipping_norm=10.0, noise_multiplier=0.0, client_sampling="fixed")
    delta, metrics = run_one_round(s, grid)
    assert metrics["rejected"] == 1 and metrics["clients"] == 4
    assert np.all(np.isfinite(delta))
    assert delta[3] == pytest.approx(0.01 * 4 / 5)  # fixed denominator m = 5


def run_rounds(strategy, num_nodes, rounds):
    grid = InProcessGrid(stub_app(zero_update, 10, 2), num_nodes, {})
    return strategy.start(
        grid, ArrayRecord([np.zeros((2, 10), np.float32), np.zeros(2, np.float32)]), num_rounds=rounds
    )


def test_epsilon_every_round_matches_accountant():
    s = DPFedAvg(sample_rate=0.2, clipping_norm=C, noise_multiplier=1.1, delta=1e-3)
    result = run_rounds(s, 20, 6)
    eps = [result.train_metrics_clientapp[r]["epsilon"] for r in range(1, 7)]
    assert all(b > a for a, b in zip(eps, eps[1:]))
    for r, e in enumerate(eps, start=1):
        assert e == pytest.approx(epsilon_of([(1.1, 0.2, r)], 1e-3))
    assert s.describe()["num_clients"] == 20 and s.describe()["delta"] == 1e-3


@pytest.mark.parametrize("population,delta", [(8, 1e-5), (5000, 2e-6)])
def test_default_delta_is_far_below_one_over_the_population(population, delta):
    s = DPFedAvg(sample_rate=0.5, clipping_norm=C, noise_multiplier=1.0)
    s.setup_population(population)
    assert s.ledger.delta == pytest.approx(delta)  # min(1e-5, 0.01 / M)


ZEROS = [np.zeros((2, 10), np.float32), np.zeros(2, np.float32)]


@pytest.mark.parametrize("delta", [0.9999999999999999, 1 / 7])
def test_a_delta_of_one_over_the_population_or_more_is_refused_before_anything_is_sent(delta):
    """Issue 55 item 6: with delta >= 1/M, publishing one of the M clients whole is (0, delta)-DP (delta 1 - 1e-16
    printed epsilon 0.0 as a guarantee): refused when M is known, before round 1 sends anything."""
    s = DPFedAvg(sample_rate=0.5, clipping_norm=C, noise_multiplier=1.0, delta=delta)
    grid = InProcessGrid(stub_app(zero_update, 10, 2), 7, {})
    with pytest.raises(SettingError) as refused:
        s.start(grid, ArrayRecord(ZEROS), num_rounds=1)
    assert str(refused.value) == (
        f"delta={delta!r} (run-config key 'delta'): must be < 1/M = 0.142857 (M = 7 clients): with delta >= 1/M, "
        "publishing one of the M whole is (0, delta)-DP, so epsilon guarantees nothing. Set a smaller delta (0: the "
        "default), or allow_large_delta (run-config key 'allow-large-delta') = true to publish the figure marked as "
        "no guarantee"
    )
    assert grid.sent == [] and s.record.history == []


def test_a_delta_just_below_one_over_the_population_is_a_guarantee():
    delta = math.nextafter(1 / 7, 0)
    s = DPFedAvg(sample_rate=0.5, clipping_norm=C, noise_multiplier=1.0, delta=delta)
    run_rounds(s, 7, 1)
    assert s.ledger.epsilon() == epsilon_of([(1.0, 0.5, 1)], delta)
    assert s.describe()["epsilon_is_guarantee"] is True and s.describe()["epsilon_caveats"] == []


def test_allow_large_delta_publishes_the_figure_marked_as_no_guarantee():
    delta = 0.9999999999999999
    s = DPFedAvg(sample_rate=0.5, clipping_norm=C, noise_multiplier=1.0, delta=delta, allow_large_delta=True)
    result = run_rounds(s, 7, 2)
    summary = s.describe()
    assert summary["epsilon"] == epsilon_of([(1.0, 0.5, 2)], delta) == result.train_metrics_clientapp[2]["epsilon"]
    assert summary["epsilon_is_guarantee"] is False
    assert summary["epsilon_caveats"] == [
        "delta = 1 >= 1/M = 0.142857 (M = 7 clients), accepted by allow-large-delta: publishing one of the M whole "
        "is (0, delta)-DP, so epsilon guarantees nothing"
    ]
    assert [r["epsilon_is_guarantee"] for r in s.record.history] == [False, False]  # every round's record says so


def test_allow_large_delta_is_a_run_config_key_that_reaches_the_strategy():
    from dpfl.fl_app.algorithms import ALGORITHMS
    from dpfl.fl_app.config import validate

    settings = validate({"algorithm": "dp-fedavg", "delta": 0.5, "allow-large-delta": True})
    strategy = ALGORITHMS["dp-fedavg"].build_strategy(settings)
    assert strategy.privacy.allow_large_delta is True and strategy.privacy.delta == 0.5
    assert validate({}).privacy.allow_large_delta is False


def test_target_epsilon_stop_never_exceeds():
    s = DPFedAvg(sample_rate=0.5, clipping_norm=C, noise_multiplier=1.0, delta=1e-3, target_epsilon=3.0)
    result = run_rounds(s, 10, 50)
    done = len(s.record.history)
    assert 1 <= done < 50 and "target epsilon" in s.record.stop_reason
    assert s.ledger.epsilon() <= 3.0 < epsilon_of([(1.0, 0.5, done + 1)], 1e-3)
    assert max(result.train_metrics_clientapp) == done


def test_target_epsilon_calibrate():
    s = DPFedAvg(
        sample_rate=0.5,
        clipping_norm=C,
        noise_multiplier=0.1,
        delta=1e-3,
        target_epsilon=4.0,
        target_epsilon_mode="calibrate",
    )
    run_rounds(s, 10, 12)
    assert len(s.record.history) == 12
    assert 3.95 <= s.ledger.epsilon() <= 4.0
    assert s.privacy.noise_multiplier > 0.1


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(sample_rate=0.0), "sample_rate"),
        (dict(noise_multiplier=1.0, clipping_norm=0.0), "clipping_norm"),
        (dict(noise_placement="nowhere"), "noise_placement"),
        (dict(client_sampling="uniform"), "client_sampling"),
        (dict(target_epsilon_mode="x"), "target_epsilon_mode"),
    ],
)
def test_strategy_rejects_bad_settings(kwargs, needle):
    args = dict(sample_rate=0.1, clipping_norm=1.0, noise_multiplier=1.0) | kwargs
    with pytest.raises(ValueError, match=needle):
        DPFedAvg(**args)


@pytest.mark.parametrize("secure_rng", [True, False])
def test_regenerating_the_noise_from_the_seed_recovers_nothing_by_default(secure_rng):
    """The attack of a server that knows the run config: regenerate the client's noise share from 'seed'
    and subtract it. With the default (OS entropy) the residual is the full noise; seeded noise
    (secure_rng=False, which the summary marks as no guarantee) gives the clipped update away."""
    from dpfl.clients.base import TrainingClient
    from dpfl.dpcore.privacy.mechanisms import clip_to_norm, gaussian_noise, make_rng

    update = np.random.default_rng(1).standard_normal(10_000).astype(np.float32)
    client = TrainingClient(torch.nn.Linear(2, 2), [], [], seed=42, partition_id=3, secure_rng=secure_rng)
    config = {"privatize": True, "clipping-norm": C, "noise-std": 0.05, "server-round": 5}
    upload, _ = client.privatize(update, config)
    regenerated = gaussian_noise(update.size, 0.05, make_rng(42, 3, 5, 3))
    error = np.linalg.norm(upload - regenerated - clip_to_norm(update, C)[0])
    if secure_rng:
        assert error > 0.05 * np.sqrt(update.size) * 0.9 * np.sqrt(2)  # two independent noises remain
    else:
        assert error < 1e-4
    strategy = DPFedAvg(sample_rate=0.5, clipping_norm=C, noise_multiplier=1.0, secure_rng=secure_rng)
    strategy.setup_population(4)
    assert strategy.describe()["epsilon_is_guarantee"] is secure_rng
