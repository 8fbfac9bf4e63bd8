"""TensorBoard for every run: one event file per run folder, so `tensorboard --logdir results/`
shows all runs side by side.

`TAGS` maps the published round record's keys (metrics.jsonl: what the ledger covers) to TensorBoard
tags, in one table. The non-private diagnostics (diagnostics.jsonl: counts, update norms, clipped
fraction, losses, client evaluation) appear under `nonprivate/` only when the run publishes them
(`publish-diagnostics = true`), with a text note that epsilon does not cover them.
`python -m fl_app.results --tensorboard RUN...` writes the events of older run folders.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

TAGS = {
    "accuracy": "eval/accuracy",
    "loss": "eval/loss",
    "epsilon": "privacy/epsilon",
    "epsilon_against_server": "privacy/epsilon_against_server",
    "epsilon_claimed": "privacy/epsilon_claimed_by_paper",
    "claimed_epsilon": "privacy/epsilon_claimed_by_paper",
    "epsilon_min": "privacy/epsilon_min_client",
    "tau": "ali_dpfl/tau",
    "tau_star": "ali_dpfl/tau_star",
    "mu": "ali_dpfl/mu",
    "upload_bytes_per_client": "topk/upload_bytes_per_client",
    "dense_bytes_per_client": "topk/dense_bytes_per_client",
}
NONPRIVATE_PREFIX = "nonprivate/"
DIAGNOSTICS_NOTE = ("Scalars under nonprivate/ (counts, update norms, clipped fraction, losses, client evaluation, "
                    "bytes, timing) are computed from raw client replies and released without noise: they are NOT "
                    "covered by the DP guarantee. privacy/epsilon is the ledger's figure.")


def scalars(record: dict) -> dict[str, float]:
    """{tag: value} of a published round record's finite numbers (per-client epsilon under
    privacy/epsilon_client/)."""
    out = {TAGS[k]: float(v) for k, v in record.items() if k in TAGS and finite_number(v)}
    for client, eps in (record.get("epsilon_per_client") or {}).items():
        if finite_number(eps):
            out[f"privacy/epsilon_client/{client}"] = float(eps)
    return out


def diagnostic_scalars(diagnostics: dict) -> dict[str, float]:
    """{nonprivate/<key>: value} of a diagnostics record's finite numbers."""
    return {NONPRIVATE_PREFIX + k: float(v) for k, v in diagnostics.items() if k != "round" and finite_number(v)}


def finite_number(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


class TensorBoardWriter:
    """Writes a run's round records as TensorBoard scalars into `run_dir` (events.out.tfevents.*);
    the diagnostics too when `publish_diagnostics`."""

    def __init__(self, run_dir: Path | str, cfg: dict | None = None, publish_diagnostics: bool = False) -> None:
        from torch.utils.tensorboard import SummaryWriter  # the tensorboard package writes the files

        self.writer = SummaryWriter(log_dir=str(run_dir))
        self.publish_diagnostics = publish_diagnostics
        if publish_diagnostics:
            self.writer.add_text("notes/diagnostics", DIAGNOSTICS_NOTE, 0)
        if cfg is not None:
            self.writer.add_text("config", "    " + json.dumps(cfg, indent=2, sort_keys=True, default=str)
                                 .replace("\n", "\n    "), 0)

    def on_round(self, published: dict, diagnostics: dict | None = None) -> None:
        values = scalars(published)
        if self.publish_diagnostics and diagnostics:
            values.update(diagnostic_scalars(diagnostics))
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, int(published["round"]))
        self.writer.flush()

    def on_finish(self, summary: dict) -> None:
        audit = summary.get("audit") or {}
        if audit.get("epsilon_estimate") is not None and summary.get("rounds_completed"):
            self.writer.add_scalar("privacy/audit_epsilon_estimate", float(audit["epsilon_estimate"]),
                                   int(summary["rounds_completed"]))
        self.writer.close()


def write_tensorboard(run_dir: Path | str, publish_diagnostics: bool = False) -> Path:
    """TensorBoard events for an existing run folder, from its metrics.jsonl (and diagnostics.jsonl),
    config.json and summary.json."""
    from fl_app.results import read_diagnostics, read_metrics

    run_dir = Path(run_dir)
    config = run_dir / "config.json"
    writer = TensorBoardWriter(run_dir, json.loads(config.read_text()) if config.exists() else None,
                               publish_diagnostics)
    diagnostics = {r["round"]: r for r in read_diagnostics(run_dir)}
    for record in read_metrics(run_dir):
        writer.on_round(record, diagnostics.get(record["round"]))
    summary = run_dir / "summary.json"
    writer.on_finish(json.loads(summary.read_text()) if summary.exists() else {})
    return run_dir
