"""ALI-DPFL: DP-SGD steps, per-client ledgers, R_c, tau* (eq. 9), weighted aggregation, end to end."""

import json
import logging
import math

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from dpfl.clients.dpsgd import DPSGDClient, dpsgd_steps, load_ledger
from dpfl.dpcore.privacy.accountants import epsilon_of
from dpfl.dpcore.privacy.dpsgd_noise import GRAD_SAMPLE_MODES, max_local_steps
from dpfl.dpcore.privacy.dpsgd_noise import GRAD_SAMPLE_MODES as CONFIG_GRAD_SAMPLE_MODES
from dpfl.dpcore.privacy.mechanisms import flatten
from dpfl.dpcore.privacy.settings import SettingError
from dpfl.dpcore.task.catalogue import ArrayDataset
from dpfl.dpcore.task.models import build_model
from dpfl.dpcore.task.torch_helpers import get_weights
from dpfl.fl_app.client_app import app as client_app
from dpfl.fl_app.config import validate
from dpfl.fl_app.results import read_metrics
from dpfl.fl_app.server_app import run_federated
from dpfl.strategies.loop.options import DPSGDOptions, SamplingOptions, ServerData
from dpfl.strategies.sample_level.ali_dpfl import ALIDPFL
from dpfl.strategies.sample_level.local_steps import estimate_mu, next_local_steps, optimal_local_steps
from dpfl_tools.inprocess import InProcessGrid
from tests.independent_accountant import dp_accounting_epsilons

logging.getLogger("absl").setLevel(logging.ERROR)
torch.set_num_threads(1)


def tiny_data(n=50, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 1, 4, 5)).astype(np.float32)
    y = rng.integers(0, 3, n).astype(np.int64)
    return ArrayDataset(x, y, 3)


def tiny_model():
    return build_model("mlp", (1, 4, 5), 3, seed=0)


def tensors(ds):
    return torch.from_numpy(ds.x), torch.from_numpy(ds.y)


# ---------------------------------------------------------------- DP-SGD steps


@pytest.mark.parametrize("mode", GRAD_SAMPLE_MODES)
def test_noise_only_steps_have_std_lr_sigma_c_over_expected_batch(mode):
    """With q -> 0 every Poisson batch is empty: the step is -lr N(0, sigma^2 C^2) / (q n)."""
    x, y = tensors(tiny_data())
    model = tiny_model()
    w0 = flatten(get_weights(model))
    q, sigma, c, lr = 1e-6, 2.0, 0.5, 1e-3
    taken = dpsgd_steps(
        model,
        x,
        y,
        steps=1,
        sample_rate=q,
        noise_multiplier=sigma,
        clipping_norm=c,
        lr=lr,
        grad_sample_mode=mode,
        noise_generator=torch.Generator().manual_seed(1),
    )
    delta = flatten(get_weights(model)) - w0
    expected = lr * sigma * c / (q * len(y))
    assert taken == 1
    assert abs(delta.std() / expected - 1) < 5 / math.sqrt(2 * delta.size)
    assert abs(delta.mean()) < 5 * expected / math.sqrt(delta.size)


@pytest.mark.parametrize("mode", GRAD_SAMPLE_MODES)
def test_without_noise_and_clipping_a_full_batch_step_is_sgd(mode):
    x, y = tensors(tiny_data())
    model, reference = tiny_model(), tiny_model()
    w0 = flatten(get_weights(model))
    dpsgd_steps(
        model, x, y, steps=1, sample_rate=1.0, noise_multiplier=0.0, clipping_norm=1e6, lr=0.5, grad_sample_mode=mode
    )
    torch.nn.functional.cross_entropy(reference(x), y).backward()
    expected = w0 - 0.5 * flatten([p.grad.numpy() for p in reference.parameters()])
    np.testing.assert_allclose(flatten(get_weights(model)), expected, atol=1e-6)


