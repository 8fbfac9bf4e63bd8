"""The round's log line, `Round r/R: key=value ...`, and its parser: what `flwr log` shows of a run. The keys are
the published figures (`LOG_KEYS`; with publish_diagnostics, after `DIAGNOSTICS_MARK`, the diagnostics'), each
declared in dpcore/privacy/figures.py."""

from __future__ import annotations

import re

from dpfl.dpcore.privacy import figures

LOG_KEYS = figures.round_line_names()


DIAGNOSTIC_LOG_KEYS = figures.round_line_names(published=False)


DIAGNOSTICS_MARK = "  | not private: "  # what follows it on a log line is not covered by epsilon


LOG_LINE = re.compile(r"(?:Round (\d+)(?:/\d+|(?=: [\w-]+=))|Finished): (.*)$")


def format_record(record: dict, keys: tuple[str, ...] = LOG_KEYS) -> str:
    """`key=value` for the keys present (None left out), numbers to 4 significant digits, two spaces apart."""
    return "  ".join(
        f"{k}={record[k]:.4g}" if isinstance(record[k], float) else f"{k}={record[k]}"
        for k in keys
        if record.get(k) is not None
    )


def parse_log_line(line: str) -> tuple[dict, dict] | None:
    """(published values, diagnostics) of a `Round r/R: ...` or `Round r: ...` line (with `round`) or of the run's
    `Finished: ...` line as `flwr log` prints them (a prefix such as Flower's `INFO :` is allowed); None for any other line.
    Keys are those of metrics.jsonl (Finished: summary.json), after DIAGNOSTICS_MARK diagnostics.jsonl's;
    numbers come back to the line's 4 significant digits."""
    match = LOG_LINE.search(line.rstrip())
    if match is None:
        return None

    def value(v: str):
        if v in ("True", "False"):  # the not-a-guarantee marks
            return v == "True"
        return int(v) if v.lstrip("-").isdigit() else float(v)

    def values(text: str) -> dict:
        pairs = (item.split("=", 1) for item in text.split())
        return {k: value(v) for k, v in pairs}

    published, _, diagnostics = match.group(2).partition(DIAGNOSTICS_MARK.strip())
    round_number = {"round": int(match.group(1))} if match.group(1) else {}
    return {**round_number, **values(published)}, values(diagnostics)
