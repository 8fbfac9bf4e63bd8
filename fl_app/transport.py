"""Transport: how the ServerApp talks to the nodes through Flower's Grid, apart from what a run does.

- `wait_for_nodes`: before round 1, wait until min-nodes nodes are connected (in a simulation, until the count is
  steady), or refuse the run naming the key and the number to set (`TooFewNodes`);
- `PromptGrid`: a Grid that polls for replies every `interval` seconds instead of Flower's 3 s, public Grid API only.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from logging import INFO

from flwr.app import Message
from flwr.common import log
from flwr.serverapp import Grid
from flwr.supercore.run import Run


class PromptGrid(Grid):
    """A Grid that looks for replies every `interval` seconds (Flower 1.41's deployed Grid waits 3 s between
    looks, which a round pays once per message exchange: four times per round under SecAgg+). Public Grid API
    only. `pulls_end_by(deadline)`: a context in which the pulls of a reply's objects end at the timeout
    (`flower-speed-patches`: dpfl_tools.pull_backoff.object_pulls_end_by; default: none, Flower's own limit)."""

    def __init__(self, grid: Grid, interval: float = 0.1, pulls_end_by=None) -> None:
        self.grid, self.interval = grid, interval
        self.pulls_end_by = pulls_end_by or (lambda deadline: nullcontext())

    def set_run(self, run: Run) -> None:
        self.grid.set_run(run)

    @property
    def run(self) -> Run:
        return self.grid.run

    def create_message(self, *args, **kwargs) -> Message:
        return self.grid.create_message(*args, **kwargs)

    def get_node_ids(self):
        return self.grid.get_node_ids()

    def get_nodes(self):
        return self.grid.get_nodes()

    def push_messages(self, messages):
        return self.grid.push_messages(messages)

    def pull_messages(self, reply_to_message_ids=None, *, message_ids=None):
        """The replies to `reply_to_message_ids` (Flower 1.43's name; `message_ids`, 1.41/1.42's, is taken too),
        asked of the grid positionally, where both releases take them."""
        if message_ids is not None and reply_to_message_ids is not None:
            raise TypeError("pull_messages: give reply_to_message_ids or message_ids, not both")
        return self.grid.pull_messages(message_ids if message_ids is not None else reply_to_message_ids)

    def send_and_receive(self, messages, *, timeout: float | None = None) -> list[Message]:
        """Flower's send_and_receive (push, then pull until every reply is in or `timeout`), polling faster.
        Pulls of a reply's objects end at the timeout too (`pulls_end_by`), and one last pull at the
        timeout takes the replies already complete: replies that came while a withheld one held a pull."""
        pending = {m for m in self.push_messages(messages) if m}  # not pushed: None (1.41/1.42) or "" (1.43)
        deadline = None if timeout is None else time.monotonic() + timeout
        replies: list[Message] = []

        def pull() -> None:
            with self.pulls_end_by(deadline):
                got = list(self.pull_messages(pending))
            replies.extend(got)
            pending.difference_update(m.metadata.reply_to_message_id for m in got)

        pulls = 0
        while pending and (deadline is None or time.monotonic() < deadline):
            pull()
            pulls += 1
            if pending:
                time.sleep(self.interval)
        if pending and pulls:
            pull()  # a last look at the deadline: complete replies only (no time left for objects)
        return replies


class TooFewNodes(RuntimeError):
    """Fewer nodes are connected than the run config's min-nodes, and no more will come."""


def is_simulation(grid: Grid) -> bool:
    """Whether the grid is Flower's simulation grid (all SuperNodes register when the simulation starts)."""
    try:
        from flwr.superlink.grid import InMemoryGrid
    except ImportError:  # pragma: no cover - another Flower layout: treated as a deployment (the timeout applies)
        return False
    return isinstance(grid, InMemoryGrid)


def wait_for_nodes(
    grid: Grid,
    min_nodes: int,
    timeout: float,
    *,
    simulation: bool,
    poll: float = 0.5,
    settle: float = 5.0,
    steady: float = 1.0,
) -> int:
    """The number of connected nodes once it reaches min-nodes (in a simulation, once it has also stayed the
    same for `steady` s: the population M is fixed from it). A simulation's count that stays below min-nodes
    for `settle` s (its SuperNodes have registered) is refused at once; elsewhere after `timeout` s. The error
    names the key and the number to set."""
    start = time.monotonic()
    count, changed = -1, start
    while True:
        now, seen = time.monotonic(), len(list(grid.get_node_ids()))
        if seen != count:
            count, changed = seen, now
            if seen < min_nodes:
                log(INFO, "Waiting for nodes: %d connected, run-config key 'min-nodes' = %d", seen, min_nodes)
        if seen >= min_nodes and (not simulation or now - changed >= steady):
            return seen
        if simulation and 0 < seen < min_nodes and now - changed >= settle:
            raise TooFewNodes(
                f"run-config key 'min-nodes' = {min_nodes}, but the simulation has {seen} SuperNodes: "
                f'run with --federation-config "num-supernodes={min_nodes}" (or more), or set '
                f'--run-config "min-nodes={seen}"'
            )
        if now - start >= timeout:
            raise TooFewNodes(
                f"run-config key 'min-nodes' = {min_nodes}, but only {seen} nodes connected within "
                f"run-config key 'node-wait-timeout' = {timeout:g} s: start {min_nodes - seen} more "
                f'SuperNodes (or, in a simulation, --federation-config "num-supernodes={min_nodes}"), '
                f"or lower min-nodes"
            )
        time.sleep(min(poll, steady / 4) if simulation and seen >= min_nodes else poll)
