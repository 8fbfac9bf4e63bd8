"""Node cohorts (issue 56): SuperNodes hosting several clients each, one message and one reply a node
(clients/cohort/, strategies/loop/node_cohorts.py), against the same run with one client a node."""

import math

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict

from dpfl.clients.cohort.hosting import client_context, hosted_clients, keep_client_state
from dpfl.dpcore.privacy import protocol as keys
from dpfl.dpcore.privacy.packing import WireError, pack, unpack
from dpfl.fl_app.client_app import app as client_app
from dpfl.fl_app.config import ConfigError, validate
from dpfl.fl_app.results import read_diagnostics, read_metrics
from dpfl.fl_app.server_app import run_federated
from dpfl.strategies.loop.node_cohorts import VIRTUAL_BASE, NodeCohortGrid
from dpfl_tools.inprocess import InProcessGrid

SMALL = {"dataset": "digits", "model": "mlp", "partitioner": "iid", "secure-rng": False, "seed": 3, "min-nodes": 1}


def run(tmp_path, name: str, nodes: int, clients: int, **overrides):
    """(summary, published rounds, diagnostics rounds) of an in-process run on `nodes` nodes; clients = 0: one
    client a node."""
    torch.set_num_threads(1)
    cfg = validate({**SMALL, "results-dir": str(tmp_path / name), "num-clients": clients, **overrides})
    summary = run_federated(InProcessGrid(client_app, nodes, cfg), cfg)
    return summary, read_metrics(tmp_path / name), read_diagnostics(tmp_path / name)


# ---------------------------------------------------------------------------- the wire
def test_pack_carries_each_shared_record_once_and_unpack_restores_every_clients_content():
    arrays = ArrayRecord({"w": __import__("flwr").app.Array(np.arange(6, dtype=np.float32))})
    shared = RecordDict({"arrays": arrays, "config": ConfigRecord({"lr": 0.1})})
    own = RecordDict({"arrays": arrays, "metrics": MetricRecord({"loss": 1.5})})
    packed = pack({3: shared, 8: shared, 11: own, 20: "ValueError: no data"})
    assert len(packed.array_records) == 1  # the model once for the four clients
    back = unpack(packed)
    assert sorted(back) == [3, 8, 11, 20] and back[20] == "ValueError: no data"
    assert back[3]["config"]["lr"] == 0.1 and back[11]["metrics"]["loss"] == 1.5
    assert np.array_equal(back[8]["arrays"]["w"].numpy(), np.arange(6, dtype=np.float32))


@pytest.mark.parametrize(
    "index,match",
    [
        (None, "no 'cohort-index' record"),
        ("not json", "holds no JSON index"),
        ("[1, 2]", "is a list, not an object"),
        ('{"-1": {}}', "not an integer in"),
        ('{"x7": {}}', "not an integer in"),
        ('{"1": ["arrays"]}', "is not an object of strings"),
        ('{"1": {"arrays": "record.9"}}', "names 'record.9', which is not in the message"),
        ('{"1": {"arrays": "cohort-index"}}', "which is not in the message"),
    ],
)
def test_a_malformed_packed_message_is_a_wire_error_naming_what_is_wrong(index, match):
    packed = RecordDict({"record.0": ArrayRecord()})
    if index is not None:
        packed[keys.COHORT_INDEX] = ConfigRecord({"index": index})
    with pytest.raises(WireError, match=match):
        unpack(packed)


# ---------------------------------------------------------------------------- the node
def test_a_node_hosts_every_pth_client_or_the_ones_its_node_config_names():
    assert hosted_clients({"partition-id": 1, "num-partitions": 2}, 7) == [1, 3, 5]
    assert hosted_clients({"partition-id": 4, "num-partitions": 5}, 3) == []  # more nodes than clients
    assert hosted_clients({"client-ids": "9, 2,2"}, 10) == [2, 9]
    assert hosted_clients({"partition-id": 0, "num-partitions": 2}, 0) is None  # one client a node
    with pytest.raises(ValueError, match=r"client-ids='2,x': must be client ids separated by commas, each in \[0, 9\]"):
        hosted_clients({"client-ids": "2,x"}, 10)
    with pytest.raises(ValueError, match=r"client-ids='12': .* each in \[0, 9\] for num-clients = 10"):
        hosted_clients({"client-ids": "12"}, 10)
    with pytest.raises(ValueError, match="node config lacks num-partitions"):
        hosted_clients({"partition-id": 0}, 10)


