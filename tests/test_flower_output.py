"""Flower's own output under the DP wrapper (issue 34 item 4): `DifferentialPrivacy(FedAvg(...), sigma, C, m).start`
prints the lines plain `FedAvg(...).start` prints, in the same order and format, plus the project's `Round r/R:`
epsilon line; the metric records in them hold only what the ledger covers unless publish_diagnostics, a note says
once what was left out, and the returned Result keeps everything (the clients' train_loss as they sent it)."""

import ast
import logging
import re

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg

from dpfl import DifferentialPrivacy
from dpfl.strategies.loop.log_line import parse_log_line
from dpfl.strategies.loop.run_record import published_keys
from dpfl_tools.inprocess import InProcessGrid
from tests.test_wrapper import model

NODES, M, ROUNDS, SIGMA, C = 4, 3, 3, 1.0, 1.0
AGGREGATED = "\t└──> Aggregated MetricRecord: "


def examples(node: int) -> int:
    return 10 * (node + 1)


def train_loss(node: int, server_round: int) -> float:
    return node + 1.0 / server_round


def eval_acc(node: int) -> float:
    return 0.125 * node


def flower_client() -> ClientApp:
    """A quickstart-style client: new weights, `train_loss` and `eval_acc` that depend on the node (and round)."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        node, rnd = context.node_id - 100, int(msg.content["config"]["server-round"])
        new = {k: Array(msg.content["arrays"][k].numpy()) for k in msg.content["arrays"].keys()}
        metrics = MetricRecord({"num-examples": examples(node), "train_loss": train_loss(node, rnd)})
        return Message(RecordDict({"arrays": ArrayRecord(new), "metrics": metrics}), reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        node = context.node_id - 100
        metrics = MetricRecord({"num-examples": examples(node), "eval_acc": eval_acc(node)})
        return Message(RecordDict({"metrics": metrics}), reply_to=msg)

    return app


def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
    return MetricRecord({"accuracy": 0.5 + server_round / 10})


def run(strategy, caplog) -> tuple:
    """(result, the flwr logger's messages, the grid) of `strategy.start` on NODES nodes with both evaluations."""
    grid = InProcessGrid(flower_client(), NODES, {})
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="flwr"):
        result = strategy.start(grid, model(), num_rounds=ROUNDS, evaluate_fn=evaluate_fn)
    return result, [r.getMessage() for r in caplog.records if r.name.startswith("flwr")], grid


def wrapped(**kw) -> DifferentialPrivacy:
    return DifferentialPrivacy(FedAvg(), SIGMA, C, M, seed=1, secure_rng=False, **kw)  # noise from the seed


def flower_kinds(lines: list[str]) -> list[str]:
    """The lines of Flower's Strategy.start, by kind (numbers left out), in order; others dropped."""
    kinds = []
    for line in lines:
        if line.startswith("Starting ") and line.endswith(" strategy:"):
            kinds.append("starting")
        elif line.startswith("\t├── Number of rounds:"):
            kinds.append(line)
        elif line.startswith("Initial global evaluation results:"):
            kinds.append("initial evaluation")
        elif line.startswith("[ROUND "):
            kinds.append(line)
        elif line.startswith(AGGREGATED):
            kinds.append("aggregated")
        elif line in ("Global evaluation", "Final results:"):
            kinds.append(line)
        elif line.startswith("\t└──> MetricRecord: "):
            kinds.append("global record")
        elif line.startswith("Strategy execution finished in "):
            kinds.append("finished")
        elif line.strip().endswith("Metrics:") or line.strip() == "Global Arrays:":
            kinds.append(line)
    return kinds


def record_on(line: str) -> dict:
    """The record a `...MetricRecord: {...}` line prints (inf as Python writes it)."""
    return ast.literal_eval(re.sub(r"\binf\b", "1e999", line.split(": ", 1)[1]))


def weighted_train_loss(grid: InProcessGrid, server_round: int) -> float:
    """The clients' train_loss averaged by num-examples over the nodes sent the round's train message."""
    nodes = sorted(
        m.metadata.dst_node_id - 100
        for m in grid.sent
        if m.metadata.message_type == "train" and int(m.content["config"]["server-round"]) == server_round
    )
    assert len(nodes) == M
    return sum(examples(n) * train_loss(n, server_round) for n in nodes) / sum(examples(n) for n in nodes)


