"""SecAgg+: the strategy sees only the sum, the arithmetic of sum/m and top-up, the ledger, accuracy."""

import math
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord
from flwr.client.mod import secaggplus_mod
from flwr.clientapp import ClientApp
from flwr.common import parameters_to_ndarrays
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Stage
from flwr.compat.common import recorddict_compat as compat
from torch import nn

from dpfl.clients.mods import uniform_weight_mod
from dpfl.dpcore.privacy.accountants import epsilon_of
from dpfl.dpcore.privacy.mechanisms import flatten
from dpfl.dpcore.task.torch_helpers import get_weights
from dpfl.fl_app.client_app import app as fl_client_app
from dpfl.fl_app.config import validate
from dpfl.fl_app.server_app import run_federated
from dpfl.strategies.dp_fedavg import DPFedAvg
from dpfl.strategies.legacy.secagg import DPSecAggPlusWorkflow, SecAggPlusDPFedAvg, secagg_clipping_range
from dpfl.strategies.parts.part import failure_probability
from dpfl_tools.inprocess import InProcessGrid
from tests.stub_clients import FixedUpdateClient

C, SIGMA = 0.5, 1.3
N_S, DELTA = 6, 1e-5  # 5 nodes sampled with q = 1: n_s = M + 1 noise shares (a neighbour has one client more)
CLIP = 1e-9  # DPSecAggPlusWorkflow's quantizer-clip probability a round, reserved out of delta (no truncation: q = 1)


class SpySecAggPlusDPFedAvg(SecAggPlusDPFedAvg):
    """Keeps what aggregate_fit receives."""

    seen: list

    def aggregate_fit(self, server_round, results, failures):
        self.seen = [parameters_to_ndarrays(res.parameters) for _, res in results]
        return super().aggregate_fit(server_round, results, failures)


def secagg_stub_app(update_fn, uploads: dict) -> ClientApp:
    """Legacy client_fn ClientApp under SecAgg+; `uploads[node] = what the client handed to SecAgg+`."""

    def spy(msg, context, call_next):
        reply = call_next(msg, context)
        if "fitres.parameters" in reply.content.array_records:
            fitres = compat.recorddict_to_fitres(reply.content, keep_input=True)
            uploads[msg.metadata.dst_node_id] = flatten(parameters_to_ndarrays(fitres.parameters))
        return reply

    def client_fn(context):
        torch.manual_seed(0)
        return FixedUpdateClient(nn.Linear(1000, 100), int(context.node_config["partition-id"]), update_fn).to_client()

    return ClientApp(client_fn=client_fn, mods=[secaggplus_mod, spy, uniform_weight_mod])


def initial() -> ArrayRecord:
    torch.manual_seed(0)
    return ArrayRecord(get_weights(nn.Linear(1000, 100)))


def run_secagg_round(num_nodes, update_fn, fail=None, workflow=None, num_rounds=1):
    uploads: dict = {}
    grid = InProcessGrid(secagg_stub_app(update_fn, uploads), num_nodes, {}, fail=fail)
    dp = DPFedAvg(
        sample_rate=1.0, clipping_norm=C, noise_multiplier=SIGMA, noise_placement="distributed", seed=3
    )  # q = 1: every node, every round
    strategy = SpySecAggPlusDPFedAvg(dp, workflow=workflow)
    start = initial()
    result = strategy.start(grid, start, num_rounds=num_rounds)
    delta = flatten(result.arrays.to_numpy_ndarrays()) - flatten(start.to_numpy_ndarrays())
    return strategy, grid, uploads, delta


def signal(pid, rnd, size):  # each client: a different direction, norm 2 > C (clipped)
    v = np.zeros(size, np.float32)
    v[pid * 10 : (pid + 1) * 10] = 2.0 / math.sqrt(10)
    return v


