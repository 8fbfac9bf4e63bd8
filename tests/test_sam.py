"""One SAM step equals a hand-computed two-pass step."""

import torch
from torch import nn

from dpfl.clients.sam import sam_step


def test_sam_step_matches_hand_computation():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    x, y = torch.randn(5, 3), torch.tensor([0, 1, 1, 0, 1])
    rho, lr, momentum, wd = 0.5, 0.1, 0.5, 5e-4
    w0 = [p.detach().clone() for p in model.parameters()]

    def loss_at(params):
        return nn.functional.cross_entropy(x @ params[0].T + params[1], y)

    # hand computation: g at w, perturb by rho g/||g||, g~ at w+e, SGD step with weight decay
    w = [p.clone().requires_grad_(True) for p in w0]
    g = torch.autograd.grad(loss_at(w), w)
    norm = torch.sqrt(sum((gi**2).sum() for gi in g))
    w_adv = [(wi + rho * gi / (norm + 1e-12)).detach().requires_grad_(True) for wi, gi in zip(w0, g)]
    g_tilde = torch.autograd.grad(loss_at(w_adv), w_adv)
    # first step of momentum SGD: buffer = grad + wd * w; w <- w - lr * buffer
    expected = [wi - lr * (gt + wd * wi) for wi, gt in zip(w0, g_tilde)]

    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=wd)
    loss = sam_step(model, nn.CrossEntropyLoss(), x, y, opt, rho)
    assert abs(loss - loss_at(w0).item()) < 1e-6
    for p, e in zip(model.parameters(), expected):
        assert torch.allclose(p, e, atol=1e-6)
    # and it differs from a plain SGD step (the perturbation matters)
    plain = [wi - lr * (gi + wd * wi) for wi, gi in zip(w0, g)]
    assert max((p - q).abs().max().item() for p, q in zip(model.parameters(), plain)) > 1e-4


def test_sam_with_zero_radius_is_sgd():
    torch.manual_seed(1)
    a, b = nn.Linear(4, 3), nn.Linear(4, 3)
    b.load_state_dict(a.state_dict())
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    oa = torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.5)
    ob = torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.5)
    sam_step(a, nn.CrossEntropyLoss(), x, y, oa, 0.0)
    ob.zero_grad()
    nn.functional.cross_entropy(b(x), y).backward()
    ob.step()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.allclose(p, q, atol=1e-7)
