"""DP-FedSAM-top_k: exact selection, sparse upload, fixed denominator m, rejection, p = 1 equals DP-FedSAM."""

import json
import math

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord

from dpfl.dpcore.privacy.mechanisms import (
    flatten,
    sparse_decode,
    sparse_encode,
    topk_count,
    topk_mask,
    topk_sparsify,
)
from dpfl.dpcore.task.torch_helpers import get_weights
from dpfl.fl_app.algorithms import ALGORITHMS
from dpfl.fl_app.client_app import app as client_app
from dpfl.fl_app.config import validate
from dpfl.fl_app.results import read_metrics, read_rounds
from dpfl.fl_app.server_app import build_global_model, build_strategy, run_federated
from dpfl.strategies.parts.topk import payload_bytes
from dpfl.strategies.presets import DPFedSAMTopK
from dpfl_tools.inprocess import InProcessGrid
from tests.stub_clients import stub_app

torch.set_num_threads(1)


def brute_force_topk(vector, k):
    """Indices of the k largest |v| by a full stable sort."""
    return np.sort(np.argsort(-np.abs(vector), kind="stable")[:k])


def test_topk_count_is_ceil():
    assert topk_count(10, 0.7) == 7  # 0.7 * 10 = 7.000000000000001 in floats
    assert topk_count(11, 0.4) == 5 and topk_count(10, 0.4) == 4
    assert topk_count(3, 0.01) == 1 and topk_count(1000, 1.0) == 1000
    with pytest.raises(ValueError, match="sparsity"):
        topk_count(10, 0.0)


@pytest.mark.parametrize("n", [1, 10, 1000, 70_000, 300_000])
@pytest.mark.parametrize("p", [0.01, 0.4, 0.93])
def test_topk_selection_equals_brute_force_sort(n, p):
    rng = np.random.default_rng(n)
    v = rng.standard_normal(n).astype(np.float32) * rng.uniform(0.1, 3, n).astype(np.float32)
    k = topk_count(n, p)
    mask = topk_mask(v, k)
    assert mask.sum() == k
    np.testing.assert_array_equal(np.flatnonzero(mask), brute_force_topk(v, k))


