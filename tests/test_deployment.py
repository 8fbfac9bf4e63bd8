"""Real deployment on loopback: flower-superlink + flower-supernode processes and `flwr run`.

Slow (a ClientApp is a fresh process per message): marked `slow`. Ports 19000-19999, a private
FLWR_HOME per process, every process ended by PID when the test ends (also on failure).
"""

import json
import math
import time
from pathlib import Path

import pytest

from dpfl.dpcore.privacy.accountants import epsilon_of
from dpfl.dpcore.privacy.mechanisms import noise_share_count, topup_noise_std
from dpfl.fl_app.results import read_rounds
from dpfl_tools import ROOT
from dpfl_tools.local_deployment import Deployment, make_node_keys

pytestmark = pytest.mark.slow

APP = {
    "dataset": "digits",
    "model": "mlp",
    "partitioner": "iid",
    "sample-rate": 1.0,
    "local-epochs": 1,
    "clipping-norm": 0.5,
    "noise-multiplier": 1.0,
    "noise-placement": "distributed",
}
RUN_TIMEOUT = 400


def deployment_of_three(deployment) -> Deployment:
    """A SuperLink and SuperNodes n0, n1, n2 (partition-id 0, 1, 2 of 3), all connected, from the fixture."""
    d = deployment()
    d.start_superlink()
    for i in range(3):
        d.start_supernode(f"n{i}", f"partition-id={i} num-partitions=3")
    for i in range(3):
        d.wait_connected(f"n{i}")
    return d


def finish(d: Deployment, cli, log: str = "cli") -> None:
    try:
        cli.wait(timeout=RUN_TIMEOUT)
    except Exception:
        pytest.fail(f"flwr run did not finish:\n{d.log(log)[-3000:]}")
    assert cli.returncode == 0, d.log(log)[-3000:]


def read_run(folder) -> tuple[dict, list[dict]]:
    """(summary.json with diagnostics-summary.json, each round of metrics.jsonl with its diagnostics)."""
    summary = {
        **json.loads((folder / "diagnostics-summary.json").read_text()),
        **json.loads((folder / "summary.json").read_text()),
    }
    return summary, read_rounds(folder)


def test_supernodes_with_bad_input_and_a_crash(deployment, tmp_path):
    """3 good SuperNodes, one without a partition id, one out of range; a good one is killed in the
    middle of round 1 and restarted. The run finishes; the failures are recorded; the restarted
    node takes part in round 2; the missing noise shares are topped up."""
    d = deployment()
    d.start_superlink()
    for i in range(3):
        d.start_supernode(f"n{i}", f"partition-id={i} num-partitions=3")
    d.start_supernode("no-partition")
    d.start_supernode("out-of-range", "partition-id=7 num-partitions=3")
    for name in ("n0", "n1", "n2", "no-partition", "out-of-range"):
        d.wait_connected(name)
    results = tmp_path / "run"
    cli = d.run_app({**APP, "num-rounds": 2, "min-nodes": 5, "results-dir": str(results)})

    deadline = time.monotonic() + RUN_TIMEOUT
    while not d.clientapp_running("n2"):  # n2 is training in round 1
        assert time.monotonic() < deadline and cli.poll() is None, d.log("cli")[-3000:]
        time.sleep(0.1)
    d.stop_node("n2")
    d.start_supernode("n2-restarted", "partition-id=2 num-partitions=3")
    d.wait_connected("n2-restarted")
    finish(d, cli)

    summary, rounds = read_run(results)
    assert summary["rounds_completed"] == 2 and summary["num_clients"] == 5
    first, second = rounds
    # round 1: n0, n1 contribute; n2 (killed) and the two misconfigured nodes fail, each with its reason
    assert first["clients"] == 2 and first["failures"] == 3 and first["rejected"] == 0
    reasons = "\n".join(first["failed_nodes"])
    assert set(first) - set(json.loads((results / "metrics.jsonl").read_text().splitlines()[0])) >= {
        "clients",
        "failures",
        "failed_nodes",
        "server_noise_std",
    }  # how many took part: diagnostics only
    assert "node config lacks partition-id, num-partitions" in reasons
    assert "partition-id=7 is out of range: must be in [0, 2]" in reasons
    assert "Node Unavailable" in reasons or "unavailable" in reasons.lower()
    # n_s = 6 noise shares (5 nodes at q = 1, and a neighbour has one more), 2 arrived: the server adds
    # sigma C sqrt(4/6), so the release carries sigma C whatever the count
    assert first["server_noise_std"] == pytest.approx(1.0 * 0.5 * math.sqrt(4 / 6))
    # round 2: the restarted node is back
    assert second["clients"] == 3 and second["failures"] == 2
    assert second["server_noise_std"] == pytest.approx(1.0 * 0.5 * math.sqrt(3 / 6))
    assert summary["epsilon"] == pytest.approx(epsilon_of([(1.0, 1.0, 2)], 1e-5)) and summary["delta"] == 1e-5
    assert summary["epsilon_against_server"] > summary["epsilon"]
    assert "Node Unavailable" not in "\n".join(second["failed_nodes"])


