"""Adaptive clipping (Andrew, Thakkar, McMahan and Ramaswamy, "Differentially Private Learning with Adaptive
Clipping", NeurIPS 2021, arXiv 1905.03871), a part the DP wrapper is composed with (docs/dp-toolbox.md §3):

    DifferentialPrivacy(FedAvg(), clipping_norm=C_0, noise_multiplier=sigma, sample_rate=q,
                        adaptive_clipping=AdaptiveClipping(target_quantile=0.5, learning_rate=0.2,
                                                           count_noise_multiplier=sigma_b))

Each round t the clipping norm C_t moves toward the gamma-quantile of the update norms:

    b_i = 1[||Delta_i|| <= C_t],   b_bar = (sum_i (b_i - 1/2) + N(0, sigma_b^2)) / m + 1/2,
    C_{t+1} = C_t * exp(-eta_C (b_bar - gamma)),

and the update noise has the multiplier of the paper's Theorem 1, sigma_Delta = (sigma^-2 - (2 sigma_b)^-2)^(-1/2),
so that the round (update sum with sensitivity C and noise sigma_Delta C, centred count with sensitivity 1/2 and noise
sigma_b) is exactly one Gaussian mechanism with multiplier sigma: the ledger charges sigma, as without adaptive
clipping. Settings with sigma_b <= sigma / 2 (sigma_Delta imaginary) are refused.

Where the bits come from follows the noise placement: `central`, the server computes b_i from the norms it measures
and adds the count noise; `distributed`, each client's mod (`clients.adaptive_clipping.clip_bit_mod`) sends
(b_i - 1/2) + N(0, sigma_b^2 / n_s) and the server tops up the shares that did not arrive, as for the update.
C_t is a DP output (a function of the noised counts): it is published per round (`clipping_norm`).
"""

from __future__ import annotations

import math

import numpy as np

from dpfl.dpcore.privacy import protocol as keys
from dpfl.dpcore.privacy.mechanisms import make_rng
from dpfl.dpcore.privacy.settings import require
from dpfl.strategies.parts.noise_placement import PLACEMENTS
from dpfl.strategies.parts.part import AfterRound, Part
from dpfl.strategies.parts.reply_rules import MetricRule

HONEST_BIT_BOUND_SIGMAS = math.sqrt(2 * math.log(1e12))  # an honest share exceeds 1/2 + this many stds w.p. <= 1e-12


def update_noise_multiplier(noise_multiplier: float, count_noise_multiplier: float) -> float:
    """sigma_Delta = (sigma^-2 - (2 sigma_b)^-2)^(-1/2) (Theorem 1 of arXiv 1905.03871)."""
    if noise_multiplier <= 0:
        return 0.0
    rest = noise_multiplier**-2 - (2.0 * count_noise_multiplier) ** -2
    if rest <= 0:
        raise ValueError(f"count_noise_multiplier={count_noise_multiplier!r} <= noise_multiplier / 2")
    return rest**-0.5