@pytest.mark.parametrize("mode", GRAD_SAMPLE_MODES)
def test_per_sample_gradient_is_clipped_to_c(mode):
    """One sample, q = 1, no noise: the step is lr * g * min(1, C / ||g||)."""
    x, y = tensors(tiny_data(1))
    reference = tiny_model()
    torch.nn.functional.cross_entropy(reference(x), y).backward()
    grad_norm = float(np.linalg.norm(flatten([p.grad.numpy() for p in reference.parameters()])))
    for c in (grad_norm / 10, grad_norm * 10):
        model = tiny_model()
        w0 = flatten(get_weights(model))
        dpsgd_steps(
            model, x, y, steps=1, sample_rate=1.0, noise_multiplier=0.0, clipping_norm=c, lr=1.0, grad_sample_mode=mode
        )
        step = np.linalg.norm(flatten(get_weights(model)) - w0)
        assert step == pytest.approx(min(c, grad_norm), rel=1e-4)


@pytest.mark.parametrize("mode", GRAD_SAMPLE_MODES)
def test_a_batch_step_clips_each_samples_own_gradient(mode):
    """q = 1, no noise, C between the per-sample norms: the step is lr * sum_s clip_C(g_s) / n, with g_s
    from a backward pass on sample s alone (clipping sees each sample's own gradient, not a scaled one)."""
    x, y = tensors(tiny_data(8))
    grads = []
    for s in range(len(y)):
        reference = tiny_model()
        torch.nn.functional.cross_entropy(reference(x[s : s + 1]), y[s : s + 1]).backward()
        grads.append(flatten([p.grad.numpy() for p in reference.parameters()]))
    norms = np.linalg.norm(grads, axis=1)
    c = float(np.median(norms))
    assert (norms < c * 0.99).any() and (norms > c * 1.01).any()
    clipped_sum = sum(g * min(1.0, c / n) for g, n in zip(grads, norms))
    model = tiny_model()
    w0 = flatten(get_weights(model))
    dpsgd_steps(
        model, x, y, steps=1, sample_rate=1.0, noise_multiplier=0.0, clipping_norm=c, lr=0.5, grad_sample_mode=mode
    )
    np.testing.assert_allclose(flatten(get_weights(model)), w0 - 0.5 * clipped_sum / len(y), atol=1e-6)


def test_config_and_client_list_the_same_grad_sample_modes():
    assert set(CONFIG_GRAD_SAMPLE_MODES) == set(GRAD_SAMPLE_MODES)


# ---------------------------------------------------------------- R_c and the client ledger


@pytest.mark.slow
@pytest.mark.parametrize(
    "target,sigma,q", [(1.0, 1.5, 0.05), (2.0, 1.0, 0.05), (4.0, 1.5, 0.1), (8.0, 1.0, 0.01), (3.0, 0.8, 0.02)]
)
def test_rc_is_the_last_step_within_the_target(target, sigma, q):
    delta = 1e-5
    r_c = max_local_steps(target, delta, sigma, q)
    assert r_c >= 1
    assert epsilon_of([(sigma, q, r_c)], delta) <= target < epsilon_of([(sigma, q, r_c + 1)], delta)
    eps_pld, _ = dp_accounting_epsilons(sigma, q, r_c, delta)
    assert eps_pld <= target * 1.001  # an independent accountant agrees (dp-accounting's finer PLD grid)
    assert epsilon_of([(sigma, q, r_c)], delta, "prv") <= target * 1.03  # and an independent implementation


def dpsgd_client(state, *, target=8.0, sigma=1.2, q=0.2, mu_noise=3.0, seed=0, delta=1e-5, **more):
    return DPSGDClient(
        tiny_model(),
        tiny_data(),
        tiny_data(10, 1),
        state=state,
        sample_rate=q,
        noise_multiplier=sigma,
        clipping_norm=1.0,
        target_epsilon=target,
        delta=delta,
        **more,
        lr=0.1,
        momentum=0.0,
        weight_decay=0.0,
        mu_max=1.0,
        mu_noise_multiplier=mu_noise,
        seed=seed,
        partition_id=3,
        secure_rng=False,
    )  # seeded: the tests compare runs


