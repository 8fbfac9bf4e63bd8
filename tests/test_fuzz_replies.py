"""Hostile replies: a seeded fuzz of malformed client replies, mixed with honest ones, through every
strategy path (Message API: DP-FedAvg central and distributed, top-k, wavelet, partial sharing, ALI-DPFL;
legacy adapter; SecAgg+ sums; personalized and legacy client evaluation).

For every round: no exception escapes, the global model stays finite, and the model moves by at
most eta_s * k * B / m, where k replies were accepted and B is the most one accepted upload may
weigh (C when the server clips; the honest-noise bound under distributed noise, here with sigma = 0
so that the bound is exact). The counts are printed (docs/privacy.md, "Threat model and failure behaviour").
"""

import io
import random

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Error, MetricRecord, RecordDict
from flwr.common import Code, EvaluateRes, FitRes, Parameters, Status, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server.client_manager import SimpleClientManager
from flwr.server.strategy import FedAvg
from flwr.serverapp.strategy import FedAvg as MessageFedAvg

from dpfl.dpcore.privacy import protocol as keys
from dpfl.dpcore.privacy.mechanisms import flatten, l2_norm, sparse_encode, topk_sparsify
from dpfl.strategies import DifferentialPrivacy
from dpfl.strategies.dp_fedavg import DPFedAvg
from dpfl.strategies.legacy.adapter import LegacyDPFedAvg, reply_message
from dpfl.strategies.legacy.secagg import SecAggPlusDPFedAvg
from dpfl.strategies.legacy.wrapper import LegacyDifferentialPrivacy
from dpfl.strategies.loop.options import DPSGDOptions, SamplingOptions, ServerData
from dpfl.strategies.loop.sample_epsilon import max_sample_epsilon, max_sample_epsilon_records
from dpfl.strategies.partial_sharing import PartialSharingDPFedAvg, PersonalizedDPFedAvg
from dpfl.strategies.presets import DPFedAvgWavelet, DPFedSAMTopK
from dpfl.strategies.sample_level.ali_dpfl import ALIDPFL

SHAPES = [(4, 3), (5,)]
DIM = 17
C, ETA, M = 0.5, 1.0, 4
ROUNDS = 130  # per strategy path; 9 paths -> 1,170 rounds, each with at least one hostile reply
SEED = 20261122


def honest_update(rng: np.random.Generator) -> list[np.ndarray]:
    """An update clipped to C (what an honest client with sigma = 0 uploads)."""
    v = rng.standard_normal(DIM).astype(np.float32)
    v *= np.float32(min(1.0, 0.99 * C / float(np.linalg.norm(v))))
    return [v[:12].reshape(4, 3), v[12:]]


def npy_bytes(array: np.ndarray, allow_pickle: bool = False) -> bytes:
    stream = io.BytesIO()
    np.save(stream, array, allow_pickle=allow_pickle)
    return stream.getvalue()


def forged(array: np.ndarray, data: bytes, stype: str = "numpy.ndarray") -> Array:
    """An Array that names `array`'s dtype and shape but carries `data`: what a client's own encoder may send."""
    return Array(dtype=str(array.dtype), shape=tuple(array.shape), stype=stype, data=data)


def hostile_arrays(rng: random.Random, nprng: np.random.Generator) -> tuple[str, list | None]:
    """(kind, arrays) of one malformed or oversized upload: numpy arrays, or Arrays whose bytes are forged."""
    good = honest_update(nprng)
    honest = npy_bytes(good[0])
    kinds = {
        "huge-finite": lambda: [a * np.float32(1e6 / C) for a in good],
        "float64-1e300": lambda: [good[0].astype(np.float64) * 1e300, good[1]],
        "nan": lambda: [np.full((4, 3), np.nan, np.float32), good[1]],
        "inf": lambda: [good[0], np.full(5, -np.inf, np.float32)],
        "int-dtype": lambda: [np.ones((4, 3), np.int64), good[1]],
        "bool-dtype": lambda: [np.ones((4, 3), bool), good[1]],
        "complex": lambda: [good[0].astype(np.complex64), good[1]],
        "wrong-shape": lambda: [good[0].reshape(3, 4), good[1]],
        "too-few": lambda: [good[0]],
        "too-many": lambda: good + [good[1]],
        "scalar": lambda: [np.float32(1.0), good[1]],
        "empty": lambda: [],
        "missing": lambda: None,
        "bytes-truncated": lambda: [forged(good[0], honest[:-5]), good[1]],
        "bytes-garbage": lambda: [forged(good[0], bytes(nprng.integers(0, 256, 80, dtype=np.uint8))), good[1]],
        "bytes-pickled-objects": lambda: [forged(good[0], npy_bytes(good[0].astype(object), True)), good[1]],
        "bytes-other-shape": lambda: [forged(good[0], npy_bytes(good[0].reshape(3, 4))), good[1]],
        "bytes-huge-under-honest-header": lambda: [forged(good[0], npy_bytes(good[0] * np.float32(1e6))), good[1]],
        "bytes-torch-stype": lambda: [forged(good[0], honest, stype="torch.Tensor"), good[1]],
    }
    kind = rng.choice(sorted(kinds))
    return kind, kinds[kind]()


