"""Our DP wrapper against Flower's `DifferentialPrivacyServerSideFixedClipping`, both around FedAvg, on the same
job in one process (the drop-in comparison a Flower user makes).

    python -m benchmarks.wrapper_vs_flower [--clients 50] [--rounds 4] [--repeats 2]

The job: the default dataset, partitions and model, every client in every round (q = 1), clients that reply
with their new weights as any Flower client does (our `TrainingClient` trains; no mod), central noise
(the server clips each update to C and adds N(0, sigma^2 C^2) to the sum), C = 0.5, sigma = 1, the same
server evaluation each round. Both on `InProcessGrid`, runs alternated (the machine is shared); the ratio is
the median of the per-round seconds of ours over Flower's. Target: at most 1.0x.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import torch
from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping, FedAvg

from dpfl.fl_app.config import validate
from dpfl.fl_app.settings import Settings
from dpfl.strategies import DifferentialPrivacy

from .flower_side import timed_run, weights_client_app

C, SIGMA = 0.5, 1.0


def strategies(clients: int) -> dict:
    return {
        "flower": lambda: DifferentialPrivacyServerSideFixedClipping(
            FedAvg(fraction_evaluate=0.0, min_available_nodes=clients),
            noise_multiplier=SIGMA,
            clipping_norm=C,
            num_sampled_clients=clients,
        ),
        "ours": lambda: DifferentialPrivacy(
            FedAvg(fraction_evaluate=0.0),
            clipping_norm=C,
            noise_multiplier=SIGMA,
            sample_rate=1.0,
            noise_placement="central",
            min_available_nodes=clients,
            delta=1e-5,
        ),
    }


def run(make, cfg: Settings, clients: int) -> tuple[list[float], float]:
    """(seconds of rounds 2.., final accuracy) of one run; clients reply with weights, unmodified."""
    seconds, accuracies = timed_run(make(), cfg, clients, weights_client_app())
    return seconds[1:], accuracies[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    seconds, accuracy = {"flower": [], "ours": []}, {}
    with tempfile.TemporaryDirectory() as tmp:
        cfg = validate({"num-rounds": args.rounds, "sample-rate": 1.0, "results-dir": tmp, "tensorboard": False})
        for repeat in range(args.repeats + 1):  # the first pair pays one-time costs only
            for name, make in strategies(args.clients).items():
                per_round, accuracy[name] = run(make, cfg, args.clients)
                if repeat:
                    seconds[name] += per_round
    for name in seconds:
        print(f"{name:6}  s/round {statistics.median(seconds[name]):.3f}  accuracy {accuracy[name]:.3f}")
    print(
        f"wrapper / Flower's server-side fixed clipping: "
        f"{statistics.median(seconds['ours']) / statistics.median(seconds['flower']):.2f}x seconds per round"
    )


if __name__ == "__main__":
    main()
