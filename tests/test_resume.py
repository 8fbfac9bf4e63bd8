"""Checkpoint and resume: a ServerApp killed at the start of a round and resumed ends where the
uninterrupted run ends (same model, same epsilon, same records), with exactly one ledger event per
completed round, for every algorithm family; a folder holding a previous run is never overwritten, and a
half-written metrics line is refused with what to do."""

import json

import numpy as np
import pytest

from dpfl.fl_app.client_app import app as client_app
from dpfl.fl_app.config import validate
from dpfl.fl_app.results import PreviousRunError, RunDirectory, read_metrics
from dpfl.fl_app.server_app import run_federated
from dpfl_tools.inprocess import InProcessGrid

SMALL = {
    "dataset": "digits",
    "model": "mlp",
    "partitioner": "iid",
    "local-steps": 3,
    "batch-size": 16,
    "num-rounds": 4,
    "sample-rate": 0.75,
    "secure-rng": False,
}  # seeded, so that the two runs can be compared
FAMILIES = {
    "client-level, distributed noise": {"algorithm": "dp-fedavg"},
    "client-level, central noise, fixed sampling": {
        "algorithm": "dp-fedsam",
        "noise-placement": "central",
        "client-sampling": "fixed",
    },
    "calibrated to a target": {"algorithm": "dp-fedavg", "target-epsilon": 6.0, "target-epsilon-mode": "calibrate"},
    "top-k": {"algorithm": "dp-fedsam-topk", "sparsity": 0.3},
    "wavelet": {"algorithm": "dp-fedavg-wav", "noise-placement": "central"},
    "partial sharing, persistent heads": {
        "algorithm": "dp2-fedsam",
        "partitioner": "pathological",
        "fraction-evaluate": 0.0,
    },
    "ali-dpfl, per-client ledgers": {
        "algorithm": "ali-dpfl",
        "target-epsilon": 3.0,
        "sample-rate": 1.0,
        "batch-sample-rate": 0.1,
        "sample-noise-multiplier": 1.5,
        "local-steps": 2,
        "adaptive": False,
    },
}
NODES = 4


class KilledServerApp(BaseException):
    """What the in-process 'kill' raises (BaseException, like KeyboardInterrupt / SystemExit)."""


class CrashingGrid(InProcessGrid):
    """Raises when the train messages of round `crash_round` are about to be sent (nothing delivered)."""

    crash_round = 0

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        train = [m for m in messages if m.metadata.message_type == "train"]
        if train and int(train[0].content["config"]["server-round"]) == self.crash_round:
            raise KilledServerApp(f"ServerApp killed in round {self.crash_round}")
        return super().send_and_receive(messages, timeout=timeout)


def run(cfg, grid):
    return run_federated(grid, cfg)


def records(run_dir):
    return [{k: v for k, v in r.items() if k != "seconds"} for r in read_metrics(run_dir)]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_resumed_run_equals_the_uninterrupted_run(family, tmp_path):
    overrides = {**SMALL, **FAMILIES[family]}
    whole_cfg = validate({**overrides, "results-dir": str(tmp_path / "whole")})
    whole = run(whole_cfg, InProcessGrid(client_app, NODES, whole_cfg))

    cfg = validate({**overrides, "results-dir": str(tmp_path / "killed")})
    grid = CrashingGrid(client_app, NODES, cfg)  # its nodes (and their Context.state) live on, as SuperNodes do
    grid.crash_round = 3
    with pytest.raises(KilledServerApp):
        run(cfg, grid)
    status = json.loads((tmp_path / "killed" / "status.json").read_text())
    assert status["status"] == "failed" and status["completed_rounds"] == 2
    assert len(read_metrics(tmp_path / "killed")) == 2

    grid.crash_round = 0
    resumed = run(validate({**overrides, "results-dir": str(tmp_path / "killed"), "resume": True}), grid)
    assert resumed["resumed_after_round"] == 2 and resumed["rounds_completed"] == whole["rounds_completed"]
    assert resumed["epsilon"] == whole["epsilon"]
    assert records(tmp_path / "killed") == records(tmp_path / "whole")  # every round once, same numbers
    for a, b in zip(
        RunDirectory(tmp_path / "killed", resume=True).checkpoint[1],
        RunDirectory(tmp_path / "whole", resume=True).checkpoint[1],
    ):
        np.testing.assert_array_equal(a, b)
    ledger = resumed["ledger"]
    if "model" in ledger:  # client level: one sampled-Gaussian event per completed round, no more
        assert sum(steps for _, _, steps in ledger["model"]["history"]) == resumed["rounds_completed"]
    else:  # sample level: each client's DP-SGD steps as in the uninterrupted run
        assert ledger == whole["ledger"]


