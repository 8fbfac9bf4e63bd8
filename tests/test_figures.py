"""Each figure a run writes is declared once (dpcore/privacy/figures.py), and every output draws from that table:
the round record's split, the round and `Finished:` log lines, the dashboards' tags and guarantee marks, and
docs/running.md's table. One name per figure: `claimed_epsilon` (older runs wrote `epsilon_claimed`)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dpfl.dpcore.privacy import figures
from dpfl.dpcore.privacy.figures import FIGURES, GUARANTEE_SUFFIX
from dpfl.fl_app.dashboards import NOT_A_GUARANTEE, TAGS, scalars
from dpfl.fl_app.server_app import DIAGNOSTIC_SUMMARY_LOG_KEYS, SUMMARY_LOG_KEYS
from dpfl.strategies.loop.log_line import DIAGNOSTIC_LOG_KEYS, LOG_KEYS, format_record, parse_log_line
from dpfl.strategies.loop.run_record import PUBLISHED_KEYS, published_keys

ROOT = Path(__file__).resolve().parents[1]


def test_the_docs_table_is_drawn_from_the_figures():
    doc = (ROOT / figures.FIGURES_DOC).read_text()
    assert figures.figure_table() in doc, "regenerate it: python -m dpfl.dpcore.privacy.figures --write"
    assert all(f"| `{f.name}` |" in doc for f in FIGURES)


def test_one_name_and_one_tag_per_figure():
    """The two-names bug: `claimed_epsilon` and `epsilon_claimed` were two keys with one tag."""
    names = [f.name for f in FIGURES] + [old for f in FIGURES for old in f.former]
    tags = [f.tag for f in FIGURES if f.tag]
    assert len(names) == len(set(names)) and len(tags) == len(set(tags))
    assert figures.with_current_names({"round": 1, "epsilon_claimed": 2.5}) == {"round": 1, "claimed_epsilon": 2.5}


def test_no_former_name_is_spelled_outside_the_table():
    """A former name left in code or docs would write or read a figure under a second name."""
    former = [old for f in FIGURES for old in f.former]
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    allowed = {"dpcore/privacy/figures.py", "tests/test_figures.py"}
    hits = [
        f"{name}: {old}"
        for name in files
        if name.endswith((".py", ".md", ".toml")) and name not in allowed and (ROOT / name).is_file()
        for old in former
        if re.search(rf"\b{old}\b", (ROOT / name).read_text(errors="replace"))
    ]
    assert former == ["epsilon_claimed"] and hits == []


@pytest.mark.parametrize("figure", FIGURES, ids=lambda f: f.name)
def test_every_output_follows_the_figures_row(figure):
    """What the round loop publishes, the log lines print and the dashboards tag is what the row says."""
    name, value = figure.name, 0.5
    assert (name in PUBLISHED_KEYS) == (figure.published and figure.per_round)
    assert (f"{name}=0.5" in format_record({name: value})) == (figure.published and figure.round_line)
    assert (f"{name}=0.5" in format_record({name: value}, DIAGNOSTIC_LOG_KEYS)) == (
        not figure.published and figure.round_line
    )
    assert (name in SUMMARY_LOG_KEYS) == (figure.published and figure.finish_line)
    assert (name in DIAGNOSTIC_SUMMARY_LOG_KEYS) == (not figure.published and figure.finish_line)
    shown = scalars({"round": 3, name: value})
    assert shown == ({figure.tag: value} if figure.tag else {})
    assert scalars({"round": 3, name: {"7": value}}) == ({f"{figure.tag}/7": value} if figure.tag else {})
    if figure.caveat:  # its mark says so on the line and in the tag
        marked = {"round": 3, name: value, figure.mark: False}
        assert f"{figure.mark}=False" in format_record(marked)
        assert scalars(marked) == {figure.tag + NOT_A_GUARANTEE: value}
        assert figure.mark == name + GUARANTEE_SUFFIX and figure.mark in PUBLISHED_KEYS


def test_the_log_line_keeps_its_order_and_reads_back():
    """The line's keys in the order of the table (what the runs printed before it existed), read back."""
    assert LOG_KEYS == (
        "accuracy",
        "loss",
        "epsilon",
        "delta",
        "epsilon_against_server",
        "claimed_epsilon",
        "epsilon_min",
        "tau",
        "tau_next",
        "epsilon_is_guarantee",
        "epsilon_against_server_is_guarantee",
        "claimed_epsilon_is_guarantee",
    )
    assert SUMMARY_LOG_KEYS == (
        "rounds_completed",
        "final_accuracy",
        "final_loss",
        "epsilon",
        "delta",
        "epsilon_against_server",
        "claimed_epsilon",
    )
    record = {"round": 4, "epsilon": 1.25, "claimed_epsilon": 0.5, "claimed_epsilon_is_guarantee": False}
    line = f"Round 4/9: {format_record(record)}"
    assert line == "Round 4/9: epsilon=1.25  claimed_epsilon=0.5  claimed_epsilon_is_guarantee=False"
    assert parse_log_line(line) == (record, {})


def test_an_adaptive_clipping_run_publishes_only_figures_of_the_table():
    from dpfl.strategies import DPFedAvg
    from dpfl.strategies.parts.adaptive_clipping import AdaptiveClipping

    strategy = DPFedAvg(
        noise_multiplier=0.1,
        clipping_norm=0.1,
        sample_rate=1.0,
        min_available_nodes=2,
        adaptive_clipping=AdaptiveClipping(0.5, 0.2, count_noise_multiplier=0.1),
    )
    assert {"clipping_norm", "clipping_norm_next", "unclipped_fraction_noisy"} <= published_keys(strategy)
    assert published_keys(strategy) <= figures.published_names()


TOY = """
import json
from dpfl.dpcore.privacy import figures

toy = figures.Figure("toy_figure", "a toy", tag="toy/figure", round_line=True, finish_line=True, caveat="a toy's")
figures.FIGURES = (*figures.FIGURES, toy, figures.guarantee_mark(toy))
from dpfl.fl_app.dashboards import scalars
from dpfl.fl_app.server_app import SUMMARY_LOG_KEYS
from dpfl.strategies.loop.run_record import PUBLISHED_KEYS
from dpfl.strategies.loop.log_line import LOG_KEYS, format_record

record = {"round": 2, "toy_figure": 0.25, "toy_figure_is_guarantee": False}
print(json.dumps({
    "published": sorted(PUBLISHED_KEYS & set(record)),
    "line": format_record(record),
    "finished": format_record(record, SUMMARY_LOG_KEYS),
    "scalars": scalars(record),
    "docs": "| `toy_figure` | metrics.jsonl, summary.json | Round, Finished | `toy/figure` | a toy |"
    in figures.figure_table(),
}))
"""


@pytest.mark.slow  # 2-9 s together: the fast tier keeps its 5-minute margin on 2 cores
def test_a_figure_added_to_the_table_reaches_every_output():
    """One row, and nothing else: the record's split, both log lines, the dashboards, its mark and the docs."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FLWR_TELEMETRY_ENABLED": "0"}
    out = subprocess.run([sys.executable, "-c", TOY], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == {
        "published": ["round", "toy_figure", "toy_figure_is_guarantee"],
        "line": "toy_figure=0.25  toy_figure_is_guarantee=False",
        "finished": "toy_figure=0.25",
        "scalars": {"toy/figure_NOT_a_guarantee": 0.25},
        "docs": True,
    }
    assert "toy_figure" not in TAGS  # this process's table is the real one
