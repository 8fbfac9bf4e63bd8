"""Secure aggregation as a part of the wrapper: the server only ever sees the sum (SecAgg+, `strategies.secagg`).

It changes the "against the server" figure only: under SecAgg+ that figure depends on how many noise shares
reached the sum, so it is a diagnostic (diagnostics-summary.json), not a published figure.
"""

from __future__ import annotations

from dpcore.privacy.settings import check_secure_aggregation

from .parts import Part


class SecureAggregation(Part):
    """The server sees only the sum of the clients' noisy updates."""

    keyword = "secure_aggregation"
    server_sees_only_the_sum = True

    @classmethod
    def from_keywords(cls, keywords: dict) -> SecureAggregation | None:
        return cls() if keywords.pop("secure_aggregation", False) else None

    def check(self, privacy, others: frozenset[str]) -> None:
        check_secure_aggregation(privacy.noise_placement, privacy.clipping_norm)

    def publish(self, published: frozenset[str]) -> frozenset[str]:
        return published - {"epsilon_against_server"}

    def describe(self, dp) -> dict:
        """Its per-round multipliers reveal how many shares arrived: the ledger's server part is a diagnostic."""
        return {"ledger": {**dp.ledger.state_dict(), "server": "in diagnostics-summary.json (not private)"}}

    def describe_diagnostics(self, dp) -> dict:
        return {"ledger": dp.ledger.state_dict(), "epsilon_against_server": dp.ledger.epsilon_against_server()}
