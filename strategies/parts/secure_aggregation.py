"""Secure aggregation as a part of the wrapper: the server only ever sees the sum (SecAgg+, `strategies.legacy.secagg`).

It changes the "against the server" figure: under SecAgg+ that figure depends on how many noise shares reached the
sum, so it is a diagnostic (diagnostics-summary.json), not a published figure. And every round reserves the
quantizer's clip probability out of delta (`failure_probability`), for both figures.
"""

from __future__ import annotations

from dpfl.dpcore.privacy.settings import check_secure_aggregation
from dpfl.strategies.parts.part import Part


class SecureAggregation(Part):
    """The server sees only the sum of the clients' noisy updates."""

    keyword = "secure_aggregation"
    server_sees_only_the_sum = True

    def __init__(self) -> None:
        self.quantizer_clip_probability = 0.0  # set each round by DPSecAggPlusWorkflow (`strategies.legacy.secagg`)

    @classmethod
    def from_keywords(cls, keywords: dict) -> SecureAggregation | None:
        return cls() if keywords.pop("secure_aggregation", False) else None

    def check(self, privacy, others: frozenset[str]) -> None:
        check_secure_aggregation(privacy.noise_placement, privacy.clipping_norm)

    def failure_probability(self) -> float:
        """SecAgg+'s quantizer may clip a coordinate (bounded per round by DPSecAggPlusWorkflow's
        failure_probability): the sum is then not the Gaussian mechanism, so the ledger reserves it out of delta."""
        return self.quantizer_clip_probability

    def publish(self, published: frozenset[str]) -> frozenset[str]:
        return published - {"epsilon_against_server"}

    def describe(self, dp) -> dict:
        """Its per-round multipliers reveal how many shares arrived: the ledger's server part is a diagnostic."""
        return {"ledger": {**dp.ledger.state_dict(), "server": "in diagnostics-summary.json (not private)"}}

    def describe_diagnostics(self, dp) -> dict:
        return {"ledger": dp.ledger.state_dict(), "epsilon_against_server": dp.ledger.epsilon_against_server()}
