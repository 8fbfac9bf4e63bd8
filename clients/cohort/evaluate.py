"""The cohort engine's evaluate messages: each client's mean loss and accuracy on its own held-out split, for a
chunk of clients at once.

Per client i, with weights w_i and held-out split (x_ij, y_ij), j < n_i:

    loss_i = (1 / n_i) sum_j CE(f(w_i, x_ij), y_ij)
    accuracy_i = (1 / n_i) sum_j [argmax f(w_i, x_ij) = y_ij]

This is `dpcore.task.torch_helpers.evaluate_model`, which the ClientApp runs one client at a time. The weights w_i:
- a plain client: the received model;
- DP2-FedSAM / CENTAUR: the received body and the node's stored head (read, never saved);
- a -FT baseline: the received model after its fine-tuning steps (`FineTuneClient.tune_config`), trained as the
  cohort engine trains (dpfl.clients.cohort.train.train_chunk).

The splits are padded to the longest and masked, and run in slices of EVAL_ROWS rows per client. Weights that every
client shares (one object: the received model, a body) enter `vmap` once (in_dims None); the others are stacked.
Where all are shared (a plain client), the clients' rows are one batch of the model.
The model is in eval mode. The reply is `clients.adapter.evaluation_reply` of `clients.base.evaluation`, what the
ClientApp sends.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from flwr.app import Message
from torch.func import functional_call, vmap

from dpfl.clients.cohort.tensors import stacked
from dpfl.clients.cohort.train import chunk_size, local_rule, minibatches, personal, torch_threads, train_chunk, trainer
from dpfl.dpcore.task.torch_helpers import as_tensors, host_tensor

EVAL_ROWS = 512  # rows per client and slice: evaluate_model's batch
CPU_EVAL_ROWS = 64  # rows per slice of one model's evaluation on the CPU


def evaluate_cohort(
    messages: list[Message], params: list, clients: list, budget: int | None, threads: int | None
) -> dict[int, Message]:
    """{id(message): its evaluate reply} for clients built by the ClientApp (`CohortGrid.batchable`), from each
    message's `params` (its arrays)."""
    from dpfl.clients.adapter import config_of, evaluation_reply
    from dpfl.clients.base import evaluation
    from dpfl.clients.personalized import FineTuneClient
    from dpfl.dpcore.privacy import protocol as keys

    inner = [trainer(c) for c in clients]
    model, device = inner[0].model, inner[0].device
    names = list(model.state_dict())
    rows = max(1, min(EVAL_ROWS, max(len(c.testset) for c in inner)))
    size = chunk_size(model, inner[0], budget, rows)
    initial = clients[0].head_arrays() if personal(clients[0]) else {}  # one object per tensor: entered once
    replies = {}
    with torch_threads(threads):
        for start in range(0, len(messages), size):
            chunk = list(range(start, min(start + size, len(messages))))
            extras: list[dict] = [{} for _ in chunk]
            if personal(clients[0]):  # the received body, the node's head (before its first save: the model's)
                body = clients[0].body_keys
                weights = [{**dict(zip(body, params[i])), **(clients[i].stored_head() or initial)} for i in chunk]
            elif type(clients[0]) is FineTuneClient:
                configs = [clients[i].tune_config(config_of(messages[i])) for i in chunk]
                plans = [(inner[i].round_batches(cfg), cfg) for i, cfg in zip(chunk, configs)]
                group = [inner[i] for i in chunk]
                new, _ = train_chunk(model, local_rule(group[0]), group, plans, [params[i] for i in chunk], device)
                weights = [dict(zip(names, w)) for w in new]
                extras = [{keys.FINE_TUNE_STEPS: plan[0][0]} for plan in plans]
            else:
                weights = [dict(zip(names, params[i])) for i in chunk]
            scores = held_out_scores(model, weights, [inner[i].testset for i in chunk], device)
            for j, i in enumerate(chunk):
                n = len(inner[i].testset)
                replies[id(messages[i])] = evaluation_reply(messages[i], evaluation(*scores[j], n, extras[j]))
    return replies


@torch.no_grad()
def held_out_scores(model: torch.nn.Module, weights: list[dict], tests: list, device) -> list[tuple[float, float]]:
    """(loss_i, accuracy_i) of the module docstring for each client's `weights` ({name: array}) and held-out
    split; (nan, nan) for an empty split, as evaluate_model."""
    names = list(weights[0])
    common = [k for k in names if all(w[k] is weights[0][k] for w in weights)]
    shared = {k: host_tensor(weights[0][k], np.float32).to(device) for k in common}
    own = stacked([k for k in names if k not in common], weights, device)
    data = [as_tensors(t) for t in tests]
    sizes = [len(y) for _, y in data]
    if not own:
        return one_model_scores(model, shared, data, device)
    sample = tuple(data[0][0].shape[1:])
    loss = torch.zeros(len(weights), dtype=torch.float64, device=device)
    correct = torch.zeros(len(weights), dtype=torch.long, device=device)
    model.eval()
    logits = vmap(lambda p, q, x: functional_call(model, {**q, **p}, (x,)), in_dims=(0, None, 0))
    for r in range(0, max(sizes, default=0), EVAL_ROWS):
        rows = min(EVAL_ROWS, max(sizes) - r)
        part = [
            (x[r : r + rows].to(device), y[r : r + rows].to(device)) if n > r else None
            for (x, y), n in zip(data, sizes)
        ]
        x, y, m = minibatches(part, rows, sample, device)
        out = logits(own, shared, x)
        ce = torch.nn.functional.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="none").view_as(m)
        loss += (ce.double() * m).sum(1)
        correct += ((out.argmax(-1) == y) & (m > 0)).sum(1)
    return scores(loss, correct, sizes)


def one_model_scores(model: torch.nn.Module, weights: dict, data: list, device) -> list[tuple[float, float]]:
    """held_out_scores where every client has the same `weights`: the clients' rows concatenated, in slices of
    EVAL_ROWS (CPU_EVAL_ROWS on the CPU, where a smaller slice stays in the cache), each row's loss and hit added
    to its client's sums."""
    x, y = torch.cat([x for x, _ in data]), torch.cat([y for _, y in data])
    sizes = [len(y) for _, y in data]
    owner = torch.repeat_interleave(torch.arange(len(data)), torch.tensor(sizes)).to(device)
    loss = torch.zeros(len(data), dtype=torch.float64, device=device)
    correct = torch.zeros(len(data), dtype=torch.long, device=device)
    model.eval()
    step = EVAL_ROWS if device.type == "cuda" else CPU_EVAL_ROWS
    for r in range(0, len(y), step):
        out = functional_call(model, weights, (x[r : r + step].to(device),))
        labels, rows = y[r : r + step].to(device), owner[r : r + step]
        loss.index_add_(0, rows, torch.nn.functional.cross_entropy(out, labels, reduction="none").double())
        correct.index_add_(0, rows, (out.argmax(1) == labels).long())
    return scores(loss, correct, sizes)


def scores(loss: torch.Tensor, correct: torch.Tensor, sizes: list[int]) -> list[tuple[float, float]]:
    """(loss sum / n_i, hits / n_i) per client; (nan, nan) for an empty split, as evaluate_model."""
    return [
        (float(s) / n, float(c) / n) if n else (math.nan, math.nan)
        for s, c, n in zip(loss.tolist(), correct.tolist(), sizes)
    ]
