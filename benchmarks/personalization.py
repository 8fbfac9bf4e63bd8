"""DP2-FedSAM against its baselines at the same accounted epsilon (one table, measured in one run).

Every algorithm runs with the same clients, partition, sampling rate, noise multiplier and
rounds, so the ledger gives every run the same epsilon. Global algorithms report the global
model's accuracy on the server test set; personalized ones the mean over clients of their
personal model's accuracy on their own held-out split.

    python -m benchmarks.personalization              # the settings of the slow end-to-end test
    python -m benchmarks.personalization --rounds 20 --clients 50
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from dpfl.fl_app.client_app import app as client_app
from dpfl.fl_app.config import validate
from dpfl.fl_app.results import read_summary
from dpfl.fl_app.server_app import run_federated
from dpfl_tools.inprocess import InProcessGrid

ALGORITHMS = ("dp-fedavg", "dp-fedsam", "dp-fedavg-ft", "dp-fedsam-ft", "centaur", "dp2-fedsam")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--sample-rate", type=float, default=0.5)
    parser.add_argument("--noise-multiplier", type=float, default=0.5)
    parser.add_argument("--clipping-norm", type=float, default=0.5)
    parser.add_argument("--algorithms", default=",".join(ALGORITHMS))
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(tempfile.mkdtemp(prefix="personalization-"))
    rows = []
    for algorithm in args.algorithms.split(","):
        cfg = validate(
            {
                "algorithm": algorithm,
                "partitioner": "pathological",
                "classes-per-client": 2,
                "num-rounds": args.rounds,
                "sample-rate": args.sample_rate,
                "noise-multiplier": args.noise_multiplier,
                "clipping-norm": args.clipping_norm,
                "local-epochs": 1,
                **({"head-epochs": 1} if algorithm in ("dp2-fedsam", "centaur") else {}),  # the others have no head
                "results-dir": str(out / algorithm),
            }
        )
        t0 = time.perf_counter()
        s = read_summary(run_federated(InProcessGrid(client_app, args.clients, cfg), cfg)["results_dir"])
        rows.append(
            (
                algorithm,
                s["final_accuracy"],
                s.get("personalized_accuracy"),
                s["epsilon"],
                s["delta"],
                time.perf_counter() - t0,
            )
        )
    print(
        f"\n{args.clients} clients, 2 labels each, q={args.sample_rate}, sigma={args.noise_multiplier}, "
        f"C={args.clipping_norm}, {args.rounds} rounds, 1 local epoch (+1 head epoch)\n"
    )
    print(
        "| algorithm | global accuracy (server test set) | personalized accuracy (client mean) | epsilon | delta | seconds |"
    )
    print("|---|---|---|---|---|---|")
    for algorithm, acc, pers, eps, delta, sec in rows:
        fmt = lambda v: "-" if v is None else f"{v:.3f}"
        print(f"| {algorithm} | {fmt(acc)} | {fmt(pers)} | {eps:.3f} | {delta:.3g} | {sec:.0f} |")


if __name__ == "__main__":
    main()
