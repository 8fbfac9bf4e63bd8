"""Sample-level DP in a user's own Opacus client (clients.opacus_ledger, strategies.sample_epsilon): a Flower-style
NumPyClient that builds a new PrivacyEngine every round reports an epsilon that grows across rounds and equals
dp-accounting's for all its steps; an engine kept across rounds is charged once per step; nodes in one process keep
separate ledgers; the server shows the largest epsilon and ignores what is not a ledger's figure."""

import copy
import math
from itertools import count

import dp_accounting
import numpy as np
import pytest
import torch
from dp_accounting import rdp
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.client import ClientApp, NumPyClient
from flwr.common import FitIns, ndarrays_to_parameters
from flwr.compat.common import recorddict_compat as compat
from flwr.supercore.task_identity import TaskIdentity
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from clients.opacus_ledger import PrivacyEngine, make_sample_ledger_mod, sample_ledger_mod
from dpcore.privacy import protocol as keys
from strategies.sample_epsilon import max_sample_epsilon, max_sample_epsilon_records, with_max_sample_epsilon
from tests.independent_accountant import dp_accounting_epsilons

SIGMA, BATCH, N = 1.0, 16, 128  # q = 16 / 128; one epoch = 8 expected steps


def data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(N, 5, generator=g), torch.randint(0, 2, (N,), generator=g)), BATCH)


class OpacusClient(NumPyClient):
    """As Flower's Opacus example: a new PrivacyEngine (and make_private) in every fit."""

    def __init__(self, keep_engine: dict | None = None) -> None:
        self.model, self.loader, self.keep = nn.Linear(5, 2), data(), keep_engine

    def fit(self, parameters, config):
        for p, a in zip(self.model.parameters(), parameters):
            p.data = torch.as_tensor(a)
        if self.keep is not None and "engine" in self.keep:  # one engine kept across rounds
            model, optimizer, loader = self.keep["private"]
        else:
            engine = PrivacyEngine(secure_mode=False)
            optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
            model, optimizer, loader = engine.make_private(
                module=self.model,
                optimizer=optimizer,
                data_loader=self.loader,
                noise_multiplier=SIGMA,
                max_grad_norm=1.0,
            )
            self.engine = engine
            if self.keep is not None:
                self.keep.update(engine=engine, private=(model, optimizer, loader))
        for x, y in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
        return [p.detach().numpy().copy() for p in self.model.parameters()], N, {"train_loss": 0.5}


ids = count(1)


def train_message(node: int) -> Message:
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1  # as the in-process grid sets them
    weights = [p.detach().numpy() for p in nn.Linear(5, 2).parameters()]
    content = compat.fitins_to_recorddict(FitIns(ndarrays_to_parameters(weights), {}), keep_input=True)
    msg = Message(content=content, message_type="train", dst_node_id=node, group_id="1")
    msg.metadata.__dict__["_message_id"] = str(next(ids))
    return Message(content=copy.deepcopy(msg.content), metadata=copy.deepcopy(msg.metadata))


def context(node: int) -> Context:
    return Context(run_id=1, node_id=node, node_config={}, state=RecordDict(), run_config={})


def fit_metrics(reply: Message) -> dict:
    return compat.recorddict_to_fitres(reply.content, keep_input=True).metrics


def steps_of(reply: Message) -> int:
    return int(fit_metrics(reply)[keys.SAMPLE_STEPS])


@pytest.mark.parametrize("keep_engine", [False, True])
def test_epsilon_grows_across_rounds_and_matches_dp_accounting(keep_engine):
    kept = {} if keep_engine else None
    app = ClientApp(client_fn=lambda ctx: OpacusClient(kept).to_client(), mods=[sample_ledger_mod])
    ctx = context(100)
    epsilons, steps = [], []
    for _ in range(3):
        metrics = fit_metrics(app(train_message(100), ctx))
        epsilons.append(metrics[keys.SAMPLE_EPSILON])
        steps.append(metrics[keys.SAMPLE_STEPS])
        assert metrics["train_loss"] == 0.5 and metrics[keys.SAMPLE_ACCOUNTANT] == "pld"
    assert epsilons[0] < epsilons[1] < epsilons[2]
    assert steps == [8, 16, 24]  # each optimizer step once: a kept engine is not charged twice
    pld_epsilon, _ = dp_accounting_epsilons(SIGMA, BATCH / N, 24, 1e-5)
    assert epsilons[2] == pytest.approx(pld_epsilon, rel=2e-2)  # our PLD's coarser grid is an upper bound
    assert epsilons[2] >= pld_epsilon * (1 - 1e-3)


def test_nodes_in_one_process_keep_separate_ledgers():
    app = ClientApp(client_fn=lambda ctx: OpacusClient().to_client(), mods=[sample_ledger_mod])
    a, b = context(100), context(101)
    for _ in range(2):
        app(train_message(100), a)
    assert steps_of(app(train_message(101), b)) == 8
    assert steps_of(app(train_message(100), a)) == 24


def test_the_accountant_whose_bound_is_printed_is_named():
    """sigma 1e-6: dp-accounting's PLD overflows, so the ledger's bound is RDP's, and the reply says so."""
    global SIGMA
    app = ClientApp(client_fn=lambda ctx: OpacusClient().to_client(), mods=[make_sample_ledger_mod(delta=1e-5)])
    SIGMA, old = 1e-6, SIGMA
    try:
        metrics = fit_metrics(app(train_message(100), context(100)))
    finally:
        SIGMA = old
    assert metrics[keys.SAMPLE_ACCOUNTANT].startswith(
        "rdp (pld failed at a noise multiplier of 1e-06 charged: Overflow"
    )
    rdp_accountant = rdp.RdpAccountant()  # PLD overflows here too: RDP alone
    rdp_accountant.compose(
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(BATCH / N, dp_accounting.GaussianDpEvent(1e-6)), 8
        )
    )
    rdp_epsilon = rdp_accountant.get_epsilon(1e-5)
    assert metrics[keys.SAMPLE_EPSILON] == pytest.approx(rdp_epsilon, rel=0.05)


