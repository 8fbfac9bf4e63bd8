"""Haar-wavelet noise: the paper's worked example, its true noise covariance, and the ledger of DP-FedAvg-WAV."""

import logging
import math

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord
from threadpoolctl import threadpool_limits

from dpfl.dpcore.privacy.accountants import epsilon_of
from dpfl.dpcore.privacy.mechanisms import (
    flatten,
    haar_coefficients,
    haar_padded_size,
    haar_wavelet_noise,
    haar_weights,
    make_rng,
    wavelet_effective_noise_multiplier,
)
from dpfl.fl_app.client_app import app as client_app
from dpfl.fl_app.config import validate
from dpfl.fl_app.results import read_metrics
from dpfl.fl_app.server_app import run_federated
from dpfl.strategies.presets import DPFedAvgWavelet
from dpfl_tools.inprocess import InProcessGrid
from tests.independent_accountant import dp_accounting_epsilons
from tests.stub_clients import stub_app, zero_update

logging.getLogger("absl").setLevel(logging.ERROR)
torch.set_num_threads(1)


def test_paper_worked_example_table_2():
    base, top, level1, level2 = haar_coefficients([4, 8, 1, 9, 8, 4, 5, 3])
    exact = dict(rel=0, abs=1e-12)
    assert base.tolist() == pytest.approx([5.25], **exact)
    assert top.tolist() == pytest.approx([0.25], **exact)  # (5.5 - 5) / 2
    assert level1.tolist() == pytest.approx([0.5, 1.0], **exact)  # means [5.5, 5] from [6, 5, 6, 4]
    assert level2.tolist() == pytest.approx([-2.0, -4.0, 2.0, 1.0], **exact)  # (L - R) / 2 of the pairs
    # W: n for the base, block size for a detail (the paper's [8, 2, 2, 2, 2, 4, 4, 8] per level)
    assert haar_weights(8) == [8, 8, 4, 2]


def test_padding_and_exact_inverse():
    assert [haar_padded_size(d) for d in (1, 2, 5, 8, 1000, 1024, 1025)] == [2, 2, 8, 8, 1024, 1024, 2048]
    base, *_ = haar_coefficients([1, 2, 3, 4, 5])  # padded with zeros to 8
    assert base.tolist() == pytest.approx([15 / 8], rel=0, abs=1e-12)
    x = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    y = haar_wavelet_noise(x, 0.0, make_rng(0))
    assert y.shape == (1000,) and y.dtype == np.float32
    np.testing.assert_allclose(y, x, atol=1e-5)


