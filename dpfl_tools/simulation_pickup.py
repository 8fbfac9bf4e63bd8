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
below: the same loop and the same rule (each node's next undelivered message, one per node per sweep,
marked delivered as Flower marks them, after Flower's own expiry check of that message), done in one pass
over the stored messages under the state's lock, in the order the ServerApp stored them. A sweep then costs
one check per undelivered message; Flower's own `get_message_ins` would check every stored message before
each node's (with every client sampled, N messages: about N^2 / 2 checks per sweep even when asking only
the nodes that have one).
`fl_app.client_app` calls `install()` when it is imported with SPEED_PATCHES_ENV = 1 in the environment (the
launcher sets it for runs with `flower-speed-patches = true`; without it the ClientApp imports nothing of the
tooling), which Flower does in the simulation process (to test that the ClientApp loads) before it starts the
thread that runs the loop; in any other process, or with a Flower whose loop or in-memory state differs, it
changes nothing.
"""

from __future__ import annotations

import inspect
import os
import sys
from collections.abc import Callable

VCE_MODULE = "flwr.server.superlink.fleet.vce.vce_api"
FLOWER_PARAMETERS = ("state", "queue", "nodes_mapping", "f_stop")
SWEEP_SECONDS = 0.1  # Flower's wait between sweeps

_flower_loop: Callable | None = None  # Flower's own loop, for a state that is not the in-memory one


def in_memory_state(state) -> bool:
    """Whether `state` is Flower's in-memory LinkState as this module knows it."""
    return all(hasattr(state, name) for name in ("message_ins_store", "lock", "_check_stored_messages"))


def take_undelivered(state, nodes) -> list:
    """The next undelivered stored message of each node in `nodes`, in the order stored, marked delivered (what
    Flower's `get_message_ins(node_id, limit=1)` returns for each of those nodes), in one pass."""
    from flwr.supercore.date import now

    taken, served = [], set()
    with state.lock:
        for message_id, message in list(state.message_ins_store.items()):
            node = message.metadata.dst_node_id
            if message.metadata.delivered_at or node in served or node not in nodes:
                continue
            state._check_stored_messages({message_id})  # Flower's check: expired or out-of-federation goes
            if message_id in state.message_ins_store:
                served.add(node)
                taken.append(message)
        delivered_at = now().isoformat()
        for message in taken:
            message.metadata.delivered_at = delivered_at
    return taken


def add_messages_to_queue(state, queue, nodes_mapping, f_stop) -> None:
    """Flower's message pickup loop (put each node's next undelivered message on `queue` every 0.1 s until
    `f_stop`), in one pass over the stored messages instead of one ask per node."""
    if not in_memory_state(state) and _flower_loop is not None:
        return _flower_loop(state, queue, nodes_mapping, f_stop)
    while not f_stop.is_set():
        for message in take_undelivered(state, nodes_mapping):
            queue.put(message)
        f_stop.wait(SWEEP_SECONDS)
    return None


add_messages_to_queue.dpfl_pickup = True


def install() -> bool:
    """Put `add_messages_to_queue` in place of Flower's in this process's simulation engine, if the speed
    patches are asked for (`SPEED_PATCHES_ENV` = 1: opt-in, as every patch of Flower internals), the installed
    Flower is a release they were tested on, its engine is loaded and its loop takes the arguments this one
    does. Returns whether it is in place."""
    global _flower_loop
    from dpfl.fl_app import SPEED_PATCHES_ENV
    from dpfl_tools.pull_backoff import flower_patch_problem

    if os.environ.get(SPEED_PATCHES_ENV) != "1" or flower_patch_problem() is not None:
        return False
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
