"""The binary-tree mechanism for private prefix sums (Dwork, Naor, Pitassi and Rothblum 2010; Chan, Shi and
Song 2011), as DP-FTRL uses it (Kairouz et al., "Practical and Private (Deep) Learning without Sampling or
Shuffling", arXiv 2103.00039; docs/dp-toolbox.md §4).

Leaves x_1, x_2, ... arrive one per step (in DP-FTRL: a round's sum of clipped client updates). The prefix sum
S_t = x_1 + ... + x_t is released as S_t + Z_t, where Z_t is the sum of the noises of the dyadic tree nodes
that cover [1, t]: one node per set bit of t (the node of level l covers 2^l leaves). Each node's noise,
N(0, std^2 I), is drawn once, when the node completes, and reused by every later prefix sum that contains it.
So Z_t has popcount(t) std^2 variance per coordinate (`nodes_in_prefix`), at most ceil(log2(t + 1)), and one
leaf lies in at most one released node per level: `tree_depth(T)` = ceil(log2(T + 1)) nodes over T steps.

Only noise is kept (the exact running sum is the caller's): at step t the node of level v2(t) (trailing zeros
of t) completes and replaces the noise kept for its level, and the lower levels, no longer in [1, t]'s cover,
are dropped, so at most ceil(log2(t + 1)) vectors are held. Nodes that never enter a released prefix sum (the
left children of a completed node once their parent completes) get no noise at all.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .mechanisms import gaussian_noise


def tree_depth(steps: int) -> int:
    """ceil(log2(steps + 1)): the most released nodes one leaf lies in over `steps` steps (0 for none)."""
    return max(0, int(steps)).bit_length()


def nodes_in_prefix(t: int) -> int:
    """How many tree nodes the prefix sum of step t adds up: the set bits of t."""
    return bin(int(t)).count("1")


class TreeNoise:
    """The noise of the binary-tree mechanism for one tree: `next_prefix_noise()` at step t gives Z_t.

    dim : the length of the leaves. std : each node's noise std (sigma * C in DP-FTRL). rng : step t -> the
    generator of the node that completes at step t (OS entropy unless the caller seeds it).
    """

    def __init__(self, dim: int, std: float, rng: Callable[[int], np.random.Generator]) -> None:
        self.dim, self.std, self.rng = int(dim), float(std), rng
        self.steps = 0
        self.nodes: dict[int, np.ndarray] = {}  # level -> noise of the node of that level in [1, steps]'s cover

    def next_prefix_noise(self) -> np.ndarray:
        """Step t = steps + 1: the node of level v2(t) completes (fresh noise); Z_t, the sum over [1, t]'s cover."""
        t = self.steps + 1
        level = (t & -t).bit_length() - 1
        for lower in range(level):  # covered by the node that completes now: never in a later prefix's cover
            self.nodes.pop(lower, None)
        self.nodes[level] = gaussian_noise(self.dim, self.std, self.rng(t))
        self.steps = t
        return self.prefix_noise()

    def prefix_noise(self) -> np.ndarray:
        """Z_t of the current step (zeros before the first)."""
        total = np.zeros(self.dim, np.float32)
        for noise in self.nodes.values():
            total += noise
        return total