def paper_synthesis_matrix(n):
    """Columns: the paper's Eq. 6 reconstruction x = H0 + sum_i S_i H_i, built from its definition
    (base: all ones; a detail over a block of size B: +1 on the left half, -1 on the right)."""
    columns, weights = [np.ones(n)], [n]
    block = n
    while block >= 2:
        for start in range(0, n, block):
            col = np.zeros(n)
            col[start : start + block // 2], col[start + block // 2 : start + block] = 1, -1
            columns.append(col)
            weights.append(block)
        block //= 2
    return np.stack(columns, axis=1), np.array(weights, dtype=float)


class BasisRng:
    """Stands in for the Generator: its standard normals are one basis vector of the coefficient space."""

    def __init__(self, n, i):
        self.z, self.pos = np.zeros(n, np.float32), 0
        self.z[i] = 1

    def standard_normal(self, size, dtype=np.float64):
        out = self.z[self.pos : self.pos + size].astype(dtype)
        self.pos += size
        return out


@pytest.mark.parametrize("n", [8, 64, 1024])
def test_noise_covariance_gives_effective_multiplier_sigma_h_over_sqrt_n(n):
    with threadpool_limits(1):  # multi-threaded BLAS on 2 shared cores is 10x slower
        check_noise_covariance(n)


def check_noise_covariance(n):
    sigma_h, clip = 1.7, 0.3
    S, W = paper_synthesis_matrix(n)
    cov = S @ np.diag((sigma_h * clip / W) ** 2) @ S.T  # per-coefficient std sigma_H C / W
    lam_max = np.linalg.eigvalsh(np.linalg.inv(cov)).max()
    sigma_eff = 1 / (clip * math.sqrt(lam_max))  # sensitivity C along the worst direction
    assert sigma_eff == pytest.approx(sigma_h / math.sqrt(n), rel=1e-6)
    assert wavelet_effective_noise_multiplier(sigma_h, n) == pytest.approx(sigma_eff, rel=1e-6)
    # the worst direction is the all-ones vector
    ones = np.ones(n) / math.sqrt(n)
    assert math.sqrt(ones @ cov @ ones) == pytest.approx(sigma_h * clip / math.sqrt(n), rel=1e-9)
    # Lemma 1's per-coordinate variance (2 + log2 n)/2 sigma_H^2 is wrong as well: it is
    # sigma_H^2 (1/n^2 + sum_l 4^-l), below sigma_H^2 / 3 + 1/n^2
    per_coord = (sigma_h * clip) ** 2 * (1 / n**2 + sum(4.0**-l for l in range(1, int(math.log2(n)) + 1)))
    np.testing.assert_allclose(np.diag(cov), per_coord, rtol=1e-9)
    # and the implementation (pywt + per-level weights) has exactly this covariance
    columns = [haar_wavelet_noise(np.zeros(n, np.float32), sigma_h * clip, BasisRng(n, i)) for i in range(n)]
    A = np.stack(columns, axis=1).astype(np.float64)
    np.testing.assert_allclose(A @ A.T, cov, atol=1e-6 * cov.max())


def test_sampled_noise_along_all_ones_and_a_fine_detail():
    n, sigma_h, clip, draws = 64, 2.0, 0.5, 4000
    rng = np.random.default_rng(3)
    noise = np.stack([haar_wavelet_noise(np.zeros(n, np.float32), sigma_h * clip, rng) for _ in range(draws)])
    along_ones = noise @ (np.ones(n) / math.sqrt(n))
    detail = np.zeros(n)
    detail[0], detail[1] = 1 / math.sqrt(2), -1 / math.sqrt(2)  # a level-1 detail: block 2
    along_detail = noise @ detail
    tol = 5 / math.sqrt(2 * draws)
    assert abs(along_ones.std() / (sigma_h * clip / math.sqrt(n)) - 1) < tol
    assert abs(along_detail.std() / (sigma_h * clip / math.sqrt(2)) - 1) < tol


# ---------------------------------------------------------------------------- strategy and ledger


def run_wavelet(calibration, sigma, rounds=4, dim_in=7, dim_out=8, **kwargs):
    """nn.Linear(7, 8) has 64 parameters: n = 64."""
    grid = InProcessGrid(stub_app(zero_update, dim_in, dim_out), 10, {})
    s = DPFedAvgWavelet(
        wavelet_calibration=calibration,
        sample_rate=0.3,
        clipping_norm=0.5,
        noise_multiplier=sigma,
        delta=1e-4,
        **kwargs,
    )
    arrays = ArrayRecord([np.zeros((dim_out, dim_in), np.float32), np.zeros(dim_out, np.float32)])
    result = s.start(grid, arrays, num_rounds=rounds)
    return s, result


def test_paper_ledger_charges_sigma_h_over_sqrt_n_and_warns(caplog):
    with caplog.at_level("WARNING", logger="flwr"):
        s, result = run_wavelet("paper", 8.0)
    assert s.mechanism.padded_size == 64 and s.mechanism.sigma_h(s) == 8.0
    assert s.accounted_noise_multiplier() == pytest.approx(1.0)  # 8 / sqrt(64)
    eps = result.train_metrics_clientapp[4]["epsilon"]
    eps_pld, eps_rdp = dp_accounting_epsilons(1.0, 0.3, 4, 1e-4)
    assert eps_pld * 0.99 <= eps <= eps_rdp * 1.05
    assert eps == pytest.approx(epsilon_of([(1.0, 0.3, 4)], 1e-4))
    claimed = result.train_metrics_clientapp[4]["claimed_epsilon"]
    assert claimed == pytest.approx(epsilon_of([(8.0, 0.3, 4)], 1e-4)) and claimed < eps / 10
    assert "TRUE epsilon" in caplog.text and f"{eps:.4g}" in caplog.text
    d = s.describe()
    assert d["effective_noise_multiplier"] == pytest.approx(1.0) and d["claimed_epsilon"] == claimed
    assert d["epsilon"] == eps and d["wavelet_calibration"] == "paper"


def test_exact_calibration_holds_the_configured_sigma():
    s, result = run_wavelet("exact", 1.2)
    assert s.mechanism.sigma_h(s) == pytest.approx(1.2 * 8)
    assert result.train_metrics_clientapp[4]["epsilon"] == pytest.approx(epsilon_of([(1.2, 0.3, 4)], 1e-4))


def test_exact_noise_on_the_model_update():
    """1000 -> n = 1024 (padded); per-coordinate std of the averaged noise is
    sigma sqrt(n) C sqrt(1/n^2 + sum_l 4^-l) / m."""
    sigma, clip, m = 1.0, 0.5, 3.0
    grid = InProcessGrid(stub_app(zero_update, 99, 10), 10, {})  # 990 + 10 = 1000 parameters
    s = DPFedAvgWavelet(
        wavelet_calibration="exact",
        sample_rate=0.3,
        clipping_norm=clip,
        noise_multiplier=sigma,
        client_sampling="fixed",
    )
    arrays = ArrayRecord([np.zeros((10, 99), np.float32), np.zeros(10, np.float32)])
    result = s.start(grid, arrays, num_rounds=1)
    assert s.mechanism.padded_size == 1024 and s.population.expected_clients == m
    delta = flatten(result.arrays.to_numpy_ndarrays())
    per_coord = sigma * math.sqrt(1024) * clip * math.sqrt(1 / 1024**2 + sum(4.0**-l for l in range(1, 11))) / m
    # coordinates are correlated (the coarse levels have few coefficients): the ratio has standard deviation 0.025
    # (778 effective degrees of freedom), and 0.125 is 5 of those. From the exact quadratic form (Imhof's inversion
    # and 2e7 Monte Carlo draws): P(|ratio - 1| >= 0.125) < 1e-6; at the former 0.1 it was 8e-5 (OS-entropy noise).
    assert abs(delta.std() / per_coord - 1) < 0.125
    assert s.round.server_noise_std == pytest.approx(sigma * 32 * clip)


def test_clients_clip_and_server_reports_their_norm():
    def big(pid, rnd, size):
        return np.full(size, 1.0, np.float32)  # norm 8 for 64 parameters

    grid = InProcessGrid(stub_app(big, 7, 8), 4, {})
    s = DPFedAvgWavelet(sample_rate=1.0, clipping_norm=0.5, noise_multiplier=0.0, client_sampling="fixed")
    arrays = ArrayRecord([np.zeros((8, 7), np.float32), np.zeros(8, np.float32)])
    result = s.start(grid, arrays, num_rounds=1)
    for reply in grid.received:  # what left each client has norm C
        assert np.linalg.norm(flatten(reply.content["arrays"].to_numpy_ndarrays())) == pytest.approx(0.5, rel=1e-5)
    metrics = result.train_metrics_clientapp[1]
    assert metrics["update_norm_mean"] == pytest.approx(8.0) and metrics["clipped_fraction"] == 1.0
    assert np.linalg.norm(flatten(result.arrays.to_numpy_ndarrays())) == pytest.approx(0.5, rel=1e-5)


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(wavelet_calibration="approx"), "wavelet_calibration"),
        (dict(noise_placement="distributed"), "central"),
    ],
)
def test_strategy_rejects_bad_settings(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        DPFedAvgWavelet(**(dict(sample_rate=0.5, clipping_norm=1.0, noise_multiplier=1.0) | kwargs))


def test_run_summary_reports_true_and_claimed_epsilon(tmp_path):
    cfg = validate(
        {
            "algorithm": "dp-fedavg-wav",
            "wavelet-calibration": "paper",
            "noise-placement": "central",
            "dataset": "digits",
            "model": "mlp",
            "num-rounds": 2,
            "sample-rate": 0.5,
            "local-steps": 3,
            "batch-size": 16,
            "noise-multiplier": 1.0,
            "results-dir": str(tmp_path / "wav"),
        }
    )
    summary = run_federated(InProcessGrid(client_app, 6, cfg), cfg)
    n = 16384  # 9,610 parameters
    assert summary["padded_size"] == n and summary["sigma_h"] == 1.0
    assert summary["effective_noise_multiplier"] == pytest.approx(1 / 128)
    delta = summary["delta"]
    assert delta == 1e-5  # min(1e-5, 0.01 / M)
    assert summary["claimed_epsilon"] == pytest.approx(epsilon_of([(1.0, 0.5, 2)], delta))
    # sigma 1/128: PLD on a coarser grid (an upper bound), below RDP's bound
    assert summary["epsilon"] == pytest.approx(epsilon_of([(1 / 128, 0.5, 2)], delta))
    assert summary["epsilon"] < epsilon_of([(1 / 128, 0.5, 2)], delta, "rdp")
    assert summary["epsilon"] > 100 * summary["claimed_epsilon"]
    rows = read_metrics(summary["results_dir"])
    assert [r["claimed_epsilon"] for r in rows][-1] == pytest.approx(summary["claimed_epsilon"])


def test_epsilon_is_never_negative_for_huge_sigma():
    """`exact` makes sigma_H = sigma * sqrt(n) large; Opacus' RDP conversion then goes below 0."""
    assert epsilon_of([(181.0, 0.5, 30)], 1 / 50) == 0.0
    assert epsilon_of([(20.0, 0.5, 30)], 1e-5) > 0
