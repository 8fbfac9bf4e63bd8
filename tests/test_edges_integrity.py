"""Integrity at the edges (issue 26, third part): ALI-DPFL trusts no number a client sends (its ledgers keyed by
the SuperLink's node ids), runs that aggregated nothing say so, hung nodes count as failures."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from dpfl.dpcore.privacy.accountants import epsilon_of
from dpfl.dpcore.privacy.mechanisms import flatten
from dpfl.strategies.dp_fedavg import DPFedAvg
from dpfl.strategies.loop.options import DPSGDOptions, RunOptions, SamplingOptions, ServerData
from dpfl.strategies.sample_level.ali_dpfl import ALIDPFL
from dpfl_tools.inprocess import InProcessGrid

SIZES = [10, 30, 60, 99]


def public_size(pid: int, num_partitions: int) -> int:
    """Public partition sizes that depend on the number of partitions, as a real partitioner's do."""
    if not 0 <= pid < num_partitions:
        raise ValueError(f"partition_id={pid} out of range for {num_partitions}")
    return 100 * num_partitions + pid


def honest_reply(msg: Message, context: Context, lie: dict | None = None) -> Message:
    """Node of partition i uploads (i + 1) e_0, one DP-SGD step, its public size; `lie` overrides metrics."""
    pid, n = int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    arrays = msg.content["arrays"].to_numpy_ndarrays()
    update = [np.zeros_like(a) for a in arrays]
    update[0].flat[0] = pid + 1.0
    steps = int(context.state["metrics"]["steps"]) + 1 if "metrics" in context.state else 1
    context.state["metrics"] = MetricRecord({"steps": steps})
    metrics = {
        "partition-id": pid,
        "num-partitions": n,
        "local-steps": 1,
        "dpsgd-steps": steps,
        "num-examples": public_size(pid, n),
        "epsilon": epsilon_of([(1.0, 0.1, steps)], 1e-5),
        **(lie or {}),
    }
    return Message(RecordDict({"arrays": ArrayRecord(update), "metrics": MetricRecord(metrics)}), reply_to=msg)


def app_with_liar(lie: dict, from_round: int = 1, liar_pid: int = 0) -> ClientApp:
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        lying = (
            int(context.node_config["partition-id"]) == liar_pid
            and int(msg.content["config"]["server-round"]) >= from_round
        )
        return honest_reply(msg, context, lie if lying else None)

    return app


def ali(min_available_nodes: int = 2, **dpsgd) -> ALIDPFL:
    return ALIDPFL(
        dpsgd=DPSGDOptions(0.1, 1.0, 1.0, **{"target_epsilon": 5.0, "adaptive": False, "local_steps": 1, **dpsgd}),
        sampling=SamplingOptions(1.0, min_available_nodes=min_available_nodes),
        run=RunOptions(secure_rng=False),
        server_data=ServerData(partition_size=public_size),
    )


def initial() -> ArrayRecord:
    return ArrayRecord([np.zeros((3, 2), np.float32), np.zeros(3, np.float32)])


def test_a_client_mu_that_underflows_does_not_crash_the_server_app():
    """mu = 1e-170 squares to 0: before, eq. (9)'s 4 / mu^2 raised ZeroDivisionError in the ServerApp; now tau* is
    unbounded and tau is capped at R_c."""
    strategy = ali(adaptive=True, mu_source="clients", mu_noise_multiplier=10.0)
    grid = InProcessGrid(app_with_liar({"mu": 1e-170, "mu-releases": 1}), 3, {})
    result = strategy.start(grid, initial(), num_rounds=2)
    first = result.train_metrics_clientapp[1]
    assert first["mu"] == pytest.approx(1e-170 / 3) and first["tau_next"] == strategy.schedule.steps_budget
    assert math.isinf(first["tau_star"]) and strategy.record.completed_rounds == 2