def test_each_hosted_client_sees_its_own_partition_and_keeps_its_own_state():
    node = Context(1, 7, {"partition-id": 0, "num-partitions": 2, "state-dir": "/x"}, RecordDict(), {})
    views = {c: client_context(node, c, 10) for c in (0, 2)}
    assert views[2].node_config == {"partition-id": 2, "num-partitions": 10, "client-id": 2, "state-dir": "/x"}
    views[0].state["ledger"] = ConfigRecord({"rounds": 1})
    views[2].state["ledger"] = ConfigRecord({"rounds": 5})
    for c, view in views.items():
        keep_client_state(node, c, view)
    again = client_context(node, 2, 10)
    assert again.state["ledger"]["rounds"] == 5 and client_context(node, 0, 10).state["ledger"]["rounds"] == 1
    assert client_context(node, 4, 10).state == RecordDict()  # a client that never trained has nothing


def test_a_hosting_node_refuses_one_clients_message_naming_the_key():
    cfg = validate({**SMALL, "num-clients": 10})
    grid = InProcessGrid(client_app, 2, cfg)
    msg = Message(RecordDict({"arrays": ArrayRecord()}), dst_node_id=100, message_type="train")
    [reply] = grid.send_and_receive([msg])
    assert reply.has_error() and "this node hosts 5 clients (run-config key 'num-clients' = 10)" in reply.error.reason


def test_num_clients_with_secure_aggregation_is_refused_before_training():
    with pytest.raises(ConfigError, match="'num-clients' = 50 .* not supported with 'secure-aggregation' = true"):
        validate({"num-clients": 50, "secure-aggregation": True})


# ---------------------------------------------------------------------------- the server's grid
def test_the_grid_sees_one_node_per_hosted_client_and_a_later_claim_of_a_held_client_is_left_out():
    cfg = validate({**SMALL, "num-clients": 6})
    inner = InProcessGrid(client_app, 3, cfg)
    grid = NodeCohortGrid(inner)
    assert grid.get_node_ids() == [VIRTUAL_BASE + c for c in range(6)]
    assert grid.population() == {100: 2, 101: 2, 102: 2}
    inner.contexts[102].node_config = {"client-ids": "0,5"}  # node 102 restarts claiming node 100's client 0
    grid.claims.pop(102)  # asked again, as a new node would be
    assert grid.get_node_ids() == [VIRTUAL_BASE + c for c in (0, 1, 3, 4, 5)]  # client 2 hosted by no node now
    assert grid.client_of(VIRTUAL_BASE + 0) == (100, 0) and grid.client_of(VIRTUAL_BASE + 5) == (102, 5)
    [identity] = grid.send_and_receive(
        [Message(RecordDict(), dst_node_id=VIRTUAL_BASE + 5, message_type=keys.CLIENT_ID_QUERY)]
    )
    assert identity.content[keys.CLIENT_IDENTITY][keys.CLIENT_ID] == 5  # answered from node 102's list


@pytest.mark.parametrize(
    "reply,reason",
    [
        (lambda msg: Message(RecordDict({"x": ConfigRecord({"a": 1})}), reply_to=msg), "malformed: no 'cohort-index'"),
        (lambda msg: Message(pack(dict.fromkeys((0, 2), "RuntimeError: oom")), reply_to=msg), "RuntimeError: oom"),
        (lambda msg: Message(pack({}), reply_to=msg), "has no entry for it"),
        (lambda msg: (_ for _ in ()).throw(RuntimeError("node down")), "node down"),
    ],
)
def test_a_hostile_or_failing_nodes_reply_is_an_error_for_its_clients_only(reply, reason):
    cfg = validate({**SMALL, "num-clients": 4})
    inner = InProcessGrid(client_app, 2, cfg)
    grid = NodeCohortGrid(inner)
    grid.get_node_ids()
    messages = [Message(RecordDict(), dst_node_id=VIRTUAL_BASE + c, message_type="train") for c in range(4)]

    def hostile_node_100(msg, context):
        return reply(msg) if msg.metadata.dst_node_id == 100 else client_app(msg, context)

    inner.client_app = hostile_node_100
    replies = {r.metadata.src_node_id - VIRTUAL_BASE: r for r in grid.send_and_receive(messages)}
    assert sorted(replies) == [0, 1, 2, 3]
    for client in (0, 2):  # node 100's
        assert replies[client].has_error() and reason in replies[client].error.reason, replies[client].error.reason
    for client in (1, 3):  # node 101's: its own (here an error from the ClientApp: the train message is empty)
        assert replies[client].has_error() and "node" not in replies[client].error.reason.split(":")[0]


