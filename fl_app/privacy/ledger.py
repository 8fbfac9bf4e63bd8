"""The privacy ledger: the single source of every epsilon the product prints.

A ledger is a list of (noise_multiplier, sample_rate, steps) events of the
sampled Gaussian mechanism, composed by a maintained accountant (Opacus RDP by
default, Opacus PRV selectable). The list is the whole state: save it, restore it.

Two ledgers implement the one interface `Ledger` that strategies and reports use:
`ClientLevelLedger` (one protected unit: a client; against the released model and against
the server) and `SampleLevelLedgers` (one ledger per client of its samples, DP-SGD).
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass, field
from typing import Protocol


ACCOUNTANTS = ("rdp", "prv")  # Opacus' accountants; Opacus is imported when an epsilon is first computed
MIN_SIGMA = 1e-12  # below: epsilon is infinite (Opacus' RDP divides by sigma^2)
PRV_MIN_SIGMA = 0.2  # below it PRV runs out of memory or returns inf (measured)

Event = tuple[float, float, int]


def _compress(events: list[Event]) -> list[Event]:
    """Merge consecutive events with equal (sigma, q)."""
    merged: list[Event] = []
    for sigma, q, steps in events:
        if steps <= 0:
            continue
        if merged and merged[-1][0] == sigma and merged[-1][1] == q:
            merged[-1] = (sigma, q, merged[-1][2] + steps)
        else:
            merged.append((float(sigma), float(q), int(steps)))
    return merged


def epsilon_of(events: list[Event], delta: float, accountant: str = "rdp") -> float:
    """eps(delta) of a composition of sampled-Gaussian events; inf if any has sigma = 0."""
    return _epsilon_of(tuple(_compress(events)), float(delta), accountant)


@functools.lru_cache(maxsize=4096)
def _epsilon_of(events: tuple[Event, ...], delta: float, accountant: str) -> float:
    """Memoised (PRV evaluations are slow and many ledgers share histories)."""
    if not events:
        return 0.0
    if any(sigma < MIN_SIGMA and q > 0 for sigma, q, _ in events):
        return math.inf  # (next to) no noise: Opacus' RDP would divide by zero
    events = [e for e in events if e[1] > 0]
    if not events:
        return 0.0
    if accountant == "prv" and min(sigma for sigma, _, _ in events) < PRV_MIN_SIGMA:
        # PRV's discretisation grows without bound as sigma -> 0 (16 GB at sigma = 0.03, inf at 0.1):
        # such events get RDP's bound, which is valid too (and close to PRV there).
        logging.getLogger(__name__).warning(
            "sigma < %s: PRV cannot bound this composition; using the RDP accountant", PRV_MIN_SIGMA)
        accountant = "rdp"
    from opacus.accountants import PRVAccountant, RDPAccountant
    from opacus.accountants.analysis import rdp as rdp_analysis

    if accountant == "rdp":  # what RDPAccountant.get_privacy_spent computes, per-step RDP cached
        rdp = sum(_rdp_per_step(sigma, q) * steps for sigma, q, steps in events)
        eps, _ = rdp_analysis.get_privacy_spent(orders=RDPAccountant.DEFAULT_ALPHAS, rdp=rdp, delta=delta)
    else:
        acc = {"rdp": RDPAccountant, "prv": PRVAccountant}[accountant]()
        acc.history = list(events)
        eps = acc.get_epsilon(delta=delta)
    # Opacus' RDP conversion can return a slightly negative value when the noise is huge; eps >= 0
    return max(0.0, float(eps))


@functools.lru_cache(maxsize=1024)
def _rdp_per_step(noise_multiplier: float, sample_rate: float):
    """RDP of one sampled-Gaussian step at Opacus' default orders (RDP composes additively)."""
    from opacus.accountants import RDPAccountant
    from opacus.accountants.analysis import rdp as rdp_analysis

    rdp = rdp_analysis.compute_rdp(q=sample_rate, noise_multiplier=noise_multiplier, steps=1,
                                   orders=RDPAccountant.DEFAULT_ALPHAS)
    rdp.setflags(write=False)
    return rdp