def test_topk_selection_with_ties_and_a_misleading_sample():
    rng = np.random.default_rng(1)
    n = 100_000
    ties = np.round(rng.standard_normal(n), 1).astype(np.float32)  # many equal magnitudes
    k = topk_count(n, 0.4)
    mask = topk_mask(ties, k)
    assert mask.sum() == k
    np.testing.assert_array_equal(np.sort(np.abs(ties[mask])), np.sort(np.abs(ties))[-k:])
    # the strided sample sees only zeros: the band misses, the exact fallback must still be right
    v = rng.standard_normal(n).astype(np.float32)
    v[:: n // 8192] = 0
    mask = topk_mask(v, k)
    np.testing.assert_array_equal(np.flatnonzero(mask), brute_force_topk(v, k))


@pytest.mark.parametrize("mode", ["per-layer", "global"])
@pytest.mark.parametrize("p,form", [(0.4, np.uint8), (0.01, np.int32), (1.0, np.uint8)])
def test_sparse_roundtrip_and_size(mode, p, form):
    rng = np.random.default_rng(2)
    arrays = [rng.standard_normal((200, 100)).astype(np.float32), rng.standard_normal(100).astype(np.float32)]
    masks = topk_sparsify(arrays, p, mode)
    if mode == "per-layer":
        assert [m.sum() for m in masks] == [topk_count(20000, p), topk_count(100, p)]
        np.testing.assert_array_equal(
            np.flatnonzero(masks[0]), brute_force_topk(arrays[0].ravel(), topk_count(20000, p))
        )
    else:
        assert sum(m.sum() for m in masks) == topk_count(20100, p)
        np.testing.assert_array_equal(
            np.flatnonzero(np.concatenate(masks)), brute_force_topk(flatten(arrays), topk_count(20100, p))
        )
    encoded = sparse_encode(arrays, masks)
    assert encoded[0].dtype == form and encoded[1].dtype == np.float32
    decoded = sparse_decode(encoded, [a.shape for a in arrays], p, mode)
    for a, m, d in zip(arrays, masks, decoded):
        np.testing.assert_array_equal(d.ravel(), np.where(m, a.ravel(), 0))
    k = int(masks[0].sum())
    expected = 20000 / 8 + 4 * k if form == np.uint8 else 8 * k  # bytes of tensor 0's upload
    assert encoded[0].nbytes + encoded[1].nbytes == pytest.approx(expected, abs=1)


# ---------------------------------------------------------------------------- server side
C = 10.0
SHAPES = [(50, 20), (50,)]  # nn.Linear(20, 50): 1050 parameters


def sparse_stub(update_fn, p, mode="per-layer", corrupt=None):
    """Stub clients (fixed updates) that upload top-k sparse form; corrupt(pid, encoded) may break it."""
    inner = stub_app(update_fn, dim_in=20, dim_out=50)

    def app(msg, ctx):
        reply = inner(msg, ctx)
        arrays = reply.content["arrays"].to_numpy_ndarrays()
        encoded = sparse_encode(arrays, topk_sparsify(arrays, p, mode))
        if corrupt:
            encoded = corrupt(ctx.node_config["partition-id"], encoded)
        reply.content["arrays"] = ArrayRecord(encoded)
        return reply

    return app


def updates_of(pid, rnd, size):
    return np.random.default_rng(pid).standard_normal(size).astype(np.float32)


def one_round(strategy, grid):
    torch.manual_seed(0)
    arrays = ArrayRecord(get_weights(torch.nn.Linear(20, 50)))
    strategy.setup_population(len(grid.get_node_ids()))
    replies = grid.send_and_receive(strategy.configure_train(1, arrays, ConfigRecord(), grid))
    new, metrics = strategy.aggregate_train(1, replies)
    return flatten(new.to_numpy_ndarrays()) - flatten(arrays.to_numpy_ndarrays()), metrics


def expected_topk_sum(pids, size, p, mode):
    total = np.zeros(size, np.float32)
    for pid in pids:
        u = updates_of(pid, 1, size)
        parts = [u[:1000], u[1000:]]
        total += flatten([np.where(m, a, 0) for a, m in zip(parts, topk_sparsify(parts, p, mode))])
    return total


@pytest.mark.parametrize("mode", ["per-layer", "global"])
def test_server_divides_sparse_sum_by_m_and_counts_bytes(mode):
    p, n = 0.3, 6
    grid = InProcessGrid(sparse_stub(updates_of, p, mode), n, {})
    s = DPFedSAMTopK(
        sparsity=p,
        topk_mode=mode,
        sample_rate=1.0,
        clipping_norm=1e6,
        noise_multiplier=0.0,
        noise_placement="distributed",
        client_sampling="fixed",
    )
    delta, metrics = one_round(s, grid)
    assert metrics["clients"] == n and metrics["rejected"] == 0
    expected = expected_topk_sum(range(n), 1050, p, mode) / n  # fixed m, not the count of non-zeros
    np.testing.assert_allclose(delta, expected, rtol=1e-5, atol=1e-6)
    assert np.count_nonzero(delta) < 1050  # some coordinates nobody kept
    dense = payload_bytes(ArrayRecord([np.zeros(s, np.float32) for s in SHAPES]))
    assert metrics["dense_bytes"] == n * dense
    assert metrics["upload_bytes"] == sum(payload_bytes(r.content["arrays"]) for r in grid.received)
    assert metrics["upload_bytes"] < 0.6 * metrics["dense_bytes"]  # 1/8 + 4p bytes per parameter vs 4
    assert s.describe_diagnostics()["upload_bytes_total"] == metrics["upload_bytes"]  # totals count clients
    # what is published: the bytes of one honest upload, computed from the shapes and p alone (per-layer top-k;
    # under global top-k how the k values spread over the tensors depends on the data: not published)
    assert metrics["dense_bytes_per_client"] == dense
    if mode == "per-layer":
        assert all(payload_bytes(r.content["arrays"]) == metrics["upload_bytes_per_client"] for r in grid.received)
        assert s.describe()["upload_bytes_per_client"] < 0.6 * dense
    else:
        assert "upload_bytes_per_client" not in metrics and "upload_bytes_per_client" not in s.describe()


def _out_of_range(enc):
    idx = np.flatnonzero(np.unpackbits(enc[0])[:1000]).astype(np.int32)
    idx[-1] = 1000
    return [idx] + enc[1:]


def _duplicated(enc):
    idx = np.flatnonzero(np.unpackbits(enc[0])[:1000]).astype(np.int32)
    idx[1] = idx[0]
    return [idx] + enc[1:]


def _wrong_count(enc):
    mask = np.unpackbits(enc[0])[:1000].astype(bool)
    first = np.flatnonzero(mask)[0]
    mask[first] = False
    return [np.packbits(mask), enc[1][1:]] + enc[2:]


def _padding_bits(enc):
    bad = enc[1 * 2].copy()  # tensor 1 has 50 entries: 7 bytes, 6 unused bits
    bad[-1] |= 1
    return enc[:2] + [bad] + enc[3:]


def _float_indices(enc):
    return [np.flatnonzero(np.unpackbits(enc[0])[:1000]).astype(np.float32)] + enc[1:]


def _nan_value(enc):
    values = enc[1].copy()
    values[0] = np.nan
    return [enc[0], values] + enc[2:]


def _dense(enc):
    return [np.zeros(s, np.float32) for s in SHAPES]


@pytest.mark.parametrize(
    "corrupt,reason",
    [
        (_out_of_range, "out of range"),
        (_duplicated, "duplicated index"),
        (_wrong_count, "keeps"),
        (_padding_bits, "beyond"),
        (_float_indices, "support must be"),
        (_nan_value, "NaN"),
        (_dense, "arrays, expected 4"),
    ],
)
def test_bad_sparse_update_is_rejected_not_averaged(corrupt, reason):
    p, n = 0.3, 5
    app = sparse_stub(updates_of, p, corrupt=lambda pid, enc: corrupt(enc) if pid == 0 else enc)
    grid = InProcessGrid(app, n, {})
    s = DPFedSAMTopK(
        sparsity=p,
        sample_rate=1.0,
        clipping_norm=1e6,
        noise_multiplier=0.0,
        noise_placement="distributed",
        client_sampling="fixed",
    )
    delta, metrics = one_round(s, grid)
    assert metrics["rejected"] == 1 and metrics["clients"] == n - 1
    assert reason in s.round.problems[0]  # the round's diagnostics name why
    expected = expected_topk_sum(range(1, n), 1050, p, "per-layer") / n  # node 0 left out, still / m
    np.testing.assert_allclose(delta, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(sparsity=0.0), "sparsity"),
        (dict(sparsity=1.2), "sparsity"),
        (dict(topk_mode="row"), "topk_mode"),
    ],
)
def test_strategy_rejects_bad_settings(kwargs, needle):
    args = dict(sample_rate=0.5, clipping_norm=1.0, noise_multiplier=1.0, noise_placement="distributed") | kwargs
    with pytest.raises(ValueError, match=needle):
        DPFedSAMTopK(**args)


