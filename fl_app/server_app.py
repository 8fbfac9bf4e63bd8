"""ServerApp: run config -> strategy -> rounds -> run directory."""

from __future__ import annotations

import time
from logging import INFO, WARNING

import numpy as np
import torch
from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.supercore import log

from clients.base import evaluate_model, get_weights, set_weights
from clients.dpsgd import loss_gradient, opacus_compatible
from fl_app.config import validate
from fl_app.data import dataset_info, load_dataset
from fl_app.models import build_model, count_parameters
from fl_app.results import RunDirectory, plot_runs, resolve_run_dir
from strategies.ali_dpfl import ALIDPFL
from strategies.dp_fedavg import DPFedAvg

app = ServerApp()


MU_SAMPLES = 256  # ali-dpfl, mu-source = server: gradients on this many server evaluation samples


def build_strategy(cfg: dict, on_round_end=None, gradient_fn=None) -> DPFedAvg:
    """The server strategy for cfg['algorithm'] (DP-FedAvg and DP-FedSAM share the server)."""
    if cfg["algorithm"] == "ali-dpfl":
        return ALIDPFL(
            sample_rate=cfg["sample-rate"], client_sampling=cfg["client-sampling"],
            batch_sample_rate=cfg["batch-sample-rate"], sample_noise_multiplier=cfg["sample-noise-multiplier"],
            sample_clipping_norm=cfg["sample-clipping-norm"], target_epsilon=cfg["target-epsilon"],
            delta=cfg["delta"], accountant=cfg["accountant"], adaptive=cfg["adaptive"],
            local_steps=cfg["local-steps"], gamma=cfg["gamma"], mu_source=cfg["mu-source"],
            mu_noise_multiplier=cfg["mu-noise-multiplier"], gradient_fn=gradient_fn,
            dpsgd_noise=cfg["dpsgd-noise"], wavelet_calibration=cfg["wavelet-calibration"],
            server_learning_rate=cfg["server-lr"], seed=cfg["seed"], secure_rng=cfg["secure-rng"],
            min_available_nodes=cfg["min-nodes"], fraction_evaluate=cfg["fraction-evaluate"],
            on_round_end=on_round_end)
    return DPFedAvg(
        sample_rate=cfg["sample-rate"], clipping_norm=cfg["clipping-norm"],
        noise_multiplier=cfg["noise-multiplier"], noise_placement=cfg["noise-placement"],
        client_sampling=cfg["client-sampling"], server_learning_rate=cfg["server-lr"],
        delta=cfg["delta"], accountant=cfg["accountant"], target_epsilon=cfg["target-epsilon"],
        target_epsilon_mode=cfg["target-epsilon-mode"], seed=cfg["seed"], secure_rng=cfg["secure-rng"],
        min_available_nodes=cfg["min-nodes"], fraction_evaluate=cfg["fraction-evaluate"],
        on_round_end=on_round_end)


def build_global_model(cfg: dict) -> torch.nn.Module:
    info = dataset_info(cfg["dataset"])
    model = build_model(cfg["model"], info["input_shape"], info["num_classes"], seed=cfg["seed"])
    return opacus_compatible(model) if cfg["algorithm"] == "ali-dpfl" else model


def run_federated(grid: Grid, cfg: dict) -> dict:
    """Train with the validated config `cfg` on `grid`; write the run directory; return the summary."""
    t0 = time.perf_counter()
    run_dir = RunDirectory(resolve_run_dir(cfg))
    run_dir.write_config(cfg)
    log(INFO, "Results go to %s", run_dir.path)
    if not cfg["secure-rng"] and cfg["noise-multiplier"] > 0:
        log(WARNING, "DP noise is seeded from 'seed' for reproducibility: keep the seed secret, or set "
                     "secure-rng = true for deployments")
    model = build_global_model(cfg)
    _, server_testset = load_dataset(cfg["dataset"], cfg["data-dir"])

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        set_weights(model, arrays.to_numpy_ndarrays())
        loss, accuracy = evaluate_model(model, server_testset)
        return MetricRecord({"accuracy": accuracy, "loss": loss})

    def gradient_fn(arrays: list) -> np.ndarray:  # ali-dpfl's mu on server data (no client data, no privacy cost)
        set_weights(model, arrays)
        return loss_gradient(model, server_testset, MU_SAMPLES)

    strategy = build_strategy(cfg, on_round_end=run_dir.append_round, gradient_fn=gradient_fn)
    result = strategy.start(grid, ArrayRecord(get_weights(model)), num_rounds=cfg["num-rounds"],
                            evaluate_fn=evaluate_fn)
    final = result.evaluate_metrics_serverapp[max(result.evaluate_metrics_serverapp)]
    summary = {
        "strategy": cfg["algorithm"],
        "dataset": cfg["dataset"],
        "model": cfg["model"],
        "num_parameters": count_parameters(model),
        "rounds_completed": len(strategy.history),
        "final_accuracy": final["accuracy"],
        "final_loss": final["loss"],
        "seconds": time.perf_counter() - t0,
        "results_dir": str(run_dir.path),
        **strategy.describe(),
    }
    run_dir.write_summary(summary)
    plot_runs([run_dir.path], run_dir.path / "plot.png")
    log(INFO, "Finished: accuracy %.4f, epsilon %.4g (delta %.3g) after %d rounds; results in %s",
        summary["final_accuracy"], summary["epsilon"], summary["delta"], summary["rounds_completed"],
        run_dir.path)
    return summary


@app.main()
def main(grid: Grid, context: Context) -> None:
    run_federated(grid, validate(context.run_config))