def test_a_client_lying_about_its_partition_id_charges_only_its_own_ledger():
    """Node 100 (partition 0) claims partition 1 from round 2. Its reply is weighed by partition 1's public size
    (the id binds nothing), but its steps go to its own ledger, 100, and the honest owner, 101, is accepted."""
    strategy = ali()
    grid = InProcessGrid(app_with_liar({"partition-id": 1, "num-examples": public_size(1, 3)}, from_round=2), 3, {})
    result = strategy.start(grid, initial(), num_rounds=2)
    second = result.train_metrics_clientapp[2]
    assert second["clients"] == 3 and second["rejected"] == 0
    assert set(strategy.ledger.clients) == {100, 101, 102}
    assert strategy.spent.steps_taken == {100: 2, 101: 2, 102: 2}
    # round 2: weights 301 (the liar's claim), 301, 302 on the first entries 1, 2, 3
    assert flatten(result.arrays.to_numpy_ndarrays())[0] == pytest.approx((301 * 1 + 301 * 2 + 302 * 3) / 904, rel=1e-6)


def test_a_node_claiming_another_partition_first_does_not_lock_its_owner_out_and_resume_keeps_the_ledgers():
    """Issue 35 item 5. Node 100 claims partition 1 from round 1. Before: it was bound to partition 1 and the
    honest node 101 was refused in every round ("partition id 1 is bound to another node (100)"). Now both are
    accepted, each charged on its own node id, also after a resume."""
    app = app_with_liar({"partition-id": 1, "num-examples": public_size(1, 3)})
    strategy, grid = ali(), InProcessGrid(app, 3, {})
    first = strategy.start(grid, initial(), num_rounds=1).train_metrics_clientapp[1]
    assert first["clients"] == 3 and first["rejected"] == 0
    assert strategy.spent.steps_taken == {100: 1, 101: 1, 102: 1}
    state = json.loads(json.dumps(strategy.state_dict()))
    resumed = ali()
    resumed.load_state_dict(state)
    assert resumed.spent.steps_taken == {100: 1, 101: 1, 102: 1}
    result = resumed.start(grid, initial(), num_rounds=2)  # the same SuperNodes (ServerApp restarted)
    assert resumed.spent.steps_taken == {100: 2, 101: 2, 102: 2} and result.train_metrics_clientapp[2]["rejected"] == 0


def test_a_node_charged_for_a_claimed_partition_is_told_only_its_own_spent_steps():
    """Issue 35 item 5. Node 100 claims partition 1 with dpsgd-steps = 3 in round 1 (tau 3). Before: the train
    config told partition 1's real client (node 101) spent-steps = 3. Now each node is told what its own node id
    was charged: 3 for the liar, 1 for the honest nodes."""
    app = app_with_liar({"partition-id": 1, "num-examples": public_size(1, 3), "dpsgd-steps": 3, "local-steps": 3})
    strategy, grid = ali(local_steps=3), InProcessGrid(app, 3, {})
    strategy.start(grid, initial(), num_rounds=1)
    assert strategy.spent.steps_taken == {100: 3, 101: 1, 102: 1}
    messages = strategy.configure_train(2, initial(), ConfigRecord(), grid)
    told = {m.metadata.dst_node_id: int(m.content["config"]["spent-steps"]) for m in messages}
    assert told == {100: 3, 101: 1, 102: 1}


def test_fewer_connected_nodes_than_partitions_are_weighted_at_the_default_num_partitions():
    """Issue 35 item 6. 2 SuperNodes of a 4-partition deployment, num_partitions = 0 (the default). Before: the server
    computed the public sizes for 2 partitions (the connected count) and rejected both honest replies ("num-examples
    400 differs from partition 0's public size 200"). Now it looks each size up for the count the node reports from
    its node config (4), as it does for the run config's num-partitions = 4; a count below the connected nodes is
    refused."""
    grid = InProcessGrid(app_with_liar({}), 4, {})
    grid.contexts = {node: ctx for node, ctx in grid.contexts.items() if node < 102}  # partitions 0, 1 of 4

    def fresh_nodes() -> None:
        grid.contexts = {
            node: Context(run_id=1, node_id=node, node_config=dict(ctx.node_config), state=RecordDict(), run_config={})
            for node, ctx in grid.contexts.items()
        }

    for strategy in (ali(min_available_nodes=2), ali(num_partitions=4, min_available_nodes=2)):
        fresh_nodes()
        result = strategy.start(grid, initial(), num_rounds=1)
        assert result.train_metrics_clientapp[1]["clients"] == 2 and result.train_metrics_clientapp[1]["rejected"] == 0
        # weights 400 and 401 on the first entries 1 and 2
        assert flatten(result.arrays.to_numpy_ndarrays())[0] == pytest.approx((400 + 401 * 2) / 801, rel=1e-6)
    fresh_nodes()
    grid.client_app = app_with_liar({"num-partitions": 1, "partition-id": 0, "num-examples": public_size(0, 1)})
    strategy = ali(min_available_nodes=2)
    metrics = strategy.start(grid, initial(), num_rounds=1).train_metrics_clientapp[1]
    assert metrics["clients"] == 1 and metrics["rejected"] == 1
    assert any("num-partitions 1 is fewer than the 2 nodes" in p for p in strategy.record.history[0]["problems"])