@dataclass
class PrivacyLedger:
    """Composition of sampled-Gaussian events for one protected unit (a client or a sample)."""

    delta: float
    accountant: str = "rdp"
    history: list[Event] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.accountant not in ACCOUNTANTS:
            raise ValueError(f"accountant={self.accountant!r} is not one of: {', '.join(ACCOUNTANTS)}")
        if not 0 < self.delta < 1:
            raise ValueError(f"delta={self.delta!r} must be in (0, 1)")

    def record(self, noise_multiplier: float, sample_rate: float, steps: int = 1) -> None:
        """Charge `steps` releases of the Gaussian mechanism with (sigma, q)."""
        self.history = _compress(self.history + [(noise_multiplier, sample_rate, steps)])

    def epsilon(self) -> float:
        """eps(delta) spent so far."""
        return epsilon_of(self.history, self.delta, self.accountant)

    def epsilon_after(self, noise_multiplier: float, sample_rate: float, steps: int = 1) -> float:
        """eps(delta) if `steps` more events were charged (nothing is recorded)."""
        return epsilon_of(self.history + [(noise_multiplier, sample_rate, steps)], self.delta, self.accountant)

    def max_steps_within(self, target_epsilon: float, noise_multiplier: float, sample_rate: float,
                         limit: int = 10**7) -> int:
        """Largest n with epsilon_after(sigma, q, n) <= target (binary search; ALI-DPFL's R_c)."""
        if self.epsilon_after(noise_multiplier, sample_rate, 1) > target_epsilon:
            return 0
        lo, hi = 1, 2
        while hi <= limit and self.epsilon_after(noise_multiplier, sample_rate, hi) <= target_epsilon:
            lo, hi = hi, hi * 2
        hi = min(hi, limit + 1)
        while hi - lo > 1:  # invariant: eps(lo) <= target < eps(hi)
            mid = (lo + hi) // 2
            if self.epsilon_after(noise_multiplier, sample_rate, mid) <= target_epsilon:
                lo = mid
            else:
                hi = mid
        return lo

    def state_dict(self) -> dict:
        return {"delta": self.delta, "accountant": self.accountant, "history": [list(e) for e in self.history]}

    @classmethod
    def from_state_dict(cls, state: dict) -> "PrivacyLedger":
        history = [(float(s), float(q), int(n)) for s, q, n in state["history"]]
        return cls(delta=float(state["delta"]), accountant=str(state["accountant"]), history=history)


def calibrate_noise_multiplier(target_epsilon: float, delta: float, sample_rate: float, steps: int,
                               accountant: str = "rdp") -> float:
    """Smallest sigma (to 0.01 in eps) with eps(delta) <= target after `steps` events (Opacus search)."""
    from opacus.accountants.utils import get_noise_multiplier

    return float(get_noise_multiplier(target_epsilon=target_epsilon, target_delta=delta,
                                      sample_rate=sample_rate, steps=steps, accountant=accountant))


def per_update_noise_multiplier(noise_multiplier: float, expected_clients: float) -> float:
    """Noise multiplier of one distributed-noise upload as the server sees it.

    Each upload carries N(0, sigma^2 C^2 / m) and two clipped updates differ by up to
    2C, so the release has multiplier (sigma C / sqrt(m)) / (2C) = sigma / (2 sqrt(m)).
    """
    return noise_multiplier / (2.0 * math.sqrt(expected_clients))


class Ledger(Protocol):
    """What every ledger offers: delta, the epsilon spent, and its whole state."""

    delta: float
    accountant: str

    def epsilon(self) -> float:
        """eps(delta) spent so far (the figure the run prints)."""

    def state_dict(self) -> dict:
        """The whole state, JSON-serializable; `from_state_dict` restores it."""


