"""The cohort engine's training (dpfl_tools.cohort.CohortGrid hands it a round's train messages and clients).

The train messages whose client is a `TrainingClient` (local SGD), `SAMClient` or `TopKSAMClient` (local SAM) are
trained in chunks of clients: the clients' parameters are stacked on a leading dimension and one step of every
client is one call of `torch.func.vmap` over `grad` of the loss of `torch.func.functional_call(model, params_i,
x_i)` (on the CPU, clients/cohort/grouped.py's grouped model where the layers allow). Per client i and step t
(the rules of clients/base.py and clients/sam.py, re-expressed on stacked tensors and tested against them in
tests/test_cohort.py):

    g = grad F_i(w)                                    (SGD)
    g = grad F_i(w + e), e = rho g0 / (||g0||_2 + 1e-12), g0 = grad F_i(w)   (SAM)
    g <- g + lambda w;  b <- mu b + g (b = g at t = 0);  w <- w - eta_i b

Each client keeps its own minibatches (its own generator, `TrainingClient.round_batches`) and its own number
of steps: a chunk runs max_i steps_i steps, and a client past its last step is masked (its w and b kept); a
client with fewer samples than a batch is padded and masked inside the loss (mean over its real samples).
Nothing mixes clients: every operation is per client under vmap, and models with buffers (BatchNorm
statistics) are not batched. The reply is the client's own `upload` (Delta, clip, noise share, metrics) and
`clients.adapter.fit_reply`, so the ServerApp, the strategy and the ledger see what the ClientApp would send.

DP2-FedSAM's and CENTAUR's clients (clients/personalized.py, `train_personal`) keep a personal head h_i per node:
each client's stored head (its HeadStore: the node's Context.state, or its state-dir file; before the first save
the model's initial head) is stacked beside the received body phi, and PartialSharingClient.fit's rule runs per
client: tau_h SGD steps on h_i with phi frozen (lr round_lr(eta_h), batches from generator (seed, 5, round,
partition-id)), then tau_phi SGD or SAM steps on phi with h_i frozen (the SAM norm over phi only). Only phi's
update is replied (`upload_body`); h_i is saved to the node's HeadStore when the node answers, as the ClientApp
saves it, so a later round, an evaluation and a node that fails (it keeps its previous head) read what the
sequential path leaves. A stored head that does not fit the model runs through the ClientApp (its error).
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import numpy as np
import torch
from flwr.app import Context, Message
from torch.func import functional_call, grad, grad_and_value, vmap

from dpfl.clients.cohort.grouped import grouped_step
from dpfl.clients.cohort.tensors import sgd_update, stacked, unstacked
from dpfl.dpcore.privacy import protocol as keys
from dpfl.dpcore.task.threads import limit_blas_threads

CPU_BUDGET = 2 << 30  # bytes of stacked parameters and activations per chunk on the CPU
CUDA_BUDGET_SHARE = 0.5  # of the GPU's free memory
PROCESS_SHARE = 1.0  # of either budget this process takes: a ProcessGrid's worker, 1 / the workers on its device
PROCESSES = 1  # processes training side by side on this host (a ProcessGrid's workers), sharing its cores
# uploads on threads from this model size: on 2 cores 100 uploads of cnn-mnist (26,010 parameters) took 1.1x as
# long on two threads as on one, of cnn-cifar10 (550,570) 0.68x, of resnet18-gn (11.2 M) 0.8x (docs/performance.md)
THREADED_UPLOAD_PARAMS = 100_000


def local_rule(client) -> str | None:
    """'sgd', 'sam' or 'dpsgd' for the clients whose local rule is batched (exact types: a subclass changes the
    rule)."""
    from dpfl.clients.base import TrainingClient
    from dpfl.clients.personalized import DP2FedSAMClient, PartialSharingClient
    from dpfl.clients.sam import SAMClient
    from dpfl.clients.topk import TopKSAMClient

    dpsgd = sys.modules.get("dpfl.clients.dpsgd")  # imported where a client is one (not otherwise: it imports Opacus)
    if dpsgd is not None and type(client) is dpsgd.DPSGDClient:
        return "dpsgd"
    rules = {TrainingClient: "sgd", SAMClient: "sam", TopKSAMClient: "sam"}
    rules.update({PartialSharingClient: "sgd", DP2FedSAMClient: "sam"})  # the body's rule; heads: train_personal
    return rules.get(type(client))


def trainer(client):
    """The client that trains: a -FT baseline's inner client (its fit is the inner client's fit)."""
    from dpfl.clients.personalized import FineTuneClient

    return client.inner if type(client) is FineTuneClient else client


def in_threads(fn: Callable, items: list, model: torch.nn.Module) -> list:
    """[fn(*item) for item in items], on a pool of the process's `cores()` where `model` has THREADED_UPLOAD_PARAMS
    parameters or more: the clients' uploads (Delta, clip norm, noise share) are numpy work that releases the GIL,
    each client's from its own generator, so the replies are the ones computed one after the other. Below that,
    Python's share of an upload (the reply Message) dominates and threads only add switching."""
    large = sum(p.numel() for p in model.parameters()) >= THREADED_UPLOAD_PARAMS
    workers = min(len(items), cores()) if large else 1
    if workers <= 1:
        return [fn(*item) for item in items]
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda item: fn(*item), items))


