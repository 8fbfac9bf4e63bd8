"""Our adaptive clipping against Flower's `DifferentialPrivacyServerSideAdaptiveClipping(FedAvg)`, same job, in one
process (docs/dp-toolbox.md §3).

    python -m benchmarks.adaptive_clipping_vs_flower [--clients 20] [--rounds 10] [--repeats 2]

Both: `InProcessGrid`, the same clients (our `TrainingClient`'s local SGD), partitions, model, C_0, sigma, sigma_b,
target quantile, eta_C and seeds, q = 1 (every client every round: Flower's FedAvg samples exactly fraction_train N),
central noise (the server clips). Flower: the wrapper around FedAvg, clients reply with their new weights; ours:
`algorithm = dp-fedavg`, `noise-placement = central`, `adaptive-clipping = true` through the real ServerApp and
ClientApp code. Reported: final accuracy (the server's test set), seconds per round (median over rounds and repeats,
after a warm-up pair), the final clipping norm, and our ledger's epsilon (Flower's wrapper prints none).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import numpy as np
import torch
from flwr.serverapp.strategy import DifferentialPrivacyServerSideAdaptiveClipping, FedAvg

from dpfl.fl_app.client_app import app as our_client_app
from dpfl.fl_app.config import validate
from dpfl.fl_app.results import read_metrics, read_rounds
from dpfl.fl_app.server_app import run_federated
from dpfl.fl_app.settings import Settings
from dpfl_tools.inprocess import InProcessGrid

from .flower_side import timed_run, weights_client_app

JOB = {
    "algorithm": "dp-fedavg",
    "dataset": "digits",
    "model": "mlp",
    "partitioner": "iid",
    "local-steps": 5,
    "batch-size": 16,
    "sample-rate": 1.0,
    "noise-placement": "central",
    "clipping-norm": 0.1,
    "noise-multiplier": 1.0,
    "adaptive-clipping": True,
    "target-quantile": 0.5,
    "clip-learning-rate": 0.2,
    "clip-count-noise-multiplier": 2.0,
    "delta": 1e-5,
    "secure-rng": False,
    "seed": 7,
    "tensorboard": False,
}


def flower_run(cfg: Settings, clients: int) -> dict:
    np.random.seed(cfg.run.seed)  # Flower draws its noise from numpy's global generator
    strategy = DifferentialPrivacyServerSideAdaptiveClipping(
        FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=clients, min_available_nodes=clients),
        noise_multiplier=cfg.privacy.noise_multiplier,
        num_sampled_clients=clients,
        initial_clipping_norm=cfg.privacy.clipping_norm,
        target_clipped_quantile=cfg.adaptive_clipping.target_quantile,
        clip_norm_lr=cfg.adaptive_clipping.learning_rate,
        clipped_count_stddev=cfg.adaptive_clipping.count_noise_multiplier,
    )
    seconds, accuracies = timed_run(strategy, cfg, clients, weights_client_app())  # the wrapper clips
    return {"seconds": seconds, "accuracy": accuracies[-1], "clipping_norm": strategy.clipping_norm, "epsilon": None}


def our_run(cfg: Settings, clients: int) -> dict:
    summary = run_federated(InProcessGrid(our_client_app, clients, cfg), cfg)
    rounds = read_metrics(summary["results_dir"])
    return {
        "seconds": [r["seconds"] for r in read_rounds(summary["results_dir"])],
        "accuracy": summary["final_accuracy"],
        "clipping_norm": rounds[-1]["clipping_norm_next"],
        "epsilon": summary["epsilon"],
    }


def compare(clients: int, rounds: int, repeats: int) -> dict:
    seconds: dict[str, list[float]] = {"flower": [], "ours": []}
    accuracy: dict[str, list[float]] = {"flower": [], "ours": []}
    last: dict[str, dict] = {}
    for repeat in range(repeats + 1):  # the first pair pays one-time costs
        for name, run in (("flower", flower_run), ("ours", our_run)):
            with tempfile.TemporaryDirectory() as tmp:
                cfg = validate(
                    {
                        **JOB,
                        "num-rounds": rounds,
                        "min-nodes": clients,
                        "results-dir": tmp,
                        "seed": JOB["seed"] + repeat,
                    }
                )
                out = run(cfg, clients)
            if repeat:
                seconds[name] += out["seconds"]
                accuracy[name].append(out["accuracy"])
            last[name] = out
    return {
        name: {
            "s_per_round": statistics.median(seconds[name]),
            "accuracy": accuracy[name],
            "clipping_norm": last[name]["clipping_norm"],
            "epsilon": last[name]["epsilon"],
        }
        for name in seconds
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for name, r in compare(args.clients, args.rounds, args.repeats).items():
        eps = "none printed" if r["epsilon"] is None else f"{r['epsilon']:.3f}"
        print(
            f"{name:6}  s/round {r['s_per_round']:.3f}  accuracy {', '.join(f'{a:.3f}' for a in r['accuracy'])}  "
            f"final C {r['clipping_norm']:.4f}  epsilon {eps}"
        )


if __name__ == "__main__":
    main()
