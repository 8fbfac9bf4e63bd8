"""Flower's simulation engine, made to find its messages in time that grows with the messages, not with
nodes x messages.

Flower 1.41-1.42's simulation (`flwr.server.superlink.fleet.vce.vce_api.add_messages_to_queue`) looks for
work every 0.1 s by asking its in-memory LinkState, node by node, for that node's next message
(`get_message_ins(node_id, limit=1)`), and each ask walks every stored message and checks each one
(`_check_stored_messages`). With N nodes and M messages stored a sweep costs N x M checks, and the
messages of a round stay stored until their replies are taken: measured here 2.2 s of CPU per sweep with
10,000 nodes and 100 messages (q = 0.01), 0.02 s with 1,000 and 10; 100,000 nodes and 1,000 messages would
take minutes per sweep, with the ServerApp and the clients waiting for the state's lock meanwhile.

`install()` replaces that function, in the process that runs the simulation, with `add_messages_to_queue`
below: the same loop, asking only for the nodes that have an undelivered message (read from the same
store, under its lock, in the order the ServerApp stored them), one message per node per sweep as
Flower does. A sweep then costs M x M checks while messages wait and M cheap reads when none does.
`fl_app.client_app` calls `install()` when it is imported, which Flower does in the simulation process (to
test that the ClientApp loads) before it starts the thread that runs the loop; in any other process, or
with a Flower whose loop takes other arguments, it changes nothing.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable

VCE_MODULE = "flwr.server.superlink.fleet.vce.vce_api"
FLOWER_PARAMETERS = ("state", "queue", "nodes_mapping", "f_stop")
SWEEP_SECONDS = 0.1  # Flower's wait between sweeps

_flower_loop: Callable | None = None  # Flower's own loop, for a state that is not the in-memory one


def nodes_with_undelivered_messages(state, nodes) -> list[int]:
    """The destination nodes (among `nodes`) of the stored messages not delivered yet, in the order stored."""
    with state.lock:
        pending = [m.metadata.dst_node_id for m in state.message_ins_store.values() if not m.metadata.delivered_at]
    return [node for node in dict.fromkeys(pending) if node in nodes]


def add_messages_to_queue(state, queue, nodes_mapping, f_stop) -> None:
    """Flower's message pickup loop (put each node's next undelivered message on `queue` every 0.1 s until
    `f_stop`), over the nodes that have one instead of over every node."""
    if not (hasattr(state, "message_ins_store") and hasattr(state, "lock")) and _flower_loop is not None:
        return _flower_loop(state, queue, nodes_mapping, f_stop)
    while not f_stop.is_set():
        for node_id in nodes_with_undelivered_messages(state, nodes_mapping):
            for message in state.get_message_ins(node_id=node_id, limit=1):
                queue.put(message)
        f_stop.wait(SWEEP_SECONDS)
    return None


add_messages_to_queue.dpfl_pickup = True


def install() -> bool:
    """Put `add_messages_to_queue` in place of Flower's in this process's simulation engine, if one is loaded
    and its loop takes the arguments this one does. Returns whether it is in place."""
    global _flower_loop
    module = sys.modules.get(VCE_MODULE)
    flower = getattr(module, "add_messages_to_queue", None)
    if flower is None:
        return False
    if getattr(flower, "dpfl_pickup", False):
        return True
    if tuple(inspect.signature(flower).parameters) != FLOWER_PARAMETERS:
        return False
    _flower_loop = flower
    module.add_messages_to_queue = add_messages_to_queue
    return True
