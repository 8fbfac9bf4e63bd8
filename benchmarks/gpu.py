"""CUDA against the CPU, measured in one run on one machine (docs/performance.md, "On a GPU").

    python -m benchmarks.gpu [--repeats 20] [--out gpu.json]

1. step costs per model (SGD, SAM, Opacus DP-SGD `ew`) at batch 32 (CPU and CUDA steps interleaved, medians);
2. channels_last against the plain layout on CUDA for the convolutional models (the CPU choice is
   `benchmarks.channels_last`'s; on CUDA the plain layout is kept unless this shows a gain above 1.1x);
3. an in-process round of the default job (DP-FedSAM, 10 clients, q = 1) with `device = 'cuda'` against
   `device = 'cpu'`: the median seconds of rounds 2.. and the final accuracy of each.
It needs a CUDA device; it refuses to run without one.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
from torch import nn

from dpfl.clients.base import LocalSGD, sgd_step
from dpfl.clients.dpsgd import dpsgd_steps
from dpfl.clients.sam import sam_step
from dpfl.dpcore.task.device import place_input, place_model
from dpfl.dpcore.task.models import build_model

MODELS = {"cnn-mnist": ((1, 28, 28), 10), "cnn-cifar10": ((3, 32, 32), 10), "resnet18-gn": ((3, 32, 32), 10)}


def synchronized(run, device: torch.device):
    """`run`, waiting for the device's queued kernels so that a timer around it measures the work."""

    def step():
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return step


def stepper(name: str, step: str, device: torch.device, batch_size: int, channels_last: bool = False):
    """One `step` ("sgd", "sam" or "dpsgd") of model `name` on a fixed batch on `device`."""
    shape, classes = MODELS[name]
    model = place_model(build_model(name, shape, classes), device, channels_last)
    generator = torch.Generator().manual_seed(0)
    x = place_input(torch.randn(batch_size, *shape, generator=generator), device, channels_last)
    y = torch.randint(0, classes, (batch_size,), generator=generator).to(device)
    if step == "dpsgd":
        return synchronized(
            lambda: dpsgd_steps(
                model, x, y, steps=1, sample_rate=1.0, noise_multiplier=1.0, clipping_norm=1.0, lr=0.01
            ),
            device,
        )
    optimizer = LocalSGD(model.parameters(), lr=0.01, momentum=0.5, weight_decay=5e-4)
    loss_fn = nn.CrossEntropyLoss()
    if step == "sgd":
        return synchronized(lambda: sgd_step(model, loss_fn, x, y, optimizer), device)
    return synchronized(lambda: sam_step(model, loss_fn, x, y, optimizer, 0.05), device)


def timed(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def paired_ms(first, second, repeats: int) -> tuple[float, float]:
    """Median ms of each, their steps alternating one by one after two warm-ups each."""
    for run in (first, second, first, second):
        run()
    pairs = [(timed(first), timed(second)) for _ in range(repeats)]
    return 1000 * statistics.median(a for a, _ in pairs), 1000 * statistics.median(b for _, b in pairs)


def step_costs(repeats: int, batch_size: int) -> list[dict]:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    rows = []
    for name in MODELS:
        for step in ("sgd", "sam", "dpsgd"):
            cpu_ms, cuda_ms = paired_ms(
                stepper(name, step, cpu, batch_size), stepper(name, step, cuda, batch_size), repeats
            )
            rows.append(
                {"model": name, "step": step, "cpu_ms": cpu_ms, "cuda_ms": cuda_ms, "speedup": cpu_ms / cuda_ms}
            )
            print(rows[-1], flush=True)
    return rows


def channels_last_on_cuda(repeats: int, batch_size: int) -> list[dict]:
    cuda, rows = torch.device("cuda"), []
    for name in MODELS:
        for step in ("sgd", "sam"):
            plain, last = paired_ms(
                stepper(name, step, cuda, batch_size), stepper(name, step, cuda, batch_size, True), repeats
            )
            rows.append(
                {"model": name, "step": step, "plain_ms": plain, "channels_last_ms": last, "gain": plain / last}
            )
            print(rows[-1], flush=True)
    return rows


def inprocess_rounds(device: str, rounds: int, clients: int) -> dict:
    """The default job on the in-process grid: per-round seconds (from metrics.jsonl) and the final accuracy."""
    from dpfl.fl_app.client_app import app as client_app
    from dpfl.fl_app.config import validate
    from dpfl.fl_app.server_app import run_federated
    from dpfl_tools.inprocess import InProcessGrid

    with tempfile.TemporaryDirectory() as tmp:
        cfg = validate(
            {"device": device, "num-rounds": rounds, "sample-rate": 1.0, "results-dir": str(Path(tmp) / "run")}
        )
        started = time.perf_counter()
        summary = run_federated(InProcessGrid(client_app, clients, cfg), cfg)
        total = time.perf_counter() - started
        run_dir = Path(tmp) / "run"
        rows = [json.loads(line) for f in ("metrics.jsonl", "diagnostics.jsonl") for line in (run_dir / f).open()]
    seconds = [r["seconds"] for r in rows if "seconds" in r][1:]
    return {
        "device": device,
        "rounds": rounds,
        "clients": clients,
        "total_s": total,
        "median_round_s": statistics.median(seconds) if seconds else None,
        "final_accuracy": summary["final_accuracy"],
        "epsilon": summary["epsilon"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--out", default="", help="also write the results as JSON to this file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.gpu needs a CUDA device: torch sees none here")
    warnings.filterwarnings("ignore")
    result = {
        "machine": {
            "gpu": torch.cuda.get_device_name(0),
            "cpu_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "step_costs": step_costs(args.repeats, args.batch_size),
        "channels_last_on_cuda": channels_last_on_cuda(args.repeats, args.batch_size),
        "rounds": [inprocess_rounds(d, args.rounds, args.clients) for d in ("cuda", "cpu")],
    }
    print(json.dumps(result["rounds"], indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
