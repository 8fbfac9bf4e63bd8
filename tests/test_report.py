"""The HTML report of run folders (dpfl_tools/report.py): what it draws, counted in the HTML and in a real headless
browser, and that it shows the non-private diagnostics only when asked or published.

The browser test needs Debian's chromium (`apt-get install -y chromium`) and the playwright package (in the test
extra); it never downloads a browser of its own.
"""

import json
import re
from pathlib import Path

import pytest

from dpfl.fl_app.client_app import app as client_app
from dpfl.fl_app.config import validate
from dpfl.fl_app.results import read_metrics
from dpfl.fl_app.server_app import run_federated
from dpfl_tools.inprocess import InProcessGrid
from dpfl_tools.report import NOT_PRIVATE, main, write_report

ROOT = Path(__file__).resolve().parents[1]

SMALL = {
    "dataset": "digits",
    "model": "mlp",
    "partitioner": "iid",
    "local-steps": 2,
    "num-rounds": 3,
    "sample-rate": 1.0,
    "tensorboard": False,
}
RUNS = {  # name: (overrides, clients)
    "sigma-0.7": ({"noise-multiplier": 0.7}, 4),
    "sigma-1.5": ({"noise-multiplier": 1.5}, 4),
    "reference": ({"noise-multiplier": 0.0, "clipping-norm": 0.0}, 4),
    "topk": ({"algorithm": "dp-fedsam-topk", "noise-placement": "central", "publish-diagnostics": True}, 4),
    "wavelet": ({"algorithm": "dp-fedavg-wav", "wavelet-calibration": "paper", "noise-placement": "central"}, 4),
    "ali": ({"algorithm": "ali-dpfl", "target-epsilon": 4.0, "adaptive": False, "batch-sample-rate": 0.2}, 5),
}
CHROMIUM = "/usr/bin/chromium"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("runs")
    out = {}
    for name, (overrides, clients) in RUNS.items():
        cfg = validate({**SMALL, **overrides, "results-dir": str(base / name)})
        run_federated(InProcessGrid(client_app, clients, cfg), cfg)
        out[name] = base / name
    return out


def private_runs(runs) -> list[str]:
    return [
        name for name, path in runs.items() if json.loads((path / "summary.json").read_text())["epsilon"] is not None
    ]


def heatmap_cells(ali_run: Path) -> int:
    rows = read_metrics(ali_run)
    clients = {c for r in rows for c in r["epsilon_per_client"]}
    return len(rows) * len(clients)


@pytest.mark.slow
def test_the_report_draws_one_frontier_point_per_dp_run_and_the_heatmap(runs, tmp_path):
    report = write_report(list(runs.values()), tmp_path / "report.html")
    text = report.read_text()
    assert len(private_runs(runs)) == 5  # all but the reference
    assert text.count('class="frontier-point"') == 5
    assert text.count('class="reference"') == 1  # the non-private reference: a horizontal line
    assert heatmap_cells(runs["ali"]) == 3 * 5
    assert text.count('<rect class="cell"') == 15
    assert "Top-k: bytes per client upload" in text and "true vs claimed epsilon" in text
    assert "tau per round" in text and "resolved config" in text
    assert not re.search(r"(src|href)=|https?:|<script|<link", text)  # nothing to fetch, no script


@pytest.mark.slow
def test_diagnostics_only_for_a_run_that_published_them_or_when_asked(runs, tmp_path):
    dirs = [runs["sigma-0.7"], runs["topk"]]  # topk published its diagnostics, sigma-0.7 did not
    default = write_report(dirs, tmp_path / "default.html").read_text()
    assert default.count(f"Diagnostics — {NOT_PRIVATE}") == 1
    assert write_report([runs["sigma-0.7"]], tmp_path / "private.html").read_text().count("Clipped fraction") == 0
    asked = write_report(dirs, tmp_path / "asked.html", diagnostics=True).read_text()
    assert asked.count(f"Diagnostics — {NOT_PRIVATE}") == 2 and "Update norms before clipping" in asked


def test_the_command_refuses_a_folder_without_a_finished_run(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main([str(tmp_path), "-o", str(tmp_path / "r.html")])
    assert "no summary.json" in capsys.readouterr().err


def browser_or_skip():
    if not Path(CHROMIUM).exists():
        pytest.skip(
            f"{CHROMIUM} is absent: install Debian's chromium (apt-get install -y chromium) to open the "
            "report in a headless browser"
        )
    return pytest.importorskip(
        "playwright.sync_api",
        reason="the playwright package is absent: "
        "pip install -e '.[test]' (never `playwright install`: the test uses Debian's chromium)",
    )


@pytest.mark.slow
def test_the_report_opens_in_a_headless_browser_without_errors(runs, tmp_path):
    sync_api = browser_or_skip()
    report = write_report(list(runs.values()), tmp_path / "report.html")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM,
            args=[
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--no-first-run",
            ],
        )
        try:
            page = browser.new_page()
            errors, requests = [], []
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("request", lambda r: requests.append(r.url))
            page.goto(report.as_uri())
            page.wait_for_load_state("load")
            points = page.locator("svg.frontier circle.frontier-point")
            cells = page.locator("svg.heatmap rect.cell")
            counts = points.count(), cells.count()
            box = points.first.bounding_box()
        finally:
            browser.close()
    assert errors == []
    assert requests == [report.as_uri()]  # the page fetched nothing but itself
    assert counts == (len(private_runs(runs)), heatmap_cells(runs["ali"]))
    assert box and box["width"] > 0  # drawn, not just present