def hostile_metrics(rng: random.Random) -> tuple[str, dict | list]:
    """(kind, metrics) where the record or one value is malformed."""
    key = rng.choice(
        [
            "update-norm",
            "train-loss",
            "num-examples",
            "partition-id",
            "local-steps",
            "dpsgd-steps",
            "mu",
            "mu-releases",
            "epsilon",
            "budget-left",
            "kept-values",
        ]
    )
    value = rng.choice([[1.0], [1, 2], float("nan"), float("inf"), -float("inf"), -1.0, 1e300, 2.5, 10**15, -7])
    return f"{key}={value!r}", {key: value}


def reply(node: int, arrays, metrics: dict, extra_records: int = 0):
    content = RecordDict()
    if arrays is not None:
        content["arrays"] = ArrayRecord(
            {str(i): a if isinstance(a, Array) else Array(np.asarray(a)) for i, a in enumerate(arrays)}
        )
    for i in range(extra_records):  # a junk record before the real one
        content[f"junk{i}"] = MetricRecord({"x": float("nan")})
    content["metrics"] = MetricRecord(metrics)
    return reply_message(node, content)


def honest_metrics(pid: int) -> dict:
    return {
        "update-norm": 0.4,
        "train-loss": 0.7,
        "num-examples": 10,
        "partition-id": pid,
        "local-steps": 1,
        "dpsgd-steps": 1,
        "epsilon": 0.1,
        "budget-left": 1,
        keys.UPLOAD_KIND: keys.UPLOAD_UPDATE,
    }


def round_replies(rng: random.Random, nprng: np.random.Generator, encode=None) -> tuple[list, list[str]]:
    """Three honest replies and 1-2 hostile ones (arrays, metrics, a junk record, or an error), shuffled."""
    replies, kinds = [], []
    for pid in range(3):
        upload = honest_update(nprng)
        replies.append(reply(100 + pid, encode(upload) if encode else upload, honest_metrics(pid)))
    for j in range(rng.choice([1, 2])):
        node, pid = 103 + j, 3 + j
        what = rng.choice(["arrays", "metrics", "junk-record-first", "error"])
        if what == "arrays":
            kind, arrays = hostile_arrays(rng, nprng)
            replies.append(reply(node, arrays, honest_metrics(pid)))
        elif what == "metrics":
            kind, bad = hostile_metrics(rng)
            upload = honest_update(nprng)
            replies.append(reply(node, encode(upload) if encode else upload, {**honest_metrics(pid), **bad}))
        elif what == "junk-record-first":
            kind = what
            upload = [a * np.float32(1e6) for a in honest_update(nprng)]  # oversized too
            replies.append(reply(node, upload, honest_metrics(pid), extra_records=2))
        else:
            kind = what
            replies.append(reply_message(node, error=Error(code=1, reason="node crashed")))
        kinds.append(kind)
    rng.shuffle(replies)
    return replies, kinds


def initial() -> ArrayRecord:
    return ArrayRecord([np.zeros(s, np.float32) for s in SHAPES])


def topk_encode(upload):
    return sparse_encode(upload, topk_sparsify(upload, 0.5, "per-layer"))