def test_client_reports_the_accountant_epsilon_of_the_steps_it_took():
    state = RecordDict()
    weights = get_weights(tiny_model())
    total = 0
    for rnd, tau in enumerate([3, 5, 2], start=1):
        _, n, metrics = dpsgd_client(state).fit(weights, {"server-round": rnd, "local-steps": tau})
        total += tau
        assert metrics["local-steps"] == tau and metrics["dpsgd-steps"] == total and n == 50
        assert metrics["epsilon"] == epsilon_of([(1.2, 0.2, total)], 1e-5)
        eps_pld, eps_rdp = dp_accounting_epsilons(1.2, 0.2, total, 1e-5)
        assert eps_pld <= metrics["epsilon"] <= eps_rdp * 1.05
    ledger, counts = load_ledger(state, 1e-5, "rdp")  # it lives in Context.state
    assert ledger.history == [(1.2, 0.2, 10)] and counts == {"steps": 10, "mu-releases": 0}


def test_a_client_refuses_a_delta_of_one_over_its_samples_or_more():
    """Issue 55 item 6, sample-level: with n = 50 samples, delta >= 1/50 guarantees nothing (publishing one sample
    whole is (0, delta)-DP): the client refuses before it trains, unless allow_large_delta; then the server marks
    the run's epsilon as no guarantee."""
    for delta in (0.9999999999999999, 1 / 50):
        with pytest.raises(SettingError) as refused:
            dpsgd_client(RecordDict(), delta=delta)
        assert str(refused.value).startswith(
            f"delta={delta!r} (run-config key 'delta'): must be < 1/M = 0.02 (M = 50 samples of this client): "
        )
    assert dpsgd_client(RecordDict(), delta=math.nextafter(1 / 50, 0)).delta < 1 / 50
    assert dpsgd_client(RecordDict(), delta=1 / 50, allow_large_delta=True).delta == 1 / 50
    options = DPSGDOptions(0.1, 1.0, 1.0, 5.0, delta=0.02, accountant="rdp", allow_large_delta=True, adaptive=False)
    flagged = ALIDPFL(dpsgd=options, sampling=SamplingOptions(1.0))
    flagged.setup_population(4)
    summary = flagged.describe()
    assert summary["epsilon_is_guarantee"] is False and summary["epsilon_caveats"][-1] == (
        "allow-large-delta: a client with n <= 1/delta = 50 samples trains at delta 0.02 >= 1/n, where publishing "
        "one of its samples whole is (0, delta)-DP: epsilon guarantees nothing for it"
    )


def test_client_never_steps_past_the_target():
    sigma, q, target = 1.2, 0.2, 5.0
    r_c = max_local_steps(target, 1e-5, sigma, q)
    assert r_c > 6
    state, weights = RecordDict(), get_weights(tiny_model())
    taken = []
    for rnd in range(1, 5):
        _, _, metrics = dpsgd_client(state, target=target).fit(weights, {"server-round": rnd, "local-steps": r_c - 3})
        taken.append(metrics["local-steps"])
        assert metrics["epsilon"] <= target
    assert taken == [r_c - 3, 3, 0, 0]
    assert metrics["budget-left"] == 0 and metrics["dpsgd-steps"] == r_c
    assert metrics["epsilon"] == epsilon_of([(sigma, q, r_c)], 1e-5)


def test_mu_release_is_charged_and_raises_epsilon():
    """Same client, same seeds, same steps: releasing mu costs exactly one Gaussian event (z, q = 1)."""
    weights = get_weights(tiny_model())
    results = {}
    for release in (False, True):
        state = RecordDict()
        update, _, metrics = dpsgd_client(state).fit(
            weights, {"server-round": 1, "local-steps": 4, "release-mu": release}
        )
        results[release] = (flatten(update), metrics)
    (u_plain, m_plain), (u_mu, m_mu) = results[False], results[True]
    np.testing.assert_array_equal(u_plain, u_mu)  # the DP-SGD part is identical
    assert "mu" not in m_plain and math.isfinite(m_mu["mu"]) and m_mu["mu-releases"] == 1
    assert m_plain["epsilon"] == epsilon_of([(1.2, 0.2, 4)], 1e-5)
    assert m_mu["epsilon"] == epsilon_of([(1.2, 0.2, 4), (3.0, 1.0, 1)], 1e-5)
    assert m_mu["epsilon"] > m_plain["epsilon"] + 0.1


# ---------------------------------------------------------------- tau* (eq. 9)