def fake_run(folder: Path, accuracies: list[float], epsilon: float | None = 2.0, **config) -> Path:
    """A finished run folder written by hand (no training): summary, config and one record per round."""
    folder.mkdir(parents=True)
    summary = {
        "strategy": "dp-fedavg",
        "noise_multiplier": 1.0,
        "epsilon": epsilon,
        "delta": 1e-5,
        "final_accuracy": accuracies[-1],
        "rounds_completed": len(accuracies),
    }
    (folder / "summary.json").write_text(json.dumps(summary))
    (folder / "config.json").write_text(json.dumps({"noise-multiplier": 1.0, "results-dir": str(folder), **config}))
    rows = [{"round": i + 1, "accuracy": a, "epsilon": epsilon} for i, a in enumerate(accuracies)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def y_ticks(text: str, css: str) -> list[float]:
    """The y-axis tick labels of the chart with class `css` (y ticks are right-aligned, x ticks centred)."""
    svg = re.search(rf'<svg class="chart {css}".*?</svg>', text).group(0)
    return [float(v) for v in re.findall(r'class="tick" text-anchor="end">([^<]+)<', svg)]


def legend(text: str) -> list[str]:
    return re.findall(r"<td><i class=\"swatch\"[^>]*></i>([^<]+)<br>", text)


def test_runs_that_differ_only_in_config_get_labels_that_say_how(tmp_path):
    dirs = [
        fake_run(tmp_path / "a", [0.5], **{"sample-rate": 0.5, "seed": 1}),
        fake_run(tmp_path / "b", [0.6], **{"sample-rate": 1.0, "seed": 1}),
        fake_run(tmp_path / "c", [0.7], **{"sample-rate": 1.0, "seed": 2}),
    ]
    labels = legend(write_report(dirs, tmp_path / "r.html").read_text())
    assert labels == [
        "dp-fedavg sigma=1.0 (sample-rate=0.5 seed=1)",
        "dp-fedavg sigma=1.0 (sample-rate=1 seed=1)",
        "dp-fedavg sigma=1.0 (sample-rate=1 seed=2)",
    ]


def test_runs_with_the_same_config_are_told_apart_by_their_folder(tmp_path):
    dirs = [fake_run(tmp_path / "run-1", [0.5]), fake_run(tmp_path / "run-2", [0.6])]
    labels = legend(write_report(dirs, tmp_path / "r.html").read_text())
    assert labels == ["dp-fedavg sigma=1.0 (run-1)", "dp-fedavg sigma=1.0 (run-2)"]


def test_a_single_run_frontier_keeps_accuracy_within_0_and_1(tmp_path):
    text = write_report([fake_run(tmp_path / "one", [0.6, 0.9])], tmp_path / "r.html").read_text()
    frontier_ticks, accuracy_ticks = y_ticks(text, "frontier"), y_ticks(text, "accuracy")
    assert 0.85 <= frontier_ticks[0] < 0.9 < frontier_ticks[-1] <= 0.95  # was 0.4 to 1.4
    assert 0.5 <= accuracy_ticks[0] <= 0.6 and 0.9 < accuracy_ticks[-1] <= 1.0
    top = write_report([fake_run(tmp_path / "top", [1.0])], tmp_path / "t.html").read_text()
    assert y_ticks(top, "frontier")[-1] == 1.0 and y_ticks(top, "frontier")[0] >= 0.9


@pytest.mark.parametrize(
    "damage",
    [
        "summary not json",
        "summary a list",
        "metrics line not json",
        "metrics line a number",
        "config not json",
        "summary with wrong types",
        "metrics binary",
        "output folder missing",
    ],
)
@pytest.mark.slow  # 2-9 s together: the fast tier keeps its 5-minute margin on 2 cores
def test_bad_run_folders_give_one_line_naming_the_file(tmp_path, damage):
    """dpfl_tools.report on damaged run folders: one line naming the file (or the output), exit 2, no traceback."""
    import subprocess
    import sys

    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"strategy": "dp-fedavg", "epsilon": 1.0, "final_accuracy": 0.5}))
    (run / "metrics.jsonl").write_text(json.dumps({"round": 1, "accuracy": 0.5, "epsilon": 1.0}) + "\n")
    output = tmp_path / "report.html"
    named = "summary.json"
    if damage == "summary not json":
        (run / "summary.json").write_text("{bad")
    elif damage == "summary a list":
        (run / "summary.json").write_text("[1, 2]")
    elif damage == "metrics line not json":
        (run / "metrics.jsonl").write_text('{"round": 1}\n{oops\n')
        named = "metrics.jsonl, line 2"
    elif damage == "metrics line a number":
        (run / "metrics.jsonl").write_text("7\n")
        named = "metrics.jsonl, line 1"
    elif damage == "config not json":
        (run / "config.json").write_text("\x00\x01")
        named = "config.json"
    elif damage == "summary with wrong types":
        (run / "summary.json").write_text(json.dumps({"strategy": ["x"], "epsilon": "high", "final_accuracy": {}}))
        named = ""
    elif damage == "metrics binary":
        (run / "metrics.jsonl").write_bytes(b"\xff\xfe\x00garbage\n")
        named = "metrics.jsonl, line 1"
    else:
        output = tmp_path / "missing" / "report.html"
        named = "cannot write"
    out = subprocess.run(
        [sys.executable, "-m", "dpfl_tools.report", str(run), "-o", str(output)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "Traceback" not in out.stderr, out.stderr
    if damage == "summary with wrong types" and out.returncode == 0:
        return  # drawn anyway: nothing to refuse
    assert out.returncode == 2, (out.returncode, out.stdout, out.stderr)
    assert out.stderr.startswith("dpfl_tools.report: ") and named in out.stderr and len(out.stderr.splitlines()) == 1
