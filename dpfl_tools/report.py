"""One self-contained HTML report of run folders: inline SVG drawn here, no script, nothing fetched.

    python -m dpfl_tools.report RUN_DIR... [-o report.html] [--diagnostics]

What it shows comes from metrics.jsonl and summary.json, what the privacy ledger covers:
- across runs: the privacy-utility frontier (final accuracy against final epsilon, one line per algorithm,
  each non-private reference as a horizontal line), and accuracy and epsilon per round of every run;
- per run: its figures, for ALI-DPFL a rounds x clients heatmap of the epsilon each client has spent and tau
  per round, for top-k the bytes of one upload, for the wavelet mechanisms the true epsilon beside the one
  the paper claims, and the resolved config (config.json).
The non-private diagnostics (diagnostics.jsonl: clipped fraction, update norms) appear only for a run that
published them (`publish-diagnostics = true`) or with --diagnostics, in sections marked as not covered by
epsilon. `python -m dpfl_tools.launch --sweep noise-multiplier=0.5,1,2 --reference` makes the runs of one frontier.
"""

from __future__ import annotations

import argparse
import html
import json
from dataclasses import dataclass, field
from pathlib import Path

from dpfl.dpcore.privacy.figures import with_current_names
from dpfl.fl_app.results import read_diagnostics, read_metrics, read_status, run_label
from dpfl.fl_app.run_files import RunFileError, read_json_object
from dpfl_tools.svg_charts import Series, chart, fmt, heatmap, number

NOT_PRIVATE = "not private: not covered by epsilon"
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf", "#7f7f7f", "#bcbd22")
ACCURACY_BOUNDS = (0.0, 1.0)
IGNORED_IN_LABELS = ("results-dir", "run-name", "resume")  # differ between runs without describing them


# ---------------------------------------------------------------------------- runs
@dataclass
class Run:
    path: Path
    label: str
    algorithm: str
    config: dict
    summary: dict
    metrics: list[dict]
    diagnostics: list[dict] = field(default_factory=list)  # empty unless shown
    color: str = COLORS[0]

    @property
    def private(self) -> bool:
        """A DP run (a finite epsilon); the non-private reference's epsilon is null (infinite)."""
        return self.summary.get("epsilon") is not None

    def series(self, key: str, rows: list[dict] | None = None) -> list[tuple[float, float]]:
        return [(r["round"], r[key]) for r in (self.metrics if rows is None else rows) if number(r.get(key))]


def load_run(path: Path | str, diagnostics: bool = False, color: str = COLORS[0]) -> Run:
    """A run folder's published files; its diagnostics too when it published them or `diagnostics`."""
    path = Path(path)
    summary = read_json_object(path / "summary.json")
    config_file = path / "config.json"
    config = read_json_object(config_file) if config_file.exists() else {}
    shown = diagnostics or bool(config.get("publish-diagnostics"))
    return Run(
        path,
        run_label(summary),
        str(summary.get("strategy")),
        config,
        with_current_names(summary),
        [with_current_names(r) for r in read_metrics(path)],
        read_diagnostics(path) if shown else [],
        color,
    )


def config_value(value) -> str:
    """A config value as a label shows it: strings bare, numbers as fmt writes them."""
    return value if isinstance(value, str) else fmt(value)


def differing_keys(runs: list[Run]) -> list[str]:
    """The config keys whose values differ between `runs` (sorted; the run's folder and name left out)."""
    keys = sorted({k for r in runs for k in r.config} - set(IGNORED_IN_LABELS))
    return [k for k in keys if len({json.dumps(r.config.get(k), sort_keys=True) for r in runs}) > 1]