def test_the_wrapper_prints_flowers_lines_in_flowers_order_with_the_ledgers_epsilon(caplog):
    _, plain, _ = run(FedAvg(), caplog)
    strategy = wrapped()
    result, ours, grid = run(strategy, caplog)
    expected = ["starting", "\t├── Number of rounds: 3", "initial evaluation"]
    for r in range(1, ROUNDS + 1):
        expected += [f"[ROUND {r}/{ROUNDS}]", "aggregated", "aggregated", "Global evaluation", "global record"]
    expected += ["finished", "Final results:", "\tGlobal Arrays:"]
    expected += [f"\tAggregated ClientApp-side {k} Metrics:" for k in ("Train", "Evaluate")]
    expected += ["\tServerApp-side Evaluate Metrics:"]
    assert flower_kinds(plain) == expected
    assert flower_kinds(ours) == expected

    # the project's epsilon line, once a round after Flower's, with the ledger's numbers
    round_lines = [parse_log_line(line)[0] for line in ours if line.startswith("Round ")]
    assert [r["round"] for r in round_lines] == list(range(1, ROUNDS + 1))
    assert [r["epsilon"] for r in round_lines] == [float(f"{h['epsilon']:.4g}") for h in strategy.record.history]
    assert round_lines[-1]["epsilon"] == float(f"{strategy.privacy_metrics()['epsilon']:.4g}")
    assert strategy.record.history[0]["epsilon"] < strategy.record.history[-1]["epsilon"]

    # the train aggregate holds the ledger's figures in full precision, and nothing it does not cover
    train_lines = [record_on(line) for line in ours if line.startswith(AGGREGATED)][::2]
    assert [t["epsilon"] for t in train_lines] == [h["epsilon"] for h in strategy.record.history]
    assert set(train_lines[0]) <= published_keys(strategy) and {"epsilon", "delta"} <= set(train_lines[0])
    evaluate_lines = [record_on(line) for line in ours if line.startswith(AGGREGATED)][1::2]
    assert evaluate_lines == [{}] * ROUNDS  # the clients' evaluation: a diagnostic
    global_lines = [record_on(line) for line in ours if line.startswith("\t└──> MetricRecord: ")]
    assert global_lines == [{"accuracy": 0.5 + r / 10} for r in range(1, ROUNDS + 1)]  # server evaluation: shown

    # the Result keeps everything: the clients' train_loss as Flower's FedAvg averages it, their evaluation
    for r in range(1, ROUNDS + 1):
        assert result.train_metrics_clientapp[r]["train_loss"] == pytest.approx(weighted_train_loss(grid, r), rel=1e-12)
        assert "update_norm_mean" in result.train_metrics_clientapp[r]
        expected_acc = sum(examples(n) * eval_acc(n) for n in range(NODES)) / sum(map(examples, range(NODES)))
        assert result.evaluate_metrics_clientapp[r]["eval_acc"] == pytest.approx(expected_acc, rel=1e-12)


