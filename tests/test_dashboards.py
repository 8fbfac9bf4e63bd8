"""TensorBoard events of a real run, read back with tensorboard's EventAccumulator, against metrics.jsonl
(and diagnostics.jsonl, which appear under nonprivate/ only when a run publishes them)."""

import math

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from fl_app.client_app import app as client_app
from fl_app.config import validate
from fl_app.dashboards import NONPRIVATE_PREFIX, TAGS, scalars, write_tensorboard
from fl_app.inprocess import InProcessGrid
from fl_app.results import read_diagnostics, read_metrics
from fl_app.server_app import run_federated

SMALL = {"dataset": "digits", "model": "mlp", "partitioner": "iid", "local-steps": 2, "num-rounds": 3,
         "sample-rate": 1.0}


def events(run_dir) -> EventAccumulator:
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def check_against_metrics(run_dir, expected_tags):
    acc = events(run_dir)
    rows = read_metrics(run_dir)
    assert set(expected_tags) <= set(acc.Tags()["scalars"])
    for tag in expected_tags:
        if tag.startswith(NONPRIVATE_PREFIX):
            key, rows = tag[len(NONPRIVATE_PREFIX):], read_diagnostics(run_dir)
        else:
            key, rows = next(k for k, t in TAGS.items() if t == tag), read_metrics(run_dir)
        logged = {e.step: e.value for e in acc.Scalars(tag)}
        written = {r["round"]: r[key] for r in rows if r.get(key) is not None}
        assert logged.keys() == written.keys()
        for step, value in written.items():
            assert logged[step] == pytest.approx(value, rel=1e-6)
    return acc


def test_a_run_writes_tensorboard_scalars_equal_to_its_metrics_and_no_diagnostics(tmp_path):
    cfg = validate({**SMALL, "results-dir": str(tmp_path / "run")})
    run_federated(InProcessGrid(client_app, 4, cfg), cfg)
    acc = check_against_metrics(tmp_path / "run", ["eval/accuracy", "eval/loss", "privacy/epsilon",
                                                   "privacy/epsilon_against_server"])
    assert not [t for t in acc.Tags()["scalars"] if t.startswith(NONPRIVATE_PREFIX)]  # published: ledger only
    assert read_diagnostics(tmp_path / "run")[0]["clients"] == 4  # the diagnostics stay in their own file


def test_published_diagnostics_appear_under_nonprivate_with_a_note(tmp_path):
    cfg = validate({**SMALL, "publish-diagnostics": True, "results-dir": str(tmp_path / "run")})
    run_federated(InProcessGrid(client_app, 4, cfg), cfg)
    acc = check_against_metrics(tmp_path / "run", ["privacy/epsilon", "nonprivate/clipped_fraction",
                                                   "nonprivate/update_norm_mean", "nonprivate/clients"])
    assert any("diagnostics" in t for t in acc.Tags()["tensors"])  # the note that nonprivate/ is not private


def test_ali_dpfl_per_client_epsilon_and_tau(tmp_path):
    cfg = validate({**SMALL, "algorithm": "ali-dpfl", "target-epsilon": 4.0, "batch-sample-rate": 0.2,
                    "adaptive": False, "results-dir": str(tmp_path / "ali")})
    run_federated(InProcessGrid(client_app, 3, cfg), cfg)
    acc = check_against_metrics(tmp_path / "ali", ["ali_dpfl/tau", "privacy/epsilon"])
    rows = read_metrics(tmp_path / "ali")
    for client, eps in rows[-1]["epsilon_per_client"].items():
        assert acc.Scalars(f"privacy/epsilon_client/{client}")[-1].value == pytest.approx(eps, rel=1e-6)


def test_older_run_folders_are_converted(tmp_path):
    cfg = validate({**SMALL, "tensorboard": False, "results-dir": str(tmp_path / "old")})
    run_federated(InProcessGrid(client_app, 4, cfg), cfg)
    assert not list((tmp_path / "old").glob("events.out.tfevents.*"))
    write_tensorboard(tmp_path / "old")
    check_against_metrics(tmp_path / "old", ["eval/accuracy", "privacy/epsilon"])


def test_non_finite_values_are_not_logged():
    assert scalars({"round": 1, "epsilon": math.inf, "accuracy": 0.5, "failed_nodes": ["x"]}) == {"eval/accuracy": 0.5}
