"""The parts of a client-level DP round, behind one small protocol (docs/architecture.md, "Adding a part").

`DifferentialPrivacy` runs a list of parts and calls the same hooks on each of them; it never asks which part
it holds. A part overrides the hooks it needs; every hook here is a no-op. A part reads the wrapper (`dp`, read
only) and the round in flight; what it changes comes back as a return value (`after_round`'s settings, e.g. the
next clipping norm), never as a write into the wrapper.

Roles: four jobs of a round are filled by exactly one part each; the wrapper supplies the default when none of
its parts fills the role. Each role is a `typing.Protocol` in `strategies.parts.roles`, and a part that names a role in
its `roles` without the role's methods is refused when the wrapper is built (`strategies.parts.roles.check_roles`).

- selection: who is sent the train message (Poisson or fixed-size sampling: the round loop's own;
  DP-FTRL's participation rule, `strategies.parts.dp_ftrl`);
- mechanism: how the sum becomes a release and what the ledger charges (the Gaussian mechanism through the noise
  placement, `strategies.parts.mechanism.GaussianMechanism`; DP-FTRL's tree; the Haar-wavelet noise,
  `strategies.parts.wavelet.WaveletMechanism`);
- codec: how a reply's arrays are read (dense, `DenseCodec`; top-k sparse, `strategies.parts.topk.TopKCodec`);
- noise: who adds the Gaussian noise (`strategies.parts.noise_placement`: central, distributed or local; the wrapper
  builds it from `noise_placement`, always its first part).

The other parts (adaptive clipping, the canary audit, secure aggregation) add to a round without replacing a job.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
from flwr.app import ArrayRecord, RecordDict

from dpfl.dpcore.privacy import protocol as keys
from dpfl.strategies.parts.reply_rules import MetricRule, reply_arrays

ROLES = ("selection", "mechanism", "codec", "noise")  # strategies.parts.roles declares each


@dataclass(frozen=True)
class AfterRound:
    """What a part returns after a round: entries for the round record, and settings of the wrapper that take new
    values from the next round on (names of `PrivacyOptions` fields, e.g. {"clipping_norm": C_next})."""

    record: dict = field(default_factory=dict)
    settings: dict = field(default_factory=dict)


class Part:
    """One optional piece of a client-level DP round. Each hook is a no-op here."""

    roles: tuple[str, ...] = ()  # which of ROLES this part fills
    keyword = ""  # the wrapper's keyword (and run-config key) that names the part in errors
    published_keys: frozenset[str] = frozenset()  # round-record keys it adds that the ledger covers
    reply_rules: dict[str, MetricRule] = {}  # metrics it reads from a train reply
    server_sees_only_the_sum = False  # the server never sees a single update (secure aggregation)
    publishes_claimed_epsilon = False  # its rounds publish a paper's claimed epsilon beside the true one
    clients_clip_under_central_noise = False  # a mechanism's: under central noise, clients clip too (wavelet)

    def check(self, privacy, others: frozenset[str]) -> None:
        """Refuse settings the part cannot run with (`privacy`: the wrapper's `PrivacyOptions`; `others`: the
        keywords of the other parts)."""

    def see_model(self, dp, arrays: ArrayRecord) -> None:
        """The global arrays the run starts from, and those each round starts from."""

    def round_begun(self, dp) -> None:
        """A round's train messages are composed (its sample drawn)."""

    def update_noise_multiplier(self, noise_multiplier: float) -> float:
        """The multiplier of the noise on the update sum, given the one the others leave (the ledger still
        charges the mechanism's `accounted_noise_multiplier`)."""
        return noise_multiplier

    def failure_probability(self) -> float:
        """P(a round's release is not the mechanism the ledger charges) through this part, reserved out of delta
        every round as the truncation probability is (SecAgg+'s quantizer clipping)."""
        return 0.0

    def client_config(self, dp, server_round: int) -> dict:
        """What the train config gains for this part."""
        return {}

    def reply_problem(self, dp, metrics: dict) -> str | None:
        """Why a well-formed reply is refused (logged with the node), else None."""
        return None

    def extra_updates(self, dp, server_round: int, dim: int) -> list[np.ndarray]:
        """Vectors the part adds to the round's sum (the audit's canaries)."""
        return []

    def round_metrics(self, dp, server_round: int, replies: list) -> dict:
        """Round-record entries measured on the raw replies, before the gate (e.g. bytes received)."""
        return {}

    def after_round(self, dp, server_round: int, accepted: list[tuple[np.ndarray, dict]], norms: list) -> AfterRound:
        """The round is aggregated: record entries and settings for the next round."""
        return AfterRound()

    def publish(self, published: frozenset[str]) -> frozenset[str]:
        """The round-record keys the ledger covers, given those the others publish."""
        return published | self.published_keys

    def caveats(self, dp) -> list[str]:
        """Why the printed epsilon is not a guarantee with this part (empty: no reason)."""
        return []

    def server_caveats(self, dp) -> list[str]:
        """Why epsilon_against_server is not a guarantee with this part."""
        return []

    def describe(self, dp) -> dict:
        """summary.json entries."""
        return {}

    def describe_diagnostics(self, dp) -> dict:
        """diagnostics-summary.json entries (not private)."""
        return {}

    def summary(self) -> str | None:
        """One line for the start-up summary, or None."""
        return None

    def state_dict(self) -> dict:
        """The part's state a resumed run needs (JSON-serializable)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Take the state `state_dict` gave."""


