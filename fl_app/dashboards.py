"""TensorBoard for every run: one event file per run folder, so `tensorboard --logdir results/`
shows all runs side by side.

`TAGS` maps the published round record's keys (metrics.jsonl: what the ledger covers) to TensorBoard
tags, drawn from the one table of figures (dpcore/privacy/figures.py). The non-private diagnostics
(diagnostics.jsonl: counts, update norms, clipped fraction, losses, client evaluation) appear under
`nonprivate/` only when the run publishes them (`publish-diagnostics = true`), with a text note that
epsilon does not cover them.
`python -m dpfl.fl_app.results --tensorboard RUN...` writes the events of older run folders.

Weights & Biases (`wandb = true`, the `wandb` extra) logs the same scalars under the same names (`WandbWriter`),
offline by default: into <run folder>/wandb/, with no account and no network (`wandb sync` uploads it later).
Only the ServerApp writes dashboards; wandb is imported when a W&B run starts, never by a ClientApp.
"""

from __future__ import annotations

import json
import math
import os
from logging import INFO
from pathlib import Path
from typing import TYPE_CHECKING

from flwr.common import log

from dpfl.dpcore.privacy import figures
from dpfl.fl_app.run_files import read_diagnostics, read_metrics

if TYPE_CHECKING:
    from dpfl.fl_app.settings import Settings

TAGS = figures.dashboard_tags()  # {published key: tag}, from the one table of figures
NONPRIVATE_PREFIX = "nonprivate/"
DIAGNOSTICS_NOTE = (
    "Scalars under nonprivate/ (counts, update norms, clipped fraction, losses, client evaluation, "
    "bytes, timing) are computed from raw client replies and released without noise: they are NOT "
    "covered by the DP guarantee. privacy/epsilon is the ledger's figure."
)


def scalars(record: dict) -> dict[str, float]:
    """{tag: value} of a published round record's finite numbers, and of its dicts of numbers one scalar per
    entry under <tag>/<entry> (ALI-DPFL's per-client epsilon under privacy/epsilon_client/)."""
    out = {tag_of(k, record): float(v) for k, v in record.items() if k in TAGS and finite_number(v)}
    for key, values in record.items():
        if key in TAGS and isinstance(values, dict):
            out.update({f"{TAGS[key]}/{entry}": float(v) for entry, v in values.items() if finite_number(v)})
    return out


NOT_A_GUARANTEE = "_NOT_a_guarantee"  # appended to the tag of a figure its round record marks as no guarantee
GUARANTEE_MARKS = figures.guarantee_marks()  # {figure: the key that is False when it is no guarantee}


def tag_of(key: str, record: dict) -> str:
    """The dashboard tag of a published key: TAGS', with NOT_A_GUARANTEE when the round says the figure is none."""
    mark = GUARANTEE_MARKS.get(key)
    return TAGS[key] + (NOT_A_GUARANTEE if mark and record.get(mark) is False else "")


def diagnostic_scalars(diagnostics: dict) -> dict[str, float]:
    """{nonprivate/<key>: value} of a diagnostics record's finite numbers."""
    return {NONPRIVATE_PREFIX + k: float(v) for k, v in diagnostics.items() if k != "round" and finite_number(v)}


