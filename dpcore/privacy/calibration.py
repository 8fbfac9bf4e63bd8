"""Calibration: the noise multiplier and delta a run is set up with, and the multipliers its releases carry.

`calibrate_noise_multiplier` finds the smallest sigma that meets a target epsilon with the accountants' own
`epsilon_of`; `default_client_delta` is delta's default; `per_update_noise_multiplier` and
`secure_sum_noise_multiplier` are the multipliers of distributed-noise releases as the server sees them.
"""

from __future__ import annotations

import math

from dpfl.dpcore.privacy.accountants import DEFAULT_ACCOUNTANT, Event, epsilon_of


def default_client_delta(num_clients: int) -> float:
    """delta = min(1e-5, 0.01 / M): the chance that the mechanism exposes any one of the M clients outright
    (delta's failure event, per client) summed over all clients stays below 1% and below 1e-5 M.
    1/M, the old default, is the boundary at which publishing one random client's data is allowed."""
    return min(1e-5, 0.01 / max(1, num_clients))


CALIBRATION_RANGE = (1e-3, 1e3)  # the noise multipliers `calibrate_noise_multiplier` searches


def calibrate_noise_multiplier(
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    accountant: str = DEFAULT_ACCOUNTANT,
    low: float = CALIBRATION_RANGE[0],
    high: float = CALIBRATION_RANGE[1],
    spent: tuple[Event, ...] | list[Event] = (),
) -> float:
    """Smallest sigma in [low, high] (to 0.01%) with eps(delta) <= target after the events already `spent` and
    `steps` (sigma, q) events: bisection on the ledger's own epsilon_of, so the ledger charges exactly what was
    calibrated."""

    def eps(sigma: float) -> float:
        return epsilon_of([*spent, (sigma, sample_rate, steps)], delta, accountant)

    if eps(high) > target_epsilon:
        raise ValueError(
            f"target_epsilon={target_epsilon!r} cannot be met with a noise multiplier <= {high:g} "
            f"(epsilon {eps(high):.4g} after {steps} steps at q={sample_rate:g}, delta={delta:g})"
        )
    lo, hi = low, high  # invariant: eps(hi) <= target (and eps(lo) > target unless lo is the answer)
    if eps(lo) <= target_epsilon:
        return lo
    while hi / lo > 1.0001:
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if eps(mid) <= target_epsilon else (mid, hi)
    return hi


def per_update_noise_multiplier(noise_multiplier: float, noise_shares: int) -> float:
    """Noise multiplier of one distributed-noise upload as the server sees it.

    Each upload carries N(0, sigma^2 C^2 / n_s) and two clipped updates differ by up to
    2C, so the release has multiplier (sigma C / sqrt(n_s)) / (2C) = sigma / (2 sqrt(n_s)).
    """
    return noise_multiplier / (2.0 * math.sqrt(noise_shares))


def secure_sum_noise_multiplier(noise_multiplier: float, shares: int, noise_shares: int) -> float:
    """Noise multiplier of a SecAgg+ sum of `shares` noise shares as the server sees it (before its top-up).

    The server chose the sample, so it knows who is in the sum: against it the relation is replace-one (a
    participant's clipped update anywhere in the C-ball), sensitivity 2C, as for a single upload
    (`per_update_noise_multiplier`), whatever the client sampling. The sum carries N(0, sigma^2 C^2 k / n_s):
    multiplier sigma sqrt(k / n_s) C / (2C) = sigma sqrt(k / n_s) / 2 (docs/privacy.md).
    """
    return noise_multiplier * math.sqrt(shares / noise_shares) / 2.0
