"""Real deployment on loopback, its restarts: a SuperNode started again under a new node id, the ServerApp killed
mid-run and resumed, the SuperLink restarted on its database (flower-superlink, flower-supernode, `flwr run`).

Slow: marked `slow`; a module of its own so that CI's slow tier runs it beside tests/test_deployment.py (the
helpers are that module's).
"""

import json
import time

import pytest

from dpfl.dpcore.privacy.accountants import epsilon_of
from dpfl.fl_app.results import read_rounds, read_status
from dpfl_tools.local_deployment import Deployment
from tests.independent_accountant import dp_accounting_epsilons
from tests.test_deployment import APP, RUN_TIMEOUT, deployment_of_three, finish, read_run

pytestmark = pytest.mark.slow


def test_a_supernode_restarted_under_a_new_node_id_keeps_its_clients_participation_record(deployment, tmp_path):
    """Issue 55: DP-FTRL (tree), 3 SuperNodes (clients 0-2), every client in round 1 of a 2-round epoch
    (sample-rate 1, ftrl-epoch-rounds 2), 3 rounds. While n2 trains in round 1, its SuperNode is started again with
    the same node config (stock flower-supernode: a new node id) and the old one stopped (started first, so that
    the new one is connected before round 2 chooses). Before: the new node id was a fresh record, and client 2 was
    sent a train message again in round 2, twice in one epoch. Now the server asks the new node who it is in round
    2, finds client 2 already in the epoch and sends it nothing; round 3 (the next epoch) takes all three."""
    d = deployment_of_three(deployment)
    results = tmp_path / "run"
    ftrl = {**APP, "algorithm": "dp-ftrl", "ftrl-epoch-rounds": 2}
    del ftrl["noise-placement"]  # DP-FTRL's noise is the server's
    cli = d.run_app({**ftrl, "num-rounds": 3, "min-nodes": 3, "results-dir": str(results)})
    deadline = time.monotonic() + RUN_TIMEOUT
    while "Receiving: train message" not in d.log("n2"):  # n2 has its round-1 train message
        assert time.monotonic() < deadline and cli.poll() is None, d.log("cli")[-3000:]
        time.sleep(0.1)
    d.start_supernode("n2-restarted", "partition-id=2 num-partitions=3")
    d.wait_connected("n2-restarted")
    d.stop_node("n2")
    finish(d, cli)

    summary, rounds = read_run(results)
    restarted = d.log("n2-restarted")
    asked = restarted.index("Receiving: query.client_id message")
    assert "ROUND 2]" in restarted[:asked].splitlines()[-2], restarted  # asked when round 2 chose its clients
    assert rounds[0]["clients"] in (2, 3) and [r["clients"] for r in rounds[1:]] == [0, 3], rounds
    assert restarted.count("Receiving: train message") == 1  # round 3's only
    assert summary["ftrl"]["participation_rule"].startswith("each client (its client id, asked of its node) at most")
    assert summary["ledger"]["trees"] == [[1.0, 2], [1.0, 1]]


def serverapp_pids(d: Deployment) -> list[int]:
    """The live flwr-serverapp processes the SuperLink started (the ServerApp of the run in progress)."""
    from dpfl_tools.processes import alive, descendants

    pids = []
    for pid in descendants(d.superlink.pid):
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:
            continue
        if b"flwr-serverapp" in cmdline and alive(pid):
            pids.append(pid)
    return pids


