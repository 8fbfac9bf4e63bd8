"""The server's side of node cohorts (docs/node-cohorts.md): SuperNodes that host several clients, seen by the strategy
as one node per client.

`NodeCohortGrid` wraps the ServerApp's Grid. Each connected node is asked once which clients it hosts (the identity
query, `protocol.CLIENT_ID_QUERY`): a node of this project's ClientApp with `num-clients` > 0 answers a list
(`protocol.CLIENT_IDS`), and each of its clients becomes a node of its own to the strategy, with the id
`VIRTUAL_BASE` + its client id: the same client has the same id whichever node hosts it (a restarted SuperNode's
too), and the sorted ids are the clients in order, so a seeded sample picks the same clients on 2 nodes as on 50.
Everything above the grid (sampling, the reply gate, clipping, noise, the ledger, the per-client records) works per
client as with one client a node: M is the number of clients, never of nodes.

`send_and_receive` sends each node one message for all of its clients addressed in the exchange (their contents
packed, `dpcore.privacy.packing`: the round's model once) and splits the node's one reply into one reply per client.
A node's reply is hostile until checked: a reply that cannot be unpacked, or lacks a client, is an Error for those of
its clients (never an exception here), and a client's content is checked by the reply gate as any client's. An
identity query to a hosted client is answered here from its node's list. A node that answers the query with one
client id, or with an error (a ClientApp of one's own), or nodes without the query, stay nodes of one client,
addressed as themselves; a node that does not answer in QUERY_TIMEOUT is asked again at the next look.
"""

from __future__ import annotations

import json
from collections import defaultdict
from logging import INFO, WARNING

from flwr.app import ConfigRecord, Error, Message, RecordDict
from flwr.common import log
from flwr.serverapp import Grid

from dpfl.dpcore.privacy import protocol as keys
from dpfl.dpcore.privacy.packing import WireError, pack, unpack

VIRTUAL_BASE = 2**62  # a hosted client's node id here: VIRTUAL_BASE + its client id (Flower's: random below 2^63)
QUERY_TIMEOUT = 60.0  # seconds a look waits for new nodes' answers; the first look (nodes starting) FIRST_QUERY_TIMEOUT
FIRST_QUERY_TIMEOUT = 600.0
NOT_HOSTED = None  # claims[node] for a node of one client, addressed as itself
ERROR_CODE = 1


