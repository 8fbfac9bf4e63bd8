"""The cohort engine's CPU step: a cohort's gradients as one grouped model, without vmap.

Under `torch.func.vmap` a convolution whose weights differ per client already runs as one grouped convolution
over the clients' channels, but vmap then moves the client dimension back into the batch dimension around every
max-pool, ReLU and reshape: layout copies and NCHW pooling kernels that cost more on the CPU than the
convolutions (docs/performance.md, "The cohort engine"). Here the activations stay in the grouped layout from
the input to the flatten, channels_last, so pooling and activations run on one plain tensor:

    image layers:  x[B, N*C, H, W] (channels_last, client i owns channels i*C .. i*C + C - 1)
        Conv2d:    conv2d(x, W[N*O, C, k, k], b[N*O], groups=N)        (one grouped convolution)
        ReLU, MaxPool2d, Upsample, Identity: as they are               (per channel: no client's channels mix)
        Flatten:   none: the next Linear reads x per client in (H, W, C) order, its columns permuted to match
    dense layers:  h[N, B, F]
        Linear:    h @ W[N]^T + b[N]                                   (one batched matmul)

and the gradients are plain autograd of sum_i F_i(w_i) over the stacked parameters w[N, ...]: F_j does not
depend on w_i for j != i, so the gradient's row i is grad F_i(w_i), each client's own. SAM's two evaluations
take the per-client norm of the first gradient over all of that client's parameters.

The forward is the model's layers in order (`grouped_layers`: plain functions of the stacked parameters).
Only models built from the layers above (in `nn.Sequential` or the zoo's `ConvNet`, which run their children in
order) qualify, and only after the grouped forward matched the model's own on random weights of two clients;
any other model (e.g. GroupNorm's ResNet) keeps the vmap step. Gradients in slices of GROUP clients.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn
from torch.func import functional_call

from dpfl.dpcore.task.models import ConvNet

ELEMENTWISE = (nn.ReLU, nn.MaxPool2d, nn.Upsample, nn.Identity)  # per sample and channel: same in grouped layout
CONTAINERS = (nn.Sequential, ConvNet)  # whose forward runs their children in registration order
GROUP = 5  # clients per grouped forward and backward (benchmarks/cohort_step.py: 5 beat 2, 10, 25 and 100 here)

Layer = Callable[[torch.Tensor, dict], torch.Tensor]  # (activations, stacked parameters) -> activations


def conv2d(conv: nn.Conv2d, name: str, x: torch.Tensor, w: dict) -> torch.Tensor:
    """A Conv2d over N clients' stacked weights [N, O, C, k, k] as one grouped convolution (formula: module doc)."""
    weight, bias = w[name + ".weight"], w.get(name + ".bias")
    return nn.functional.conv2d(
        x,
        weight.flatten(0, 1),
        None if bias is None else bias.flatten(),
        conv.stride,
        conv.padding,
        conv.dilation,
        groups=weight.shape[0],
    )


def linear(name: str, h: torch.Tensor, w: dict) -> torch.Tensor:
    """A Linear over N clients' stacked weights [N, O, F]: h[N, B, F] -> b[N, 1, O] + h @ W^T, one baddbmm.

    A grouped image h[B, N*C, H, W] (the Flatten before it left it as it is) is read in its channels_last order
    (H, W, C) per client, and W's columns are permuted from nn.Flatten's (C, H, W) order to match: the same
    products as W @ flatten(h_i), without a layout copy of h in the backward pass."""
    weight, bias = w[name + ".weight"], w.get(name + ".bias")
    n, o = weight.shape[:2]
    if h.dim() == 4:
        bs, nc, hh, ww = h.shape
        c = nc // n
        h = h.permute(0, 2, 3, 1).reshape(bs, hh * ww, n, c).permute(2, 0, 1, 3).reshape(n, bs, -1)
        weight = weight.view(n, o, c, hh, ww).permute(0, 1, 3, 4, 2).reshape(n, o, -1)
    return (
        torch.baddbmm(bias[:, None, :], h, weight.transpose(1, 2)) if bias is not None else h @ weight.transpose(1, 2)
    )


def same(module: nn.Module, x: torch.Tensor, w: dict) -> torch.Tensor:
    return module.forward(x)


