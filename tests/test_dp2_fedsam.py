"""DP2-FedSAM / CENTAUR / -FT baselines: body/head split, head privacy and persistence, clipping, noise."""

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MessageType, RecordDict
from torch import nn

import dpfl.clients.personalized as personalized
from dpfl.clients.base import TrainingClient
from dpfl.clients.personalized import ContextHeadStore, DP2FedSAMClient, FileHeadStore, PartialSharingClient
from dpfl.dpcore.privacy.mechanisms import clip_to_norm, flatten
from dpfl.dpcore.task import atomic
from dpfl.dpcore.task.models import MODELS, build_model, head_parameter_names, split_state_keys
from dpfl.fl_app.algorithms import ALGORITHMS
from dpfl.fl_app.client_app import app as client_app
from dpfl.fl_app.client_app import build_client
from dpfl.fl_app.config import validate
from dpfl.fl_app.server_app import build_global_model, build_strategy, run_federated, shared_weights
from dpfl.strategies.partial_sharing import PartialSharingDPFedAvg
from dpfl_tools.inprocess import InProcessGrid

torch.set_num_threads(1)
C, SIGMA = 0.5, 1.3

# A small, fast DP2-FedSAM setup: 2 labels per client, a few local steps.
SMALL = {
    "algorithm": "dp2-fedsam",
    "partitioner": "pathological",
    "classes-per-client": 2,
    "local-steps": 2,
    "head-steps": 2,
    "batch-size": 16,
    "clipping-norm": C,
    "noise-multiplier": SIGMA,
}


def small_cfg(tmp_path, **overrides):
    return validate({**SMALL, "results-dir": str(tmp_path / "run"), **overrides})


def heads_of(grid):
    return {node: ContextHeadStore(ctx.state).load() for node, ctx in grid.contexts.items()}


# ------------------------------------------------------------------ the split


@pytest.mark.parametrize("name", MODELS)
def test_body_head_split_works_for_every_model(name):
    shape = (3, 32, 32) if "cifar" in name or "resnet" in name else (1, 28, 28)
    model = build_model(name, shape, 10)
    body, head = split_state_keys(model)
    keys = list(model.state_dict())
    assert set(body).isdisjoint(head) and sorted(body + head) == sorted(keys)
    assert body == [k for k in keys if k in body] and head == [k for k in keys if k in head]  # state_dict order
    last_linear = [m for m in model.modules() if isinstance(m, nn.Linear)][-1]
    assert [tuple(model.state_dict()[k].shape) for k in head] == [(10, last_linear.in_features), (10,)]
    assert head == head_parameter_names(model)


def test_head_prefix_selects_head_and_rejects_whole_model():
    model = build_model("cnn-mnist", (1, 28, 28), 10)
    body, head = split_state_keys(model, "classifier")
    assert head == ["classifier.1.weight", "classifier.1.bias", "classifier.3.weight", "classifier.3.bias"]
    assert all(k.startswith("features") for k in body)
    with pytest.raises(ValueError, match="whole model"):
        split_state_keys(nn.Sequential(nn.Linear(3, 2)), "0")


# ------------------------------------------------------------------ the head never leaves the client


def test_messages_carry_only_the_body(tmp_path):
    # fixed-size sampling (3 of 6 a round): Poisson at q = 0.5 from OS entropy sampled nobody in both rounds
    # with probability 0.5^12 = 2.4e-4, and then no train message was checked
    cfg = small_cfg(tmp_path, **{"num-rounds": 2, "sample-rate": 0.5, "client-sampling": "fixed"})
    grid = InProcessGrid(client_app, 6, cfg)
    run_federated(grid, cfg)
    model = build_global_model(cfg, ALGORITHMS[cfg.run.algorithm])
    body, head = split_state_keys(model)
    state = model.state_dict()
    body_shapes = [tuple(state[k].shape) for k in body]
    stored_heads = [h for h in heads_of(grid).values() if h is not None]
    assert stored_heads, "some client trained"
    train_replies = [m for m in grid.received if m.metadata.message_type == MessageType.TRAIN]
    eval_replies = [m for m in grid.received if m.metadata.message_type == MessageType.EVALUATE]
    assert len(train_replies) == 2 * 3 and len(eval_replies) == 2 * 6  # every client evaluates every round
    for msg in grid.sent:  # server -> client: the body only
        arrays = msg.content["arrays"].to_numpy_ndarrays()
        assert [a.shape for a in arrays] == body_shapes
    for msg in train_replies:  # client -> server: the body update only, no array of the head's size
        assert not msg.has_error()
        arrays = [a for rec in msg.content.array_records.values() for a in rec.to_numpy_ndarrays()]
        assert [a.shape for a in arrays] == body_shapes
        assert sum(a.size for a in arrays) == sum(int(np.prod(s)) for s in body_shapes)
        for h in stored_heads:  # nothing sent equals a head tensor
            assert not any(a.shape == h[k].shape and np.allclose(a, h[k]) for a in arrays for k in h)
    for msg in eval_replies:  # evaluation replies carry metrics only
        assert not msg.content.array_records and "accuracy" in msg.content["metrics"]


