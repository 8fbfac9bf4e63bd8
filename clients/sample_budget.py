"""A per-client target for an Opacus client under `sample_ledger_mod` (`PrivacyEngine.make_private_with_epsilon`,
clients.opacus_ledger): the noise multiplier that ends the node's planned run at the target on its own ledger, and
the steps it may still take.

The plan: `epochs` counts the node's epochs over the whole run (every round's), T = epochs x batches DP-SGD steps at
q = 1 / batches. sigma is calibrated on the project's accountant (`dpcore.privacy.calibration`) so that
eps(target_delta) of the ledger's steps so far and the T - (steps so far) left is at most the target; a step past
them, or a plan with none left, is refused (`SampleBudgetSpent`).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from dpfl.dpcore.privacy.accountants import epsilon_of
from dpfl.dpcore.privacy.calibration import calibrate_noise_multiplier
from dpfl.dpcore.privacy.ledger import PrivacyLedger


class SampleBudgetSpent(RuntimeError):
    """A per-client target's budget is spent (`PrivacyEngine.make_private_with_epsilon` under the mod): the step, or
    the round's training, is refused, and the node's reply is an error that says so."""


@dataclass
class StepBudget:
    """The DP-SGD steps at sample rate `sample_rate` that an engine of `make_private_with_epsilon` may still take
    under the mod, and what a step past them is told."""

    steps: int
    sample_rate: float
    refusal: str

    def take(self, sample_rate: float) -> None:
        if self.steps <= 0:
            raise SampleBudgetSpent(self.refusal)
        if not math.isclose(sample_rate, self.sample_rate):
            raise SampleBudgetSpent(
                f"a DP-SGD step at sample rate {sample_rate:g}, where make_private_with_epsilon calibrated the noise "
                f"for one step per batch at {self.sample_rate:g} (gradient accumulation is not planned for)"
            )
        self.steps -= 1


def sample_budget(
    node: int, spent: PrivacyLedger, unknown: str, target_epsilon: float, target_delta: float, epochs: int, batches: int
) -> tuple[float, StepBudget]:
    """(sigma, the steps left) of a per-client target: T = epochs x batches steps at q = 1 / batches over the run.
    sigma is T's from zero (`calibrate_noise_multiplier`, the same every round) while the ledger holds only steps
    at it; else the smallest with eps(ledger's steps + the steps left at sigma) <= target. SampleBudgetSpent where
    no step is left (or the ledger is unknown: `unknown` says why). `spent`: the node's ledger, `node` its id."""
    if not (isinstance(epochs, numbers.Integral) and not isinstance(epochs, bool) and epochs >= 1):
        raise ValueError(f"epochs={epochs!r}: the node's epochs over the whole run, an integer >= 1")
    if not (isinstance(target_epsilon, (int, float)) and 0 < target_epsilon < math.inf):
        raise ValueError(f"target_epsilon={target_epsilon!r}: a number > 0")
    ledger = PrivacyLedger(target_delta, spent.accountant, list(spent.history))  # checks target_delta
    q, total, taken = 1 / batches, int(epochs) * batches, sum(n for _, _, n in ledger.history)
    plan = (
        f"target_epsilon={target_epsilon:g} at target_delta={target_delta:g} over epochs={epochs} "
        f"({epochs} x {batches} batches = {total} DP-SGD steps)"
    )
    if unknown:
        raise SampleBudgetSpent(
            f"sample_ledger_mod: node {node}'s ledger is unknown ({unknown}): {plan} cannot be kept"
        )
    if taken >= total or ledger.epsilon() >= target_epsilon:
        raise SampleBudgetSpent(
            f"sample_ledger_mod: node {node}'s budget is spent: {plan}; its ledger holds {taken} steps, epsilon "
            f"{ledger.epsilon():.4g}, so it trains no further (epochs counts the run's epochs, every round's)"
        )
    left, accountant = total - taken, ledger.accountant
    sigma = calibrate_noise_multiplier(target_epsilon, target_delta, q, total, accountant)
    if epsilon_of(ledger.history + [(sigma, q, left)], target_delta, accountant) > target_epsilon:
        sigma = calibrate_noise_multiplier(target_epsilon, target_delta, q, left, accountant, spent=ledger.history)
    refusal = (
        f"sample_ledger_mod: node {node}'s budget is spent: {plan}; this engine took the {left} steps left, "
        "a further step is not taken"
    )
    return sigma, StepBudget(left, q, refusal)
