"""SGD and SAM step times on the CPU, plain layout against torch.channels_last, for every conv model.

    python -m benchmarks.channels_last [--batch-size 32] [--repeats 100] [--out FILE]

Per model of `dpcore.task.models` with convolutions, on its dataset's input shape (MNIST 1x28x28 for the
MNIST/EMNIST CNNs, CIFAR 3x32x32 for the others), batch 32, one torch thread (one simulated client per
core): the median time of an SGD step (`clients.base.sgd_step` with `LocalSGD`) and of a SAM step
(`clients.sam.sam_step`), with model and input in the plain layout and in channels_last, the two layouts'
steps alternating one by one so that a change in the machine's load hits both. Prints plain / channels_last
per model and step (> 1: channels_last is faster) and whether both exceed 1.1x, the rule that
`dpcore.task.device.CHANNELS_LAST_MODELS` follows.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from dpfl.clients.base import LocalSGD, sgd_step
from dpfl.clients.sam import sam_step
from dpfl.dpcore.task.catalogue import dataset_info
from dpfl.dpcore.task.device import CHANNELS_LAST_MODELS, place_input, place_model
from dpfl.dpcore.task.models import MODELS, build_model

THRESHOLD = 1.1  # channels_last is taken where both steps are faster by more than this
DATASET_OF = {
    "cnn-mnist": "mnist",
    "cnn-emnist": "emnist",
    "cnn-cifar10": "cifar10",
    "cnn-cifar10-dp2": "cifar10",
    "resnet18-gn": "cifar10",
}


def conv_models() -> list[str]:
    """The models of the zoo that have a convolution."""

    def has_conv(name: str) -> bool:
        info = dataset_info(DATASET_OF.get(name, "mnist"))
        model = build_model(name, info["input_shape"], info["num_classes"])
        return any(isinstance(m, nn.Conv2d) for m in model.modules())

    return [name for name in MODELS if has_conv(name)]


def stepper(name: str, step: str, channels_last: bool, batch_size: int):
    """A function that runs one `step` ("sgd" or "sam") of `name` on a fixed batch, in the given layout."""
    info = dataset_info(DATASET_OF[name])
    cpu = torch.device("cpu")
    model = place_model(build_model(name, info["input_shape"], info["num_classes"]), cpu, channels_last)
    generator = torch.Generator().manual_seed(0)
    x = place_input(torch.randn(batch_size, *info["input_shape"], generator=generator), cpu, channels_last)
    y = torch.randint(0, info["num_classes"], (batch_size,), generator=generator)
    optimizer = LocalSGD(model.parameters(), lr=0.01, momentum=0.5, weight_decay=5e-4)
    loss_fn = nn.CrossEntropyLoss()
    if step == "sgd":
        return lambda: sgd_step(model, loss_fn, x, y, optimizer)
    return lambda: sam_step(model, loss_fn, x, y, optimizer, 0.05)


def timed(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def measure(name: str, batch_size: int, repeats: int) -> dict:
    """{"sgd": plain / channels_last, "sam": ..., and the median step times in ms}: the two layouts' steps
    alternate one by one (after two warm-up steps each), so that a change in the machine's load hits both."""
    out = {}
    for step in ("sgd", "sam"):
        plain, last = stepper(name, step, False, batch_size), stepper(name, step, True, batch_size)
        for run in (plain, last, plain, last):
            run()
        pairs = [(timed(plain), timed(last)) for _ in range(repeats)]
        p, c = statistics.median(a for a, _ in pairs), statistics.median(b for _, b in pairs)
        out[f"{step}_ms"], out[step] = (1000 * p, 1000 * c), p / c
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=100, help="steps per layout (resnet18-gn: 5)")
    parser.add_argument("--models", nargs="*", default=None, help="default: every model with a convolution")
    parser.add_argument("--out", default="", help="also write the table to this file")
    args = parser.parse_args()
    torch.set_num_threads(1)
    lines = [
        f"machine: {platform.machine()}, torch {torch.__version__} (1 thread), batch {args.batch_size}, "
        f"median of {args.repeats} alternating steps per layout (resnet18-gn: 5); ratio = plain / channels_last (> 1: channels_last faster)",
        f"{'model':<16} {'SGD plain ms':>12} {'SGD cl ms':>10} {'SGD ratio':>9} {'SAM plain ms':>12} "
        f"{'SAM cl ms':>10} {'SAM ratio':>9}  take (> {THRESHOLD}x both)  in CHANNELS_LAST_MODELS",
    ]
    print("\n".join(lines), flush=True)
    for name in args.models or conv_models():
        r = measure(name, args.batch_size, min(args.repeats, 5) if name == "resnet18-gn" else args.repeats)
        take = r["sgd"] > THRESHOLD and r["sam"] > THRESHOLD
        lines.append(
            f"{name:<16} {r['sgd_ms'][0]:12.2f} {r['sgd_ms'][1]:10.2f} {r['sgd']:8.2f}x "
            f"{r['sam_ms'][0]:12.2f} {r['sam_ms'][1]:10.2f} {r['sam']:8.2f}x  {'yes' if take else 'no':<19}"
            f" {'yes' if name in CHANNELS_LAST_MODELS else 'no'}"
        )
        print(lines[-1], flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