def test_serverapp_killed_mid_run_and_resumed(deployment, tmp_path):
    """SIGKILL the ServerApp after round 1 of 3, then `flwr run` again with resume = true: the run ends with an
    uninterrupted run's epsilon and records, and the ledger holds one event per round. (At sample-rate 1 with 3
    nodes up an uninterrupted run has all 3 clients every round and epsilon_of 3 rounds at sigma 1, q 1: checked
    here directly, where the test once ran that run too.)"""
    import os
    import signal

    d = deployment_of_three(deployment)
    run = {**APP, "num-rounds": 3, "min-nodes": 3}

    killed = tmp_path / "killed"
    cli = d.run_app({**run, "results-dir": str(killed)}, log="killed")
    deadline = time.monotonic() + RUN_TIMEOUT
    while not ((killed / "metrics.jsonl").exists() and (killed / "metrics.jsonl").read_text().count("\n") >= 1):
        assert time.monotonic() < deadline and cli.poll() is None, d.log("killed")[-3000:]
        time.sleep(0.2)
    pids = serverapp_pids(d)
    assert pids, "no flwr-serverapp process found under the SuperLink"
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    cli.wait(timeout=RUN_TIMEOUT)
    assert json.loads((killed / "status.json").read_text())["status"] == "running"  # what a killed run leaves
    assert not (killed / "summary.json").exists()

    finish(d, d.run_app({**run, "results-dir": str(killed), "resume": True}, log="resumed"), "resumed")
    resumed, resumed_rounds = read_run(killed)
    assert resumed["status"] == "completed" and resumed["resumed_after_round"] >= 1
    assert resumed["epsilon"] == pytest.approx(epsilon_of([(1.0, 1.0, 3)], 1e-5))
    assert [r["round"] for r in resumed_rounds] == [1, 2, 3]
    assert [r["clients"] for r in resumed_rounds] == [3, 3, 3]
    assert sum(steps for _, _, steps in resumed["ledger"]["model"]["history"]) == 3


def test_a_superlink_restart_with_its_database_and_a_resumed_run(deployment, tmp_path):
    """The SuperLink (with its ServerApp) SIGKILLed after round 1 of 3 and started again on its --database: the
    SuperNodes, retrying without limit (Flower's default), reconnect as the nodes they were, the killed run's
    status.json reads interrupted to a plain JSON reader once the resume's launcher (here: read_status) touches
    it, and `flwr run` with resume = true ends with the epsilon of 3 rounds: one ledger event per round."""
    d = deployment()
    d.start_superlink(database=tmp_path / "superlink-state.db")
    for i in range(2):
        d.start_supernode(f"n{i}", f"partition-id={i} num-partitions=2", idle_poll=0.2)
    for i in range(2):
        d.wait_connected(f"n{i}")
    folder, run = tmp_path / "run", {**APP, "num-rounds": 3, "min-nodes": 2}
    cli = d.run_app({**run, "results-dir": str(folder)}, log="first")
    deadline = time.monotonic() + RUN_TIMEOUT
    while len(read_rounds(folder)) < 1:
        assert time.monotonic() < deadline and cli.poll() is None, d.log("first")[-3000:]
        time.sleep(0.2)
    d.restart_superlink()
    cli.wait(timeout=60)  # the CLI's stream ends with the SuperLink it followed
    assert json.loads((folder / "status.json").read_text())["status"] == "running"  # what the killed run left
    assert read_status(folder)["status"] == "interrupted"
    assert json.loads((folder / "status.json").read_text())["status"] == "interrupted"  # now for any reader too

    finish(d, d.run_app({**run, "results-dir": str(folder), "resume": True}, log="resumed"), "resumed")
    summary, rounds = read_run(folder)
    assert summary["status"] == "completed" and summary["resumed_after_round"] >= 1
    assert [r["round"] for r in rounds] == [1, 2, 3] and all(r["clients"] == 2 for r in rounds)
    assert sum(steps for _, _, steps in summary["ledger"]["model"]["history"]) == 3
    eps_pld, _ = dp_accounting_epsilons(1.0, 1.0, 3, 1e-5)  # sigma 1, q 1, 3 rounds: an uninterrupted run's
    assert summary["epsilon"] == pytest.approx(epsilon_of([(1.0, 1.0, 3)], 1e-5))
    assert eps_pld * 0.99 <= summary["epsilon"] <= eps_pld * 1.02
    for name in ("n0", "n1"):  # the same nodes, never restarted: the database kept their registrations
        assert d.nodes[name].poll() is None and d.log(name).count("SuperNode ID:") == 1, d.log(name)[-3000:]