def cores() -> int:
    """This process's share of the cores it may run on: all of them, or a ProcessGrid worker's 1 / PROCESSES."""
    available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, available // PROCESSES)


@contextmanager
def torch_threads(n: int | None):
    before = torch.get_num_threads()
    torch.set_num_threads(n or before)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def train_cohort(
    messages: list[Message], params: list, clients: list, budget: int | None, threads: int | None
) -> dict[int, Message]:
    """Train each message's client from its `params` (the message's arrays) in chunks; {id(message): its train
    reply} (DP-SGD: clients/cohort/dpsgd.py)."""
    from dpfl.clients.adapter import config_of, fit_reply

    limit_blas_threads()  # the ClientApp's setting (its train calls it): numpy's BLAS on one thread for the uploads
    clients = [trainer(c) for c in clients]
    if personal(clients[0]):
        return train_personal(messages, params, clients, budget, threads)
    if local_rule(clients[0]) == "dpsgd":
        from dpfl.clients.cohort.dpsgd import poisson_rows, train_dpsgd_cohort

        size = chunk_size(clients[0].model, clients[0], budget, poisson_rows(clients), per_sample=True)
        with torch_threads(threads):
            return train_dpsgd_cohort(messages, params, clients, size)

    configs = [config_of(m) for m in messages]
    plans = [(c.round_batches(cfg), cfg) for c, cfg in zip(clients, configs)]
    order = sorted(range(len(messages)), key=lambda i: -plans[i][0][0])  # similar step counts share a chunk
    model, device = clients[0].model, clients[0].device
    size = chunk_size(model, clients[0], budget)
    replies = {}
    with torch_threads(threads):
        for start in range(0, len(order), size):
            chunk = order[start : start + size]
            group = [clients[i] for i in chunk]
            given = [params[i] for i in chunk]
            new, losses = train_chunk(model, local_rule(group[0]), group, [plans[i] for i in chunk], given, device)

            def reply(j: int, i: int) -> Message:
                steps = plans[i][0][0]
                loss = float(np.mean(losses[j])) if steps else math.nan
                return fit_reply(messages[i], clients[i].upload(given[j], new[j], loss, steps, configs[i]))

            replies.update(zip((id(messages[i]) for i in chunk), in_threads(reply, list(enumerate(chunk)), model)))
    return replies


