"""Sample-level DP in your own Opacus client: one ledger per node across rounds, charged at each DP-SGD step.

Flower's Opacus example builds a new `opacus.PrivacyEngine` every round, so the epsilon it prints covers one
round and never grows. With this module every DP-SGD step an Opacus optimizer takes while the mod handles one of
the node's messages is charged to one ledger per node (`dpcore.privacy.ledger.PrivacyLedger`, the project's
accountant: PLD by default), the engine's `get_epsilon` answers from it, and each train reply carries the
cumulative epsilon. Two changed lines on the client:

    from dpfl import PrivacyEngine, sample_ledger_mod          # was: from opacus import PrivacyEngine
    app = ClientApp(client_fn=client_fn, mods=[sample_ledger_mod])
    # Message API instead: @app.train(mods=[sample_ledger_mod])

and, on a server that does not aggregate its clients' epsilon already, `fit_metrics_aggregation_fn=
max_sample_epsilon` (legacy FedAvg) or `train_metrics_aggr_fn=max_sample_epsilon_records` (Message-API FedAvg),
`strategies.loop.sample_epsilon`.

Where steps are counted: `PrivacyEngine` is Opacus' own, whose `make_private` (and so `make_private_with_epsilon`)
puts a counter in front of the optimizer's step hook, the hook Opacus' accountants use: each noisy step is one
event (sigma = the optimizer's noise_multiplier, q = (1 / len(data_loader)) * accumulated_iterations, as Opacus
charges it), charged to the node whose message is being handled when the step happens, whichever object or round
made the engine and whatever the client does to its `accountant`. A torch optimizer step pre-hook sees the steps
this counter did not: a step with Opacus' per-sample gradients (an `opacus.PrivacyEngine`, or a step hook
replaced) makes the node's ledger unknown. So does a DP-SGD step taken outside any message the mod handled (a
stray step, `StraySteps`), for the node whose message made or last stepped that optimizer only; a stray step of an
optimizer no message saw marks the runs this process has served (it could be any of their nodes'), or the first it
serves where it has served none, and never another run.

Where the ledger lives: in `Context.state` and in a node-local file, `<folder>/<run key>.<node key>.json`,
written atomically after each message (folder: `make_sample_ledger_mod(folder=...)`, else node_config
`sample-ledger-dir`, else `$FLWR_HOME/dpfl-sample-ledgers`, FLWR_HOME defaulting to ~/.flwr; run key: run_config
`sample-ledger-run`, else the run id, which the SuperLink draws at random for each run, as the in-process grids
do; node key: node_config `sample-ledger-node`, else `client-<client-id>`, else `partition-<partition-id>`, else
`node-<node id>`). A cleared `Context.state` or a fresh Context (a SuperNode restart; a resumed run that sets
the same `sample-ledger-run`) continues from the file. A damaged record (lists of unequal
length, a step count below 1, a sigma that is not a number in (0, 1e6], a rate outside (0, 1]), a file and a state
that disagree, or a step the mod could not see make the ledger unknown for good: one warning line, and every
later reply says `sample-epsilon` = inf (the server's `sample-epsilon-max` then reads inf) and `sample-accountant`
`unknown: <why>`.

The reply's metrics gain `sample-epsilon` (cumulative, at `sample-delta`), `sample-steps` and `sample-accountant`
(legacy replies only: `pld`, or `rdp` where PLD falls back, e.g. sigma below 0.2; or `unknown: ...`).

A per-client target: under the mod, `make_private_with_epsilon(..., epochs=E)` plans the node's whole run, E epochs
(every round's) of len(data_loader) steps, calibrates sigma on the node's ledger to end it at the target
(`clients.sample_budget`) and refuses a step past the plan (`SampleBudgetSpent`: the node's reply is an error that
says so).
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
import weakref
from collections.abc import Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from logging import WARNING
from pathlib import Path

import torch
from flwr.app import ConfigRecord, Context, Message, MessageType, MetricRecord
from flwr.clientapp.typing import ClientAppCallable, Mod
from flwr.common import log
from flwr.compat.common import recorddict_compat as compat
from torch.optim.optimizer import register_optimizer_step_pre_hook

from dpfl.clients.sample_budget import StepBudget, sample_budget
from dpfl.dpcore.privacy import protocol as keys
from dpfl.dpcore.privacy.accountants import DEFAULT_ACCOUNTANT, Event, accountant_used
from dpfl.dpcore.privacy.ledger import PrivacyLedger
from dpfl.dpcore.task.opacus_import import import_opacus

STATE_KEY = "dpfl.sample-ledger"  # the ConfigRecord in Context.state that holds the node's ledger
FOLDER_KEY = "sample-ledger-dir"  # node_config: the node-local folder of the ledger files
RUN_KEY = "sample-ledger-run"  # run_config: the run's stable name, kept when it is resumed
NODE_KEY = "sample-ledger-node"  # node_config: the node's stable name (else its partition-id, else its node id)
DEFAULT_SAMPLE_DELTA = 1e-5  # per client's samples, as ALI-DPFL's default
MAX_SIGMA = 1e6  # a larger noise multiplier is charged as 1e6: an upper bound (epsilon 0 at 8 digits), no overflow
LEGACY_FIT_METRICS = "fitres.metrics"
OPACUS_GRADIENT_STATE = ("grad_sample", "summed_grad", "_norm_sample")  # what Opacus puts on a parameter


@dataclass
class NodeCall:
    """The node whose message the mod is handling, its ledger (charged step by step) and, once it cannot vouch
    for it, why (`unknown`)."""

    node: int
    ledger: PrivacyLedger
    unknown: str = ""
    path: str = ""  # its ledger file: whose it is

    def mark_unknown(self, why: str) -> None:
        self.unknown = self.unknown or why

    def epsilon(self, delta: float) -> float:
        if self.unknown:
            return math.inf
        return PrivacyLedger(delta=delta, accountant=self.ledger.accountant, history=self.ledger.history).epsilon()


_call: ContextVar[NodeCall | None] = ContextVar("dpfl_sample_ledger_call", default=None)
_counted: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # inner optimizer -> its next step was counted


@dataclass
class StraySteps:
    """The DP-SGD steps this process took outside any message the mod handled, and whose ledgers they make unknown:
    the node's whose message made or last stepped the optimizer (`owners`: inner optimizer -> ledger file); for an
    optimizer no message saw, the runs this process has served so far (any of their nodes' data could be under it),
    or the first it serves where it has served none (`pending`). Every other node, and a run that starts later,
    keeps its ledger."""

    owners: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)
    nodes: dict[str, int] = field(default_factory=dict)  # ledger file -> stray steps of optimizers its node owns
    runs: dict[str, int] = field(default_factory=dict)  # run key -> stray steps of optimizers no message saw
    served: set[str] = field(default_factory=set)  # the run keys of the messages handled so far
    pending: int = 0

    def own(self, optimizer) -> None:
        """`optimizer` belongs to the node whose message is being handled (if one is)."""
        call = _call.get()
        if call is not None:
            self.owners[optimizer] = call.path

    def step(self, optimizer) -> None:
        owner = self.owners.get(optimizer)
        if owner is not None:
            self.nodes[owner] = self.nodes.get(owner, 0) + 1
        elif self.served:
            for run in self.served:
                self.runs[run] = self.runs.get(run, 0) + 1
        else:
            self.pending += 1

    def serve(self, run: str) -> None:
        if run not in self.served:
            self.served.add(run)
            self.runs[run] = self.runs.get(run, 0) + self.pending
            self.pending = 0

    def why(self, path: str, run: str) -> str:
        """Why the ledger in `path` (of run `run`) is unknown for a stray step, or ""."""
        if steps := self.nodes.get(path):
            return (
                f"{steps} DP-SGD steps taken outside a message the mod handled, by an optimizer this node's messages "
                "made or stepped"
            )
        if steps := self.runs.get(run):
            return (
                f"{steps} DP-SGD steps taken in this process outside a message the mod handled, by an optimizer no "
                "message saw (any node of this run could be its)"
            )
        return ""


_strays = StraySteps()


def charge_step(sigma: float, sample_rate: float) -> None:
    """One DP-SGD step (sigma, q), to the node whose message is being handled (outside any: `uncounted_step` marks
    the stray step)."""
    call = _call.get()
    if call is None:
        return
    if not sigma > 0:  # nan, 0 or negative: nothing to charge that bounds it
        call.mark_unknown(f"a DP-SGD step at noise multiplier {sigma}")
    else:
        call.ledger.record(min(float(sigma), MAX_SIGMA), min(float(sample_rate), 1.0), 1)


def watch(optimizer, sample_rate: float, budget: StepBudget | None = None) -> None:
    """Count the noisy steps of an Opacus `DPOptimizer`, in front of the step hook it has (its accountant's); a
    step past the `budget` raises before the parameters move (Opacus calls the hook after noising, before the
    wrapped optimizer's step)."""
    _strays.own(optimizer.original_optimizer)  # made in a node's message: that node's
    accountant_hook = optimizer.step_hook

    def step_hook(optim) -> None:
        if budget is not None:
            budget.take(sample_rate * optim.accumulated_iterations)
        _counted[optim.original_optimizer] = True
        charge_step(optim.noise_multiplier, sample_rate * optim.accumulated_iterations)
        if accountant_hook is not None:
            accountant_hook(optim)

    optimizer.attach_step_hook(step_hook)


def uncounted_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """Torch's pre-hook of every optimizer step: a step on parameters carrying Opacus' per-sample gradients that
    `watch`'s counter did not see makes the ledger unknown; a DP-SGD step outside any message is a stray step
    (`StraySteps`); one inside a message makes the optimizer that node's."""
    counted = _counted.pop(optimizer, False)
    if not counted:
        first = next((p for group in optimizer.param_groups for p in group["params"] if p.requires_grad), None)
        if first is None or all(getattr(first, name, None) is None for name in OPACUS_GRADIENT_STATE):
            return
    call = _call.get()
    if call is None:
        _strays.step(optimizer)
        return
    _strays.own(optimizer)
    if not counted:
        call.mark_unknown(
            "a DP-SGD step of an Opacus optimizer not made by dpfl's PrivacyEngine (or its step hook replaced)"
        )


register_optimizer_step_pre_hook(uncounted_step)


class PrivacyEngine(import_opacus().PrivacyEngine):
    """`opacus.PrivacyEngine`, whose optimizers' steps `sample_ledger_mod` charges to the node that takes them."""

    def make_private(self, **kwargs):
        return self._make_private(None, **kwargs)

    def _make_private(self, budget: StepBudget | None, **kwargs):
        made = super().make_private(**kwargs)  # (module, optimizer, [criterion,] data_loader)
        watch(made[1], 1 / len(made[-1]), budget)  # Opacus' own sample rate: 1 / len of the loader it returns
        return made

    def make_private_with_epsilon(
        self, *, data_loader, target_epsilon: float, target_delta: float, epochs: int, **kwargs
    ):
        """Opacus' own outside `sample_ledger_mod`. Under it, a per-client target for the whole run
        (docs/dropin.md, "A per-client target epsilon"): `epochs` counts the node's epochs over the run (every
        round's: num_rounds x local epochs), T = epochs x len(data_loader) steps at q = 1 / len(data_loader), and
        sigma (`clients.sample_budget`) keeps the node's ledger at eps(target_delta) <= target_epsilon after its
        steps so far and the T - (steps so far) left, which are all this engine's optimizer takes: a step past them,
        or a call with none left, raises `SampleBudgetSpent` (the node's reply is an error that says so)."""
        call = _call.get()
        if call is None:
            return super().make_private_with_epsilon(
                data_loader=data_loader,
                target_epsilon=target_epsilon,
                target_delta=target_delta,
                epochs=epochs,
                **kwargs,
            )
        sigma, budget = sample_budget(
            call.node, call.ledger, call.unknown, target_epsilon, target_delta, epochs, len(data_loader)
        )
        return self._make_private(budget, data_loader=data_loader, noise_multiplier=sigma, **kwargs)

    def get_epsilon(self, delta: float) -> float:
        """While `sample_ledger_mod` handles a message: the node's cumulative epsilon at `delta` (every earlier
        round's steps and this one's so far, as the reply's `sample-epsilon` will say; inf if unknown).
        Otherwise Opacus' own figure for this engine alone."""
        call = _call.get()
        return super().get_epsilon(delta) if call is None else call.epsilon(delta)


# ---------------------------------------------------------------- the node's record
def as_record(ledger: PrivacyLedger, unknown: str) -> dict:
    return {
        "sigmas": [float(s) for s, _, _ in ledger.history],
        "sample-rates": [float(q) for _, q, _ in ledger.history],
        "steps": [int(n) for _, _, n in ledger.history],
        "unknown": unknown,
    }


def number(value, low: float, high: float) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and low < value <= high


def read_record(record: Mapping) -> tuple[list[Event], str]:
    """(history, why unknown) of a stored record; ValueError naming what is damaged."""
    try:
        sigmas, rates, steps = list(record["sigmas"]), list(record["sample-rates"]), list(record["steps"])
    except (KeyError, TypeError) as exc:
        raise ValueError(f"no list {exc}") from None
    unknown = record.get("unknown", "")
    if not len(sigmas) == len(rates) == len(steps):
        raise ValueError(f"{len(sigmas)} sigmas, {len(rates)} sample-rates, {len(steps)} steps")
    for s, q, n in zip(sigmas, rates, steps):
        if not (number(s, 0, MAX_SIGMA) and number(q, 0, 1) and isinstance(n, int) and not isinstance(n, bool)):
            raise ValueError(f"event (sigma={s!r}, sample-rate={q!r}, steps={n!r}) outside (0, 1e6] x (0, 1] x int")
        if n < 1:
            raise ValueError(f"{n} steps")
    if not isinstance(unknown, str):
        raise ValueError(f"unknown={unknown!r}")
    return [(float(s), float(q), int(n)) for s, q, n in zip(sigmas, rates, steps)], unknown


def extends(longer: list[Event], shorter: list[Event]) -> bool:
    """Whether `shorter` is an earlier state of the append-only history `longer`."""
    if len(shorter) > len(longer) or shorter[:-1] != longer[: len(shorter) - 1]:
        return False
    if not shorter:
        return True
    last, there = shorter[-1], longer[len(shorter) - 1]
    return last[:2] == there[:2] and last[2] <= there[2]


def ledger_file(context: Context, folder: str | Path | None) -> Path:
    """<folder>/<run key>.<node key>.json (module docstring): the node key names the node's data, which outlives
    its node id (a restarted SuperNode, a new run may get another)."""
    configured = folder or context.node_config.get(FOLDER_KEY)
    home = Path(os.environ.get("FLWR_HOME") or Path.home() / ".flwr")
    base = Path(configured) if configured else home / "dpfl-sample-ledgers"
    config = context.node_config
    node = config.get(NODE_KEY) or next(
        (
            f"{name}-{config[key]}"
            for key, name in (("client-id", "client"), ("partition-id", "partition"))
            if key in config
        ),
        None,
    )
    name = f"{run_key(context)}.{node or f'node-{int(context.node_id)}'}"
    return base / f"{re.sub(r'[^A-Za-z0-9._-]', '_', name)}.json"


def run_key(context: Context) -> str:
    """The run's name in its ledger files: run_config `sample-ledger-run`, else the run id."""
    return str(context.run_config.get(RUN_KEY) or context.run_id)


def load_ledger(context: Context, path: Path, delta: float, accountant: str) -> tuple[NodeCall, str]:
    """(the node's ledger from Context.state and its file: the longer where one extends the other, unknown where
    either is damaged or they disagree; why the records already said it is unknown)."""
    sources = {}
    state = context.state.config_records.get(STATE_KEY)
    if state is not None:
        sources["Context.state"] = dict(state)
    if path.exists():
        try:
            sources[str(path)] = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            sources[str(path)] = exc
    read, unknown, stored = [], "", ""
    for where, raw in sources.items():
        try:
            if isinstance(raw, Exception):
                raise ValueError(str(raw))
            history, why = read_record(raw)
            read.append(history)
            stored = stored or why
        except ValueError as exc:
            unknown = unknown or f"the ledger record in {where} is damaged: {exc}"
    read.sort(key=lambda h: sum(n for _, _, n in h))
    if len(read) == 2 and not extends(read[1], read[0]):
        unknown = unknown or f"Context.state and {path} hold different histories"
    ledger = PrivacyLedger(delta, accountant, read[-1] if read else [])
    return NodeCall(int(context.node_id), ledger, stored or unknown, str(path)), stored


def save_ledger(context: Context, path: Path, call: NodeCall) -> None:
    """Into Context.state, and atomically into the node's file (a temporary file renamed over it)."""
    record = as_record(call.ledger, call.unknown)
    context.state.config_records[STATE_KEY] = ConfigRecord(record)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=path.name, suffix=".tmp", delete=False) as f:
            json.dump(record, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(f.name, path)
    except OSError as exc:
        raise OSError(
            f"sample_ledger_mod cannot write the node's ledger to {path} ({exc}): set node_config "
            f"'{FOLDER_KEY}' (or FLWR_HOME) to a writable node-local folder"
        ) from exc


def ledger_metrics(ledger: PrivacyLedger, unknown: str) -> dict:
    steps = sum(n for _, _, n in ledger.history)
    if unknown:
        return {
            keys.SAMPLE_EPSILON: math.inf,
            keys.SAMPLE_DELTA: ledger.delta,
            keys.SAMPLE_STEPS: steps,
            keys.SAMPLE_ACCOUNTANT: f"unknown: {unknown}",
        }
    return {
        keys.SAMPLE_EPSILON: ledger.epsilon(),
        keys.SAMPLE_DELTA: ledger.delta,
        keys.SAMPLE_STEPS: steps,
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


def handle(
    msg: Message, context: Context, call_next: ClientAppCallable, delta: float, accountant: str, folder
) -> Message:
    """The mod's work (module-level, so the mod's closure holds no ContextVar: Ray pickles the ClientApp, mods
    included, and a ContextVar cannot be pickled). Steps in any message are charged; train replies report."""
    path, run = ledger_file(context, folder), run_key(context)
    _strays.serve(run)
    call, stored = load_ledger(context, path, delta, accountant)
    before = (list(call.ledger.history), call.unknown)
    token = _call.set(call)
    try:
        reply = call_next(msg, context)
    finally:
        _call.reset(token)
        if why := _strays.why(call.path, run):
            call.mark_unknown(why)
        train = msg.metadata.message_type == MessageType.TRAIN
        if train or (call.ledger.history, call.unknown) != before or STATE_KEY not in context.state.config_records:
            save_ledger(context, path, call)
        if call.unknown != stored:
            log(
                WARNING,
                "sample_ledger_mod: node %d's sample-level epsilon is unknown from now on (%s); its replies "
                "say sample-epsilon = inf",
                call.node,
                call.unknown,
            )
    if train and not reply.has_error():
        add_metrics(reply, ledger_metrics(call.ledger, call.unknown))
    return reply


def make_sample_ledger_mod(
    delta: float = DEFAULT_SAMPLE_DELTA, accountant: str = DEFAULT_ACCOUNTANT, folder: str | Path | None = None
) -> Mod:
    """A mod that charges the node's DP-SGD steps to its ledger (Context.state and a file in `folder`) and
    reports the cumulative epsilon in each train reply (module docstring)."""
    PrivacyLedger(delta=delta, accountant=accountant)  # refuses a bad delta or accountant now, not in round 1

    def sample_ledger_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        return handle(msg, context, call_next, delta, accountant, folder)

    return sample_ledger_mod


sample_ledger_mod = make_sample_ledger_mod()
