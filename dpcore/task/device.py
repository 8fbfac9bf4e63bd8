"""Where torch computes: the `device` run-config key, and the tensor layout of the models on it.

`device` is `auto` (CUDA when torch sees a CUDA device, else the CPU), `cpu`, `cuda` (torch's current CUDA
device) or `cuda:N`. `device_problem` says why a value cannot be used in this process (the run config is
checked with it at start-up); `resolve_device` turns a value into a `torch.device`. Models train and evaluate
there; what goes on the wire stays CPU numpy arrays (`dpcore.task.torch_helpers.get_weights`).

channels_last: on the CPU, convolutions of the MNIST and CIFAR CNNs run faster with the model and the
input in torch's channels_last memory format (`python -m benchmarks.channels_last` measures the ratio per
model; `CHANNELS_LAST_MODELS` lists those where an SGD and a SAM step were both more than 1.1x faster).
Only the layout in memory changes: shapes, parameter order and the arrays sent are the same. Opacus' `ew`
per-sample gradients fail on channels_last convolutions, so DP-SGD clients keep the plain layout.
"""

from __future__ import annotations

import itertools
import re

import torch
from torch import nn

DEVICE_CHOICES = "auto, cpu, cuda, cuda:N"
_DEVICE = re.compile(r"auto|cpu|cuda(?::(\d+))?")

# Models whose SGD and SAM steps on the CPU were both > 1.1x faster in channels_last
# (benchmarks/output/channels_last.txt; python -m benchmarks.channels_last).
CHANNELS_LAST_MODELS = frozenset({"cnn-mnist", "cnn-emnist", "cnn-cifar10", "cnn-cifar10-dp2"})


def device_problem(spec: str) -> str | None:
    """Why `spec` cannot be used as the device in this process (None: it can)."""
    match = _DEVICE.fullmatch(spec) if isinstance(spec, str) else None
    if match is None:
        return f"must be one of: {DEVICE_CHOICES}"
    if not spec.startswith("cuda"):
        return None
    if not torch.cuda.is_available():
        return (
            "CUDA was asked for, but torch sees no CUDA device here (torch.cuda.is_available() is False: "
            f"no GPU, no driver, or a CPU build of torch {torch.__version__}); use 'auto' or 'cpu'"
        )
    count = torch.cuda.device_count()
    if match.group(1) is not None and int(match.group(1)) >= count:
        return (
            f"CUDA device {match.group(1)} is out of range: torch sees {count} CUDA device(s), "
            f"cuda:0 to cuda:{count - 1}"
        )
    return None


def resolve_device(spec: str | torch.device) -> torch.device:
    """The torch.device of a `device` value (`auto`: CUDA when available, else CPU); raises ValueError
    naming the value and what is allowed when it cannot be used here."""
    if isinstance(spec, torch.device):
        return spec
    problem = device_problem(spec)
    if problem:
        raise ValueError(f"device={spec!r}: {problem}")
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(spec)


def use_channels_last(model_name: str, device: torch.device) -> bool:
    """Whether a client that does not run Opacus trains `model_name` in channels_last on `device`
    (measured on the CPU only; on CUDA the plain layout is kept)."""
    return device.type == "cpu" and model_name in CHANNELS_LAST_MODELS


def place_model(model: nn.Module, device: torch.device, channels_last: bool = False) -> nn.Module:
    """`model` moved to `device`, its 4-d parameters in channels_last when asked (in place; returned). A model
    already placed so is returned as it is, without the walk over its modules that `Module.to` takes even then
    (the cohort engine builds each client around one module: 0.16 ms against 0.04 ms a client, cnn-mnist)."""
    if is_placed(model, device, channels_last):
        return model
    model = model.to(device)
    return model.to(memory_format=torch.channels_last) if channels_last else model


def is_placed(model: nn.Module, device: torch.device, channels_last: bool = False) -> bool:
    """Whether every parameter and buffer of `model` is on `device` (plain "cuda": the current CUDA device, as
    `Module.to` reads it) and, with `channels_last`, every 4-d one in that layout (none 5-d: `Module.to` decides)."""
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    tensors = list(itertools.chain(model.parameters(), model.buffers()))
    laid_out = not channels_last or all(
        t.dim() < 4 or (t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last)) for t in tensors
    )
    return laid_out and all(t.device == device for t in tensors)


def place_input(x: torch.Tensor, device: torch.device, channels_last: bool = False) -> torch.Tensor:
    """A batch of inputs on `device`; images (4-d) in channels_last when asked."""
    x = x.to(device, non_blocking=True)
    return x.contiguous(memory_format=torch.channels_last) if channels_last and x.dim() == 4 else x


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter or buffer (the CPU for a model with neither)."""
    first = next(itertools.chain(model.parameters(), model.buffers()), None)
    return torch.device("cpu") if first is None else first.device
