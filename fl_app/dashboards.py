"""TensorBoard for every run: one event file per run folder, so `tensorboard --logdir results/`
shows all runs side by side.

`TAGS` maps the round record's keys (metrics.jsonl) to TensorBoard tags, in one table.
`dp/` and `client/` scalars are diagnostics computed from raw client data, outside the DP guarantee;
a text note in every run says so. `python -m fl_app.results --tensorboard RUN...` writes the events
of older run folders from their metrics.jsonl.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

TAGS = {
    "accuracy": "eval/accuracy",
    "loss": "eval/loss",
    "personalized_accuracy": "eval/personalized_accuracy",
    "personalized_loss": "eval/personalized_loss",
    "epsilon": "privacy/epsilon",
    "epsilon_against_server": "privacy/epsilon_against_server",
    "epsilon_claimed": "privacy/epsilon_claimed_by_paper",
    "claimed_epsilon": "privacy/epsilon_claimed_by_paper",
    "epsilon_min": "privacy/epsilon_min_client",
    "tau": "ali_dpfl/tau",
    "tau_star": "ali_dpfl/tau_star",
    "mu": "ali_dpfl/mu",
    "clipped_fraction": "dp/clipped_fraction",
    "update_norm_mean": "dp/update_norm_mean",
    "update_norm_std": "dp/update_norm_std",
    "server_noise_std": "dp/server_noise_std",
    "train_loss": "dp/train_loss",
    "clients": "dp/clients",
    "rejected": "dp/rejected",
    "failures": "dp/failures",
    "upload_bytes": "topk/upload_bytes",
    "dense_bytes": "topk/dense_bytes",
    "seconds": "time/round_seconds",
}
DIAGNOSTICS_NOTE = ("Scalars under dp/ and client/ (counts, update norms, clipped fraction, training loss, client "
                    "evaluation) are computed from raw client data and released without noise: they are NOT covered "
                    "by the DP guarantee. privacy/epsilon is the ledger's figure.")


def scalars(record: dict) -> dict[str, float]:
    """{tag: value} of a round record's finite numbers (client_* keys under client/, per-client epsilon
    under privacy/epsilon_client/)."""
    out = {}
    for key, value in record.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            continue
        if key in TAGS:
            out[TAGS[key]] = float(value)
        elif key.startswith("client_"):
            out[f"client/{key[len('client_'):]}"] = float(value)
    for client, eps in (record.get("epsilon_per_client") or {}).items():
        if isinstance(eps, (int, float)) and math.isfinite(eps):
            out[f"privacy/epsilon_client/{client}"] = float(eps)
    return out


class TensorBoardWriter:
    """Writes a run's round records as TensorBoard scalars into `run_dir` (events.out.tfevents.*)."""

    def __init__(self, run_dir: Path | str, cfg: dict | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter  # the tensorboard package writes the files

        self.writer = SummaryWriter(log_dir=str(run_dir))
        self.writer.add_text("notes/diagnostics", DIAGNOSTICS_NOTE, 0)
        if cfg is not None:
            self.writer.add_text("config", "    " + json.dumps(cfg, indent=2, sort_keys=True, default=str)
                                 .replace("\n", "\n    "), 0)

    def on_round(self, record: dict) -> None:
        for tag, value in scalars(record).items():
            self.writer.add_scalar(tag, value, int(record["round"]))
        self.writer.flush()

    def on_finish(self, summary: dict) -> None:
        audit = summary.get("audit") or {}
        if audit.get("epsilon_estimate") is not None and summary.get("rounds_completed"):
            self.writer.add_scalar("privacy/audit_epsilon_estimate", float(audit["epsilon_estimate"]),
                                   int(summary["rounds_completed"]))
        self.writer.close()


def write_tensorboard(run_dir: Path | str) -> Path:
    """TensorBoard events for an existing run folder, from its metrics.jsonl, config.json and summary.json."""
    from fl_app.results import read_metrics

    run_dir = Path(run_dir)
    config = run_dir / "config.json"
    writer = TensorBoardWriter(run_dir, json.loads(config.read_text()) if config.exists() else None)
    for record in read_metrics(run_dir):
        writer.on_round(record)
    summary = run_dir / "summary.json"
    writer.on_finish(json.loads(summary.read_text()) if summary.exists() else {})
    return run_dir