class NodeCohortGrid(Grid):
    """A Grid on which each client a node hosts is a node (module docstring)."""

    def __init__(self, grid: Grid, query_timeout: float = QUERY_TIMEOUT, first_timeout: float = FIRST_QUERY_TIMEOUT):
        self.grid, self.query_timeout, self.first_timeout = grid, query_timeout, first_timeout
        self.claims: dict[int, list[int] | None] = {}  # node id -> the clients it hosts (NOT_HOSTED), in claim order
        self.clients: dict[int, tuple[int, int]] = {}  # a hosted client's node id here -> (its node's id, client id)

    # ------------------------------------------------------------------ Flower's Grid, delegated
    def set_run(self, run) -> None:
        self.grid.set_run(run)

    @property
    def run(self):
        return self.grid.run

    def create_message(self, *args, **kwargs) -> Message:
        return self.grid.create_message(*args, **kwargs)

    def get_nodes(self):
        return self.grid.get_nodes()

    def push_messages(self, messages):
        messages = list(messages)
        if any(m.metadata.dst_node_id in self.clients for m in messages):
            raise ValueError("a hosted client's messages go through send_and_receive, which packs them per node")
        return self.grid.push_messages(messages)

    def pull_messages(self, *args, **kwargs):
        return self.grid.pull_messages(*args, **kwargs)

    # ------------------------------------------------------------------ the clients as nodes
    def get_node_ids(self) -> list[int]:
        """The connected nodes of one client and the clients the other connected nodes host (sorted). A client that
        two connected nodes claim is the first claimant's (a restarted SuperNode takes its clients over once the
        SuperLink drops the old node); the later claim is logged and left out."""
        nodes = sorted(int(n) for n in self.grid.get_node_ids())
        if new := [n for n in nodes if n not in self.claims]:
            self.ask(new)
        live, held, ids = set(nodes), {}, []
        for node, claimed in self.claims.items():
            if node not in live:
                continue
            if claimed is NOT_HOSTED:
                ids.append(node)
                continue
            for client in claimed:
                if held.setdefault(client, node) != node:
                    log(WARNING, "Node %d claims client %d, which node %d hosts: left out", node, client, held[client])
        self.clients = {VIRTUAL_BASE + client: (node, client) for client, node in held.items()}
        return sorted(ids + list(self.clients))

    def population(self) -> dict[int, int]:
        """{node id: how many clients it claims} of the nodes asked so far (a node of one client: 1)."""
        return {n: 1 if c is NOT_HOSTED else len(c) for n, c in self.claims.items()}

    def ask(self, nodes: list[int]) -> None:
        """Ask `nodes` which clients they host; a node that does not answer is asked again at the next look."""
        messages = [Message(RecordDict(), dst_node_id=n, message_type=keys.CLIENT_ID_QUERY) for n in nodes]
        timeout = self.query_timeout if self.claims else self.first_timeout
        replies = self.grid.send_and_receive(messages, timeout=timeout)
        sent_to = {m.metadata.message_id: m.metadata.dst_node_id for m in messages if m.metadata.message_id}
        for reply in replies:
            node = int(sent_to.get(reply.metadata.reply_to_message_id) or reply.metadata.src_node_id)
            if node not in nodes or node in self.claims:
                continue
            clients = None if reply.has_error() else hosted_list(reply.content)
            self.claims[node] = NOT_HOSTED if clients is None else clients
            if clients is not None:
                log(INFO, "Node %d hosts %d clients (%s)", node, len(clients), span(clients))
        for node in sorted(set(nodes) - set(self.claims)):
            log(WARNING, "Node %d did not say which clients it hosts within %g s: asked again", node, timeout)

    def client_of(self, virtual: int) -> tuple[int, int] | None:
        """(node id, client id) of a hosted client's node id; None for a node of one client."""
        return self.clients.get(int(virtual))

    # ------------------------------------------------------------------ one message per node
    def send_and_receive(self, messages, *, timeout: float | None = None) -> list[Message]:
        """Each node's hosted clients' messages as one packed message per node and message type; the node's one reply
        split into one reply per client. Messages to nodes of one client pass as they are."""
        direct, answered, groups = [], [], defaultdict(list)
        for msg in messages:
            found = self.client_of(msg.metadata.dst_node_id)
            if found is None:
                direct.append(msg)
            elif msg.metadata.message_type == keys.CLIENT_ID_QUERY:  # answered here, from the node's list
                identity = ConfigRecord({keys.CLIENT_ID: found[1]})
                answered.append(Message(RecordDict({keys.CLIENT_IDENTITY: identity}), reply_to=msg))
            else:
                groups[found[0], msg.metadata.message_type].append(msg)
        packed = {}  # (node, message type) -> (its one message, the clients' messages it carries)
        for (node, message_type), group in groups.items():
            content = pack({self.clients[m.metadata.dst_node_id][1]: m.content for m in group})
            packed[node, message_type] = (
                Message(content, node, message_type, group_id=group[0].metadata.group_id),
                group,
            )
        replies = list(self.grid.send_and_receive(direct + [m for m, _ in packed.values()], timeout=timeout))
        by_id = {m.metadata.message_id: key for key, (m, _) in packed.items() if m.metadata.message_id}
        split: dict[tuple[int, str], Message] = {}
        for reply in replies:
            key = by_id.get(reply.metadata.reply_to_message_id)
            if key is None and (int(reply.metadata.src_node_id), reply.metadata.message_type) in packed:
                key = (int(reply.metadata.src_node_id), reply.metadata.message_type)
            if key is None:
                answered.append(reply)  # a node of one client
            else:
                split.setdefault(key, reply)
        for key, (_, group) in packed.items():
            answered.extend(self.split(split.get(key), group))
        return answered

    def split(self, reply: Message | None, group: list[Message]) -> list[Message]:
        """One reply per client of `group` from its node's `reply` (None: the node did not answer in time)."""
        if reply is None:
            return [Message(Error(ERROR_CODE, "its node did not reply in time"), reply_to=m) for m in group]
        if reply.has_error():
            reason = f"its node failed: {reply.error.reason}"
            return [Message(Error(reply.error.code, reason), reply_to=m) for m in group]
        try:
            contents = unpack(reply.content)
        except WireError as err:
            return [Message(Error(ERROR_CODE, f"its node's reply is malformed: {err}"), reply_to=m) for m in group]
        out = []
        for msg in group:
            content = contents.get(self.clients[msg.metadata.dst_node_id][1])
            if content is None:
                out.append(Message(Error(ERROR_CODE, "its node's reply has no entry for it"), reply_to=msg))
            elif isinstance(content, str):
                out.append(Message(Error(ERROR_CODE, content), reply_to=msg))
            else:
                out.append(Message(content, reply_to=msg))
        return out


def hosted_list(content: RecordDict) -> list[int] | None:
    """The client ids a node's identity answer lists (CLIENT_IDS), or None where it names one client or none."""
    record = content.config_records.get(keys.CLIENT_IDENTITY)
    if record is None or keys.CLIENT_IDS not in record:
        return None
    try:
        clients = json.loads(record[keys.CLIENT_IDS])
    except (TypeError, ValueError):
        return None
    if not isinstance(clients, list) or not all(
        isinstance(c, int) and not isinstance(c, bool) and 0 <= c < keys.MAX_CLIENT_ID for c in clients
    ):
        return None
    return sorted(set(clients))


def span(clients: list[int]) -> str:
    """'0, 2, 4, ..., 48' style: the first three and the last."""
    shown = ", ".join(map(str, clients[:3]))
    return shown + (f", ..., {clients[-1]}" if len(clients) > 3 else "")
