"""The run directory: config.json, status.json, metrics.jsonl, diagnostics.jsonl, checkpoint.npz,
summary.json, diagnostics-summary.json, plot.png.

metrics.jsonl and summary.json hold what the privacy ledger covers (fit to publish); diagnostics.jsonl
and diagnostics-summary.json hold the raw statistics of client replies (counts, norms, losses, client
evaluation, timing), which no noise covers. Non-finite numbers (epsilon of a non-private run is inf)
are written as null.
`python -m fl_app.results RUN_DIR [REFERENCE_RUN_DIR ...]` redraws a run's plot with
other runs (e.g. the non-private reference) as extra lines; `--tensorboard RUN_DIR ...` writes
TensorBoard events for older run folders.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

from fl_app.task.atomic import atomic_write


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


class PreviousRunError(ValueError):
    """The results folder holds another run that this one would overwrite or mix with."""


RESUMABLE_KEYS = ("resume", "num-rounds")
LOCK_FILE = ".dpfl-run.lock"  # held (flock) by the run's one writer
RUN_FILES = ("config.json", "status.json", "metrics.jsonl", "checkpoint.npz", LOCK_FILE)  # any: a dpfl run folder  # what may change between a run and its resumption


class RunDirectory:
    """Writes one run's files as the run goes; nothing already written is lost on a crash.

    Files: config.json, status.json (running / completed / failed), metrics.jsonl and
    diagnostics.jsonl (one line per round each), checkpoint.npz (after every round: the global arrays
    and the strategy's whole state, the ledger included, replaced atomically), summary.json,
    diagnostics-summary.json and plot.png at the end.

    A folder that holds a previous run is refused unless `resume`: then the checkpoint is read
    (`checkpoint`), the config must match the previous one (but for RESUMABLE_KEYS), and the
    caller rewrites the round files from the checkpoint's history (`rewrite_rounds`), so no round
    appears twice.
    """

    def __init__(self, path: Path | str, *, resume: bool = False) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.metrics_file = self.path / "metrics.jsonl"
        self.diagnostics_file = self.path / "diagnostics.jsonl"
        self.checkpoint_file = self.path / "checkpoint.npz"
        self.checkpoint = self.read_checkpoint()
        previous_rounds = len(read_metrics(self.path)) if self.metrics_file.exists() else 0
        if not resume and (self.checkpoint is not None or previous_rounds):
            raise PreviousRunError(
                f"results-dir {self.path} holds a previous run ({previous_rounds} rounds in metrics.jsonl"
                f"{', a checkpoint' if self.checkpoint is not None else ''}): set resume = true to continue it, "
                "or choose another results-dir or run-name")
        self.rewrite_rounds([])

    def _write_json(self, name: str, obj) -> None:
        tmp = self.path / f".{name}.tmp"
        tmp.write_text(json.dumps(json_safe(obj), indent=2, sort_keys=True) + "\n")
        os.replace(tmp, self.path / name)

    def write_config(self, cfg: dict) -> None:
        """config.json; resuming, the previous run's config must agree (but for RESUMABLE_KEYS)."""
        previous_file = self.path / "config.json"
        if self.checkpoint is not None and previous_file.exists():
            previous = json.loads(previous_file.read_text())
            differ = sorted(k for k in set(previous) | set(cfg) if k not in RESUMABLE_KEYS
                            and json_safe(previous.get(k)) != json_safe(cfg.get(k)))
            if differ:
                raise PreviousRunError(
                    f"resume = true, but the run in {self.path} was made with other settings: "
                    + ", ".join(f"'{k}' = {previous.get(k)!r} there, {cfg.get(k)!r} now" for k in differ))
        self._write_json("config.json", cfg)

    def write_status(self, status: str, **details) -> None:
        """status.json: running (also what a killed run leaves), completed or failed."""
        self._write_json("status.json", {"status": status, "pid": os.getpid(), "time": time.time(), **details})

    def rewrite_rounds(self, rounds: list[tuple[dict, dict]]) -> None:
        """metrics.jsonl and diagnostics.jsonl from (published, diagnostics) pairs, e.g. a checkpoint's history."""
        for path, records in ((self.metrics_file, [p for p, _ in rounds]), (self.diagnostics_file, [d for _, d in rounds])):
            path.write_text("".join(json.dumps(json_safe(r), sort_keys=True) + "\n" for r in records))

    def append_round(self, published: dict, diagnostics: dict) -> None:
        """One round: what the ledger covers to metrics.jsonl, the raw diagnostics to diagnostics.jsonl."""
        for path, record in ((self.metrics_file, published), (self.diagnostics_file, diagnostics)):
            with path.open("a") as f:
                f.write(json.dumps(json_safe(record), sort_keys=True) + "\n")

    def write_checkpoint(self, state: dict, arrays) -> None:
        """checkpoint.npz: the global arrays and the strategy's state as JSON, replaced atomically."""
        state_bytes = np.frombuffer(json.dumps(json_safe(state)).encode(), dtype=np.uint8)
        payload = {f"array_{i}": a for i, a in enumerate(arrays.to_numpy_ndarrays())}
        atomic_write(self.checkpoint_file, lambda f: np.savez(f, state=state_bytes, **payload))

    def read_checkpoint(self) -> tuple[dict, list] | None:
        """(strategy state, global arrays) of the last completed round, or None."""
        if not self.checkpoint_file.exists():
            return None
        with np.load(self.checkpoint_file, allow_pickle=False) as data:
            state = json.loads(data["state"].tobytes().decode())
            arrays = [data[f"array_{i}"] for i in range(len(data.files) - 1)]
        return state, arrays

    def write_summary(self, summary: dict, diagnostics: dict) -> None:
        """summary.json (what the ledger covers) and diagnostics-summary.json (not private)."""
        self._write_json("summary.json", summary)
        self._write_json("diagnostics-summary.json", diagnostics)


def run_label(summary: dict) -> str:
    """The run's label in plots: its algorithm's (fl_app.algorithms), or the strategy's name."""
    from fl_app.algorithms import ALGORITHMS

    name = summary.get("strategy")
    label = ALGORITHMS[name].run_label(summary) if name in ALGORITHMS else str(name)
    return label if summary.get("epsilon_is_guarantee", True) else f"{label} (epsilon: no guarantee)"


def read_metrics(run_dir: Path | str, name: str = "metrics.jsonl") -> list[dict]:
    """The round records of a run folder (name = "diagnostics.jsonl" for the non-private ones)."""
    path = Path(run_dir, name)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_diagnostics(run_dir: Path | str) -> list[dict]:
    return read_metrics(run_dir, "diagnostics.jsonl")


def read_summary(run_dir: Path | str) -> dict:
    """summary.json merged with diagnostics-summary.json (for reports and research; not private)."""
    extra = Path(run_dir, "diagnostics-summary.json")
    return {**(json.loads(extra.read_text()) if extra.exists() else {}),
            **json.loads(Path(run_dir, "summary.json").read_text())}


def read_rounds(run_dir: Path | str) -> list[dict]:
    """Each round's published record merged with its diagnostics (for reports and research; not private)."""
    diagnostics = {r["round"]: r for r in read_diagnostics(run_dir)}
    return [{**diagnostics.get(r["round"], {}), **r} for r in read_metrics(run_dir)]


def plot_runs(run_dirs: list[Path | str], out: Path | str, diagnostics: bool = False) -> Path:
    """Accuracy and epsilon per round, one line per run (first run = this run). `diagnostics`: also read
    diagnostics.jsonl (the personalized accuracy of partial sharing is a client evaluation: not private)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_acc, ax_eps) = plt.subplots(1, 2, figsize=(10, 4))
    for run_dir in run_dirs:
        rows = read_rounds(run_dir) if diagnostics else read_metrics(run_dir)
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
    for ax in (ax_acc, ax_eps):
        if ax.get_legend_handles_labels()[0]:  # a non-private run draws no epsilon line
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return Path(out)


if __name__ == "__main__":
    args = sys.argv[1:]
    with_diagnostics = "--diagnostics" in args
    args = [a for a in args if a != "--diagnostics"]
    if args and args[0] == "--tensorboard":
        from fl_app.dashboards import write_tensorboard

        for run in args[1:]:
            print("TensorBoard events written into", write_tensorboard(run, with_diagnostics))
        sys.exit(0)
    if not args:
        sys.exit("usage: python -m fl_app.results [--diagnostics] RUN_DIR [OTHER_RUN_DIR ...]\n"
                 "       python -m fl_app.results --tensorboard [--diagnostics] RUN_DIR ...\n"
                 "--diagnostics: also show the non-private diagnostics (diagnostics.jsonl)")
    print(plot_runs(args, Path(args[0], "plot.png"), with_diagnostics))
