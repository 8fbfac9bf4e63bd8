"""ALI-DPFL next to its fixed-tau baselines and with mu released by the clients, in one run.

Embedded MNIST, 10 clients, Dirichlet(0.05), every client every round, R_s = 20 rounds,
DP-SGD sigma = 1.5, q_s = 0.1, C = 0.1, lr = 5, target epsilon 4 per client (R_c = 104
steps): the end-to-end test's setting. In-process (no Ray), one seed per run.

    python -m benchmarks.ali_dpfl_runs [--seeds 1]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import warnings

import torch

from dpfl.fl_app.client_app import app as client_app
from dpfl.fl_app.config import validate
from dpfl.fl_app.server_app import run_federated
from dpfl_tools.inprocess import InProcessGrid

BASE = {
    "algorithm": "ali-dpfl",
    "dataset": "mnist-embedded",
    "partitioner": "dirichlet",
    "dirichlet-alpha": 0.05,
    "num-rounds": 20,
    "sample-rate": 1.0,
    "batch-sample-rate": 0.1,
    "sample-noise-multiplier": 1.5,
    "sample-clipping-norm": 0.1,
    "lr": 5.0,
    "momentum": 0.0,
    "weight-decay": 0.0,
    "gamma": 10.0,
    "target-epsilon": 4.0,
}
RUNS = {
    "ALI-DPFL (mu on server data)": {},
    "ALI-DPFL (mu from clients, z=10)": {"mu-source": "clients", "mu-max": 20.0, "mu-noise-multiplier": 10.0},
    "fixed tau = 1": {"adaptive": False, "local-steps": 1},
    "fixed tau = 5": {"adaptive": False, "local-steps": 5},
    "fixed tau = 10": {"adaptive": False, "local-steps": 10},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("flwr").setLevel(logging.ERROR)
    print(f"{'run':<34} {'accuracy':>9} {'rounds':>6} {'steps':>5} {'max eps':>7}  tau list (first seed)")
    for name, overrides in RUNS.items():
        accs, first = [], None
        for seed in range(args.seeds):
            with tempfile.TemporaryDirectory() as tmp:
                cfg = validate({**BASE, **overrides, "seed": 42 + seed, "results-dir": tmp})
                summary = run_federated(InProcessGrid(client_app, 10, cfg), cfg)
            accs.append(summary["final_accuracy"])
            first = first or summary
        acc = f"{statistics.mean(accs):.3f}" + (f"±{statistics.stdev(accs):.3f}" if len(accs) > 1 else "")
        print(
            f"{name:<34} {acc:>9} {first['rounds_completed']:>6} {first['local_steps_total']:>5} "
            f"{first['epsilon']:>7.3f}  {first['tau_list']}"
        )


if __name__ == "__main__":
    main()