def test_a_node_that_withholds_its_reply_objects_costs_one_round_timeout(deployment, tmp_path):
    """A node that sends its reply but never the reply's objects (tests/withholding_supernode.py). Flower's
    ServerApp would retry those objects until the SuperLink's push session expired (180 s, renewable) or
    for up to 7200 s, inside one pull; here each exchange gives up at `round-timeout`, counts the node as
    failed, and the other two nodes' updates and the noise top-up make the round. The ledger charges the
    rounds as if nothing happened."""
    d = deployment()
    d.start_superlink()
    for i in range(2):
        d.start_supernode(f"n{i}", f"partition-id={i} num-partitions=3", idle_poll=0.2)
    d.start_supernode(
        "withholding", "partition-id=2 num-partitions=3", idle_poll=0.2, node_module="tests.withholding_supernode"
    )
    for name in ("n0", "n1", "withholding"):
        d.wait_connected(name)
    # 45 s: the honest nodes' first ClientApp start (torch's import) took over 15 s under CI's load, and a first
    # round in which every node failed stops the run (EveryClientFailed)
    results, timeout = tmp_path / "run", 45.0
    cli = d.run_app(
        {
            **APP,
            "num-rounds": 2,
            "min-nodes": 3,
            "round-timeout": timeout,
            "flower-speed-patches": True,
            "results-dir": str(results),
        }
    )
    finish(d, cli)

    summary, rounds = read_run(results)
    assert summary["rounds_completed"] == 2
    shares = noise_share_count(3, 1.0)
    for rnd in rounds:
        assert rnd["clients"] == 2 and rnd["failures"] == 1, rnd
        assert "objects are unavailable" in "\n".join(rnd["failed_nodes"]), rnd["failed_nodes"]
        assert timeout - 1 < rnd["seconds"] < timeout + 5, rnd["seconds"]  # not 180 s; a pull ends <= 1.2 s late
        assert rnd["server_noise_std"] == pytest.approx(topup_noise_std(1.0, 0.5, shares, 2))
    assert summary["epsilon"] == pytest.approx(epsilon_of([(1.0, 1.0, 2)], 1e-5))
    assert "Sent successfully" in d.log("withholding")  # the reply's message did reach the SuperLink


def test_tls_supernode_auth_and_a_foreign_app(deployment, tmp_path):
    """TLS with a CA made here and SuperNode authentication: registered nodes run the app; an
    unregistered node, an insecure node and an insecure CLI are refused with a clear error. Then a
    foreign app (its own model and client, our mod and strategy) runs on the same federation,
    with one node whose model does not match: that node fails alone, the run goes on."""
    d = deployment(tls=True, auth=True)
    d.start_superlink()
    d.write_cli_config()
    nodes = {
        "n0": "partition-id=0 num-partitions=3",
        "n1": "partition-id=1 num-partitions=3",
        "n2": "partition-id=2 num-partitions=3",
        "odd": "partition-id=2 num-partitions=3 classes=9",
    }  # `classes`: the foreign app's model size
    keys = {name: make_node_keys(tmp_path / "keys", name) for name in nodes}
    registrations = {name: d.register(public) for name, (_, public) in keys.items()}
    for name, node_config in nodes.items():
        registered = registrations[name]
        assert registered.wait(timeout=120) == 0, d.log(f"register-{name}")
        d.start_supernode(name, node_config, private_key=keys[name][0])
    stranger, _ = make_node_keys(tmp_path / "keys", "stranger")
    refused = {
        "unregistered": d.start_supernode(
            "unregistered", nodes["n0"], private_key=stranger, extra=["--max-retries", "1"]
        ),
        "insecure": d.start_supernode("insecure", nodes["n0"], insecure=True, extra=["--max-retries", "1"]),
    }
    for name in nodes:
        d.wait_connected(name)

    # our app and the foreign app run at the same time on this federation
    results, foreign = tmp_path / "run", tmp_path / "foreign"
    ours = d.run_app({**APP, "num-rounds": 1, "min-nodes": 4, "results-dir": str(results)})
    # sigma 0.4 (the foreign app's default is 0.7): at 0.7 the 210-parameter model after 2 rounds of 3 clients
    # reached 0.53 +- 0.10 and was at or below 0.3 in 1.2% of 3,000 in-process runs (noise from OS entropy); at 0.4,
    # 0.84 +- 0.06 (lowest 0.55 of 2,000)
    theirs = d.run_app(
        {"num-rounds": 2, "min-nodes": 4, "noise-multiplier": 0.4, "results-dir": str(foreign)},
        app=ROOT / "tests" / "foreign_app",
        log="foreign-cli",
    )
    finish(d, ours)
    finish(d, theirs, "foreign-cli")
    summary, rounds = read_run(results)
    assert summary["rounds_completed"] == 1 and rounds[0]["clients"] == 4 and rounds[0]["failures"] == 0
    assert summary["epsilon"] == pytest.approx(epsilon_of([(1.0, 1.0, 1)], 1e-5))

    for name, proc in refused.items():
        assert proc.wait(timeout=60) != 0, d.log(name)
        assert "Failed to initialize the connection to the SuperLink" in d.log(name)
    assert "Failed to activate SuperNode" in d.log("unregistered") and "SuperNode ID:" not in d.log("unregistered")
    insecure_cli = d.run_app(
        {**APP, "num-rounds": 1, "results-dir": str(tmp_path / "never")}, insecure=True, log="insecure-cli"
    )
    assert insecure_cli.wait(timeout=120) != 0
    assert "Connection to the SuperLink is unavailable" in d.log("insecure-cli")
    assert not (tmp_path / "never").exists()

    result = json.loads((foreign / "summary.json").read_text())
    assert len(result["history"]) == 2
    for record in result["history"]:
        assert record["clients"] == 3 and record["failures"] == 1
        assert (
            "the client's model does not match the global model: array 0 has shape (20, 9), expected (20, 10)"
            in record["failed_nodes"][0]
        )
    assert result["final_accuracy"] > 0.3  # 10 classes: chance is 0.1
    assert result["epsilon"] == pytest.approx(epsilon_of([(0.4, 1.0, 2)], 1e-5))


