"""An in-process Grid: runs a ClientApp for N simulated nodes in this process, no Ray.

For tests and benchmarks: the same ServerApp code path (strategy.start on a Grid) and
the same ClientApp code path (Message in, Message out, Context.state kept per node),
without a SuperLink. `flwr run` is the way to run the app for real.

One exchange at a time: Flower's legacy server (`flwr.server.Server`) asks its clients from a pool of threads,
one `send_and_receive` each. In one process their ClientApps would then run at once, and CPython 3.11 can raise
"SystemError: AST constructor recursion depth mismatch" where two threads parse at once (np.load parses each
array's header with `ast.literal_eval`): a client failed so in CI. The grids here run one exchange after the
other (`send_and_receive` holds `exchange_lock` around `exchange`), as their nodes share one interpreter.

Each grid is one run with a run id of its own, drawn at random as the SuperLink draws one (`fresh_run_id`), never a
constant: what a node keeps per run on disk (the Opacus ledger of `clients.opacus_ledger`, a personal head under
node config `state-dir`) is named by it, and two runs in one process, or in two processes on one machine, must not
share it.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterable, Mapping
from copy import deepcopy
from itertools import count
from threading import RLock
from typing import Any

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

from dpfl.fl_app.settings import Settings

SERVER_NODE_ID = 1


def fresh_run_id() -> int:
    """A run id as the SuperLink draws one: uniformly random, nonzero, below 2^63."""
    return 1 + secrets.randbelow(2**63 - 1)


class InProcessGrid(Grid):
    """Nodes 100..100+N-1, each with node config partition-id / num-partitions, and the run config (a dict, or
    the Settings of one). `keep_messages`: every message sent and received stays in `sent` and `received` (tests
    read them; a long run of the launcher keeps none: a round's replies are the cohort's models). `run_id`: the
    run's id (default: a fresh random one, `fresh_run_id`; a ProcessGrid gives its workers its own)."""

    def __init__(
        self,
        client_app: ClientApp | Callable[[Message, Context], Message],
        num_nodes: int,
        run_config: Mapping[str, Any] | Settings,
        *,
        fail: Callable[[int, Message], bool] | None = None,
        keep_messages: bool = True,
        run_id: int | None = None,
    ) -> None:
        if isinstance(run_config, Settings):
            run_config = run_config.run_config()
        self.run_id = fresh_run_id() if run_id is None else int(run_id)
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = self.run_id, SERVER_NODE_ID, 1
        self.client_app = client_app
        self.fail = fail  # fail(node_id, msg) -> True: the node "crashes" on this message
        self.keep_messages = keep_messages
        self.contexts = {
            100 + i: Context(
                run_id=self.run_id,
                node_id=100 + i,
                node_config={"partition-id": i, "num-partitions": num_nodes},
                state=RecordDict(),
                run_config=dict(run_config),
            )
            for i in range(num_nodes)
        }
        self._ids = count(1)
        self.exchange_lock = RLock()  # one exchange at a time (module docstring)
        self.sent: list[Message] = []
        self.received: list[Message] = []

    def set_run(self, run) -> None:  # pragma: no cover - not needed in process
        pass

    @property
    def run(self) -> Run:
        return Run.create_empty(self.run_id)

    def create_message(
        self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str, ttl: float | None = None
    ) -> Message:
        return Message(content=content, message_type=message_type, dst_node_id=dst_node_id, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:  # pragma: no cover
        raise NotImplementedError("use send_and_receive")

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:  # pragma: no cover
        raise NotImplementedError("use send_and_receive")

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        with self.exchange_lock:
            return self.exchange(list(messages))

    def exchange(self, messages: list[Message]) -> list[Message]:
        """The replies to `messages` (a subclass's way of running them: here one by one)."""
        return [self.answer(self.deliver(msg)) for msg in messages]

    def stamp(self, msg: Message) -> Message:
        """`msg` with the id the SuperLink would set (one it has is kept: a ProcessGrid stamps its workers')."""
        if not msg.metadata.message_id:
            msg.metadata.__dict__["_message_id"] = str(next(self._ids))
        return msg

    def deliver(self, msg: Message) -> Message:
        """The copy of `msg` its node sees, as it would over the network, with the id the SuperLink would set."""
        self.stamp(msg)
        delivered = Message(content=deepcopy(msg.content), metadata=deepcopy(msg.metadata))
        if self.keep_messages:
            self.sent.append(delivered)
        return delivered

    def crashes(self, msg: Message) -> bool:
        """Whether the `fail` hook crashes `msg`'s node on it."""
        return bool(self.fail and self.fail(msg.metadata.dst_node_id, msg))

    def answer(self, delivered: Message, run: Callable[[Message, Context], Message] | None = None) -> Message:
        """The node's reply to `delivered` from `run` (default: the ClientApp); a failing node costs only its
        reply (an Error)."""
        node = delivered.metadata.dst_node_id
        try:
            if self.crashes(delivered):
                raise simulated_crash(node)
            reply = (run or self.client_app)(delivered, self.contexts[node])
        except Exception as exc:
            reply = error_reply(delivered, exc)
        if self.keep_messages:
            self.received.append(reply)
        return reply


def simulated_crash(node: int) -> RuntimeError:
    return RuntimeError(f"node {node} crashed (simulated)")


def error_reply(msg: Message, exc: BaseException) -> Message:
    """A failing node's reply to `msg`: an Error that names `exc`."""
    return Message(Error(code=1, reason=f"{type(exc).__name__}: {exc}"), reply_to=msg)
