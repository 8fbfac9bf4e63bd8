"""The selection role: who is sent a round's train message (docs/algorithms.md §0).

`ClientSampling` is the round loop's own selection, Poisson (each node with probability q) or fixed-size (exactly
m = round(q M)), seeded per round. DP-FTRL's participation rule (`strategies.parts.dp_ftrl.DPFTRL`) fills the same role.
A selection returns a `Selection`: the nodes, and what the ledger must know about how they were drawn.
"""

from __future__ import annotations

from dataclasses import dataclass
from logging import INFO, WARNING

import numpy as np
from flwr.common import log

from dpfl.dpcore.privacy.mechanisms import TRUNCATION_PROBABILITY, make_rng, noise_share_count, truncation_probability
from dpfl.dpcore.privacy.modes import SAMPLING_FORMS, ClientSamplingMode
from dpfl.strategies.parts.part import Part


@dataclass(frozen=True)
class Selection:
    """The nodes a round sends its train message to.

    truncation_probability : P(this round's Poisson sample was truncated to n_s), reserved out of delta.
    sampled_from : (N, m) for fixed-size sampling, m of N nodes (the ledger's sampling-without-replacement bound).
    """

    nodes: list[int]
    truncation_probability: float = 0.0
    sampled_from: tuple[int, int] | None = None


class ClientSampling(Part):
    """Poisson or fixed-size sampling of the connected nodes (`client_sampling`)."""

    roles = ("selection",)
    sampling_form = SAMPLING_FORMS[ClientSamplingMode.POISSON]  # what the ledger charges (dpcore.privacy.modes)

    def __init__(self, client_sampling: str = ClientSamplingMode.POISSON) -> None:
        self.sampling_form = SAMPLING_FORMS[client_sampling]

    def select(self, dp, server_round: int, node_ids: list[int]) -> Selection:
        """Poisson (each with prob. q) or fixed-size (exactly m) sampling, seeded per round; a Poisson sample larger
        than n_s keeps a uniform n_s of it (probability <= 1e-12: n_s is re-derived for the round's population,
        `covering_noise_shares`; the ledger reserves the round's probability out of delta)."""
        rng = make_rng(dp.run.seed, 1, server_round, secure=dp.run.secure_rng)
        nodes = sorted(node_ids)
        if self.sampling_form.fixed_size:
            k = min(len(nodes), int(dp.population.expected_clients))
            if k < dp.population.expected_clients:
                log(
                    WARNING,
                    "Round %d: %d nodes connected, fewer than the m = %d a round samples: all %d are sampled "
                    "(charged as %d of %d; the noise is topped up to m shares)",
                    server_round,
                    len(nodes),
                    int(dp.population.expected_clients),
                    k,
                    k,
                    len(nodes),
                )
            return Selection(pick(rng, nodes, k), 0.0, (len(nodes), k))
        truncation = truncation_probability(len(nodes), dp.population.sample_rate, dp.population.noise_shares)
        sampled = [n for n, u in zip(nodes, rng.random(len(nodes))) if u < dp.population.sample_rate]
        if len(sampled) > dp.population.noise_shares:
            sampled = pick(rng, sampled, dp.population.noise_shares)
        return Selection(sampled, truncation)

    def next_truncation_probability(self, dp) -> float:
        """What the budget check assumes the next round reserves out of delta."""
        return 0.0 if self.sampling_form.fixed_size else max(TRUNCATION_PROBABILITY, dp.round.truncation_probability)


def covering_noise_shares(dp, population: int) -> int:
    """n_s for a round of `population` nodes. Poisson sampling: re-derived for the round's N
    (`noise_share_count(N, q)`: P(Binomial(N, q) >= n_s) <= 1e-12), so the noise shares cover the sample the round
    may draw whether the population grew or shrank; each client's share std sigma C / sqrt(n_s), the server's
    top-up and the ledger's truncation reserve follow it (logged when it changes). Fixed-size sampling keeps
    n_s = m (a smaller population's sample is topped up)."""
    if dp.population.client_sampling != ClientSamplingMode.POISSON:
        return dp.population.noise_shares
    shares = noise_share_count(population, dp.population.sample_rate, "poisson")
    if shares != dp.population.noise_shares:
        log(
            INFO,
            "Population %d nodes: n_s re-derived for it, %d -> %d noise shares (each client's noise std "
            "sigma C / sqrt(n_s))",
            population,
            dp.population.noise_shares,
            shares,
        )
    return shares


def pick(rng: np.random.Generator, node_ids: list[int], k: int) -> list[int]:
    """k of the node ids uniformly without replacement, sorted. Indices are drawn, not the ids: numpy would
    hold Flower's 64-bit node ids as floats and return ids of nodes that do not exist."""
    return sorted(node_ids[i] for i in rng.choice(len(node_ids), size=k, replace=False))
