"""The wrapped Flower strategy's part of a DP round (docs/algorithms.md §0): what it writes into the train
message, and its aggregation and server optimizer acting on the privatized model as post-processing (`release`);
and the small Flower helpers the round loop and the legacy adapter share (a stand-in grid, log filters, a reply
message)."""

from __future__ import annotations

import logging
import math
import os
import time
from contextlib import contextmanager
from logging import WARNING

import flwr
import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, Metadata, MetricRecord, RecordDict
from flwr.common import log

from dpfl.dpcore.privacy import protocol as keys
from dpfl.dpcore.privacy.figures import published_and_former_names
from dpfl.dpcore.privacy.mechanisms import flatten, unflatten
from dpfl.strategies.loop.reply_gate import note_problem
from dpfl.strategies.loop.sample_epsilon import sample_epsilon_summary
from dpfl.strategies.parts.part import arrays_key, config_key
from dpfl.strategies.parts.reply_rules import METRICS_RECORD, metric_record

PROTOCOL_NAMES = frozenset(v for k, v in vars(keys).items() if k.isupper() and isinstance(v, str))
OWN_NAMES = PROTOCOL_NAMES | published_and_former_names()  # no client writes these


def own_metrics(dp, metrics: MetricRecord | None) -> dict:
    """The clients' own train metrics as the wrapped strategy aggregated them (`metrics`, e.g. FedAvg's weighted
    `train_loss`), plus the largest sample-level epsilon of every accepted reply (`sample-epsilon-max` at
    `sample-delta`, `strategies.loop.sample_epsilon`): non-private diagnostics that reach Flower's Result (the round's
    own statistics of the same name take precedence). Keys of the protocol or of a published figure (e.g.
    `epsilon`, `accuracy`) are left out, so no client can write a published figure."""
    own = {k: v for k, v in dict(metrics or {}).items() if k not in OWN_NAMES}
    accepted = [dict(metric_record(r.content) or {}) for r in dp.round.accepted_replies]
    return {**own, **sample_epsilon_summary(accepted, announce=False)}


def metric_problem(content: RecordDict, weight_key: str) -> str | None:
    """Why Flower's aggregation cannot read one reply's metrics (it needs exactly one MetricRecord with a positive
    finite weight `weight_key` and numbers or lists of numbers), else None."""
    if len(content.metric_records) != 1:
        return f"{len(content.metric_records)} metric records, not one"
    record = next(iter(content.metric_records.values()))
    weight = record.get(weight_key)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight < math.inf:
        return f"metric '{weight_key}' = {weight!r} is not a positive finite number"
    for key, value in record.items():
        values = value if isinstance(value, list) else [value]
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values):
            return f"metric '{key}' is not finite"
    return None


def metric_replies(dp, server_round: int) -> list[RecordDict]:
    """The accepted replies' metric records (`round.accepted_replies`: not a node's second reply) that the wrapped
    strategy can aggregate: each reply readable on its own (`metric_problem`), and of the key set most replies have
    (Flower's aggregation skips the whole round when one reply's keys differ). One bad reply costs only its own metrics: it is a noted problem, never raised."""
    weight_key = getattr(dp.strategy, "weighted_by_key", keys.NUM_EXAMPLES)
    usable = []
    for reply in dp.round.accepted_replies:
        if problem := metric_problem(reply.content, weight_key):
            note_problem(dp, server_round, f"metrics of node {reply.metadata.src_node_id} not aggregated: {problem}")
        else:
            usable.append(reply)
    key_sets = [frozenset(next(iter(r.content.metric_records.values())).keys()) for r in usable]
    common = max(key_sets, key=key_sets.count, default=frozenset())
    for reply, key_set in zip(usable, key_sets):
        if key_set != common:
            note_problem(
                dp,
                server_round,
                f"metrics of node {reply.metadata.src_node_id} not aggregated: keys {sorted(key_set)} differ from "
                f"the other replies' {sorted(common)}",
            )
    return [
        RecordDict({name: record for name, record in r.content.metric_records.items()})
        for r, key_set in zip(usable, key_sets)
        if key_set == common
    ]


