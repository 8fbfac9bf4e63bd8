"""Sample-level DP in your own Opacus client: one ledger per client across rounds, kept in `Context.state`.

Flower's Opacus example builds a new `opacus.PrivacyEngine` every round, so the epsilon it prints covers one
round and never grows. With this module the steps every round takes are charged to one ledger per client
(`dpcore.privacy.ledger.PrivacyLedger`, the project's accountant: PLD by default), the engine's `get_epsilon`
answers from it, and each train reply carries the cumulative epsilon. Two changed lines on the client:

    from dpfl import PrivacyEngine, sample_ledger_mod          # was: from opacus import PrivacyEngine
    app = ClientApp(client_fn=client_fn, mods=[sample_ledger_mod])
    # Message API instead: @app.train(mods=[sample_ledger_mod])

and, on a server that does not aggregate its clients' epsilon already, `fit_metrics_aggregation_fn=
max_sample_epsilon` (legacy FedAvg) or `train_metrics_aggr_fn=max_sample_epsilon_records` (Message-API FedAvg),
`strategies.sample_epsilon`.

`PrivacyEngine` is Opacus' own with two additions: created while the mod handles a train message, it belongs to
that node, and its `get_epsilon(delta)` is the node's cumulative epsilon (the ledger's earlier rounds and this
round's steps so far). After the client's train function returns, the mod reads each of the node's engines'
accountant history (Opacus records (noise_multiplier, sample_rate, steps) at every optimizer step, whatever
accountant it was given) and charges the steps not charged before: an engine made every round and one kept across
rounds are both counted once. The reply's metrics gain `sample-epsilon` (cumulative, at `sample-delta`),
`sample-steps` and `sample-accountant` (the accountant whose bound it is: `pld`, or `rdp` where PLD falls back,
e.g. sigma below 0.2).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from flwr.app import ConfigRecord, Context, Message, MessageType, MetricRecord
from flwr.clientapp.typing import ClientAppCallable, Mod
from flwr.compat.common import recorddict_compat as compat

from dpcore.privacy import protocol as keys
from dpcore.privacy.accountants import DEFAULT_ACCOUNTANT, accountant_used
from dpcore.privacy.ledger import PrivacyLedger
from dpcore.task.opacus_import import import_opacus

STATE_KEY = "dpfl.sample-ledger"  # the ConfigRecord in Context.state that holds the node's ledger
DEFAULT_SAMPLE_DELTA = 1e-5  # per client's samples, as ALI-DPFL's default
LEGACY_FIT_METRICS = "fitres.metrics"

# While the mod handles a node's train message: (the node, the engines made during the call, the node's ledger as
# it stood before the call). The list holds the engines until the mod has read them (an engine made in fit() is
# gone once fit() returns); _engines keeps the ones a client holds across rounds.
_call: ContextVar[tuple[int, list, PrivacyLedger] | None] = ContextVar("dpfl_sample_ledger_call", default=None)
_engines: weakref.WeakSet = weakref.WeakSet()


class PrivacyEngine(import_opacus().PrivacyEngine):
    """`opacus.PrivacyEngine`, whose steps `sample_ledger_mod` charges to the node that made it."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        call = _call.get()
        self.dpfl_node = None if call is None else call[0]
        self.dpfl_charged: list[tuple[float, float, int]] = []  # the part of accountant.history already charged
        if call is not None:
            call[1].append(self)
            _engines.add(self)

    def make_private_with_epsilon(self, *args, **kwargs):
        """Opacus' own, except under `sample_ledger_mod`, where it is refused (docs/dropin.md, "A per-client target
        epsilon"): it sizes the noise for this engine's steps alone, the mod charges every round's to one ledger."""
        if self.dpfl_node is not None:
            raise ValueError(
                "make_private_with_epsilon under sample_ledger_mod: Opacus picks the noise so that this engine's "
                "steps alone reach target_epsilon, but the mod charges every round's engine to the node's one ledger, "
                "so the run would pass the target; use make_private(noise_multiplier=...) with a sigma chosen for the "
                "whole run (dpfl.epsilon_of) and stop once get_epsilon(delta) reaches it"
            )
        return super().make_private_with_epsilon(*args, **kwargs)

    def get_epsilon(self, delta: float) -> float:
        """Made while `sample_ledger_mod` handles a train message: the node's cumulative epsilon at `delta`, from
        the project's ledger (every earlier round's steps and this round's so far, as the reply's
        `sample-epsilon` will say). Otherwise Opacus' own figure for this engine alone."""
        call = _call.get()
        if call is None or self.dpfl_node != call[0]:
            return super().get_epsilon(delta)
        node, made_now, ledger = call
        running = PrivacyLedger(delta=delta, accountant=ledger.accountant, history=list(ledger.history))
        for sigma, q, steps in uncharged_events(node, made_now):
            running.record(sigma, q, steps)
        return running.epsilon()


