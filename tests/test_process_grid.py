"""ProcessGrid (dpfl_tools/process_grid.py): a round's nodes over worker processes, each a grid for its share.

The replies equal one grid's (CohortGrid's within tests/test_cohort.py's tolerance: a share is a smaller batch;
InProcessGrid's bit for bit), each node's Context stays in its worker across rounds, the ledger and the epsilon are
identical, and a worker that dies stops the run after its last completed round, from which it resumes.
"""

from __future__ import annotations

import json
import os
import signal

import numpy as np
import pytest
import torch

from dpfl.fl_app.client_app import app as client_app
from dpfl.fl_app.config import validate
from dpfl.fl_app.results import read_status
from dpfl.fl_app.server_app import run_federated
from dpfl_tools.cohort import CohortGrid
from dpfl_tools.inprocess import InProcessGrid
from dpfl_tools.process_grid import ProcessGrid, placement
from tests.test_cohort import BASE, NODES, assert_replies_close, launch, train_messages


def config(tmp_path, name: str, **overrides):
    return validate({**BASE, **overrides, "results-dir": str(tmp_path / name)})


@pytest.mark.slow  # worker processes: 10-17 s each on 2 cores
def test_personal_heads_evaluations_and_epsilon_equal_one_cohort_grid(tmp_path):
    """DP2-FedSAM over 2 rounds, every node evaluated: each node's head lives in its worker's Context across
    rounds (a node answered by another worker would start again from the initial head, and its replies differ)."""
    torch.set_num_threads(1)
    overrides = {"algorithm": "dp2-fedsam", "num-rounds": 2, "fraction-evaluate": 1.0}
    one = CohortGrid(client_app, NODES, config(tmp_path, "one", **overrides))
    s1 = run_federated(one, config(tmp_path, "one", **overrides))
    with ProcessGrid(client_app, NODES, config(tmp_path, "two", **overrides), processes=2) as two:
        s2 = run_federated(two, config(tmp_path, "two", **overrides))
        assert len(two.workers) == 2
    assert len(two.received) == len(one.received) > 2 * NODES
    assert {m.metadata.message_type for m in two.received} == {"train", "evaluate"}
    assert_replies_close(one.received, two.received)
    assert s2["epsilon"] == s1["epsilon"] > 0
    ledgers = [
        [json.loads(line)["epsilon"] for line in (tmp_path / n / "metrics.jsonl").open()] for n in ("one", "two")
    ]
    assert ledgers[0] == ledgers[1] and len(ledgers[0]) == 2


@pytest.mark.slow  # worker processes: 10-17 s each on 2 cores
def test_inprocess_grids_in_processes_reply_bit_for_bit(tmp_path):
    """InProcessGrid's in 3 workers: the replies of InProcessGrid itself, bit for bit; a simulated crash (`fail`)
    costs that node's reply only."""
    cfg = config(tmp_path, "x", algorithm="dp-fedavg", **{"noise-placement": "distributed"})
    one = InProcessGrid(client_app, NODES, cfg)
    expected = one.send_and_receive(train_messages(one))
    crash = lambda node, _msg: node == 102  # noqa: E731
    with ProcessGrid(client_app, NODES, cfg, processes=3, grid_class=InProcessGrid, fail=crash) as grid:
        replies = grid.send_and_receive(train_messages(grid))
    assert [r.metadata.src_node_id for r in replies] == list(range(100, 100 + NODES))
    assert [r.has_error() for r in replies] == [n == 102 for n in range(100, 100 + NODES)]
    assert "node 102 crashed" in replies[2].error.reason
    for got, want in zip(replies, expected):
        if not got.has_error():
            for x, y in zip(got.content["arrays"].to_numpy_ndarrays(), want.content["arrays"].to_numpy_ndarrays()):
                assert np.array_equal(x, y)
            assert dict(got.content["metrics"]) == dict(want.content["metrics"])
    for peak in grid.worker_peaks:  # each worker's own, torch loaded; CUDA memory where it trained there
        assert peak["rss_mib"] > 100
        assert (peak["cuda_max_allocated_mib"] is None) == (not torch.cuda.is_available())