class DenseCodec(Part):
    """The codec of a dense reply: the arrays as sent (read in place, `reply_arrays`), the update itself when the
    reply is marked `UPLOAD_UPDATE` (this project's clients and mod), else the client's new weights."""

    roles = ("codec",)

    def decode(self, dp, content: RecordDict) -> tuple[list[np.ndarray], bool]:
        is_update = any(
            record.get(keys.UPLOAD_KIND) == keys.UPLOAD_UPDATE for record in content.metric_records.values()
        )
        return reply_arrays(content[arrays_key(dp)]), is_update


def filling(parts: Sequence[Part], role: str, default: Part) -> Part:
    """The part that fills `role` (at most one may), else `default`."""
    found = [p for p in parts if role in p.roles]
    if len(found) > 1:
        raise ValueError(f"two parts fill the role {role!r}: {', '.join(type(p).__name__ for p in found)}")
    return found[0] if found else default


def keywords_of(parts: Iterable[Part]) -> frozenset[str]:
    return frozenset(p.keyword for p in parts if p.keyword)


class PartView:
    """What a part reads of the wrapper it is composed into (the `dp` its hooks receive), read-only: the wrapped
    `strategy` (its message keys), the `population` (M, q, m, n_s), the `privacy` options (C, sigma, delta, the
    accountant, the budget), the `run` options (the seed and secure_rng its generators come from, eta_s), the
    `record` (R_s, the arrays after the last round), the `round` in flight, the `ledger`, the `noise` and
    `selection` parts and all `parts`, and `update_noise_multiplier()`. Not the wrapper: a part cannot call its
    methods or set its attributes (an AttributeError names what it may read)."""

    __slots__ = ("_dp",)
    NAMES = ("strategy", "population", "privacy", "run", "record", "round", "ledger", "noise", "selection", "parts")

    def __init__(self, dp) -> None:
        object.__setattr__(self, "_dp", dp)

    def __getattr__(self, name: str):
        if name in PartView.NAMES:
            return getattr(self._dp, name)
        raise AttributeError(f"a part reads {', '.join(PartView.NAMES)} and update_noise_multiplier(), not {name!r}")

    def __setattr__(self, name: str, value) -> None:
        raise AttributeError(f"a part's view of the wrapper is read-only: it cannot set {name!r}")

    def update_noise_multiplier(self) -> float:
        """The multiplier of the noise on the update sum (sigma, or what the parts leave of it)."""
        return self._dp.update_noise_multiplier()


def arrays_key(dp) -> str:
    """The key of the arrays in the messages of the strategy `dp` wraps (Flower's `arrayrecord_key`)."""
    return getattr(dp.strategy, "arrayrecord_key", "arrays")


def config_key(dp) -> str:
    """The key of the config in its messages (Flower's `configrecord_key`)."""
    return getattr(dp.strategy, "configrecord_key", "config")


def fraction_evaluate(dp) -> float:
    """The fraction of nodes the wrapped strategy evaluates on (the wrapper samples only the train rounds)."""
    return float(getattr(dp.strategy, "fraction_evaluate", 0.0))


def sees_only_the_sum(dp) -> bool:
    """Whether the server of `dp` (the wrapper) never sees a single update: a part says so (secure aggregation)."""
    return any(part.server_sees_only_the_sum for part in dp.parts)


def failure_probability(parts: Iterable[Part]) -> float:
    """What the parts reserve out of delta each round beside the truncation probability (SecAgg+'s quantizer
    clipping: `SecureAggregation.failure_probability`)."""
    return sum(part.failure_probability() for part in parts)