def test_strategy_receives_only_the_sum():
    strategy, grid, uploads, delta = run_secagg_round(5, signal)
    settings = strategy.secagg_settings
    step = settings["quantization_step"]
    assert len(uploads) == 5 and len(strategy.seen) == 5
    # every result carries the same vector: the mean of the uploads, up to quantization ...
    first = flatten(strategy.seen[0])
    assert all(np.array_equal(flatten(s), first) for s in strategy.seen)
    mean = np.mean(list(uploads.values()), axis=0)
    assert np.max(np.abs(first - mean)) <= 2 * step
    # ... and no individual upload
    for upload in uploads.values():
        assert np.max(np.abs(first - upload)) > 100 * step
    # what the server received from clients: masked integers, never the arrays themselves
    for reply in grid.received:
        assert all(len(record) == 0 for record in reply.content.array_records.values())
    # the quantizer range was not reached, and the model moved by (sum + the top-up for the sixth share) / m
    assert max(np.max(np.abs(u)) for u in uploads.values()) < settings["clipping_range"]
    assert settings["clipping_range"] == pytest.approx(secagg_clipping_range(C, SIGMA * C / math.sqrt(N_S), 100_100, 5))
    topup = delta * 5 - np.sum(list(uploads.values()), axis=0)
    assert strategy.dp.round.server_noise_std == pytest.approx(SIGMA * C / math.sqrt(N_S))
    assert abs(topup.std() / (SIGMA * C / math.sqrt(N_S)) - 1) < 5 / math.sqrt(2 * topup.size)
    # each client's share: clipped signal (norm C) + N(0, sigma^2 C^2 / n_s)
    noise = list(uploads.values())[0] - signal(0, 1, delta.size) * (C / 2.0)
    assert abs(noise.std() / (SIGMA * C / math.sqrt(N_S)) - 1) < 5 / math.sqrt(2 * noise.size)
    # the server saw only the noisy sum of 5 shares (multiplier sigma sqrt(5/6), no amplification): a
    # diagnostic, since it depends on how many shares arrived
    described, diagnostics = strategy.describe(), strategy.describe_diagnostics()
    assert described["epsilon"] == pytest.approx(epsilon_of([(SIGMA, 1.0, 1)], DELTA - CLIP))
    assert "epsilon_against_server" not in described and described["ledger"]["server"].startswith("in diagnostics")
    assert diagnostics["epsilon_against_server"] == pytest.approx(
        epsilon_of([(SIGMA * math.sqrt(5 / 6) / 2, 1.0, 1)], DELTA - CLIP)
    )
    assert described["secure_aggregation"] is True


def masked_vector_stage(msg) -> bool:
    configs = msg.content.config_records.get(RECORD_KEY_CONFIGS)
    return configs is not None and configs.get("stage") == Stage.COLLECT_MASKED_VECTORS


def test_dropout_under_secagg_is_topped_up_and_charged():
    dead = 101
    strategy, _, uploads, delta = run_secagg_round(
        5,
        lambda pid, rnd, size: np.zeros(size, np.float32),
        fail=lambda node, msg: node == dead and masked_vector_stage(msg),
    )
    record = strategy.record.history[0]
    assert record["clients"] == 4 and record["failures"] == 1
    assert "node 101 crashed" in record["failed_nodes"][0]
    # 4 noise shares in the sum, the server adds the other 2 of n_s = 6: the model still gets N(0, sigma^2 C^2) / m
    assert strategy.dp.round.server_noise_std == pytest.approx(SIGMA * C * math.sqrt(2 / N_S))
    expected = SIGMA * C / 5
    assert abs(delta.std() / expected - 1) < 5 / math.sqrt(2 * delta.size)
    # the server saw the sum before its own top-up: multiplier sigma * sqrt(4/6) against it
    ledger = strategy.ledger
    assert ledger.epsilon() == pytest.approx(epsilon_of([(SIGMA, 1.0, 1)], DELTA - CLIP))
    assert ledger.epsilon_against_server() == pytest.approx(
        epsilon_of([(SIGMA * math.sqrt(4 / N_S) / 2, 1.0, 1)], DELTA - CLIP)
    )
    assert ledger.epsilon_against_server() > ledger.epsilon()


def test_secagg_halts_when_too_few_finish():
    """4 of 5 nodes drop before sending their masked vector: nothing can be unmasked; the round was sampled, so
    it releases the model with the full noise (sigma C / m) and is charged, like an empty round of DPFedAvg.start;
    the server saw no sum."""
    strategy, _, _, delta = run_secagg_round(5, signal, fail=lambda node, msg: node != 100 and masked_vector_stage(msg))
    [record] = strategy.record.history
    assert record["clients"] == 0 and "no aggregate" in record["problems"][0]
    assert strategy.dp.round.server_noise_std == pytest.approx(SIGMA * C)
    assert abs(delta.std() / (SIGMA * C / 5) - 1) < 5 / math.sqrt(2 * delta.size)
    assert strategy.ledger.epsilon() == pytest.approx(epsilon_of([(SIGMA, 1.0, 1)], DELTA - CLIP))
    assert strategy.ledger.epsilon_against_server() == 0