class AdaptiveClipping(Part):
    """The geometric quantile update of the clipping norm, with its noised count (a part of the wrapper)."""

    keyword = "adaptive_clipping"
    published_keys = frozenset({"clipping_norm", "clipping_norm_next", "unclipped_fraction_noisy"})  # DP outputs
    reply_rules = {keys.CLIP_BIT: MetricRule(low=-1e15, high=1e15)}

    def __init__(
        self, target_quantile: float = 0.5, learning_rate: float = 0.2, count_noise_multiplier: float = 10.0
    ) -> None:
        require(0 < target_quantile < 1, "target_quantile", target_quantile, "must be in (0, 1)")
        require(learning_rate > 0, "clip_learning_rate", learning_rate, "must be > 0")
        require(count_noise_multiplier > 0, "clip_count_noise_multiplier", count_noise_multiplier, "must be > 0")
        self.target_quantile = target_quantile
        self.learning_rate = learning_rate
        self.count_noise_multiplier = count_noise_multiplier

    def check(self, privacy, others: frozenset[str]) -> None:
        """The rules with the wrapper's settings (a strategy built from Python and a run config alike)."""
        noise_multiplier, noise_placement = privacy.noise_multiplier, privacy.noise_placement
        require(
            noise_multiplier == 0 or self.count_noise_multiplier > noise_multiplier / 2,
            "clip_count_noise_multiplier",
            self.count_noise_multiplier,
            f"must be > noise_multiplier / 2 = {noise_multiplier / 2:g} (run-config keys "
            "'clip-count-noise-multiplier' and 'noise-multiplier'): the update noise multiplier "
            "(sigma^-2 - (2 sigma_b)^-2)^(-1/2) of Theorem 1 would be imaginary",
        )
        require(
            PLACEMENTS[noise_placement].server_adds_noise,
            "noise_placement",
            noise_placement,
            "adaptive clipping (run-config key 'adaptive-clipping') needs 'central' or 'distributed' noise",
        )
        require(
            "secure_aggregation" not in others,
            "secure_aggregation",
            "secure_aggregation" in others,
            "adaptive clipping (run-config key 'adaptive-clipping') needs the clipped bits in the clear, "
            "which SecAgg+ replies do not carry",
        )
        require(
            privacy.clipping_norm > 0, "clipping_norm", privacy.clipping_norm, "adaptive clipping starts from C_0 > 0"
        )

    def update_noise_multiplier(self, noise_multiplier: float) -> float:
        """sigma_Delta of Theorem 1: the count's noise takes the rest of sigma."""
        return update_noise_multiplier(noise_multiplier, self.count_noise_multiplier)

    def client_config(self, dp, server_round: int) -> dict:
        """Noise in client shares: each client's share of the count noise."""
        if not dp.noise.noise_in_shares:
            return {}
        return {keys.CLIP_COUNT_NOISE_STD: self.count_noise_multiplier / math.sqrt(max(1, dp.population.noise_shares))}

    def reply_problem(self, dp, metrics: dict) -> str | None:
        """Noise in client shares: the noisy bit is present and within what an honest one reaches (p <= 1e-12)."""
        if not dp.noise.noise_in_shares:
            return None
        if keys.CLIP_BIT not in metrics:
            return (
                "no clipped bit: adaptive clipping under distributed noise needs "
                "dpfl.clip_bit_mod on the ClientApp's train"
            )
        bound = 0.5 + HONEST_BIT_BOUND_SIGMAS * self.count_noise_multiplier / math.sqrt(
            max(1, dp.population.noise_shares)
        )
        if abs(metrics[keys.CLIP_BIT]) > bound:
            return f"clipped bit {metrics[keys.CLIP_BIT]:.6g} outside [-{bound:.6g}, {bound:.6g}]"
        return None

    def noisy_count(
        self, server_round: int, in_shares: bool, bits: list[float], noise_shares: int, seed: int, secure: bool
    ) -> float:
        """sum_i (b_i - 1/2) + N(0, sigma_b^2): all of the noise (central) or the top-up of the missing shares."""
        if in_shares:
            std = self.count_noise_multiplier * math.sqrt(max(0, noise_shares - len(bits)) / max(1, noise_shares))
        else:
            std = self.count_noise_multiplier
        rng = make_rng(seed, 12, server_round, secure=secure)
        return float(np.sum(bits)) + float(rng.normal(0.0, std)) if std > 0 else float(np.sum(bits))

    def next_clipping_norm(
        self, clipping_norm: float, noisy_count: float, expected_clients: float
    ) -> tuple[float, float]:
        """(C_{t+1}, b_bar) from the noisy centred count."""
        b_bar = noisy_count / expected_clients + 0.5
        return clipping_norm * math.exp(-self.learning_rate * (b_bar - self.target_quantile)), b_bar

    def after_round(self, dp, server_round: int, accepted: list[tuple[np.ndarray, dict]], norms: list) -> AfterRound:
        """C_{t+1} from the noised count (after this round's noise used C_t): the wrapper's next clipping norm, and
        the round record's entries (C_t and C_{t+1} are published)."""
        used, in_shares = dp.privacy.clipping_norm, dp.noise.noise_in_shares
        if in_shares:
            bits = [float(metrics[keys.CLIP_BIT]) for _, metrics in accepted]
        else:
            bits = [(1.0 if n <= used else 0.0) - 0.5 for n in norms]
        count = self.noisy_count(
            server_round, in_shares, bits, dp.population.noise_shares, dp.run.seed, dp.run.secure_rng
        )
        following, b_bar = self.next_clipping_norm(used, count, dp.population.expected_clients)
        return AfterRound(
            record={"clipping_norm": used, "clipping_norm_next": following, "unclipped_fraction_noisy": b_bar},
            settings={"clipping_norm": following},
        )

    def describe(self, dp) -> dict:
        return {"adaptive_clipping": self.describe_settings()}

    def describe_settings(self) -> dict:
        return {
            "target_quantile": self.target_quantile,
            "clip_learning_rate": self.learning_rate,
            "clip_count_noise_multiplier": self.count_noise_multiplier,
        }