def test_ali_dpfl_client_that_lost_its_state_spends_no_budget_twice(tmp_path):
    """A restart that also loses the clients' Context.state (a fresh simulation): the server sends what it
    has charged, the clients adopt it, and no client ends above its target."""
    overrides = {**SMALL, **FAMILIES["ali-dpfl, per-client ledgers"], "num-rounds": 30, "local-steps": 15}
    cfg = validate({**overrides, "results-dir": str(tmp_path / "run")})
    grid = CrashingGrid(client_app, NODES, cfg)
    grid.crash_round = 3
    with pytest.raises(KilledServerApp):
        run(cfg, grid)
    fresh = InProcessGrid(client_app, NODES, cfg)  # new nodes: every client's own ledger is gone
    summary = run(validate({**overrides, "results-dir": str(tmp_path / "run"), "resume": True}), fresh)
    assert summary["epsilon"] <= 3.0 and max(summary["epsilon_per_client"].values()) <= 3.0
    for context in fresh.contexts.values():  # the clients' own ledgers agree with the server's mirror (by client id)
        record, client = context.state["dpsgd-ledger"], str(context.node_config["partition-id"])
        assert int(record["steps"]) == summary["ledger"]["clients"][client]["history"][0][2]


def test_a_folder_with_a_previous_run_is_refused_before_anything_trains(tmp_path):
    cfg = validate({**SMALL, "num-rounds": 1, "results-dir": str(tmp_path)})
    run(cfg, InProcessGrid(client_app, NODES, cfg))
    grid = InProcessGrid(client_app, NODES, cfg)
    with pytest.raises(PreviousRunError, match="resume = true"):
        run(cfg, grid)
    assert grid.sent == []
    changed = validate(
        {**SMALL, "num-rounds": 2, "noise-multiplier": 2.0, "results-dir": str(tmp_path), "resume": True}
    )
    with pytest.raises(PreviousRunError, match="'noise-multiplier' = 1.0 there, 2.0 now"):
        run(changed, grid)
    assert grid.sent == []
    more = run(validate({**SMALL, "num-rounds": 2, "results-dir": str(tmp_path), "resume": True}), grid)
    assert more["rounds_completed"] == 2 and [r["round"] for r in read_metrics(tmp_path)] == [1, 2]


def test_a_half_written_metrics_line_is_refused_with_what_to_do_and_the_resume_then_continues(tmp_path):
    from flwr.app import ArrayRecord

    from dpfl.fl_app.run_files import RunFileError

    run_dir = RunDirectory(tmp_path)  # a run killed while it wrote round 2's line: round 1 checkpointed
    run_dir.write_checkpoint({"completed_rounds": 1}, ArrayRecord([np.ones(2)]))
    run_dir.close()
    (tmp_path / "metrics.jsonl").write_text('{"round": 1, "epsilon": 0.5}\n{"round": 2, "epsil')
    with pytest.raises(RunFileError) as err:
        RunDirectory(tmp_path, resume=True)
    assert str(err.value) == (
        f"{tmp_path / 'metrics.jsonl'}, line 2: not JSON (Unterminated string starting at: line 1 column 14 "
        "(char 13)); the line is cut short (a run killed while writing it, a full disk) or was not written by this "
        "program: remove line 2 and resume (resume = true writes metrics.jsonl anew from checkpoint.npz), or start "
        "a new run with another results-dir or run-name"
    )
    (tmp_path / "metrics.jsonl").write_text('{"round": 1, "epsilon": 0.5}\n')  # what the refusal says to do
    resumed = RunDirectory(tmp_path, resume=True)
    assert resumed.saved_rounds == 1 and resumed.checkpoint[1][0].tolist() == [1.0, 1.0]
    resumed.close()
