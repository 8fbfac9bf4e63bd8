"""What each simulated client asks Ray for: one CPU, and a share of the GPUs where there are any.

Flower's simulation runs a ClientApp in a Ray actor that holds `client-resources-num-cpus` CPUs and
`client-resources-num-gpus` GPUs (a fraction shares one GPU between actors; Ray sets each actor's
CUDA_VISIBLE_DEVICES to the GPU it got). With c CPUs per client, at most min(clients, CPUs / c) clients run
at once (one Ray worker process each, about 1 GB of resident memory with torch), so `gpus / that` per client
lets all of them share the GPUs. `--cpus-per-client` (default 1) trades clients at once for memory. `dpfl_tools.launch` passes the result in
`--federation-config`, and `--gpus-per-client` overrides it; with plain `flwr run`, pass
`--federation-config "num-supernodes=N client-resources-num-cpus=1 client-resources-num-gpus=0.25"`.
"""

from __future__ import annotations

import glob
import os


def visible_gpus() -> int:
    """CUDA devices torch sees here (0 at once, without importing torch, where no NVIDIA device node exists)."""
    if not glob.glob("/dev/nvidia[0-9]*") and not os.path.exists("/dev/kfd"):  # kfd: ROCm's torch.cuda
        return 0
    import torch

    return torch.cuda.device_count()


def default_gpus_per_client(clients: int, gpus: int, cpus: int, cpus_per_client: int = 1) -> float:
    """GPUs per client so that the clients that run at once (`cpus_per_client` CPUs each) share the `gpus`
    evenly; 0 without GPUs. At most 1 (a client never holds more than one GPU)."""
    if gpus <= 0 or clients <= 0:
        return 0.0
    at_once = max(1, min(clients, cpus // max(1, cpus_per_client)))
    return min(1.0, gpus / at_once)


def gpu_share_problem(share: float, gpus: int) -> str | None:
    """Why `share` GPUs per client cannot be asked of Ray with `gpus` GPUs here (None: it can)."""
    if not share >= 0:
        return f"--gpus-per-client {share!r}: must be >= 0"
    if share > 0 and gpus == 0:
        return (
            f"--gpus-per-client {share!r}: no GPU is visible here (torch sees no CUDA device), so Ray could "
            "never start a client; use 0 or leave it out"
        )
    if share > 1 and share != int(share):
        return f"--gpus-per-client {share!r}: above 1 Ray takes whole GPUs only"
    if share > gpus > 0:
        return f"--gpus-per-client {share!r}: more than the {gpus} GPU(s) visible here"
    return None


def gpus_per_client(requested: float | None, clients: int, run_config: str, cpus_per_client: int = 1) -> float:
    """The GPUs each simulated client asks for: `requested` (checked), else the default share when the run's
    `device` (in the launch's run-config overrides) may use CUDA ('cpu': none). Raises SystemExit with the
    reason for a share Ray cannot give. Without a GPU and a request it reads nothing (no Flower import)."""
    gpus = visible_gpus()
    if requested is None:
        if gpus == 0 or run_device(run_config) == "cpu":
            return 0.0
        return default_gpus_per_client(clients, gpus, os.cpu_count() or 1, cpus_per_client)
    if problem := gpu_share_problem(requested, gpus):
        raise SystemExit(problem)
    return float(requested)


def run_device(run_config: str) -> str:
    """The `device` a launch's run-config overrides ('key=value ...') set, else the default 'auto'."""
    from flwr.common.config import parse_config_args

    return str(parse_config_args([run_config]).get("device", "auto")) if run_config.strip() else "auto"


def federation_config(clients: int, gpus_per_client: float = 0.0, cpus_per_client: int = 1) -> str:
    """`flwr run --federation-config` for `clients` simulated clients with their CPUs and GPU share."""
    config = f"num-supernodes={clients} client-resources-num-cpus={cpus_per_client}"
    return f"{config} client-resources-num-gpus={gpus_per_client:.6g}" if gpus_per_client > 0 else config
