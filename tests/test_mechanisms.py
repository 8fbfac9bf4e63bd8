"""Clipping and noise primitives: norms and standard deviations."""

import numpy as np
import pytest

from dpfl.dpcore.privacy.mechanisms import (
    NORM_CHUNK,
    clip_and_noise,
    clip_to_norm,
    distributed_noise_std,
    flatten,
    gaussian_noise,
    l2_norm,
    make_rng,
    sum_updates,
    topup_noise_std,
    unflatten,
    update_problem,
)


def std_bound(n: int) -> float:
    """5 standard errors of a sample std, relative: 5 / sqrt(2n)."""
    return 5.0 / np.sqrt(2 * n)


@pytest.mark.parametrize("scale", [0.01, 0.5, 3.0, 1e4])
def test_clip_bounds_norm_and_keeps_direction(scale):
    rng = np.random.default_rng(0)
    v = (rng.standard_normal(10_000) * scale).astype(np.float32)
    clipped, norm = clip_to_norm(v, 1.0)
    assert norm == pytest.approx(np.linalg.norm(v.astype(np.float64)), rel=1e-9)
    assert l2_norm(clipped) <= 1.0 * (1 + 1e-6)
    cos = np.dot(clipped.astype(np.float64), v) / (l2_norm(clipped) * l2_norm(v))
    assert cos == pytest.approx(1.0, abs=1e-6)
    if norm <= 1.0:
        assert np.array_equal(clipped, v)  # small updates untouched
    else:
        assert l2_norm(clipped) == pytest.approx(1.0, rel=1e-6)


def test_no_clipping_when_clip_norm_is_zero():
    v = np.full(100, 7.0, np.float32)
    assert np.array_equal(clip_to_norm(v, 0.0)[0], v)


@pytest.mark.parametrize("size", [0, 1, 1000, NORM_CHUNK, NORM_CHUNK + 1, 2 * NORM_CHUNK + 37])
def test_l2_norm_by_chunks_is_the_float64_norm(size):
    v = np.random.default_rng(size).standard_normal(size).astype(np.float32) * np.float32(1e-3)
    exact = np.sqrt(np.sum(v.astype(np.float64) ** 2))
    assert l2_norm(v) == pytest.approx(exact, rel=1e-12, abs=0.0)
    assert l2_norm(v.reshape(-1, 1)) == l2_norm(v)  # any shape: its entries
    if size <= NORM_CHUNK:  # one chunk: the float64 dot product, to the last bit
        assert l2_norm(v) == float(np.sqrt(np.dot(v.astype(np.float64), v.astype(np.float64))))


def test_sum_updates_is_numpys_sum_bit_for_bit():
    rng = np.random.default_rng(3)
    updates = [
        rng.standard_normal(5000).astype(np.float32) * np.float32(10.0**k) for k in range(-3, 4) for _ in range(5)
    ]
    assert np.array_equal(sum_updates(updates, 5000), np.sum(updates, axis=0, dtype=np.float32))
    assert sum_updates(updates, 5000).dtype == np.float32
    assert np.array_equal(sum_updates([], 7), np.zeros(7, np.float32))


def test_flatten_roundtrip():
    arrays = [np.arange(6, dtype=np.float32).reshape(2, 3), np.ones(4, np.float32), np.zeros((1, 1, 2), np.float32)]
    back = unflatten(flatten(arrays), [a.shape for a in arrays])
    assert all(np.array_equal(a, b) for a, b in zip(arrays, back))


def test_gaussian_noise_std_and_seeding():
    n, std = 200_000, 0.37
    x = gaussian_noise(n, std, make_rng(1, 2, 3))
    assert abs(x.std() / std - 1) < std_bound(n)
    assert abs(x.mean()) < 5 * std / np.sqrt(n)
    assert np.array_equal(x, gaussian_noise(n, std, make_rng(1, 2, 3)))
    assert not np.array_equal(x, gaussian_noise(n, std, make_rng(1, 2, 4)))
    assert not np.array_equal(
        gaussian_noise(10, 1, make_rng(1, secure=True)), gaussian_noise(10, 1, make_rng(1, secure=True))
    )


def test_clip_and_noise_share():
    n, C, sigma, m = 100_000, 0.5, 1.2, 16
    std = distributed_noise_std(sigma, C, m)
    assert std == pytest.approx(sigma * C / 4)
    out, norm = clip_and_noise(np.zeros(n, np.float32), C, std, make_rng(0))
    assert norm == 0.0
    assert abs(out.std() / std - 1) < std_bound(n)
    # m shares add up to sigma*C, k shares plus the top-up too
    assert np.sqrt(m * std**2) == pytest.approx(sigma * C)
    k = 9
    assert np.sqrt(k * std**2 + topup_noise_std(sigma, C, m, k) ** 2) == pytest.approx(sigma * C)
    assert topup_noise_std(sigma, C, m, m + 3) == 0.0


def test_update_problem():
    shapes = [(2, 2), (3,)]
    good = [np.zeros((2, 2), np.float32), np.zeros(3, np.float32)]
    assert update_problem(good, shapes) is None
    assert "expected 2 arrays" in update_problem(good[:1], shapes)
    assert "shape" in update_problem([np.zeros((2, 3), np.float32), good[1]], shapes)
    assert "NaN or Inf" in update_problem([good[0], np.array([0, np.nan, 0], np.float32)], shapes)
    assert "NaN or Inf" in update_problem([good[0], np.array([0, np.inf, 0], np.float32)], shapes)
    assert "dtype" in update_problem([good[0], np.zeros(3, np.int64)], shapes)
