"""ServerApp: run config -> strategy -> rounds -> run directory (the grid it talks through: `fl_app.transport`)."""

from __future__ import annotations

import time
from logging import ERROR, INFO, WARNING

import numpy as np
import torch
from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.common import log
from flwr.serverapp import Grid, ServerApp

from dpfl.dpcore.privacy import figures
from dpfl.dpcore.privacy.modes import PrivacyUnit
from dpfl.dpcore.task.catalogue import dataset_info
from dpfl.dpcore.task.data import load_dataset
from dpfl.dpcore.task.device import resolve_device
from dpfl.dpcore.task.models import build_model, count_parameters, split_state_keys
from dpfl.dpcore.task.partitions import load_validation
from dpfl.dpcore.task.threads import limit_blas_threads
from dpfl.dpcore.task.torch_helpers import evaluate_model, get_weights, loss_gradient, opacus_compatible, set_weights
from dpfl.fl_app import speed_patches
from dpfl.fl_app.algorithms import Algorithm, algorithm
from dpfl.fl_app.builders import load_client_partition
from dpfl.fl_app.config import validate
from dpfl.fl_app.dashboards import open_dashboards
from dpfl.fl_app.results import (
    INTERRUPTED_NOTE,
    RunDirectory,
    plot_runs,
    resolve_run_dir,
    unreadable_checkpoint_error,
)
from dpfl.fl_app.settings import Settings
from dpfl.fl_app.transport import PromptGrid, is_simulation, wait_for_nodes
from dpfl.strategies.legacy.secagg import DPSecAggPlusWorkflow, SecAggPlusDPFedAvg
from dpfl.strategies.loop.log_line import DIAGNOSTICS_MARK, format_record
from dpfl.strategies.loop.node_cohorts import NodeCohortGrid
from dpfl.strategies.loop.options import ServerData
from dpfl.strategies.loop.round_loop import DPRoundLoop
from dpfl.strategies.loop.run_record import split_record

app = ServerApp()


MU_SAMPLES = 256  # ali-dpfl, mu-source = server: gradients on this many held-out server samples


