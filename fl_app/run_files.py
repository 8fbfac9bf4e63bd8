"""Reading a run folder's round records: what fl_app.results and fl_app.dashboards both need.

metrics.jsonl holds what the privacy ledger covers; diagnostics.jsonl the raw, non-private statistics.
"""

from __future__ import annotations

import json
from pathlib import Path


class RunFileError(ValueError):
    """A run folder's file is not what a run writes: the message names the file and what is wrong."""


def read_json_object(path: Path | str) -> dict:
    """A JSON object file of a run folder (summary.json, config.json); RunFileError naming it otherwise."""
    try:
        value = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RunFileError(f"{path}: not readable as JSON ({exc})") from None
    if not isinstance(value, dict):
        raise RunFileError(f"{path}: holds a {type(value).__name__}, not a JSON object")
    return value


def read_metrics(run_dir: Path | str, name: str = "metrics.jsonl") -> list[dict]:
    """The round records of a run folder (name = "diagnostics.jsonl" for the non-private ones); RunFileError
    naming the file and line where one is not a JSON object."""
    path = Path(run_dir, name)
    if not path.exists():
        return []
    rows = []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise RunFileError(f"{path}, line {number}: not JSON ({exc})") from None
        if not isinstance(row, dict):
            raise RunFileError(f"{path}, line {number}: a {type(row).__name__}, not a round record")
        rows.append(row)
    return rows


def read_diagnostics(run_dir: Path | str) -> list[dict]:
    """The non-private round records (diagnostics.jsonl) of a run folder."""
    return read_metrics(run_dir, "diagnostics.jsonl")