def test_a_reply_from_a_node_that_was_not_sampled_or_twice_from_one_node_is_rejected():
    """Who replied is the SuperLink's src_node_id. Before: DP-FedAvg averaged a node's second reply and a reply
    from a node it never sampled (5 clients of 3 nodes)."""
    strategy = DPFedAvg(sample_rate=1.0, clipping_norm=10.0, noise_multiplier=0.0, noise_placement="central")
    grid = InProcessGrid(app_with_liar({}), 3, {})
    original = grid.send_and_receive

    def duplicating(messages, *, timeout=None):
        replies = list(original(messages, timeout=timeout))
        stranger = Message(replies[0].content, reply_to=replies[0])  # a reply the SuperLink says came from node 1
        return replies + [replies[1], stranger]

    grid.send_and_receive = duplicating
    metrics = strategy.start(grid, initial(), num_rounds=1).train_metrics_clientapp[1]
    assert metrics["clients"] == 3 and metrics["rejected"] == 2


# ---------------------------------------------------------------- failed runs say so; hung nodes are failures

NO_UPDATE_AGGREGATED = "no client update was aggregated in any round"


def small_run_config(tmp_path, algorithm="ali-dpfl"):
    from dpfl.fl_app.config import validate

    common = {
        "dataset": "digits",
        "model": "mlp",
        "partitioner": "iid",
        "sample-rate": 1.0,
        "num-rounds": 2,
        "local-steps": 1,
        "results-dir": str(tmp_path),
    }
    if algorithm == "ali-dpfl":
        common.update(
            {
                "batch-sample-rate": 0.1,
                "sample-noise-multiplier": 1.5,
                "sample-clipping-norm": 1.0,
                "target-epsilon": 3.0,
                "adaptive": False,
            }
        )
    return validate({"algorithm": algorithm, **common})


@pytest.mark.parametrize("algorithm", ["ali-dpfl", "dp-fedavg"])
def test_a_run_in_which_every_client_fails_stops_at_round_1_and_the_launcher_exits_non_zero(tmp_path, algorithm):
    """Before: status 'completed' (the launcher exited 0) though no client update was ever aggregated; then two
    noise-only rounds charged and printed before 'failed'. Issue 55 item 2: the run stops in round 1, naming the
    client's error, with nothing released or charged."""
    from dpfl.fl_app.client_app import app as client_app
    from dpfl.fl_app.server_app import run_federated
    from dpfl.strategies.loop.reply_gate import EveryClientFailed
    from dpfl_tools.launch import run_status

    cfg = small_run_config(tmp_path, algorithm=algorithm)
    first = (
        r"Round 1: every sampled client failed \(3 of 3\) .* The first client's error: RuntimeError: node 10\d crashed"
    )
    with pytest.raises(EveryClientFailed, match=first):
        run_federated(InProcessGrid(client_app, 3, cfg, fail=lambda node, msg: True), cfg)
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["status"] == "failed" and status["completed_rounds"] == 0
    assert status["error"].startswith("EveryClientFailed: Round 1: every sampled client failed (3 of 3)")
    assert run_status(tmp_path) == "failed"  # what the launcher's exit code follows (non-zero unless completed)
    assert not (tmp_path / "metrics.jsonl").exists() or (tmp_path / "metrics.jsonl").read_text() == ""


