"""Torch helpers that the ServerApp and the clients share: model weights in and out,
evaluation, the loss gradient (ALI-DPFL's mu), and Opacus' layer fixes (imported lazily:
only DP-SGD needs Opacus).

Models may live on any device and in any memory layout (`dpcore.task.device`): weights come out as
C-contiguous CPU numpy arrays in state_dict order, and evaluation moves each batch to the model's device.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from dpfl.dpcore.task.device import model_device
from dpfl.dpcore.task.opacus_import import import_opacus


def get_weights(model: nn.Module) -> list[np.ndarray]:
    """The model's state as C-contiguous CPU numpy arrays, in state_dict order (whatever its device and layout)."""
    return [v.detach().cpu().numpy().copy() for v in model.state_dict().values()]


def set_weights(model: nn.Module, arrays: list[np.ndarray]) -> None:
    keys = list(model.state_dict().keys())
    if len(keys) != len(arrays):
        raise ValueError(f"model has {len(keys)} tensors, received {len(arrays)} arrays")
    model.load_state_dict({k: host_tensor(a) for k, a in zip(keys, arrays)}, strict=True)


def as_tensors(dataset, index: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) of `dataset[index]` as float32 and int64 CPU tensors; they share memory with writable arrays (a
    read-only, memory-mapped array is copied: only the slice asked for)."""
    return host_tensor(dataset.x[index], np.float32), host_tensor(dataset.y[index], np.int64)


def host_tensor(array: np.ndarray, dtype=None) -> torch.Tensor:
    """A CPU tensor of `array` (as `dtype`): its memory where writable, a copy of a read-only array (torch does not
    support read-only memory; the cohort engine's shared arrays and memory-mapped data are read-only)."""
    array = np.asarray(array, dtype=dtype)
    return torch.from_numpy(array if array.flags.writeable else array.copy())


@torch.no_grad()
def evaluate_model(model: nn.Module, dataset, batch_size: int = 512) -> tuple[float, float]:
    """(mean cross-entropy loss, accuracy) of `model` on `dataset`."""
    model.eval()
    device = model_device(model)
    n = len(dataset.y)
    if n == 0:
        return math.nan, math.nan
    loss, correct = 0.0, 0
    for i in range(0, n, batch_size):
        x, y = as_tensors(dataset, slice(i, i + batch_size))
        labels = y.to(device)
        out = model(x.to(device))
        loss += nn.functional.cross_entropy(out, labels, reduction="sum").item()
        correct += (out.argmax(1) == labels).sum().item()
    return loss / n, correct / n


def opacus_compatible(model: nn.Module) -> nn.Module:
    """`model`, or Opacus' fix of it (e.g. BatchNorm -> GroupNorm); raises if Opacus still rejects it.

    The server applies the same function to the global model so both sides share one layout.
    """
    import_opacus()
    from opacus.validators import ModuleValidator

    if ModuleValidator.is_valid(model):
        return model
    fixed = ModuleValidator.fix(model)
    errors = ModuleValidator.validate(fixed, strict=False)
    if errors:
        raise ValueError(f"model is not supported by Opacus DP-SGD even after ModuleValidator.fix: {errors}")
    return fixed


def loss_gradient(model: nn.Module, dataset, max_samples: int = 0, batch_size: int = 512) -> np.ndarray:
    """grad F(w) = gradient of the mean cross-entropy on `dataset` (its first `max_samples`), flat float64."""
    x, y = as_tensors(dataset, slice(0, max_samples if max_samples > 0 else None))
    model.eval()
    model.zero_grad(set_to_none=True)
    device = model_device(model)
    for i in range(0, len(y), batch_size):
        out = model(x[i : i + batch_size].to(device))
        loss = nn.functional.cross_entropy(out, y[i : i + batch_size].to(device), reduction="sum")
        (loss / len(y)).backward()
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
    out = torch.cat([g.reshape(-1) for g in grads]).double().cpu().numpy()
    model.zero_grad(set_to_none=True)
    return out