# ---------------------------------------------------------------------------- end to end
def tiny_config(tmp_path, name, **overrides):
    return validate(
        {
            "dataset": "digits",
            "model": "mlp",
            "num-rounds": 2,
            "sample-rate": 0.5,
            "client-sampling": "fixed",
            "local-steps": 3,
            "batch-size": 16,
            "noise-multiplier": 0.8,
            "clipping-norm": 0.5,
            "secure-rng": False,
            "results-dir": str(tmp_path / name),
            **overrides,
        }
    )


def final_arrays(cfg, clients=6):
    strategy = build_strategy(cfg, ALGORITHMS[cfg.run.algorithm])
    result = strategy.start(
        InProcessGrid(client_app, clients, cfg),
        ArrayRecord(get_weights(build_global_model(cfg, ALGORITHMS[cfg.run.algorithm]))),
        num_rounds=cfg.run.num_rounds,
    )
    return flatten(result.arrays.to_numpy_ndarrays()), strategy


def test_p1_is_exactly_dp_fedsam(tmp_path):
    dense, s_dense = final_arrays(tiny_config(tmp_path, "a", algorithm="dp-fedsam"))
    sparse, s_sparse = final_arrays(tiny_config(tmp_path, "b", algorithm="dp-fedsam-topk", sparsity=1.0))
    np.testing.assert_array_equal(dense, sparse)
    assert [r["epsilon"] for r in s_dense.record.history] == [r["epsilon"] for r in s_sparse.record.history]
    # p < 1 changes the result
    sparse04, _ = final_arrays(tiny_config(tmp_path, "c", algorithm="dp-fedsam-topk", sparsity=0.4))
    assert np.abs(sparse04 - dense).max() > 1e-4


