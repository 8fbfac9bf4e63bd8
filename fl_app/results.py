"""The run directory: config.json, status.json, metrics.jsonl, checkpoint.npz, summary.json, plot.png.

Non-finite numbers (epsilon of a non-private run is inf) are written as null.
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


RESUMABLE_KEYS = ("resume", "num-rounds")  # what may change between a run and its resumption


class RunDirectory:
    """Writes one run's files as the run goes; nothing already written is lost on a crash.

    Files: config.json, status.json (running / completed / failed), metrics.jsonl (one line per
    round), checkpoint.npz (after every round: the global arrays and the strategy's whole state,
    the ledger included, replaced atomically), summary.json and plot.png at the end.

    A folder that holds a previous run is refused unless `resume`: then the checkpoint is read
    (`checkpoint`), the config must match the previous one (but for RESUMABLE_KEYS), and
    metrics.jsonl is rewritten from the checkpoint's history, so no round appears twice.
    """

    def __init__(self, path: Path | str, *, resume: bool = False) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.metrics_file = self.path / "metrics.jsonl"
        self.checkpoint_file = self.path / "checkpoint.npz"
        self.checkpoint = self.read_checkpoint()
        previous_rounds = len(read_metrics(self.path)) if self.metrics_file.exists() else 0
        if not resume and (self.checkpoint is not None or previous_rounds):
            raise PreviousRunError(
                f"results-dir {self.path} holds a previous run ({previous_rounds} rounds in metrics.jsonl"
                f"{', a checkpoint' if self.checkpoint is not None else ''}): set resume = true to continue it, "
                "or choose another results-dir or run-name")
        history = self.checkpoint[0]["history"] if self.checkpoint is not None else []
        self.metrics_file.write_text("".join(json.dumps(json_safe(r), sort_keys=True) + "\n" for r in history))

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

    def append_round(self, record: dict) -> None:
        with self.metrics_file.open("a") as f:
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

    def write_summary(self, summary: dict) -> None:
        self._write_json("summary.json", summary)


def run_label(summary: dict) -> str:
    """The run's label in plots: its algorithm's (fl_app.algorithms), or the strategy's name."""
    from fl_app.algorithms import ALGORITHMS

    name = summary.get("strategy")
    label = ALGORITHMS[name].run_label(summary) if name in ALGORITHMS else str(name)
    return label if summary.get("epsilon_is_guarantee", True) else f"{label} (epsilon: no guarantee)"


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
    if len(sys.argv) >= 2 and sys.argv[1] == "--tensorboard":
        from fl_app.dashboards import write_tensorboard

        for run in sys.argv[2:]:
            print("TensorBoard events written into", write_tensorboard(run))
        sys.exit(0)
    if len(sys.argv) < 2:
        sys.exit("usage: python -m fl_app.results RUN_DIR [OTHER_RUN_DIR ...]\n"
                 "       python -m fl_app.results --tensorboard RUN_DIR ...")
    print(plot_runs(sys.argv[1:], Path(sys.argv[1], "plot.png")))
