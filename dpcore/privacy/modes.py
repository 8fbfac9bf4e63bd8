"""The modes of a DP run as `str` enums, as Flower 1.42's `PrivacyConfig` declares its `SamplingMethod`: one
member per allowed value. A member equals its string (`NoisePlacementMode.LOCAL == "local"`) and prints as it
(`StrEnum`), so a setting read from a run config or a saved ledger compares with the members, and nothing
printed or recorded changes. Code compares a mode with these members, never with a string literal
(tests/test_modes.py). `ServerView` is what a noise placement means for the server, and `SamplingForm` what a
selection's sampling means for the release, which the ledger asks instead of their names.
"""

from dataclasses import dataclass
from enum import StrEnum


class NoisePlacementMode(StrEnum):
    """Who adds the Gaussian noise (docs/algorithms.md §0; the parts in strategies/parts/noise_placement.py)."""

    CENTRAL = "central"  # the server clips and adds N(0, sigma^2 C^2 I) to the sum
    DISTRIBUTED = "distributed"  # each client adds N(0, sigma^2 C^2 / n_s I); the server tops up
    LOCAL = "local"  # each client adds N(0, sigma^2 C^2 I) to its own update


class ClientSamplingMode(StrEnum):
    """How a round's clients are drawn."""

    POISSON = "poisson"  # each node with probability q
    FIXED = "fixed"  # exactly m = round(q M) nodes


class TargetEpsilonMode(StrEnum):
    """What a target epsilon does."""

    STOP = "stop"  # stop before a round would exceed it
    CALIBRATE = "calibrate"  # choose sigma so the configured rounds end at it


class PrivacyUnit(StrEnum):
    """What one unit of privacy protects."""

    CLIENT = "client"  # client-level DP: all of a client's data
    SAMPLE = "sample"  # sample-level DP-SGD: one training example


def values(mode: type[StrEnum]) -> tuple[str, ...]:
    """The allowed strings of a mode, in declaration order."""
    return tuple(member.value for member in mode)


@dataclass(frozen=True)
class ServerView:
    """What the server sees of a round, as the noise placement answers it (the noise role's `server_view`,
    strategies/parts/noise_placement.py); the ledger asks this, never the placement's name.

    - `trusted`: the server sees the raw clipped updates, so there is no DP against it (central noise);
    - `uploads_private`: every upload carries all the noise N(0, sigma^2 C^2 I) on its own, local DP: each round
      is the Gaussian mechanism at sigma / 2 (replace-one) with q = 1, against the model and the server alike;
    - neither: every upload carries a share N(0, sigma^2 C^2 / n_s I) (distributed noise): the server figure
      charges one upload at sigma / (2 sqrt(n_s)), or under SecAgg+ the sum of the shares that arrived.

    `name`: the placement's name, which the ledger's state records.
    """

    name: str = "central"
    trusted: bool = True
    uploads_private: bool = False


TRUSTED_SERVER = ServerView()  # central noise: the ledger's default


@dataclass(frozen=True)
class SamplingForm:
    """How a round's clients are drawn, as the selection part answers it (the selection role's `sampling_form`,
    strategies/parts/sampling.py); the ledger asks this, never the sampling's name.

    - `fixed_size`: exactly m of the N connected nodes: each release is charged replace-one as (sigma / 2, q = 1),
      with dp-accounting's bound for sampling without replacement where N and m are known, and no truncation;
    - otherwise Poisson (each node with probability q): the sampled Gaussian mechanism (sigma, q), add/remove-one.

    `name`: the sampling's name, which the ledger's state records.
    """

    name: str = "poisson"
    fixed_size: bool = False


SAMPLING_FORMS = {  # by name: a saved ledger records the name
    ClientSamplingMode.POISSON: SamplingForm(ClientSamplingMode.POISSON, fixed_size=False),
    ClientSamplingMode.FIXED: SamplingForm(ClientSamplingMode.FIXED, fixed_size=True),
}
