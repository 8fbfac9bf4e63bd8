"""A SuperNode that hosts several clients of the population (docs/node-cohorts.md).

With run-config key `num-clients` = M > 0 the population is M clients, and each node hosts some of them: node config
`client-ids` ("0,5,9") where set, else the clients j < M with j mod num-partitions = partition-id (Flower's
simulation numbers its SuperNodes so). Client j trains on partition j of M whichever node hosts it. Each hosted
client sees the node as if it were the node's only client (`client_context`): node config partition-id = client-id =
j, num-partitions = M, and a state of its own, kept in the node's `Context.state` under "client.<j>." (its ledger,
its personal head). `serve_cohort` answers one packed message (`dpcore.privacy.packing`) for the clients it names
with one packed reply; a client's failure is its own entry of the reply, never the other clients'.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from logging import INFO

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.common import log

from dpfl.dpcore.privacy import protocol as keys
from dpfl.dpcore.privacy.packing import pack, unpack

Reply = Message | Callable[[Message, Context], Message]  # a reply, or a handler that writes state, then replies


def hosted_clients(node_config: Mapping, num_clients: int) -> list[int] | None:
    """The ids of the clients this node hosts, sorted; None where num_clients is 0 (the node is one client)."""
    if num_clients <= 0:
        return None
    if keys.CLIENT_IDS in node_config:
        value = node_config[keys.CLIENT_IDS]
        try:
            clients = sorted({int(c) for c in str(value).replace(" ", "").split(",") if c})
        except ValueError:
            clients = None
        if not clients or not all(0 <= c < num_clients for c in clients):
            raise ValueError(
                f"node config {keys.CLIENT_IDS}={value!r}: must be client ids separated by commas, each in "
                f"[0, {num_clients - 1}] for {keys.NUM_CLIENTS} = {num_clients}"
            )
        return clients
    missing = [k for k in (keys.PARTITION_ID, keys.NUM_PARTITIONS) if k not in node_config]
    if missing:
        raise ValueError(
            f"node config lacks {', '.join(missing)} (or {keys.CLIENT_IDS}): start the SuperNode with "
            f'--node-config "{keys.PARTITION_ID}=<i> {keys.NUM_PARTITIONS}=<n>" or "{keys.CLIENT_IDS}=0,5,9"'
        )
    node, nodes = int(node_config[keys.PARTITION_ID]), int(node_config[keys.NUM_PARTITIONS])
    if not 0 <= node < nodes:
        raise ValueError(f"node config partition-id={node} is out of range: must be in [0, {nodes - 1}]")
    return list(range(node, num_clients, nodes))


def client_context(context: Context, client: int, num_clients: int) -> Context:
    """Client `client`'s view of the node: its partition of `num_clients`, its own state."""
    node_config = {**context.node_config, keys.PARTITION_ID: client, keys.NUM_PARTITIONS: num_clients}
    node_config[keys.CLIENT_ID] = client
    node_config.pop(keys.CLIENT_IDS, None)
    prefix = state_prefix(client)
    state = RecordDict({k[len(prefix) :]: v for k, v in context.state.items() if k.startswith(prefix)})
    return Context(context.run_id, context.node_id, node_config, state, context.run_config)


def state_prefix(client: int) -> str:
    return f"client.{client}."


def keep_client_state(context: Context, client: int, view: Context) -> None:
    """Write the client's state (`view.state`) back into the node's, under its prefix."""
    prefix = state_prefix(client)
    for key in [k for k in context.state if k.startswith(prefix)]:
        del context.state[key]
    for key, record in view.state.items():
        context.state[prefix + key] = record


def answer_hosted_clients(clients: list[int], msg: Message) -> Message:
    """The identity query's answer of a node hosting `clients`: {CLIENT_IDENTITY: {CLIENT_IDS: JSON list}}."""
    return Message(
        RecordDict({keys.CLIENT_IDENTITY: ConfigRecord({keys.CLIENT_IDS: json.dumps(clients)})}), reply_to=msg
    )


def serve_cohort(
    handler: Callable[[Message, Context, Reply | None], Message],
    msg: Message,
    context: Context,
    num_clients: int,
    batch: Callable[[dict[int, Message], dict[int, Context]], dict[int, Reply]] | None = None,
) -> Message:
    """The node's one reply to a packed message: each named client's content through `handler` (the ClientApp's path
    for one client, given the client's reply where `batch` computed it for the whole cohort) in the client's own
    Context; a client it does not host, or whose handler raises or answers an Error, gets its reason in the reply
    instead of a content. A batch that raises leaves every client to the one-by-one path."""
    hosted = set(hosted_clients(context.node_config, num_clients) or ())
    replies: dict[int, RecordDict | str] = {}
    messages, views = {}, {}
    for client, content in unpack(msg.content).items():
        if isinstance(content, str) or client not in hosted:
            replies[client] = f"client {client} is not hosted by this node (it hosts {len(hosted)} clients)"
            continue
        messages[client] = Message(content=content, metadata=msg.metadata)
        views[client] = client_context(context, client, num_clients)
    computed: dict[int, Reply] = {}
    if batch is not None and messages:
        try:
            computed = batch(messages, views)
        except Exception as exc:  # never a wrong reply: each client answers one by one instead
            log(INFO, "Node cohort: the batch raised %s: %s; its clients answer one by one", type(exc).__name__, exc)
    for client, message in messages.items():
        try:
            reply = handler(message, views[client], computed.get(client))
            replies[client] = reply.error.reason if reply.has_error() else reply.content
        except Exception as exc:  # this client's failure, not its node's
            replies[client] = f"{type(exc).__name__}: {exc}"
        keep_client_state(context, client, views[client])
    return Message(pack(replies), reply_to=msg)


def as_handler(reply: Reply) -> Callable[[Message, Context], Message]:
    """A computed reply as a handler (a handler as it is: it writes the client's state when the node answers)."""
    return reply if callable(reply) else (lambda _msg, _context: reply)