def test_reply_carrying_the_head_is_rejected(tmp_path):
    # every node is asked (fixed, q = 1): with Poisson q = 0.5 the leaky node 100 went unsampled in half the runs,
    # which then checked nothing about the rejection
    cfg = small_cfg(
        tmp_path, **{"noise-multiplier": 0.0, "clipping-norm": 0.0, "sample-rate": 1.0, "client-sampling": "fixed"}
    )

    def leaky_app(msg, ctx):  # node 100 appends its head to the upload
        reply = client_app(msg, ctx)
        if ctx.node_config["partition-id"] == 0 and msg.metadata.message_type == MessageType.TRAIN:
            head = list(ContextHeadStore(ctx.state).load().values())
            reply.content["arrays"] = ArrayRecord(reply.content["arrays"].to_numpy_ndarrays() + head)
        return reply

    grid = InProcessGrid(leaky_app, 3, cfg)
    strategy = build_strategy(cfg, ALGORITHMS[cfg.run.algorithm])
    strategy.setup_population(3)
    initial = ArrayRecord(
        shared_weights(build_global_model(cfg, ALGORITHMS[cfg.run.algorithm]), cfg, ALGORITHMS[cfg.run.algorithm])
    )
    replies = grid.send_and_receive(strategy.configure_train(1, initial, ConfigRecord(), grid))
    _, metrics = strategy.aggregate_train(1, replies)
    sampled = {m.metadata.dst_node_id for m in grid.sent}
    assert sampled == {100, 101, 102}
    assert metrics["rejected"] == 1 and metrics["clients"] == 2


# ------------------------------------------------------------------ persistence


def test_exactly_the_sampled_clients_heads_change(tmp_path):
    # fixed-size sampling (3 of 8 a round): Poisson at q = 0.4 with sampling from OS entropy drew an empty
    # round in about 5% of runs (0.6^8 per round), which this test does not exercise
    cfg = small_cfg(tmp_path, **{"num-rounds": 3, "sample-rate": 0.4, "client-sampling": "fixed"})
    grid = InProcessGrid(client_app, 8, cfg)
    snapshots, sampled, seen = [heads_of(grid)], [], [0]

    def on_round_end(published, diagnostics):
        sampled.append(
            {m.metadata.dst_node_id for m in grid.sent[seen[0] :] if m.metadata.message_type == MessageType.TRAIN}
        )
        seen[0] = len(grid.sent)
        snapshots.append(heads_of(grid))
        assert diagnostics["personalized_clients"] == 8  # all clients evaluate, sampled or not
        assert "personalized_accuracy" not in published  # a client evaluation: not covered by epsilon

    strategy = build_strategy(cfg, ALGORITHMS[cfg.run.algorithm], on_round_end=on_round_end)
    strategy.start(
        grid,
        ArrayRecord(
            shared_weights(build_global_model(cfg, ALGORITHMS[cfg.run.algorithm]), cfg, ALGORITHMS[cfg.run.algorithm])
        ),
        num_rounds=3,
    )
    initial = {k: v.numpy() for k, v in build_global_model(cfg, ALGORITHMS[cfg.run.algorithm]).state_dict().items()}
    _, head_keys = split_state_keys(build_global_model(cfg, ALGORITHMS[cfg.run.algorithm]))

    def same(a, b):
        a = a or {k: initial[k] for k in head_keys}  # no stored head yet: the seeded model's head
        b = b or {k: initial[k] for k in head_keys}
        return all(np.array_equal(a[k], b[k]) for k in head_keys)

    assert len(sampled) == 3 and all(len(s) == 3 for s in sampled)
    for rnd in range(1, 4):
        before, after = snapshots[rnd - 1], snapshots[rnd]
        changed = {node for node in grid.contexts if not same(before[node], after[node])}
        assert changed == sampled[rnd - 1], rnd


