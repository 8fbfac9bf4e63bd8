"""The roles a part can fill, declared as `typing.Protocol`s (docs/architecture.md, "Adding a part").

A part names the roles it fills in its `roles` tuple (`strategies.parts.part.Part.roles`); `check_roles` holds it to
them when the wrapper is built: a part that claims a role without one of the role's methods or attributes is a
TypeError naming the part, the role and what is missing. `DifferentialPrivacy` calls a role's methods and nothing
else of the part that fills it (besides `Part`'s hooks).

- selection: who is sent a round's train message (`strategies.parts.sampling.ClientSampling`, DP-FTRL's rule);
- mechanism: how the round's sum becomes a release and what the ledger charges (`strategies.parts.mechanism`);
- codec: how a reply's arrays are read (`strategies.parts.part.DenseCodec`, `strategies.parts.topk.TopKCodec`);
- noise: who adds the Gaussian noise and what the server sees (`strategies.parts.noise_placement`).
"""

from __future__ import annotations

import inspect
from typing import Protocol, runtime_checkable

import numpy as np
from flwr.app import RecordDict

from dpfl.dpcore.privacy.ledger import Ledger
from dpfl.dpcore.privacy.modes import SamplingForm, ServerView
from dpfl.strategies.parts.sampling import Selection


@runtime_checkable
class SelectionRole(Protocol):
    """Who is sent a round's train message, what the budget check assumes the next round reserves, and the form of
    its sampling that the client-level ledger charges (`sampling_form`: Poisson or fixed-size; None where the
    mechanism's own ledger charges the participation rule, as DP-FTRL's does)."""

    sampling_form: SamplingForm | None

    def select(self, dp, server_round: int, node_ids: list[int]) -> Selection: ...

    def next_truncation_probability(self, dp) -> float: ...


@runtime_checkable
class MechanismRole(Protocol):
    """The release of a round (w + eta_s * (sum + noise) / m for the Gaussian mechanism) and its ledger; whether
    its clients clip too when the server adds all the noise (the wrapper builds the noise placement with it)."""

    clients_clip_under_central_noise: bool

    def make_ledger(self, dp, delta: float) -> Ledger: ...

    def ledger_from_state(self, state: dict) -> Ledger: ...

    def accounted_noise_multiplier(self, dp) -> float: ...

    def release(
        self, dp, server_round: int, updates: list[np.ndarray], global_vector: np.ndarray, received: int
    ) -> tuple[np.ndarray, float]: ...


@runtime_checkable
class CodecRole(Protocol):
    """(a reply's arrays, whether they are the update rather than the new weights)."""

    def decode(self, dp, content: RecordDict) -> tuple[list[np.ndarray], bool]: ...


@runtime_checkable
class NoiseRole(Protocol):
    """Who adds the noise: the clients' privatizing config, the server's clip and noise std sigma C (all of it),
    sigma C sqrt((n_s - k)/n_s) (the top-up) or 0, the norm an honest upload stays below, and what the server
    sees (`server_view`: the ledger asks it, never the placement's name)."""

    name: str
    server_adds_noise: bool
    clients_add_noise: bool
    noise_in_shares: bool

    def privatize_config(self, noise_multiplier: float, clipping_norm: float, noise_shares: float) -> dict: ...

    def server_clip(self, vector: np.ndarray, metrics: dict, clipping_norm: float) -> tuple[np.ndarray, float]: ...

    def server_noise_std(
        self, noise_multiplier: float, clipping_norm: float, noise_shares: float, received: int
    ) -> float: ...

    def upload_norm_bound(
        self, noise_multiplier: float, clipping_norm: float, noise_shares: float, dim: int
    ) -> float: ...

    def server_view(self) -> ServerView: ...


ROLE_PROTOCOLS: dict[str, type] = {
    "selection": SelectionRole,
    "mechanism": MechanismRole,
    "codec": CodecRole,
    "noise": NoiseRole,
}


def role_members(protocol: type) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the protocol's methods, its attributes), in the order declared."""
    methods = tuple(name for name, value in vars(protocol).items() if inspect.isfunction(value) and name[0] != "_")
    return methods, tuple(getattr(protocol, "__annotations__", {}))


def check_roles(part) -> None:
    """Refuse a part that claims an unknown role, or a role without one of its methods or attributes."""
    name = type(part).__name__
    for role in part.roles:
        if role not in ROLE_PROTOCOLS:
            raise TypeError(f"{name} claims the role {role!r}; the roles are {', '.join(ROLE_PROTOCOLS)}")
        methods, attributes = role_members(ROLE_PROTOCOLS[role])
        for method in methods:
            if not callable(getattr(part, method, None)):
                raise TypeError(f"{name} claims the role {role!r} but has no method {method}()")
        for attribute in attributes:
            if not hasattr(part, attribute):
                raise TypeError(f"{name} claims the role {role!r} but has no attribute {attribute!r}")
