"""The wrapped Flower strategy's part of a DP round (docs/algorithms.md §0): what it writes into the train
message, and its aggregation and server optimizer acting on the privatized model as post-processing (`release`);
and the small Flower helpers the round loop and the legacy adapter share (a stand-in grid, log filters, a reply
message)."""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from logging import WARNING

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, Metadata, MetricRecord, RecordDict
from flwr.common import log

from dpcore.privacy import protocol as keys
from dpcore.privacy.figures import published_and_former_names
from dpcore.privacy.mechanisms import flatten, unflatten

PROTOCOL_NAMES = frozenset(v for k, v in vars(keys).items() if k.isupper() and isinstance(v, str))
OWN_NAMES = PROTOCOL_NAMES | published_and_former_names()  # no client writes these


def clients_own_metrics(dp) -> dict:
    """The accepted replies' own train metrics (e.g. a Flower client's `train_loss`), aggregated by the wrapped
    strategy as Flower would (its `train_metrics_aggr_fn`, weighted by its `weighted_by_key`): non-private
    diagnostics that reach Flower's Result as the clients sent them (the round's own statistics of the same name
    take precedence). Keys of the protocol or of a published figure (e.g. `epsilon`, `accuracy`) are left out,
    so no client can write a published figure; a failed aggregation (hostile values) is a noted problem, never
    raised."""
    aggregate = getattr(dp.strategy, "train_metrics_aggr_fn", None)
    contents = [r.content for r in dp.round.accepted_replies]  # not a node's second reply, which the gate rejected
    if aggregate is None or not contents:
        return {}
    try:
        record = aggregate(contents, getattr(dp.strategy, "weighted_by_key", keys.NUM_EXAMPLES))
    except Exception as exc:  # hostile metrics: the wrapped strategy's function raised
        dp.round.problems.append(f"clients' own train metrics not aggregated ({type(exc).__name__}: {exc})")
        return {}
    return {k: v for k, v in dict(record or {}).items() if k not in OWN_NAMES}


def wrapped_train_content(dp, server_round: int, arrays: ArrayRecord, config: ConfigRecord) -> RecordDict:
    """What the wrapped strategy would send this round (its own sampling is discarded, and so is its log
    line, which counts nodes): asked on a stand-in grid of as many nodes as it waits for, so it never waits."""
    grid = StandInGrid(
        max(1, getattr(dp.strategy, "min_available_nodes", 1), getattr(dp.strategy, "min_train_nodes", 1))
    )
    with quiet_flower_info():
        messages = list(dp.strategy.configure_train(server_round, arrays, ConfigRecord(dict(config)), grid))
    if not messages:
        return RecordDict({dp.arrayrecord_key: arrays, dp.configrecord_key: ConfigRecord(dict(config))})
    return RecordDict(dict(messages[0].content.items()))


# ------------------------------------------------------------------ the wrapped strategy's part
def release(dp, server_round: int, new_global: np.ndarray) -> tuple[ArrayRecord, MetricRecord | None]:
    """The privatized model w' (flat, floating-point arrays only) through the wrapped strategy's aggregation
    and server optimizer (post-processing): it receives one reply holding w', so FedAvg returns w' and
    FedAdam steps on w' - w. Keys, order, shapes and dtypes are those the server sent; other arrays come
    back unchanged."""
    assert dp.current_arrays is not None
    rnd = dp.round
    names = list(rnd.arrays.keys())
    proposal = conform(names, rnd.everything, rnd.float_positions, new_global)
    reply = reply_message(
        0,
        RecordDict(
            {
                dp.arrayrecord_key: proposal,
                "metrics": MetricRecord({getattr(dp.strategy, "weighted_by_key", keys.NUM_EXAMPLES): 1}),
            }
        ),
    )
    with quiet_flower_info():
        arrays, metrics = dp.strategy.aggregate_train(server_round, [reply])
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


class FlowerInfoFilter(logging.Filter):
    """Drops Flower's INFO lines (a wrapped strategy's "Sampled N nodes", "Received N results"): they count
    nodes, which epsilon does not cover. Warnings and errors pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING


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
