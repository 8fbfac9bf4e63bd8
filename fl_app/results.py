"""The run directory: config.json, metrics.jsonl (one line per round), summary.json, plot.png.

Non-finite numbers (epsilon of a non-private run is inf) are written as null.
`python -m fl_app.results RUN_DIR [REFERENCE_RUN_DIR ...]` redraws a run's plot with
other runs (e.g. the non-private reference) as extra lines.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path


def json_safe(obj):
    """Replace NaN/inf by None, recursively, so the files are strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if hasattr(obj, "item"):  # numpy scalar
        return json_safe(obj.item())
    return obj


def resolve_run_dir(cfg: dict) -> Path:
    """results-dir if given, else ~/dpfl-results/<run-name or time-algorithm-dataset>."""
    name = cfg["run-name"] or f"{time.strftime('%Y%m%d-%H%M%S')}-{cfg['algorithm']}-{cfg['dataset']}"
    base = Path(os.path.expanduser(cfg["results-dir"])) if cfg["results-dir"] else Path.home() / "dpfl-results" / name
    return base.resolve()


class RunDirectory:
    """Writes one run's files as the run goes; nothing already written is lost on a crash."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.metrics_file = self.path / "metrics.jsonl"
        self.metrics_file.write_text("")

    def _write_json(self, name: str, obj) -> None:
        tmp = self.path / f".{name}.tmp"
        tmp.write_text(json.dumps(json_safe(obj), indent=2, sort_keys=True) + "\n")
        os.replace(tmp, self.path / name)

    def write_config(self, cfg: dict) -> None:
        self._write_json("config.json", cfg)

    def append_round(self, record: dict) -> None:
        with self.metrics_file.open("a") as f:
            f.write(json.dumps(json_safe(record), sort_keys=True) + "\n")

    def write_summary(self, summary: dict) -> None:
        self._write_json("summary.json", summary)


def run_label(summary: dict) -> str:
    """The run's label in plots: its algorithm's (fl_app.algorithms), or the strategy's name."""
    from fl_app.algorithms import ALGORITHMS

    name = summary.get("strategy")
    return ALGORITHMS[name].run_label(summary) if name in ALGORITHMS else str(name)


def read_metrics(run_dir: Path | str) -> list[dict]:
    lines = Path(run_dir, "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def plot_runs(run_dirs: list[Path | str], out: Path | str) -> Path:
    """Accuracy and epsilon per round, one line per run (first run = this run)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_acc, ax_eps) = plt.subplots(1, 2, figsize=(10, 4))
    for run_dir in run_dirs:
        rows = read_metrics(run_dir)
        summary_file = Path(run_dir, "summary.json")
        label = Path(run_dir).name
        if summary_file.exists():
            label = run_label(json.loads(summary_file.read_text()))
        rounds = [r["round"] for r in rows]
        accuracy = [r.get("accuracy", r.get("personalized_accuracy")) for r in rows]  # partial sharing: personalized
        ax_acc.plot(rounds, [math.nan if a is None else a for a in accuracy], marker=".", label=label)
        eps = [r.get("epsilon") for r in rows]
        if any(e is not None for e in eps):
            ax_eps.plot(rounds, eps, marker=".", label=label)
    ax_acc.set(xlabel="round", ylabel="accuracy (server test set, or personalized)", title="Accuracy")
    ax_eps.set(xlabel="round", ylabel="epsilon", title="Privacy spent (non-private runs: infinite)")
    ax_acc.legend(fontsize=8)
    ax_eps.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return Path(out)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python -m fl_app.results RUN_DIR [OTHER_RUN_DIR ...]")
    print(plot_runs(sys.argv[1:], Path(sys.argv[1], "plot.png")))
