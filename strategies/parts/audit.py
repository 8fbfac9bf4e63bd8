"""The canary audit as a part of the wrapper (`dpcore.privacy.audit`; Andrew et al., arXiv 2302.03098).

K canary clients, each sampled with probability q per round like a client, add C * u_i to the sum; K more
directions are never inserted; the one-shot estimate from the model delta is in `describe()["audit"]`.
"""

from __future__ import annotations

import numpy as np
from flwr.app import ArrayRecord

from dpfl.dpcore.privacy.audit import CANARY_KINDS, audit_epsilon, canary_direction, new_canary_seed
from dpfl.dpcore.privacy.mechanisms import flatten, make_rng
from dpfl.dpcore.privacy.settings import one_of, require
from dpfl.strategies.parts.part import Part

CANARY_STREAM = 9  # make_rng stream of which canaries a round inserts (seeded runs only)


class AuditCanaries(Part):
    """K canaries (`canaries` >= 2) of kind "isotropic" (the paper's random directions) or "smooth" (coarse
    Haar directions)."""

    keyword = "audit_canaries"

    def __init__(self, canaries: int, kind: str = "isotropic", *, seed: int = 0, secure_rng: bool = True) -> None:
        require(
            canaries >= 2,
            "audit_canaries",
            canaries,
            "must be 0 (no audit) or >= 2 (the null cosines' spread needs two)",
        )
        one_of("audit_canary_kind", kind, CANARY_KINDS)
        self.canaries, self.kind = canaries, kind
        self.canary_seed = new_canary_seed() if secure_rng else int(make_rng(seed, 8).integers(2**63))
        self.start: np.ndarray | None = None  # the global vector before round 1

    @classmethod
    def from_keywords(cls, keywords: dict, seed: int, secure_rng: bool) -> AuditCanaries | None:
        """`audit_canaries=K, audit_canary_kind=...` (K = 0: no audit, but the kind is still checked)."""
        canaries, kind = keywords.pop("audit_canaries", 0), keywords.pop("audit_canary_kind", "isotropic")
        require(
            canaries == 0 or canaries >= 2,
            "audit_canaries",
            canaries,
            "must be 0 (no audit) or >= 2 (the null cosines' spread needs two)",
        )
        one_of("audit_canary_kind", kind, CANARY_KINDS)
        return cls(canaries, kind, seed=seed, secure_rng=secure_rng) if canaries else None

    def see_model(self, dp, arrays: ArrayRecord) -> None:
        if self.start is None:
            self.start = flatten(arrays.to_numpy_ndarrays())

    def extra_updates(self, dp, server_round: int, dim: int) -> list[np.ndarray]:
        """C * u_i of the canaries sampled this round (each with probability q, like a client)."""
        draws = make_rng(dp.run.seed, CANARY_STREAM, server_round, secure=dp.run.secure_rng).random(self.canaries)
        return [
            dp.privacy.clipping_norm * canary_direction(self.canary_seed, i, dim, self.kind)
            for i in np.flatnonzero(draws < dp.population.sample_rate)
        ]

    def estimate(self, dp) -> dict | None:
        """The one-shot estimate from the model delta of the rounds run so far (None before a round)."""
        if self.start is None or dp.record.latest_arrays is None:
            return None
        final = flatten(dp.record.latest_arrays.to_numpy_ndarrays())
        return audit_epsilon(
            final - self.start, self.canary_seed, self.canaries, self.canaries, dp.ledger.delta, self.kind
        )

    def describe(self, dp) -> dict:
        return {"audit": self.estimate(dp)}