def test_run_writes_upload_and_dense_bytes(tmp_path):
    cfg = tiny_config(tmp_path, "run", algorithm="dp-fedsam-topk", sparsity=0.4)
    summary = run_federated(InProcessGrid(client_app, 6, cfg), cfg)
    rows = read_rounds(summary["results_dir"])  # the totals count clients: they are diagnostics
    diagnostics = json.loads((tmp_path / "run" / "diagnostics-summary.json").read_text())
    assert len(rows) == 2
    params = summary["num_parameters"]  # mlp on 8x8 digits: 64*128 + 128 + 128*10 + 10
    for row in rows:
        assert row["clients"] == 3 and row["rejected"] == 0
        per_client = row["upload_bytes"] / 3
        # per-layer masks + float32 values: about params/8 + 4 * 0.4 * params (+ npy headers)
        assert per_client == pytest.approx(
            params / 8 + 4 * sum(topk_count(s, 0.4) for s in (64 * 128, 128, 128 * 10, 10)), abs=8 * 128 + 8
        )
        assert row["dense_bytes"] / 3 == pytest.approx(4 * params, abs=4 * 128)
        assert row["upload_bytes_per_client"] == row["upload_bytes"] / 3  # published: one honest upload
    assert diagnostics["upload_bytes_total"] == sum(r["upload_bytes"] for r in rows)
    assert diagnostics["dense_bytes_total"] == sum(r["dense_bytes"] for r in rows)
    assert "upload_bytes_total" not in summary and "clients" not in read_metrics(summary["results_dir"])[0]
    # (1/8 + 4 * 0.4) / 4 bytes per parameter; the npy headers of 8 arrays weigh on 9,610 parameters
    assert summary["upload_fraction_of_dense"] == pytest.approx((1 / 8 + 1.6) / 4, rel=0.06)
    assert math.isfinite(summary["epsilon"]) and summary["sparsity"] == 0.4


