"""DP-FedAvg-WAV (the wavelet paper's Algorithm 2; docs/algorithms.md §6).

Clients clip their update to C; the server sums the clipped updates, adds the paper's
Haar-wavelet noise with scale sigma_H * C (`dpcore.privacy.mechanisms.haar_wavelet_noise`, on the whole
model as one vector zero-padded to n = 2^L >= d), divides by m and steps.

The paper's privacy claim does not hold: the noise along the all-ones direction has std
sigma_H * C / sqrt(n), so the mechanism is a Gaussian mechanism with multiplier
sigma_eff = sigma_H / sqrt(n), and that is what the ledger charges.
- `paper`: sigma_H = the configured noise multiplier (what Algorithm 2 feeds to
  WaveletNoise and what the paper accounts); the run warns with the true epsilon and
  reports the claimed one (ledger epsilon at sigma_H) next to it.
- `exact`: sigma_H = sigma * sqrt(n), so sigma_eff = sigma and the configured epsilon holds.

`WaveletMechanism` is that noise, a part of the wrapper (the mechanism role, `strategies.parts.part`); the preset
`DPFedAvgWavelet` (`strategies.presets`) returns the wrapper composed with it from the flat keyword
`wavelet_calibration`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from logging import WARNING

import numpy as np
from flwr.app import ArrayRecord
from flwr.common import log

from dpfl.dpcore.privacy.dpsgd_noise import WAVELET_CALIBRATIONS
from dpfl.dpcore.privacy.ledger import ClientLevelLedger, PrivacyLedger
from dpfl.dpcore.privacy.mechanisms import (
    haar_padded_size,
    haar_wavelet_noise,
    make_rng,
    sum_updates,
    wavelet_effective_noise_multiplier,
)
from dpfl.dpcore.privacy.settings import one_of, require
from dpfl.strategies.parts.mechanism import NOISE_STREAM, GaussianMechanism
from dpfl.strategies.parts.noise_placement import PLACEMENTS
from dpfl.strategies.parts.part import AfterRound, Part


class WaveletMechanism(GaussianMechanism):
    """The server's Gaussian noise replaced by Haar-wavelet noise, with calibration `paper` or `exact` (see the
    module docstring). Noise placement is `central` (Algorithm 2 adds the noise at aggregation)."""

    keyword = "wavelet_calibration"
    publishes_claimed_epsilon = True  # claimed_epsilon (ledger at sigma_H) is in every round's record: no guarantee
    clients_clip_under_central_noise = True  # Algorithm 2: clients clip, the server adds the noise

    def __init__(self, calibration: str = "exact") -> None:
        one_of("wavelet_calibration", calibration, WAVELET_CALIBRATIONS)
        self.calibration = calibration
        self.dimension = 0  # d, set from the model
        self.padded_size = 0  # n = 2^L >= d
        self.claimed: PrivacyLedger | None = None  # what the paper's analysis would print
        self._warned = False

    def check(self, privacy, others: frozenset[str]) -> None:
        require(
            not PLACEMENTS[privacy.noise_placement].clients_add_noise,
            "noise_placement",
            privacy.noise_placement,
            "DP-FedAvg-WAV adds its wavelet noise at the server (Algorithm 2), so it needs noise_placement = 'central'",
        )

    # ------------------------------------------------------------------ calibration
    def see_model(self, dp, arrays: ArrayRecord) -> None:
        """Fix d and n = 2^L (the model's size cannot change during a run)."""
        dimension = sum(a.size for a in arrays.to_numpy_ndarrays())
        if self.dimension and dimension != self.dimension:
            raise ValueError(f"model size changed from {self.dimension} to {dimension}")
        self.dimension, self.padded_size = int(dimension), haar_padded_size(dimension)

    def sigma_h(self, dp) -> float:
        """sigma_H fed to the wavelet mechanism: sigma (`paper`) or sigma * sqrt(n) (`exact`)."""
        if not self.padded_size:
            raise RuntimeError("the model size is not known yet (see_model)")
        if self.calibration == "exact":
            return dp.privacy.noise_multiplier * math.sqrt(self.padded_size)
        return dp.privacy.noise_multiplier

    def accounted_noise_multiplier(self, dp) -> float:
        """sigma_eff = sigma_H / sqrt(n) (= sigma under `exact`)."""
        if self.calibration == "exact":
            return dp.privacy.noise_multiplier
        return wavelet_effective_noise_multiplier(self.sigma_h(dp), self.padded_size)

    def make_ledger(self, dp, delta: float) -> ClientLevelLedger:
        self.claimed = PrivacyLedger(delta, dp.privacy.accountant)
        return super().make_ledger(dp, delta)

    def state_dict(self) -> dict:
        return {"claimed": None if self.claimed is None else self.claimed.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.claimed = None if state["claimed"] is None else PrivacyLedger.from_state_dict(state["claimed"])

    def round_begun(self, dp) -> None:
        """`paper`: say once what the paper would claim and what the run really spends."""
        if self._warned or self.calibration != "paper" or dp.ledger is None:
            return
        self._warned = True
        rounds = max(1, dp.record.num_rounds)
        claimed = dp.ledger.epsilon_after_rounds(self.sigma_h(dp), dp.population.sample_rate, rounds)
        true = dp.ledger.epsilon_after_rounds(self.accounted_noise_multiplier(dp), dp.population.sample_rate, rounds)
        log(
            WARNING,
            "wavelet-calibration = 'paper': the paper accounts sigma_H = %.4g (epsilon %.4g after %d "
            "rounds, delta %.3g), but the wavelet noise along the all-ones direction has std "
            "sigma_H*C/sqrt(n) with n = %d: effective noise multiplier %.4g, TRUE epsilon %.4g. "
            "Use wavelet-calibration = 'exact' for the configured guarantee.",
            self.sigma_h(dp),
            claimed,
            rounds,
            dp.ledger.delta,
            self.padded_size,
            self.accounted_noise_multiplier(dp),
            true,
        )

    # ------------------------------------------------------------------ rounds
    def noisy_sum(
        self, dp, server_round: int, updates: list[np.ndarray], size: int, received: int
    ) -> tuple[np.ndarray, float]:
        """Sum of clipped updates + Haar-wavelet noise with scale sigma_H * C (all of it added here, so `received`
        does not change it)."""
        total = sum_updates(updates, size)
        scale = self.sigma_h(dp) * dp.privacy.clipping_norm
        rng = make_rng(dp.run.seed, NOISE_STREAM, server_round, secure=dp.run.secure_rng)
        return haar_wavelet_noise(total, scale, rng), scale

    def after_round(self, dp, server_round: int, accepted: list, norms: list) -> AfterRound:
        assert self.claimed is not None
        self.claimed.record(self.sigma_h(dp), dp.population.sample_rate)
        return AfterRound(record={"claimed_epsilon": self.claimed.epsilon()})

    def summary(self) -> str:
        return f"\t└──> Haar-wavelet noise, calibration={self.calibration}"

    def describe(self, dp) -> dict:
        assert self.claimed is not None
        return {
            "wavelet_calibration": self.calibration,
            "model_size": self.dimension,
            "padded_size": self.padded_size,
            "sigma_h": self.sigma_h(dp),
            "effective_noise_multiplier": self.accounted_noise_multiplier(dp),
            "claimed_epsilon": self.claimed.epsilon(),
            "privacy_note": (
                "epsilon is the true one (ledger at sigma_H/sqrt(n)); claimed_epsilon is what "
                "the paper's analysis prints (ledger at sigma_H)"
            ),
        }


class PaperClaim(Part):
    """ALI-DPFL's DP-SGD-WAV clients under `paper` calibration: the rounds publish the paper's claimed epsilon
    beside the true one, a figure that is no guarantee, so every round record marks it
    (`claimed_epsilon_is_guarantee`). `claims()`: whether the claimed and the true multiplier differ (they do once
    the model's size is known)."""

    def __init__(self, claims: Callable[[], bool]) -> None:
        self.claims = claims

    @property
    def publishes_claimed_epsilon(self) -> bool:
        return self.claims()
