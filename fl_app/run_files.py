"""Reading a run folder's round records: what fl_app.results and fl_app.dashboards both need.

metrics.jsonl holds what the privacy ledger covers; diagnostics.jsonl the raw, non-private statistics.
"""

from __future__ import annotations

import json
from pathlib import Path


def read_metrics(run_dir: Path | str, name: str = "metrics.jsonl") -> list[dict]:
    """The round records of a run folder (name = "diagnostics.jsonl" for the non-private ones)."""
    path = Path(run_dir, name)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_diagnostics(run_dir: Path | str) -> list[dict]:
    """The non-private round records (diagnostics.jsonl) of a run folder."""
    return read_metrics(run_dir, "diagnostics.jsonl")
