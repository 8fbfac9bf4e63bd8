"""Our DP-FedAvg against what a Flower user would build instead, side by side in one process.

    python -m benchmarks.flower_dp_baseline [--clients 50] [--rounds 4]

Flower's version: `DifferentialPrivacyClientSideFixedClipping` around `flwr.serverapp.strategy.FedAvg`
(server-side Gaussian noise with std sigma C / m on the average, Flower's `RdpAccountant`, which for
fixed clipping accepts only `no-amplification` sampling), and `fixedclipping_mod` on the ClientApp's
train function only. Ours: `algorithm = dp-fedavg` through the real ServerApp and ClientApp code with
`noise-placement = central` (the same mechanism: clients train, the update is clipped to C, the server
adds the noise). Both on `InProcessGrid`, the same clients, partitions, model, local SGD steps (our
`TrainingClient` trains in both), C, sigma and server-side evaluation every round.

Two settings: every client in every round (q = 1: identical work, the timing comparison; both
accountants charge the same Gaussian mechanism), and q = 0.5 (Flower's FedAvg samples exactly qN
clients, ours Poisson with rate q: the epsilon each prints, and seconds per client update).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import torch
from flwr.clientapp.mod import fixedclipping_mod
from flwr.serverapp import NeighboringRelation, PrivacyConfig, RdpAccountant, SamplingMethod
from flwr.serverapp.strategy import DifferentialPrivacyClientSideFixedClipping, FedAvg

from dpfl.fl_app.client_app import app as our_client_app
from dpfl.fl_app.config import validate
from dpfl.fl_app.results import read_rounds
from dpfl.fl_app.server_app import run_federated
from dpfl.fl_app.settings import Settings
from dpfl_tools.inprocess import InProcessGrid

from .flower_side import timed_run, weights_client_app

JOB = {
    "algorithm": "dp-fedavg",
    "noise-placement": "central",
    "clipping-norm": 0.5,
    "noise-multiplier": 1.0,
    "delta": 1e-5,
    "tensorboard": False,
}  # both accountants at the same delta


def flower_run(cfg: Settings, clients: int) -> tuple[list[float], list[int], float, float]:
    """(seconds per round, clients per round, epsilon, delta) of Flower's DP-FedAvg."""
    sampled = max(1, int(clients * cfg.federation.sample_rate))
    accountant = RdpAccountant(
        PrivacyConfig(
            target_delta=cfg.privacy.delta,
            population_size=clients,
            neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
            sampling_method=SamplingMethod.NO_AMPLIFICATION,
        )
    )
    strategy = DifferentialPrivacyClientSideFixedClipping(
        FedAvg(
            fraction_train=cfg.federation.sample_rate,
            fraction_evaluate=0.0,
            min_train_nodes=sampled,
            min_available_nodes=clients,
        ),
        noise_multiplier=cfg.privacy.noise_multiplier,
        clipping_norm=cfg.privacy.clipping_norm,
        num_sampled_clients=sampled,
        accountant=accountant,
    )
    # the same server evaluation as ours; fixedclipping_mod on train clips the update on the client
    seconds, accuracies = timed_run(strategy, cfg, clients, weights_client_app([fixedclipping_mod]))
    spent = strategy.privacy_spent()
    return seconds, [sampled] * len(seconds), spent.epsilon, spent.delta, accuracies[-1]


def our_run(cfg: Settings, clients: int) -> tuple[list[float], list[int], float, float, float]:
    summary = run_federated(InProcessGrid(our_client_app, clients, cfg), cfg)
    rows = read_rounds(summary["results_dir"])  # seconds and clients are diagnostics
    return (
        [r["seconds"] for r in rows],
        [r["clients"] for r in rows],
        summary["epsilon"],
        summary["delta"],
        summary["final_accuracy"],
    )


def compare(clients: int, rounds: int, sample_rate: float, repeats: int = 2) -> dict:
    """Both runs of one setting, alternated `repeats` times (the machine is shared): {"ours"|"flower":
    (median seconds per round, median seconds per client update, epsilon, delta, final accuracy)}."""
    seconds, updates, last = {"flower": [], "ours": []}, {"flower": [], "ours": []}, {}
    for repeat in range(repeats + 1):  # the first pair only pays one-time costs (lazy imports, torch kernels)
        for name, run in (("flower", flower_run), ("ours", our_run)):
            with tempfile.TemporaryDirectory() as tmp:
                cfg = validate({**JOB, "sample-rate": sample_rate, "num-rounds": rounds, "results-dir": tmp})
                per_round, counts, epsilon, delta, accuracy = run(cfg, clients)
            if repeat:
                seconds[name] += per_round
                updates[name] += [s / c for s, c in zip(per_round, counts) if c]
            last[name] = (epsilon, delta, accuracy)
    return {name: (statistics.median(seconds[name]), statistics.median(updates[name]), *last[name]) for name in seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for q in (1.0, 0.5):
        r = compare(args.clients, args.rounds, q)
        for name, (per_round, per_update, epsilon, delta, accuracy) in r.items():
            print(
                f"q={q} {name:6}  s/round {per_round:.3f}  s/update {per_update:.3f}  "
                f"epsilon {epsilon:.3f} (delta {delta:.3g})  accuracy {accuracy:.3f}"
            )
        print(
            f"q={q} ours/Flower seconds per round {r['ours'][0] / r['flower'][0]:.2f}x, "
            f"per update {r['ours'][1] / r['flower'][1]:.2f}x"
        )


if __name__ == "__main__":
    main()
