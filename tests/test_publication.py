"""What a run publishes is what the ledger covers (issue 10, item 4).

- Under distributed noise the released sum carries N(0, sigma^2 C^2) whatever the number of participants:
  its variance does not reveal the count (each client adds sigma^2 C^2 / n_s, the server tops up the rest).
- A Poisson sample larger than n_s keeps n_s clients (probability <= 1e-12 per round, reserved out of delta).
- metrics.jsonl, the log lines and the dashboards carry no count, norm, loss or client evaluation; those go to
  diagnostics.jsonl, and to the log and dashboards only with publish-diagnostics.
"""

import json
import logging
import math

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict

from dpfl.dpcore.privacy.mechanisms import flatten
from dpfl.fl_app.client_app import app as client_app
from dpfl.fl_app.config import validate
from dpfl.fl_app.results import read_diagnostics, read_metrics
from dpfl.fl_app.server_app import run_federated
from dpfl.strategies.dp_fedavg import DPFedAvg
from dpfl.strategies.loop.run_record import PUBLISHED_KEYS
from dpfl_tools.inprocess import InProcessGrid
from tests.stub_clients import stub_app, zero_update

C, SIGMA, M, Q = 0.5, 1.3, 10, 0.5


def release_noise(arrived: int, trials: int = 3) -> np.ndarray:
    """The server's release (w_new - w) when `arrived` of the M = 10 clients' noise shares reach it."""
    alive = set(range(100, 100 + arrived))
    grid = InProcessGrid(stub_app(zero_update), M, {}, fail=lambda node, msg: node not in alive)
    strategy = DPFedAvg(sample_rate=Q, clipping_norm=C, noise_multiplier=SIGMA, noise_placement="distributed")
    strategy.setup_population(M)
    arrays = ArrayRecord([np.zeros((100, 1000), np.float32), np.zeros(100, np.float32)])  # stub_app's nn.Linear
    out = []
    for rnd in range(1, trials + 1):
        strategy.begin_round(arrays)
        content = RecordDict({"arrays": arrays, "config": ConfigRecord(strategy.client_train_config(rnd))})
        asked = [
            Message(content=content, dst_node_id=node, message_type=MessageType.TRAIN)  # all nodes
            for node in grid.get_node_ids()
        ]
        new, _ = strategy.aggregate_train(rnd, grid.send_and_receive(asked))  # `fail` decides who answers
        out.append(flatten(new.to_numpy_ndarrays()))
    assert strategy.population.noise_shares == M + 1  # P(Binomial(10, 0.5) >= 11) = 0: n_s = M + 1
    return np.concatenate(out)


def test_the_release_variance_does_not_depend_on_the_number_of_participants():
    """Old shares of sigma^2 C^2 / m let the release's variance count the participants above m = 5
    (sigma^2 C^2 k / m): with 10 of them it was twice that of 5. Now every count gives sigma C / m."""
    expected = SIGMA * C / (Q * M)  # the noise of the average
    stds = {k: release_noise(k).std() for k in (1, 5, 10)}
    size = 3 * 100 * 1000
    for k, std in stds.items():
        assert abs(std / expected - 1) < 5 / math.sqrt(2 * size), (k, std, expected)
    assert abs(stds[10] / stds[5] - 1) < 10 / math.sqrt(2 * size)  # no distinguisher left in the variance


def test_an_oversized_poisson_sample_keeps_n_s_clients():
    strategy = DPFedAvg(sample_rate=0.9, clipping_norm=C, noise_multiplier=1.0, secure_rng=False)
    strategy.setup_population(20)
    assert strategy.population.noise_shares == 21
    grown = list(range(60))  # the pool tripled after the population was fixed: samples of ~54 > n_s
    selection = strategy.selection.select(strategy, 3, grown)  # the selection role at n_s = 21
    assert len(selection.nodes) == 21 and set(selection.nodes) <= set(grown)
    assert selection.truncation_probability > 0.99


