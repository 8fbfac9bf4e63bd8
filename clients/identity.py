"""A node's answer to the server's identity question: which client it is (docs/privacy.md, "Whose record").

The server keys every per-client record (DP-FTRL's participation limits, ALI-DPFL's ledgers) by a client id, not by
the SuperLink's node id, which a restarted SuperNode does not keep. It asks each node it has not seen once, with a
message of type `protocol.CLIENT_ID_QUERY`; `answer_client_id` replies with the node config's `client-id`, else its
`partition-id`, the ids a SuperNode restarted with the same `--node-config` names again. The project's ClientApp
answers it; a ClientApp of one's own registers it in one line:

    app.query("client_id")(answer_client_id)   # from dpfl import answer_client_id

A node config with neither key answers with no id, and the server says which key to set.
"""

from __future__ import annotations

from collections.abc import Mapping

from flwr.app import ConfigRecord, Context, Message, RecordDict

from dpfl.dpcore.privacy import protocol as keys

ID_KEYS = (keys.CLIENT_ID, keys.PARTITION_ID)  # node-config keys, in the order they are read


def client_id_of(node_config: Mapping):
    """The node config's `client-id`, else its `partition-id`, as it is there (the server checks it); None if
    neither."""
    return next((node_config[k] for k in ID_KEYS if k in node_config), None)


def answer_client_id(msg: Message, context: Context) -> Message:
    """The reply to the server's identity query: {CLIENT_IDENTITY: {CLIENT_ID: id}}, an empty record without one."""
    found = client_id_of(context.node_config)
    record = ConfigRecord({} if found is None else {keys.CLIENT_ID: found})
    return Message(RecordDict({keys.CLIENT_IDENTITY: record}), reply_to=msg)


def noise_stream(msg: Message, context: Context) -> int:
    """Which client a seeded noise stream (secure-rng = false) belongs to: its client id (node config client-id,
    else partition-id), else its node id. Every client of a node that hosts several has its own (their messages
    share the node's id); a client draws the same noise whichever node hosts it."""
    found = client_id_of(context.node_config)
    try:
        return int(found)
    except (TypeError, ValueError):
        return int(msg.metadata.dst_node_id)