def test_quantizer_clip_probability_is_reserved_out_of_delta_every_round():
    """Issue 39 item 3: SecAgg+'s quantizer clips a coordinate with probability <= failure_probability a round, and
    the sum is then not the Gaussian mechanism: like the truncation probability, it is summed over the rounds and
    reserved out of delta, for the model's figure and the server's. 1e-6 a round of delta 1e-5, 2 rounds: eps at
    0.8e-5, about 2% above eps at 1e-5; the budget check predicts with the same reserve."""
    workflow = DPSecAggPlusWorkflow(failure_probability=1e-6)
    strategy, _, _, _ = run_secagg_round(5, signal, workflow=workflow, num_rounds=2)
    ledger = strategy.ledger
    assert [r["clients"] for r in strategy.record.history] == [5, 5]
    assert ledger.truncation_delta == pytest.approx(2e-6, rel=1e-9)  # q = 1, n_s = 6 > 5 nodes: no truncation
    expected = epsilon_of([(SIGMA, 1.0, 2)], DELTA - 2e-6)
    assert ledger.epsilon() == pytest.approx(expected, rel=1e-9)
    assert ledger.epsilon() > epsilon_of([(SIGMA, 1.0, 2)], DELTA) * 1.01  # the reserve is not negligible here
    assert ledger.epsilon_against_server() == pytest.approx(
        epsilon_of([(SIGMA * math.sqrt(5 / N_S) / 2, 1.0, 2)], DELTA - 2e-6), rel=1e-9
    )
    # the budget check before a third round reserves it too: a target between eps(3 rounds) at delta less
    # 2 rounds' and less 3 rounds' reserve (and the 1e-12 truncation floor) stops the run only with the reserve
    dp = strategy.dp
    with_reserve = epsilon_of([(SIGMA, 1.0, 3)], DELTA - 3e-6 - 1e-12)
    without = epsilon_of([(SIGMA, 1.0, 3)], DELTA - 2e-6 - 1e-12)
    dp.privacy = replace(dp.privacy, target_epsilon=(with_reserve + without) / 2)
    assert failure_probability(dp.parts) == 1e-6 and dp.budget_exhausted()
    workflow_part = next(p for p in dp.parts if p.server_sees_only_the_sum)
    workflow_part.quantizer_clip_probability = 0.0
    assert not dp.budget_exhausted()
    assert "quantizer-clip probability" in ledger.relation
    with pytest.raises(ValueError, match="failure_probability=0"):
        DPSecAggPlusWorkflow(failure_probability=0)


def test_secagg_rejects_unequal_weights():
    """A sum of unequally weighted updates cannot be un-averaged: it is rejected (never raised), the round
    counts every update as rejected, and the model moves by the full server noise only (topped up for all m)."""
    dp = DPFedAvg(sample_rate=1.0, clipping_norm=C, noise_multiplier=SIGMA, noise_placement="distributed")
    with pytest.raises(ValueError, match="noise_placement='distributed'"):
        SecAggPlusDPFedAvg(DPFedAvg(sample_rate=1.0, clipping_norm=C, noise_multiplier=SIGMA))
    strategy = SecAggPlusDPFedAvg(dp)
    strategy._global = [np.zeros(3, np.float32)]
    dp.setup_population(2)

    class Res:
        def __init__(self, n):
            from flwr.common import ndarrays_to_parameters

            self.num_examples, self.parameters, self.metrics = n, ndarrays_to_parameters([np.zeros(3)]), {}

    proxies = [SimpleNamespace(node_id=n) for n in (1, 2)]  # as Flower's workflow hands them: one per node
    parameters, published = strategy.aggregate_fit(1, [(proxies[0], Res(1)), (proxies[1], Res(7))], [])
    assert "rejected" not in published  # what Flower's History prints is the ledger's only
    metrics = dict(strategy.result.train_metrics_clientapp[1])
    assert "num_examples = 1" in dp.round.problems[0]
    assert metrics["rejected"] == 2 and metrics["clients"] == 0
    assert metrics["server_noise_std"] == pytest.approx(SIGMA * C)  # the top-up covers all m = 2 shares
    assert np.all(np.isfinite(parameters_to_ndarrays(parameters)[0]))