@pytest.mark.parametrize(
    ("k", "processes", "device", "gpus", "expected"),
    [
        (3, 8, "auto", 0, (None, 8)),  # the CPU: all share its budget
        (3, 8, "cuda", 1, (None, 8)),  # one GPU: all share it
        (3, 8, "auto", 4, (3, 2)),  # 8 workers on 4 GPUs: workers 3 and 7 on GPU 3
        (4, 5, "cuda", 2, (0, 3)),  # workers 0, 2, 4 on GPU 0
        (1, 5, "cuda", 2, (1, 2)),  # workers 1, 3 on GPU 1
        (2, 3, "auto", 8, (2, 1)),  # more GPUs than workers: one each
        (1, 4, "cuda:1", 4, (None, 4)),  # the run config names one GPU: all on it
        (1, 4, "cpu", 4, (None, 4)),
        (1, 4, None, 4, (None, 4)),  # a ClientApp of one's own: its own choice of device
    ],
)
def test_placement_spreads_workers_over_the_gpus(k, processes, device, gpus, expected):
    assert placement(k, processes, device, gpus) == expected


def test_placement_shares_each_gpu_among_exactly_the_workers_on_it():
    for gpus in range(2, 5):
        for processes in range(1, 10):
            placed = [placement(k, processes, "auto", gpus) for k in range(processes)]
            for gpu, sharing in placed:
                assert sharing == sum(other == gpu for other, _ in placed)


def test_refusals():
    cfg = validate({**BASE, "algorithm": "dp-fedavg"})
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=rf"processes = {bad!r}: an integer of at least 1"):
            ProcessGrid(client_app, NODES, cfg, processes=bad)
    with pytest.raises(ValueError, match="does not pickle.*module's top level"):
        ProcessGrid(lambda msg, context: msg, NODES, cfg, processes=2)


def test_launcher_refuses_processes_with_flwr(capsys):
    from dpfl_tools.launch import main

    with pytest.raises(SystemExit):
        main(["--processes", "2"])  # the default engine, flwr: Ray runs its own actors
    assert "--processes 2: allowed are 1 or more, and more than 1 only with --engine inprocess or cohort" in (
        capsys.readouterr().err
    )


class KillAtRound:
    """`fail` hook that kills worker 1 (node 101's) when round `at` is sent, and fails no node."""

    def __init__(self, at: int):
        self.at, self.grid = at, None

    def __call__(self, node: int, msg) -> bool:
        if node == 101 and msg.content["config"]["server-round"] == self.at:
            proc = self.grid.workers[self.grid.worker_of(node)][0]
            os.kill(proc.pid, signal.SIGKILL)
            proc.join()
        return False


@pytest.mark.slow
def test_a_dead_worker_stops_the_run_which_resumes_to_the_same_epsilon(tmp_path):
    overrides = {"algorithm": "dp-fedavg", "num-rounds": 3}
    whole = run_federated(
        InProcessGrid(client_app, NODES, config(tmp_path, "whole", **overrides)), config(tmp_path, "whole", **overrides)
    )
    cfg = config(tmp_path, "cut", **overrides)
    kill = KillAtRound(2)
    with ProcessGrid(client_app, NODES, cfg, processes=2, fail=kill) as grid:
        kill.grid = grid
        with pytest.raises(
            RuntimeError, match=r"worker process 1 \(pid \d+, exit code -9\) of the ProcessGrid died .*--resume"
        ):
            run_federated(grid, cfg)
    status = read_status(tmp_path / "cut")
    assert status["status"] == "failed" and status["completed_rounds"] == 1
    resumed = config(tmp_path, "cut", **overrides, resume=True)
    with ProcessGrid(client_app, NODES, resumed, processes=2) as grid:
        summary = run_federated(grid, resumed)
    assert summary["rounds_completed"] == 3 and summary["resumed_after_round"] == 1
    assert summary["epsilon"] == whole["epsilon"] > 0