def test_heads_persist_in_node_state_dir(tmp_path):
    # fixed-size sampling (2 of 4 a round): Poisson at q = 0.5 from OS entropy sampled nobody in both rounds
    # with probability 0.5^8 = 1/256, and the test failed
    cfg = small_cfg(tmp_path, **{"num-rounds": 2, "sample-rate": 0.5, "client-sampling": "fixed"})
    grid = InProcessGrid(client_app, 4, cfg)
    for node, ctx in grid.contexts.items():
        ctx.node_config["state-dir"] = str(tmp_path / f"node{node}")
    run_federated(grid, cfg)
    train = [m for m in grid.sent if m.metadata.message_type == MessageType.TRAIN]
    assert sorted(int(m.content["config"]["server-round"]) for m in train) == [1, 1, 2, 2]
    trained = {m.metadata.dst_node_id for m in train}
    assert 2 <= len(trained) <= 4
    for node, ctx in grid.contexts.items():
        files = list((tmp_path / f"node{node}").glob("*.npz"))
        assert len(files) == (1 if node in trained else 0)
        assert not ctx.state.array_records  # nothing in Context.state when a state-dir is given
        if files:
            head = FileHeadStore(files[0]).load()
            assert sorted(head) == sorted(split_state_keys(build_global_model(cfg, ALGORITHMS[cfg.run.algorithm]))[1])


def test_relative_state_dir_is_refused(tmp_path):
    cfg = small_cfg(tmp_path)
    ctx = Context(
        run_id=1,
        node_id=1,
        node_config={"partition-id": 0, "num-partitions": 2, "state-dir": "heads"},
        state=RecordDict(),
        run_config=cfg.run_config(),
    )
    with pytest.raises(ValueError, match="state-dir='heads'.*absolute"):
        build_client(ctx)


def test_head_file_survives_a_crash_during_the_next_write(tmp_path, monkeypatch):
    store = FileHeadStore(tmp_path / "heads" / "personal-head.npz")
    old = {"fc.weight": np.arange(6, dtype=np.float32).reshape(2, 3), "fc.bias": np.ones(2, np.float32)}
    store.save(old)
    new = {k: v + 100 for k, v in old.items()}

    def half_write_then_crash(f, **arrays):
        f.write(b"PK\x03\x04 half a zip")
        raise OSError("disk died mid-write")

    monkeypatch.setattr(personalized.np, "savez", half_write_then_crash)
    with pytest.raises(OSError, match="mid-write"):
        store.save(new)
    monkeypatch.undo()
    loaded = store.load()
    assert all(np.array_equal(loaded[k], old[k]) for k in old)
    assert os.listdir(store.path.parent) == ["personal-head.npz"]  # the partial temp file is gone

    # a crash after the data is written but before the rename: still the old head
    monkeypatch.setattr(atomic.os, "replace", lambda *a: (_ for _ in ()).throw(OSError("killed")))
    with pytest.raises(OSError, match="killed"):
        store.save(new)
    monkeypatch.undo()
    assert all(np.array_equal(store.load()[k], old[k]) for k in old)
    store.save(new)
    assert all(np.array_equal(store.load()[k], new[k]) for k in new)


# ------------------------------------------------------------------ privatization of the body update


def client_for(tmp_path, m_clients=20, **overrides):
    cfg = small_cfg(tmp_path, **{"lr": 0.5, "local-steps": 4, **overrides})
    ctx = Context(
        run_id=1,
        node_id=100,
        node_config={"partition-id": 3, "num-partitions": m_clients},
        state=RecordDict(),
        run_config=cfg.run_config(),
    )
    return build_client(ctx), cfg


