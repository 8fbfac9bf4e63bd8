"""DP-FTRL (Kairouz, McMahan, Song, Thakkar, Thakurta and Xu, "Practical and Private (Deep) Learning without
Sampling or Shuffling", ICML 2021, arXiv 2103.00039): client-level DP without any sampling assumption, a part
the DP wrapper is composed with (docs/dp-toolbox.md §4):

    DifferentialPrivacy(FedAvg(), clipping_norm=C, noise_multiplier=sigma, sample_rate=q,
                        noise_placement="central", ftrl=DPFTRL(epoch_rounds=b, momentum=0.0))

Real devices join when they can, so the server cannot promise the uniform sampling that amplification needs.
DP-FTRL needs none; what it needs instead is a participation rule, which this part enforces:

- the run is cut into epochs of b rounds (rounds (j-1)b+1 .. jb); a client takes part in at most one round per
  epoch. A client is its client id, which the server asks each node for once (`strategies.parts.sampling.
  ClientIdentities`: node config `client-id`, else `partition-id`), so a SuperNode that restarts under a new node
  id keeps its client's record; the run refuses to start where a node offers none. Each round the server sends
  the train message to m = max(1, round(q M)) of the nodes whose clients have not taken part in the epoch yet
  (fewer if fewer are eligible; which ones does not matter to the guarantee) and marks those clients as having
  taken part; the round loop's reply gate refuses any reply from a node it did not send this round's message to
  (the SuperLink's node id of the reply, never an id a client sends), and a second reply from one it did;
- the server keeps the running sum of the rounds' sums of clipped updates (each client's update clipped to
  C), released through the binary-tree mechanism (`dpcore.privacy.tree_aggregation`), one tree per epoch,
  each node with noise N(0, sigma^2 C^2 I) from OS entropy; a completed epoch's noisy total is carried over;
- the model is w_t = w_0 + eta (noisy prefix sum of the updates) / m (FTRL; eta: the wrapper's
  server_learning_rate), or with server momentum gamma (the paper's DP-FTRLM): g_t = P_t - P_{t-1} of the noisy
  prefix sums P, v_t = gamma v_{t-1} + g_t, w_t = w_0 + eta (v_1 + ... + v_t) / m. Both are post-processing of
  the released prefix sums.

Each epoch's tree is one `SingleEpochTreeAggregationDpEvent(sigma, steps)` in the ledger
(`dpcore.privacy.ledger.TreeAggregationLedger`).
"""

from __future__ import annotations

import numpy as np

from dpfl.dpcore.privacy.ledger import TreeAggregationLedger
from dpfl.dpcore.privacy.mechanisms import make_rng, sum_updates
from dpfl.dpcore.privacy.settings import require
from dpfl.dpcore.privacy.tree_aggregation import TreeNoise, nodes_in_prefix
from dpfl.strategies.parts.noise_placement import PLACEMENTS
from dpfl.strategies.parts.part import Part
from dpfl.strategies.parts.sampling import ClientIdentities, Selection, round_note

NOISE_STREAM = 21  # make_rng stream of the tree nodes' noise (seeded runs only)
SELECTION_STREAM = 22


