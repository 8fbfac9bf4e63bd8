"""Seconds per round versus a bare PyTorch loop doing the same local steps; SAM vs SGD step time.

    python -m benchmarks.round_overhead [--rounds 5] [--clients 50]

All figures come from one run (the machines are shared and noisy, so compare ratios):
- product round: DP-FedSAM through the real ServerApp/ClientApp code on the in-process
  grid (data loading per call, message conversion, clipping, noise, ledger, evaluation);
- bare loop: the same clients, the same number of SAM steps on the same batches, in a
  plain PyTorch loop with the model kept in memory, no DP, no evaluation;
- SAM vs SGD: one optimizer step on a batch of 32 with the MNIST CNN.
One thread throughout (one simulated client per CPU).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from clients.sam import sam_step
from fl_app.client_app import app as client_app
from fl_app.config import validate
from fl_app.task.data import load_partition
from fl_app.inprocess import InProcessGrid
from fl_app.task.models import build_model
from fl_app.results import read_rounds
from fl_app.server_app import run_federated


def product_seconds_per_round(cfg: dict, clients: int) -> tuple[float, list[int]]:
    """Median seconds per round (from metrics.jsonl) and the clients sampled in each round."""
    summary = run_federated(InProcessGrid(client_app, clients, cfg), cfg)
    rows = read_rounds(summary["results_dir"])  # seconds and clients are diagnostics
    return statistics.median(r["seconds"] for r in rows), [r["clients"] for r in rows]


def bare_loop_seconds(cfg: dict, clients: int, sampled_counts: list[int]) -> float:
    """Median seconds for a round's local SAM steps over the same number of clients."""
    times = []
    for round_idx, count in enumerate(sampled_counts):
        t0 = time.perf_counter()
        for pid in range(count):
            train, _ = load_partition(cfg["dataset"], pid % clients, clients, cfg["partitioner"],
                                      alpha=cfg["dirichlet-alpha"], seed=cfg["seed"])
            model = build_model(cfg["model"], train.x.shape[1:], train.num_classes, seed=cfg["seed"])
            opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=cfg["momentum"],
                                  weight_decay=cfg["weight-decay"])
            x, y = torch.from_numpy(train.x), torch.from_numpy(train.y)
            steps = cfg["local-epochs"] * -(-len(y) // cfg["batch-size"])
            g = torch.Generator().manual_seed(round_idx * 1000 + pid)
            for s in range(steps):
                idx = torch.randint(0, len(y), (min(cfg["batch-size"], len(y)),), generator=g)
                sam_step(model, torch.nn.functional.cross_entropy, x[idx], y[idx], opt, cfg["sam-rho"])
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def step_seconds(use_sam: bool, repeats: int = 200) -> float:
    model = build_model("cnn-mnist", (1, 28, 28), 10)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    x, y = torch.randn(32, 1, 28, 28), torch.randint(0, 10, (32,))
    loss_fn = torch.nn.functional.cross_entropy

    def sgd_step():
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()

    step = (lambda: sam_step(model, loss_fn, x, y, opt, 0.05)) if use_sam else sgd_step
    for _ in range(20):
        step()
    t0 = time.perf_counter()
    for _ in range(repeats):
        step()
    return (time.perf_counter() - t0) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--clients", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = validate({"num-rounds": args.rounds, "results-dir": tmp})
        product, counts = product_seconds_per_round(cfg, args.clients)
    bare = bare_loop_seconds(cfg, args.clients, counts)
    sgd, sam = step_seconds(False), step_seconds(True)
    print(f"clients sampled per round: {counts}")
    print(f"product round (in-process grid): {product:.3f} s")
    print(f"bare PyTorch loop, same steps:  {bare:.3f} s")
    print(f"overhead ratio product/bare:     {product / bare:.2f}x")
    print(f"SGD step {sgd * 1e3:.2f} ms, SAM step {sam * 1e3:.2f} ms, SAM/SGD {sam / sgd:.2f}x")


if __name__ == "__main__":
    main()