def test_a_grown_poisson_pool_re_derives_n_s_before_it_samples():
    """Issue 35 item 2: the wrapper re-derives n_s for the round's population, so the sample is not truncated
    (n_s = 61 for 60 nodes at q = 0.9: P(truncation) = 0) and epsilon stays finite (it was inf)."""
    strategy = DPFedAvg(sample_rate=0.9, clipping_norm=C, noise_multiplier=1.0, secure_rng=False)
    strategy.setup_population(20)
    sampled = strategy.sample_clients(3, list(range(60)))
    assert strategy.population.noise_shares == 61 and 40 < len(sampled) <= 60
    assert strategy.round.truncation_probability == 0.0
    strategy.noisy_average_step(3, [np.zeros(4, np.float32)], np.zeros(4, np.float32), received=1)
    assert strategy.ledger.truncation_delta == 0.0 and math.isfinite(strategy.ledger.epsilon())


SMALL = {
    "dataset": "digits",
    "model": "mlp",
    "partitioner": "iid",
    "local-steps": 2,
    "num-rounds": 2,
    "sample-rate": 1.0,
    "min-nodes": 5,
}
FAMILIES = {
    "distributed": {},
    "central": {"noise-placement": "central"},
    "top-k": {"algorithm": "dp-fedsam-topk", "noise-placement": "central"},
    "dp2-fedsam": {"algorithm": "dp2-fedsam", "partitioner": "pathological"},
    "secagg+": {"secure-aggregation": True},
    "ali-dpfl": {"algorithm": "ali-dpfl", "target-epsilon": 8.0, "adaptive": False, "local-steps": 2},
}
RAW_KEYS = {
    "clients",
    "rejected",
    "failures",
    "failed_nodes",
    "problems",
    "clipped_fraction",
    "update_norm_mean",
    "update_norm_std",
    "train_loss",
    "server_noise_std",
    "personalized_accuracy",
    "personalized_clients",
    "upload_bytes",
    "dense_bytes",
    "upload_bytes_total",
    "dense_bytes_total",
    "seconds",
    "client_accuracy",
    "client_loss",
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_published_outputs_carry_no_raw_statistic(family, tmp_path, caplog):
    """One node fails whenever it is asked (under SecAgg+, whose protocol then halts, none does).
    metrics.jsonl, summary.json and the log name no count, norm, loss or client evaluation; diagnostics.jsonl
    has them, with the failure."""
    cfg = validate({**SMALL, **FAMILIES[family], "results-dir": str(tmp_path / "run")})
    failing = 104 if family != "secagg+" else None
    grid = InProcessGrid(client_app, 5, cfg, fail=lambda node, msg: node == failing)
    with caplog.at_level(logging.DEBUG, logger="flwr"):
        run_federated(grid, cfg)
    published = read_metrics(tmp_path / "run")
    assert published and all(set(r) <= PUBLISHED_KEYS for r in published), published
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert not RAW_KEYS & set(summary) and "epsilon_against_server" not in summary if family == "secagg+" else True
    shown = "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.INFO)
    round_lines = [line for line in shown.splitlines() if line.startswith("Round ")]
    assert len(round_lines) == cfg.run.num_rounds
    assert not [k for k in RAW_KEYS if f"{k}=" in shown]
    assert "node 104" not in shown and "sampled" not in shown
    diagnostics = read_diagnostics(tmp_path / "run")
    assert [d["round"] for d in diagnostics] == [r["round"] for r in published]
    assert all("clients" in d or "personalized_clients" in d for d in diagnostics)
    if failing:
        assert any("node 104" in problem for d in diagnostics for problem in d.get("problems", []))
    summary = json.loads((tmp_path / "run" / "diagnostics-summary.json").read_text())
    assert summary["not_private"].startswith("computed from raw client replies")


def test_publish_diagnostics_shows_them_in_the_log(tmp_path, caplog):
    cfg = validate({**SMALL, "publish-diagnostics": True, "results-dir": str(tmp_path / "run")})
    grid = InProcessGrid(client_app, 5, cfg, fail=lambda node, msg: node == 104)
    with caplog.at_level(logging.INFO, logger="flwr"):
        run_federated(grid, cfg)
    round_lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Round ")]
    assert any("not private: " in line and "clients=" in line for line in round_lines)
    assert any("node 104 failed" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert set(read_metrics(tmp_path / "run")[0]) <= PUBLISHED_KEYS  # the files stay split
