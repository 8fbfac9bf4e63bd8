"""The cohort engine (dpfl_tools.cohort.CohortGrid) against the sequential in-process grid.

Tolerance: every array of every train reply within RTOL x its largest |value| of the sequential reply's (plus, in
a run of several rounds, a few float32 ulps of the weights each reply's Delta was taken from), every
metric within RTOL relative (float32 rounding: vmap'd kernels sum in another order); the printed epsilon and
everything the ledger writes identical (the engine changes no privacy number). RTOL is 1e-5 on the CPU and 1e-4
on CUDA, where the batched and the plain layer run different cuDNN/cuBLAS kernels (an H200 gave 1.9e-5 on the
wavelet route, docs/gpu.md).
"""

from __future__ import annotations

import dataclasses
import json
import logging

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict

from dpfl.fl_app.client_app import app as client_app
from dpfl.fl_app.client_app import build_client
from dpfl.fl_app.config import validate
from dpfl.fl_app.server_app import run_federated
from dpfl_tools.cohort import CohortGrid
from dpfl_tools.inprocess import InProcessGrid

RTOL = 1e-4 if torch.cuda.is_available() else 1e-5
NODES = 6
BASE = {
    "dataset": "digits",
    "model": "mlp",
    "num-rounds": 2,
    "local-steps": 0,
    "local-epochs": 1,  # Dirichlet partitions: every client its own number of steps (ragged)
    "batch-size": 16,
    "seed": 0,
    "secure-rng": False,
    "sample-rate": 1.0,
}


def in_node_order(replies: list[Message]) -> list[Message]:
    """Each exchange's replies (a run of one message type) by node: Flower's FedAvg samples its evaluation nodes
    in an order of its own (unseeded), so two runs ask the same nodes in different orders."""
    blocks, block = [], 0
    for i, m in enumerate(replies):
        block += i > 0 and m.metadata.message_type != replies[i - 1].metadata.message_type
        blocks.append((block, m.metadata.src_node_id))
    return [m for _, m in sorted(zip(blocks, replies), key=lambda pair: pair[0])]


def assert_replies_close(seq: list[Message], coh: list[Message], sent: list[Message] = ()) -> None:
    """Each reply of `coh` equal to `seq`'s of the same node within RTOL (module docstring). With `sent` (the
    messages `seq` answers), each array element may also be off by 2 (k + 1) float32 ulps of the weight w_i its
    Delta = w_new - w was taken from, k the client's local steps: each step rounds w to its own ulp, which for a
    model far from 0 (the wavelet's server noise leaves |w| up to 24) exceeds RTOL of Delta's largest value."""
    assert len(seq) == len(coh)
    weights = {m.metadata.message_id: m.content["arrays"].to_numpy_ndarrays() for m in sent if "arrays" in m.content}
    for a, b in zip(in_node_order(seq), in_node_order(coh)):
        assert not a.has_error() and not b.has_error()
        assert a.metadata.message_type == b.metadata.message_type
        assert a.content.keys() == b.content.keys()
        if a.metadata.message_type == "query.client_id":  # the identity answers: the node config's client id
            assert a.content["client-identity"]["client-id"] == b.content["client-identity"]["client-id"]
            continue
        if "arrays" in a.content:
            xa, xb = a.content["arrays"].to_numpy_ndarrays(), b.content["arrays"].to_numpy_ndarrays()
            assert [(x.dtype, x.shape) for x in xa] == [(x.dtype, x.shape) for x in xb]
            w = weights.get(a.metadata.reply_to_message_id)
            ulps = 2 * (int(a.content["metrics"].get("local-steps", 0)) + 1) * np.finfo(np.float32).eps
            for j, (x, y) in enumerate(zip(xa, xb)):
                slack = ulps * np.abs(w[j]) if w is not None and len(w) == len(xa) else 0.0
                assert np.all(np.abs(x - y) <= RTOL * np.abs(x).max() + slack), (j, np.abs(x - y).max())
        ma, mb = dict(a.content["metrics"]), dict(b.content["metrics"])
        assert ma.keys() == mb.keys()
        for k in ma:
            assert type(ma[k]) is type(mb[k]) and mb[k] == pytest.approx(ma[k], rel=RTOL), k


