"""The ServerApp log (`flwr log`): one parseable line per round, printed once, and a final `Finished:` line.

Each run is a plain Python process (what a user runs, and where the bug showed): Opacus' import used to give
the root logger a handler, so every Flower line was printed twice (dpcore/task/opacus_import.py).
"""

import json
import math
import subprocess
import sys

import pytest

from dpfl.strategies.loop.log_line import format_record, parse_log_line
from dpfl_tools.import_graph import ROOT

RUN = """
import json, logging, sys
from dpfl.fl_app.client_app import app as client_app
from dpfl.fl_app.config import validate
from dpfl_tools.inprocess import InProcessGrid
from dpfl.fl_app.server_app import run_federated
cfg = validate(json.loads(sys.argv[1]))
run_federated(InProcessGrid(client_app, 4, cfg), cfg)
print("root handlers:", len(logging.getLogger().handlers))
"""
SMALL = {
    "dataset": "digits",
    "model": "mlp",
    "partitioner": "iid",
    "local-steps": 2,
    "num-rounds": 2,
    "sample-rate": 1.0,
    "tensorboard": False,
}
CASES = {  # each imports Opacus: the RDP accountant on the server; ALI-DPFL's model and DP-SGD clients
    "rdp accountant": {"accountant": "rdp"},
    "ali-dpfl": {"algorithm": "ali-dpfl", "target-epsilon": 4.0, "adaptive": False, "batch-sample-rate": 0.2},
}


def run_in_a_fresh_process(cfg: dict) -> str:
    done = subprocess.run(
        [sys.executable, "-c", RUN, json.dumps(cfg)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout + done.stderr


def close(logged: float, value: float) -> bool:
    return logged == pytest.approx(float(f"{value:.4g}"), rel=1e-9) if math.isfinite(value) else logged == value


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_each_round_line_appears_once_and_reads_back_as_metrics(case, tmp_path):
    cfg = {**SMALL, **CASES[case], "results-dir": str(tmp_path / "run")}
    output = run_in_a_fresh_process(cfg)
    lines = output.splitlines()
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in metrics] == [1, 2]
    for record in metrics:
        found = [line for line in lines if f"Round {record['round']}/2:" in line]
        assert len(found) == 1, found  # once: no second copy through a root handler
        published, diagnostics = parse_log_line(found[0])
        assert diagnostics == {}  # counts only with publish-diagnostics
        assert published["round"] == record["round"]
        assert {"accuracy", "loss", "epsilon", "delta"} <= set(published)
        for key, value in published.items():
            assert close(value, record[key]), (key, value, record[key])
    finished = [line for line in lines if "Finished: " in line]
    assert len(finished) == 1, finished
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    published, _ = parse_log_line(finished[0])
    assert published["rounds_completed"] == 2
    for key in ("final_accuracy", "epsilon", "delta"):
        assert close(published[key], summary[key]), key
    assert "root handlers: 0" in lines
    assert not [line for line in lines if ":DEBUG:" in line or "Warning:" in line], output[-3000:]


def test_the_line_format_reads_back():
    record = {
        "round": 3,
        "accuracy": 0.91234,
        "loss": 0.3,
        "epsilon": math.inf,
        "delta": 1e-5,
        "tau": 4,
        "epsilon_against_server": None,
    }
    line = (
        f"INFO :      Round 3/30: {format_record(record)}  | not private: {format_record({'clients': 7}, ('clients',))}"
    )
    assert "epsilon_against_server" not in line  # None is left out
    published, diagnostics = parse_log_line(line)
    assert published == {"round": 3, "accuracy": 0.9123, "loss": 0.3, "epsilon": math.inf, "delta": 1e-5, "tau": 4}
    assert diagnostics == {"clients": 7}
    assert parse_log_line("INFO :      Round 2: client 5 reports epsilon 3") is None


OPACUS_ROOT_HANDLERS = """
import logging, sys
if sys.argv[1] == "guarded":
    from dpfl.dpcore.task.opacus_import import import_opacus
    import_opacus()
import opacus
print(len(logging.getLogger().handlers))
"""


def root_handlers_after_importing_opacus(how: str) -> int:
    done = subprocess.run(
        [sys.executable, "-c", OPACUS_ROOT_HANDLERS, how],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return int(done.stdout.split()[-1])


@pytest.mark.slow
def test_opacus_is_imported_without_a_root_log_handler():
    if root_handlers_after_importing_opacus("plain") == 0:
        pytest.skip("this Opacus no longer calls logging.basicConfig() on import: nothing to guard against")
    assert root_handlers_after_importing_opacus("guarded") == 0


def test_the_readme_round_line_is_in_the_current_format():
    """README's example line (a round of the default job, `python -m dpfl_tools.launch`; issue 55: it had gone
    stale) reads back and is printed again in the same characters: the keys in LOG_KEYS order, 4 significant digits,
    and the default job's number of rounds."""
    from dpfl.fl_app.config import SPEC

    (line,) = [line for line in (ROOT / "README.md").read_text().splitlines() if "Round 3/" in line]
    published, diagnostics = parse_log_line(line)
    number = published.pop("round")
    assert diagnostics == {} and {"accuracy", "loss", "epsilon", "delta", "epsilon_against_server"} <= set(published)
    assert line == f"INFO :      Round {number}/{SPEC['num-rounds'].default}: {format_record(published)}"