def make_labels_unique(runs: list[Run], max_keys: int = 3) -> None:
    """Runs that would share a label get the config values that tell them apart (up to `max_keys`), and where
    those do not (the same config, or too many differences), the run folder's name."""
    groups: dict[str, list[Run]] = {}
    for run in runs:
        groups.setdefault(run.label, []).append(run)
    for label, members in groups.items():
        if len(members) < 2:
            continue
        keys = differing_keys(members)
        for run in members:
            extra = " ".join(f"{k}={config_value(run.config.get(k))}" for k in keys[:max_keys])
            run.label = f"{label} ({extra})" if extra and len(keys) <= max_keys else f"{label} ({run.path.name})"
    if len({r.label for r in runs}) < len(runs):  # e.g. a label made above equals another run's own
        for run in runs:
            run.label = f"{run.label} [{run.path.name}]"


# ---------------------------------------------------------------------------- sections
def frontier(runs: list[Run]) -> str:
    """Final accuracy against final epsilon: a point per DP run, a line per algorithm, references flat."""
    by_algorithm: dict[str, list[Run]] = {}
    for run in runs:
        if run.private and number(run.summary.get("final_accuracy")):
            by_algorithm.setdefault(run.algorithm, []).append(run)
    series = []
    for i, (name, members) in enumerate(by_algorithm.items()):
        members.sort(key=lambda r: r.summary["epsilon"])
        series.append(
            Series(
                name,
                [(r.summary["epsilon"], r.summary["final_accuracy"]) for r in members],
                COLORS[i % len(COLORS)],
                markers=True,
                marker_class="frontier-point",
                marker_titles=[
                    f"{r.label} ({r.path.name}): epsilon {fmt(r.summary['epsilon'])}, "
                    f"accuracy {fmt(r.summary['final_accuracy'])}"
                    for r in members
                ],
            )
        )
    references = [
        Series(r.label, [(0.0, r.summary["final_accuracy"])], "#555", dashed=True)
        for r in runs
        if not r.private and number(r.summary.get("final_accuracy"))
    ]
    if not series and not references:
        return ""
    return chart(
        "Privacy-utility frontier",
        series,
        "final epsilon (log scale)",
        "final accuracy",
        log_x=True,
        hlines=references,
        css="frontier",
        y_bounds=ACCURACY_BOUNDS,
        note="One point per DP run (final round), a line per algorithm; dashed: non-private references. "
        "Epsilons of different DP units (client-level, ALI-DPFL's sample-level) do not compare.",
    )


def per_round(runs: list[Run], key: str, title: str, y_label: str) -> str:
    """One line per run of `key` against the round (accuracy on an axis within [0, 1])."""
    series = [Series(r.label, r.series(key), r.color) for r in runs if r.series(key)]
    bounds = ACCURACY_BOUNDS if key == "accuracy" else None
    return chart(title, series, "round", y_label, css=key, y_bounds=bounds) if series else ""


def ali_dpfl_charts(run: Run) -> str:
    rows = [r for r in run.metrics if isinstance(r.get("epsilon_per_client"), dict)]
    if not rows:
        return ""
    clients = sorted({c for r in rows for c in r["epsilon_per_client"]}, key=lambda c: (len(c), c))
    values = {(r["round"], c): v for r in rows for c, v in r["epsilon_per_client"].items()}
    out = heatmap("Epsilon spent per client (sample-level)", [r["round"] for r in rows], clients, values)
    tau = [Series("tau (local DP-SGD steps)", run.series("tau"), run.color, markers=True)]
    return out + chart("tau per round", tau, "round", "tau", css="tau")


def topk_chart(run: Run) -> str:
    upload = run.series("upload_bytes_per_client")
    if not upload:
        return ""
    series = [
        Series("upload of one honest client", upload, run.color),
        Series("dense upload", run.series("dense_bytes_per_client"), "#555", dashed=True),
    ]
    return chart("Top-k: bytes per client upload", [s for s in series if s.points], "round", "bytes", css="topk")


def claimed_epsilon_chart(run: Run) -> str:
    claimed = run.series("claimed_epsilon")
    if not claimed:
        return ""
    series = [
        Series("true epsilon (ledger)", run.series("epsilon"), run.color),
        Series("epsilon the paper claims", claimed, "#555", dashed=True),
    ]
    return chart(
        "Wavelet noise: true vs claimed epsilon",
        series,
        "round",
        "epsilon",
        css="claimed",
        note="The paper's calibration overstates the noise; only the ledger's epsilon is a bound.",
    )


