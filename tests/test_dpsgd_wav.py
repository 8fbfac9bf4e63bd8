"""DP-SGD-WAV: Haar-coefficient clipping, its derived sensitivity (sigma_H / n), the client ledger."""

import math

import numpy as np
import pytest
import torch
from flwr.app import RecordDict

from dpfl.clients.dpsgd import DPSGDClient, dpsgd_steps
from dpfl.dpcore.privacy.accountants import epsilon_of
from dpfl.dpcore.privacy.dpsgd_noise import dpsgd_multipliers, max_local_steps
from dpfl.dpcore.privacy.mechanisms import (
    coefficient_clipping_noise_multiplier,
    flatten,
    haar_coefficient_norm,
    haar_coefficient_norms,
    haar_coefficients,
    haar_padded_size,
    haar_wavelet_noise,
    haar_weights,
    make_rng,
)
from dpfl.dpcore.task.torch_helpers import get_weights
from dpfl.fl_app.client_app import app as client_app
from dpfl.fl_app.config import validate
from dpfl.fl_app.server_app import run_federated
from dpfl_tools.inprocess import InProcessGrid
from tests.test_ali_dpfl import tensors, tiny_data, tiny_model

torch.set_num_threads(1)


def test_coefficient_norm_of_the_papers_worked_example():
    # base 5.25; block 8: (5.5 - 5)/2; block 4: (6 - 5)/2, (6 - 4)/2; block 2: -2, -4, 2, 1
    expected = math.sqrt(5.25**2 + 0.25**2 + 0.5**2 + 1**2 + 2**2 + 4**2 + 2**2 + 1**2)
    assert haar_coefficient_norm(np.array([4, 8, 1, 9, 8, 4, 5, 3], float)) == pytest.approx(expected)  # 7.3400
    rows = np.random.default_rng(0).standard_normal((11, 37))  # batched, in chunks, padded to 64
    np.testing.assert_allclose(
        haar_coefficient_norms(rows, chunk=4),
        [np.sqrt(sum(c @ c for c in haar_coefficients(r))) for r in rows],
        rtol=1e-12,
    )


def paper_transform(n):
    """T with H = T g (the paper's coefficients, in pywt's order) and the weight W of every row."""
    rows = np.stack([np.concatenate(haar_coefficients(e)) for e in np.eye(n)], axis=1)
    weights = np.concatenate([[w] * c.size for w, c in zip(haar_weights(n), haar_coefficients(np.zeros(n)))])
    return rows, weights.astype(float)


@pytest.mark.parametrize("n", [8, 16, 64])
def test_coefficient_clipping_sensitivity_gives_multiplier_sigma_over_n(n):
    """Covariance of the wavelet noise in H-space is sigma^2 C^2 / W^2; the worst whitened shift of
    norm C is n / sigma, i.e. noise multiplier sigma / n (the paper claims sigma)."""
    sigma, c = 1.3, 0.7
    transform, weights = paper_transform(n)
    # the noise haar_wavelet_noise adds, seen in H-space, has std sigma C / W per coefficient
    rng = make_rng(0, 1)
    draws = np.stack([transform @ haar_wavelet_noise(np.zeros(n), sigma * c, rng) for _ in range(3000)])
    ratio = draws.std(axis=0) / (sigma * c / weights)
    assert np.all(np.abs(ratio - 1) < 5 / math.sqrt(2 * 3000))
    # largest whitened sensitivity over the clipping ball ||h||_2 <= C in H-space
    inverse_cov = np.diag(weights**2 / (sigma * c) ** 2)
    worst = c * math.sqrt(np.linalg.eigvalsh(inverse_cov).max())
    assert worst == pytest.approx(n / sigma)
    assert coefficient_clipping_noise_multiplier(sigma, n) == pytest.approx(1 / worst)
    # that worst case is a real gradient: a constant vector, clipped to coefficient norm C, has norm C sqrt(n)
    g = np.full(n, 5.0)
    clipped = g * min(1.0, c / haar_coefficient_norm(g))
    assert haar_coefficient_norm(clipped) == pytest.approx(c)
    assert np.linalg.norm(clipped) == pytest.approx(c * math.sqrt(n))
    # and the mechanism's output moves by n / sigma noise standard deviations along it
    shift = (transform @ clipped)[0]
    assert shift / (sigma * c / n) == pytest.approx(n / sigma)


def test_wavelet_step_clips_the_coefficient_norm_not_the_gradient_norm():
    x, y = tensors(tiny_data(1))
    reference = tiny_model()
    torch.nn.functional.cross_entropy(reference(x), y).backward()
    g = flatten([p.grad.numpy() for p in reference.parameters()])
    g_norm, h_norm = np.linalg.norm(g), haar_coefficient_norm(g)
    assert h_norm < g_norm / math.sqrt(2) + 1e-6  # W >= 2 for every coefficient
    for c, expected in ((0.5 * (h_norm + g_norm), g_norm), (h_norm / 4, g_norm / 4)):
        model = tiny_model()
        w0 = flatten(get_weights(model))
        dpsgd_steps(
            model,
            x,
            y,
            steps=1,
            sample_rate=1.0,
            noise_multiplier=0.0,
            clipping_norm=c,
            lr=1.0,
            grad_sample_mode="hooks",
            noise="wavelet",
        )
        assert np.linalg.norm(flatten(get_weights(model)) - w0) == pytest.approx(expected, rel=1e-4)


