"""Who adds the Gaussian noise of client-level DP (docs/algorithms.md §0), as two small parts
that `DPFedAvg` is composed with, in the spirit of Flower's server-side and client-side
fixed-clipping DP wrappers.

- `CentralNoise`: a trusted server clips every update to C and adds N(0, sigma^2 C^2 I) to the sum.
- `DistributedNoise`: each client clips and adds its share N(0, sigma^2 C^2 / n_s I); the server
  adds the top-up N(0, sigma^2 C^2 (n_s - k)/n_s I) for the n_s - k shares that did not arrive, so
  the sum carries sigma^2 C^2 whatever the number k of participants (n_s: the round loop's
  `noise_shares`, `dpcore.privacy.mechanisms.noise_share_count`).
- `LocalNoise`: local DP, each client adds N(0, sigma^2 C^2 I) to its own clipped update; no server noise.

Each is a part of the wrapper (`strategies.parts.part.Part`): it writes the clients' privatizing config, refuses the
replies it cannot take, and says what it means for the server figure. Code that needs to know who adds noise asks
these objects (`server_adds_noise`, `clients_add_noise`, `noise_in_shares`), never their name.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import numpy as np

from dpfl.dpcore.privacy import protocol as keys
from dpfl.dpcore.privacy.mechanisms import clip_to_norm, distributed_noise_std, topup_noise_std
from dpfl.dpcore.privacy.modes import ServerView
from dpfl.strategies.parts.part import Part, fraction_evaluate, sees_only_the_sum
from dpfl.strategies.parts.reply_rules import upload_norm_bound


class NoisePlacement(Part, ABC):
    """Who adds the noise; the wrapper's `noise` (one of the three below), the noise role
    (`strategies.parts.roles.NoiseRole`)."""

    roles = ("noise",)
    keyword = "noise_placement"
    name = ""
    server_adds_noise = True  # the server adds all of it or tops it up
    clients_add_noise = False  # a reply counts only if its client (or mod) noised it: marked updates only
    noise_in_shares = False  # the noise is split into n_s client shares, topped up for the missing ones

    @classmethod
    def server_view(cls) -> ServerView:
        """What the server sees, which the ledger asks: the raw clipped updates unless clients add noise, and
        uploads private on their own where the server adds none (read off the class: no placement is built)."""
        return ServerView(cls.name, trusted=not cls.clients_add_noise, uploads_private=not cls.server_adds_noise)

    @abstractmethod
    def privatize_config(self, noise_multiplier: float, clipping_norm: float, noise_shares: float) -> dict:
        """The clients' train config: C, whether they privatize, their noise std."""

    @abstractmethod
    def server_clip(self, vector: np.ndarray, metrics: dict, clipping_norm: float) -> tuple[np.ndarray, float]:
        """(update to sum, its norm before clipping)."""

    @abstractmethod
    def server_noise_std(
        self, noise_multiplier: float, clipping_norm: float, noise_shares: float, received: int
    ) -> float:
        """The std of the noise the server adds to the sum of `received` updates."""

    @abstractmethod
    def upload_norm_bound(self, noise_multiplier: float, clipping_norm: float, noise_shares: float, dim: int) -> float:
        """The norm an honest upload stays below (inf: no bound)."""

    def client_config(self, dp, server_round: int) -> dict:
        return self.privatize_config(dp.update_noise_multiplier(), dp.privacy.clipping_norm, dp.population.noise_shares)

    def server_caveats(self, dp) -> list[str]:
        """Clients that noise their own uploads, without SecAgg+: what reaches the server in the clear beside the
        noisy upload, which the per-upload figure does not cover. Noise in shares: this project's clients and
        dp_privatize_mod send their update's norm before clipping (and TrainingClient its training loss and
        example count); either, with fraction_evaluate > 0, the clients' evaluate replies (loss, accuracy, example
        count). (Under SecAgg+ clients send weight 1 and no metrics, and the figure is a diagnostic.)"""
        if not self.clients_add_noise or sees_only_the_sum(dp) or dp.privacy.noise_multiplier <= 0:
            return []
        caveats = []
        if self.noise_in_shares:
            caveats.append(
                "clients send their update norm before clipping, training loss and example count in the clear "
                "beside the noisy upload: epsilon_against_server covers the upload only, not those figures"
            )
        if fraction_evaluate(dp) > 0:
            caveats.append(
                "clients' evaluate replies (loss, accuracy, example count; fraction-evaluate > 0) reach the server "
                "in the clear: epsilon_against_server covers the noisy uploads only, not those replies"
            )
        return caveats