def run(grid_class, overrides: dict, tmp_path):
    torch.set_num_threads(1)
    cfg = validate({**BASE, **overrides, "results-dir": str(tmp_path / grid_class.__name__)})
    grid = grid_class(client_app, NODES, cfg)
    summary = run_federated(grid, cfg)
    return grid, summary


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param({"algorithm": "dp-fedsam"}, id="dp-fedsam", marks=pytest.mark.slow),
        pytest.param(  # every node evaluates too: the evaluate messages go through the batch as well
            {"algorithm": "dp-fedavg", "noise-placement": "distributed", "fraction-evaluate": 1.0},
            id="dp-fedavg-distributed",
        ),
        pytest.param(
            {"algorithm": "dp-fedavg", "noise-placement": "central"}, id="dp-fedavg-central", marks=pytest.mark.slow
        ),
        # the ClientApp's mods around the batched reply: local DP, adaptive clipping's noisy bit
        pytest.param(
            {"algorithm": "dp-fedavg", "noise-placement": "local", "noise-multiplier": 4.0},
            id="local-dp",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            {"algorithm": "dp-fedavg", "adaptive-clipping": True, "clip-count-noise-multiplier": 2.0},
            id="adaptive-clipping",
            marks=pytest.mark.slow,
        ),
        # the exact calibration's server noise (std sigma C sqrt(2^14) = 64 here) leaves a global model with |w| up
        # to 24 after round 1: round 2's replies are compared within the ulps of w too (`assert_replies_close`)
        pytest.param(
            {"algorithm": "dp-fedavg-wav", "noise-placement": "central"}, id="wavelet", marks=pytest.mark.slow
        ),
        pytest.param({"algorithm": "dp-ftrl", "partitioner": "iid"}, id="dp-ftrl", marks=pytest.mark.slow),
        pytest.param({"algorithm": "dp-fedsam-ft", "fine-tune-steps": 2}, id="dp-fedsam-ft", marks=pytest.mark.slow),
        # one round: a coordinate at the k-th largest |value| may swap with its neighbour on a rounding difference,
        # which moves the next round's global model by a whole coordinate
        pytest.param(
            {"algorithm": "dp-fedsam-topk", "sparsity": 0.4, "num-rounds": 1},
            id="dp-fedsam-topk",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_replies_and_epsilon_equal_sequential(overrides, tmp_path):
    seq, s1 = run(InProcessGrid, overrides, tmp_path)
    coh, s2 = run(CohortGrid, overrides, tmp_path)
    trains = [m for m in seq.received if m.metadata.message_type == "train"]
    assert coh.batched == len(trains) > 0  # every train message went through the batch
    assert coh.evaluated == sum(m.metadata.message_type == "evaluate" for m in seq.received)  # and every evaluate
    if "partitioner" not in overrides and "local-steps" in trains[0].content["metrics"]:
        assert len({m.content["metrics"]["local-steps"] for m in trains}) > 1  # ragged clients
    assert_replies_close(seq.received, coh.received, seq.sent)
    assert s2["epsilon"] == s1["epsilon"] and s2["delta"] == s1["delta"]
    assert s2["final_accuracy"] == pytest.approx(s1["final_accuracy"], abs=0.01)
    ledger = [json.loads(line)["epsilon"] for line in (tmp_path / "CohortGrid" / "metrics.jsonl").open()]
    assert ledger == [json.loads(line)["epsilon"] for line in (tmp_path / "InProcessGrid" / "metrics.jsonl").open()]


def train_messages(grid, noise_std: dict[int, float] | None = None) -> list[Message]:
    weights = [v.detach().cpu().numpy() for v in build_client(grid.contexts[100]).model.state_dict().values()]
    config = {"server-round": 1, "privatize": True, "clipping-norm": 0.5}
    return [
        grid.create_message(
            RecordDict(
                {
                    "arrays": ArrayRecord(weights),
                    "config": ConfigRecord({**config, "noise-std": (noise_std or {}).get(node, 0.05)}),
                }
            ),
            "train",
            node,
            "1",
        )
        for node in grid.get_node_ids()
    ]


def arrays(replies: list[Message]) -> list[list[np.ndarray]]:
    return [r.content["arrays"].to_numpy_ndarrays() for r in replies]


def test_no_client_leaks_into_another(monkeypatch):
    """One client's data or noise changed: its reply changes, every other reply is bit for bit the same."""
    cfg = validate({**BASE, "algorithm": "dp-fedsam"})
    grid = CohortGrid(client_app, NODES, cfg)
    base = arrays(grid.send_and_receive(train_messages(grid)))

    grid = CohortGrid(client_app, NODES, cfg)
    noisier = arrays(grid.send_and_receive(train_messages(grid, noise_std={102: 0.5})))

    import dpfl.fl_app.client_app as project

    load = project.load_client_partition

    def other_data(s, pid, n):
        train, test = load(s, pid, n)
        if pid == 4:  # a copy (the loaded partition may be cached): mirrored images
            train = dataclasses.replace(train, x=np.ascontiguousarray(np.flip(train.x, axis=-1)))
        return train, test

    monkeypatch.setattr(project, "load_client_partition", other_data)
    grid = CohortGrid(client_app, NODES, cfg)
    other = arrays(grid.send_and_receive(train_messages(grid)))
    assert grid.batched == NODES
    for i in range(NODES):
        for changed, index in ((noisier, 2), (other, 4)):
            same = all(np.array_equal(a, b) for a, b in zip(base[i], changed[i]))
            assert same == (i != index), (i, index)


def evaluate_messages(grid) -> list[Message]:
    weights = [v.detach().cpu().numpy() for v in build_client(grid.contexts[100]).model.state_dict().values()]
    content = RecordDict({"arrays": ArrayRecord(weights), "config": ConfigRecord({"server-round": 1})})
    return [grid.create_message(content, "evaluate", node, "1") for node in grid.get_node_ids()]


def test_evaluation_in_the_batch_equals_the_clientapps_and_does_not_leak(monkeypatch):
    """Evaluate messages in the batch: each node's loss and accuracy equal the ClientApp's on its own held-out
    split (padded to the longest: the splits differ in size); one node's split changed moves only its reply."""
    cfg = validate({**BASE, "algorithm": "dp-fedavg"})
    one_by_one = InProcessGrid(client_app, NODES, cfg)
    seq = one_by_one.send_and_receive(evaluate_messages(one_by_one))
    grid = CohortGrid(client_app, NODES, cfg)
    base = grid.send_and_receive(evaluate_messages(grid))
    assert grid.evaluated == NODES and grid.batched == 0
    assert len({m.content["metrics"]["num-examples"] for m in base}) > 1  # ragged splits
    assert_replies_close(seq, base)

    import dpfl.fl_app.client_app as project

    load = project.load_client_partition

    def other_test(s, pid, n):
        train, test = load(s, pid, n)
        return train, (dataclasses.replace(test, x=np.ascontiguousarray(np.flip(test.x, -1))) if pid == 3 else test)

    monkeypatch.setattr(project, "load_client_partition", other_test)
    grid = CohortGrid(client_app, NODES, cfg)
    other = grid.send_and_receive(evaluate_messages(grid))
    for i in range(NODES):
        same = dict(base[i].content["metrics"]) == dict(other[i].content["metrics"])
        assert same == (i != 3), i


def test_uploads_on_threads_are_the_uploads_one_after_the_other(monkeypatch):
    """A large model's uploads run on a pool of threads (here forced for the small one): every reply bit for bit
    the one computed on one thread, each client's noise from its own generator."""
    import dpfl.clients.cohort.train as cohort_train

    cfg = validate({**BASE, "algorithm": "dp-fedsam"})
    grid = CohortGrid(client_app, NODES, cfg)
    one_thread = arrays(grid.send_and_receive(train_messages(grid)))
    pools = []
    monkeypatch.setattr(cohort_train, "THREADED_UPLOAD_PARAMS", 0)
    monkeypatch.setattr(cohort_train.os, "sched_getaffinity", lambda _pid: {0, 1, 2, 3}, raising=False)
    real_pool = cohort_train.ThreadPoolExecutor
    monkeypatch.setattr(cohort_train, "ThreadPoolExecutor", lambda n: pools.append(n) or real_pool(n))
    grid = CohortGrid(client_app, NODES, cfg)
    threaded = arrays(grid.send_and_receive(train_messages(grid)))
    assert pools == [4] and grid.batched == NODES
    assert all(np.array_equal(a, b) for x, y in zip(one_thread, threaded) for a, b in zip(x, y))


def test_unbatched_algorithm_and_own_clientapp_run_one_by_one(caplog, tmp_path, monkeypatch):
    """A client whose local rule the engine does not know (a subclass of SAMClient: local_rule takes exact types, as
    a subclass may change the rule) and a user's own ClientApp: message by message, one log line each, the
    sequential replies exactly."""
    from dpfl.clients.sam import SAMClient
    from dpfl.fl_app.algorithms import ALGORITHMS

    class OwnSAM(SAMClient):
        pass

    def own_client(setup):
        kwargs = setup.training_kwargs()
        return OwnSAM(setup.model, setup.trainset, setup.testset, rho=setup.settings.training.sam_rho, **kwargs)

    monkeypatch.setitem(ALGORITHMS, "dp-fedsam", dataclasses.replace(ALGORITHMS["dp-fedsam"], build_client=own_client))
    seq, _ = run(InProcessGrid, {"algorithm": "dp-fedsam", "num-rounds": 1}, tmp_path)
    with caplog.at_level(logging.INFO, logger="flwr"):
        grid, _ = run(CohortGrid, {"algorithm": "dp-fedsam", "num-rounds": 1}, tmp_path)
    assert grid.batched == 0 and len(grid.received) == len(seq.received) > 0
    for a, b in zip(seq.received, grid.received):
        assert not a.has_error() and a.content.keys() == b.content.keys()
        if "arrays" in a.content:
            x, y = a.content["arrays"].to_numpy_ndarrays(), b.content["arrays"].to_numpy_ndarrays()
            assert all(np.array_equal(u, v) for u, v in zip(x, y))
    lines = [r.getMessage() for r in caplog.records if "Cohort engine" in r.getMessage()]
    assert "Cohort engine: OwnSAM's local rule is not batched yet: its messages run one by one" in lines
    assert len(lines) == len(set(lines))  # once per reason

    def own_app(msg, context):
        return client_app(msg, context)

    grid = CohortGrid(own_app, NODES, validate({**BASE, "algorithm": "dp-fedavg"}))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="flwr"):
        replies = grid.send_and_receive(train_messages(grid))
    assert grid.batched == 0 and not any(r.has_error() for r in replies)
    assert [r.getMessage() for r in caplog.records if "Cohort engine" in r.getMessage()] == [
        "Cohort engine: a ClientApp other than the project's (fl_app.client_app.app): messages run one by one"
    ]


