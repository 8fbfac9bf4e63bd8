"""End to end on the embedded MNIST data through the real ServerApp/ClientApp code (in process)."""

import json
import math

import pytest
import torch

from dpfl.dpcore.privacy.accountants import epsilon_of
from dpfl.fl_app.client_app import app as client_app
from dpfl.fl_app.config import validate
from dpfl.fl_app.results import read_diagnostics, read_metrics
from dpfl.fl_app.server_app import run_federated
from dpfl_tools.inprocess import InProcessGrid

NUM_CLIENTS = 50


def run(tmp_path, name, **overrides):
    torch.set_num_threads(1)
    cfg = validate({"results-dir": str(tmp_path / name), **overrides})
    summary = run_federated(InProcessGrid(client_app, NUM_CLIENTS, cfg), cfg)
    return cfg, summary, tmp_path / name


@pytest.fixture(scope="module")
def default_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("e2e")
    return run(tmp, "dp"), run(tmp, "reference", **{"noise-multiplier": 0.0, "clipping-norm": 0.0})


@pytest.mark.slow
def test_dp_fedsam_learns_with_growing_epsilon(default_runs):
    (cfg, summary, run_dir), _ = default_runs
    assert summary["strategy"] == "dp-fedsam" and summary["rounds_completed"] == cfg.run.num_rounds
    assert summary["final_accuracy"] > 0.5, summary["final_accuracy"]  # chance is 0.1
    rows = read_metrics(run_dir)
    eps = [r["epsilon"] for r in rows]
    assert all(b > a for a, b in zip(eps, eps[1:]))
    q, rounds, delta = cfg.federation.sample_rate, cfg.run.num_rounds, 1e-5  # min(1e-5, 0.01 / M)
    assert summary["epsilon"] == pytest.approx(epsilon_of([(cfg.privacy.noise_multiplier, q, rounds)], delta), rel=1e-6)
    assert summary["delta"] == pytest.approx(delta)
    assert math.isfinite(summary["epsilon_against_server"]) and summary["epsilon_against_server"] > summary["epsilon"]


@pytest.mark.slow
def test_non_private_reference_scores_higher(default_runs):
    (_, dp, _), (_, ref, ref_dir) = default_runs
    assert ref["final_accuracy"] > dp["final_accuracy"]
    assert ref["epsilon"] is None or math.isinf(ref["epsilon"])
    assert json.loads((ref_dir / "summary.json").read_text())["epsilon"] is None  # strict JSON: inf -> null


@pytest.mark.slow
def test_run_directory_contents(default_runs):
    (cfg, summary, run_dir), _ = default_runs
    assert json.loads((run_dir / "config.json").read_text()) == cfg.run_config()
    rows, diagnostics = read_metrics(run_dir), read_diagnostics(run_dir)
    assert [r["round"] for r in rows] == [r["round"] for r in diagnostics] == list(range(1, cfg.run.num_rounds + 1))
    for key in ("round", "accuracy", "loss", "epsilon", "delta", "epsilon_against_server"):
        assert all(key in r for r in rows), key
    for key in (
        "clipped_fraction",
        "update_norm_mean",
        "update_norm_std",
        "clients",
        "rejected",
        "failures",
        "train_loss",
        "seconds",
    ):  # raw statistics of client replies: not covered by epsilon
        assert all(key in r for r in diagnostics) and not any(key in r for r in rows), key
    assert all(0 <= r["clipped_fraction"] <= 1 and r["update_norm_mean"] > 0 for r in diagnostics)
    on_disk = json.loads((run_dir / "summary.json").read_text())
    for key in (
        "strategy",
        "dataset",
        "rounds_completed",
        "final_accuracy",
        "epsilon",
        "delta",
        "noise_multiplier",
        "client_sampling_rate",
        "num_clients",
        "accountant",
    ):
        assert key in on_disk, key
    assert on_disk["num_clients"] == NUM_CLIENTS and on_disk["client_sampling_rate"] == cfg.federation.sample_rate
    assert (run_dir / "plot.png").stat().st_size > 10_000
    assert "not_private" in json.loads((run_dir / "diagnostics-summary.json").read_text())


def test_short_run_is_reproducible(tmp_path):
    overrides = {"num-rounds": 2, "dataset": "digits", "model": "mlp", "local-epochs": 1, "secure-rng": False}
    _, a, dir_a = run(tmp_path, "a", **overrides)
    _, b, dir_b = run(tmp_path, "b", **overrides)
    strip = lambda rows: [{k: v for k, v in r.items() if k != "seconds"} for r in rows]  # noqa: E731
    assert read_metrics(dir_a) == read_metrics(dir_b)
    assert strip(read_diagnostics(dir_a)) == strip(read_diagnostics(dir_b))
    assert a["final_accuracy"] == b["final_accuracy"]


def test_bad_config_fails_before_training(tmp_path):
    """The ServerApp refuses a bad config before it writes or trains anything."""
    from flwr.app import Context, RecordDict

    from dpfl.fl_app.config import ConfigError
    from dpfl.fl_app.server_app import main

    bad = {"noise-multiplier": -1.0, "results-dir": str(tmp_path / "run")}
    grid = InProcessGrid(client_app, 3, bad)
    with pytest.raises(ConfigError, match="'noise-multiplier' = -1.0"):
        main(grid, Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config=bad))
    assert not (tmp_path / "run").exists() and grid.sent == []


def test_eval_every_and_the_validation_split(tmp_path):
    """eval-every = 2 over 5 rounds: rounds 2, 4 and the last carry the server's test and validation figures."""
    _, summary, run_dir = run(
        tmp_path,
        "v",
        **{
            "num-rounds": 5,
            "eval-every": 2,
            "validation-fraction": 0.1,
            "dataset": "digits",
            "model": "mlp",
            "local-steps": 2,
        },
    )
    rows = read_metrics(run_dir)
    assert (
        [r["round"] for r in rows if "accuracy" in r] == [r["round"] for r in rows if "val_accuracy" in r] == [2, 4, 5]
    )
    assert summary["final_accuracy"] == rows[-1]["accuracy"] and 0 <= rows[-1]["val_accuracy"] <= 1
