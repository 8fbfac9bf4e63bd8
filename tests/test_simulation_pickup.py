"""The simulation's message pickup: Flower's loop asks every node for its message, and each ask checks the
stored messages up to that node's; ours takes them in one pass (dpfl_tools.simulation_pickup; docs/scale.md)."""

import dataclasses
import inspect
import subprocess
import sys
import threading
import time
import uuid
from queue import Queue

import pytest
from flwr.app import ConfigRecord, Message, MessageType, Metadata, RecordDict
from flwr.server.superlink.fleet.vce import vce_api
from flwr.server.superlink.linkstate import LinkStateFactory
from flwr.server.superlink.linkstate.in_memory_linkstate import RunRecord
from flwr.supercore.constant import FLWR_IN_MEMORY_DB_NAME, NOOP_FEDERATION_ID
from flwr.supercore.object_store import ObjectStoreFactory
from flwr.supercore.run import Run
from flwr.superlink.federation import NoOpFederationManager

from dpfl_tools import simulation_pickup


def state_with_messages(num_nodes: int, num_messages: int):
    """Flower's in-memory LinkState with `num_nodes` registered nodes and `num_messages` stored train messages
    to evenly spaced nodes (the last near the end)."""
    factory = LinkStateFactory(FLWR_IN_MEMORY_DB_NAME, NoOpFederationManager(), ObjectStoreFactory())
    mapping = vce_api._register_nodes(num_nodes, factory)
    state = factory.state()
    state.run_ids[1] = RunRecord(run=dataclasses.replace(Run.create_empty(1), federation_id=NOOP_FEDERATION_ID))
    nodes = list(mapping)[num_nodes // num_messages - 1 :: num_nodes // num_messages]
    for node in nodes:
        metadata = Metadata(
            run_id=1,
            message_id=uuid.uuid4().hex,
            src_node_id=1,
            dst_node_id=node,
            reply_to_message_id="",
            group_id="",
            created_at=time.time(),
            ttl=3600.0,
            message_type=MessageType.TRAIN,
        )
        state.message_ins_store[metadata.message_id] = Message(
            RecordDict({"c": ConfigRecord({"a": 1})}), metadata=metadata
        )
    return state, mapping


def pick_up(loop, num_nodes: int, num_messages: int) -> tuple[list[int], int]:
    """(the messages `loop` queued, in the order queued, each as its place in the store; how many stored-message
    checks it made until then)."""
    state, mapping = state_with_messages(num_nodes, num_messages)
    place = {message_id: i for i, message_id in enumerate(state.message_ins_store)}
    checks = 0
    check = state._check_stored_messages

    def counted(message_ids, run_id=None):
        nonlocal checks
        checks += len(message_ids)
        return check(message_ids, run_id)

    state._check_stored_messages = counted
    queue, stop = Queue(), threading.Event()
    thread = threading.Thread(target=loop, args=(state, queue, mapping, stop))
    thread.start()
    try:
        got = [place[queue.get(timeout=60).metadata.message_id] for _ in range(num_messages)]
        made = checks
    finally:
        stop.set()
        thread.join()
    assert queue.empty()
    return got, made


def flowers_loop():
    """Flower's own loop (kept by the pickup where another test's import of fl_app.client_app installed it)."""
    return simulation_pickup._flower_loop or vce_api.add_messages_to_queue


def test_the_pickup_delivers_flowers_messages_with_a_fraction_of_the_checks():
    flower_ids, flower_checks = pick_up(flowers_loop(), 2000, 20)
    ours_ids, ours_checks = pick_up(simulation_pickup.add_messages_to_queue, 2000, 20)
    assert sorted(ours_ids) == sorted(flower_ids) == list(range(20))
    assert flower_checks >= 1900 * 20  # every node asked, every stored message checked per ask
    assert ours_checks == 20  # one check per message
    print(f"stored-message checks to deliver 20 messages to 2000 nodes: Flower {flower_checks}, ours {ours_checks}")


def test_with_every_node_sampled_the_pickup_stays_linear():
    """A message for each of 400 nodes (q = 1): Flower's asks check the messages up to each node's, about
    N^2 / 2 in all; ours one per message, and in the order the ServerApp stored them."""
    flower_ids, flower_checks = pick_up(flowers_loop(), 400, 400)
    ours_ids, ours_checks = pick_up(simulation_pickup.add_messages_to_queue, 400, 400)
    assert flower_checks >= 400 * 401 // 2 and ours_checks == 400
    assert ours_ids == flower_ids == list(range(400))  # the same messages in the same order


def test_an_expired_message_is_dropped_as_flower_drops_it():
    state, mapping = state_with_messages(100, 10)
    expired = next(iter(state.message_ins_store.values()))
    expired.metadata.__dict__["_created_at"] = time.time() - 7200  # its 3600 s TTL is over
    taken = simulation_pickup.take_undelivered(state, mapping)
    assert len(taken) == 9 and expired.metadata.message_id not in state.message_ins_store
    assert all(m.metadata.delivered_at for m in taken) and simulation_pickup.take_undelivered(state, mapping) == []


@pytest.mark.flower_version
@pytest.mark.slow
def test_the_client_app_installs_the_pickup_only_where_asked_and_flowers_engine_is_loaded():
    import os

    from dpfl.fl_app import SPEED_PATCHES_ENV

    code = (
        "import sys\nimport flwr.server.superlink.fleet.vce.vce_api as v\nimport fl_app.client_app\n"
        "print(v.add_messages_to_queue.__module__)"
    )
    env = {k: v for k, v in os.environ.items() if k != SPEED_PATCHES_ENV}
    stock = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
    assert stock.strip() == "flwr.server.superlink.fleet.vce.vce_api"  # opt-in: Flower's own loop by default
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env={**env, SPEED_PATCHES_ENV: "1"}
    ).stdout
    from dpfl_tools.pull_backoff import flower_patch_problem

    # asked for: in place on the Flower releases the patches were tested on; Flower's own loop on another (1.43)
    patchable = flower_patch_problem() is None
    assert out.strip() == ("dpfl_tools.simulation_pickup" if patchable else "flwr.server.superlink.fleet.vce.vce_api")
    assert simulation_pickup.install() in (True, False)  # idempotent where it is in place


def test_flowers_loop_still_takes_the_arguments_the_pickup_replaces():
    """A Flower whose loop changed would keep its own (install() checks the arguments); this one matches."""
    parameters = ("state", "queue", "nodes_mapping", "f_stop")
    assert tuple(inspect.signature(flowers_loop()).parameters) == parameters == simulation_pickup.FLOWER_PARAMETERS
