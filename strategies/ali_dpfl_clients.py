"""ALI-DPFL's mirror of the clients' ledgers on the server (docs/algorithms.md §5): which node holds which
partition, and each client's DP-SGD steps and mu releases charged from the cumulative counts it reports. Functions of
the strategy (`strategies.ali_dpfl.ALIDPFL`), whose state they read and update."""

from __future__ import annotations

import math
from logging import WARNING

from flwr.common import log

from dpcore.privacy import protocol as keys
from dpcore.privacy.accountants import epsilon_of

from .local_steps import reply_metrics_problem


def bind_partition(ali, node: int, pid: int) -> str | None:
    """Bind `node` to partition `pid` for the run (None), or why it cannot claim it: it is bound to another
    one, or another node that is still connected holds it. A partition whose node is gone (a restarted
    SuperNode gets a new id) passes to the new node with that node's ledger and counts."""
    bound = ali.partition_of.get(node)
    if bound is not None:
        return None if bound == pid else f"partition id {pid} reported, the node is bound to {bound}"
    holder = next((n for n, p in ali.partition_of.items() if p == pid), None)
    if holder is not None:
        if holder in ali.round.population:
            return f"partition id {pid} is bound to another node ({holder})"
        del ali.partition_of[holder]
        assert ali.ledger is not None
        for table in (ali.ledger.clients, ali.steps_taken, ali.mu_releases, ali.dataset_sizes):
            if holder in table:
                table[node] = table.pop(holder)
    ali.partition_of[node] = pid
    return None


def update_ledgers(ali, server_round: int, replies: list[dict], nodes: list[int]) -> None:
    """Charge each client's new DP-SGD steps and mu releases, from its cumulative counts, never beyond
    what the server asked for (the sum of tau over the rounds so far; the rounds that asked for mu).

    Cumulative counts make the mirror whole again after a lost reply. The epsilon the
    client computed itself must agree with the mirror; a mismatch is logged.
    """
    assert ali.ledger is not None
    asked_steps = sum(ali.tau_list)
    for m, pid in zip(replies, nodes):  # pid: the node id the SuperLink gave the reply
        ali.dataset_sizes[pid] = int(m[keys.NUM_EXAMPLES])
        known_steps, known_releases = ali.steps_taken.get(pid, 0), ali.mu_releases.get(pid, 0)
        steps = min(max(int(m[keys.DPSGD_STEPS]), known_steps), asked_steps)
        releases = min(max(int(m.get(keys.MU_RELEASES, 0)), known_releases), ali.mu_rounds)
        if steps > known_steps:
            ali.ledger.record(pid, ali.noise.accounted, ali.batch_sample_rate, steps - known_steps)
        if releases > known_releases:
            ali.ledger.record(pid, ali.mu_noise_multiplier, 1.0, releases - known_releases)
        ali.steps_taken[pid], ali.mu_releases[pid] = steps, releases
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
                    (ali.sample_noise_multiplier, ali.batch_sample_rate, steps),
                    (ali.mu_noise_multiplier, 1.0, ali.mu_releases.get(pid, 0)),
                ],
                ali.ledger.delta,
                ali.accountant,
            )
            for pid, steps in ali.steps_taken.items()
        ),
        default=0.0,
    )


def mirror_state(ali) -> dict:
    """The mirror's tables for the checkpoint (JSON keys are strings)."""

    def by_pid(d: dict) -> dict:
        return {str(k): v for k, v in d.items()}

    return {
        "steps_taken": by_pid(ali.steps_taken),
        "mu_releases": by_pid(ali.mu_releases),
        "dataset_sizes": by_pid(ali.dataset_sizes),
        "partition_of": by_pid(ali.partition_of),
        "mu_rounds": ali.mu_rounds,
        "clients_out_of_budget": ali.clients_out_of_budget,
    }


def load_mirror_state(ali, state: dict) -> None:
    def by_pid(d: dict) -> dict:
        return {int(k): int(v) for k, v in d.items()}

    ali.steps_taken, ali.mu_releases = by_pid(state["steps_taken"]), by_pid(state["mu_releases"])
    ali.dataset_sizes, ali.mu_rounds = by_pid(state["dataset_sizes"]), int(state["mu_rounds"])
    ali.partition_of = by_pid(state.get("partition_of", {}))
    ali.clients_out_of_budget = bool(state["clients_out_of_budget"])


def row_problem(ali, node: int, metrics: dict, tau: int) -> tuple[str | None, float]:
    """(why a DP-SGD client's reply cannot be used, or None; its averaging weight p_i before normalising).

    The node's partition id is the one it first reported (`bind_partition`); its public size, the weight."""
    problem = reply_metrics_problem(metrics)
    pid, reported = int(metrics[keys.PARTITION_ID]), metrics[keys.NUM_EXAMPLES]
    if problem is None and metrics[keys.LOCAL_STEPS] > tau:
        problem = f"{metrics[keys.LOCAL_STEPS]} local steps taken, {tau} asked"
    if problem is None and ali.partition_size is not None:
        try:
            public = int(ali.partition_size(pid, ali.partitions))
        except Exception as exc:  # e.g. out of range: nothing a client sends may raise
            return f"partition id {pid}: {exc}", 0.0
        if reported != public:
            return f"num-examples {reported} differs from partition {pid}'s public size {public}", 0.0
    if problem is None:
        problem = bind_partition(ali, node, pid)
    if problem:
        return problem, 0.0
    return None, float(public) if ali.partition_size is not None else 1.0
