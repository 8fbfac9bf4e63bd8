"""DP-SGD step time versus plain SGD, per Opacus per-sample-gradient mode, on the papers' CNNs.

Both sides draw the same Poisson batches (expected size q * n) from the same synthetic
data; DP-SGD runs through `clients.dpsgd.dpsgd_steps` (what the ALI-DPFL client runs),
SGD through a plain forward/backward/step loop. The modes and SGD are interleaved and
the median of the repeats is reported, so load on the machine hits all alike.

    python -m benchmarks.dpsgd_bench [--batch 64] [--threads 1] [--repeats 5] [--models cnn-mnist ...]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
from opacus.utils.uniform_sampler import UniformWithReplacementSampler
from torch import nn

from dpfl.clients.dpsgd import dpsgd_steps
from dpfl.dpcore.privacy.dpsgd_noise import GRAD_SAMPLE_MODES
from dpfl.dpcore.task.models import build_model

MODELS = {"cnn-mnist": ((1, 28, 28), 30), "cnn-cifar10": ((3, 32, 32), 8)}  # input, steps per repeat


def sgd_steps(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int, sample_rate: float, generator: torch.Generator
) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model.train()
    for indices in UniformWithReplacementSampler(
        num_samples=len(y), sample_rate=sample_rate, generator=generator, steps=steps
    ):
        idx = torch.as_tensor(indices, dtype=torch.long)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        optimizer.step()


def time_per_step(run, steps: int) -> float:
    start = time.perf_counter()
    run()
    return (time.perf_counter() - start) / steps * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64, help="expected batch size q * n")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    n, q = 20 * args.batch, 0.05
    print(
        f"torch {torch.__version__}, {args.threads} thread(s), expected batch {args.batch} (q = {q}, n = {n}), "
        f"median of {args.repeats} repeats"
    )
    print(f"{'model':<12} {'mode':<10} {'ms/step':>9} {'x SGD':>7}")
    for name in args.models:
        shape, steps = MODELS[name]
        x, y = torch.randn(n, *shape), torch.randint(0, 10, (n,))
        runs = {"sgd": lambda m, g: sgd_steps(m, x, y, steps, q, g)}
        for mode in GRAD_SAMPLE_MODES:
            runs[mode] = (
                lambda mode: (
                    lambda m, g: dpsgd_steps(
                        m,
                        x,
                        y,
                        steps=steps,
                        sample_rate=q,
                        noise_multiplier=1.0,
                        clipping_norm=1.0,
                        lr=0.01,
                        grad_sample_mode=mode,
                        sampling_generator=g,
                    )
                )
            )(mode)
        runs["wavelet"] = lambda m, g: dpsgd_steps(  # DP-SGD-WAV: Haar-domain clipping and noise, hooks
            m,
            x,
            y,
            steps=steps,
            sample_rate=q,
            noise_multiplier=1.0,
            clipping_norm=1.0,
            lr=0.01,
            grad_sample_mode="hooks",
            sampling_generator=g,
            noise="wavelet",
        )
        times: dict[str, list[float]] = {k: [] for k in runs}
        for repeat in range(args.repeats + 1):  # the first repeat warms up
            for key, run in runs.items():
                model = build_model(name, shape, 10, seed=0)
                generator = torch.Generator().manual_seed(repeat)
                ms = time_per_step(lambda: run(model, generator), steps)
                if repeat:
                    times[key].append(ms)
        sgd = statistics.median(times["sgd"])
        for key, values in times.items():
            ms = statistics.median(values)
            print(f"{name:<12} {key:<10} {ms:>9.2f} {ms / sgd:>7.2f}")


if __name__ == "__main__":
    main()
