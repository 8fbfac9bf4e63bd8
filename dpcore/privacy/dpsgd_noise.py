"""DP-SGD's noise multipliers and step budget (docs/algorithms.md §5 and §6), for the DP-SGD
client, the ALI-DPFL strategy and the config alike: derived once, here.
"""

from __future__ import annotations

from typing import NamedTuple

from dpfl.dpcore.privacy.accountants import DEFAULT_ACCOUNTANT
from dpfl.dpcore.privacy.ledger import PrivacyLedger

from .mechanisms import coefficient_clipping_noise_multiplier, haar_padded_size

DPSGD_NOISES = ("gaussian", "wavelet")
WAVELET_CALIBRATIONS = ("paper", "exact")
GRAD_SAMPLE_MODES = ("hooks", "ghost", "functorch", "ew")  # Opacus' per-sample gradient modes
DEFAULT_SAMPLE_DELTA = 1e-5  # sample-level delta when none is configured
MAX_LOCAL_STEPS = 100_000  # ALI-DPFL's R_c is capped here (set-up within about a second for any target)


class DPSGDNoise(NamedTuple):
    """The three multipliers of one DP-SGD configuration.

    mechanism: what the optimizer feeds to its noise (sigma, or sigma_H for DP-SGD-WAV);
    accounted: the true multiplier the ledger charges;
    budget: the multiplier the step budget R_c is computed with (the paper's claim under
        DP-SGD-WAV `paper` calibration, so that the published mechanism runs at all).
    """

    mechanism: float
    accounted: float
    budget: float

    @property
    def claims_differ(self) -> bool:
        """True when the printed (true) epsilon differs from what the paper's analysis claims."""
        return self.accounted != self.budget


def dpsgd_multipliers(
    noise_multiplier: float, noise: str = "gaussian", calibration: str = "exact", dim: int = 1
) -> DPSGDNoise:
    """The multipliers of DP-SGD (`gaussian`: sigma for all three) or DP-SGD-WAV on d = `dim` parameters.

    DP-SGD-WAV, padded to n = 2^L >= d: its true multiplier is sigma_H / n
    (`coefficient_clipping_noise_multiplier`); `exact` feeds sigma_H = sigma * n, so the true
    multiplier is sigma; `paper` feeds sigma_H = sigma as published and charges sigma / n.
    """
    if noise not in DPSGD_NOISES:
        raise ValueError(f"noise={noise!r} is not one of: {', '.join(DPSGD_NOISES)}")
    if noise == "gaussian":
        return DPSGDNoise(noise_multiplier, noise_multiplier, noise_multiplier)
    if calibration not in WAVELET_CALIBRATIONS:
        raise ValueError(f"calibration={calibration!r} is not one of: {', '.join(WAVELET_CALIBRATIONS)}")
    n = haar_padded_size(dim)
    if calibration == "exact":
        return DPSGDNoise(noise_multiplier * n, noise_multiplier, noise_multiplier)
    return DPSGDNoise(noise_multiplier, coefficient_clipping_noise_multiplier(noise_multiplier, n), noise_multiplier)


def max_local_steps(
    target_epsilon: float,
    delta: float,
    noise_multiplier: float,
    sample_rate: float,
    accountant: str = DEFAULT_ACCOUNTANT,
    limit: int = MAX_LOCAL_STEPS,
) -> int:
    """R_c (ALI-DPFL Algorithm 3): the largest number of DP-SGD steps with eps(delta) <= target, at most `limit`.

    A target that allows more than MAX_LOCAL_STEPS is planned as MAX_LOCAL_STEPS steps (each client's epsilon
    then stays below its target): the unbounded search took 20 s to minutes for targets of 1e3 and above."""
    return PrivacyLedger(delta, accountant).max_steps_within(target_epsilon, noise_multiplier, sample_rate, limit)