def wrapped_train_content(dp, server_round: int, arrays: ArrayRecord, config: ConfigRecord) -> RecordDict:
    """What the wrapped strategy would send this round (its own sampling is discarded, and so is its log
    line, which counts nodes): asked on a stand-in grid of as many nodes as it waits for, so it never waits."""
    grid = StandInGrid(
        max(1, getattr(dp.strategy, "min_available_nodes", 1), getattr(dp.strategy, "min_train_nodes", 1))
    )
    with quiet_flower_info():
        messages = list(dp.strategy.configure_train(server_round, arrays, ConfigRecord(dict(config)), grid))
    if not messages:
        return RecordDict({arrays_key(dp): arrays, config_key(dp): ConfigRecord(dict(config))})
    return RecordDict(dict(messages[0].content.items()))


# ------------------------------------------------------------------ the wrapped strategy's part
def release(
    dp, server_round: int, new_global: np.ndarray, metric_records: list[RecordDict] = ()
) -> tuple[ArrayRecord, MetricRecord | None]:
    """The privatized model w' (flat, floating-point arrays only) through the wrapped strategy's aggregation
    and server optimizer (post-processing), and the accepted clients' own metrics (`metric_records`,
    `metric_replies`) through its metric aggregation. A Flower strategy (FedAvg, FedAdam, ...) receives one reply
    holding w' and only its weight 1, so FedAvg returns exactly w' and FedAdam steps on w' - w, and its
    `train_metrics_aggr_fn` averages the clients' metrics. An aggregate_train of the app's own
    (`own_aggregate_train`) receives one reply per record instead, each holding w' and that client's metrics, as it
    would without DP (a weighted mean of copies of w' is w' up to rounding). Keys, order, shapes and dtypes are
    those the server sent; other arrays come back unchanged."""
    assert dp.round.arrays is not None
    rnd = dp.round
    names = list(rnd.arrays.keys())
    proposal = conform(names, rnd.everything, rnd.float_positions, new_global)
    weight_key = getattr(dp.strategy, "weighted_by_key", keys.NUM_EXAMPLES)
    weight_only = RecordDict({METRICS_RECORD: MetricRecord({weight_key: 1})})
    if metric_records and own_aggregate_train(dp.strategy):
        try:
            arrays, metrics = wrapped_aggregate(dp, server_round, proposal, metric_records)
        except Exception as exc:  # hostile metric values its own aggregation cannot read: they cost only themselves
            note_problem(dp, server_round, f"clients' own metrics not aggregated ({type(exc).__name__}: {exc})")
            arrays, metrics = wrapped_aggregate(dp, server_round, proposal, [weight_only])
    else:
        arrays, _ = wrapped_aggregate(dp, server_round, proposal, [weight_only])
        metrics = aggregated_metrics(dp, server_round, metric_records)
    if arrays is None:
        return proposal, metrics
    returned = [arrays[k].numpy() for k in arrays.keys()]
    if list(arrays.keys()) != list(proposal.keys()) or [a.shape for a in returned] != [a.shape for a in rnd.everything]:
        log(
            WARNING,
            "Round %d: %s returned arrays that do not match the model; the DP average is kept",
            server_round,
            type(dp.strategy).__name__,
        )
        return proposal, metrics
    return conform(
        names, rnd.everything, rnd.float_positions, flatten([returned[i] for i in rnd.float_positions])
    ), metrics


OWN_AGGREGATE_TRAIN = (
    "Its own aggregate_train receives one reply per accepted client: the privatized model and that client's metrics "
    "as sent (arrays made from the metrics rather than the model are not covered by epsilon)"
)


def own_aggregate_train(strategy) -> bool:
    """Whether the strategy's aggregate_train is the app's own (not one of Flower's classes')."""
    return not type(strategy).aggregate_train.__module__.startswith("flwr.")