class CentralNoise(NoisePlacement):
    """The server clips and adds all the noise. `clients_clip`: clients clip too (and report the
    norm they measured), as DP-FedAvg-WAV's Algorithm 2 has them do; the server clips again, so a
    client that did not clip still counts at most C."""

    name = "central"

    def __init__(self, clients_clip: bool = False) -> None:
        self.clients_clip = clients_clip

    def privatize_config(self, noise_multiplier: float, clipping_norm: float, noise_shares: float) -> dict:
        return {keys.CLIPPING_NORM: float(clipping_norm), keys.PRIVATIZE: self.clients_clip, keys.NOISE_STD: 0.0}

    def server_clip(self, vector: np.ndarray, metrics: dict, clipping_norm: float) -> tuple[np.ndarray, float]:
        """(update to sum, its norm before clipping)."""
        clipped, server_norm = clip_to_norm(vector, clipping_norm)
        if self.clients_clip:
            return clipped, float(metrics.get(keys.UPDATE_NORM, server_norm))
        return clipped, server_norm

    def server_noise_std(
        self, noise_multiplier: float, clipping_norm: float, noise_shares: float, received: int
    ) -> float:
        """sigma * C, whoever arrived."""
        return noise_multiplier * clipping_norm

    def upload_norm_bound(self, noise_multiplier: float, clipping_norm: float, noise_shares: float, dim: int) -> float:
        """No bound on what arrives: the server clips every update to C itself."""
        return math.inf


class DistributedNoise(NoisePlacement):
    """Clients clip and add their noise share; the server tops up the shares that did not arrive."""

    name = "distributed"
    clients_add_noise = True
    noise_in_shares = True

    def privatize_config(self, noise_multiplier: float, clipping_norm: float, noise_shares: float) -> dict:
        return {
            keys.CLIPPING_NORM: float(clipping_norm),
            keys.PRIVATIZE: True,
            keys.NOISE_STD: distributed_noise_std(noise_multiplier, clipping_norm, noise_shares),
        }

    def server_clip(self, vector: np.ndarray, metrics: dict, clipping_norm: float) -> tuple[np.ndarray, float]:
        """The client clipped and reported its norm before clipping."""
        return vector, float(metrics.get(keys.UPDATE_NORM, math.nan))

    def server_noise_std(
        self, noise_multiplier: float, clipping_norm: float, noise_shares: float, received: int
    ) -> float:
        """sigma * C * sqrt((n_s - k)/n_s) for the k shares received."""
        return topup_noise_std(noise_multiplier, clipping_norm, noise_shares, received)

    def upload_norm_bound(self, noise_multiplier: float, clipping_norm: float, noise_shares: float, dim: int) -> float:
        """The norm an honest upload (clipped to C plus its share) exceeds with probability <= 1e-12
        (no bound without clipping: the non-private reference)."""
        if clipping_norm <= 0:
            return math.inf
        return upload_norm_bound(
            clipping_norm, distributed_noise_std(noise_multiplier, clipping_norm, noise_shares), dim
        )


class LocalNoise(NoisePlacement):
    """Local DP (docs/dp-toolbox.md §2): each client clips and adds N(0, sigma^2 C^2 I) to its own update
    (`clients.local_dp.make_local_dp_mod`), so every upload is DP on its own and the server adds nothing. The
    server takes only uploads marked with a local noise multiplier of at least sigma, under the norm an honest
    one stays below."""

    name = "local"
    server_adds_noise = False
    clients_add_noise = True

    def privatize_config(self, noise_multiplier: float, clipping_norm: float, noise_shares: float) -> dict:
        """The client's mod decides its own noise; its training client is asked for the raw update."""
        return {keys.CLIPPING_NORM: float(clipping_norm), keys.PRIVATIZE: False, keys.NOISE_STD: 0.0}

    def server_clip(self, vector: np.ndarray, metrics: dict, clipping_norm: float) -> tuple[np.ndarray, float]:
        """The client clipped and noised; no norm before clipping is sent (NaN)."""
        return vector, math.nan

    def server_noise_std(
        self, noise_multiplier: float, clipping_norm: float, noise_shares: float, received: int
    ) -> float:
        return 0.0

    def upload_norm_bound(self, noise_multiplier: float, clipping_norm: float, noise_shares: float, dim: int) -> float:
        if clipping_norm <= 0:
            return math.inf
        return upload_norm_bound(clipping_norm, noise_multiplier * clipping_norm, dim)

    def reply_problem(self, dp, metrics: dict) -> str | None:
        """Why an upload is not locally private enough (no local noise multiplier, or a smaller one), else None."""
        noise_multiplier = dp.privacy.noise_multiplier
        local = metrics.get(keys.LOCAL_NOISE_MULTIPLIER)
        if local is None:
            return (
                "not locally privatized: under noise_placement = 'local' each client adds its own noise; add "
                "dpfl.make_local_dp_mod to the ClientApp's train"
            )
        if local < noise_multiplier * (1 - 1e-9):
            return f"local noise multiplier {local:g} below the configured {noise_multiplier:g}"
        return None


# name -> class: a part's `check` reads what a placement does (server_adds_noise, ...) off the class, building none
PLACEMENTS = {placement.name: placement for placement in (CentralNoise, DistributedNoise, LocalNoise)}


def server_view(name: str) -> ServerView:
    """What the server sees under the placement called `name` (a saved ledger records the name)."""
    return PLACEMENTS[name].server_view()


def noise_placement(name: str, clients_clip: bool = False) -> NoisePlacement:
    """The placement called `name` (`clients_clip`: under central noise, clients clip too)."""
    return CentralNoise(clients_clip) if PLACEMENTS[name] is CentralNoise else PLACEMENTS[name]()
