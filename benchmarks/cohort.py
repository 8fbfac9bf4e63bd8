"""Seconds per round of a cohort trained one client after the other (InProcessGrid) and as one batched model
(dpfl_tools.cohort.CohortGrid), with peak memory.

    python -m benchmarks.cohort [--quick] [--device cpu|cuda|auto] [--out FILE.json]
    python -m benchmarks.cohort --models cnn-mnist --cohorts 100 --local-steps 8
    python -m benchmarks.cohort --algorithm ali-dpfl --models cnn-mnist --cohorts 10,100

One round's train exchange (`grid.send_and_receive` of one train message per node, dp-fedsam, distributed noise:
each client clips and adds its noise share), through the project's own ClientApp, for each model (cnn-mnist,
cnn-cifar10, resnet18-gn), cohort size (10, 100, 1000) and engine, each in a fresh process after one warm-up
round of the same engine on 2 clients: the round's seconds, the process's peak RSS (CPU) and the peak CUDA memory
allocated. Every client holds --samples synthetic images of the model's input shape (MNIST's for cnn-mnist,
CIFAR-10's for the others) and takes --local-steps steps of batch 32. torch runs on one thread in both engines
(the ClientApp's setting). The sequential engine runs cohorts up to --sequential-max clients (its time grows
linearly: 1,000 clients of resnet18-gn take minutes); the ratio line compares the cohort engine to it.
`--algorithm ali-dpfl`: the round is ALI-DPFL's DP-SGD instead (--local-steps steps at Poisson rate
--sample-rate, Opacus one client after the other against dpfl_tools/cohort_dpsgd.py).
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

DATASETS = {"cnn-mnist": "mnist-embedded", "cnn-cifar10": "cifar10", "resnet18-gn": "cifar10"}
SHAPES = {"mnist-embedded": (1, 28, 28), "cifar10": (3, 32, 32)}


def synthetic_partitions(samples: int):
    """load_client_partition's stand-in: `samples` Gaussian images of the dataset's shape per client, 10 labels."""
    import numpy as np

    from dpcore.task.catalogue import ArrayDataset

    def load(s, pid, n):
        rng = np.random.default_rng([pid, n])
        shape = SHAPES[s.data.dataset]
        x = rng.standard_normal((samples, *shape), dtype=np.float32)
        train = ArrayDataset(x, rng.integers(0, 10, samples).astype(np.int64), 10)
        return train, ArrayDataset(x[:1], train.y[:1], 10)

    return load


def one(
    model: str, clients: int, engine: str, device: str, steps: int, samples: int, algorithm: str = "dp-fedsam", q=0.25
) -> dict:
    """One measurement, in this process: a warm-up round on 2 clients, then the timed round on `clients`."""
    import torch
    from flwr.app import ArrayRecord, ConfigRecord, RecordDict

    import fl_app.client_app as project
    from dpcore.task.device import resolve_device
    from dpfl_tools.cohort import CohortGrid
    from dpfl_tools.inprocess import InProcessGrid
    from fl_app.config import validate

    torch.set_num_threads(1)
    project.load_client_partition = synthetic_partitions(samples)
    grid_class = CohortGrid if engine == "cohort" else InProcessGrid
    cfg = validate(
        {
            "model": model,
            "dataset": DATASETS[model],
            "device": device,
            "local-steps": steps,
            "batch-size": 32,
            "secure-rng": False,
            "algorithm": algorithm,
            **({"batch-sample-rate": q, "target-epsilon": 100.0} if algorithm == "ali-dpfl" else {}),
        }
    )

    def round_seconds(n: int) -> float:
        grid = grid_class(project.app, n, cfg)
        weights = [
            v.detach().cpu().numpy() for v in project.build_client(grid.contexts[100]).model.state_dict().values()
        ]
        config = {"server-round": 1, "privatize": True, "clipping-norm": 0.5, "noise-std": 0.1}
        if algorithm == "ali-dpfl":  # DP-SGD: the server sends the round's local steps
            config = {"server-round": 1, "local-steps": steps}
        messages = [
            grid.create_message(
                RecordDict({"arrays": ArrayRecord(weights), "config": ConfigRecord(config)}), "train", node, "1"
            )
            for node in grid.get_node_ids()
        ]
        cuda = resolve_device(device).type == "cuda"
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        replies = grid.send_and_receive(messages)
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        errors = [r.error.reason for r in replies if r.has_error()]
        if errors:
            raise RuntimeError(f"{len(errors)} replies failed: {errors[0]}")
        if engine == "cohort" and grid.batched != n:
            raise RuntimeError(f"only {grid.batched} of {n} replies were batched")
        return seconds

    round_seconds(2)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    seconds = round_seconds(clients)
    return {
        "model": model,
        "clients": clients,
        "engine": engine,
        "seconds": seconds,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "cuda_max_allocated_mib": torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None,
    }


def fresh(args: list[str], timeout: float) -> dict | None:
    """`one(...)` in a fresh process; None where it ran out of time."""
    code = "import json, sys; from benchmarks.cohort import one; print(json.dumps(one(*json.loads(sys.argv[1]))))"
    try:
        out = subprocess.run(
            [sys.executable, "-c", code, json.dumps(args)], capture_output=True, text=True, timeout=timeout, check=True
        )
    except subprocess.TimeoutExpired:
        return None
    except subprocess.CalledProcessError as exc:
        raise SystemExit(f"benchmark process failed: {exc.stderr[-2000:]}") from None
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="cnn-mnist,cnn-cifar10,resnet18-gn")
    parser.add_argument("--cohorts", default="10,100,1000")
    parser.add_argument("--device", default="auto", help="the run-config device: auto, cpu, cuda, cuda:N")
    parser.add_argument("--local-steps", type=int, default=4)
    parser.add_argument("--samples", type=int, default=64, help="synthetic samples per client")
    parser.add_argument("--sequential-max", type=int, default=100, help="largest cohort the sequential engine runs")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per measurement (then: not measured)")
    parser.add_argument("--quick", action="store_true", help="cnn-mnist only, cohorts 10 and 100 (a CPU run)")
    parser.add_argument("--out", default="", help="also write the rows as JSON to this file")
    parser.add_argument("--algorithm", default="dp-fedsam", choices=("dp-fedsam", "ali-dpfl"))
    parser.add_argument("--sample-rate", type=float, default=0.25, help="ali-dpfl: DP-SGD's Poisson rate q")
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.cohorts = "cnn-mnist", "10,100"
    import torch

    rows = []
    for model in args.models.split(","):
        for clients in map(int, args.cohorts.split(",")):
            for engine in ("inprocess", "cohort"):
                if engine == "inprocess" and clients > args.sequential_max:
                    continue
                one_args = [model, clients, engine, args.device, args.local_steps, args.samples]
                row = fresh([*one_args, args.algorithm, args.sample_rate], args.timeout)
                if row is None:
                    row = {"model": model, "clients": clients, "engine": engine, "seconds": None}
                rows.append(row)
                print(json.dumps(row), flush=True)
            pair = {r["engine"]: r["seconds"] for r in rows[-2:] if r["model"] == model and r["clients"] == clients}
            if pair.get("inprocess") and pair.get("cohort"):
                print(
                    f"{model} {clients} clients: cohort / sequential round = {pair['cohort'] / pair['inprocess']:.2f}x",
                    flush=True,
                )
    result = {
        "machine": {
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "processor": platform.processor(),
        },
        "settings": vars(args),
        "rows": rows,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
