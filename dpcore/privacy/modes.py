"""The modes of a DP run as `str` enums, as Flower 1.42's `PrivacyConfig` declares its `SamplingMethod`: one
member per allowed value. A member equals its string (`NoisePlacementMode.LOCAL == "local"`) and prints as it
(`StrEnum`), so a setting read from a run config or a saved ledger compares with the members, and nothing
printed or recorded changes. Code compares a mode with these members, never with a string literal
(tests/test_modes.py).
"""

from enum import StrEnum


class NoisePlacementMode(StrEnum):
    """Who adds the Gaussian noise (docs/algorithms.md §0; the parts in strategies/noise_placement.py)."""

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
