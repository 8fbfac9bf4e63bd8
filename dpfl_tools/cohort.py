"""The cohort engine: a Grid that trains a round's sampled clients together, as one batched model.

`CohortGrid` is an `InProcessGrid` (the same nodes, contexts, message copies and failure hook) whose
`send_and_receive` takes the round's messages at once. The train messages of the project's own ClientApp
(`fl_app.client_app.app`) whose client's local rule is known are trained in chunks of clients, every client's
step one call of `torch.func` over parameters stacked on a leading dimension (clients/cohort/train.py: local
SGD and SAM, personal heads; clients/cohort/dpsgd.py: ALI-DPFL's DP-SGD). The replies are each client's own
code (`upload`, `fit_reply`), so the ServerApp, the strategy and the ledger see what the ClientApp would send.

The ClientApp's train mods (local DP, adaptive clipping's bit) run around each batched reply
(`fl_app.client_app.train_with`); top-k sparsifies in its own `upload`; a -FT baseline trains with its inner
client. ALI-DPFL's DP-SGD clients (`DPSGDClient`) train in clients/cohort/dpsgd.py: per-sample gradients,
clipping and noise inside the batch, the Poisson masks and the noise from each client's own generators in Opacus'
order, each client's ledger charged by its own `finish_round` when the grid answers its node. Evaluate messages of the
same clients run together in clients/cohort/evaluate.py. Everything else (a user's own ClientApp,
SecAgg+, models with buffers, malformed messages) runs message by message through the ClientApp,
with one log line per reason. Replies equal the sequential path's to float32 rounding (tests/test_cohort.py:
1e-5 relative).

The round's arrays are decoded once per record the server sent (`received_arrays`: a strategy sends one record to
every node) and moved to the device once (`stacked`); the clients' uploads after a chunk (Delta, clip, noise
share, reply) of a model of 100,000 parameters or more run on a pool of threads (`in_threads`): numpy's noise
draws release the GIL, and on a large model they are most of a client's time outside the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from logging import INFO

import numpy as np
import torch
from flwr.app import Context, Message
from flwr.common.logger import log

from dpfl.clients.cohort.evaluate import evaluate_cohort
from dpfl.clients.cohort.train import head_fits, local_rule, personal, train_cohort, trainer
from dpfl_tools.inprocess import InProcessGrid


class CohortGrid(InProcessGrid):
    """InProcessGrid that trains a round's train messages for the project's ClientApp as one batched model.

    memory_budget: bytes per chunk (default: cohort_train's CPU_BUDGET, or its CUDA_BUDGET_SHARE of the free GPU
    memory; a ProcessGrid's worker takes its PROCESS_SHARE of either);
    threads: torch threads while training a chunk (default: as set in the process; the ClientApp sets 1, one
    simulated client per CPU, and more threads than free cores cost far more than they gain)."""

    def __init__(self, *args, memory_budget: int | None = None, threads: int | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)  # InProcessGrid's: client_app, num_nodes, run_config, fail
        self.memory_budget, self.threads = memory_budget, threads
        self.said: set[str] = set()
        self.batched = 0  # train replies computed in a batch (tests read it)
        self.evaluated = 0  # evaluate replies computed in a batch

    def say(self, reason: str) -> None:
        if reason not in self.said:
            self.said.add(reason)
            log(INFO, "Cohort engine: %s", reason)

    def exchange(self, messages: list[Message]) -> list[Message]:
        delivered = [self.deliver(msg) for msg in messages]
        clients = {id(m): c for m in delivered if (c := self.batchable(m)) is not None}
        trained: dict[int, Message] = {}
        received = received_arrays([(s, d) for s, d in zip(messages, delivered) if id(d) in clients])
        for kind, run in (("train", train_cohort), ("evaluate", evaluate_cohort)):
            cohort = [(m, arrays) for m, arrays in received if m.metadata.message_type == kind]
            if not cohort:
                continue
            try:
                done = run(
                    [m for m, _ in cohort],
                    [arrays for _, arrays in cohort],
                    [clients[id(m)] for m, _ in cohort],
                    self.memory_budget,
                    self.threads,
                )
            except Exception as exc:  # never a wrong reply: the ClientApp answers each of them instead
                self.say(f"a batch of {kind} messages failed ({type(exc).__name__}: {exc}); they run one by one")
                continue
            trained.update(done)
            self.batched += len(done) if kind == "train" else 0
            self.evaluated += len(done) if kind == "evaluate" else 0
        return [self.answer(m, self.replier(trained[id(m)]) if id(m) in trained else None) for m in delivered]

    @staticmethod
    def replier(reply) -> Callable[[Message, Context], Message]:
        """The ClientApp's path around the batched reply (a Message, or a handler run when the node answers:
        DP-SGD's charges the node's ledger, `train_personal`'s writes its head): a train reply under the train mods
        (local DP, adaptive clipping's bit), an evaluate reply as it is (the ClientApp's evaluate has no mods)."""
        from dpfl.fl_app.client_app import train_with

        handler = reply if callable(reply) else lambda *_: reply
        return lambda msg, context: (
            train_with(handler, msg, context) if msg.metadata.message_type == "train" else handler(msg, context)
        )

    def batchable(self, msg: Message):
        """The node's client when `msg` can be trained or evaluated in the batch, else None (the reason logged
        once)."""
        from dpfl.fl_app import client_app as project

        if self.client_app is not project.app:
            self.say("a ClientApp other than the project's (fl_app.client_app.app): messages run one by one")
            return None
        if msg.metadata.message_type not in ("train", "evaluate"):
            if not msg.metadata.message_type.startswith("query"):  # a query (the identity's) has nothing to batch
                self.say(f"{msg.metadata.message_type} messages run one by one through the ClientApp")
            return None
        context = self.contexts[msg.metadata.dst_node_id]
        try:
            if project.secure_aggregation(context):
                self.say("secure aggregation (SecAgg+) runs one by one")
                return None
            client = project.build_client(context, model=self.shared_model(context))
        except Exception as err:  # the ClientApp raises it again, as its reply
            self.say(f"building a client raised {type(err).__name__}: {err}; its messages run one by one")
            return None
        inner = trainer(client)
        if local_rule(inner) is None:
            self.say(f"{type(inner).__name__}'s local rule is not batched yet: its messages run one by one")
            return None
        if any(True for _ in inner.model.buffers()):
            self.say("the model has buffers (e.g. BatchNorm statistics), which would mix clients: one by one")
            return None
        if personal(client) and not head_fits(client):
            return None  # the ClientApp raises restore_head's error, as its reply
        state = inner.model.state_dict()
        shapes = [tuple(state[k].shape) for k in (client.body_keys if personal(client) else state)]
        arrays = msg.content.array_records.get("arrays")
        if arrays is None or [tuple(a.shape) for a in arrays.values()] != shapes:
            return None  # a malformed message: the ClientApp's own error is its reply
        return client

    def shared_model(self, context: Context) -> torch.nn.Module:
        """One module for all clients (the ClientApp's, built once): the structure functional_call runs."""
        from dpfl.fl_app.client_app import build_client

        if getattr(self, "_model", None) is None:
            self._model = trainer(build_client(context)).model
        return self._model


def received_arrays(pairs: list[tuple[Message, Message]]) -> list[tuple[Message, list[np.ndarray]]]:
    """(delivered message, its "arrays" as read-only numpy) for each (message sent, its delivered copy), each
    ArrayRecord the server sent decoded once: a strategy sends one record to every node (the node copies of one
    record are equal), so the clients of a round share one set of arrays and `stacked` moves them to the device
    once."""
    decoded: dict[int, list[np.ndarray]] = {}
    for original, _ in pairs:
        record = original.content.get("arrays")
        if id(record) not in decoded:
            decoded[id(record)] = record.to_numpy_ndarrays() if record is not None else []
            for a in decoded[id(record)]:
                a.flags.writeable = False
    return [(msg, decoded[id(original.content.get("arrays"))]) for original, msg in pairs]