def test_malformed_message_gets_the_clientapps_error():
    """A message whose arrays do not fit the model is not batched: its reply is the ClientApp's error, the others
    train in the batch."""
    cfg = validate({**BASE, "algorithm": "dp-fedavg"})
    grid = CohortGrid(client_app, NODES, cfg)
    messages = train_messages(grid)
    messages[1].content["arrays"] = ArrayRecord([np.zeros(3, dtype=np.float32)])
    replies = grid.send_and_receive(messages)
    assert [r.has_error() for r in replies] == [False, True] + [False] * (NODES - 2)
    assert grid.batched == NODES - 1


def test_a_client_that_cannot_be_built_is_logged_and_gets_the_clientapps_error(caplog, monkeypatch):
    """build_client raising (e.g. a model Opacus refuses) is not swallowed: one log line names the error, and every
    message runs through the ClientApp, whose reply carries that error."""
    import dpfl.fl_app.client_app as project

    def broken(context, model=None):
        raise ValueError("no client for this node")

    grid = CohortGrid(client_app, NODES, validate({**BASE, "algorithm": "dp-fedavg"}))
    monkeypatch.setattr(project, "build_client", broken)
    with caplog.at_level(logging.INFO, logger="flwr"):
        replies = grid.send_and_receive(train_messages(grid))
    assert grid.batched == 0 and all(r.has_error() for r in replies)
    lines = [r.getMessage() for r in caplog.records if "Cohort engine" in r.getMessage()]
    assert lines == [
        "Cohort engine: building a client raised ValueError: no client for this node; its messages run one by one"
    ]


