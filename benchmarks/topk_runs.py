"""DP-FedSAM-top_k against DP-FedSAM: accuracy, epsilon and upload bytes per round.

    python -m benchmarks.topk_runs [--rounds 30] [--clients 50] [--seeds 42]

In-process federated runs (dpfl_tools.inprocess.InProcessGrid, the same ServerApp/ClientApp
code as `flwr run`) on mnist-embedded with the default job (cnn-mnist, Poisson q = 0.5,
sigma = 1.0, C = 0.5, distributed noise, SAM rho = 0.05). Top-k is post-processing, so
every run has the same epsilon; what changes is the accuracy and the bytes uploaded.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
from pathlib import Path

import torch

RUNS = [
    ("dp-fedsam", {"algorithm": "dp-fedsam"}),
    ("top-k p=0.4 per-layer", {"algorithm": "dp-fedsam-topk", "sparsity": 0.4}),
    ("top-k p=0.4 global", {"algorithm": "dp-fedsam-topk", "sparsity": 0.4, "topk-mode": "global"}),
    ("top-k p=0.1 per-layer", {"algorithm": "dp-fedsam-topk", "sparsity": 0.1}),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--seeds", type=int, nargs="+", default=[42])
    args = parser.parse_args()

    from dpfl.fl_app.client_app import app as client_app
    from dpfl.fl_app.config import validate
    from dpfl.fl_app.results import read_summary
    from dpfl.fl_app.server_app import run_federated
    from dpfl_tools.inprocess import InProcessGrid

    logging.getLogger("flwr").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    print(f"mnist-embedded, cnn-mnist, {args.clients} clients, {args.rounds} rounds, default job")
    print(f"{'run':<24} {'seed':>5} {'accuracy':>9} {'epsilon':>8} {'MiB up':>8} {'MiB dense':>10} {'up/dense':>9}")
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in RUNS:
            for seed in args.seeds:
                cfg = validate(
                    {
                        "num-rounds": args.rounds,
                        "seed": seed,
                        "results-dir": str(Path(tmp, f"{name.replace(' ', '-')}-{seed}")),
                        **overrides,
                    }
                )
                s = read_summary(run_federated(InProcessGrid(client_app, args.clients, cfg), cfg)["results_dir"])
                # dense runs upload float32 arrays: what the top-k runs call dense
                dense = s.get("dense_bytes_total")
                up = s.get("upload_bytes_total", dense)
                mib = lambda b: f"{b / 2**20:>8.2f}" if b else f"{'-':>8}"
                ratio = f"{up / dense:>9.3f}" if dense else f"{'1 (dense)':>9}"
                print(
                    f"{name:<24} {seed:>5} {s['final_accuracy']:>9.4f} {s['epsilon']:>8.3f} {mib(up)} "
                    f"{mib(dense):>10} {ratio}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
