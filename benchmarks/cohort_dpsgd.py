"""Seconds per round of ALI-DPFL's DP-SGD clients one after the other (InProcessGrid: Opacus) and batched
(dpfl_tools.cohort.CohortGrid: dpfl_tools/cohort_dpsgd.py).

    python -m benchmarks.cohort_dpsgd [--models cnn-mnist] [--cohorts 10,100] [--device auto] [--out FILE.json]

One round's train exchange of ali-dpfl (`grid.send_and_receive`, one message per node: --local-steps DP-SGD
steps, Poisson rate --sample-rate on --samples synthetic images per client, benchmarks.cohort's
`synthetic_partitions`), in this process, each engine after a warm-up round on 2 clients; torch on one thread.
Prints each round's seconds, the CUDA peak memory allocated, and the ratio cohort / sequential.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from benchmarks.cohort import DATASETS, synthetic_partitions


def round_seconds(grid_class, cfg: dict, clients: int, steps: int) -> float:
    import torch
    from flwr.app import ArrayRecord, ConfigRecord, RecordDict

    import fl_app.client_app as project

    grid = grid_class(project.app, clients, cfg)
    weights = [v.detach().cpu().numpy() for v in project.build_client(grid.contexts[100]).model.state_dict().values()]
    messages = [
        grid.create_message(
            RecordDict(
                {"arrays": ArrayRecord(weights), "config": ConfigRecord({"server-round": 1, "local-steps": steps})}
            ),
            "train",
            node,
            "1",
        )
        for node in grid.get_node_ids()
    ]
    cuda = torch.cuda.is_available() and cfg["device"] != "cpu"
    if cuda:
        torch.cuda.synchronize()
    started = time.perf_counter()
    replies = grid.send_and_receive(messages)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    errors = [r.error.reason for r in replies if r.has_error()]
    if errors or getattr(grid, "batched", clients) != clients:
        raise RuntimeError(f"{len(errors)} replies failed ({errors[:1]}), {getattr(grid, 'batched', '-')} batched")
    return seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="cnn-mnist")
    parser.add_argument("--cohorts", default="10,100")
    parser.add_argument("--device", default="auto", help="the run-config device: auto, cpu, cuda, cuda:N")
    parser.add_argument("--local-steps", type=int, default=4)
    parser.add_argument("--samples", type=int, default=64, help="synthetic samples per client")
    parser.add_argument("--sample-rate", type=float, default=0.25, help="DP-SGD's Poisson rate q")
    parser.add_argument("--out", default="", help="also write the rows as JSON to this file")
    args = parser.parse_args(argv)
    import torch

    import fl_app.client_app as project
    from dpfl_tools.cohort import CohortGrid
    from dpfl_tools.inprocess import InProcessGrid

    torch.set_num_threads(1)
    project.load_client_partition = synthetic_partitions(args.samples)
    rows = []
    for model in args.models.split(","):
        cfg = {
            "algorithm": "ali-dpfl",
            "model": model,
            "dataset": DATASETS[model],
            "device": args.device,
            "batch-sample-rate": args.sample_rate,
            "target-epsilon": 100.0,
            "secure-rng": False,
        }
        for clients in map(int, args.cohorts.split(",")):
            pair = {}
            for engine, grid_class in (("inprocess", InProcessGrid), ("cohort", CohortGrid)):
                round_seconds(grid_class, cfg, 2, args.local_steps)
                if torch.cuda.is_available():
                    torch.cuda.reset_peak_memory_stats()
                pair[engine] = round_seconds(grid_class, cfg, clients, args.local_steps)
                cuda = torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None
                rows.append({"model": model, "clients": clients, "engine": engine, "seconds": pair[engine]})
                rows[-1]["cuda_max_allocated_mib"] = cuda
                print(json.dumps(rows[-1]), flush=True)
            print(f"{model} {clients} clients: cohort / sequential round = {pair['cohort'] / pair['inprocess']:.2f}x")
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    if args.out:
        Path(args.out).write_text(json.dumps({"gpu": gpu, "settings": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