@dataclass
class ClientLevelLedger:
    """Client-level DP of a federated run, against the released model and against the server.

    - released model, Poisson client sampling: one sampled-Gaussian event (sigma, q) per round;
    - released model, fixed-size sampling (exactly m of M): under the replace-one relation one client's
      change moves the clipped sum by up to 2C, so a round is charged as the Gaussian mechanism with
      multiplier sigma / 2 and no sampling amplification (q = 1), an upper bound (tests check it
      against the worst-pair lower bound);
    - server, `central` noise: the trusted server sees raw updates (no guarantee);
    - server, `distributed` noise without secure aggregation: every upload is its own
      Gaussian release with multiplier sigma/(2 sqrt(m)) and no sampling amplification;
    - server, `distributed` with secure aggregation: the server sees only the noisy sum, but it
      chose the sample, so no sampling amplification (q = 1); in a round where only k < m noise
      shares arrived, the sum it sees (before its own top-up) has multiplier sigma sqrt(k/m),
      and that is what the server figure charges for the round.
    """

    delta: float
    accountant: str = "rdp"
    noise_placement: str = "central"
    secure_aggregation: bool = False
    client_sampling: str = "poisson"
    model: PrivacyLedger = field(init=False)
    server: PrivacyLedger = field(init=False)

    def __post_init__(self) -> None:
        self.model = PrivacyLedger(self.delta, self.accountant)
        self.server = PrivacyLedger(self.delta, self.accountant)

    @property
    def server_threat_model(self) -> str:
        if self.noise_placement == "central":
            return "trusted server: it sees raw clipped updates, no DP against it"
        if self.secure_aggregation:
            return "secure aggregation: the server sees only the noisy sum"
        return "distributed noise: each upload is its own Gaussian release (sigma/(2 sqrt(m)), q=1)"

    @property
    def relation(self) -> str:
        if self.client_sampling == "fixed":
            return ("replace-one, fixed-size sampling: Gaussian mechanism with sensitivity 2C, no sampling "
                    "amplification claimed (an upper bound)")
        return "add/remove-one, Poisson sampling: sampled Gaussian mechanism (exact)"

    def release_event(self, noise_multiplier: float, sample_rate: float) -> tuple[float, float]:
        """(multiplier, rate) one round's release is charged as: (sigma, q), or (sigma / 2, 1) for fixed-size."""
        if self.client_sampling == "fixed":
            return noise_multiplier / 2.0, 1.0
        return noise_multiplier, sample_rate

    def epsilon_after_rounds(self, noise_multiplier: float, sample_rate: float, rounds: int = 1) -> float:
        """eps(delta) against the released model if `rounds` more rounds were charged."""
        return self.model.epsilon_after(*self.release_event(noise_multiplier, sample_rate), rounds)

    def record_round(self, noise_multiplier: float, sample_rate: float, expected_clients: float,
                     received: int | None = None) -> None:
        """Charge one round; `received` = noise shares that reached the sum (None: all m)."""
        sigma, rate = self.release_event(noise_multiplier, sample_rate)
        self.model.record(sigma, rate)
        if self.noise_placement != "distributed":
            return
        if not self.secure_aggregation:
            self.server.record(per_update_noise_multiplier(noise_multiplier, expected_clients), 1.0)
        elif received is None or received >= expected_clients:
            self.server.record(sigma, 1.0)  # the server chose the sample: no amplification against it
        elif received > 0:
            self.server.record(sigma * math.sqrt(received / expected_clients), 1.0)

    def epsilon(self) -> float:
        """eps(delta) against the released model."""
        return self.model.epsilon()

    def epsilon_against_server(self) -> float:
        if self.noise_placement == "central":
            return math.inf
        return self.server.epsilon()

    def state_dict(self) -> dict:
        return {"delta": self.delta, "accountant": self.accountant, "noise_placement": self.noise_placement,
                "secure_aggregation": self.secure_aggregation, "client_sampling": self.client_sampling,
                "relation": self.relation, "model": self.model.state_dict(), "server": self.server.state_dict()}

    @classmethod
    def from_state_dict(cls, state: dict) -> "ClientLevelLedger":
        ledger = cls(float(state["delta"]), state["accountant"], state["noise_placement"],
                     bool(state["secure_aggregation"]), state.get("client_sampling", "poisson"))
        ledger.model = PrivacyLedger.from_state_dict(state["model"])
        ledger.server = PrivacyLedger.from_state_dict(state["server"])
        return ledger


@dataclass
class SampleLevelLedgers:
    """Sample-level DP of a federated run in which every client runs DP-SGD (ALI-DPFL).

    One PrivacyLedger per client (keyed by partition id) of the sampled-Gaussian events
    its data went through: DP-SGD steps (sigma, q_s, steps) and, if any, releases of
    statistics computed on its data. A client's data is protected by its own ledger;
    the run reports the maximum over clients.
    """

    delta: float
    accountant: str = "rdp"
    clients: dict[int, PrivacyLedger] = field(default_factory=dict)

    def record(self, client: int, noise_multiplier: float, sample_rate: float, steps: int = 1) -> None:
        if client not in self.clients:
            self.clients[client] = PrivacyLedger(self.delta, self.accountant)
        self.clients[client].record(noise_multiplier, sample_rate, steps)

    def epsilon_per_client(self) -> dict[int, float]:
        return {client: ledger.epsilon() for client, ledger in sorted(self.clients.items())}

    def epsilon(self) -> float:
        """max over clients of eps(delta); 0 before any client took a step."""
        return max(self.epsilon_per_client().values(), default=0.0)

    def state_dict(self) -> dict:
        return {"delta": self.delta, "accountant": self.accountant,
                "clients": {str(c): ledger.state_dict() for c, ledger in sorted(self.clients.items())}}

    @classmethod
    def from_state_dict(cls, state: dict) -> "SampleLevelLedgers":
        return cls(float(state["delta"]), state["accountant"],
                   {int(c): PrivacyLedger.from_state_dict(s) for c, s in state["clients"].items()})