@pytest.mark.parametrize("algorithm", ["ali-dpfl", "dp-fedavg"])
def test_a_run_in_which_every_reply_is_rejected_says_failed_and_the_launcher_exits_non_zero(tmp_path, algorithm):
    """Rejected replies (not failures) do not stop the run; it ends 'failed' since no update was aggregated."""
    from dpfl.fl_app.server_app import run_federated
    from dpfl_tools.launch import run_status

    def one_array_reply(msg: Message, context: Context) -> Message:  # the model has more than one array
        arrays = ArrayRecord([np.zeros(1, np.float32)])
        return Message(RecordDict({"arrays": arrays, "metrics": MetricRecord({"num-examples": 1})}), reply_to=msg)

    cfg = small_run_config(tmp_path, algorithm=algorithm)
    summary = run_federated(InProcessGrid(one_array_reply, 3, cfg), cfg)
    folder = Path(summary["results_dir"])
    status = json.loads((folder / "status.json").read_text())
    assert status["status"] == "failed" and status["reason"] == NO_UPDATE_AGGREGATED
    assert run_status(folder) == "failed"
    written = json.loads((folder / "summary.json").read_text())
    assert written["status"] == "failed" and written["failure_reason"] == NO_UPDATE_AGGREGATED
    assert written["rounds_completed"] == 2


def test_a_run_in_which_one_client_trains_completes(tmp_path):
    from dpfl.fl_app.client_app import app as client_app
    from dpfl.fl_app.server_app import run_federated

    cfg = small_run_config(tmp_path)
    summary = run_federated(InProcessGrid(client_app, 3, cfg, fail=lambda node, msg: node != 101), cfg)
    assert summary["status"] == "completed" and "failure_reason" not in summary


class HangingGrid(InProcessGrid):
    """Node 101 is SIGSTOPped: its replies never come (no error message either), as at a round-timeout."""

    def send_and_receive(self, messages, *, timeout=None):
        return [r for r in super().send_and_receive(messages, timeout=timeout) if r.metadata.src_node_id != 101]


def test_a_hung_node_whose_reply_never_comes_is_a_failure_in_the_round_diagnostics():
    """Before: 'failures' 0 and no 'failed_nodes' entry: a reply missing at the timeout is no error message."""
    strategy = ali()
    strategy.start(HangingGrid(app_with_liar({}), 3, {}), initial(), num_rounds=1)
    record = strategy.record.history[0]
    assert record["clients"] == 2 and record["failures"] == 1
    assert record["failed_nodes"] == ["node 101: no reply before round-timeout"]
    assert "node 101 failed: no reply before round-timeout" in record["problems"]


# ---------------------------------------------------------------- a restarted SuperNode keeps its client's ledger (issue 55)
def adopting_app() -> ClientApp:
    """honest_reply's client, which answers the identity query (node config partition-id) and adopts the
    spent-steps the server tells it, as DPSGDClient does when its own state was lost."""
    from dpfl.clients.identity import answer_client_id

    app = ClientApp()
    app.query("client_id")(answer_client_id)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        own = int(context.state["metrics"]["steps"]) if "metrics" in context.state else 0
        context.state["metrics"] = MetricRecord({"steps": max(own, int(msg.content["config"]["spent-steps"]))})
        return honest_reply(msg, context)

    return app


def test_a_restarted_supernode_is_told_its_clients_spent_steps_and_charged_on_its_ledger():
    """Node 100 (client 0) restarts after round 1 under a new node id with a fresh Context. Before: the new node id
    was told spent-steps 0 and charged on a new ledger (client 0's two steps split over two ledgers of one step:
    the printed epsilon that of 1 step for it). Now it is told client 0's 1 step and charged on client 0's ledger."""
    strategy, grid = ali(), InProcessGrid(adopting_app(), 3, {})
    strategy.start(grid, initial(), num_rounds=1)
    old = grid.contexts.pop(100)
    grid.contexts[7_000_000_007] = Context(
        run_id=old.run_id, node_id=7_000_000_007, node_config=old.node_config, state=RecordDict(), run_config={}
    )
    messages = list(strategy.configure_train(2, initial(), ConfigRecord(), grid))
    told = {m.metadata.dst_node_id: int(m.content["config"]["spent-steps"]) for m in messages}
    assert told == {7_000_000_007: 1, 101: 1, 102: 1}
    _, metrics = strategy.aggregate_train(2, grid.send_and_receive(messages))
    assert metrics["clients"] == 3 and strategy.spent.steps_taken == {0: 2, 1: 2, 2: 2}
    assert strategy.ledger.epsilon_per_client() == {c: epsilon_of([(1.0, 0.1, 2)], 1e-5) for c in (0, 1, 2)}