def new_events(history: list, charged: list) -> list[tuple[float, float, int]]:
    """The events of Opacus' `history` [(sigma, q, steps), ...] beyond `charged` (an earlier copy of it: Opacus
    only appends entries or adds steps to the last one)."""
    events = []
    for i, (sigma, q, steps) in enumerate(history):
        before = charged[i][2] if i < len(charged) and charged[i][:2] == (sigma, q) else 0
        if steps > before:
            events.append((float(sigma), float(q), int(steps - before)))
    return events


def load_ledger(context: Context, delta: float, accountant: str) -> PrivacyLedger:
    record = context.state.config_records.get(STATE_KEY)
    if record is None:
        return PrivacyLedger(delta=delta, accountant=accountant)
    sigmas, rates, steps = list(record["sigmas"]), list(record["sample-rates"]), list(record["steps"])
    return PrivacyLedger(delta=delta, accountant=accountant, history=list(zip(sigmas, rates, steps)))


def save_ledger(context: Context, ledger: PrivacyLedger) -> None:
    context.state.config_records[STATE_KEY] = ConfigRecord(
        {
            "sigmas": [float(s) for s, _, _ in ledger.history],
            "sample-rates": [float(q) for _, q, _ in ledger.history],
            "steps": [int(n) for _, _, n in ledger.history],
        }
    )


def node_engines(node: int, made_now: list) -> list:
    """The node's engines: made in this call, or kept from earlier ones."""
    return list({id(e): e for e in [*made_now, *(e for e in list(_engines) if e.dpfl_node == node)]}.values())


def uncharged_events(node: int, made_now: list) -> list[tuple[float, float, int]]:
    """The steps the node's engines took since they were last charged, (sigma, q, steps) each."""
    return [event for e in node_engines(node, made_now) for event in new_events(e.accountant.history, e.dpfl_charged)]


def charge_node_engines(node: int, made_now: list, ledger: PrivacyLedger) -> None:
    """Charge the steps the node's engines took since they were last charged, and mark them charged."""
    for engine in node_engines(node, made_now):
        history = list(engine.accountant.history)
        for sigma, q, steps in new_events(history, engine.dpfl_charged):
            ledger.record(sigma, q, steps)
        engine.dpfl_charged = [tuple(e) for e in history]


def ledger_metrics(ledger: PrivacyLedger) -> dict:
    return {
        keys.SAMPLE_EPSILON: ledger.epsilon(),
        keys.SAMPLE_DELTA: ledger.delta,
        keys.SAMPLE_STEPS: sum(n for _, _, n in ledger.history),
        keys.SAMPLE_ACCOUNTANT: accountant_used(ledger.history, ledger.delta, ledger.accountant),
    }


def add_metrics(reply: Message, metrics: dict) -> None:
    """Into the reply's metrics: a legacy FitRes' metrics, else the Message-API reply's MetricRecord ("metrics",
    or its only one); the accountant's name goes where strings may (FitRes metrics), else it is left out."""
    content = reply.content
    if LEGACY_FIT_METRICS in content.config_records:
        fitres = compat.recorddict_to_fitres(content, keep_input=True)
        fitres.metrics = {**(fitres.metrics or {}), **metrics}
        reply.content = compat.fitres_to_recorddict(fitres, keep_input=True)
        return
    numbers = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
    records = content.metric_records
    name = "metrics" if "metrics" in records or len(records) != 1 else next(iter(records))
    records[name] = MetricRecord({**dict(records.get(name, MetricRecord())), **numbers})


@contextmanager
def engines_made_for(node: int, ledger: PrivacyLedger) -> Iterator[list]:
    """While active, the PrivacyEngines this call makes are listed (the list yielded) for `node`, whose `ledger`
    their `get_epsilon` continues. A module-level function, so the mod's closure holds no ContextVar: Ray pickles
    the ClientApp, mods included, and a ContextVar cannot be pickled."""
    made_now: list = []
    token = _call.set((node, made_now, ledger))
    try:
        yield made_now
    finally:
        _call.reset(token)


def make_sample_ledger_mod(delta: float = DEFAULT_SAMPLE_DELTA, accountant: str = DEFAULT_ACCOUNTANT) -> Mod:
    """A mod that charges the node's `PrivacyEngine` steps to its ledger in Context.state after each train
    message and reports the cumulative epsilon in the reply (module docstring)."""
    PrivacyLedger(delta=delta, accountant=accountant)  # refuses a bad delta or accountant now, not in round 1

    def sample_ledger_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        if msg.metadata.message_type != MessageType.TRAIN:
            return call_next(msg, context)
        node, ledger = int(context.node_id), load_ledger(context, delta, accountant)
        with engines_made_for(node, ledger) as made_now:
            reply = call_next(msg, context)
        charge_node_engines(node, made_now, ledger)
        save_ledger(context, ledger)
        if not reply.has_error():
            add_metrics(reply, ledger_metrics(ledger))
        return reply

    return sample_ledger_mod


sample_ledger_mod = make_sample_ledger_mod()
