"""ALI-DPFL's choice of the local steps tau (the ALI-DPFL paper's Algorithm 2, eq. (9); docs/algorithms.md §5)
and its strong-convexity estimate mu: the schedule the strategy holds (`LocalIterations`: R_c, tau, d) and functions
of the strategy (`strategies.sample_level.ali_dpfl.ALIDPFL`) that read it with R_s, the options and what the clients
have spent."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from logging import WARNING

import numpy as np
from flwr.common import log

from dpfl.dpcore.privacy import protocol as keys
from dpfl.dpcore.privacy.mechanisms import flatten, haar_padded_size, l2_norm, unflatten


@dataclass
class LocalIterations:
    """The schedule of local DP-SGD steps: tau_0 (`initial`), R_c (`steps_budget`, set with the population), the
    tau of the next round, the tau of every round so far, and d, the model's size (0 until the first round)."""

    initial: int
    steps_budget: int = 0
    tau: int = 0
    tau_list: list[int] = field(default_factory=list)
    dimension: int = 0

    def __post_init__(self) -> None:
        self.tau = self.tau or self.initial

    def state_dict(self) -> dict:
        return {"steps_budget": self.steps_budget, "tau": self.tau, "tau_list": self.tau_list}

    def load_state_dict(self, state: dict) -> None:
        self.steps_budget, self.tau = int(state["steps_budget"]), int(state["tau"])
        self.tau_list = [int(t) for t in state["tau_list"]]


def round_local_steps(ali) -> int:
    """tau for this round, never more than the steps left to R_c."""
    return max(1, min(ali.schedule.tau, ali.schedule.steps_budget - ali.spent.total_steps))


def needs_mu(ali) -> bool:
    """Eq. (9) needs mu while R_s < R_c (else tau = 1, Lemma 1)."""
    return ali.dpsgd.adaptive and ali.record.num_rounds < ali.schedule.steps_budget


def releases_mu(ali) -> bool:
    """Whether the clients release a noised mu this round (mu_source = clients)."""
    return needs_mu(ali) and ali.dpsgd.mu_source == "clients"


def next_tau(ali, mu: float, dim: int) -> tuple[int, float]:
    """(tau of the next round, the real-valued tau*): eq. (9) when adaptive, else tau_0."""
    d, schedule = ali.dpsgd, ali.schedule
    if not d.adaptive:
        return schedule.initial, math.nan
    return next_local_steps(
        rounds_budget=ali.record.num_rounds,
        steps_budget=schedule.steps_budget,
        previous=schedule.tau,
        mu=mu,
        clipping_norm=d.sample_clipping_norm,
        noise_multiplier=d.sample_noise_multiplier,
        dim=dim,
        batch_size=d.batch_sample_rate * min(ali.spent.dataset_sizes.values(), default=0),
        gamma=d.gamma,
    )


def set_dimension(ali, dim: int) -> None:
    """d, on which DP-SGD-WAV's true multiplier depends; under `paper` calibration a warning the first time."""
    first, ali.schedule.dimension = ali.schedule.dimension == 0, dim
    if first and ali.noise.claims_differ:
        log(
            WARNING,
            "DP-SGD-WAV with wavelet-calibration = 'paper': coefficient-domain clipping makes the "
            "true noise multiplier sigma_H / n = %.3g (n = %d), not %.3g; clients stop on the "
            "paper's claimed epsilon, the run reports the TRUE epsilon. Use 'exact' for the "
            "configured guarantee.",
            ali.noise.accounted,
            haar_padded_size(dim),
            ali.dpsgd.sample_noise_multiplier,
        )


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
