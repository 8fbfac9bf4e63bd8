"""A node's hosted clients answered as one batched cohort inside the ClientApp (docs/node-cohorts.md).

`answer_batched` takes the messages of the clients a node hosts (one per client, each with the client's own NumPyClient,
built on one shared module) and answers those it can in chunks, every client's step one `torch.func` call over
parameters stacked on a leading dimension (`clients.cohort.train`: SGD and SAM, personal heads, ALI-DPFL's DP-SGD in
`clients.cohort.dpsgd`; evaluation in `clients.cohort.evaluate`). The replies are each client's own code (`upload`,
`fit_reply`), equal to the one-by-one path's to float32 rounding. A message it cannot batch (`batch_reason`: a local
rule not batched yet, a model with buffers, a malformed message) is left to the ClientApp's one-by-one path, and so is
the whole cohort where the batch raises.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from flwr.app import Message

from dpfl.clients.cohort.hosting import Reply
from dpfl.clients.cohort.train import head_fits, local_rule, personal, train_cohort, trainer


def batch_reason(client, msg: Message) -> str | None:
    """Why `client` cannot answer `msg` in the batch (None: it can)."""
    inner = trainer(client)
    if local_rule(inner) is None:
        return f"{type(inner).__name__}'s local rule is not batched yet"
    if any(True for _ in inner.model.buffers()):
        return "the model has buffers (e.g. BatchNorm statistics), which would mix clients"
    if personal(client) and not head_fits(client):
        return "its stored personal head does not fit the model"  # the one-by-one path raises the client's error
    state = inner.model.state_dict()
    shapes = [tuple(state[k].shape) for k in (client.body_keys if personal(client) else state)]
    arrays = msg.content.array_records.get("arrays")
    if arrays is None or [tuple(a.shape) for a in arrays.values()] != shapes:
        return "the message's arrays do not fit the model"  # the one-by-one path's error is the reply
    return None


def answer_batched(
    kind: str, messages: Mapping[int, Message], clients: Mapping[int, object], threads: int | None = None
) -> dict[int, Reply]:
    """{client id: its reply (or reply handler)} for the clients of `messages` that can be batched; `kind` is "train" or
    "evaluate". Each arrays record is decoded once (a node's clients share the round's model)."""
    from dpfl.clients.cohort.evaluate import evaluate_cohort

    batched = [c for c in messages if batch_reason(clients[c], messages[c]) is None]
    if not batched:
        return {}
    decoded: dict[int, list[np.ndarray]] = {}
    params = []
    for c in batched:
        record = messages[c].content.array_records["arrays"]
        if id(record) not in decoded:
            decoded[id(record)] = record.to_numpy_ndarrays()
            for a in decoded[id(record)]:
                a.flags.writeable = False
        params.append(decoded[id(record)])
    run = train_cohort if kind == "train" else evaluate_cohort
    done = run([messages[c] for c in batched], params, [clients[c] for c in batched], None, threads)
    return {c: done[id(messages[c])] for c in batched if id(messages[c]) in done}
