"""ALI-DPFL's choice of the local steps tau (the ALI-DPFL paper's Algorithm 2, eq. (9); docs/algorithms.md §5)
and its strong-convexity estimate mu, as functions (the strategy, `strategies.sample_level.ali_dpfl.ALIDPFL`, calls them)."""

from __future__ import annotations

import math

import numpy as np

from dpfl.dpcore.privacy import protocol as keys
from dpfl.dpcore.privacy.mechanisms import flatten, l2_norm, unflatten


def optimal_local_steps(
    *,
    mu: float,
    clipping_norm: float,
    noise_multiplier: float,
    dim: int,
    batch_size: float,
    gamma: float,
    total_steps: float,
) -> float:
    """Eq. (9): tau* = sqrt(1 + (4/mu^2 + 3C^2 + 2 Gamma T mu + s) / ((2 + 1/T)(C^2 + s))),
    s = sigma^2 C^2 d / B^2 (the real-valued optimum, before rounding)."""
    c2 = clipping_norm**2
    s = noise_multiplier**2 * c2 * dim / batch_size**2
    numerator = 4.0 / mu**2 + 3.0 * c2 + 2.0 * gamma * total_steps * mu + s
    return math.sqrt(1.0 + numerator / ((2.0 + 1.0 / total_steps) * (c2 + s)))


def next_local_steps(
    *,
    rounds_budget: int,
    steps_budget: int,
    previous: int,
    mu: float,
    clipping_norm: float,
    noise_multiplier: float,
    dim: int,
    batch_size: float,
    gamma: float,
) -> tuple[int, float]:
    """(tau for the next round, real-valued tau* or nan) by Algorithm 2 lines 15-18.

    tau = 1 if R_s >= R_c; else eq. (9) with T = min(R_s * tau_prev, R_c), rounded half
    up, at least 1. Without a usable mu (not finite or <= 0) tau stays `previous`.
    """
    if rounds_budget >= steps_budget:
        return 1, 1.0
    if not (math.isfinite(mu) and mu > 0 and batch_size > 0):
        return previous, math.nan
    total = min(rounds_budget * previous, steps_budget)
    try:
        tau = optimal_local_steps(
            mu=mu,
            clipping_norm=clipping_norm,
            noise_multiplier=noise_multiplier,
            dim=dim,
            batch_size=batch_size,
            gamma=gamma,
            total_steps=total,
        )
    except (ZeroDivisionError, OverflowError):  # mu so small that 1/mu^2 overflows: tau* is unbounded
        tau = math.inf
    if not math.isfinite(tau) or tau >= steps_budget:  # never more than R_c (and an int, even for tau* = inf)
        return max(1, steps_budget), tau
    return max(1, math.floor(tau + 0.5)), tau


def reply_metrics_problem(metrics: dict) -> str | None:
    """Why a DP-SGD client's gated metrics are inconsistent (more steps this round than in all), else None."""
    if metrics[keys.DPSGD_STEPS] < metrics[keys.LOCAL_STEPS]:
        return f"inconsistent step counts {metrics[keys.LOCAL_STEPS]!r} / {metrics[keys.DPSGD_STEPS]!r}"
    return None


def estimate_mu(
    ali, global_arrays: list[np.ndarray], shapes: list, rows: list[tuple[np.ndarray, dict]], weights: np.ndarray
) -> float:
    """sum_i p_i ratio_i over the clients with a ratio (p renormalised over them); nan if none."""
    ratios, used = [], []
    if ali.dpsgd.mu_source == "clients":
        for (_, m), w in zip(rows, weights):
            if keys.MU in m:  # finite (reply gate); clipped here as the client should have
                ratios.append(min(max(float(m[keys.MU]), 0.0), ali.dpsgd.mu_max))
                used.append(w)
    else:
        assert ali.server_data.gradient_fn is not None
        g_global = np.asarray(ali.server_data.gradient_fn(global_arrays), dtype=np.float64)
        w_global = flatten(global_arrays)
        for (v, _), w in zip(rows, weights):
            distance = l2_norm(v)
            if distance == 0:
                continue
            g_local = np.asarray(ali.server_data.gradient_fn(unflatten(w_global + v, shapes)), dtype=np.float64)
            ratios.append(l2_norm(g_local - g_global) / distance)
            used.append(w)
    if not ratios:
        return math.nan
    return float(np.dot(np.asarray(used) / np.sum(used), ratios))