def aggregated_metrics(dp, server_round: int, metric_records: list[RecordDict]) -> MetricRecord | None:
    """The wrapped strategy's `train_metrics_aggr_fn` over the clients' metric records (weighted by its
    `weighted_by_key`); None without records or function, and a noted problem, never raised, if it fails."""
    aggregate = getattr(dp.strategy, "train_metrics_aggr_fn", None)
    if aggregate is None or not metric_records:
        return None
    try:
        return aggregate(list(metric_records), getattr(dp.strategy, "weighted_by_key", keys.NUM_EXAMPLES))
    except Exception as exc:  # hostile values the function cannot read
        note_problem(dp, server_round, f"clients' own train metrics not aggregated ({type(exc).__name__}: {exc})")
        return None


def wrapped_aggregate(dp, server_round: int, proposal: ArrayRecord, metric_records: list[RecordDict]):
    """The wrapped strategy's aggregate_train over one reply per metric record, each holding `proposal`."""
    replies = [
        reply_message(0, RecordDict({arrays_key(dp): proposal, **dict(m.metric_records.items())}))
        for m in metric_records
    ]
    with quiet_flower_info():
        return dp.strategy.aggregate_train(server_round, replies)


def conform(names: list[str], template: list[np.ndarray], positions: list[int], vector: np.ndarray) -> ArrayRecord:
    """The arrays `template` (named `names`) with those at `positions` replaced by consecutive slices of `vector`,
    in their own dtype: same keys in the same order, same shapes and dtypes."""
    everything = list(template)
    parts = unflatten(np.asarray(vector), [everything[i].shape for i in positions])
    for i, part in zip(positions, parts):
        everything[i] = part.astype(everything[i].dtype, copy=False)
    return ArrayRecord({name: Array(np.asarray(a, order="C")) for name, a in zip(names, everything)})


class StandInGrid:
    """Just enough of a Grid for a wrapped strategy's configure_train to write its content: `n` node ids."""

    def __init__(self, n: int) -> None:
        self.n = n

    def get_node_ids(self) -> list[int]:
        return list(range(1, self.n + 1))


FLOWER_PACKAGE = os.path.dirname(flwr.__file__) + os.sep


class FlowerInfoFilter(logging.Filter):
    """Drops the INFO lines of Flower's own code (a wrapped strategy's "Sampled N nodes", "Received N results"):
    they count nodes, which epsilon does not cover. Warnings, errors and the lines of the app's own code (a
    strategy subclass's `log(INFO, ...)`) pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or not record.pathname.startswith(FLOWER_PACKAGE)


class UnusedSamplingLines(logging.Filter):
    """Drops the lines of a wrapped strategy's banner that state its own train sampling (`Fraction: train ...`,
    `Minimum nodes: train ...`): the DP wrapper samples, so they would describe what is not used."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        return not ("Fraction: train" in message or "Minimum nodes: train" in message)


@contextmanager
def filtered_flower_log(log_filter: logging.Filter, enabled: bool = True):
    """While active (and `enabled`), the flwr logger passes its records through `log_filter`."""
    flower_logger = logging.getLogger("flwr")
    if enabled:
        flower_logger.addFilter(log_filter)
    try:
        yield
    finally:
        flower_logger.removeFilter(log_filter)


def quiet_flower_info(enabled: bool = True):
    """While active (and `enabled`), the flwr logger drops INFO lines (`FlowerInfoFilter`)."""
    return filtered_flower_log(FlowerInfoFilter(), enabled)


def reply_message(node_id: int, content: RecordDict | None = None, error=None) -> Message:
    """A reply Message from `node_id`, as a Message-API strategy's aggregate_train expects one."""
    metadata = Metadata(
        run_id=0,
        message_id="",
        src_node_id=node_id,
        dst_node_id=0,
        reply_to_message_id="",
        group_id="",
        created_at=time.time(),
        ttl=0.0,
        message_type=MessageType.TRAIN,
    )
    return Message(content, metadata=metadata) if error is None else Message(error, metadata=metadata)
