"""Seconds per round of a cohort trained one client after the other (InProcessGrid) and as one batched model
(dpfl_tools.cohort.CohortGrid), with peak memory.

    python -m benchmarks.cohort [--quick] [--device cpu|cuda|auto] [--out FILE.json]
    python -m benchmarks.cohort --models cnn-mnist --cohorts 100 --local-steps 8
    python -m benchmarks.cohort --algorithm ali-dpfl --models cnn-mnist --cohorts 10,100
    python -m benchmarks.cohort --exchange evaluate --models cnn-mnist --cohorts 10,100
    python -m benchmarks.cohort --engines cohort,ray --models cnn-mnist,resnet18-gn --cohorts 100
    python -m benchmarks.cohort --engines ray,cohort-run --processes 1,8 --models cnn-mnist --cohorts 100

One round's train exchange (`grid.send_and_receive` of one train message per node, dp-fedsam, distributed noise:
each client clips and adds its noise share), through the project's own ClientApp, for each model (cnn-mnist,
cnn-cifar10, resnet18-gn), cohort size (10, 100, 1000) and engine, each in a fresh process after one warm-up
round of the same engine on the same clients (a steady round: a sweep's rounds after its first one; the first
round of a cohort pays its first allocations, and on CUDA its kernels' first launches): the round's seconds, the
process's peak RSS (CPU) and the peak CUDA memory allocated (with --processes P > 1: the sum of each process's
peak, an upper bound of what they held at once).
Every client holds --samples synthetic images of the model's input shape (MNIST's for cnn-mnist, CIFAR-10's for
the others) and takes --local-steps steps of batch 32. torch runs on one thread in both engines
(the ClientApp's setting). The sequential engine runs cohorts up to --sequential-max clients (its time grows
linearly: 1,000 clients of resnet18-gn take minutes); the ratio line compares the cohort engine to it.
`--algorithm ali-dpfl`: the round is ALI-DPFL's DP-SGD instead (--local-steps steps at Poisson rate
--sample-rate, Opacus one client after the other against clients/cohort/dpsgd.py). `--exchange evaluate`: an
evaluate message per node instead (each client's loss and accuracy on its --samples / 4 held-out images).

`--engines ...,ray`: the same round through Flower's Ray simulation as a user runs it, `python -m
dpfl_tools.launch --clients N` (its own SuperLink and Ray head; one CPU per client and, on a GPU, the launcher's
fractional `client-resources-num-gpus`, or --gpus-per-client), --ray-rounds rounds of dp-fedsam with every node
sampled (sample-rate 1), iid partitions of synthetic PNG images written as a Hugging Face parquet export
(`data-dir`; dataset mnist for cnn-mnist, cifar10 for the others), --samples training images per client. Its
seconds are the run folder's `seconds` of the last round before the final one (round 1 pays Ray's actor
start-up, the final round the server's evaluation); its memory is not measured (many processes). The ratio line
compares the cohort engine to it. `--engines ...,cohort-run`: the same launch with `--engine cohort --processes
P` (each of --processes), timed the same way, so that its ratio to Ray's compares whole rounds, the server's
aggregation, accounting and checkpoint included in both.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LAUNCHED = ("ray", "cohort-run")  # engines timed through `python -m dpfl_tools.launch`, whole rounds
DATASETS = {"cnn-mnist": "mnist-embedded", "cnn-cifar10": "cifar10", "resnet18-gn": "cifar10"}
SHAPES = {"mnist-embedded": (1, 28, 28), "cifar10": (3, 32, 32)}


def use_synthetic_partitions(samples: int) -> None:
    """The ClientApp loads `synthetic_partitions(samples)` (a ProcessGrid's worker calls it first)."""
    import dpfl.fl_app.client_app as project

    project.load_client_partition = synthetic_partitions(samples)


def synthetic_partitions(samples: int):
    """load_client_partition's stand-in: `samples` Gaussian images of the dataset's shape per client, and a
    quarter as many held out, 10 labels. Each client's rows are copied from one pool of images drawn once per
    shape (its own rows from its own generator), as the real loader copies its partition's rows from the
    dataset: 0.05 ms a client, where drawing 64 MNIST-sized images anew every round took 0.6 ms."""
    import functools

    import numpy as np

    from dpfl.dpcore.task.catalogue import ArrayDataset

    @functools.cache
    def pool(shape):
        rows = 16 * (samples + samples // 4)
        return np.random.default_rng(0).standard_normal((rows, *shape), dtype=np.float32)

    def load(s, pid, n):
        images = pool(SHAPES[s.data.dataset])
        rng = np.random.default_rng([pid, n])
        idx = rng.integers(0, len(images), samples + samples // 4)
        x, y = images[idx], rng.integers(0, 10, len(idx)).astype(np.int64)
        return ArrayDataset(x[:samples], y[:samples], 10), ArrayDataset(x[samples:], y[samples:], 10)

    return load


def one(
    model: str,
    clients: int,
    engine: str,
    device: str,
    steps: int,
    samples: int,
    algorithm: str = "dp-fedsam",
    q=0.25,
    exchange: str = "train",
    processes: int = 1,
) -> dict:
    """One measurement, in this process: a warm-up round, then the timed round, each on all `clients` (the cohort
    engine with `processes` > 1: a ProcessGrid of that many CohortGrids)."""
    import torch
    from flwr.app import ArrayRecord, ConfigRecord, RecordDict

    import dpfl.fl_app.client_app as project
    from dpfl.dpcore.task.device import resolve_device
    from dpfl.fl_app.config import validate
    from dpfl_tools.cohort import CohortGrid
    from dpfl_tools.inprocess import InProcessGrid
    from dpfl_tools.process_grid import ProcessGrid, peak_memory

    torch.set_num_threads(1)
    use_synthetic_partitions(samples)
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

    if engine == "inprocess":
        grid = InProcessGrid(project.app, clients, cfg, keep_messages=False)
    elif processes == 1:
        grid = CohortGrid(project.app, clients, cfg, keep_messages=False)
    else:
        synthetic = {"initializer": use_synthetic_partitions, "initargs": (samples,)}
        grid = ProcessGrid(project.app, clients, cfg, processes=processes, keep_messages=False, **synthetic)

    def round_seconds(n: int) -> float:
        weights = [
            v.detach().cpu().numpy() for v in project.build_client(grid.contexts[100]).model.state_dict().values()
        ]
        config = {"server-round": 1, "privatize": True, "clipping-norm": 0.5, "noise-std": 0.1}
        if algorithm == "ali-dpfl":  # DP-SGD: the server sends the round's local steps
            config = {"server-round": 1, "local-steps": steps}
        content = RecordDict({"arrays": ArrayRecord(weights), "config": ConfigRecord(config)})  # one for all, as
        messages = [grid.create_message(content, exchange, node, "1") for node in list(grid.get_node_ids())[:n]]
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
        batched = getattr(grid, "batched" if exchange == "train" else "evaluated", n)  # a ProcessGrid's: its workers'
        if engine == "cohort" and batched != n:
            raise RuntimeError(f"only {batched} of {n} {exchange} replies were batched")
        return seconds

    round_seconds(clients)
    if isinstance(grid, CohortGrid):
        grid.batched = grid.evaluated = 0
    if torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats()
    seconds = round_seconds(clients)
    peaks = [peak_memory(), *getattr(grid, "worker_peaks", [])]  # a ProcessGrid's: each process's, summed
    if isinstance(grid, ProcessGrid):
        grid.close()
    cuda = [p["cuda_max_allocated_mib"] for p in peaks if p["cuda_max_allocated_mib"] is not None]
    return {
        "model": model,
        "clients": clients,
        "engine": engine,
        **({"processes": processes} if engine == "cohort" else {}),
        "seconds": seconds,
        "peak_rss_mib": sum(p["rss_mib"] for p in peaks),
        "cuda_max_allocated_mib": sum(cuda) if cuda else None,
    }


def write_parquet_export(folder: Path, dataset: str, train: int, test: int = 64) -> None:
    """Synthetic uint8 images of `dataset`'s shape as a Hugging Face parquet export (PNG bytes, 10 labels)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    channels, height, width = SHAPES["mnist-embedded" if dataset == "mnist" else "cifar10"]
    image_col = "img" if dataset == "cifar10" else "image"  # dpcore.task.data_files._HUB's columns
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", train), ("test", test)):
        pixels = rng.integers(0, 256, (n, height, width, channels), dtype=np.uint8)
        images = []
        for x in pixels:
            png = io.BytesIO()
            Image.fromarray(x[..., 0] if channels == 1 else x).save(png, format="PNG")
            images.append({"bytes": png.getvalue(), "path": None})
        table = pa.table({image_col: images, "label": rng.integers(0, 10, n)})
        pq.write_table(table, folder / f"{split}-00000.parquet")


def launched_round(
    engine: str,
    model: str,
    clients: int,
    device: str,
    steps: int,
    samples: int,
    rounds: int,
    gpus: float | None,
    timeout: float,
    processes: int = 1,
) -> dict:
    """The dp-fedsam round through `python -m dpfl_tools.launch`: Flower's Ray simulation (`engine` ray) or the
    cohort engine in `processes` processes (cohort-run); `rounds` rounds, the seconds of round rounds - 1 from the
    run folder, the server's part included (None where the launch ran out of time or failed)."""
    from dpfl.fl_app.results import read_rounds
    from dpfl_tools import ROOT

    dataset = "mnist" if model == "cnn-mnist" else "cifar10"
    row = {"model": model, "clients": clients, "engine": engine, "seconds": None}
    row.update({"processes": processes} if engine == "cohort-run" else {})
    with tempfile.TemporaryDirectory(prefix="cohort-ray-") as tmp:
        data = Path(tmp, "data")
        write_parquet_export(data, dataset, -(-samples * clients * 10 // 9) + clients)  # 90/10 split per client
        overrides = (
            f"model='{model}' dataset='{dataset}' data-dir='{data}' device='{device}' local-steps={steps} "
            f"batch-size=32 secure-rng=false algorithm='dp-fedsam' num-rounds={rounds} eval-every={rounds} "
            "sample-rate=1.0 partitioner='iid'"
        )
        cmd = [sys.executable, "-m", "dpfl_tools.launch", "--clients", str(clients), "--results", str(Path(tmp, "r"))]
        cmd += ["-c", overrides] + (["--gpus-per-client", str(gpus)] if gpus is not None and engine == "ray" else [])
        cmd += ["--engine", "cohort", "--processes", str(processes)] if engine == "cohort-run" else []
        env = {**os.environ, "DPFL_CACHE_DIR": str(Path(tmp, "cache"))}
        log = Path(tmp, "launch.log")
        with log.open("w") as out:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGTERM)  # the launcher ends its SuperLink and Ray head
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                print(f"{engine} engine: {model} {clients} clients ran out of {timeout:.0f} s", file=sys.stderr)
                return row
        runs = [p.parent for p in Path(tmp, "r").glob("*/summary.json")]
        if proc.returncode != 0 or len(runs) != 1:
            tail = log.read_text()[-3000:]
            print(f"{engine} engine: launch exit code {proc.returncode}, run folders {runs}:\n{tail}", file=sys.stderr)
            return row
        rounds = read_rounds(runs[0])
    seconds = [r["seconds"] for r in rounds]
    trained = [r.get("clients") for r in rounds]  # each round's aggregated replies: all `clients` nodes
    return {**row, "seconds": seconds[-2] if len(seconds) > 1 else None, "round_seconds": seconds, "trained": trained}


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


BASELINES = {"cohort": (("inprocess", "sequential"), ("ray", "ray")), "cohort-run": (("ray", "ray"),)}


def print_ratios(rows: list[dict]) -> None:
    """Each cohort row's seconds over its baselines' (`BASELINES`), of one model and cohort size: the exchange
    over the sequential and the Ray round's, a cohort-run row (whole rounds through the launcher) over Ray's only,
    like for like."""
    other = {r["engine"]: r["seconds"] for r in rows if r["engine"] not in BASELINES}
    for row in rows:
        for engine, name in BASELINES.get(row["engine"], ()):
            if row["seconds"] and other.get(engine):
                processes = f" in {row['processes']} processes" if row["processes"] > 1 else ""
                ratio = row["seconds"] / other[engine]
                print(
                    f"{row['model']} {row['clients']} clients: {row['engine']}{processes} / {name} round = {ratio:.3f}x"
                )


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
    parser.add_argument(
        "--engines", default="inprocess,cohort", help="comma-separated: inprocess, cohort, ray, cohort-run"
    )
    parser.add_argument(
        "--processes", default="1", help="comma-separated: the cohort engine in each of these many processes"
    )
    parser.add_argument("--exchange", default="train", choices=("train", "evaluate"), help="the round's messages")
    parser.add_argument("--ray-rounds", type=int, default=3, help="ray, cohort-run: rounds per launch (at least 3)")
    parser.add_argument("--gpus-per-client", type=float, default=None, help="ray: the launcher's flag (default: its)")
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.cohorts = "cnn-mnist", "10,100"
    engines = args.engines.split(",")
    processes_list = [int(p) for p in args.processes.split(",") if p.isdigit() and int(p) >= 1]
    if len(processes_list) != len(args.processes.split(",")):
        parser.error(f"--processes {args.processes!r}: allowed are integers of at least 1, comma-separated")
    if unknown := set(engines) - {"inprocess", "cohort", *LAUNCHED}:
        parser.error(
            f"--engines {args.engines!r}: unknown {sorted(unknown)}; allowed: inprocess, cohort, ray, cohort-run"
        )
    if set(LAUNCHED) & set(engines) and (
        args.algorithm != "dp-fedsam" or args.ray_rounds < 3 or args.exchange != "train"
    ):
        parser.error(
            "--engines with ray or cohort-run: only --algorithm dp-fedsam, --exchange train and --ray-rounds of at "
            "least 3"
        )
    import torch

    rows = []
    for model in args.models.split(","):
        for clients in map(int, args.cohorts.split(",")):
            for engine in engines:
                if engine == "inprocess" and clients > args.sequential_max:
                    continue
                one_args = [model, clients, engine, args.device, args.local_steps, args.samples]
                for processes in processes_list if engine.startswith("cohort") else [1]:
                    if engine in LAUNCHED:
                        launch_args = [*one_args[:2], *one_args[3:], args.ray_rounds, args.gpus_per_client]
                        row = launched_round(engine, *launch_args, args.timeout, processes)
                    else:
                        extra = [args.algorithm, args.sample_rate, args.exchange, processes]
                        row = fresh([*one_args, *extra], args.timeout)
                    if row is None:
                        row = {"model": model, "clients": clients, "engine": engine, "seconds": None}
                        row.update({"processes": processes} if engine.startswith("cohort") else {})
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            print_ratios([r for r in rows if r["model"] == model and r["clients"] == clients])
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