@pytest.mark.parametrize(
    "params,expected,rounded",
    [
        # s = 1*1*100/10^2 = 1; (4 + 3 + 0 + 1) / ((2 + 0.1)(1 + 1)) = 8/4.2; sqrt(1 + 1.904762) = 1.704336
        (
            dict(mu=1.0, clipping_norm=1.0, noise_multiplier=1.0, dim=100, batch_size=10, gamma=0.0, total_steps=10),
            1.704336,
            2,
        ),
        # s = 4*0.01*400/400 = 0.04; (16 + 0.03 + 500 + 0.04) / (2.02 * 0.05) = 516.07/0.101 = 5109.604;
        # sqrt(5110.604) = 71.48849
        (
            dict(mu=0.5, clipping_norm=0.1, noise_multiplier=2.0, dim=400, batch_size=20, gamma=10.0, total_steps=50),
            71.48849,
            71,
        ),
        # s = 1*0.25*10000/25 = 100; (1 + 0.75 + 2000 + 100) / (2.01 * 100.25) = 2101.75/201.5025 = 10.430391;
        # sqrt(11.430391) = 3.380886
        (
            dict(mu=2.0, clipping_norm=0.5, noise_multiplier=1.0, dim=10000, batch_size=5, gamma=5.0, total_steps=100),
            3.380886,
            3,
        ),
    ],
)
def test_tau_star_matches_hand_computed_values(params, expected, rounded):
    assert optimal_local_steps(**params) == pytest.approx(expected, rel=1e-6)
    common = {k: params[k] for k in ("mu", "clipping_norm", "noise_multiplier", "dim", "batch_size", "gamma")}
    # T = min(R_s * tau_prev, R_c): R_s = T, tau_prev = 1, R_c large
    tau, real = next_local_steps(rounds_budget=params["total_steps"], steps_budget=10**6, previous=1, **common)
    assert (tau, real) == (rounded, pytest.approx(expected, rel=1e-6))


def test_tau_is_one_whenever_rounds_budget_covers_steps_budget():
    common = dict(mu=0.5, clipping_norm=0.1, noise_multiplier=2.0, dim=400, batch_size=20, gamma=10.0)
    for r_s, r_c in ((100, 100), (200, 100), (1000, 3)):
        assert next_local_steps(rounds_budget=r_s, steps_budget=r_c, previous=7, **common)[0] == 1
    assert next_local_steps(rounds_budget=99, steps_budget=100, previous=7, **common)[0] > 1


def test_total_steps_is_min_of_rounds_times_previous_tau_and_rc():
    common = dict(mu=2.0, clipping_norm=0.5, noise_multiplier=1.0, dim=10000, batch_size=5, gamma=5.0)
    tau, real = next_local_steps(rounds_budget=5, steps_budget=100, previous=2, **common)  # T = 10
    assert real == pytest.approx(optimal_local_steps(total_steps=10, **common))
    tau, real = next_local_steps(rounds_budget=50, steps_budget=100, previous=3, **common)  # T = min(150, 100)
    assert real == pytest.approx(optimal_local_steps(total_steps=100, **common))
    assert next_local_steps(rounds_budget=5, steps_budget=100, previous=4, **{**common, "mu": math.nan}) == (
        4,
        pytest.approx(math.nan, nan_ok=True),
    )


# ---------------------------------------------------------------- strategy with stub clients


