"""The cohort engine's DP-SGD: a round of ALI-DPFL's clients (clients/dpsgd.py `DPSGDClient`) trained together.

`dpfl_tools.cohort.CohortGrid` hands this module the train messages whose client is a `DPSGDClient` (Opacus'
ew, hooks, functorch or ghost clipping: the clipped sum below is what each of them computes; ghost clipping gets
there without per-sample gradients, which the batch holds within its memory budget). Each client plans its round as
`DPSGDClient.fit` does (`plan_round`: its ledger from Context.state, the steps its budget allows, its learning
rate and its generators), the chunk of clients takes its steps at once, and each reply is the client's own
`finish_round` (ledger charged with the steps taken, saved to Context.state, mu release, metrics), run when the
grid answers the node, so a node that fails before it answers charges nothing, as in the sequential path.

Per client i with data D_i, rate q, clipping norm C, noise multiplier sigma and step t < steps_i (the rule of
`dpsgd_steps` on Opacus' DPOptimizer, drawn from the client's generators in Opacus' order):

    B = {s : u_s < q},  u = torch.rand(|D_i|, generator=sampling_i)      (UniformWithReplacementSampler)
    g_s = grad l(w_i; s) for s in B: vmap over clients of vmap over samples of grad (torch.func)
    sum_s min(1, C / (||g_s||_2 + 1e-6)) g_s + N(0, sigma^2 C^2), per parameter in order from noise_i
    divided by q |D_i| (the expected batch size); then SGD with momentum and weight decay (clients/base.py).

DP-SGD-WAV (`noise = "wavelet"`, `HaarDPOptimizer`): factor min(1, C / (||H(g_s)||_2 + 1e-12)) on the Haar
coefficients, and `haar_wavelet_noise` from the client's numpy generator on all parameters as one vector.
Ragged clients: a step's batches are padded to the chunk's largest with mask 0, and a client past its last
step keeps its weights and momentum. Replies equal the Opacus path's to float32 rounding (tests/test_cohort.py).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from flwr.app import Message
from torch.func import functional_call, grad, vmap

from dpfl.clients.cohort.tensors import sgd_update, stacked, unstacked
from dpfl.dpcore.privacy.mechanisms import haar_coefficient_norms, haar_wavelet_noise
from dpfl.dpcore.task.torch_helpers import as_tensors


def train_dpsgd_cohort(messages: list[Message], params: list, clients: list, size: int) -> dict:
    """{id(message): handler(msg, context) -> its train reply}: the DP-SGD steps from each message's `params` in
    chunks of `size` clients run now, each client's `finish_round` (ledger, metrics) when the handler runs."""
    from dpfl.clients.adapter import config_of, fit_reply

    plans = [c.plan_round(config_of(m)) for c, m in zip(clients, messages)]
    order = sorted(range(len(messages)), key=lambda i: -plans[i].steps)  # similar step counts share a chunk
    new: dict[int, list[np.ndarray]] = {}
    for start in range(0, len(order), size):
        chunk = order[start : start + size]
        trained = dpsgd_chunk(
            clients[0].model, [clients[i] for i in chunk], [plans[i] for i in chunk], [params[i] for i in chunk]
        )
        new.update(zip(chunk, trained))

    def handler(i: int):
        def reply(msg: Message, _context) -> Message:
            try:
                return fit_reply(msg, clients[i].finish_round(params[i], new[i], plans[i].steps, plans[i]))
            finally:  # the mu release evaluates the shared module; Opacus' validator wants it in training mode
                clients[i].model.train()

        return reply

    return {id(m): handler(i) for i, m in enumerate(messages)}


def poisson_rows(clients: list) -> int:
    """Rows of a step's padded batch to plan memory for: the largest expected Poisson batch q |D_i| plus four
    standard deviations (the chunk size: `dpfl.clients.cohort.train.chunk_size`)."""
    mean = max(c.sample_rate * len(c.trainset) for c in clients)
    return math.ceil(mean + 4 * math.sqrt(mean) + 1)


