"""The cohort engine's DP-SGD (clients/cohort/dpsgd.py) against the sequential Opacus path (clients/dpsgd.py).

Same tolerance as tests/test_cohort.py (RTOL: float32 rounding; the Poisson masks and the noise are the clients'
own draws, in Opacus' order, so they are equal, not merely alike); the ledgers in Context.state, the printed
epsilon and the metrics files identical. Plus the formula on its own: the noise std of one step and the clipping
bound, against numbers computed here from the client's generators.
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from dpfl.clients.dpsgd import LEDGER_KEY, torch_generator
from dpfl.fl_app.client_app import app as client_app
from dpfl.fl_app.client_app import build_client
from dpfl.fl_app.config import validate
from dpfl_tools.cohort import CohortGrid
from dpfl_tools.inprocess import InProcessGrid
from tests.test_cohort import BASE, NODES, RTOL, assert_replies_close, launch, run

ALI = {
    "algorithm": "ali-dpfl",
    "target-epsilon": 5.0,
    "batch-sample-rate": 0.1,
    "local-steps": 4,
    "num-rounds": 2,
}


def ledgers(grid) -> list:
    return [dict(c.state[LEDGER_KEY]) if LEDGER_KEY in c.state else None for c in grid.contexts.values()]


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param({}, id="gaussian"),
        # Opacus' ghost clipping (the clipped sum without per-sample gradients) against the batch's per-sample
        # clipping; a rate of 0.005 (about one sample a batch) gives empty batches, which ghost handles itself
        pytest.param(
            {"grad-sample-mode": "ghost", "batch-sample-rate": 0.005, "momentum": 0.9, "mu-source": "clients"},
            id="ghost",
        ),
        pytest.param({"dpsgd-noise": "wavelet"}, id="wavelet", marks=pytest.mark.slow),
        # hooks instead of ew, momentum, the clients' noisy mu release (a second ledger event per round)
        pytest.param(
            {"grad-sample-mode": "hooks", "mu-source": "clients", "momentum": 0.9},
            id="mu-clients",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_dpsgd_replies_ledger_and_epsilon_equal_opacus(overrides, tmp_path):
    seq, s1 = run(InProcessGrid, {**ALI, **overrides}, tmp_path)
    coh, s2 = run(CohortGrid, {**ALI, **overrides}, tmp_path)
    trains = [m for m in seq.received if m.metadata.message_type == "train"]
    assert coh.batched == len(trains) == 2 * NODES
    answers = [[m for m in g.received if m.metadata.message_type != "query.client_id"] for g in (seq, coh)]
    assert_replies_close(*answers)  # the identity queries' answers left out
    assert all(r.content["metrics"]["local-steps"] > 0 for r in trains)
    assert ledgers(coh) == ledgers(seq) and all(ledgers(seq))
    assert s2["epsilon"] == s1["epsilon"] > 0 and s2["delta"] == s1["delta"]
    read = [(tmp_path / g / "metrics.jsonl").read_text() for g in ("InProcessGrid", "CohortGrid")]
    assert [json.loads(x)["epsilon"] for x in read[0].splitlines()] == [
        json.loads(x)["epsilon"] for x in read[1].splitlines()
    ]


def dpsgd_messages(grid, steps: dict[int, int], lr: float = 0.1) -> list:
    weights = [v.detach().cpu().numpy() for v in build_client(grid.contexts[100]).model.state_dict().values()]
    return [
        grid.create_message(
            RecordDict(
                {
                    "arrays": ArrayRecord(weights),
                    "config": ConfigRecord({"server-round": 1, "local-steps": steps[node], "lr": lr}),
                }
            ),
            "train",
            node,
            "1",
        )
        for node in grid.get_node_ids()
    ]


RAGGED = {100: 5, 101: 1, 102: 0, 103: 3, 104: 2, 105: 4}


def test_dpsgd_ragged_steps_and_failed_node_equal_opacus():
    """Each client its own number of steps (0 to 5, padded and masked), Dirichlet partitions of different sizes
    (ragged Poisson batches); a node that fails before it answers charges nothing, in both paths."""
    cfg = validate({**BASE, **ALI})

    def fail(node, msg):
        return node == 104

    seq = InProcessGrid(client_app, NODES, cfg, fail=fail)
    coh = CohortGrid(client_app, NODES, cfg, fail=fail)
    a = seq.send_and_receive(dpsgd_messages(seq, RAGGED))
    b = coh.send_and_receive(dpsgd_messages(coh, RAGGED))
    assert coh.batched == NODES
    assert [r.has_error() for r in a] == [r.has_error() for r in b] == [n == 104 for n in RAGGED]
    ok = [i for i, n in enumerate(RAGGED) if n != 104]
    assert_replies_close([a[i] for i in ok], [b[i] for i in ok])
    assert [b[i].content["metrics"]["local-steps"] for i in ok] == [RAGGED[100 + i] for i in ok]
    assert ledgers(coh) == ledgers(seq)
    assert ledgers(coh)[4] is None and ledgers(coh)[0]["steps"] == 5 and ledgers(coh)[2]["steps"] == 0
    update = b[2].content["arrays"].to_numpy_ndarrays()  # no step: no change
    assert all(not u.any() for u in update)


def test_dpsgd_no_client_leaks_into_another(monkeypatch):
    """One client's noise, another's Poisson masks, a third's data changed: exactly their replies change (by far
    more than rounding), every other reply stays within rounding (the padded batch may grow)."""
    cfg = validate({**BASE, **ALI})
    steps = dict.fromkeys(range(100, 100 + NODES), 3)

    def replies(patch=None):
        with monkeypatch.context() as m:
            if patch:
                patch(m)
            grid = CohortGrid(client_app, NODES, cfg)
            out = grid.send_and_receive(dpsgd_messages(grid, steps))
            assert grid.batched == NODES
            return [np.concatenate([x.ravel() for x in r.content["arrays"].to_numpy_ndarrays()]) for r in out]

    import dpfl.clients.dpsgd as dpsgd
    import dpfl.fl_app.client_app as project

    def other_stream(m, which, pid):
        made = dpsgd.torch_generator

        def patched(seed, *stream, **kw):
            return made(seed + 1 if stream[0] == which and stream[2] == pid else seed, *stream, **kw)

        m.setattr(dpsgd, "torch_generator", patched)

    load = project.load_client_partition

    def other_data(m):
        def mirrored(s, pid, n):
            train, test = load(s, pid, n)
            if pid == 4:
                train = dataclasses.replace(train, x=np.ascontiguousarray(np.flip(train.x, axis=-1)))
            return train, test

        m.setattr(project, "load_client_partition", mirrored)

    base = replies()
    for changed, patch in (
        (2, lambda m: other_stream(m, 5, 2)),  # noise
        (3, lambda m: other_stream(m, 6, 3)),  # Poisson masks
        (4, other_data),
    ):
        new = replies(patch)
        for i in range(NODES):
            scale = np.abs(base[i]).max()
            diff = np.abs(new[i] - base[i]).max()
            if i == changed:
                assert diff > 100 * RTOL * scale, (i, changed)
            else:
                assert diff <= RTOL * scale, (i, changed)


@pytest.mark.parametrize(
    "sigma, clip, secure",
    [(50.0, 1.0, False), (50.0, 1.0, True), (0.3, 0.01, False)],
    ids=["noise-std", "noise-std-secure", "clipping"],
)
def test_dpsgd_noise_std_and_clipping_bound(sigma, clip, secure):
    """One step, lr 1, no momentum or weight decay: Delta = -(sum_B clip_C(g_s) + N(0, sigma^2 C^2)) / (q |D|).
    sigma = 50: the coordinates' std is sigma C / (q |D|) within 4% (d = 9,610 coordinates: 5.5 standard errors),
    also with secure-rng's noise (Opacus' secure mode: the sum of four draws over 2); sigma = 0.3, C = 0.01:
    ||Delta|| q |D| <= |B| C + the noise's 5-sigma norm, |B| counted from the client's own sampling generator here
    (unclipped, the gradients' sum is far larger). Ledgers as the Opacus path's, also under secure-rng."""
    settings = {
        **BASE,
        **ALI,
        "sample-noise-multiplier": sigma,
        "sample-clipping-norm": clip,
        "momentum": 0.0,
        "weight-decay": 0.0,
        "target-epsilon": 50.0,
        "secure-rng": secure,
    }
    grid, seq = CohortGrid(client_app, NODES, validate(settings)), InProcessGrid(client_app, NODES, validate(settings))
    one_step = dict.fromkeys(range(100, 100 + NODES), 1)
    replies = grid.send_and_receive(dpsgd_messages(grid, one_step, lr=1.0))
    seq.send_and_receive(dpsgd_messages(seq, one_step, lr=1.0))
    assert grid.batched == NODES and ledgers(grid) == ledgers(seq)
    for node, reply in zip(grid.get_node_ids(), replies):
        n = len(build_client(grid.contexts[node]).trainset)
        delta = np.concatenate([x.ravel() for x in reply.content["arrays"].to_numpy_ndarrays()]) * 0.1 * n
        if sigma == 50.0:
            assert np.std(delta) == pytest.approx(sigma * clip, rel=0.04)
            assert abs(np.mean(delta)) < 5 * sigma * clip / math.sqrt(delta.size)
        else:
            batch = int((torch.rand(n, generator=torch_generator(0, 6, 1, node - 100)) < 0.1).sum())
            noise = sigma * clip * (math.sqrt(delta.size) + 5)
            assert np.linalg.norm(delta) <= batch * clip + noise
            assert batch > 0


@pytest.mark.slow
def test_launch_engine_cohort_ali_dpfl_same_accuracy_and_epsilon(tmp_path, capsys):
    """`python -m dpfl_tools.launch --engine cohort` on ali-dpfl: the epsilon and accuracy of `--engine inprocess`."""
    run_config = (
        'algorithm="ali-dpfl" dataset="digits" model="mlp" num-rounds=3 target-epsilon=20.0 batch-sample-rate=0.3 '
        "adaptive=false local-steps=8 sample-noise-multiplier=0.8 lr=0.5 secure-rng=false tensorboard=false"
    )
    torch.set_num_threads(1)
    sequential = launch("inprocess", tmp_path, run_config, NODES)
    cohort = launch("cohort", tmp_path, run_config, NODES)
    assert cohort["rounds_completed"] == sequential["rounds_completed"] == 3
    assert cohort["epsilon"] == sequential["epsilon"] > 0
    assert cohort["final_accuracy"] == pytest.approx(sequential["final_accuracy"], abs=0.01)
    assert cohort["final_accuracy"] > 0.15  # above chance (10 classes)
    assert f"epsilon={cohort['epsilon']}" in capsys.readouterr().out