def launch(engine: str, tmp_path, run_config: str, clients: int, *flags: str) -> dict:
    from dpfl_tools.launch import main

    folder = tmp_path / engine
    argv = ["--engine", engine, "--clients", str(clients), *flags, "-c", f'{run_config} results-dir="{folder}"']
    assert main(argv) == 0
    return json.loads((folder / "summary.json").read_text())


@pytest.mark.parametrize(
    "run_config, clients, tolerance",
    # accuracy tolerance: float32 rounding differences grow with local steps (ReLU and max-pool switches; cnn-mnist:
    # 1e-7 relative after 1 step, 4e-7 after 10, up to 4e-3 after an epoch), so accuracies agree to a point or two
    [
        pytest.param(
            'dataset="digits" model="mlp" num-rounds=3 sample-rate=1.0 noise-multiplier=0.1 clipping-norm=1.0 '
            "secure-rng=false tensorboard=false",
            6,
            0.01,
            id="digits",
            marks=pytest.mark.slow,
        ),
        # the default job (pyproject's config: dp-fedsam, cnn-mnist, mnist-embedded), 2 rounds of 20 clients; sigma
        # 0.3, as 20 clients' average does not bear sigma = 1 (the sequential engine's replies turn NaN too)
        pytest.param(
            "num-rounds=2 noise-multiplier=0.3 secure-rng=false tensorboard=false",
            20,
            0.03,
            id="default",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_launch_engine_cohort_same_accuracy_and_epsilon(run_config, clients, tolerance, tmp_path, capsys):
    """`python -m dpfl_tools.launch --engine cohort`: the accuracy and epsilon of `--engine inprocess` (same seed)."""
    torch.set_num_threads(1)
    sequential = launch("inprocess", tmp_path, run_config, clients)
    cohort = launch("cohort", tmp_path, run_config, clients)
    assert cohort["rounds_completed"] == sequential["rounds_completed"]
    assert cohort["epsilon"] == sequential["epsilon"] and cohort["epsilon"] > 0
    assert cohort["final_accuracy"] == pytest.approx(sequential["final_accuracy"], abs=tolerance)
    assert cohort["final_accuracy"] > 0.15  # above chance (10 classes)
    assert f"epsilon={cohort['epsilon']}" in capsys.readouterr().out


def test_model_with_buffers_is_not_batched(caplog):
    """BatchNorm's running statistics would mix clients in a batch: such a model runs message by message, said once."""
    cfg = validate({**BASE, "algorithm": "dp-fedavg"})
    grid = CohortGrid(client_app, NODES, cfg)
    grid._model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.BatchNorm1d(64), torch.nn.Linear(64, 10))
    with caplog.at_level(logging.INFO, logger="flwr"):
        replies = grid.send_and_receive(train_messages(grid))
    assert grid.batched == 0 and not any(r.has_error() for r in replies)
    assert [r.getMessage() for r in caplog.records if "Cohort engine" in r.getMessage()] == [
        "Cohort engine: the model has buffers (e.g. BatchNorm statistics), which would mix clients: one by one"
    ]


# ---------------------------------------------------------------- personal heads (DP2-FedSAM, CENTAUR)


def stored_heads(grid) -> dict[int, dict[str, np.ndarray] | None]:
    """Each node's personal head as the ClientApp left it in Context.state (None: never trained)."""
    from dpfl.clients.personalized import ContextHeadStore

    return {node: ContextHeadStore(context.state).load() for node, context in grid.contexts.items()}


def assert_heads_close(seq: dict, coh: dict) -> None:
    assert seq.keys() == coh.keys()
    for node in seq:
        assert (seq[node] is None) == (coh[node] is None), node
        if seq[node] is not None:
            assert seq[node].keys() == coh[node].keys()
            for k, a in seq[node].items():
                b = coh[node][k]
                assert a.dtype == b.dtype and a.shape == b.shape
                assert np.abs(a - b).max() <= RTOL * np.abs(a).max(), (node, k)


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param({"algorithm": "dp2-fedsam"}, id="dp2-fedsam", marks=pytest.mark.slow),
        # half the nodes a round: some start from the model's initial head in round 2, others from their own
        pytest.param(
            {"algorithm": "centaur", "sample-rate": 0.5, "num-rounds": 3, "head-lr": 0.05, "lr-decay": 0.9},
            id="centaur",
        ),
    ],
)
def test_personal_heads_replies_and_state_equal_sequential(overrides, tmp_path):
    """Personal heads in the batch: every train and evaluate reply (the evaluation reads the head the batch wrote)
    and every node's head in Context.state equal the sequential ClientApp's, and the epsilon is identical."""
    seq, s1 = run(InProcessGrid, overrides, tmp_path)
    coh, s2 = run(CohortGrid, overrides, tmp_path)
    trains = [m for m in seq.received if m.metadata.message_type == "train"]
    assert coh.batched == len(trains) > 0
    assert len({m.content["metrics"]["head-steps"] for m in trains}) > 1  # ragged heads
    if overrides.get("sample-rate") == 0.5:  # nodes first trained after round 1 (initial head), some several times
        rounds: dict[int, list[int]] = {}
        for m in seq.sent:
            if m.metadata.message_type == "train":
                rounds.setdefault(m.metadata.dst_node_id, []).append(m.content["config"]["server-round"])
        assert any(r[0] > 1 for r in rounds.values()) and any(len(r) > 1 for r in rounds.values())
    assert coh.evaluated == sum(m.metadata.message_type == "evaluate" for m in seq.received) > 0
    assert_replies_close(seq.received, coh.received)
    assert_heads_close(stored_heads(seq), stored_heads(coh))
    assert s2["epsilon"] == s1["epsilon"] and s2["delta"] == s1["delta"]