def test_trusted_entities_supernode_refuses_unsigned_apps(deployment, tmp_path):
    """flwr 1.41: a SuperNode started with --trusted-entities runs only FABs that carry the platform's
    verification and an ed25519 signature by a listed key. The open-source SuperLink verifies no app, so
    that node refuses this (unsigned) app: its reply is an error, the others train, the run completes."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    key = (
        ed25519.Ed25519PrivateKey.generate()
        .public_key()
        .public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        .decode()
    )
    trusted = tmp_path / "trusted.yaml"
    trusted.write_text(f"fpk_00000000-0000-0000-0000-000000000001: '{key} test'\n")
    d = deployment()
    d.start_superlink()
    d.start_supernode("n0", "partition-id=0 num-partitions=3")
    d.start_supernode("n1", "partition-id=1 num-partitions=3")
    d.start_supernode("strict", "partition-id=2 num-partitions=3", extra=["--trusted-entities", str(trusted)])
    for name in ("n0", "n1", "strict"):
        d.wait_connected(name)
    finish(d, d.run_app({**APP, "num-rounds": 1, "min-nodes": 3, "results-dir": str(tmp_path / "run")}))
    summary, (first,) = read_run(tmp_path / "run")
    assert summary["status"] == "completed" and first["clients"] == 2 and first["failures"] == 1
    assert "could not be verified" in d.log("strict") or "verification" in d.log("strict").lower()


def test_warm_clientapps_under_process_isolation(deployment, tmp_path):
    """SuperNodes with `--isolation process` and `dpfl_tools.clientapp_executor`: every message is answered by a
    child forked from the executor (the node starts no SuperExec, so no `flwr-clientapp`), each exits cleanly,
    and the runs, SecAgg+ included, have every client in every round and the ledger's epsilon."""
    import re

    d = deployment()
    d.start_superlink()
    for i in range(3):  # two nodes on dpfl_tools.supernode (Flower's idle sleeps capped), one on flower-supernode
        d.start_supernode(f"n{i}", f"partition-id={i} num-partitions=3", warm=True, idle_poll=0.2 if i < 2 else None)
    for i in range(3):
        d.wait_connected(f"n{i}")
    assert "idle sleeps capped at 0.2 s" in d.log("n0") and "idle sleeps capped" not in d.log("n2")
    for secure in (False, True):
        folder = tmp_path / f"secure-{secure}"
        finish(
            d,
            d.run_app(
                {**APP, "num-rounds": 2, "min-nodes": 3, "secure-aggregation": secure, "results-dir": str(folder)},
                log=f"cli-{secure}",
            ),
            f"cli-{secure}",
        )
        summary, rounds = read_run(folder)
        assert [r["clients"] for r in rounds] == [3, 3] and all(r["failures"] == 0 for r in rounds)
        reserve = 2 * 1e-9 if secure else 0.0  # DPSecAggPlusWorkflow's quantizer-clip probability a round
        assert summary["epsilon"] == pytest.approx(epsilon_of([(1.0, 1.0, 2)], summary["delta"] - reserve))
        assert summary["delta"] == 1e-5
    for i in range(3):
        log = d.log(f"n{i}-executor")
        exits = re.findall(r"ClientApp task pid \d+ exit (-?\d+)", log)
        assert exits == ["0"] * (2 + 2 * 4), log[-2000:]  # plain: 1 message per round; SecAgg+: 4
        origins = re.findall(r"ClientApp task pid \d+ ran fl_app from (\S+)", log)
        assert len(origins) == len(exits) and all(  # the run's FAB, installed on this node; not the executor's
            Path(o).is_relative_to(d.tmp / "homes" / f"n{i}" / "apps") for o in origins
        ), origins
        assert "Starting Flower SuperExec" not in d.log(f"n{i}")  # the node started no flwr-clientapp itself