def test_wavelet_noise_only_step_has_std_sigma_c_over_w_per_coefficient():
    x, y = tensors(tiny_data())
    model = tiny_model()
    w0 = flatten(get_weights(model))
    q, sigma_h, c, lr = 1e-6, 2.0, 0.5, 1e-3
    dpsgd_steps(
        model,
        x,
        y,
        steps=1,
        sample_rate=q,
        noise_multiplier=sigma_h,
        clipping_norm=c,
        lr=lr,
        grad_sample_mode="hooks",
        noise="wavelet",
        wavelet_rng=make_rng(0, 2),
    )
    step = (flatten(get_weights(model)) - w0) / (-lr / (q * len(y)))  # the noise added to the sum
    n = haar_padded_size(step.size)
    finest, second = haar_coefficients(step)[-1], haar_coefficients(step)[-2]
    full = step.size // 2  # finest-level coefficients over real (unpadded) entries
    for coeffs, w in ((finest[:full], 2), (second[: step.size // 4], 4)):
        assert abs(coeffs.std() / (sigma_h * c / w) - 1) < 5 / math.sqrt(2 * coeffs.size)
    assert n == 4096


def wav_client(state, calibration, target=8.0):
    return DPSGDClient(
        tiny_model(),
        tiny_data(),
        tiny_data(10, 1),
        state=state,
        sample_rate=0.2,
        noise_multiplier=1.2,
        clipping_norm=1.0,
        target_epsilon=target,
        delta=1e-5,
        lr=0.1,
        momentum=0.0,
        weight_decay=0.0,
        noise="wavelet",
        wavelet_calibration=calibration,
        grad_sample_mode="hooks",
    )


def test_wavelet_client_ledger_charges_the_true_multiplier():
    d = sum(p.numel() for p in tiny_model().parameters())
    n = haar_padded_size(d)
    assert dpsgd_multipliers(1.2, "wavelet", "exact", d) == (1.2 * n, 1.2, 1.2)
    assert dpsgd_multipliers(1.2, "wavelet", "paper", d) == (1.2, 1.2 / n, 1.2)
    weights = get_weights(tiny_model())
    _, _, exact = wav_client(RecordDict(), "exact").fit(weights, {"server-round": 1, "local-steps": 5})
    assert exact["epsilon"] == epsilon_of([(1.2, 0.2, 5)], 1e-5) and "epsilon-claimed" not in exact
    # paper: steps stop on the claimed budget; the ledger (and the report) carry the true epsilon
    r_c = max_local_steps(8.0, 1e-5, 1.2, 0.2)
    _, _, paper = wav_client(RecordDict(), "paper").fit(weights, {"server-round": 1, "local-steps": r_c + 5})
    assert paper["local-steps"] == r_c
    assert paper["epsilon-claimed"] == epsilon_of([(1.2, 0.2, r_c)], 1e-5) <= 8.0
    assert paper["epsilon"] == epsilon_of([(1.2 / n, 0.2, r_c)], 1e-5) > 1000


@pytest.mark.parametrize("calibration", ["exact", "paper"])
def test_wavelet_run_reports_true_and_claimed_epsilon(tmp_path, calibration):
    cfg = validate(
        {
            "algorithm": "ali-dpfl",
            "dataset": "digits",
            "model": "mlp",
            "partitioner": "iid",
            "sample-rate": 1.0,
            "batch-sample-rate": 0.1,
            "sample-noise-multiplier": 1.5,
            "target-epsilon": 3.0,
            "num-rounds": 2,
            "adaptive": False,
            "local-steps": 3,
            "dpsgd-noise": "wavelet",
            "wavelet-calibration": calibration,
            "results-dir": str(tmp_path),
        }
    )
    summary = run_federated(InProcessGrid(client_app, 2, cfg), cfg)
    n = haar_padded_size(summary["num_parameters"])
    true_sigma = 1.5 if calibration == "exact" else 1.5 / n
    assert summary["accounted_noise_multiplier"] == pytest.approx(true_sigma)
    assert summary["epsilon"] == pytest.approx(epsilon_of([(true_sigma, 0.1, 6)], 1e-5))
    if calibration == "paper":
        assert summary["claimed_epsilon"] == pytest.approx(epsilon_of([(1.5, 0.1, 6)], 1e-5))
        assert summary["epsilon"] > 1000 * summary["claimed_epsilon"]
    else:
        assert "claimed_epsilon" not in summary and summary["epsilon"] <= 3.0
