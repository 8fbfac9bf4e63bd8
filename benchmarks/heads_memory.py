"""Memory of DP2-FedSAM with many simulated clients, each holding its personal head in Context.state.

One round with every client sampled (so that every client trains and stores a head), then the
personalized evaluation of every client, all in this process (InProcessGrid, the real ClientApp).
Prints the process RSS before and after, its peak, and the bytes held in the heads.

    python -m benchmarks.heads_memory                 # 1000 clients, cnn-mnist
    python -m benchmarks.heads_memory --head-prefix classifier   # a 50x larger head (16,746 parameters)

The in-process grid normally keeps every message it delivered (for tests); here it keeps none,
so the numbers are the clients' state plus one model, not the message log.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from dpfl.clients.personalized import ContextHeadStore
from dpfl.dpcore.task.partitions import load_partition
from dpfl.fl_app.client_app import app as client_app
from dpfl.fl_app.config import validate
from dpfl.fl_app.results import read_summary
from dpfl.fl_app.server_app import run_federated
from dpfl_tools.inprocess import InProcessGrid
from dpfl_tools.process_grid import peak_memory


def rss_mib() -> float:
    """Current resident set size (Linux /proc), MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class _Discard(list):
    def append(self, item) -> None:  # keep no message log
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--model", default="cnn-mnist")
    parser.add_argument("--head-prefix", default="")
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(tempfile.mkdtemp(prefix="heads-memory-"))
    cfg = validate(
        {
            "algorithm": "dp2-fedsam",
            "model": args.model,
            "partitioner": "iid",
            "num-rounds": 1,
            "sample-rate": 1.0,
            "local-steps": 1,
            "head-steps": 1,
            "batch-size": 4,
            "head-prefix": args.head_prefix,
            "results-dir": str(out),
        }
    )
    load_partition(cfg.data.dataset, 0, args.clients, cfg.data.partitioner, seed=cfg.run.seed)  # data and partitions
    grid = InProcessGrid(client_app, args.clients, cfg)
    grid.sent, grid.received = _Discard(), _Discard()
    before = rss_mib()
    t0 = time.perf_counter()
    summary = run_federated(grid, cfg)
    seconds = time.perf_counter() - t0
    after = rss_mib()
    heads = [ContextHeadStore(ctx.state).load() for ctx in grid.contexts.values()]
    held = [h for h in heads if h is not None]
    head_bytes = sum(a.nbytes for h in held for a in h.values())
    print(
        f"clients: {args.clients}  model: {args.model}  heads held: {len(held)}  "
        f"bytes per head: {head_bytes // max(1, len(held))}  shared body parameters: {summary['shared_parameters']}"
    )
    print(f"heads in Context.state: {head_bytes / 2**20:.2f} MiB")
    print(
        f"RSS before the run: {before:.0f} MiB  after: {after:.0f} MiB  (+{after - before:.0f} MiB)  "
        f"peak: {peak_memory()['rss_mib']:.0f} MiB  (target: < 4096 MiB)"
    )
    print(
        f"round + evaluation of all clients: {seconds:.1f} s; personalized accuracy "
        f"{read_summary(summary['results_dir'])['personalized_accuracy']:.3f} (not private)"
    )


if __name__ == "__main__":
    main()
