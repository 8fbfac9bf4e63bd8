"""CPU time of one client's cnn-mnist gradient: the sequential path's channels_last model, one client after the
other, against the cohort engine's two batched steps (vmap, and the CPU's grouped model in slices of GROUP).

    python -m benchmarks.cohort_step [--clients 10,100] [--groups 2,5,10,100] [--batch 32]

One torch thread; process time (not wall time: the machine is shared), the best of --reps, per client gradient,
for SGD (one evaluation) and SAM (two); the ratio lines divide by the sequential figure of the same run.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from torch.func import functional_call, grad_and_value, vmap

import dpfl.clients.cohort.grouped as grouped
from dpfl.dpcore.task.models import build_model


def best(f, reps: int) -> float:
    f()
    times = []
    for _ in range(reps):
        started = time.process_time()
        f()
        times.append(time.process_time() - started)
    return min(times)


def measure(n: int, groups: list[int], batch: int, reps: int) -> dict[str, float]:
    """Milliseconds of process time per client gradient for each engine's step."""
    torch.manual_seed(0)
    model = build_model("cnn-mnist", (1, 28, 28), 10)
    x, y, m = torch.randn(n, batch, 1, 28, 28), torch.randint(0, 10, (n, batch)), torch.ones(n, batch)
    w = {
        k: torch.stack([v.detach() + 0.01 * torch.randn_like(v) for _ in range(n)]) for k, v in model.named_parameters()
    }
    plain = copy.deepcopy(model).to(memory_format=torch.channels_last)

    def sequential():
        for i in range(n):
            for k, p in plain.named_parameters():
                p.data.copy_(w[k][i])
                p.grad = None
            out = plain(x[i].contiguous(memory_format=torch.channels_last))
            torch.nn.functional.cross_entropy(out, y[i]).backward()

    def loss_of(p, xi, yi, mi):
        ce = torch.nn.functional.cross_entropy(functional_call(model, p, (xi,)), yi, reduction="none")
        return (ce * mi).sum() / mi.sum()

    vmapped = vmap(grad_and_value(loss_of))
    ms = {"sequential": best(sequential, reps), "vmap": best(lambda: vmapped(w, x, y, m), reps)}
    for g in groups:
        grouped.GROUP = g
        step = grouped.grouped_step(model, "sgd", 0.0, (1, 28, 28))
        ms[f"grouped {g}"] = best(lambda: step(w, x, y, m), reps)
    return {k: 1e3 * v / n for k, v in ms.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", default="10,100")
    parser.add_argument("--groups", default="2,5,10,100")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    default = grouped.GROUP
    try:
        for n in map(int, args.clients.split(",")):
            ms = measure(n, [int(g) for g in args.groups.split(",")], args.batch, args.reps)
            print(f"{n} clients, ms of CPU per client gradient: " + ", ".join(f"{k} {v:.2f}" for k, v in ms.items()))
            print(f"{n} clients, / sequential: " + ", ".join(f"{k} {v / ms['sequential']:.2f}x" for k, v in ms.items()))
    finally:
        grouped.GROUP = default


if __name__ == "__main__":
    main()
