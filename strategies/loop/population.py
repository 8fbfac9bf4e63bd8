"""Who takes part in a DP run: the population M the round loop waits for, and q, m and n_s derived from it. An
object the round loop holds (`DPRoundLoop.population`), built from `SamplingOptions` and fixed once the nodes are
there; the ledger reads it."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from logging import INFO

from flwr.common import log

from dpfl.dpcore.privacy.mechanisms import noise_share_count
from dpfl.dpcore.privacy.modes import ClientSamplingMode
from dpfl.dpcore.privacy.settings import CLIENT_SAMPLINGS, one_of, require
from dpfl.strategies.loop.options import SamplingOptions, refuse_more_than_connected


@dataclass
class Population:
    """q, the sampling, the nodes to wait for; once fixed (`fix`), M, m and n_s.

    sample_rate : q (with `num_sampled_clients` given: m / M once M is known).
    num_clients : M, the nodes connected when the population was fixed.
    expected_clients : m, the expected clients per round (q M; round(q M), at least 1, for fixed-size sampling).
    noise_shares : n_s, the most clients a round keeps (`noise_share_count`), covered again each round.
    """

    sample_rate: float
    client_sampling: str = ClientSamplingMode.POISSON
    min_available_nodes: int = 2
    num_sampled_clients: int = 0  # m given (Flower's wrappers); 0: round(q M)
    num_clients: int = 0
    expected_clients: float = 0.0
    noise_shares: int = 0

    @classmethod
    def of(cls, sampling: SamplingOptions) -> Population:
        """The population these options describe, its rules checked (a clear error naming the key)."""
        require(0 < sampling.sample_rate <= 1, "sample_rate", sampling.sample_rate, "must be in (0, 1]")
        one_of("client_sampling", sampling.client_sampling, CLIENT_SAMPLINGS)
        m = sampling.num_sampled_clients
        require(
            m == 0 or sampling.client_sampling == ClientSamplingMode.FIXED,
            "num_sampled_clients",
            m,
            "is a fixed-size sample: only with client_sampling = 'fixed'",
        )
        require(m >= 0, "num_sampled_clients", m, "must be >= 0")
        return cls(sampling.sample_rate, sampling.client_sampling, sampling.min_available_nodes, m)

    def fix(self, num_clients: int) -> None:
        """M = `num_clients`; then q (= m / M when m is given), m and n_s."""
        self.num_clients = num_clients
        if self.num_sampled_clients:  # m given: q = m / M
            refuse_more_than_connected(self.num_sampled_clients, num_clients, self.min_available_nodes)
            self.sample_rate = self.num_sampled_clients / num_clients
        if self.client_sampling == ClientSamplingMode.FIXED:
            self.expected_clients = float(max(1, round(self.sample_rate * num_clients)))
        else:
            self.expected_clients = self.sample_rate * num_clients
        self.noise_shares = noise_share_count(num_clients, self.sample_rate, self.client_sampling)

    def wait(self, count_nodes: Callable[[], int], poll_seconds: float = 1.0) -> int:
        """Until `count_nodes()` >= min_available_nodes; the count then."""
        while (available := count_nodes()) < self.min_available_nodes:
            log(INFO, "Waiting for nodes: %d connected, %d required", available, self.min_available_nodes)
            time.sleep(poll_seconds)
        return available

    def state_dict(self) -> dict:
        return {
            "num_clients": self.num_clients,
            "expected_clients": self.expected_clients,
            "noise_shares": self.noise_shares,
        }

    def load_state_dict(self, state: dict) -> None:
        """M, m and n_s as saved; q again m / M where m was given (not saved: it follows from them)."""
        self.num_clients, self.expected_clients = int(state["num_clients"]), float(state["expected_clients"])
        self.noise_shares = int(state["noise_shares"])
        if self.num_sampled_clients and self.num_clients:
            self.sample_rate = self.num_sampled_clients / self.num_clients
