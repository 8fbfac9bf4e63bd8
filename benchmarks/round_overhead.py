"""Seconds per round versus a bare PyTorch loop doing the same local steps; SAM vs SGD step time.

    python -m benchmarks.round_overhead [--rounds 5] [--clients 50]

All figures come from one run (the machines are shared and noisy, so compare ratios):
- product round: DP-FedSAM through the real ServerApp/ClientApp code on the in-process
  grid (data loading per call, message conversion, clipping, noise, ledger, evaluation);
- bare loop: the partitions each round trained, the same number of SAM steps, in a plain
  PyTorch loop (model and data made per client), no DP, no messages, no evaluation; the
  ratio is the median over rounds 2.. of the per-round ratio (round 1 carries first-use costs);
- SAM vs SGD: one optimizer step on a batch of 32 with the MNIST CNN.
One thread throughout (one simulated client per CPU).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from flwr.app import Context, Message, MessageType

from dpfl.clients.sam import sam_step
from dpfl.dpcore.privacy import protocol as keys
from dpfl.dpcore.task.models import build_model
from dpfl.dpcore.task.partitions import load_partition
from dpfl.fl_app.client_app import app as client_app
from dpfl.fl_app.config import validate
from dpfl.fl_app.results import read_rounds
from dpfl.fl_app.server_app import run_federated
from dpfl.fl_app.settings import Settings
from dpfl_tools.inprocess import InProcessGrid


def product_rounds(cfg: Settings, clients: int) -> tuple[list[float], list[list[int]]]:
    """Seconds of each round (from the run's diagnostics) and the partitions trained in each round."""
    trained: dict[int, list[int]] = {}

    def recording_app(msg: Message, context: Context) -> Message:
        if msg.metadata.message_type == MessageType.TRAIN:
            rnd = int(msg.content.config_records["config"][keys.SERVER_ROUND])
            trained.setdefault(rnd, []).append(int(context.node_config["partition-id"]))
        return client_app(msg, context)

    summary = run_federated(InProcessGrid(recording_app, clients, cfg), cfg)
    rows = read_rounds(summary["results_dir"])  # seconds are diagnostics
    return [r["seconds"] for r in rows], [trained[r["round"]] for r in rows]


def partition_seconds(cfg: Settings, clients: int, partition_id: int, seed: int) -> float:
    """Seconds for one client's local SAM steps on its partition in a plain PyTorch loop (model, data and
    batches made here, no DP, no messages)."""
    t0 = time.perf_counter()
    train, _ = load_partition(
        cfg.data.dataset, partition_id, clients, cfg.data.partitioner, alpha=cfg.data.dirichlet_alpha, seed=cfg.run.seed
    )
    model = build_model(cfg.training.model, train.x.shape[1:], train.num_classes, seed=cfg.run.seed)
    opt = torch.optim.SGD(
        model.parameters(), lr=cfg.training.lr, momentum=cfg.training.momentum, weight_decay=cfg.training.weight_decay
    )
    x, y = torch.from_numpy(train.x), torch.from_numpy(train.y)
    steps = cfg.training.local_epochs * -(-len(y) // cfg.training.batch_size)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(0, len(y), (min(cfg.training.batch_size, len(y)),), generator=g)
        sam_step(model, torch.nn.functional.cross_entropy, x[idx], y[idx], opt, cfg.training.sam_rho)
    return time.perf_counter() - t0


def bare_rounds(cfg: Settings, clients: int, rounds: list[list[int]]) -> list[float]:
    """For each round, the bare loop's seconds for that round's partitions, one after the other."""
    partition_seconds(cfg, clients, 0, seed=0)  # warm-up
    return [
        sum(partition_seconds(cfg, clients, pid, seed=r * 1000 + pid) for pid in partitions)
        for r, partitions in enumerate(rounds)
    ]


def steady_ratio(product: list[float], bare: list[float]) -> float:
    """Median over rounds 2.. of product round / bare round (round 1 carries the process's first-use costs,
    which the bare loop's warm-up leaves out)."""
    return statistics.median(p / b for p, b in zip(product[1:], bare[1:]))


def expected_bare_loop_seconds(cfg: Settings, clients: int, counts: list[int]) -> float:
    """Median over rounds of count x the mean bare seconds of a partition (each timed once): the expected
    bare round for `count` clients drawn uniformly, where which clients trained is not known (`flwr run`)."""
    partition_seconds(cfg, clients, 0, seed=0)  # warm-up
    mean = statistics.fmean(partition_seconds(cfg, clients, pid, seed=pid) for pid in range(clients))
    return statistics.median(count * mean for count in counts)


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
        product, rounds = product_rounds(cfg, args.clients)
    bare = bare_rounds(cfg, args.clients, rounds)
    sgd, sam = step_seconds(False), step_seconds(True)
    print(f"partitions trained per round: {rounds}")
    print(f"product rounds (in-process grid): {[round(t, 3) for t in product]} s")
    print(f"bare PyTorch loop, same steps:   {[round(t, 3) for t in bare]} s")
    print(f"product/bare, median of rounds 2..: {steady_ratio(product, bare):.2f}x")
    print(f"SGD step {sgd * 1e3:.2f} ms, SAM step {sam * 1e3:.2f} ms, SAM/SGD {sam / sgd:.2f}x")


if __name__ == "__main__":
    main()