@pytest.mark.slow
def test_launch_cohort_in_two_processes_same_accuracy_and_epsilon(tmp_path, capsys):
    """`python -m dpfl_tools.launch --engine cohort --processes 2`: the accuracy and epsilon of one process."""
    run_config = (
        'dataset="digits" model="mlp" num-rounds=3 sample-rate=1.0 noise-multiplier=0.1 clipping-norm=1.0 '
        "secure-rng=false tensorboard=false"
    )
    one = launch("cohort", tmp_path, run_config, 6)
    two = launch("cohort", tmp_path / "p", run_config, 6, "--processes", "2")
    assert two["epsilon"] == one["epsilon"] > 0 and two["rounds_completed"] == 3
    assert two["final_accuracy"] == pytest.approx(one["final_accuracy"], abs=0.01) and two["final_accuracy"] > 0.15


@pytest.mark.slow
def test_dpsgd_clients_in_processes_reply_and_account_as_one_grid(tmp_path):
    """ALI-DPFL's DP-SGD clients over 3 rounds in 2 workers: the replies (each with its client's sample-level
    epsilon after the round, from the ledger in its node's Context.state) and the run's epsilon equal one grid's.
    (A ledger lost with its worker would be charged again from the server's counts, `adopt_server_counts`: the
    personal-heads test above is the one that shows a node's state staying in its worker.)"""
    torch.set_num_threads(1)
    overrides = {"algorithm": "ali-dpfl", "num-rounds": 3, "target-epsilon": 20.0, "local-steps": 4}
    one = CohortGrid(client_app, NODES, config(tmp_path, "one", **overrides))
    s1 = run_federated(one, config(tmp_path, "one", **overrides))
    with ProcessGrid(client_app, NODES, config(tmp_path, "two", **overrides), processes=2) as two:
        s2 = run_federated(two, config(tmp_path, "two", **overrides))
    assert_replies_close(one.received, two.received)
    trains = [m.content["metrics"]["epsilon"] for m in two.received if m.metadata.message_type == "train"]
    first, last = trains[:NODES], trains[-NODES:]  # (the identity answers come first)
    assert len(last) == NODES and all(b > a > 0 for a, b in zip(first, last))  # each ledger grew across rounds
    assert s2["epsilon"] == s1["epsilon"] > 0


def refuse_to_start(reason: str) -> None:
    raise ValueError(reason)


@pytest.mark.slow  # worker processes: 10-17 s each on 2 cores
def test_a_worker_that_cannot_start_raises_before_any_round():
    cfg = validate({**BASE, "algorithm": "dp-fedavg"})
    with pytest.raises(
        RuntimeError, match="worker process 0 of the ProcessGrid could not build its grid: ValueError: no"
    ):
        ProcessGrid(client_app, NODES, cfg, processes=2, initializer=refuse_to_start, initargs=("no data here",))


def threads_app(msg, _context):
    """A ClientApp of one's own that answers with its process's torch threads and its cohort_train.cores()."""
    from flwr.app import Message, MetricRecord, RecordDict

    from dpfl.clients.cohort import train as cohort_train

    threads = {"torch-threads": torch.get_num_threads(), "cores": cohort_train.cores()}
    return Message(RecordDict({"metrics": MetricRecord(threads)}), reply_to=msg)


@pytest.mark.slow  # worker processes: 10-17 s each on 2 cores
def test_workers_share_the_cores_instead_of_each_taking_all():
    """P workers side by side take cores // P threads each (torch's and the uploads' pool), not P x cores."""
    cfg = validate({**BASE, "algorithm": "dp-fedavg"})
    available = len(os.sched_getaffinity(0))
    with ProcessGrid(threads_app, NODES, cfg, processes=2, grid_class=InProcessGrid) as grid:
        replies = grid.send_and_receive(train_messages(grid))
    shares = {(r.content["metrics"]["torch-threads"], r.content["metrics"]["cores"]) for r in replies}
    assert shares == {(max(1, available // 2), max(1, available // 2))}