def body_messages(grid, server_round: int = 1) -> list[Message]:
    body = build_client(grid.contexts[100]).body_arrays()
    config = {"server-round": server_round, "privatize": True, "clipping-norm": 0.5, "noise-std": 0.05}
    return [
        grid.create_message(RecordDict({"arrays": ArrayRecord(body), "config": ConfigRecord(config)}), "train", n, "1")
        for n in grid.get_node_ids()
    ]


def test_personal_heads_do_not_leak_and_fail_as_the_clientapp(monkeypatch):
    """DP2-FedSAM in the batch: replies and heads equal the sequential ones; one node's stored head or data changed moves only its reply and its saved head; a
    node that fails keeps its previous head (none), and a stored head that does not fit the model gets the
    ClientApp's error as its reply, while the other nodes train in the batch unchanged."""
    from dpfl.clients.personalized import ContextHeadStore

    cfg = validate({**BASE, "algorithm": "dp2-fedsam", "head-steps": 3, "local-steps": 3})
    grid = CohortGrid(client_app, NODES, cfg)
    replies = grid.send_and_receive(body_messages(grid))
    base, base_heads = arrays(replies), stored_heads(grid)
    assert grid.batched == NODES and all(h is not None for h in base_heads.values())
    seq = InProcessGrid(client_app, NODES, cfg)  # DP2-FedSAM's SAM body in the fast tier: the sequential numbers
    assert_replies_close(seq.send_and_receive(body_messages(seq)), replies)
    assert_heads_close(stored_heads(seq), base_heads)

    grid = CohortGrid(client_app, NODES, cfg)
    other_head = {k: np.full_like(v, 0.01) for k, v in build_client(grid.contexts[102]).head_arrays().items()}
    ContextHeadStore(grid.contexts[102].state).save(other_head)
    own_head, own_heads = arrays(grid.send_and_receive(body_messages(grid))), stored_heads(grid)

    import dpfl.fl_app.client_app as project

    load = project.load_client_partition

    def other_data(s, pid, n):
        train, test = load(s, pid, n)
        if pid == 4:
            train = dataclasses.replace(train, x=np.ascontiguousarray(np.flip(train.x, axis=-1)))
        return train, test

    with monkeypatch.context() as patch:
        patch.setattr(project, "load_client_partition", other_data)
        grid = CohortGrid(client_app, NODES, cfg)
        own_data, data_heads = arrays(grid.send_and_receive(body_messages(grid))), stored_heads(grid)
    assert grid.batched == NODES
    for i, node in enumerate(grid.get_node_ids()):
        for replies, heads, index in ((own_head, own_heads, 2), (own_data, data_heads, 4)):
            same = all(np.array_equal(a, b) for a, b in zip(base[i], replies[i]))
            same_head = all(np.array_equal(base_heads[node][k], heads[node][k]) for k in base_heads[node])
            assert same == same_head == (i != index), (i, index)

    grid = CohortGrid(client_app, NODES, cfg, fail=lambda node, _msg: node == 103)
    ContextHeadStore(grid.contexts[101].state).save({"fc.weight": np.zeros((2, 2), np.float32)})
    replies = grid.send_and_receive(body_messages(grid))
    assert [r.has_error() for r in replies] == [False, True, False, True, False, False]
    assert "stored head" in replies[1].error.reason and "crashed" in replies[3].error.reason
    assert grid.batched == NODES - 1  # all but the unfitting head; the crashed node's reply was never used
    heads = stored_heads(grid)
    assert heads[103] is None and list(heads[101]) == ["fc.weight"]
    for i in (0, 2, 4, 5):
        assert all(np.array_equal(a, b) for a, b in zip(base[i], arrays([replies[i]])[0]))
        assert all(np.array_equal(base_heads[100 + i][k], heads[100 + i][k]) for k in base_heads[100 + i])


