"""Thread limits: one CPU per simulated client, and numpy's BLAS on one thread everywhere the app runs."""

from __future__ import annotations

import os
from functools import cache


@cache
def limit_blas_threads() -> None:
    """numpy's BLAS (OpenBLAS in numpy's wheels) on 1 thread, process-wide, once per process.

    Its worker threads busy-wait after each call; with more runnable threads than cores (two simulated
    clients on 2 cores, or anything else running) they take the core that training needs. Measured with
    `benchmarks.flower_dp_baseline` under a 2-process CPU load: our DP-FedAvg at 1.59x Flower's seconds per
    round with 2 BLAS threads, 0.99x with 1 (1.01x and 0.95x without the load). The app's BLAS calls are
    vector dot products (norms, clipping, canary cosines), which gain nothing from threads. The libraries
    loaded now are limited through threadpoolctl; one loaded later (scipy's own OpenBLAS) reads
    OPENBLAS_NUM_THREADS when it loads, which is set for it (and inherited by processes started from here)."""
    from threadpoolctl import threadpool_limits

    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    threadpool_limits(limits=1, user_api="blas")


def one_thread_per_client() -> None:
    """A ClientApp call: torch and BLAS on one thread (one simulated client per CPU)."""
    import torch

    torch.set_num_threads(1)
    limit_blas_threads()


NODE_CPUS = "num-cpus"  # node config: the cores a SuperNode hosting several clients may train them on


def node_threads(node_config) -> int:
    """The torch threads of a SuperNode that trains its hosted clients as one cohort: the cores it was granted,
    never all the host's. Node config `num-cpus` where a deployed SuperNode sets it; in Flower's simulation, the
    CPUs Ray assigned the ClientApp's actor (`client-resources-num-cpus`, Ray's public runtime context); else 1."""
    import sys

    if NODE_CPUS in node_config:
        return max(1, int(node_config[NODE_CPUS]))
    ray = sys.modules.get("ray")  # only inside Ray's workers, where Flower's simulation imported it
    if ray is not None and ray.is_initialized():
        try:
            granted = ray.get_runtime_context().get_assigned_resources().get("CPU", 1)
        except Exception:  # the driver, or a worker outside a task or actor: no grant to read
            granted = 1
        return max(1, int(granted))
    return 1
