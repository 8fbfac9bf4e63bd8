"""DP-FTRL against DP-FedAvg accounted without amplification, at equal epsilon, on full MNIST (docs/reproductions.md,
"DP-FTRL against DP-FedAvg without amplification").

    python -m benchmarks.dp_ftrl_vs_dpfedavg --data-dir DIR [--clients 200] [--per-round 50] [--rounds 20]
                                            [--epsilon 8] [--seeds 1 2 3]

When the server cannot promise uniform sampling (devices join when they can), DP-FedAvg's honest epsilon is that
of T Gaussian releases at sigma with no amplification (q = 1); DP-FTRL's is its trees' (docs/dp-toolbox.md §4).
Each method's sigma is calibrated so that its epsilon equals the target (the ledger's `calibrate_noise_multiplier`
on q = 1 events: T of them for DP-FedAvg, sum_j ceil(log2(b + 1)) for DP-FTRL with epochs of b = M / m rounds).
Both run the real ServerApp and ClientApp code on `InProcessGrid`: the same partitions (IID), model (cnn-mnist),
local SGD, clipping norm, m clients per round (DP-FedAvg: fixed-size sampling of exactly m; DP-FTRL: m of the
nodes eligible in the epoch) and central noise. Reported per seed: the final accuracy on the 10,000 test digits,
the epsilon each one's noise gives (for DP-FTRL the ledger's printed figure), and seconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

from dpfl.dpcore.privacy.accountants import epsilon_of
from dpfl.dpcore.privacy.calibration import calibrate_noise_multiplier
from dpfl.fl_app.client_app import app as client_app
from dpfl.fl_app.config import validate
from dpfl.fl_app.server_app import run_federated
from dpfl_tools.inprocess import InProcessGrid

JOB = {
    "dataset": "mnist",
    "model": "cnn-mnist",
    "partitioner": "iid",
    "local-steps": 10,
    "batch-size": 32,
    "lr": 0.05,
    "momentum": 0.5,
    "clipping-norm": 0.5,
    "noise-placement": "central",
    "delta": 1e-5,
    "tensorboard": False,
}


def one_run(cfg_overrides: dict, clients: int) -> tuple[dict, float]:
    with tempfile.TemporaryDirectory() as folder:
        cfg = validate({**JOB, **cfg_overrides, "min-nodes": clients, "results-dir": folder})
        started = time.perf_counter()
        summary = run_federated(InProcessGrid(client_app, clients, cfg), cfg)
        return summary, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", required=True, help="folder with the four MNIST IDX .gz files")
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--per-round", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--epsilon", type=float, default=8.0)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--eval-every", type=int, default=5)
    args = parser.parse_args()

    delta, rounds = JOB["delta"], args.rounds
    epoch_rounds = max(1, args.clients // args.per_round)
    tree_steps = [min(epoch_rounds, rounds - s) for s in range(0, rounds, epoch_rounds)]
    releases = sum(steps.bit_length() for steps in tree_steps)  # sum_j ceil(log2(b_j + 1))
    sigma_ftrl = calibrate_noise_multiplier(args.epsilon, delta, 1.0, releases)
    sigma_fedavg = calibrate_noise_multiplier(args.epsilon, delta, 1.0, rounds)
    common = {
        "data-dir": args.data_dir,
        "num-rounds": rounds,
        "sample-rate": args.per_round / args.clients,
        "eval-every": args.eval_every,
    }
    methods = {
        "dp-ftrl": (
            {**common, "algorithm": "dp-ftrl", "noise-multiplier": sigma_ftrl, "ftrl-epoch-rounds": epoch_rounds},
            sigma_ftrl,
            releases,
        ),
        "dp-fedavg (no amplification)": (
            {**common, "algorithm": "dp-fedavg", "noise-multiplier": sigma_fedavg, "client-sampling": "fixed"},
            sigma_fedavg,
            rounds,
        ),
    }
    print(
        f"M={args.clients} m={args.per_round} T={rounds} b={epoch_rounds} trees={tree_steps} target "
        f"epsilon={args.epsilon} delta={delta}: sigma dp-ftrl={sigma_ftrl:.4f} ({releases} releases), "
        f"dp-fedavg={sigma_fedavg:.4f} ({rounds} releases)",
        flush=True,
    )
    results: dict[str, list[dict]] = {name: [] for name in methods}
    for seed in args.seeds:
        for name, (overrides, sigma, count) in methods.items():
            summary, seconds = one_run({**overrides, "seed": seed}, args.clients)
            honest = epsilon_of([(sigma, 1.0, count)], delta)  # q = 1: no amplification
            row = {
                "seed": seed,
                "accuracy": summary["final_accuracy"],
                "epsilon_honest": honest,
                "epsilon_printed": summary["epsilon"],
                "seconds": seconds,
            }
            results[name].append(row)
            print(name, json.dumps(row), flush=True)
    print("\n| method | sigma | accuracy (seeds " + ", ".join(map(str, args.seeds)) + ") | mean | epsilon |")
    print("|---|---|---|---|---|")
    for name, rows in results.items():
        accs = [r["accuracy"] for r in rows]
        print(
            f"| {name} | {methods[name][1]:.3f} | {', '.join(f'{a:.3f}' for a in accs)} | "
            f"{statistics.mean(accs):.3f} | {rows[0]['epsilon_honest']:.2f} |"
        )


if __name__ == "__main__":
    main()
