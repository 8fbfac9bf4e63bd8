"""The privacy ledger: the single source of every epsilon the product prints.

A ledger is a list of (noise_multiplier, sample_rate, steps) events of the sampled Gaussian mechanism,
composed by a maintained accountant (`dpcore.privacy.accountants`). The list is the whole state: save it,
restore it.

The ledgers implement the one interface `Ledger` that strategies and reports use:
`ClientLevelLedger` (one protected unit: a client; against the released model and against
the server), `SampleLevelLedgers` (one ledger per client of its samples, DP-SGD) and
`TreeAggregationLedger` (DP-FTRL's trees); `dpcore.privacy.matrix_factorization.MatrixFactorizationLedger`
(DP-FTRL's BLT and banded noise) beside its math.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

from dpfl.dpcore.privacy.accountants import (
    ACCOUNTANTS,
    DEFAULT_ACCOUNTANT,
    Event,
    WorEvent,
    accountant_used,
    epsilon_of,
    fixed_size_epsilon,
    tree_aggregation_rdp_epsilon,
    tree_gaussian_multiplier,
)
from dpfl.dpcore.privacy.calibration import per_update_noise_multiplier, secure_sum_noise_multiplier

from .modes import SAMPLING_FORMS, TRUSTED_SERVER, SamplingForm, ServerView


def check_ledger_settings(delta: float, accountant: str) -> None:
    """ValueError unless the accountant is known and 0 < delta < 1."""
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"accountant={accountant!r} is not one of: {', '.join(ACCOUNTANTS)}")
    if not 0 < delta < 1:
        raise ValueError(f"delta={delta!r} must be in (0, 1)")


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


@dataclass
class PrivacyLedger:
    """Composition of sampled-Gaussian events for one protected unit (a client or a sample)."""

    delta: float
    accountant: str = DEFAULT_ACCOUNTANT
    history: list[Event] = field(default_factory=list)

    def __post_init__(self) -> None:
        check_ledger_settings(self.delta, self.accountant)

    def record(self, noise_multiplier: float, sample_rate: float, steps: int = 1) -> None:
        """Charge `steps` releases of the Gaussian mechanism with (sigma, q)."""
        self.history = _compress(self.history + [(noise_multiplier, sample_rate, steps)])

    def epsilon(self) -> float:
        """eps(delta) spent so far."""
        return epsilon_of(self.history, self.delta, self.accountant)

    def epsilon_after(self, noise_multiplier: float, sample_rate: float, steps: int = 1) -> float:
        """eps(delta) if `steps` more events were charged (nothing is recorded)."""
        return epsilon_of(self.history + [(noise_multiplier, sample_rate, steps)], self.delta, self.accountant)

    def max_steps_within(
        self, target_epsilon: float, noise_multiplier: float, sample_rate: float, limit: int = 10**7
    ) -> int:
        """Largest n <= limit with epsilon_after(sigma, q, n) <= target (binary search; ALI-DPFL's R_c)."""
        if self.epsilon_after(noise_multiplier, sample_rate, 1) > target_epsilon:
            return 0
        if self.epsilon_after(noise_multiplier, sample_rate, limit) <= target_epsilon:
            return limit  # what the search would find, without its dozens of costly evaluations
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
        return {
            "delta": self.delta,
            "accountant": self.accountant,
            "history": [list(e) for e in self.history],
            "bound_by": accountant_used(self.history, self.delta, self.accountant),
        }

    @classmethod
    def from_state_dict(cls, state: dict) -> "PrivacyLedger":
        history = [(float(s), float(q), int(n)) for s, q, n in state["history"]]
        return cls(delta=float(state["delta"]), accountant=str(state["accountant"]), history=history)


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
      change moves the clipped sum by up to 2C. Two valid upper bounds are computed and the smaller is
      printed (`model_bound_by` names it): each round as the Gaussian mechanism with multiplier sigma / 2
      and no sampling amplification (q = 1, the configured accountant), and dp-accounting's replace-one RDP
      of the Gaussian at sigma / 2 on m of N sampled without replacement (`fixed_size_epsilon`, with each
      round's own N and m: `fixed_rounds`). Both are upper bounds, so the minimum is one, and never below
      a valid lower bound (tests check it against the worst-pair lower bound and dp-accounting);
    - released model, the sample truncated to n_s (`truncation_probability`, docs/algorithms.md §0): a
      round whose Poisson sample would exceed n_s noise shares keeps n_s of them. The run equals the
      sampled Gaussian mechanism except on the event that some round's other clients alone fill n_s,
      whose probability (summed over rounds: `truncation_delta`) is added to delta: epsilon is the
      accountant's at delta - truncation_delta. Under SecAgg+ `truncation_delta` also sums the quantizer's clip
      probability of every round (`record_round`'s truncation_probability carries both);
    - `local` noise (local DP, docs/dp-toolbox.md §2): every upload is the Gaussian mechanism at sigma / 2
      (replace-one, sensitivity 2C) on its own, with no sampling amplification (nothing is trusted on the
      server, its sampling included): one (sigma / 2, 1) event per round, against the released model and
      against the server alike, which is the local epsilon of a client that took part in every round;
    - server, `central` noise: the trusted server sees raw updates (no guarantee);
    - server, `distributed` noise without secure aggregation: every upload is its own
      Gaussian release with multiplier sigma/(2 sqrt(n_s)) and no sampling amplification;
    - server, `distributed` with secure aggregation: the server sees only the noisy sum, but it
      chose the sample, so no sampling amplification (q = 1) and replace-one (sensitivity 2C, as for one
      upload, under either client sampling); the sum of the k noise shares that arrived has multiplier
      sigma sqrt(k / n_s) / 2 before the server's own top-up (`secure_sum_noise_multiplier`), and that is
      what the server figure charges for the round (it depends on k, so it is a diagnostic, not published).
    """

    delta: float
    accountant: str = DEFAULT_ACCOUNTANT
    server_view: ServerView = TRUSTED_SERVER
    secure_aggregation: bool = False
    client_sampling: str = "poisson"  # the sampling's name (the state records it); or give its `sampling` form
    truncation_delta: float = 0.0
    fixed_rounds: list[WorEvent] = field(default_factory=list)  # fixed sampling: (sigma / 2, N, m, steps) per round
    sampling: SamplingForm | None = None  # what the selection part says of its sampling (default: by the name)
    model: PrivacyLedger = field(init=False)
    server: PrivacyLedger = field(init=False)

    def __post_init__(self) -> None:
        self.sampling = self.sampling or SAMPLING_FORMS[self.client_sampling]
        self.client_sampling = self.sampling.name
        self.model = PrivacyLedger(self.delta, self.accountant)
        self.server = PrivacyLedger(self.delta, self.accountant)

    @property
    def noise_placement(self) -> str:
        """The name of the noise placement (the ledger's state records it)."""
        return self.server_view.name

    @property
    def server_threat_model(self) -> str:
        if self.server_view.trusted:
            return "trusted server: it sees raw clipped updates, no DP against it"
        if self.server_view.uploads_private:
            return "local DP: each upload is its own Gaussian release (sigma/2, q=1); nothing trusted on the server"
        if self.secure_aggregation:
            return "secure aggregation: the server sees only the noisy sum (no sampling amplification against it)"
        return "distributed noise: each upload is its own Gaussian release (sigma/(2 sqrt(n_s)), q=1)"

    @property
    def relation(self) -> str:
        if self.server_view.uploads_private:
            return (
                "replace-one, local DP: each upload is the Gaussian mechanism with sensitivity 2C, no sampling "
                "amplification"
            )
        quantizer = "SecAgg+'s quantizer-clip probability" if self.secure_aggregation else ""
        if self.sampling.fixed_size:
            return (
                "replace-one, fixed-size sampling: Gaussian mechanism with sensitivity 2C; the smaller of two "
                "upper bounds: no sampling amplification, and dp-accounting's replace-one RDP of sampling "
                "without replacement" + (f", delta reduced by {quantizer}" if quantizer else "")
            )
        return (
            "add/remove-one, Poisson sampling: sampled Gaussian mechanism (exact), delta reduced by the "
            "probability of truncating a round's sample to n_s noise shares"
            + (f" and by {quantizer}" if quantizer else "")
        )

    def release_event(self, noise_multiplier: float, sample_rate: float) -> tuple[float, float]:
        """(multiplier, rate) one round's release is charged as: (sigma, q), or (sigma / 2, 1) for fixed-size
        sampling and for local noise."""
        if self.sampling.fixed_size or self.server_view.uploads_private:
            return noise_multiplier / 2.0, 1.0
        return noise_multiplier, sample_rate

    def _model_bounds(
        self, events: list[Event], truncation_delta: float, fixed_rounds: list[WorEvent] | None = None
    ) -> tuple[float, str]:
        """(eps(delta) against the released model, the bound that gave it): the configured accountant's, or
        under fixed-size sampling the smaller of it and the sampling-without-replacement RDP bound (when every
        round's N and m are known)."""
        delta = self.delta - truncation_delta
        if delta <= 0:
            return math.inf, self.accountant
        eps, by = epsilon_of(events, delta, self.accountant), accountant_used(events, delta, self.accountant)
        fixed_rounds = self.fixed_rounds if fixed_rounds is None else fixed_rounds
        if (
            self.sampling.fixed_size
            and not self.server_view.uploads_private
            and fixed_rounds
            and sum(e[3] for e in fixed_rounds) == sum(e[2] for e in events)
        ):
            wor = fixed_size_epsilon(fixed_rounds, delta)
            if wor < eps:
                return wor, "rdp-sampled-without-replacement (dp-accounting, replace-one)"
        return eps, by

    def _model_epsilon(
        self, events: list[Event], truncation_delta: float, fixed_rounds: list[WorEvent] | None = None
    ) -> float:
        return self._model_bounds(events, truncation_delta, fixed_rounds)[0]

    def epsilon_after_rounds(
        self,
        noise_multiplier: float,
        sample_rate: float,
        rounds: int = 1,
        truncation_probability: float = 0.0,
        sampled_from: tuple[int, int] | None = None,
    ) -> float:
        """eps(delta) against the released model if `rounds` more rounds were charged (fixed-size sampling: at
        `sampled_from` = (N, m), the round's own once it has sampled; None: at the last round's N and m)."""
        event = (*self.release_event(noise_multiplier, sample_rate), rounds)
        fixed = None
        where = sampled_from or (self.fixed_rounds[-1][1:3] if self.fixed_rounds else None)
        if self.sampling.fixed_size and where is not None:
            fixed = self.fixed_rounds + [(event[0], int(where[0]), int(where[1]), rounds)]
        return self._model_epsilon(
            self.model.history + [event], self.truncation_delta + rounds * truncation_probability, fixed
        )

    def record_round(
        self,
        noise_multiplier: float,
        sample_rate: float,
        noise_shares: float,
        received: int | None = None,
        truncation_probability: float = 0.0,
        sampled_from: tuple[int, int] | None = None,
    ) -> None:
        """Charge one round. `noise_shares` = n_s; `received` = noise shares that reached the sum (None: all);
        `truncation_probability` = P(the round's sample is truncated to n_s), plus any other failure probability
        of the round (SecAgg+'s quantizer clip), reserved out of delta;
        `sampled_from` = (N, m): fixed-size sampling drew m of N nodes (None: unknown, no amplification)."""
        sigma, rate = self.release_event(noise_multiplier, sample_rate)
        self.model.record(sigma, rate)
        if self.server_view.uploads_private:  # no amplification, no truncation reserve: the server is not trusted
            self.server.record(sigma, rate)
            return
        if self.sampling.fixed_size and sampled_from is not None:
            population, sample = int(sampled_from[0]), int(sampled_from[1])
            last = self.fixed_rounds[-1] if self.fixed_rounds else None
            if last is not None and last[:3] == (sigma, population, sample):
                self.fixed_rounds[-1] = (sigma, population, sample, last[3] + 1)
            else:
                self.fixed_rounds.append((float(sigma), population, sample, 1))
        self.truncation_delta += float(truncation_probability)
        if self.server_view.trusted:
            return
        if not self.secure_aggregation:
            self.server.record(per_update_noise_multiplier(noise_multiplier, noise_shares), 1.0)
            return
        shares = noise_shares if received is None else min(received, noise_shares)
        if shares > 0:  # the server chose the sample: no amplification against it
            self.server.record(secure_sum_noise_multiplier(noise_multiplier, shares, noise_shares), 1.0)

    def epsilon(self) -> float:
        """eps(delta) against the released model."""
        return self._model_epsilon(self.model.history, self.truncation_delta)

    def epsilon_against_server(self) -> float:
        """eps against the server; under SecAgg+ at delta - truncation_delta, since a quantizer clip (reserved
        there with the truncation probability, which only makes it larger) voids the sum it sees as well."""
        if self.server_view.trusted:
            return math.inf
        if self.secure_aggregation and self.truncation_delta > 0:
            delta = self.delta - self.truncation_delta
            return epsilon_of(self.server.history, delta, self.accountant) if delta > 0 else math.inf
        return self.server.epsilon()

    def state_dict(self) -> dict:
        return {
            "delta": self.delta,
            "accountant": self.accountant,
            "noise_placement": self.noise_placement,
            "secure_aggregation": self.secure_aggregation,
            "client_sampling": self.client_sampling,
            "truncation_delta": self.truncation_delta,
            "relation": self.relation,
            "fixed_rounds": [list(e) for e in self.fixed_rounds],
            "model_bound_by": self.model_bound_by(),
            "model": self.model.state_dict(),
            "server": self.server.state_dict(),
        }

    def model_bound_by(self) -> str:
        """Which bound gave the released model's epsilon."""
        return self._model_bounds(self.model.history, self.truncation_delta)[1]

    @classmethod
    def from_state_dict(cls, state: dict, server_view: ServerView) -> "ClientLevelLedger":
        """The ledger `state_dict` saved, with what its noise placement (`state["noise_placement"]`) says the
        server sees; its sampling's form by the name the state records (`SAMPLING_FORMS`)."""
        if server_view.name != state["noise_placement"]:
            raise ValueError(
                f"noise_placement={state['noise_placement']!r} in the saved ledger, but the server view given is "
                f"{server_view.name!r}'s"
            )
        ledger = cls(
            float(state["delta"]),
            state["accountant"],
            server_view,
            bool(state["secure_aggregation"]),
            state.get("client_sampling", "poisson"),
            float(state.get("truncation_delta", 0.0)),
            [(float(s), int(n), int(m), int(k)) for s, n, m, k in state.get("fixed_rounds", [])],
        )
        ledger.model = PrivacyLedger.from_state_dict(state["model"])
        ledger.server = PrivacyLedger.from_state_dict(state["server"])
        return ledger


@dataclass
class SampleLevelLedgers:
    """Sample-level DP of a federated run in which every client runs DP-SGD (ALI-DPFL).

    One PrivacyLedger per client (keyed by the SuperLink's node id) of the sampled-Gaussian events
    its data went through: DP-SGD steps (sigma, q_s, steps) and, if any, releases of
    statistics computed on its data. A client's data is protected by its own ledger;
    the run reports the maximum over clients.
    """

    delta: float
    accountant: str = DEFAULT_ACCOUNTANT
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
        return {
            "delta": self.delta,
            "accountant": self.accountant,
            "clients": {str(c): ledger.state_dict() for c, ledger in sorted(self.clients.items())},
        }

    @classmethod
    def from_state_dict(cls, state: dict) -> "SampleLevelLedgers":
        return cls(
            float(state["delta"]),
            state["accountant"],
            {int(c): PrivacyLedger.from_state_dict(s) for c, s in state["clients"].items()},
        )


@dataclass
class TreeAggregationLedger:
    """Client-level DP of DP-FTRL (docs/dp-toolbox.md §4): no sampling, each client in at most one round of each
    epoch of `epoch_rounds` rounds (the strategy enforces it), one tree per epoch. `trees` holds (sigma, steps)
    per tree; eps(delta) is the smaller of two upper bounds: dp-accounting's RDP of the tree events
    (`tree_aggregation_rdp_epsilon`) and the configured accountant's epsilon of the equivalent Gaussian mechanism
    (`tree_gaussian_multiplier`: ceil(log2(steps + 1)) Gaussian releases at sigma per tree, q = 1; tighter, RDP's
    conversion to (eps, delta) being lossy). Against the
    server: none (a trusted server sees the clipped updates)."""

    delta: float
    accountant: str = DEFAULT_ACCOUNTANT
    epoch_rounds: int = 1
    trees: list[list] = field(default_factory=list)  # [sigma, steps] per tree, the last one possibly incomplete

    kind = "tree-aggregation"
    server_threat_model = "trusted server: it sees raw clipped updates, no DP against it"
    relation = (
        "replace-special (a client's updates replaced by zero), no sampling: each client in at most one "
        "round per epoch (enforced by the server), one binary tree per epoch; dp-accounting's "
        "SingleEpochTreeAggregationDpEvent"
    )

    def __post_init__(self) -> None:
        check_ledger_settings(self.delta, self.accountant)

    def _with_round(self, trees: list[list], noise_multiplier: float) -> list[list]:
        """The trees after one more round: a new tree every `epoch_rounds` rounds (the smaller sigma if it changed)."""
        trees = [list(t) for t in trees]
        if trees and trees[-1][1] < self.epoch_rounds:
            trees[-1] = [min(trees[-1][0], float(noise_multiplier)), trees[-1][1] + 1]
        else:
            trees.append([float(noise_multiplier), 1])
        return trees

    def record_round(
        self,
        noise_multiplier: float,
        sample_rate: float = 1.0,
        noise_shares: float = 0,
        received: int | None = None,
        truncation_probability: float = 0.0,
        sampled_from: tuple[int, int] | None = None,
    ) -> None:
        """Charge one round: one more leaf of the current epoch's tree (no sampling, so q is not used)."""
        self.trees = self._with_round(self.trees, noise_multiplier)

    def _bounds(self, trees: list[list]) -> tuple[float, str]:
        rdp = tree_aggregation_rdp_epsilon([tuple(t) for t in trees], self.delta)
        events = [(sigma, 1.0, int(steps).bit_length()) for sigma, steps in trees]  # depth_j releases at sigma_j
        gaussian = epsilon_of(events, self.delta, self.accountant)
        if gaussian <= rdp:
            return gaussian, f"{accountant_used(events, self.delta, self.accountant)} (equivalent Gaussian)"
        return rdp, "rdp (dp-accounting, SingleEpochTreeAggregationDpEvent)"

    def epsilon(self) -> float:
        return self._bounds(self.trees)[0]

    def rdp_epsilon(self) -> float:
        """dp-accounting's RDP bound of the tree events alone."""
        return tree_aggregation_rdp_epsilon([tuple(t) for t in self.trees], self.delta)

    def epsilon_after_rounds(
        self,
        noise_multiplier: float,
        sample_rate: float = 1.0,
        rounds: int = 1,
        truncation_probability: float = 0.0,
        sampled_from: tuple[int, int] | None = None,
    ) -> float:
        trees = self.trees
        for _ in range(rounds):
            trees = self._with_round(trees, noise_multiplier)
        return self._bounds(trees)[0]

    def epsilon_against_server(self) -> float:
        return math.inf

    def model_bound_by(self) -> str:
        return self._bounds(self.trees)[1]

    def state_dict(self) -> dict:
        return {
            "kind": self.kind,
            "delta": self.delta,
            "accountant": self.accountant,
            "epoch_rounds": self.epoch_rounds,
            "trees": [list(t) for t in self.trees],
            "relation": self.relation,
            "model_bound_by": self.model_bound_by(),
            "rdp_tree_epsilon": self.rdp_epsilon(),
            "gaussian_multiplier": tree_gaussian_multiplier([tuple(t) for t in self.trees]) if self.trees else None,
        }

    @classmethod
    def from_state_dict(cls, state: dict) -> "TreeAggregationLedger":
        return cls(
            float(state["delta"]),
            state["accountant"],
            int(state["epoch_rounds"]),
            [[float(s), int(n)] for s, n in state["trees"]],
        )