def test_a_bad_delta_is_refused_when_the_mod_is_made():
    with pytest.raises(ValueError, match="delta"):
        make_sample_ledger_mod(delta=0.0)


def test_evaluate_messages_pass_through_untouched():
    calls = []
    mod_reply = sample_ledger_mod(
        Message(RecordDict(), message_type="evaluate", dst_node_id=100, group_id="1"),
        context(100),
        lambda m, c: calls.append(m) or "reply",
    )
    assert mod_reply == "reply" and len(calls) == 1


# ---------------------------------------------------------------- the server's view
def test_the_server_shows_the_largest_epsilon_and_ignores_non_figures():
    results = [
        (10, {keys.SAMPLE_EPSILON: 1.5, keys.SAMPLE_DELTA: 1e-5, "accuracy": 0.5}),
        (30, {keys.SAMPLE_EPSILON: 2.5, keys.SAMPLE_DELTA: 1e-5, "accuracy": 0.9}),
        (10, {keys.SAMPLE_EPSILON: -3.0, keys.SAMPLE_DELTA: 1e-5}),  # not a ledger's figure
        (10, {keys.SAMPLE_EPSILON: math.nan, keys.SAMPLE_DELTA: 1e-5}),
        (10, {keys.SAMPLE_EPSILON: "9", keys.SAMPLE_DELTA: 1e-5}),
        (10, {"accuracy": 0.1}),  # no ledger
    ]
    assert max_sample_epsilon(results) == {"sample-epsilon-max": 2.5, keys.SAMPLE_DELTA: 1e-5}
    assert max_sample_epsilon([(1, {})]) == {}

    def weighted_accuracy(metrics):
        assert all(keys.SAMPLE_EPSILON not in m for _, m in metrics)  # the app's function sees its own metrics
        with_acc = [(n, m) for n, m in metrics if "accuracy" in m]
        return {"accuracy": sum(n * m["accuracy"] for n, m in with_acc) / sum(n for n, _ in with_acc)}

    combined = with_max_sample_epsilon(weighted_accuracy)(results)
    assert combined["accuracy"] == pytest.approx((5 + 27 + 1) / 50) and combined["sample-epsilon-max"] == 2.5


def test_the_message_api_aggregation_averages_the_rest_and_takes_the_max_epsilon():
    records = [
        RecordDict(
            {
                "metrics": MetricRecord(
                    {"num-examples": 10, "train_loss": 1.0, keys.SAMPLE_EPSILON: 3.0, keys.SAMPLE_DELTA: 1e-5}
                )
            }
        ),
        RecordDict(
            {
                "metrics": MetricRecord(
                    {"num-examples": 30, "train_loss": 2.0, keys.SAMPLE_EPSILON: 1.0, keys.SAMPLE_DELTA: 1e-5}
                )
            }
        ),
    ]
    out = max_sample_epsilon_records(records, "num-examples")
    assert out["train_loss"] == pytest.approx(1.75) and out["sample-epsilon-max"] == 3.0
    assert keys.SAMPLE_EPSILON not in out and np.isclose(out[keys.SAMPLE_DELTA], 1e-5)


def test_the_mod_survives_the_pickling_a_simulation_does():
    """Ray sends the ClientApp, mods included, to its workers with cloudpickle: the mod must pickle and come back
    callable (it once carried a ContextVar, which cannot be pickled: `flwr run` failed at round 1)."""
    import pickle

    import cloudpickle

    from dpfl import make_sample_ledger_mod, sample_ledger_mod

    for mod in (sample_ledger_mod, make_sample_ledger_mod(delta=1e-6)):
        assert callable(pickle.loads(cloudpickle.dumps(mod)))


class SelfReportingClient(OpacusClient):
    """As Flower's Opacus example: after training, the client reports `privacy_engine.get_epsilon(delta)` itself."""

    def fit(self, parameters, config):
        arrays, n, metrics = super().fit(parameters, config)
        return arrays, n, {**metrics, "epsilon": self.engine.get_epsilon(1e-5)}


@pytest.mark.parametrize("with_mod", [True, False])
def test_the_clients_own_get_epsilon_is_the_ledgers_under_the_mod(with_mod):
    """Flower's Opacus example prints what get_epsilon returns: under the mod that is the node's cumulative figure
    (equal to the reply's sample-epsilon at the same delta, growing); without it, Opacus' one-engine figure (the
    same every round, as in Flower's example)."""
    app = ClientApp(
        client_fn=lambda ctx: SelfReportingClient().to_client(), mods=[sample_ledger_mod] if with_mod else []
    )
    ctx = context(200)
    own, ledger = [], []
    for _ in range(3):
        metrics = fit_metrics(app(train_message(200), ctx))
        own.append(metrics["epsilon"])
        ledger.append(metrics.get(keys.SAMPLE_EPSILON))
    if with_mod:
        assert own == ledger and own[0] < own[1] < own[2]
        assert own[2] == pytest.approx(dp_accounting_epsilons(SIGMA, BATCH / N, 24, 1e-5)[0], rel=2e-2)
    else:
        assert ledger == [None] * 3 and own[0] == pytest.approx(own[2], rel=1e-9)
        assert own[0] == pytest.approx(dp_accounting_epsilons(SIGMA, BATCH / N, 8, 1e-5)[1], rel=0.2)  # Opacus' PRV