MESSAGE_PATHS = {
    "dp-fedavg central": (
        lambda: DPFedAvg(sample_rate=1.0, clipping_norm=C, noise_multiplier=0.0, noise_placement="central"),
        None,
        C,
    ),
    "dp-fedavg distributed": (
        lambda: DPFedAvg(sample_rate=1.0, clipping_norm=C, noise_multiplier=0.0, noise_placement="distributed"),
        None,
        C * (1 + 1e-5),
    ),
    "top-k": (
        lambda: DPFedSAMTopK(
            sample_rate=1.0, clipping_norm=C, noise_multiplier=0.0, noise_placement="distributed", sparsity=0.5
        ),
        topk_encode,
        C * (1 + 1e-5),
    ),
    "wavelet": (lambda: DPFedAvgWavelet(sample_rate=1.0, clipping_norm=C, noise_multiplier=0.0), None, C),
    "partial sharing": (
        lambda: PartialSharingDPFedAvg(
            sample_rate=1.0, clipping_norm=C, noise_multiplier=0.0, noise_placement="distributed"
        ),
        None,
        C * (1 + 1e-5),
    ),
}


def record(path: str, hostile: int, at_least: int = ROUNDS) -> None:
    """Each path's share of the hostile replies, checked path by path (so that a test run alone checks its
    own): at least one a round, or `at_least` where some rounds are honest; over 1,000 in all."""
    print(f"{path}: {hostile} hostile replies")
    assert hostile >= at_least, (path, hostile, at_least)


@pytest.mark.parametrize("path", sorted(MESSAGE_PATHS))
def test_message_api_strategies_survive_hostile_replies(path):
    make, encode, bound = MESSAGE_PATHS[path]
    rng, nprng = random.Random(f"{SEED}-{path}"), np.random.default_rng(SEED)
    strategy = make()
    strategy.setup_population(M)
    arrays = initial()
    hostile = 0
    for rnd in range(1, ROUNDS + 1):
        replies, kinds = round_replies(rng, nprng, encode)
        hostile += len(kinds)
        strategy.begin_round(arrays)
        new_arrays, metrics = strategy.aggregate_train(rnd, replies)
        old, new = flatten(arrays.to_numpy_ndarrays()), flatten(new_arrays.to_numpy_ndarrays())
        assert np.all(np.isfinite(new)), (rnd, kinds)
        accepted = metrics["clients"]
        assert accepted >= 3 - (path == "top-k") * 0, (rnd, kinds, dict(metrics))
        assert l2_norm(new - old) <= ETA * accepted * bound / strategy.population.expected_clients + 1e-6, (rnd, kinds)
        assert metrics["clients"] + metrics["rejected"] + metrics["failures"] == len(replies)
        arrays = new_arrays
    record(path, hostile)
    print(f"{path}: {ROUNDS} rounds, {hostile} hostile replies, 0 exceptions, model finite")


@pytest.mark.slow
def test_ali_dpfl_survives_hostile_replies():
    rng, nprng = random.Random(f"{SEED}-ali"), np.random.default_rng(SEED)
    strategy = ALIDPFL(
        dpsgd=DPSGDOptions(0.1, 1.0, 1.0, target_epsilon=50.0, adaptive=False, local_steps=1),
        sampling=SamplingOptions(1.0),
        server_data=ServerData(partition_size=lambda pid, n: 10),
    )
    strategy.record.num_rounds = ROUNDS
    strategy.setup_population(M + 2)
    arrays, hostile = initial(), 0
    for rnd in range(1, ROUNDS + 1):
        replies, kinds = round_replies(rng, nprng)
        for r in replies:  # cumulative honest counts, as real DP-SGD clients report them
            if not r.has_error() and r.content["metrics"].get("dpsgd-steps") == 1:
                r.content["metrics"]["dpsgd-steps"] = rnd
        hostile += len(kinds)
        strategy.begin_round(arrays)
        new_arrays, metrics = strategy.aggregate_train(rnd, replies)
        assert np.all(np.isfinite(flatten(new_arrays.to_numpy_ndarrays()))), (rnd, kinds)
        assert strategy.spent.total_steps <= rnd  # never more steps charged than tau = 1 per round asked
        assert metrics["clients"] >= 3, (rnd, kinds)
        arrays = new_arrays
    record("ali-dpfl", hostile)
    print(f"ali-dpfl: {ROUNDS} rounds, {hostile} hostile replies, 0 exceptions, model finite")