def mu_split(testset, validation):
    """(the set the server evaluates on, the set ALI-DPFL's server-side mu is estimated on): the validation set
    (held out of the training data) when validation-fraction > 0, else the first MU_SAMPLES of the test set,
    which evaluation then leaves out; never data the reported accuracy is measured on (mu steers training)."""
    if validation is not None:
        return testset, validation
    held = min(MU_SAMPLES, len(testset) // 2)
    return testset.subset(np.arange(held, len(testset))), testset.subset(np.arange(held))


def build_strategy(
    s: Settings, algo: Algorithm, on_round_end=None, gradient_fn=None, on_checkpoint=None
) -> DPRoundLoop | SecAggPlusDPFedAvg:
    """The server strategy of the run's algorithm (`algo`, its registry record); under secure-aggregation the
    same strategy run through Flower's SecAgg+ workflow."""
    hooks = {"on_round_end": on_round_end, "on_checkpoint": on_checkpoint}
    if algo.privacy_unit == PrivacyUnit.SAMPLE:
        hooks.update(server_data=ServerData(gradient_fn, partition_size_fn(s)))
    strategy = algo.build_strategy(s, **hooks)
    if s.secagg.enabled:
        return SecAggPlusDPFedAvg(
            strategy, workflow=DPSecAggPlusWorkflow(s.secagg.num_shares, s.secagg.reconstruction_threshold)
        )
    return strategy


def partition_size_fn(s: Settings):
    """(partition id, number of partitions) -> |D_i|: the public partition sizes, computed on the server
    from the same data and partitioner as the clients (ALI-DPFL's averaging weights)."""

    def size(partition_id: int, num_partitions: int) -> int:
        trainset, _ = load_client_partition(s, partition_id, num_partitions)
        return len(trainset)

    return size


def build_global_model(s: Settings, algo: Algorithm) -> torch.nn.Module:
    info = dataset_info(s.data.dataset)
    model = build_model(s.training.model, info["input_shape"], info["num_classes"], seed=s.run.seed)
    return opacus_compatible(model) if algo.opacus_model else model


def shared_weights(model: torch.nn.Module, s: Settings, algo: Algorithm) -> list:
    """What the server holds and broadcasts: the body under partial sharing, else the whole model."""
    if not algo.shares_body_only:
        return get_weights(model)
    body_keys, _ = split_state_keys(model, s.personalization.head_prefix)
    state = model.state_dict()
    return [state[k].detach().cpu().numpy().copy() for k in body_keys]


def run_federated(grid: Grid, s: Settings, flower_run_id: int | None = None) -> dict:
    """Train with the run's settings `s` on `grid`; write the run directory; return the summary.
    `flower_run_id` (the ServerApp's Context.run_id) groups the run's W&B runs.

    With `resume`, continue the run in the results folder from its last checkpoint: the global
    arrays, the history and the ledger as they were after the last completed round.
    """
    t0 = time.perf_counter()
    algo = algorithm(s.run.algorithm)  # the run's registry record, resolved once and passed down
    limit_blas_threads()
    run_dir = RunDirectory(resolve_run_dir(s), resume=s.output.resume)
    run_dir.write_config(s)
    dashboards = open_dashboards(run_dir.path, s, flower_run_id)  # e.g. wandb missing: fails before "running"
    if run_dir.resumed_status == "interrupted":
        log(WARNING, "Resuming an interrupted run in %s: %s", run_dir.path, INTERRUPTED_NOTE.split(":")[0])
    run_dir.write_status("running")
    log(INFO, "Results go to %s", run_dir.path)
    if not s.privacy.secure_rng:
        log(
            WARNING,
            "secure-rng = false: DP noise and client sampling are derived from 'seed' (reproducible); "
            "anyone who knows the seed can remove the noise, so the epsilon printed is NOT a guarantee",
        )
    model = build_global_model(s, algo).to(resolve_device(s.training.device))  # evaluated on the run's device
    evaluate_fn, gradient_fn = server_functions(model, s, algo)

    def on_round_end(published: dict, diagnostics: dict) -> None:
        run_dir.append_round(published, diagnostics)
        for dashboard in dashboards:
            dashboard.on_round(published, diagnostics)

    strategy = build_strategy(
        s, algo, on_round_end=on_round_end, gradient_fn=gradient_fn, on_checkpoint=run_dir.write_checkpoint
    )
    initial, resumed_from = ArrayRecord(shared_weights(model, s, algo)), 0
    if run_dir.checkpoint is not None:
        state, arrays = run_dir.checkpoint
        try:
            strategy.load_state_dict(state)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            run_dir.close()
            raise unreadable_checkpoint_error(
                run_dir.checkpoint_file, f"its state does not fit this run ({type(exc).__name__}: {exc})"
            ) from None
        initial, resumed_from = ArrayRecord(arrays), strategy.record.completed_rounds
        run_dir.rewrite_rounds([split_record(strategy, record) for record in strategy.record.history])
    if s.federation.num_clients:  # SuperNodes hosting several clients: one node per client to the strategy
        grid = NodeCohortGrid(grid)
    try:
        result = strategy.start(
            grid,
            initial,
            num_rounds=s.run.num_rounds,
            timeout=s.federation.round_timeout,
            evaluate_fn=evaluate_fn,
            eval_every=s.run.eval_every,
        )
    except BaseException as exc:
        run_dir.write_status("failed", error=f"{type(exc).__name__}: {exc}", completed_rounds=run_dir.saved_rounds)
        raise
    server_eval = result.evaluate_metrics_serverapp
    final = (
        server_eval[max(server_eval)]
        if server_eval
        else (strategy.record.history[-1] if strategy.record.history else {})
    )
    summary = {
        "strategy": s.run.algorithm,
        "dataset": s.data.dataset,
        "model": s.training.model,
        "num_parameters": count_parameters(model),
        "rounds_completed": len(strategy.record.history),
        "resumed_after_round": resumed_from or None,
        "final_accuracy": final.get("accuracy"),  # global model, server test set (null under partial sharing)
        "final_loss": final.get("loss"),
        "results_dir": str(run_dir.path),
        **strategy.describe(),
    }
    diagnostics = {
        "not_private": DIAGNOSTICS_NOTICE,
        "seconds": time.perf_counter() - t0,
        **strategy.describe_diagnostics(),
    }
    return finish_run(
        run_dir, dashboards, summary, diagnostics, run_failure(strategy.record.history), s.output.publish_diagnostics
    )


def server_functions(model: torch.nn.Module, s: Settings, algo: Algorithm):
    """(evaluate_fn, gradient_fn) of the server: the global model on the server's test set (and validation set,
    held out of the training data), None under partial sharing (the server holds no head); ALI-DPFL's gradient
    on held-out server data (`mu_split`: never the evaluation data)."""
    _, testset = load_dataset(s.data.dataset, s.data.data_dir)
    validation = load_validation(s.data.dataset, s.data.data_dir, s.data.validation_fraction)
    mu_set = None
    if algo.privacy_unit == PrivacyUnit.SAMPLE and s.dpsgd.mu_source == "server":
        testset, mu_set = mu_split(testset, validation)

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        set_weights(model, arrays.to_numpy_ndarrays())
        loss, accuracy = evaluate_model(model, testset)
        metrics = {"accuracy": accuracy, "loss": loss}
        if validation is not None:
            metrics["val_loss"], metrics["val_accuracy"] = evaluate_model(model, validation)
        return MetricRecord(metrics)

    def gradient_fn(arrays: list) -> np.ndarray:
        set_weights(model, arrays)
        return loss_gradient(model, mu_set, MU_SAMPLES)

    return (None if algo.shares_body_only else evaluate_fn), gradient_fn


def finish_run(
    run_dir: RunDirectory,
    dashboards: list,
    summary: dict,
    diagnostics: dict,
    failure: str | None,
    publish_diagnostics: bool,
) -> dict:
    """summary.json and diagnostics-summary.json, the dashboards' last entries, status.json (completed, or failed
    with the reason), the plot and the last log lines; the summary, with its status."""
    summary = {
        "status": "failed" if failure else "completed",
        **({"failure_reason": failure} if failure else {}),
        **summary,
    }
    run_dir.write_summary(summary, diagnostics)
    for dashboard in dashboards:
        dashboard.on_finish(summary)
    if failure:
        run_dir.write_status("failed", reason=failure, rounds_completed=summary["rounds_completed"])
    else:
        run_dir.write_status("completed", rounds_completed=summary["rounds_completed"])
    plot_runs([run_dir.path], run_dir.path / "plot.png", publish_diagnostics)
    log_finish(summary, diagnostics, publish_diagnostics, run_dir.path)
    if failure:
        log(ERROR, "The run failed: %s (no client trained the model; see %s/diagnostics.jsonl)", failure, run_dir.path)
    return summary


NO_UPDATE_AGGREGATED = "no client update was aggregated in any round"


def run_failure(history: list[dict]) -> str | None:
    """Why a finished run failed (status 'failed', the launcher exits non-zero), or None: no round (a resumed run's
    included) aggregated an accepted client update (every client failed or was rejected, or no round ran)."""
    if not any(int(record.get("clients", 0)) > 0 for record in history):
        return NO_UPDATE_AGGREGATED
    return None


DIAGNOSTICS_NOTICE = (
    "computed from raw client replies without noise: NOT covered by the run's epsilon; do not "
    "publish (diagnostics.jsonl has them per round)"
)


SUMMARY_LOG_KEYS = figures.finish_line_names()  # summary.json's figures on the `Finished:` line
DIAGNOSTIC_SUMMARY_LOG_KEYS = figures.finish_line_names(published=False)  # diagnostics-summary.json's, after them


def log_finish(summary: dict, diagnostics: dict, publish_diagnostics: bool, run_dir) -> None:
    """The run's last lines: `Finished:` with summary.json's figures (what the ledger covers) as `key=value`
    (strategies.loop.log_line.parse_log_line reads it), the audit, where the files and the diagnostics are."""
    line = format_record(summary, SUMMARY_LOG_KEYS)
    if publish_diagnostics and format_record(diagnostics, DIAGNOSTIC_SUMMARY_LOG_KEYS):
        line += DIAGNOSTICS_MARK + format_record(diagnostics, DIAGNOSTIC_SUMMARY_LOG_KEYS)
    log(INFO, "Finished: %s", line)
    if not summary["epsilon_is_guarantee"]:
        log(WARNING, "The epsilon above is NOT a guarantee: %s", "; ".join(summary["epsilon_caveats"]))
    if summary.get("epsilon_against_server_is_guarantee") is False:
        log(
            WARNING,
            "epsilon_against_server is NOT a guarantee: %s",
            "; ".join(summary["epsilon_against_server_caveats"]),
        )
    if summary.get("audit"):
        log(
            INFO,
            "Canary audit: empirical epsilon %.4g (one-shot estimate, %d canaries) beside the accounted %.4g",
            summary["audit"]["epsilon_estimate"],
            summary["audit"]["canaries_inserted"],
            summary["epsilon"],
        )
    if diagnostics.get("rounds_with_failed_or_rejected_replies"):
        log(WARNING, "Some client replies failed or were rejected: see %s/diagnostics.jsonl ('problems')", run_dir)
    log(
        INFO,
        "Results in %s; non-private diagnostics (counts, norms, losses, client evaluation; not covered by "
        "epsilon): diagnostics.jsonl",
        run_dir,
    )


@app.main()
def main(grid: Grid, context: Context) -> None:
    settings = validate(context.run_config)
    federation = settings.federation
    pulls_end_by = None
    if (
        federation.flower_speed_patches
    ):  # opt-in: patches of Flower internals (dpfl_tools.pull_backoff), version-checked
        pull_backoff = speed_patches("pull_backoff")
        log(INFO, pull_backoff.apply_server_patches())
        pulls_end_by = pull_backoff.object_pulls_end_by
    wait_for_nodes(grid, federation.min_nodes, federation.node_wait_timeout, simulation=is_simulation(grid))
    run_federated(PromptGrid(grid, pulls_end_by=pulls_end_by), settings, context.run_id)
