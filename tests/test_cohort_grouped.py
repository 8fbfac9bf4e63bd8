"""The cohort engine's CPU step (dpfl.clients.cohort.grouped): each client's gradient of one grouped model against
plain autograd of the model, one client at a time; no client's data reaches another's gradient."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dpfl.clients.cohort.grouped as grouped
import dpfl.clients.cohort.train as cohort
from dpfl.dpcore.task.models import build_model
from dpfl.fl_app.client_app import app as client_app
from dpfl.fl_app.config import validate
from dpfl_tools.cohort import CohortGrid
from dpfl_tools.inprocess import InProcessGrid
from tests.test_cohort import assert_replies_close, run

RTOL = 1e-5
N, B = 13, 8  # 13 clients: slices of GROUP = 5 clients, the last a short one


def stacked(model_name: str, shape: tuple, seed: int = 0, dtype: torch.dtype = torch.float32):
    """A model, N clients' weights (the model's, perturbed per client), minibatches, labels and a ragged mask."""
    torch.set_num_threads(1)  # the ClientApp's setting; two threads on two shared cores are slower
    torch.manual_seed(seed)
    model = build_model(model_name, shape, 10)
    w = {
        k: torch.stack([v.detach() + 0.05 * torch.randn_like(v) for _ in range(N)]) for k, v in model.named_parameters()
    }
    x, y = torch.randn(N, B, *shape), torch.randint(0, 10, (N, B))
    m = torch.ones(N, B)
    m[3, 5:] = 0  # a short last batch
    m[7] = 0  # a client past its last step
    return model, {k: v.to(dtype) for k, v in w.items()}, x.to(dtype), y, m.to(dtype)


def reference(model: nn.Module, rule: str, rho: float, w: dict, x, y, m) -> tuple[list[list], list[float]]:
    """Client by client: plain autograd of the masked mean loss (SAM: at w + rho g0 / (||g0|| + 1e-12))."""

    def grad_at(p: dict, i: int):
        p = {k: v.detach().requires_grad_(True) for k, v in p.items()}
        ce = nn.functional.cross_entropy(torch.func.functional_call(model, p, (x[i],)), y[i], reduction="none")
        loss = (ce * m[i]).sum() / m[i].sum().clamp(min=1)
        return torch.autograd.grad(loss, list(p.values())), loss.item()

    grads, losses = [], []
    for i in range(N):
        p = {k: v[i] for k, v in w.items()}
        g, loss = grad_at(p, i)
        if rule == "sam":
            scale = rho / (torch.sqrt(sum((gk * gk).sum() for gk in g)) + 1e-12)
            g, _ = grad_at({k: p[k] + gk * scale for k, gk in zip(p, g)}, i)
        grads.append(list(g))
        losses.append(loss)
    return grads, losses


@pytest.mark.parametrize(
    "model_name, shape, rule, dtype, rtol",
    [
        ("cnn-mnist", (1, 28, 28), "sgd", torch.float32, RTOL),
        ("cnn-mnist", (1, 28, 28), "sam", torch.float32, RTOL),
        ("mlp", (1, 8, 8), "sam", torch.float32, RTOL),
        pytest.param("cnn-mnist", (1, 8, 8), "sgd", torch.float32, RTOL, marks=pytest.mark.slow, id="upsampled"),
        # 3 channels per client and three 2x2 pools; in float64, since in float32 a window whose two largest
        # values lie 5e-7 apart (this seed's client 6) may pick the other one in either path's rounding, which
        # moves that client's gradient by 1e-2: the max-pool argmax, not the layout (vmap's step, whose rounding
        # is another, matched the plain path on this seed)
        pytest.param("cnn-cifar10", (3, 32, 32), "sam", torch.float64, 1e-10, marks=pytest.mark.slow, id="cifar10"),
    ],
)
def test_grouped_gradients_equal_each_clients_own(model_name, shape, rule, dtype, rtol):
    model, w, x, y, m = stacked(model_name, shape, dtype=dtype)
    step = grouped.grouped_step(model, rule, 0.05, shape)
    assert step is not None
    g, loss = step(w, x, y, m)
    want, want_loss = reference(model, rule, 0.05, w, x, y, m)
    assert loss.shape == (N,) and loss.tolist() == pytest.approx(want_loss, rel=rtol)
    assert float(loss[7]) == 0.0 and all(float(gk[7].abs().max()) == 0.0 for gk in g.values())  # masked out
    for i in range(N):
        for k, ref in zip(w, want[i]):
            assert g[k].shape == w[k].shape and g[k].dtype == dtype
            assert float((g[k][i] - ref).abs().max()) <= rtol * float(ref.abs().max()) + 1e-12, (i, k)


def test_no_client_reaches_another():
    """One client's images changed: its gradient changes, every other client's is bit for bit the same."""
    model, w, x, y, m = stacked("cnn-mnist", (1, 28, 28))
    step = grouped.grouped_step(model, "sam", 0.05, (1, 28, 28))
    before, _ = step(w, x, y, m)
    x2 = x.clone()
    x2[4] = torch.flip(x2[4], dims=[-1])
    after, _ = step(w, x2, y, m)
    for i in range(N):
        same = all(torch.equal(before[k][i], after[k][i]) for k in w)
        assert same == (i != 4), i


class Doubled(nn.Module):
    def forward(self, x):
        return x * 2


@pytest.mark.parametrize(
    "model, shape",
    [
        (build_model("resnet18-gn", (3, 32, 32), 10), (3, 32, 32)),  # GroupNorm, residual blocks
        (nn.Sequential(nn.Flatten(), nn.Linear(64, 10), nn.Dropout(0.5)), (1, 8, 8)),  # per-client randomness
        (
            nn.Sequential(nn.Conv2d(1, 4, 3, padding=1, padding_mode="reflect"), nn.Flatten(), nn.Linear(256, 10)),
            (1, 8, 8),
        ),
        (nn.Sequential(nn.Flatten(), Doubled(), nn.Linear(64, 10)), (1, 8, 8)),  # an unknown layer
    ],
    ids=["resnet18-gn", "dropout", "reflect-padding", "unknown-layer"],
)
def test_other_models_keep_the_vmap_step(model, shape):
    assert model(torch.zeros(2, *shape)).shape == (2, 10)  # a working model, only not one the grouped step runs
    assert grouped.grouped_step(model, "sgd", 0.0, shape) is None


@pytest.mark.slow
def test_cpu_cohort_uses_the_grouped_step(monkeypatch, tmp_path):
    """On the CPU the engine trains cnn-mnist with the grouped step, and its replies equal the sequential ones."""
    used = []
    real = cohort.grouped_step
    monkeypatch.setattr(cohort, "grouped_step", lambda *a: used.append(step := real(*a)) or step)
    overrides = {"algorithm": "dp-fedsam", "model": "cnn-mnist", "num-rounds": 1}
    seq, s1 = run(InProcessGrid, overrides, tmp_path)
    coh, s2 = run(CohortGrid, overrides, tmp_path)
    assert used and all(s is not None for s in used) and coh.batched > 0
    assert_replies_close(seq.received, coh.received)
    assert s2["epsilon"] == s1["epsilon"]


def test_uploads_run_with_the_clientapps_blas_threads(monkeypatch):
    """The batched replies' uploads (clip norms: BLAS dot products) run under the ClientApp's one BLAS thread, as
    the sequential path's do: 2 OpenBLAS threads made each norm 5.5 ms instead of 0.05 ms in the CPU benchmark."""
    from threadpoolctl import threadpool_info

    from tests.test_cohort import BASE, NODES, train_messages

    torch.set_num_threads(1)
    calls = []
    real = cohort.limit_blas_threads
    monkeypatch.setattr(cohort, "limit_blas_threads", lambda: calls.append(1) or real())
    grid = CohortGrid(client_app, NODES, validate({**BASE, "algorithm": "dp-fedavg"}))
    replies = grid.send_and_receive(train_messages(grid))
    assert grid.batched == NODES and not any(r.has_error() for r in replies)
    assert calls
    assert all(i["num_threads"] == 1 for i in threadpool_info() if i["user_api"] == "blas")