def zero_count_trials(placement: str, present: int, trials: int, d: int = 1024, p: float = 0.1) -> list[int]:
    """Exact zeros in the released aggregate when `present` of m = 5 sampled clients' uploads arrive."""
    from flwr.app import Error, MetricRecord, RecordDict

    from dpfl.dpcore.privacy import protocol as keys
    from dpfl.strategies.legacy.adapter import reply_message

    # The server's noise is seeded, one stream per trial (the trial is the round): numpy's float32 normals are
    # exactly 0.0 with probability 2^-23, and with noise from OS entropy one of the ~38,800 server draws that land
    # on a coordinate no client kept (60-65% of 1024, in the 60 trials with server noise) made an exact zero in
    # 0.46% of runs: a zero that says nothing about who took part, but the test counts zeros exactly.
    strategy = DPFedSAMTopK(
        sample_rate=1.0,
        clipping_norm=1.0,
        noise_multiplier=1.0,
        noise_placement=placement,
        sparsity=p,
        client_sampling="fixed",  # n_s = m = 5: no top-up when all arrive
        secure_rng=False,
        seed=present if placement == "central" else 10 + present,
    )
    strategy.setup_population(5)
    zeros, rng = [], np.random.default_rng(0)
    arrays = ArrayRecord([np.zeros(d, np.float32)])
    for trial in range(1, trials + 1):
        strategy.begin_round(arrays)
        config = strategy.client_train_config(trial)
        replies = []
        for pid in range(5):
            if pid >= present:
                replies.append(reply_message(100 + pid, error=Error(code=1, reason="dropped")))
                continue
            update = rng.standard_normal(d).astype(np.float32)
            if config[keys.PRIVATIZE]:  # distributed: clip and add the share, then top-k (the paper's order)
                update = update / max(1.0, float(np.linalg.norm(update))) + rng.standard_normal(d).astype(
                    np.float32
                ) * np.float32(config[keys.NOISE_STD])
            encoded = sparse_encode([update], topk_sparsify([update], p))
            replies.append(
                reply_message(100 + pid, RecordDict({"arrays": ArrayRecord(encoded), "metrics": MetricRecord({})}))
            )
        new, _ = strategy.aggregate_train(trial, replies)
        zeros.append(int(np.count_nonzero(new.to_numpy_ndarrays()[0] == 0)))
    return zeros


@pytest.mark.slow  # 10 s of simulated rounds (the fast tier keeps a margin under 5 minutes)
def test_zero_count_distinguisher_gains_nothing_on_central_topk_and_flags_distributed():
    """The audit of issue 10: counting exact zeros of the release tells 'all 5 sampled clients arrived'
    from 'one dropped out' perfectly when clients sparsify their noisy shares (so that variant is marked
    as no guarantee), and not at all when the server adds dense noise to the sum of sparse clipped updates
    (a Gaussian mechanism with sensitivity C: the accounted epsilon holds)."""
    central_all, central_four = zero_count_trials("central", 5, 20), zero_count_trials("central", 4, 20)
    assert central_all == central_four == [0] * 20  # the score has no signal: TPR = FPR for every threshold
    distributed_all, distributed_four = zero_count_trials("distributed", 5, 20), zero_count_trials("distributed", 4, 20)
    assert min(distributed_all) > 300 and max(distributed_four) == 0  # a perfect distinguisher
    flagged = DPFedSAMTopK(sample_rate=1.0, clipping_norm=1.0, noise_multiplier=1.0, noise_placement="distributed")
    honest = DPFedSAMTopK(sample_rate=1.0, clipping_norm=1.0, noise_multiplier=1.0, noise_placement="central")
    for s in (flagged, honest):
        s.setup_population(5)
    assert flagged.describe()["epsilon_is_guarantee"] is False and "support" in flagged.describe()["epsilon_caveats"][0]
    assert honest.describe()["epsilon_is_guarantee"] is True


def test_central_topk_app_run_clips_on_the_server(tmp_path):
    cfg = tiny_config(tmp_path, "central", algorithm="dp-fedsam-topk", sparsity=0.3, **{"noise-placement": "central"})
    summary = run_federated(InProcessGrid(client_app, 6, cfg), cfg)
    assert summary["epsilon_is_guarantee"] is False  # tiny_config is seeded (secure-rng = false) ...
    assert summary["epsilon_caveats"] == [
        "noise derivable from the seed (secure-rng = false): anyone who knows 'seed' can remove it"
    ]  # ... but top-k itself adds no caveat
    assert summary["upload_fraction_of_dense"] < 0.6 and summary["rounds_completed"] == 2