def run_app(secure: bool, tmp_path, **overrides) -> tuple[dict, list, dict]:
    """(summary, each round's published record merged with its diagnostics, the diagnostics summary)."""
    import json
    from pathlib import Path

    from dpfl.fl_app.results import read_rounds

    cfg = validate(
        {
            "dataset": "digits",
            "model": "mlp",
            "partitioner": "iid",
            "num-rounds": 4,
            "sample-rate": 1.0,
            "local-epochs": 1,
            "min-nodes": 4,
            "secure-aggregation": secure,
            "secure-rng": False,
            "noise-multiplier": 0.5,
            "results-dir": str(tmp_path / ("secure" if secure else "plain")),
            **overrides,
        }
    )
    summary = run_federated(InProcessGrid(fl_client_app, 4, cfg), cfg)
    diagnostics = json.loads(Path(summary["results_dir"], "diagnostics-summary.json").read_text())
    return summary, read_rounds(summary["results_dir"]), diagnostics


@pytest.mark.slow  # 2-9 s together: the fast tier keeps its 5-minute margin on 2 cores
def test_app_with_secagg_matches_plain_run(tmp_path):
    torch.set_num_threads(1)
    secure, secure_rounds, secure_diagnostics = run_app(True, tmp_path)
    plain, plain_rounds, _ = run_app(False, tmp_path)
    # same seed, same sampled clients, same noise: only SecAgg+ quantization (step ~1e-6) differs
    assert secure["rounds_completed"] == plain["rounds_completed"] == 4
    assert secure["final_accuracy"] > 0.2 and abs(secure["final_accuracy"] - plain["final_accuracy"]) <= 0.02
    for s, p in zip(secure_rounds, plain_rounds):
        assert s["loss"] == pytest.approx(p["loss"], abs=1e-3)
    # the aggregate figure is the same but for SecAgg+'s quantizer reserve (1e-9 a round out of delta); against the
    # server SecAgg+ gives the unamplified sum of 4 of n_s = 5 shares (a diagnostic: it depends on how many
    # arrived), without it each upload is a release of its own
    reserved = secure["ledger"]["truncation_delta"] - plain["ledger"]["truncation_delta"]
    assert reserved == pytest.approx(4 * CLIP, rel=1e-6)
    assert plain["epsilon"] < secure["epsilon"] == pytest.approx(plain["epsilon"], rel=1e-4)
    assert secure_diagnostics["epsilon_against_server"] == pytest.approx(
        epsilon_of([(0.5 * math.sqrt(4 / 5) / 2, 1.0, 4)], secure["delta"] - secure["ledger"]["truncation_delta"])
    )
    assert plain["epsilon_against_server"] > 5 * plain["epsilon"]
    assert secure["secure_aggregation"] is True and secure["secagg"]["max_weight"] == 1.0
    # nothing data-dependent travels in the clear next to the secure sum
    assert "update_norm_mean" not in secure_rounds[0] and "train_loss" not in secure_rounds[0]


def test_topk_under_secagg_sums_the_dense_form(tmp_path):
    """DP-FedSAM-top_k: sparse uploads without SecAgg+, dense (zeros included) under it; same model."""
    torch.set_num_threads(1)
    topk = {"algorithm": "dp-fedsam-topk", "sparsity": 0.4, "num-rounds": 2}
    secure, secure_rounds, secure_diagnostics = run_app(True, tmp_path, **topk)
    plain, plain_rounds, _ = run_app(False, tmp_path, **topk)
    for s, p in zip(secure_rounds, plain_rounds):
        assert s["loss"] == pytest.approx(p["loss"], abs=1e-3) and s["clients"] == p["clients"] == 4
    assert plain_rounds[0]["upload_bytes"] < 0.5 * plain_rounds[0]["dense_bytes"]  # sparse without SecAgg+
    assert plain["epsilon"] < secure["epsilon"] == pytest.approx(plain["epsilon"], rel=1e-4)  # 1e-9 a round reserved
    assert secure_diagnostics["epsilon_against_server"] > secure["epsilon"]  # 4 of 5 shares, no amplification