def dpsgd_chunk(model: torch.nn.Module, clients: list, plans: list, params: list) -> list[list[np.ndarray]]:
    """The DP-SGD steps of `clients` at once (formulas: the module docstring); each client's new weights."""
    device = clients[0].device
    names = [k for k, _ in model.named_parameters()]
    w = stacked(names, [dict(zip(names, p)) for p in params], device)
    data = [as_tensors(c.trainset) for c in clients]
    steps = torch.tensor([plan.steps for plan in plans], device=device)
    lr = torch.tensor([plan.lr for plan in plans], device=device)
    expected = torch.tensor([c.sample_rate * len(c.trainset) for c in clients], device=device)
    first = clients[0]
    mu, wd, clip, wavelet = first.momentum, first.weight_decay, first.clipping_norm, first.noise == "wavelet"
    std = first.mechanism_multiplier * clip

    def sample_loss(p, x, y):
        out = functional_call(model, p, (x.unsqueeze(0),))
        return torch.nn.functional.cross_entropy(out, y.unsqueeze(0), reduction="sum")

    per_sample = vmap(vmap(grad(sample_loss), in_dims=(None, 0, 0)))  # over clients, over samples
    model.train()
    b: dict[str, torch.Tensor] = {}
    for t in range(max((plan.steps for plan in plans), default=0)):
        active = steps > t
        batches = [poisson_batch(c, plan, d) if plan.steps > t else None for c, plan, d in zip(clients, plans, data)]
        x, y, m = padded(batches, data, device)
        g = per_sample(w, x, y)  # {k: (n, B, *shape)}
        if wavelet:
            summed = haar_clipped_sums(g, m, clip, [plan.wavelet_rng for plan in plans], std, active)
        else:
            norms = torch.stack([g[k].flatten(2).norm(2, dim=-1) for k in names], dim=2).norm(2, dim=2)
            factor = (clip / (norms + 1e-6)).clamp(max=1.0) * m
            summed = {k: torch.einsum("nb,nb...->n...", factor, g[k]) for k in names}
            summed = gaussian_noised(summed, std, [plan.noise_generator for plan in plans], active, first.secure_rng)
        noisy_mean = {k: v / expected.view(-1, *[1] * (v.dim() - 1)) for k, v in summed.items()}  # / (q |D_i|)
        ragged = t >= min(plan.steps for plan in plans)
        w, b = sgd_update(w, b, noisy_mean, t, active if ragged else None, lr, mu, wd)
    return unstacked(w)


def poisson_batch(client, plan, data) -> torch.Tensor:
    """The step's Poisson batch of one client: Opacus' UniformWithReplacementSampler on its generator."""
    return (torch.rand(len(data[1]), generator=plan.sampling_generator) < client.sample_rate).nonzero().reshape(-1)


def padded(batches: list, data: list, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each client's batch (None: past its last step) as (x, y, mask) of the largest batch's rows, zero-padded."""
    rows = max([1] + [len(idx) for idx in batches if idx is not None])
    sample = tuple(data[0][0].shape[1:])
    x = torch.zeros((len(batches), rows, *sample), device=device)
    y = torch.zeros((len(batches), rows), dtype=torch.long, device=device)
    m = torch.zeros((len(batches), rows), device=device)
    for i, (idx, (xi, yi)) in enumerate(zip(batches, data)):
        if idx is not None and len(idx):
            x[i, : len(idx)], y[i, : len(idx)], m[i, : len(idx)] = xi[idx].to(device), yi[idx].to(device), 1.0
    return x, y, m


def gaussian_noised(summed: dict, std: float, generators: list, active: torch.Tensor, secure: bool) -> dict:
    """summed + N(0, std^2) per active client, drawn parameter by parameter from its generator as Opacus'
    DPOptimizer draws it (secure mode: one discarded draw, then the sum of four over 2)."""
    noise = {k: torch.zeros_like(v) for k, v in summed.items()}
    for i, generator in enumerate(generators):
        if not bool(active[i]):
            continue
        for k, v in summed.items():
            shape, device = v.shape[1:], v.device
            if secure:
                torch.normal(mean=0, std=std, size=(1, 1), device=device, generator=generator)
                draws = sum(
                    torch.normal(mean=0, std=std, size=shape, device=device, generator=generator) for _ in range(4)
                )
                noise[k][i] = draws / 2
            else:
                noise[k][i] = torch.normal(
                    mean=0, std=std, size=shape, device=device, generator=generator, dtype=v.dtype
                )
    return {k: summed[k] + noise[k] for k in summed}


def haar_clipped_sums(g: dict, m: torch.Tensor, clip: float, rngs: list, std: float, active: torch.Tensor) -> dict:
    """DP-SGD-WAV per active client: sum_s min(1, C / ||H(g_s)||) g_s plus `haar_wavelet_noise` (HaarDPOptimizer)."""
    names = list(g)
    shapes = [g[k].shape[2:] for k in names]
    out = {k: torch.zeros((g[k].shape[0], *g[k].shape[2:]), device=g[k].device) for k in names}
    for i, rng in enumerate(rngs):
        if not bool(active[i]):
            continue
        rows = int(m[i].sum())
        samples = torch.cat([g[k][i, :rows].flatten(1) for k in names], dim=1)
        norms = torch.from_numpy(haar_coefficient_norms(samples.detach().cpu().numpy())).to(samples.device)
        factors = (clip / (norms + 1e-12)).clamp(max=1.0).to(samples.dtype)
        summed = torch.einsum("i,i...", factors, samples)
        noisy = torch.from_numpy(haar_wavelet_noise(summed.detach().cpu().numpy(), std, rng)).to(samples.device)
        for k, part, shape in zip(names, torch.split(noisy, [math.prod(s) for s in shapes]), shapes):
            out[k][i] = part.reshape(shape)
    return out