def test_clipped_body_update_norm_and_noise_share(tmp_path):
    strategy = PartialSharingDPFedAvg(
        sample_rate=0.5, clipping_norm=C, noise_multiplier=SIGMA, noise_placement="distributed", client_sampling="fixed"
    )
    strategy.setup_population(20)
    config = strategy.client_train_config(1)
    m = 10
    assert config["noise-std"] == pytest.approx(C * SIGMA / math.sqrt(m))

    client, cfg = client_for(tmp_path)
    assert isinstance(client, DP2FedSAMClient)
    body = shared_weights(build_global_model(cfg, ALGORITHMS[cfg.run.algorithm]), cfg, ALGORITHMS[cfg.run.algorithm])
    raw, _, metrics = client.fit(body, {**config, "privatize": False})
    update = flatten(raw)  # fit returns the update Delta = phi_new - phi_global
    assert metrics["update-norm"] == pytest.approx(np.linalg.norm(update), rel=1e-5)
    assert metrics["update-norm"] > 2 * C  # clipping is active

    clipped_client, _ = client_for(tmp_path)  # fresh state: identical local training
    clipped, _, _ = clipped_client.fit(body, {**config, "noise-std": 0.0})
    clipped_update = flatten(clipped)
    assert len(clipped) == len(body)
    assert np.linalg.norm(clipped_update) <= C * (1 + 1e-6)
    np.testing.assert_allclose(clipped_update, clip_to_norm(update, C)[0], rtol=1e-5, atol=1e-7)

    noisy_client, _ = client_for(tmp_path)
    noisy, _, _ = noisy_client.fit(body, config)
    noise = flatten(noisy) - clipped_update
    n, std = noise.size, C * SIGMA / math.sqrt(m)
    assert abs(noise.std() / std - 1) < 5 / math.sqrt(2 * n), (noise.std(), std)
    assert abs(noise.mean()) < 5 * std / math.sqrt(n)


def test_sam_body_steps_and_centaur_sgd(tmp_path):
    """DP2-FedSAM with rho = 0 is CENTAUR exactly; with rho > 0 the body update differs (SAM is used)."""
    base = {"noise-multiplier": 0.0, "clipping-norm": 0.0}
    centaur, cfg = client_for(tmp_path, **base, algorithm="centaur")
    flat, _ = client_for(tmp_path, **base, **{"sam-rho": 0.0})
    sam, _ = client_for(tmp_path, **base, **{"sam-rho": 0.5})
    assert type(centaur) is PartialSharingClient
    body = shared_weights(build_global_model(cfg, ALGORITHMS[cfg.run.algorithm]), cfg, ALGORITHMS[cfg.run.algorithm])
    out = [flatten(c.fit(body, {"server-round": 1})[0]) for c in (centaur, flat, sam)]
    np.testing.assert_allclose(out[0], out[1], atol=1e-6)
    assert np.abs(out[0] - out[2]).max() > 1e-4
    # the head was trained (tau_h steps), the body's head tensors were never touched by body steps
    assert all(centaur.head_store.load()[k].shape == v.shape for k, v in centaur.head_arrays().items())


def test_head_phase_freezes_body_and_body_phase_freezes_head(tmp_path):
    client, cfg = client_for(tmp_path, **{"noise-multiplier": 0.0, "clipping-norm": 0.0})
    client.set_body(
        shared_weights(build_global_model(cfg, ALGORITHMS[cfg.run.algorithm]), cfg, ALGORITHMS[cfg.run.algorithm])
    )
    body0 = flatten(client.body_arrays())
    head0 = client.head_arrays()
    client.train_head({"server-round": 1})
    assert np.array_equal(flatten(client.body_arrays()), body0)
    head1 = client.head_arrays()
    assert any(not np.array_equal(head0[k], head1[k]) for k in head0)
    client.train_body({"server-round": 1})
    assert all(np.array_equal(head1[k], v) for k, v in client.head_arrays().items())
    assert not np.array_equal(flatten(client.body_arrays()), body0)
    assert all(p.requires_grad for p in client.model.parameters())  # restored afterwards