# ---------------------------------------------------------------------------- a run on node cohorts
ALGORITHM_RUNS = [
    {},
    {"algorithm": "dp-fedsam-topk"},
    {"algorithm": "dp2-fedsam", "fraction-evaluate": 1.0},
    {"noise-placement": "distributed"},
    {"noise-placement": "local"},
    {"adaptive-clipping": True},
    {"algorithm": "dp-ftrl", "sample-rate": 1.0},
    {"algorithm": "ali-dpfl", "target-epsilon": 5.0},
]


@pytest.mark.parametrize(
    "overrides", ALGORITHM_RUNS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "dp-fedavg"
)
def test_two_nodes_hosting_six_clients_run_as_six_nodes_of_one_client(tmp_path, overrides):
    """The same run config and seed: 6 clients on 2 nodes (node cohorts) and on 6 nodes (one client a node) sample
    the same clients, and every round's published figures and the summary's epsilon are equal (the clients' replies
    are computed by the same code on the same partitions; float32 sums in another order: 1e-6 relative)."""
    runs = {
        name: run(tmp_path, name, nodes, clients, **{"num-rounds": 2, **overrides})
        for name, nodes, clients in (("hosted", 2, 6), ("one-a-node", 6, 0))
    }
    (hosted, hosted_rounds, hosted_diag), (single, single_rounds, single_diag) = runs["hosted"], runs["one-a-node"]
    assert hosted["num_clients"] == single["num_clients"] == 6
    assert hosted["epsilon"] == pytest.approx(single["epsilon"], rel=1e-6) and math.isfinite(hosted["epsilon"])
    assert [r["clients"] for r in hosted_diag] == [r["clients"] for r in single_diag]
    assert all(r["failures"] == 0 for r in hosted_diag), hosted_diag
    for a, b in zip(hosted_rounds, single_rounds):
        for key in set(a) & set(b):
            if isinstance(a[key], float):
                assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), key


@pytest.mark.parametrize("overrides", [{}, {"algorithm": "dp2-fedsam", "fraction-evaluate": 1.0}], ids=["sgd", "heads"])
def test_a_node_answers_its_clients_as_one_batched_cohort(tmp_path, monkeypatch, overrides):
    """Every hosted client's train (and evaluate) reply comes from the batch (clients.cohort.batched), none from the
    one-by-one path; the run above equals the one-client-a-node run with it."""
    from dpfl.clients.cohort import batched

    counts = {"train": [0, 0], "evaluate": [0, 0]}  # [messages, batched replies]
    answer = batched.answer_batched

    def spy(kind, messages, clients, threads=None):
        done = answer(kind, messages, clients, threads)
        counts[kind][0] += len(messages)
        counts[kind][1] += len(done)
        return done

    monkeypatch.setattr(batched, "answer_batched", spy)
    summary, _, diagnostics = run(tmp_path, "hosted", 2, 6, **{"num-rounds": 2, **overrides})
    assert counts["train"][0] == sum(r["clients"] for r in diagnostics) > 0 and counts["train"][1] == counts["train"][0]
    assert counts["evaluate"][1] == counts["evaluate"][0] == (12 if overrides else 0)  # 6 clients, 2 rounds


def test_a_hosting_node_trains_on_the_cores_it_was_granted_never_all_the_hosts(monkeypatch):
    """Node config num-cpus (a deployed SuperNode), else the CPUs Ray assigned the simulation's ClientApp actor
    (client-resources-num-cpus), else 1."""
    import sys
    import types

    from dpfl.dpcore.task.threads import node_threads

    monkeypatch.delitem(sys.modules, "ray", raising=False)
    assert node_threads({"num-cpus": 3}) == 3 and node_threads({}) == 1
    context = types.SimpleNamespace(get_assigned_resources=lambda: {"CPU": 2.0, "memory": 1e9})
    fake_ray = types.SimpleNamespace(is_initialized=lambda: True, get_runtime_context=lambda: context)
    monkeypatch.setitem(sys.modules, "ray", fake_ray)
    assert node_threads({}) == 2 and node_threads({"num-cpus": 1}) == 1
