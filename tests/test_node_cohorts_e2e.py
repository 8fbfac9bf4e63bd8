"""Node cohorts end to end (issue 56): `flwr run .` on Flower's simulation engine with 2 SuperNodes hosting 20
clients, against 5 SuperNodes hosting the same 20; stock `flower-superlink` / `flower-supernode` processes
hosting several clients each. Slow: marked `slow`."""

import json
from pathlib import Path

import pytest

from dpfl.dpcore.privacy.accountants import epsilon_of
from dpfl.fl_app.results import read_rounds
from dpfl_tools.superlink import flwr_run_simulation

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
JOB = {
    "num-clients": 20,
    "dataset": "digits",
    "model": "mlp",
    "partitioner": "iid",
    "num-rounds": 10,
    "secure-rng": False,  # the same seed on 2 and 5 SuperNodes: the same clients, noise and model
}


def flwr_run(env: dict, out: Path, supernodes: int, **config) -> tuple[dict, str]:
    """Plain `flwr run .` of this app with `supernodes` simulated SuperNodes: (summary.json, the printed log)."""
    run = flwr_run_simulation(env, ROOT, {**JOB, "results-dir": str(out), **config}, supernodes)
    log = run.stdout + run.stderr
    assert run.returncode == 0 and (out / "summary.json").exists(), log[-4000:]
    return json.loads((out / "summary.json").read_text()), log


def test_two_supernodes_host_twenty_clients_and_learn_as_five_do(superlink, tmp_path):
    """Flower's default federation size (2 SuperNodes) trains the run's 20 clients: each node says which clients it
    hosts, each round's sample is of clients, one message and one reply a node; the run learns (digits: chance 0.1),
    its epsilon is the 20-client population's (q = 0.5, sigma 1, 10 rounds), and 5 SuperNodes hosting the same
    clients give the same epsilon and accuracy."""
    two, log = flwr_run(superlink, tmp_path / "two", 2)
    five, _ = flwr_run(superlink, tmp_path / "five", 5)
    assert two["num_clients"] == five["num_clients"] == 20
    assert "hosts 10 clients (0, 2, 4, ..., 18)" in log and "hosts 10 clients (1, 3, 5, ..., 19)" in log
    assert two["final_accuracy"] >= 0.7, two["final_accuracy"]
    assert abs(two["final_accuracy"] - five["final_accuracy"]) <= 0.03
    assert two["epsilon"] == pytest.approx(five["epsilon"], rel=1e-6)
    assert two["epsilon"] == pytest.approx(epsilon_of([(1.0, 0.5, 10)], 1e-5), rel=1e-6) and two["epsilon"] <= 25
    rounds = read_rounds(tmp_path / "two")
    assert len(rounds) == 10 and all(r["failures"] == 0 for r in rounds)
    assert sum(r["clients"] for r in rounds) > 2 * 10  # clients a round, not nodes (expected 10 of 20)


def test_stock_supernodes_host_several_clients_each(deployment, tmp_path):
    """flower-superlink and 2 stock flower-supernode processes, one hosting clients 0-3 (partition-id 0 of 2: the
    even ones of 8) and one naming its clients in its node config (client-ids = 1,3,5,7): 8 clients, every one in
    every round at sample-rate 1, one ClientApp message a node a round."""
    d = deployment()
    d.start_superlink()
    d.start_supernode("even", "partition-id=0 num-partitions=2")
    d.start_supernode("odd", "client-ids='1,3,5,7'")
    for name in ("even", "odd"):
        d.wait_connected(name)
    out = tmp_path / "run"
    cli = d.run_app(
        {**JOB, "num-clients": 8, "num-rounds": 2, "sample-rate": 1.0, "min-nodes": 2, "results-dir": str(out)}
    )
    assert cli.wait(timeout=400) == 0, d.log("cli")[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_clients"] == 8 and summary["rounds_completed"] == 2
    assert [r["clients"] for r in read_rounds(out)] == [8, 8]
    assert summary["epsilon"] == pytest.approx(epsilon_of([(1.0, 1.0, 2)], 1e-5), rel=1e-6)
    for name in ("even", "odd"):  # one train message a round (and one evaluate, none here), not one a client
        assert d.log(name).count("Receiving: train message") == 2, d.log(name)[-3000:]