def test_personal_heads_in_a_state_dir_resume_as_the_clientapps(tmp_path):
    """A deployment's heads (node config state-dir: one .npz file per node and run id): the batch writes the files the
    ClientApp writes, and the run's nodes restarted (a fresh grid of the same run id, empty Context.state) train round
    2 from them to the same replies."""
    from dpfl.clients.personalized import FileHeadStore

    cfg = validate({**BASE, "algorithm": "dp2-fedsam", "head-steps": 3, "local-steps": 3})

    def grid_in(grid_class, folder):
        grid = grid_class(client_app, NODES, cfg, run_id=7)  # both engines' files named alike: one run
        for context in grid.contexts.values():
            context.node_config["state-dir"] = str(tmp_path / folder)
        return grid

    def files(folder):
        return {p.name: FileHeadStore(p).load() for p in sorted((tmp_path / folder).glob("*.npz"))}

    replies = {}
    for grid_class in (InProcessGrid, CohortGrid):
        name = grid_class.__name__
        grid = grid_in(grid_class, name)
        first = grid.send_and_receive(body_messages(grid))
        assert stored_heads(grid) == dict.fromkeys(grid.contexts)  # not in Context.state: in the files
        resumed = grid_in(grid_class, name)
        replies[name] = (first, resumed.send_and_receive(body_messages(resumed, server_round=2)))
        if grid_class is CohortGrid:
            assert grid.batched == resumed.batched == NODES
    for seq, coh in zip(*replies.values()):
        assert_replies_close(seq, coh)
    seq_files, coh_files = files("InProcessGrid"), files("CohortGrid")
    assert len(seq_files) == NODES and seq_files.keys() == coh_files.keys()
    assert_heads_close(seq_files, coh_files)
