"""ALI-DPFL's mirror of the clients' ledgers on the server (docs/algorithms.md §5): each node's DP-SGD steps and mu
releases charged from the cumulative counts it reports, keyed by its client id (asked of its node,
`strategies.parts.sampling.ClientIdentities`; the node id where no node answers), and the public partition size that
weighs its model. Functions of the strategy (`strategies.sample_level.ali_dpfl.ALIDPFL`), whose
state they read and update."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from logging import WARNING

from flwr.common import log

from dpfl.dpcore.privacy import protocol as keys
from dpfl.dpcore.privacy.accountants import epsilon_of
from dpfl.strategies.sample_level.local_steps import reply_metrics_problem


def client_of(ali, node: int) -> int:
    """The client id the records of `node` are kept under (its ClientSampling's `ClientIdentities`)."""
    return ali.selection.identities.client_of(node)


def update_ledgers(ali, server_round: int, replies: list[dict], clients: list[int]) -> None:
    """Charge each client's new DP-SGD steps and mu releases, from its cumulative counts, never beyond
    what the server asked for (the sum of tau over the rounds so far; the rounds that asked for mu).

    Cumulative counts make the mirror whole again after a lost reply. The epsilon the
    client computed itself must agree with the mirror; a mismatch is logged.
    """
    assert ali.ledger is not None
    asked_steps = sum(ali.schedule.tau_list)
    for m, pid in zip(replies, clients):  # pid: the client id of the node the SuperLink gave the reply
        ali.spent.dataset_sizes[pid] = int(m[keys.NUM_EXAMPLES])
        known_steps, known_releases = ali.spent.steps_taken.get(pid, 0), ali.spent.mu_releases.get(pid, 0)
        steps = min(max(int(m[keys.DPSGD_STEPS]), known_steps), asked_steps)
        releases = min(max(int(m.get(keys.MU_RELEASES, 0)), known_releases), ali.spent.mu_rounds)
        if steps > known_steps:
            ali.ledger.record(pid, ali.noise.accounted, ali.dpsgd.batch_sample_rate, steps - known_steps)
        if releases > known_releases:
            ali.ledger.record(pid, ali.dpsgd.mu_noise_multiplier, 1.0, releases - known_releases)
        ali.spent.steps_taken[pid], ali.spent.mu_releases[pid] = steps, releases
        mirrored = ali.ledger.clients[pid].epsilon() if pid in ali.ledger.clients else 0.0
        reported = float(m.get(keys.EPSILON, mirrored))
        if not math.isclose(mirrored, reported, rel_tol=1e-6, abs_tol=1e-9):
            log(
                WARNING,
                "Round %d: client %d reports epsilon %.6g, its mirrored ledger gives %.6g",
                server_round,
                pid,
                reported,
                mirrored,
            )


def claimed_epsilon(ali) -> float:
    """max over clients of the epsilon the paper's analysis would print (DP-SGD at sigma_H)."""
    assert ali.ledger is not None
    return max(
        (
            epsilon_of(
                [
                    (ali.dpsgd.sample_noise_multiplier, ali.dpsgd.batch_sample_rate, steps),
                    (ali.dpsgd.mu_noise_multiplier, 1.0, ali.spent.mu_releases.get(pid, 0)),
                ],
                ali.ledger.delta,
                ali.dpsgd.accountant,
            )
            for pid, steps in ali.spent.steps_taken.items()
        ),
        default=0.0,
    )


@dataclass
class ClientSpending:
    """The server's mirror of each client's ledger, keyed by client id (that of the node the SuperLink gives the
    reply): DP-SGD steps and mu releases charged, |D_i|, the rounds that asked for a mu release, and whether no
    client has a step left."""

    steps_taken: dict[int, int] = field(default_factory=dict)  # client id -> cumulative DP-SGD steps
    mu_releases: dict[int, int] = field(default_factory=dict)  # client id -> cumulative mu releases
    dataset_sizes: dict[int, int] = field(default_factory=dict)  # client id -> |D_i|
    mu_rounds: int = 0
    clients_out_of_budget: bool = False

    @property
    def total_steps(self) -> int:
        """t of Algorithm 2: the most DP-SGD steps any client has taken."""
        return max(self.steps_taken.values(), default=0)

    def state_dict(self) -> dict:
        """The tables for the checkpoint (JSON keys are strings)."""
        return {
            "steps_taken": {str(k): v for k, v in self.steps_taken.items()},
            "mu_releases": {str(k): v for k, v in self.mu_releases.items()},
            "dataset_sizes": {str(k): v for k, v in self.dataset_sizes.items()},
            "mu_rounds": self.mu_rounds,
            "clients_out_of_budget": self.clients_out_of_budget,
        }

    def load_state_dict(self, state: dict) -> None:
        def by_pid(d: dict) -> dict:
            return {int(k): int(v) for k, v in d.items()}

        self.steps_taken, self.mu_releases = by_pid(state["steps_taken"]), by_pid(state["mu_releases"])
        self.dataset_sizes, self.mu_rounds = by_pid(state["dataset_sizes"]), int(state["mu_rounds"])
        self.clients_out_of_budget = bool(state["clients_out_of_budget"])


def row_problem(ali, metrics: dict, tau: int) -> tuple[str | None, float]:
    """(why a DP-SGD client's reply cannot be used, or None; its averaging weight p_i before normalising).

    The weight is the public size of the partition the reply names (`partition_size`), which its num-examples
    must equal; without `partition_size`, 1. The partition id and count a node sends are not authenticated, so
    they bind nothing: any node may name any partition (at worst it takes the largest public size as its
    weight), and no reply can take another's ledger or step count (those are keyed by the client id its node
    answered the identity query with, refused to a second connected node)."""
    problem = reply_metrics_problem(metrics)
    if problem is None and metrics[keys.LOCAL_STEPS] > tau:
        problem = f"{metrics[keys.LOCAL_STEPS]} local steps taken, {tau} asked"
    if problem or ali.server_data.partition_size is None:
        return problem, 0.0 if problem else 1.0
    pid, reported, partitions = (
        int(metrics[keys.PARTITION_ID]),
        metrics[keys.NUM_EXAMPLES],
        reply_partitions(ali, metrics),
    )
    if partitions < ali.population.num_clients:
        return (
            f"num-partitions {partitions} is fewer than the {ali.population.num_clients} nodes connected at the start",
            0.0,
        )
    try:
        public = int(ali.server_data.partition_size(pid, partitions))
    except Exception as exc:  # e.g. out of range: nothing a client sends may raise
        return f"partition id {pid} of {partitions}: {exc}", 0.0
    if reported != public:
        return f"num-examples {reported} differs from partition {pid}'s public size {public} (of {partitions})", 0.0
    return None, float(public)


def reply_partitions(ali, metrics: dict) -> int:
    """The number of partitions a reply's public size is looked up for: the run config's num-partitions, else the
    one the node reports from its node config, else the number of nodes connected at the start."""
    return ali.dpsgd.num_partitions or int(metrics.get(keys.NUM_PARTITIONS, ali.population.num_clients))
