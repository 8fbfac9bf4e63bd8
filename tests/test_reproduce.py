"""Smoke test of the reproduction study: `python -m benchmarks.reproduce CLAIM --quick` runs every arm at every
level through the product and writes the claim's table, JSON and plot (the shape, not the numbers: --quick is a
toy size)."""

import json
import subprocess
import sys

import pytest

from benchmarks.reproduce import CLAIMS


@pytest.mark.slow  # 20 s: a subprocess that trains every arm (the fast tier keeps a margin under 5 minutes)
def test_quick_study_of_one_claim_writes_its_table(tmp_path):
    claim = CLAIMS["dp-fedsam"]
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.reproduce",
            "dp-fedsam",
            "--quick",
            "--workers",
            "1",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "quick" / "dp-fedsam.json").read_text())
    # every arm at every level, one seed; one tuning run per tuned arm (--quick takes the first grid point)
    assert sorted((r["arm"], r["level"]) for r in report["runs"]) == sorted(
        (arm, level.name) for arm in claim.arms for level in claim.levels
    )
    assert sorted(r["arm"] for r in report["tuning"]) == sorted(claim.grid)
    assert set(report["chosen"]) == set(claim.grid)
    for run in report["runs"]:  # equal accounted epsilon across the arms of a level (calibrated by the ledger)
        same_level = [r["epsilon"] for r in report["runs"] if r["level"] == run["level"]]
        assert max(same_level) - min(same_level) < 1e-9 and 0 <= run["metric"] <= 1
    table = (tmp_path / "quick" / "dp-fedsam.md").read_text().splitlines()
    header = next(i for i, line in enumerate(table) if line.startswith("| arm |"))
    rows = table[header + 2 : header + 2 + len(claim.arms)]
    assert [row.split("|")[1].strip() for row in rows] == list(claim.arms)
    assert all(len(row.split("|")) == len(claim.levels) + 3 for row in rows)  # one cell per level
    assert sum(line.startswith("- ") for line in table) == len(claim.levels) * len(claim.compare)
    assert (tmp_path / "quick" / "dp-fedsam.png").stat().st_size > 5_000


@pytest.mark.parametrize("name", sorted(CLAIMS))
def test_every_run_of_every_claim_is_a_valid_run_config(name, tmp_path):
    """Each run a study would start (tuning, final and diagnosis, at the papers' size) passes the app's validation:
    a key its algorithm does not read (head-epochs on an arm without a head) is found here, not hours into a sweep."""
    from benchmarks.reproduce import jobs_for
    from dpfl.fl_app.config import validate

    claim = CLAIMS[name]
    chosen = {arm: {k: v[0] for k, v in grid.items()} for arm, grid in claim.grid.items()}
    jobs = [
        j
        for phase in ("tune", "final", "diagnosis")
        for j in jobs_for(name, claim, phase, 1, False, "", tmp_path, chosen)
    ]
    assert jobs
    for j in jobs:
        validate({k: v for k, v in j["config"].items() if k != "data-dir"})
