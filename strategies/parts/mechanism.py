"""The mechanism role: how a round's sum of updates becomes its release, and what the ledger charges for it.

`GaussianMechanism` is the wrapper's default (docs/algorithms.md §0): the sum of the clipped updates plus the
server's share of N(0, sigma^2 C^2 I) as the noise placement says (all of it, the top-up for the missing client
shares, or none), divided by the fixed m, one sampled-Gaussian event per round in `ClientLevelLedger`.
DP-FTRL's tree (`strategies.parts.dp_ftrl.DPFTRL`) and the Haar-wavelet noise (`strategies.parts.wavelet.WaveletMechanism`)
fill the same role.
"""

from __future__ import annotations

import numpy as np

from dpfl.dpcore.privacy.calibration import calibrate_noise_multiplier
from dpfl.dpcore.privacy.ledger import ClientLevelLedger
from dpfl.dpcore.privacy.mechanisms import TRUNCATION_PROBABILITY, gaussian_noise, make_rng, sum_updates
from dpfl.strategies.parts.noise_placement import server_view
from dpfl.strategies.parts.part import Part, failure_probability, sees_only_the_sum

NOISE_STREAM = 2  # make_rng stream of the server's noise on the sum (seeded runs only)


class GaussianMechanism(Part):
    """The sum plus the server's Gaussian noise, over m; one sampled-Gaussian event per round."""

    roles = ("mechanism",)

    def make_ledger(self, dp, delta: float) -> ClientLevelLedger:
        """The client-level ledger of what the noise part says the server sees and the selection part says of its
        sampling."""
        view, secure = dp.noise.server_view(), sees_only_the_sum(dp)
        return ClientLevelLedger(delta, dp.privacy.accountant, view, secure, sampling=dp.selection.sampling_form)

    def ledger_from_state(self, state: dict) -> ClientLevelLedger:
        return ClientLevelLedger.from_state_dict(state, server_view(state["noise_placement"]))

    def calibrated_noise_multiplier(self, dp, ledger: ClientLevelLedger) -> float:
        """sigma whose eps(delta) after the configured rounds at the selection's q is the target (fixed-size: 2 x
        the unamplified multiplier, replace-one), delta less what sampling's truncation and the parts (SecAgg+)
        reserve each round."""
        form, rounds = dp.selection.sampling_form, max(1, dp.record.num_rounds)
        fixed = form is not None and form.fixed_size
        reserve = rounds * ((0.0 if fixed else TRUNCATION_PROBABILITY) + failure_probability(dp.parts))
        q = 1.0 if fixed else dp.population.sample_rate
        return (2.0 if fixed else 1.0) * calibrate_noise_multiplier(
            dp.privacy.target_epsilon, ledger.delta - reserve, q, rounds, dp.privacy.accountant
        )

    def accounted_noise_multiplier(self, dp) -> float:
        """The sigma the ledger charges per round."""
        return dp.privacy.noise_multiplier

    def noisy_sum(
        self, dp, server_round: int, updates: list[np.ndarray], size: int, received: int
    ) -> tuple[np.ndarray, float]:
        """(sum of the updates plus the server's noise, its std): all of it (central) or the top-up (distributed)
        for the n_s - received noise shares that did not arrive."""
        total = sum_updates(updates, size)
        std = dp.noise.server_noise_std(
            dp.update_noise_multiplier(), dp.privacy.clipping_norm, dp.population.noise_shares, received
        )
        return total + gaussian_noise(
            size, std, make_rng(dp.run.seed, NOISE_STREAM, server_round, secure=dp.run.secure_rng)
        ), std

    def release(
        self, dp, server_round: int, updates: list[np.ndarray], global_vector: np.ndarray, received: int
    ) -> tuple[np.ndarray, float]:
        """(w + eta_s * (sum_i Delta_i + server noise) / m, the std of the server's noise)."""
        aggregate, std = self.noisy_sum(dp, server_round, updates, global_vector.size, received)
        aggregate /= np.float32(dp.population.expected_clients)
        return global_vector + np.float32(dp.run.server_learning_rate) * aggregate, std
