"""The cohort engine's update on stacked tensors (dpfl.clients.cohort.tensors.sgd_update) against torch.optim.SGD run
client by client: each client's own rate, momentum and weight decay, ragged step counts (a client past its last step
keeps its weights bit for bit), and the stacked tensors it updates in place."""

from __future__ import annotations

import torch

from dpfl.clients.cohort.tensors import sgd_update

SHAPES = {"conv": (4, 1, 3, 3), "bias": (4,)}


def test_stacked_update_equals_torch_sgd_per_client_and_keeps_finished_clients():
    torch.manual_seed(0)
    n, mu, wd = 5, 0.9, 5e-4
    steps = [3, 3, 2, 1, 0]  # ragged: clients finish at different steps, one takes none
    eta = torch.tensor([0.1, 0.05, 0.2, 0.1, 0.3])
    w0 = {k: torch.randn(n, *s) for k, s in SHAPES.items()}
    grads = [{k: torch.randn(n, *s) for k, s in SHAPES.items()} for _ in range(max(steps))]

    w, b, after_first = {k: v.clone() for k, v in w0.items()}, {}, {}
    for t, g in enumerate(grads):
        active = torch.tensor([s > t for s in steps])
        g = {k: v.clone() for k, v in g.items()}  # sgd_update writes into its g
        w, b = sgd_update(w, b, g, t, None if active.all() else active, eta, mu, wd)
        if t == 0:
            after_first = {k: v[3].clone() for k, v in w.items()}

    for i in range(n):
        params = [torch.nn.Parameter(w0[k][i].clone()) for k in SHAPES]
        opt = torch.optim.SGD(params, lr=float(eta[i]), momentum=mu, weight_decay=wd, foreach=False)
        for g in grads[: steps[i]]:
            for p, k in zip(params, SHAPES):
                p.grad = g[k][i].clone()
            opt.step()
        for p, k in zip(params, SHAPES):
            if steps[i] == 0:
                assert torch.equal(w[k][i], w0[k][i])  # never active: untouched
            else:
                torch.testing.assert_close(w[k][i], p.detach(), rtol=1e-6, atol=1e-7)
                assert not torch.equal(w[k][i], w0[k][i])
    # a client that stopped early is not moved by the steps after its last, bit for bit
    assert steps[3] == 1 and all(torch.equal(w[k][3], after_first[k]) for k in SHAPES)
