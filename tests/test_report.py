"""The HTML report of run folders (fl_app/report.py): what it draws, counted in the HTML and in a real headless
browser, and that it shows the non-private diagnostics only when asked or published.

The browser test needs Debian's chromium (`apt-get install -y chromium`) and the playwright package (in the test
extra); it never downloads a browser of its own.
"""

import json
import re
from pathlib import Path

import pytest

from fl_app.client_app import app as client_app
from fl_app.config import validate
from fl_app.inprocess import InProcessGrid
from fl_app.report import NOT_PRIVATE, main, write_report
from fl_app.results import read_metrics
from fl_app.server_app import run_federated

SMALL = {"dataset": "digits", "model": "mlp", "partitioner": "iid", "local-steps": 2, "num-rounds": 3,
         "sample-rate": 1.0, "tensorboard": False}
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
    return [name for name, path in runs.items()
            if json.loads((path / "summary.json").read_text())["epsilon"] is not None]


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
        pytest.skip(f"{CHROMIUM} is absent: install Debian's chromium (apt-get install -y chromium) to open the "
                    "report in a headless browser")
    return pytest.importorskip("playwright.sync_api", reason="the playwright package is absent: "
                               "pip install -e '.[test]' (never `playwright install`: the test uses Debian's chromium)")


@pytest.mark.slow
def test_the_report_opens_in_a_headless_browser_without_errors(runs, tmp_path):
    sync_api = browser_or_skip()
    report = write_report(list(runs.values()), tmp_path / "report.html")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=[
            "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--no-first-run"])
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