def test_learning_rate_decays_per_round():
    model = nn.Linear(3, 2)
    data = type("D", (), {"x": np.zeros((4, 3), np.float32), "y": np.zeros(4, np.int64), "__len__": lambda s: 4})()
    client = TrainingClient(model, data, data, lr=0.2, lr_decay=0.99)
    assert client.make_optimizer({"server-round": 1}).lr == pytest.approx(0.2)
    assert client.make_optimizer({"server-round": 11}).lr == pytest.approx(0.2 * 0.99**10)


def test_context_store_round_trip():
    store = ContextHeadStore(RecordDict())
    assert store.load() is None
    head = {"classifier.3.weight": np.random.default_rng(0).normal(size=(10, 32)).astype(np.float32)}
    store.save(head)
    assert np.array_equal(store.load()["classifier.3.weight"], head["classifier.3.weight"])


# ------------------------------------------------------------------ end to end


@pytest.mark.slow
def test_fine_tune_baseline_reports_global_and_personalized_accuracy(tmp_path):
    cfg = small_cfg(
        tmp_path,
        **{
            "algorithm": "dp-fedavg-ft",
            "head-steps": 0,  # SMALL's head-steps is dp2-fedsam's: dp-fedavg-ft has no head and refuses it
            "num-rounds": 2,
            "fine-tune-steps": 30,
            "noise-multiplier": 0.1,
            "local-steps": 5,
        },
    )
    summary = run_federated(InProcessGrid(client_app, 6, cfg), cfg)
    diagnostics = diagnostics_summary(summary)
    assert diagnostics["personalized_clients"] == 6 and summary["final_accuracy"] is not None
    # fine-tuning on a 2-label split moves predictions onto those labels: 12 runs (noise from OS entropy)
    # measured 0.72-0.94 against a global 0.06-0.14. At sigma 0.5 the noisy global model left fine-tuning at
    # 0.15 and 0.20 in 2 of 16 runs, and at 0.27 once in CI (6 clients: the noise on the average is large),
    # so the test uses sigma 0.1.
    assert diagnostics["personalized_accuracy"] > summary["final_accuracy"] + 0.2


def diagnostics_summary(summary: dict) -> dict:
    """The run's non-private end-of-run figures (the personalized evaluation is a client evaluation)."""
    return json.loads(Path(summary["results_dir"], "diagnostics-summary.json").read_text())


E2E = {
    "partitioner": "pathological",
    "classes-per-client": 2,
    "num-rounds": 8,
    "sample-rate": 0.5,
    "noise-multiplier": 0.5,
    "clipping-norm": 0.5,
    "local-epochs": 1,
}


@pytest.mark.slow
def test_dp2_fedsam_personalized_beats_dp_fedsam_global_at_same_epsilon(tmp_path):
    """20 clients with 2 labels each; numbers in docs/dp2-fedsam.md.

    Seeded (secure-rng = false, seed 42: personalized 0.842, global 0.126). With noise and sampling from OS entropy,
    56 runs gave personalized 0.800 +- 0.044 (0.700-0.911) and global 0.131 +- 0.028: the 0.7 bound is 2.3 standard
    deviations below that mean, about 1% of runs failed it (one of the 56 reached 0.69996).
    """
    results = {}
    for algorithm in ("dp2-fedsam", "dp-fedsam"):
        head = {"head-epochs": 1} if algorithm == "dp2-fedsam" else {}  # dp-fedsam has no head: it refuses the key
        cfg = validate(
            {**E2E, **head, "algorithm": algorithm, "secure-rng": False, "results-dir": str(tmp_path / algorithm)}
        )
        results[algorithm] = run_federated(InProcessGrid(client_app, 20, cfg), cfg)
    dp2, global_ = results["dp2-fedsam"], results["dp-fedsam"]
    personal = diagnostics_summary(dp2)
    assert dp2["epsilon"] == pytest.approx(global_["epsilon"], rel=1e-12) and 0 < dp2["epsilon"] < 80
    assert dp2["final_accuracy"] is None and personal["personalized_clients"] == 20
    assert personal["personalized_accuracy"] > global_["final_accuracy"] + 0.3, (personal, global_)
    assert personal["personalized_accuracy"] > 0.7