def grouped_layers(model: nn.Module) -> list[Layer] | None:
    """`model`'s layers in the order its forward runs them, each as a function of the grouped layout; None where
    a layer does not qualify (`matches` then checks the order against the model's own forward)."""
    if type(model) not in CONTAINERS:
        return None
    layers: list[Layer] = []
    owners = []  # the layers that own parameters: every parameter must be one of theirs
    for name, module in model.named_modules(remove_duplicate=False):
        if type(module) in CONTAINERS:
            continue
        if type(module) is nn.Conv2d and module.padding_mode == "zeros" and module.groups == 1:
            layers.append(partial(conv2d, module, name))
            owners.append(name)
        elif type(module) is nn.Linear:
            layers.append(partial(linear, name))
            owners.append(name)
        elif type(module) is nn.Flatten and (module.start_dim, module.end_dim) == (1, -1):
            continue  # the next Linear reads the grouped image
        elif type(module) in ELEMENTWISE:
            layers.append(partial(same, module))
        else:
            return None
    owned = {f"{o}.{k}" for o in owners for k, _ in model.get_submodule(o).named_parameters()}
    return layers if owned == {k for k, _ in model.named_parameters()} else None


def grouped_step(model: nn.Module, rule: str, rho: float, sample: tuple) -> Callable | None:
    """The vmap step's stand-in: step(w, x, y, m) -> (each client's gradient, each client's loss), for stacked
    parameters w {name: [N, ...]}, minibatches x [N, B, *sample], labels y and mask m [N, B]; rule 'sgd'
    (grad F_i) or 'sam' (grad F_i(w + rho g0 / (||g0||_2 + 1e-12)), g0 = grad F_i(w)). None: the model does not
    qualify (a layer not listed, or its grouped forward differs from the plain one)."""
    layers = grouped_layers(model)
    if layers is None:
        return None

    def forward(w: dict, x: torch.Tensor) -> torch.Tensor:
        """Logits [N, B, K] of each client's minibatch under its own weights."""
        n, b = x.shape[:2]
        if x.dim() == 5:  # [N, B, C, H, W] -> [B, N*C, H, W], channels_last
            x = x.transpose(0, 1).reshape(b, n * x.shape[2], *x.shape[3:]).contiguous(memory_format=torch.channels_last)
        for layer in layers:
            x = layer(x, w)
        return x

    if not matches(model, forward, sample):
        return None

    def grads(w: dict, x, y, m) -> tuple[dict, torch.Tensor]:
        w = {k: v.detach().requires_grad_(True) for k, v in w.items()}
        n, b = y.shape
        ce = nn.functional.cross_entropy(forward(w, x).reshape(n * b, -1), y.reshape(-1), reduction="none")
        loss = (ce.view(n, b) * m).sum(1) / m.sum(1).clamp(min=1)
        return dict(zip(w, torch.autograd.grad(loss.sum(), list(w.values())))), loss.detach()

    def sam(w: dict, x, y, m) -> tuple[dict, torch.Tensor]:
        g0, loss = grads(w, x, y, m)
        scale = rho / (torch.sqrt(sum(g.flatten(1).square().sum(1) for g in g0.values())) + 1e-12)
        g, _ = grads({k: w[k] + g0[k] * scale.view(-1, *[1] * (g0[k].dim() - 1)) for k in w}, x, y, m)
        return g, loss

    one = sam if rule == "sam" else grads

    def step(w: dict, x, y, m) -> tuple[dict, torch.Tensor]:
        """`one` over slices of GROUP clients (their activations stay in the CPU's cache), concatenated."""
        n = y.shape[0]
        if n <= GROUP:
            return one(w, x, y, m)
        parts = [
            one({k: v[s : s + GROUP] for k, v in w.items()}, *(t[s : s + GROUP] for t in (x, y, m)))
            for s in range(0, n, GROUP)
        ]
        return {k: torch.cat([g[k] for g, _ in parts]) for k in w}, torch.cat([loss for _, loss in parts])

    return step


def matches(model: nn.Module, forward: Callable, sample: tuple, n: int = 2, b: int = 3) -> bool:
    """Whether the grouped forward of n clients' random weights equals each client's plain forward (to 1e-4 of
    its largest logit: float32 rounding; a wrong layer order or layout is off by far more)."""
    gen = torch.Generator().manual_seed(0)
    params = dict(model.named_parameters())
    device = next(iter(params.values())).device
    w = {k: torch.randn((n, *v.shape), generator=gen).to(device) * 0.1 for k, v in params.items()}
    x = torch.randn((n, b, *sample), generator=gen).to(device)
    try:
        with torch.no_grad():
            got = forward(w, x)
            want = torch.stack([functional_call(model, {k: v[i] for k, v in w.items()}, (x[i],)) for i in range(n)])
    except Exception:  # e.g. a shape the grouped layers do not take: not this model
        return False
    return got.shape == want.shape and float((got - want).abs().max()) <= 1e-4 * float(want.abs().max()) + 1e-6