class DPFTRL(Part):
    """The participation rule (the selection role), the tree-aggregated noise and the FTRL model (the mechanism
    role) of DP-FTRL (one run per instance).

    epoch_rounds : b, rounds per epoch; a client takes part at most once per epoch (0: M // m, the longest epoch in
        which every client can take part once with full rounds; b >= num-rounds: at most once in the run).
    momentum : gamma of DP-FTRLM's server momentum (0: plain DP-FTRL).
    """

    roles = ("selection", "mechanism")
    sampling_form = None  # no sampling: its own ledger charges the participation rule
    keyword = "ftrl"

    def __init__(self, epoch_rounds: int = 0, momentum: float = 0.0) -> None:
        require(
            int(epoch_rounds) == epoch_rounds and epoch_rounds >= 0,
            "epoch_rounds",
            epoch_rounds,
            "must be an integer >= 0 (0: number of nodes // clients per round)",
        )
        require(0 <= momentum < 1, "ftrl_momentum", momentum, "must be in [0, 1)")
        self.requested_epoch_rounds = int(epoch_rounds)
        self.momentum = float(momentum)
        self.epoch_rounds = 0  # b, fixed with the population
        self.clients_per_round = 0  # m
        self.identities = ClientIdentities()  # node id -> client id (asked of the node)
        self.last_epoch: dict[int, int] = {}  # client id -> the last epoch its node was sent a train message in
        self.initial: np.ndarray | None = None  # w_0
        self.exact_sum: np.ndarray | None = None  # sum of every round's sum of clipped updates
        self.carried_noise: np.ndarray | None = None  # the released noise of the completed epochs' totals
        self.tree: TreeNoise | None = None
        self.tree_epoch = -1
        self.last_prefix: np.ndarray | None = None  # P_{t-1} (momentum)
        self.velocity: np.ndarray | None = None
        self.cumulative: np.ndarray | None = None  # v_1 + ... + v_t (momentum)

    # ------------------------------------------------------------------ rules
    def check(self, privacy, others: frozenset[str]) -> None:
        """The rules with the wrapper's settings (a strategy built from Python and a run config alike)."""
        check_ftrl(privacy, others, modes=("stop",))

    # ------------------------------------------------------------------ population, ledger
    def make_ledger(self, strategy, delta: float) -> TreeAggregationLedger:
        """Fix m and b from the population, and the ledger with one tree per epoch (the part's own state)."""
        self.clients_per_round = max(1, round(strategy.population.sample_rate * strategy.population.num_clients))
        self.epoch_rounds = self.requested_epoch_rounds or max(
            1, strategy.population.num_clients // self.clients_per_round
        )
        return TreeAggregationLedger(delta, strategy.privacy.accountant, self.epoch_rounds)

    def ledger_from_state(self, state: dict) -> TreeAggregationLedger:
        raise ValueError(
            "a DP-FTRL run cannot resume: its tree's noise is not checkpointed, and redrawing it "
            "would release the same nodes twice"
        )

    def accounted_noise_multiplier(self, strategy) -> float:
        return strategy.privacy.noise_multiplier

    def epoch(self, server_round: int) -> int:
        return (int(server_round) - 1) // self.epoch_rounds

    # ------------------------------------------------------------------ the participation rule
    def identify(self, strategy, grid, server_round: int, node_ids: list[int]) -> list[int]:
        """The connected nodes that hold a client id (`ClientIdentities.resolve`; round 1 refuses to start where a
        node offers none)."""
        return self.identities.resolve(grid, server_round, node_ids, round_note(strategy, server_round))

    def select(self, strategy, server_round: int, node_ids: list[int]) -> Selection:
        """Up to m of the nodes whose clients have not taken part in this epoch, those clients marked as having taken
        part (no sampling: nothing truncated, no sampling-without-replacement bound)."""
        epoch = self.epoch(server_round)
        clients = client_ids(self.identities, node_ids)
        eligible = [n for n in sorted(clients) if self.last_epoch.get(clients[n]) != epoch]
        chosen = choose(strategy, SELECTION_STREAM, server_round, eligible, self.clients_per_round)
        for node in chosen:
            self.last_epoch[clients[node]] = epoch
        return Selection(chosen)

    def next_truncation_probability(self, strategy) -> float:
        """The tree's ledger takes no sampling reserve."""
        return 0.0

    # ------------------------------------------------------------------ the tree and the model
    def release(
        self, strategy, server_round: int, updates: list[np.ndarray], global_vector: np.ndarray, received: int
    ) -> tuple[np.ndarray, float]:
        """(w_0 + eta (noisy prefix sum, or its momentum form) / m, the std of the prefix sum's noise); the wrapper
        charges the round (one more leaf of the epoch's tree)."""
        size = global_vector.size
        if self.initial is None:
            self.initial = global_vector.astype(np.float32, copy=True)
            self.exact_sum = np.zeros(size, np.float32)
            self.carried_noise = np.zeros(size, np.float32)
        epoch = self.epoch(server_round)
        if self.tree is None or epoch != self.tree_epoch:
            if self.tree is not None:
                self.carried_noise += self.tree.prefix_noise()  # the completed epoch's released total
            self.tree_epoch = epoch
            std = strategy.privacy.noise_multiplier * strategy.privacy.clipping_norm
            self.tree = TreeNoise(
                size,
                std,
                lambda t, e=epoch: make_rng(strategy.run.seed, NOISE_STREAM, e, t, secure=strategy.run.secure_rng),
            )
        if updates:
            self.exact_sum += sum_updates(updates, size)
        noise = self.tree.next_prefix_noise()
        std = float(
            strategy.privacy.noise_multiplier
            * strategy.privacy.clipping_norm
            * np.sqrt(nodes_in_prefix(self.tree.steps))
        )
        prefix = self.exact_sum + self.carried_noise + noise
        if self.momentum > 0:
            gradient = prefix - (self.last_prefix if self.last_prefix is not None else 0.0)
            self.velocity = gradient if self.velocity is None else np.float32(self.momentum) * self.velocity + gradient
            self.cumulative = self.velocity.copy() if self.cumulative is None else self.cumulative + self.velocity
            self.last_prefix = prefix
            prefix = self.cumulative
        eta = np.float32(strategy.run.server_learning_rate)
        return self.initial + eta * prefix / np.float32(self.clients_per_round), std

    def describe(self, strategy) -> dict:
        return {"ftrl": self.describe_settings()}

    def describe_settings(self) -> dict:
        return {
            "epoch_rounds": self.epoch_rounds,
            "clients_per_round": self.clients_per_round,
            "momentum": self.momentum,
            "participation_rule": f"each client (its client id, asked of its node) at most once per epoch of "
            f"{self.epoch_rounds} rounds, enforced by the server (the nodes of ineligible clients are not sent a "
            "train message and their replies are refused)",
        }


