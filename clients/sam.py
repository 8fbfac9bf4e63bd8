"""SAM local optimizer (DP-FedSAM paper, Algorithm 1 Option I; docs/algorithms.md §2)."""

from __future__ import annotations

import torch
from torch import nn

from .base import Optimizer, TrainingClient


def sam_step(model: nn.Module, loss_fn, x: torch.Tensor, y: torch.Tensor, optimizer: Optimizer, rho: float) -> float:
    """One SAM step on the parameters that require grad.

    g = grad F(w); e = rho g / (||g||_2 + 1e-12); g~ = grad F(w + e); restore w;
    the optimizer (momentum, weight decay) steps with g~. Returns F(w) on the batch.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    loss = loss_fn(model(x), y)
    grads = torch.autograd.grad(loss, params)
    grad_norm = torch.sqrt(sum((g * g).sum() for g in grads))
    scale = rho / (grad_norm + 1e-12)
    perturbations = [g * scale for g in grads]
    with torch.no_grad():
        for p, e in zip(params, perturbations):
            p.add_(e)
    optimizer.zero_grad()
    loss_fn(model(x), y).backward()
    with torch.no_grad():
        for p, e in zip(params, perturbations):
            p.sub_(e)
    optimizer.step()
    return float(loss.item())


class SAMClient(TrainingClient):
    """DP-FedSAM client: local SAM with radius rho (paper default 0.5)."""

    def __init__(self, *args, rho: float = 0.5, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rho = rho

    def local_step(self, x, y, optimizer):
        return sam_step(self.model, self.loss_fn, x, y, optimizer, self.rho)