def finite_number(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def round_scalars(published: dict, diagnostics: dict | None, publish_diagnostics: bool) -> dict[str, float]:
    """What a dashboard shows for one round: the published record's scalars, and the diagnostics under
    nonprivate/ only when the run publishes them."""
    values = scalars(published)
    if publish_diagnostics and diagnostics:
        values.update(diagnostic_scalars(diagnostics))
    return values


def owner_only(files) -> None:
    """chmod 0600, as every other file of a run (the tensorboard package creates its event files 0644)."""
    for file in files:
        os.chmod(file, 0o600)


class TensorBoardWriter:
    """Writes a run's round records as TensorBoard scalars into `run_dir` (events.out.tfevents.*);
    the diagnostics too when `publish_diagnostics`."""

    def __init__(self, run_dir: Path | str, run_config: dict | None = None, publish_diagnostics: bool = False) -> None:
        from torch.utils.tensorboard import SummaryWriter  # the tensorboard package writes the files

        self.writer = SummaryWriter(log_dir=str(run_dir))
        owner_only(Path(self.writer.get_logdir()).glob("events.out.tfevents.*"))
        self.publish_diagnostics = publish_diagnostics
        self.wall_time = 0.0  # every event's: an event's wall_time would tell when its round ended (its timing)
        if publish_diagnostics:
            self.writer.add_text("notes/diagnostics", DIAGNOSTICS_NOTE, 0, walltime=self.wall_time)
        if run_config is not None:
            self.writer.add_text(
                "config",
                "    " + json.dumps(run_config, indent=2, sort_keys=True, default=str).replace("\n", "\n    "),
                0,
                walltime=self.wall_time,
            )

    def on_round(self, published: dict, diagnostics: dict | None = None) -> None:
        for tag, value in round_scalars(published, diagnostics, self.publish_diagnostics).items():
            self.writer.add_scalar(tag, value, int(published["round"]), walltime=self.wall_time)
        self.writer.flush()

    def on_finish(self, summary: dict) -> None:
        audit = summary.get("audit") or {}
        if audit.get("epsilon_estimate") is not None and summary.get("rounds_completed"):
            self.writer.add_scalar(
                "privacy/audit_epsilon_estimate",
                float(audit["epsilon_estimate"]),
                int(summary["rounds_completed"]),
                walltime=self.wall_time,
            )
        self.writer.close()


def wandb_location(run, mode: str) -> str:
    """Where a W&B run is, for the log: online its URL; offline its folder and the command that uploads it."""
    if mode == "online" and getattr(run, "url", None):
        return f"W&B run {run.name}: {run.url}"
    folder = Path(run.dir).parent  # run.dir is <run folder>/wandb/offline-run-<time>-<id>/files
    return f"W&B run {run.name} (offline) in {folder}; upload it with: wandb sync {folder}"


class WandbWriter:
    """A run's round records as a Weights & Biases run: the scalars of `round_scalars` (the TAGS names) at
    step = round, the resolved config, and summary.json's numbers as the W&B summary.

    mode "offline" (the default) writes <run_dir>/wandb/offline-run-*/run-*.wandb and needs no account or
    network; "online" streams to the W&B server (`wandb login` first). Runs are grouped by `group` (the
    ServerApp passes the Flower run id), else by the run folder's name. Console capture, system metrics, host
    and git metadata are off: the W&B run holds what the run folder publishes and nothing about the machine.
    """

    def __init__(self, run_dir: Path | str, settings: Settings, group: str | None = None) -> None:
        try:
            import wandb
        except ImportError:
            raise RuntimeError(
                "run-config key 'wandb' = true needs the wandb package: pip install 'dpfl[wandb]' (or wandb = false)"
            ) from None
        run_dir = Path(run_dir)
        output = settings.output
        self.publish_diagnostics = publish_diagnostics = output.publish_diagnostics
        wandb_settings = wandb.Settings(
            console="off",
            silent=True,
            x_disable_stats=True,
            x_disable_meta=True,
            x_disable_machine_info=True,
            x_save_requirements=False,
            disable_git=True,
            save_code=False,
            disable_job_creation=True,
        )
        self.run = wandb.init(
            mode=output.wandb_mode,
            dir=str(run_dir),
            project=output.wandb_project,
            group=group or run_dir.name,
            name=run_dir.name,
            config=settings.run_config(),
            settings=wandb_settings,
            notes=DIAGNOSTICS_NOTE if publish_diagnostics else None,
        )
        log(INFO, "%s", wandb_location(self.run, output.wandb_mode))

    def on_round(self, published: dict, diagnostics: dict | None = None) -> None:
        self.run.log(round_scalars(published, diagnostics, self.publish_diagnostics), step=int(published["round"]))

    def on_finish(self, summary: dict) -> None:
        for key, value in summary.items():
            if finite_number(value):
                self.run.summary[key] = value
        audit = summary.get("audit") or {}
        if finite_number(audit.get("epsilon_estimate")):
            self.run.summary["privacy/audit_epsilon_estimate"] = audit["epsilon_estimate"]
        self.run.finish()


def open_dashboards(run_dir: Path | str, s: Settings, flower_run_id: int | None = None) -> list:
    """The dashboards the run's settings ask for (TensorBoard, W&B), each with on_round and on_finish."""
    dashboards: list = []
    if s.output.tensorboard:
        dashboards.append(TensorBoardWriter(run_dir, s.run_config(), s.output.publish_diagnostics))
    if s.output.wandb:
        group = f"flwr-run-{flower_run_id}" if flower_run_id else None
        dashboards.append(WandbWriter(run_dir, s, group))
    return dashboards


def write_tensorboard(run_dir: Path | str, publish_diagnostics: bool = False) -> Path:
    """TensorBoard events for an existing run folder, from its metrics.jsonl (and diagnostics.jsonl),
    config.json and summary.json."""
    run_dir = Path(run_dir)
    config = run_dir / "config.json"
    writer = TensorBoardWriter(
        run_dir, json.loads(config.read_text()) if config.exists() else None, publish_diagnostics
    )
    diagnostics = {r["round"]: r for r in read_diagnostics(run_dir)}
    for record in read_metrics(run_dir):
        writer.on_round(figures.with_current_names(record), diagnostics.get(record["round"]))
    summary = run_dir / "summary.json"
    writer.on_finish(json.loads(summary.read_text()) if summary.exists() else {})
    return run_dir
