"""Reading a run folder's round records: what fl_app.results and fl_app.dashboards both need.

metrics.jsonl holds what the privacy ledger covers; diagnostics.jsonl the raw, non-private statistics.
"""

from __future__ import annotations

import json
from pathlib import Path


class RunFileError(ValueError):
    """A run folder's file is not what a run writes: the message names the file and what is wrong."""


def not_a_file_error(file: Path) -> RunFileError:
    """One line naming what stands where a run keeps one of its files (a directory), and what to do."""
    kind = "a directory" if file.is_dir() else "not a regular file"
    return RunFileError(
        f"{file}: {kind} where the run keeps its {file.name} file; move it out of {file.parent} (or remove it) "
        "and run again, or choose another results-dir or run-name"
    )


def read_run_file(file: Path | str) -> bytes | None:
    """The bytes of one file of a run folder, None where there is none; RunFileError naming it where a directory
    (or another non-file) stands in its place or it cannot be read."""
    file = Path(file)
    if file.exists() and not file.is_file():  # checked first: reading a FIFO would wait for a writer
        raise not_a_file_error(file)
    try:
        return file.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise RunFileError(
            f"{file}: cannot be read ({exc.strerror or exc}); give this user read access to it, or choose another "
            "results-dir or run-name"
        ) from None


def read_json_object(path: Path | str) -> dict:
    """A JSON object file of a run folder (summary.json, config.json); RunFileError naming it otherwise."""
    text = read_run_file(path)
    if text is None:
        raise RunFileError(f"{path}: does not exist")
    try:
        value = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RunFileError(f"{path}: not readable as JSON ({exc})") from None
    if not isinstance(value, dict):
        raise RunFileError(f"{path}: holds a {type(value).__name__}, not a JSON object")
    return value


def damaged_line_error(path: Path, number: int, why: str) -> RunFileError:
    """One line naming a line of a round file (metrics.jsonl, diagnostics.jsonl) that no run wrote, and what to
    do: the checkpoint holds every saved round, and a resume writes the file anew from it."""
    return RunFileError(
        f"{path}, line {number}: {why}; the line is cut short (a run killed while writing it, a full disk) or was "
        f"not written by this program: remove line {number} and resume (resume = true writes {path.name} anew "
        "from checkpoint.npz), or start a new run with another results-dir or run-name"
    )


def read_metrics(run_dir: Path | str, name: str = "metrics.jsonl") -> list[dict]:
    """The round records of a run folder (name = "diagnostics.jsonl" for the non-private ones); RunFileError
    naming the file, and the line where one is not a JSON object, with what to do."""
    path = Path(run_dir, name)
    text = read_run_file(path)
    if text is None:
        return []
    rows = []
    for number, line in enumerate(text.decode(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise damaged_line_error(path, number, f"not JSON ({exc})") from None
        if not isinstance(row, dict):
            raise damaged_line_error(path, number, f"a {type(row).__name__}, not a round record")
        rows.append(row)
    return rows


def read_diagnostics(run_dir: Path | str) -> list[dict]:
    """The non-private round records (diagnostics.jsonl) of a run folder."""
    return read_metrics(run_dir, "diagnostics.jsonl")