def client_ids(identities: ClientIdentities, node_ids: list[int]) -> dict[int, int]:
    """{node id: its client id} of the nodes that hold one (the round loop asked `identify` first; a node left out
    there is not here)."""
    if not identities.started:
        raise RuntimeError(
            "DP-FTRL keeps each client's participation record by client id, which the Message-API round loop asks "
            "each node for before it selects (configure_train calls the selection's identify); this path selects "
            "without asking (Flower's legacy workflow, LegacyDPFedAvg, does), so DP-FTRL refuses to start here: "
            "run it with the Message-API wrapper, DifferentialPrivacy(..., ftrl=...) in a ServerApp"
        )
    return {int(n): identities.client_of(n) for n in node_ids if identities.by_node_id or int(n) in identities.claims}


def choose(strategy, stream: int, server_round: int, eligible: list[int], m: int) -> list[int]:
    """Up to m of the eligible node ids, uniformly (seeded per round, or OS entropy), sorted."""
    rng = make_rng(strategy.run.seed, stream, server_round, secure=strategy.run.secure_rng)
    picks = rng.choice(len(eligible), size=min(len(eligible), m), replace=False)
    return sorted(int(eligible[i]) for i in picks)  # indices: numpy would turn ids >= 2^63 into floats


def check_ftrl(privacy, others: frozenset[str], modes: tuple[str, ...]) -> None:
    """The rules of DP-FTRL (any noise) with the wrapper's settings; `modes`: the target_epsilon_mode it supports."""
    require(
        not PLACEMENTS[privacy.noise_placement].clients_add_noise,
        "noise_placement",
        privacy.noise_placement,
        "DP-FTRL (run-config algorithm 'dp-ftrl') adds its noise at the server: use 'central'",
    )
    require(
        "secure_aggregation" not in others,
        "secure_aggregation",
        "secure_aggregation" in others,
        "DP-FTRL keeps a running sum at the server; SecAgg+ is not supported with it",
    )
    require(
        "adaptive_clipping" not in others,
        "adaptive_clipping",
        "adaptive_clipping" in others,
        "DP-FTRL's noise charges a fixed clipping norm; adaptive clipping is not supported with it",
    )
    require(
        "audit_canaries" not in others,
        "audit_canaries",
        "audit_canaries" in others,
        "the canary audit assumes sampling",
    )
    require(
        privacy.target_epsilon_mode in modes,
        "target_epsilon_mode",
        privacy.target_epsilon_mode,
        f"this DP-FTRL noise supports {' or '.join(map(repr, modes))} (the tree's noise is not calibrated; "
        "ftrl-strategy 'blt' or 'banded' is)",
    )
    require(
        privacy.noise_multiplier > 0 and privacy.clipping_norm > 0,
        "noise_multiplier",
        privacy.noise_multiplier,
        "DP-FTRL needs noise_multiplier > 0 and clipping_norm > 0 (the non-private reference is dp-fedavg)",
    )