def test_what_epsilon_does_not_cover_is_withheld_and_named_once_and_printed_on_request(caplog):
    result, lines, _ = run(wrapped(), caplog)
    text = "\n".join(lines)
    for key in ("train_loss", "update_norm_mean", "clipped_fraction", "eval_acc"):
        assert f"'{key}'" not in text  # neither on the per-round records nor in the Final results
    assert not re.search(r"Sampled \d+ nodes|Received \d+ results", text)  # no node counts
    notes = [line for line in lines if line.startswith("Left out of Flower's lines in the log, as epsilon does not")]
    assert len(notes) == 1
    assert "train metrics train_loss, clients, rejected, failures" in notes[0]
    assert "clients' evaluation metrics eval_acc" in notes[0] and "node-count lines" in notes[0]
    assert "publish_diagnostics=True" in notes[0] and "publish-diagnostics = true" in notes[0]
    assert lines.index(notes[0]) > lines.index("Final results:")

    diagnostics = wrapped(publish_diagnostics=True)
    shown, lines, grid = run(diagnostics, caplog)
    text = "\n".join(lines)
    assert not [line for line in lines if line.startswith("Left out of Flower's lines")]
    records = [record_on(line) for line in lines if line.startswith(AGGREGATED)]
    for r in range(1, ROUNDS + 1):
        train, evaluation = records[2 * r - 2], records[2 * r - 1]
        assert train == dict(shown.train_metrics_clientapp[r])  # everything, as Flower prints it
        assert train["train_loss"] == pytest.approx(weighted_train_loss(grid, r), rel=1e-12)
        assert evaluation == dict(shown.evaluate_metrics_clientapp[r])
    assert "'update_norm_mean'" in text and "'train_loss': '" in text  # the Final results too

    # withholding changes the log only: the Result is the same with and without it (same seed, same noise)
    for r in range(1, ROUNDS + 1):
        assert dict(result.train_metrics_clientapp[r]) == dict(shown.train_metrics_clientapp[r])
    np.testing.assert_array_equal(result.arrays["fc.weight"].numpy(), shown.arrays["fc.weight"].numpy())


def test_evaluation_lines_follow_eval_every_and_the_budget_stop_ends_with_flowers_closing_lines(caplog):
    """sigma 3, m = 3 of 4: epsilon 2.75, 4.09, 5.17, 6.13, 7.00 after rounds 1-5; a budget of 6.5 stops before
    round 5. eval_every = 3: evaluated after round 3 and after round 4 (the last the budget allows)."""
    strategy = DifferentialPrivacy(FedAvg(), 3.0, C, M, seed=1, target_epsilon=6.5)
    grid = InProcessGrid(flower_client(), NODES, {})
    with caplog.at_level(logging.INFO, logger="flwr"):
        strategy.start(grid, model(), num_rounds=6, evaluate_fn=evaluate_fn, eval_every=3)
    lines = [r.getMessage() for r in caplog.records]
    assert len(strategy.record.history) == 4
    headers = [line for line in lines if line.startswith("[ROUND ")]
    assert headers == [f"[ROUND {r}/6]" for r in range(1, 6)]  # the refused round's header, then the stop
    stop = next(i for i, line in enumerate(lines) if line.startswith("Stopping before round 5"))
    assert lines.index(headers[-1]) < stop < lines.index("Final results:")
    evaluated = [record_on(line)["accuracy"] for line in lines if line.startswith("\t└──> MetricRecord: ")]
    assert evaluated == [0.8, 0.9]  # rounds 3 and 4
    assert len([line for line in lines if line.startswith(AGGREGATED)]) == 4 + 2  # train x4, clients' evaluation x2


def test_the_withheld_note_names_at_most_twenty_keys_a_kind_and_counts_the_rest():
    """A client may send any number of metric keys: the note stays one readable line."""
    from dpfl.strategies.loop.flower_log import withheld_note

    note = withheld_note({"train": dict.fromkeys(f"k{i}" for i in range(50)), "clients' evaluation": {}}, False)
    assert "k19, and" not in note and "k19 and 30 more" in note and "k20" not in note
    assert withheld_note({"train": {"a": None}}, True) == ""


def test_epsilon_against_server_under_central_noise_is_printed_as_docs_privacy_says(caplog):
    """Issue 39 item 11: the log printed `inf` where docs/privacy.md said null; the docs now say what each output
    writes (inf in the log and metric records, null in the JSON files)."""
    from pathlib import Path

    strategy = DifferentialPrivacy(
        FedAvg(fraction_evaluate=0.0),
        clipping_norm=C,
        noise_multiplier=SIGMA,
        sample_rate=1.0,
        min_available_nodes=NODES,
        noise_placement="central",
    )
    with caplog.at_level(logging.INFO, logger="flwr"):
        result = strategy.start(InProcessGrid(flower_client(), NODES, {}), model(), num_rounds=1)
    assert "epsilon_against_server=inf" in caplog.text
    assert result.train_metrics_clientapp[1]["epsilon_against_server"] == float("inf")
    docs = " ".join((Path(__file__).parents[1] / "docs" / "privacy.md").read_text().split())
    assert "`epsilon_against_server` = inf in the log and the metric records, null in the JSON files" in docs