def diagnostics_charts(run: Run) -> str:
    if not run.diagnostics:
        return ""
    clipped = Series("clipped fraction", run.series("clipped_fraction", run.diagnostics), run.color)
    mean = run.series("update_norm_mean", run.diagnostics)
    std = dict(run.series("update_norm_std", run.diagnostics))
    norms = [Series("update norm mean", mean, run.color)]
    if std:
        norms += [
            Series("mean ± std", [(x, y + std.get(x, 0.0)) for x, y in mean], run.color, dashed=True),
            Series("", [(x, y - std.get(x, 0.0)) for x, y in mean], run.color, dashed=True),
        ]
    charts = chart("Clipped fraction", [clipped], "round", "fraction", css="diagnostic") if clipped.points else ""
    charts += chart("Update norms before clipping", norms, "round", "L2 norm", css="diagnostic") if mean else ""
    if not charts:
        return ""
    return (
        f'<section class="diagnostics"><h4>Diagnostics — {NOT_PRIVATE}</h4><p class="note">Computed from raw '
        f"client replies without noise (diagnostics.jsonl); they describe the participants and epsilon does "
        f'not cover them.</p><div class="charts">{charts}</div></section>'
    )


SUMMARY_COLUMNS = (
    ("final accuracy", "final_accuracy"),
    ("epsilon", "epsilon"),
    ("delta", "delta"),
    ("epsilon against server", "epsilon_against_server"),
    ("claimed epsilon", "claimed_epsilon"),
    ("rounds", "rounds_completed"),
    ("noise multiplier", "noise_multiplier"),
    ("sample rate", "client_sampling_rate"),
    ("clients", "num_clients"),
    ("accountant", "accountant"),
)


def summary_table(runs: list[Run]) -> str:
    columns = [(name, key) for name, key in SUMMARY_COLUMNS if any(r.summary.get(key) is not None for r in runs)]
    head = "".join(f"<th>{html.escape(name)}</th>" for name, _ in columns)
    rows = "".join(
        f'<tr><td><i class="swatch" style="background:{r.color}"></i>{html.escape(r.label)}'
        f"<br><small>{html.escape(r.path.name)}</small></td>"
        + "".join(f"<td>{html.escape(fmt(r.summary.get(key)))}</td>" for _, key in columns)
        + "</tr>"
        for r in runs
    )
    return f'<table class="summary"><tr><th>run</th>{head}</tr>{rows}</table>'


def run_section(run: Run) -> str:
    charts = ali_dpfl_charts(run) + topk_chart(run) + claimed_epsilon_chart(run)
    caveats = (
        ""
        if run.summary.get("epsilon_is_guarantee", True)
        else (
            '<p class="warning">epsilon is NOT a guarantee: '
            + html.escape("; ".join(run.summary.get("epsilon_caveats", [])))
            + "</p>"
        )
    )
    config = "".join(
        f"<tr><td>{html.escape(k)}</td><td>{html.escape(json.dumps(v))}</td></tr>"
        for k, v in sorted(run.config.items())
    )
    return (
        f'<section class="run"><h3><i class="swatch" style="background:{run.color}"></i>{html.escape(run.label)}'
        f' <small>{html.escape(str(run.path))}</small></h3>{caveats}<div class="charts">{charts}</div>'
        f"{diagnostics_charts(run)}<details><summary>resolved config ({len(run.config)} keys)</summary>"
        f'<table class="config">{config}</table></details></section>'
    )


STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:20px;color:#222;max-width:1500px}
h1{font-size:20px;margin:0 0 4px} h2{font-size:17px;margin:22px 0 6px} h3{font-size:15px;margin:16px 0 4px}
h4{margin:8px 0 2px;color:#a33} small{color:#666;font-weight:normal}
.charts{display:flex;flex-wrap:wrap;gap:12px;align-items:flex-start} figure{margin:0}
svg text{font:11px system-ui,sans-serif;fill:#333} svg .title{font-weight:600;font-size:12px}
svg .grid{stroke:#e5e5e5} svg .reference{stroke-width:1.6;stroke-dasharray:6 4}
.legend{font-size:12px;max-width:440px} .legend span{margin-right:10px;white-space:nowrap}
.legend i{display:inline-block;width:16px;border-top:2px solid;margin-right:4px;vertical-align:middle}
.legend i.dash{border-top-style:dashed} .swatch{display:inline-block;width:10px;height:10px;margin-right:6px}
table{border-collapse:collapse;font-size:12px} td,th{border:1px solid #ddd;padding:3px 6px;text-align:right}
td:first-child,th:first-child{text-align:left} .config td{text-align:left;font-family:monospace}
.note{font-size:12px;color:#555;max-width:440px;margin:2px 0} .warning{color:#a33}
.diagnostics{border:2px dashed #c66;padding:4px 10px;margin:8px 0;background:#fff8f8}
.run{border-top:1px solid #ccc;margin-top:10px}
"""


def render(runs: list[Run]) -> str:
    """The whole report: one HTML page, styles and SVG inline."""
    across = (
        frontier(runs)
        + per_round(runs, "accuracy", "Accuracy per round (server test set)", "accuracy")
        + per_round(runs, "epsilon", "Epsilon per round", "epsilon")
    )
    shown = [r for r in runs if r.diagnostics]
    diagnostics_note = (
        f'<p class="warning">Sections marked "{NOT_PRIVATE}" show diagnostics of '
        f"{len(shown)} run(s); do not publish them.</p>"
        if shown
        else ""
    )
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>dpfl report</title>'
        f"<style>{STYLE}</style></head><body><h1>dpfl report: {len(runs)} run(s)</h1>"
        '<p class="note">Everything here is what the privacy ledger covers (metrics.jsonl, summary.json) unless a '
        f'section says "{NOT_PRIVATE}". Accuracy: the released model on the server-held test set.</p>'
        f'{diagnostics_note}{summary_table(runs)}<h2>Across runs</h2><div class="charts">{across}</div>'
        "<h2>Runs</h2>" + "".join(run_section(r) for r in runs) + "</body></html>"
    )


def write_report(run_dirs: list[Path | str], out: Path | str, diagnostics: bool = False) -> Path:
    runs = [load_run(d, diagnostics, COLORS[i % len(COLORS)]) for i, d in enumerate(run_dirs)]
    make_labels_unique(runs)
    Path(out).write_text(render(runs), encoding="utf-8")
    return Path(out)


def unfinished(run: str) -> str:
    """A run folder without summary.json, with what its status says (an interrupted run: what to do)."""
    record = read_status(run)
    return f"{run} ({record['status']}{': ' + record['note'] if 'note' in record else ''})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="run folders (with summary.json)")
    parser.add_argument("-o", "--output", default="report.html", help="the HTML file to write")
    parser.add_argument(
        "--diagnostics", action="store_true", help=f"also show every run's non-private diagnostics ({NOT_PRIVATE})"
    )
    args = parser.parse_args(argv)
    try:  # a run folder without summary.json: what its status says (a damaged status.json: named in one line)
        missing = [unfinished(r) for r in args.runs if not Path(r, "summary.json").exists()]
    except RunFileError as exc:
        parser.exit(2, f"dpfl_tools.report: {exc}\n")
    if missing:
        parser.error("no summary.json (not a finished run folder): " + "; ".join(missing))
    try:
        print("report written to", write_report(args.runs, args.output, args.diagnostics))
    except RunFileError as exc:
        parser.exit(2, f"dpfl_tools.report: {exc}\n")
    except OSError as exc:
        parser.exit(2, f"dpfl_tools.report: cannot write {args.output}: {exc.strerror or exc}\n")
    except (TypeError, ValueError, KeyError, AttributeError) as exc:  # values of the wrong kind in a run's files
        parser.exit(
            2,
            f"dpfl_tools.report: the run folders {', '.join(args.runs)} hold values the report cannot "
            f"draw ({type(exc).__name__}: {exc})\n",
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