def stub_app(sizes):
    """Client i uploads the update (i + 1) e_0 and reports |D_i| = sizes[i] and one DP-SGD step."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        pid = int(context.node_config["partition-id"])
        arrays = msg.content["arrays"].to_numpy_ndarrays()
        update = [np.zeros_like(a) for a in arrays]
        update[0].flat[0] = pid + 1.0
        metrics = {
            "partition-id": pid,
            "local-steps": 1,
            "dpsgd-steps": 1,
            "num-examples": sizes[pid],
            "epsilon": epsilon_of([(1.0, 0.1, 1)], 1e-5),
        }
        if pid == 3:
            metrics["num-examples"] = 0  # malformed: rejected
        return Message(RecordDict({"arrays": ArrayRecord(update), "metrics": MetricRecord(metrics)}), reply_to=msg)

    return app


def test_models_are_averaged_with_weights_proportional_to_dataset_size():
    """Weights are the public partition sizes; a reply whose num-examples is invalid is rejected."""
    sizes = [10, 30, 60, 99]
    grid = InProcessGrid(stub_app(sizes), 4, {})
    strategy = ALIDPFL(
        dpsgd=DPSGDOptions(0.1, 1.0, 1.0, target_epsilon=5.0, adaptive=False, local_steps=2),
        sampling=SamplingOptions(1.0),
        server_data=ServerData(partition_size=lambda pid, n: sizes[pid]),
    )
    initial = ArrayRecord([np.zeros((3, 2), np.float32), np.zeros(3, np.float32)])
    result = strategy.start(grid, initial, num_rounds=1)
    new = flatten(result.arrays.to_numpy_ndarrays())
    # client 3 reported 0 examples: rejected; p = (10, 30, 60) / 100
    assert new[0] == pytest.approx(0.1 * 1 + 0.3 * 2 + 0.6 * 3)
    assert np.all(new[1:] == 0)
    metrics = result.train_metrics_clientapp[1]
    assert metrics["rejected"] == 1 and metrics["clients"] == 3 and metrics["tau"] == 2
    trained = [m for m in grid.sent if m.metadata.message_type == "train"]  # after the identity queries
    assert [m.metadata.dst_node_id for m in trained] == [100, 101, 102, 103]
    assert all(m.content["config"]["local-steps"] == 2 for m in trained)
    assert metrics["epsilon"] == pytest.approx(epsilon_of([(1.0, 0.1, 1)], 1e-5))


# ---------------------------------------------------------------- runs through the real app


def app_config(tmp_path, **overrides):
    return validate(
        {
            "algorithm": "ali-dpfl",
            "dataset": "digits",
            "model": "mlp",
            "partitioner": "iid",
            "sample-rate": 1.0,
            "batch-sample-rate": 0.1,
            "sample-noise-multiplier": 1.5,
            "sample-clipping-norm": 1.0,
            "lr": 0.5,
            "momentum": 0.0,
            "target-epsilon": 3.0,
            "results-dir": str(tmp_path),
            **overrides,
        }
    )


def test_run_stops_at_rc_and_records_tau(tmp_path):
    cfg = app_config(tmp_path, **{"num-rounds": 30, "adaptive": False, "local-steps": 20})
    r_c = max_local_steps(3.0, 1e-5, 1.5, 0.1)
    summary = run_federated(InProcessGrid(client_app, 3, cfg), cfg)
    assert summary["steps_budget"] == r_c and r_c % 20 != 0
    assert summary["tau_list"] == [20] * (r_c // 20) + [r_c % 20]
    assert "R_c" in summary["stop_reason"] and summary["local_steps_total"] == r_c
    assert [row["tau"] for row in read_metrics(tmp_path)] == summary["tau_list"]
    for eps in summary["epsilon_per_client"].values():
        assert eps == epsilon_of([(1.5, 0.1, r_c)], 1e-5) <= 3.0
    assert summary["epsilon"] == max(summary["epsilon_per_client"].values())


@pytest.mark.parametrize("mu_source", ["server", "clients"])
def test_run_ledger_charges_exactly_the_steps_and_mu_releases(tmp_path, mu_source):
    # Seeded (secure-rng = false: tau 1, 3, 3 and 1, 2, 2, the usual outcomes). With the clients' mu noise from OS
    # entropy (std 5 on a ratio clipped to [0, 1]), a round-1 estimate in (0, 0.0016) asks for tau >= 257 in round 2
    # (tau ~ 0.4 / mu), after which no client can take a step and release mu within epsilon 6: the run stopped
    # after 2 rounds in about 2.4e-4 of runs (P(0 < mu < x) ~ 0.15 x; 2 of 800 estimates fell below 0.016).
    cfg = app_config(
        tmp_path,
        **{
            "num-rounds": 3,
            "mu-source": mu_source,
            "mu-noise-multiplier": 5.0,
            "target-epsilon": 6.0,
            "secure-rng": False,
        },
    )
    summary = run_federated(InProcessGrid(client_app, 3, cfg), cfg)
    rows = read_metrics(tmp_path)
    assert len(rows) == 3 and all(math.isfinite(r["mu"]) for r in rows)
    steps = sum(summary["tau_list"])
    releases = 3 if mu_source == "clients" else 0
    expected = epsilon_of([(1.5, 0.1, steps)] + [(5.0, 1.0, releases)] * bool(releases), 1e-5)
    assert summary["epsilon"] == pytest.approx(expected) and expected <= 6.0
    if mu_source == "clients":
        assert expected > epsilon_of([(1.5, 0.1, steps)], 1e-5) + 0.1
    history = json.loads(json.dumps(summary["ledger"]))["clients"]
    assert len(history) == 3


@pytest.mark.slow
def test_end_to_end_mnist_dirichlet_005(tmp_path):
    """10 clients, Dir(0.05) (most hold one label), R_s = 20 rounds < R_c = 104 steps (eps 4).

    Seed 42 (the default) reaches 0.49. The split decides tau: other seeds' splits make
    eq. (9) jump to tau ~ 90 and end near 0.15-0.2 (docs/ali-dpfl.md), so the seed is fixed.
    The noise and the batches are seeded too (secure-rng = false: 0.493, mid-range for the unseeded runs): with
    them from OS entropy, 30 runs reached 0.483 +- 0.045 (0.42-0.58), and 0.35 is 2.9 standard deviations
    below that mean: about 2e-3 of runs would fail.
    """
    cfg = validate(
        {
            "algorithm": "ali-dpfl",
            "dataset": "mnist-embedded",
            "partitioner": "dirichlet",
            "dirichlet-alpha": 0.05,
            "num-rounds": 20,
            "sample-rate": 1.0,
            "batch-sample-rate": 0.1,
            "sample-noise-multiplier": 1.5,
            "sample-clipping-norm": 0.1,
            "lr": 5.0,
            "momentum": 0.0,
            "weight-decay": 0.0,
            "gamma": 10.0,
            "target-epsilon": 4.0,
            "secure-rng": False,
            "results-dir": str(tmp_path),
        }
    )
    summary = run_federated(InProcessGrid(client_app, 10, cfg), cfg)
    rows = read_metrics(tmp_path)
    r_c = max_local_steps(4.0, 1e-5, 1.5, 0.1)
    assert summary["steps_budget"] == r_c
    assert summary["final_accuracy"] > 0.35  # chance is 0.1; near-noiseless runs reach about 0.6 here
    assert [r["tau"] for r in rows] == summary["tau_list"] and len(rows) == summary["rounds_completed"]
    assert max(summary["tau_list"]) > 1  # R_s < R_c: eq. (9) chose more than one local step
    assert sum(summary["tau_list"]) == summary["local_steps_total"] <= r_c
    assert summary["epsilon"] <= 4.0 and all(r["epsilon"] <= 4.0 for r in rows)
    assert summary["epsilon"] == max(summary["epsilon_per_client"].values())
    assert summary["epsilon"] == epsilon_of([(1.5, 0.1, summary["local_steps_total"])], 1e-5)


def hostile_stub_app(sizes, lie: dict):
    """stub_app whose client 0 overrides its metrics with `lie` (what a malicious client would send)."""
    honest = stub_app(sizes)
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        reply = honest(msg, context)
        if int(context.node_config["partition-id"]) == 0:
            metrics = {**dict(reply.content["metrics"]), **lie}
            reply = Message(
                RecordDict({"arrays": reply.content["arrays"], "metrics": MetricRecord(metrics)}), reply_to=msg
            )
        return reply

    return app


def run_one_round(app, partition_size=None):
    strategy = ALIDPFL(
        dpsgd=DPSGDOptions(0.1, 1.0, 1.0, target_epsilon=5.0, adaptive=False, local_steps=2),
        sampling=SamplingOptions(1.0),
        server_data=ServerData(partition_size=partition_size),
    )
    initial = ArrayRecord([np.zeros((3, 2), np.float32), np.zeros(3, np.float32)])
    result = strategy.start(InProcessGrid(app, 4, {}), initial, num_rounds=1)
    return strategy, flatten(result.arrays.to_numpy_ndarrays()), result.train_metrics_clientapp[1]


def test_a_client_cannot_buy_weight_by_reporting_a_huge_dataset():
    sizes = [10, 30, 60, 99]
    _, new, metrics = run_one_round(hostile_stub_app(sizes, {"num-examples": 1e9}), lambda pid, n: sizes[pid])
    assert metrics["rejected"] == 2 and new[0] == pytest.approx((0.3 * 2 + 0.6 * 3) / 0.9)  # client 0 refused
    _, new, metrics = run_one_round(hostile_stub_app(sizes, {"num-examples": 1e9}))  # no public sizes: uniform
    assert metrics["rejected"] == 1 and new[0] == pytest.approx((1 + 2 + 3) / 3)


@pytest.mark.parametrize("lie", [{"dpsgd-steps": 10**15}, {"local-steps": 10**6, "dpsgd-steps": 10**6}])
def test_reported_step_counts_never_exceed_what_the_server_asked(lie):
    strategy, _, metrics = run_one_round(hostile_stub_app([10, 30, 60, 99], lie))
    assert strategy.spent.total_steps <= 2  # tau = 2 asked in the only round
    assert metrics["epsilon"] <= epsilon_of([(1.0, 0.1, 2)], 1e-5) + 1e-12


@pytest.mark.parametrize(
    "lie",
    [
        {"local-steps": float("nan")},
        {"num-examples": float("inf")},
        {"mu": float("nan")},
        {"partition-id": -1},
        {"num-partitions": 0},
        {"budget-left": 7},
    ],
)
def test_malformed_metrics_are_rejected_not_raised(lie):
    _, new, metrics = run_one_round(hostile_stub_app([10, 30, 60, 99], lie))
    assert metrics["rejected"] == 2 and metrics["clients"] == 2 and np.all(np.isfinite(new))


def test_a_duplicate_partition_id_binds_nothing():
    """Client 0 names partition 2 (issue 35 item 5): a partition id is not authenticated, so it takes nobody's
    place; it is accepted and charged on its own node id (the baseline rejection of the stub stays the only one)."""
    strategy, _, metrics = run_one_round(hostile_stub_app([10, 30, 60, 99], {"partition-id": 2}))
    assert metrics["rejected"] == 1 and metrics["clients"] == 3 and strategy.spent.steps_taken[100] == 1


def test_client_mu_is_clipped_on_the_server():
    strategy = ALIDPFL(
        dpsgd=DPSGDOptions(0.1, 1.0, 1.0, target_epsilon=5.0, mu_source="clients", mu_max=0.5),
        sampling=SamplingOptions(1.0),
    )
    rows = [(np.ones(3, np.float32), {"mu": 1e6}), (np.ones(3, np.float32), {"mu": -3.0})]
    assert estimate_mu(strategy, [np.zeros(3, np.float32)], [(3,)], rows, np.array([1.0, 1.0])) == pytest.approx(0.25)


def test_alidpfl_takes_its_option_objects_built_straight_from_the_settings():
    """Issue 41 item 4: ALIDPFL(strategy, *, dpsgd=, sampling=, run=, server_data=), at most 6 parameters (it took
    29 flat ones, 14 relayed to check_settings); the registry's builder makes the option objects from the typed
    Settings, and the strategy it builds holds their values."""
    import inspect

    from dpfl.fl_app.algorithms import ALGORITHMS

    assert list(inspect.signature(ALIDPFL).parameters) == ["strategy", "dpsgd", "sampling", "run", "server_data"]
    s = validate({"algorithm": "ali-dpfl", "target-epsilon": 3.0, "batch-sample-rate": 0.02, "gamma": 1.0})
    kwargs = ALGORITHMS["ali-dpfl"].strategy_kwargs(s)
    assert set(kwargs) == {"dpsgd", "sampling", "run"}
    assert kwargs["dpsgd"] == DPSGDOptions(
        0.02, s.dpsgd.noise_multiplier, s.dpsgd.clipping_norm, target_epsilon=3.0, gamma=1.0, local_steps=0
    )
    assert kwargs["sampling"] == SamplingOptions(s.federation.sample_rate, s.federation.client_sampling, 2)
    strategy = ALGORITHMS["ali-dpfl"].build_strategy(s, server_data=ServerData(gradient_fn=lambda w: w[0]))
    assert (strategy.dpsgd.batch_sample_rate, strategy.dpsgd.target_epsilon, strategy.dpsgd.gamma) == (0.02, 3.0, 1.0)
    assert strategy.run.seed == s.run.seed and strategy.run.secure_rng is s.privacy.secure_rng
    with pytest.raises(TypeError):
        ALIDPFL(sample_rate=1.0, batch_sample_rate=0.1)  # the flat form is gone