def fit_res(rng: random.Random, nprng: np.random.Generator, legacy_weight: int = 10) -> tuple[FitRes, str]:
    """An honest or hostile legacy FitRes."""
    upload = honest_update(nprng)
    what = rng.choice(
        ["honest", "honest", "garbage-bytes", "nan", "huge", "metrics-list", "weight", "metrics-none", "metrics-seq"]
    )
    params = ndarrays_to_parameters(upload)
    metrics: dict = {"update-norm": 0.4}
    weight = legacy_weight
    if what == "garbage-bytes":
        params = Parameters(tensors=[bytes(rng.getrandbits(8) for _ in range(40))], tensor_type="numpy.ndarray")
    elif what == "nan":
        params = ndarrays_to_parameters([np.full((4, 3), np.nan, np.float32), upload[1]])
    elif what == "huge":
        params = ndarrays_to_parameters([a.astype(np.float64) * 1e300 for a in upload])
    elif what == "metrics-list":
        metrics = {"update-norm": [1.0, 2.0], "train-loss": "x"}
    elif what == "weight":
        weight = rng.choice([0, -5, 10**18])
    elif what == "metrics-none":
        metrics = None
    elif what == "metrics-seq":
        metrics = [("update-norm", 0.4)]
    return FitRes(Status(Code.OK, ""), params, weight, metrics), what


def test_legacy_adapter_survives_hostile_results():
    rng, nprng = random.Random(f"{SEED}-legacy"), np.random.default_rng(SEED)
    strategy = LegacyDPFedAvg(
        DPFedAvg(sample_rate=1.0, clipping_norm=C, noise_multiplier=0.0, noise_placement="central")
    )
    strategy.dp.setup_population(M)
    weights, hostile = [np.zeros(s, np.float32) for s in SHAPES], 0
    for rnd in range(1, ROUNDS + 1):
        pairs = [fit_res(rng, nprng) for _ in range(4)]
        hostile += sum(what != "honest" for _, what in pairs)
        strategy._global = weights
        strategy.dp.begin_round(ArrayRecord(weights))
        parameters, metrics = strategy.aggregate_fit(
            rnd, [(FakeProxy(100 + i), r) for i, (r, _) in enumerate(pairs)], []
        )
        from flwr.common import parameters_to_ndarrays

        new = parameters_to_ndarrays(parameters)
        assert all(np.all(np.isfinite(a)) for a in new)
        assert set(metrics) <= {"epsilon", "delta", "epsilon_against_server"}  # what Flower's History prints
        clients = strategy.result.train_metrics_clientapp[rnd]["clients"]  # a diagnostic
        assert l2_norm(flatten(new) - flatten(weights)) <= ETA * clients * C / M + 1e-6
        weights = new
    record("legacy", hostile)
    print(f"legacy: {ROUNDS} rounds, {hostile} hostile results, 0 exceptions, model finite")


@pytest.mark.parametrize("metrics", [None, [("update-norm", 0.4)], "update-norm"])
def test_legacy_metrics_that_are_not_a_dict_are_refused_with_a_reason(metrics):
    strategy = LegacyDPFedAvg(
        DPFedAvg(sample_rate=1.0, clipping_norm=C, noise_multiplier=0.0, noise_placement="central")
    )
    strategy.dp.setup_population(M)
    weights = [np.zeros(s, np.float32) for s in SHAPES]
    strategy._global = weights
    strategy.dp.begin_round(ArrayRecord(weights))
    nprng = np.random.default_rng(SEED)
    good = FitRes(Status(Code.OK, ""), ndarrays_to_parameters(honest_update(nprng)), 10, {})
    bad = FitRes(Status(Code.OK, ""), ndarrays_to_parameters(honest_update(nprng)), 10, metrics)
    strategy.aggregate_fit(1, [(FakeProxy(100), good), (FakeProxy(101), bad)], [])
    record = strategy.result.train_metrics_clientapp[1]
    assert record["clients"] == 1  # the good reply only
    assert record["failures"] == 1
    assert any("node 101: FitRes.metrics is" in p and "not a dict" in p for p in strategy.dp.round.problems)