def chunk_size(model: torch.nn.Module, client, budget: int | None, rows: int = 0, per_sample: bool = False) -> int:
    """Clients per chunk: the budget over one client's bytes, 4 (6 P + 4 B A): P parameters (w, b, g, the
    SAM point, the masked copies), B samples (`rows`, default the batch size) of A activation values (saved,
    their gradients; SAM twice); `per_sample` (DP-SGD): plus 3 B P for the per-sample gradients."""
    device = client.device
    if budget is None:
        default = CPU_BUDGET if device.type != "cuda" else CUDA_BUDGET_SHARE * torch.cuda.mem_get_info(device)[0]
        budget = int(PROCESS_SHARE * default)
    p = sum(v.numel() for v in model.parameters())
    sizes = []
    hooks = [m.register_forward_hook(lambda _m, _i, o: sizes.append(o.numel())) for m in model.modules()]
    try:
        with torch.no_grad():
            x = torch.as_tensor(client.trainset.x[:1], dtype=torch.float32).to(device)
            model.to(device)(x.contiguous())
    finally:
        for h in hooks:
            h.remove()
    rows = rows or client.batch_size
    per_client = 4 * (6 * p + 4 * rows * sum(sizes) + (3 * rows * p if per_sample else 0))
    return max(1, int(budget // per_client))


def train_chunk(model, rule: str, clients: list, plans: list, params: list, device) -> tuple[list, list]:
    """The local steps of `clients` at once; (each client's new weights as numpy arrays, its step losses)."""
    names = list(model.state_dict())
    w = stacked(names, [dict(zip(names, p)) for p in params], device)
    lr = [c.round_lr(float(cfg.get(keys.LEARNING_RATE, c.lr)), cfg) for c, (_, cfg) in zip(clients, plans)]
    w, losses = masked_steps(model, rule, w, {}, [plan for plan, _ in plans], lr, clients, device)
    return unstacked(w), losses


def minibatches(batches: list, batch: int, sample: tuple, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each client's minibatch (None: it took its last step) stacked as (x, y, mask) of `batch` rows per client:
    a short or missing one padded with zeros and mask 0."""
    if all(b is not None and len(b[1]) == batch for b in batches):  # the common case: one stack, no copies
        x, y = torch.stack([b[0].contiguous() for b in batches]), torch.stack([b[1] for b in batches])
        return x, y, torch.ones(y.shape, device=device)
    n = len(batches)
    x = torch.zeros((n, batch, *sample), device=device)
    y = torch.zeros((n, batch), dtype=torch.long, device=device)
    m = torch.zeros((n, batch), device=device)
    for i, b in enumerate(batches):
        if b is not None:
            x[i, : len(b[1])], y[i, : len(b[1])], m[i, : len(b[1])] = b[0], b[1], 1.0
    return x, y, m


# ---------------------------------------------------------------- personal heads (DP2-FedSAM, CENTAUR)


def personal(client) -> bool:
    """A client with a personal head kept in its node's HeadStore (clients.personalized.PartialSharingClient)."""
    from dpfl.clients.personalized import PartialSharingClient

    return isinstance(client, PartialSharingClient)


def head_fits(client) -> bool:
    """Whether the node's stored head (if any) is one the ClientApp's restore_head accepts."""
    try:
        client.stored_head()
    except ValueError:
        return False
    return True


def train_personal(
    messages: list[Message], params: list, clients: list, budget: int | None, threads: int | None
) -> dict[int, Callable[[Message, Context], Message]]:
    """DP2-FedSAM / CENTAUR clients in chunks, each with its own rule of PartialSharingClient.fit: from its stored
    head h_i (or the model's initial head), tau_h SGD steps on h_i with the received body phi frozen (lr
    round_lr(eta_h), batches from generator (seed, 5, round, partition-id)), then tau_phi steps of its body rule
    (SGD, or SAM with the perturbation over phi only) on phi with h_i frozen (generator (seed, 4, ...)). The reply
    is the client's `upload_body` (phi's Delta only); h_i is saved to the node's HeadStore when the node answers,
    as the ClientApp saves it, so a node that fails keeps its previous head. {id(message): that handler}."""
    from dpfl.clients.adapter import config_of, fit_reply

    configs = [config_of(m) for m in messages]
    model, device, first = clients[0].model, clients[0].device, clients[0]
    size = chunk_size(model, first, budget)
    order = sorted(
        range(len(messages)), key=lambda i: (-clients[i].num_head_steps(), -clients[i].num_steps(configs[i]))
    )
    handlers = {}
    with torch_threads(threads):
        for start in range(0, len(order), size):
            chunk = order[start : start + size]
            group, cfgs = [clients[i] for i in chunk], [configs[i] for i in chunk]
            bodies = [params[i] for i in chunk]
            heads = [c.stored_head() or c.head_arrays() for c in group]
            body = stacked(first.body_keys, [dict(zip(first.body_keys, b)) for b in bodies], device)
            head = stacked(first.head_keys, heads, device)
            head_plans = [c.head_batches(cfg) for c, cfg in zip(group, cfgs)]
            head_lr = [c.round_lr(c.head_lr, cfg) for c, cfg in zip(group, cfgs)]
            head, head_losses = masked_steps(model, "sgd", head, body, head_plans, head_lr, group, device)
            body_plans = [c.round_batches(cfg) for c, cfg in zip(group, cfgs)]
            body_lr = [c.round_lr(float(cfg.get(keys.LEARNING_RATE, c.lr)), cfg) for c, cfg in zip(group, cfgs)]
            body, losses = masked_steps(model, local_rule(first), body, head, body_plans, body_lr, group, device)
            new_body, new_head = unstacked(body), unstacked(head)

            def handler(j: int, i: int) -> Callable[[Message, Context], Message]:
                c = clients[i]
                trained = (mean_or_nan(losses[j]), body_plans[j][0])
                head_trained = (mean_or_nan(head_losses[j]), head_plans[j][0])
                reply = fit_reply(messages[i], c.upload_body(bodies[j], new_body[j], trained, head_trained, cfgs[j]))
                return keeping(c.head_store, dict(zip(first.head_keys, new_head[j])), reply)

            handlers.update(zip((id(messages[i]) for i in chunk), in_threads(handler, list(enumerate(chunk)), model)))
    return handlers


def keeping(store, head: dict, reply: Message) -> Callable[[Message, Context], Message]:
    """The node's train handler: save its trained head (as PartialSharingClient.fit does), then reply."""

    def handler(_msg: Message, _context: Context) -> Message:
        store.save(head)
        return reply

    return handler


def mean_or_nan(losses: list[float]) -> float:
    return float(np.mean(losses)) if losses else math.nan


def masked_steps(model, rule: str, w: dict, frozen: dict, plans: list, lr: list, clients: list, device) -> tuple:
    """Each client's (steps, minibatches) `plans` on its stacked trainable tensors `w`, its `frozen` ones held
    (none: the whole model, trained by `cohort_grouped`'s step on the CPU, by vmap elsewhere):
    the rule of `sgd_step` / `sam_step` on the parameters that require grad (the SAM radius and norm over `w`
    only), LocalSGD's update g <- g + lambda w, b <- mu b + g, w <- w - eta_i b; a client past its last step
    masked. Returns (the new `w`, each client's step losses)."""
    mu, wd, rho = clients[0].momentum, clients[0].weight_decay, getattr(clients[0], "rho", 0.0)
    batch, sample = clients[0].batch_size, tuple(clients[0].trainset.x.shape[1:])
    model.train()

    def loss_of(p, q, x, y, m):
        out = functional_call(model, {**q, **p}, (x,))
        ce = torch.nn.functional.cross_entropy(out, y, reduction="none")
        return (ce * m).sum() / m.sum().clamp(min=1)

    def sam_grad(p, q, x, y, m):
        g0, loss = grad_and_value(loss_of)(p, q, x, y, m)
        scale = rho / (torch.sqrt(sum((g * g).sum() for g in g0.values())) + 1e-12)
        return grad(loss_of)({k: p[k] + g0[k] * scale for k in p}, q, x, y, m), loss

    grouped = not frozen and device.type == "cpu" and grouped_step(model, rule, rho, sample)  # the CPU's step
    step_fn = (
        (lambda p, _q, x, y, m: grouped(p, x, y, m))
        if grouped
        else vmap(sam_grad if rule == "sam" else grad_and_value(loss_of))
    )
    counts, iters = [plan[0] for plan in plans], [plan[1] for plan in plans]
    steps, eta = torch.tensor(counts, device=device), torch.tensor(lr, device=device)
    b: dict[str, torch.Tensor] = {}
    history = []
    for t in range(max(counts, default=0)):
        active = steps > t
        x, y, m = minibatches([next(it) if c > t else None for it, c in zip(iters, counts)], batch, sample, device)
        g, loss = step_fn(w, frozen, x, y, m)
        w, b = sgd_update(w, b, g, t, active if t >= min(counts) else None, eta, mu, wd)
        history.append(torch.where(active, loss.detach(), torch.nan))
    table = torch.stack(history).T.cpu().tolist() if history else [[] for _ in counts]
    return w, [[v for v in row if not math.isnan(v)] for row in table]