def test_secagg_sum_survives_hostile_results():
    rng, nprng = random.Random(f"{SEED}-secagg"), np.random.default_rng(SEED)
    strategy = SecAggPlusDPFedAvg(
        DPFedAvg(sample_rate=1.0, clipping_norm=C, noise_multiplier=0.0, noise_placement="distributed")
    )
    strategy.dp.setup_population(M)
    weights, hostile = [np.zeros(s, np.float32) for s in SHAPES], 0
    for rnd in range(1, ROUNDS + 1):
        res, what = fit_res(rng, nprng, legacy_weight=1)
        hostile += what != "honest"
        results = [(FakeProxy(100 + i), res) for i in range(3)]  # SecAgg+ hands every result the same sum
        if what == "weight":
            results[1] = (FakeProxy(101), FitRes(Status(Code.OK, ""), res.parameters, 1, {}))
        strategy._global = weights
        parameters, metrics = strategy.aggregate_fit(rnd, results, [])
        from flwr.common import parameters_to_ndarrays

        new = parameters_to_ndarrays(parameters)
        assert all(np.all(np.isfinite(a)) for a in new), what
        assert l2_norm(flatten(new) - flatten(weights)) <= ETA * 3 * C * (1 + 1e-5) / M + 1e-6 or what == "honest"
        weights = new
    record("secagg", hostile, ROUNDS // 2)  # some rounds honest: 93 of 130 with this seed


def test_client_evaluation_survives_hostile_metrics():
    rng = random.Random(f"{SEED}-eval")
    personalized = PersonalizedDPFedAvg(sample_rate=1.0, clipping_norm=C, noise_multiplier=0.0)
    legacy = LegacyDPFedAvg(DPFedAvg(sample_rate=1.0, clipping_norm=C, noise_multiplier=0.0))
    hostile = 0
    for rnd in range(1, ROUNDS + 1):
        bad = rng.choice([[0.5], float("nan"), float("inf"), -3.0, 7.0, 10**300])
        replies = [reply(100, None, {"accuracy": 0.8, "loss": 0.3}), reply(101, None, {"accuracy": bad, "loss": bad})]
        result = personalized.aggregate_evaluate(rnd, replies)
        assert result is not None and result["personalized_accuracy"] == pytest.approx(0.8)
        loss = bad if isinstance(bad, float) else float("nan")
        results = [
            (FakeProxy(100), EvaluateRes(Status(Code.OK, ""), 0.3, 10, {"accuracy": 0.8})),
            (
                FakeProxy(101),
                EvaluateRes(Status(Code.OK, ""), loss, rng.choice([10, 0, -1, 10**18]), {"accuracy": bad}),
            ),
        ]
        legacy.aggregate_evaluate(rnd, results, [])
        hostile += 2
    record("evaluation", hostile)


class FakeProxy:
    def __init__(self, node_id: int) -> None:
        self.node_id = node_id
        self.cid = str(node_id)


def hostile_fit_res(rng: random.Random, nprng: np.random.Generator, metrics: dict) -> tuple[FitRes, str]:
    """A FitRes the reply gate rejects whoever sends it: (the result, its kind)."""
    upload = honest_update(nprng)
    kind = rng.choice(["nan", "float64-1e300", "wrong-shape", "garbage-bytes", "metrics-list"])
    params = {
        "nan": lambda: ndarrays_to_parameters([np.full((4, 3), np.nan, np.float32), upload[1]]),
        "float64-1e300": lambda: ndarrays_to_parameters([a.astype(np.float64) * 1e300 for a in upload]),
        "wrong-shape": lambda: ndarrays_to_parameters([upload[0].reshape(3, 4), upload[1]]),
        "garbage-bytes": lambda: Parameters(tensors=[rng.randbytes(40)], tensor_type="numpy.ndarray"),
        "metrics-list": lambda: ndarrays_to_parameters(upload),
    }[kind]()
    sent = list(metrics.items()) if kind == "metrics-list" else metrics
    return FitRes(Status(Code.OK, ""), params, 10, sent), kind


def test_the_legacy_apps_fit_metrics_function_gets_the_accepted_replies_only():
    """LegacyDifferentialPrivacy samples m of 8 connected nodes; each round their replies come mixed with 1-3 hostile
    ones: a second reply of a sampled node, a reply of a connected node not sampled, one of a node never connected,
    and replies the gate rejects (NaN, overflow, wrong shape, garbage bytes, metrics not a dict), each claiming
    sample-epsilon 60. The app's fit_metrics_aggregation_fn gets exactly the (num_examples, metrics) of the replies
    accepted (the first well-formed reply of each sampled node, in order), and History's sample-epsilon-max is theirs:
    never 60 (it once got every result: a rejected second reply put 60.0 there)."""
    rng, nprng = random.Random(f"{SEED}-legacy-app-metrics"), np.random.default_rng(SEED)
    manager = SimpleClientManager()
    for node in range(1, 9):
        manager.register(FakeProxy(node))
    calls = []

    def app_fn(results):
        calls.append(results)
        return max_sample_epsilon(results)

    strategy = LegacyDifferentialPrivacy(
        FedAvg(fit_metrics_aggregation_fn=app_fn), 0.0, C, M, delta=1e-3, seed=SEED, secure_rng=False
    )
    weights, hostile, rounds = [np.zeros(s, np.float32) for s in SHAPES], 0, 40
    for rnd in range(1, rounds + 1):
        sampled = [proxy.node_id for proxy, _ in strategy.configure_fit(rnd, ndarrays_to_parameters(weights), manager)]
        entries = []  # (node, result, well-formed)
        for node in sampled:
            metrics = {keys.SAMPLE_EPSILON: rng.uniform(0.1, 5.0), keys.SAMPLE_DELTA: 1e-5, "node": node}
            entries.append(
                (node, FitRes(Status(Code.OK, ""), ndarrays_to_parameters(honest_update(nprng)), 10, metrics), True)
            )
        claim = {keys.SAMPLE_EPSILON: 60.0, keys.SAMPLE_DELTA: 1e-5}
        for kind in rng.sample(["duplicate", "unsampled", "unknown", "malformed"], rng.choice([1, 2, 3])):
            hostile += 1
            honest = FitRes(Status(Code.OK, ""), ndarrays_to_parameters(honest_update(nprng)), 10, dict(claim))
            if kind == "duplicate":
                entries.append((rng.choice(sampled), honest, True))
            elif kind == "unsampled":
                entries.append((rng.choice(sorted(set(range(1, 9)) - set(sampled))), honest, True))
            elif kind == "unknown":
                entries.append((999, honest, True))
            else:
                entries.append((rng.choice(sampled), hostile_fit_res(rng, nprng, dict(claim))[0], False))
        rng.shuffle(entries)
        expected, read = [], set()
        for node, res, well_formed in entries:  # the reply gate's rule, independently
            if node in sampled and node not in read and well_formed:
                read.add(node)
                expected.append((res.num_examples, res.metrics))
        before = len(calls)
        parameters, metrics = strategy.aggregate_fit(rnd, [(FakeProxy(node), res) for node, res, _ in entries], [])
        assert calls[before:] == ([expected] if expected else []), (rnd, entries)
        assert metrics.get("sample-epsilon-max") == max((m[keys.SAMPLE_EPSILON] for _, m in expected), default=None)
        assert strategy.result.train_metrics_clientapp[rnd]["clients"] == len(expected)
        weights = parameters_to_ndarrays(parameters)
    record("legacy app metrics", hostile, rounds)


def test_the_message_api_wrappers_metrics_function_gets_no_second_reply():
    """The Message-API wrapper passes the accepted replies to the wrapped strategy's train_metrics_aggr_fn; a node's
    second reply, which the gate rejects, once passed with them (it was matched by node id), so a rejected reply
    claiming sample-epsilon 60 became the round's sample-epsilon-max."""
    strategy = DifferentialPrivacy(
        MessageFedAvg(train_metrics_aggr_fn=max_sample_epsilon_records),
        clipping_norm=C,
        noise_multiplier=0.0,
        sample_rate=1.0,
    )
    strategy.setup_population(2)
    strategy.begin_round(initial())
    nprng = np.random.default_rng(SEED)
    claims = [(100, 1.5), (101, 2.0), (100, 60.0)]  # node 100 replies twice
    replies = [
        reply(node, honest_update(nprng), {keys.NUM_EXAMPLES: 10, keys.SAMPLE_EPSILON: eps, keys.SAMPLE_DELTA: 1e-5})
        for node, eps in claims
    ]
    _, metrics = strategy.aggregate_train(1, replies)
    assert (metrics["clients"], metrics["rejected"]) == (2, 1)
    assert metrics["sample-epsilon-max"] == 2.0
