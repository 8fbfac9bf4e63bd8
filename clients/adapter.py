"""The one adapter between Flower's Message API and a NumPyClient.

ArrayRecord <-> list of ndarrays, ConfigRecord <-> dict, metrics dict -> MetricRecord.
"""

from __future__ import annotations

import math
import numbers

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.client import NumPyClient

from dpfl.dpcore.privacy import protocol as keys


def _metric_record(metrics: dict) -> MetricRecord:
    """Numbers only (MetricRecord's types); NaN is dropped rather than sent."""
    clean = {}
    for k, v in metrics.items():
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            continue
        v = int(v) if isinstance(v, numbers.Integral) else float(v)
        if isinstance(v, float) and math.isnan(v):
            continue
        clean[k] = v
    return MetricRecord(clean)


def config_of(msg: Message) -> dict:
    """The message's "config" ConfigRecord as a dict ({} where there is none, or it is not a ConfigRecord)."""
    record = msg.content.get("config")
    return dict(record) if isinstance(record, ConfigRecord) else {}


def train_reply(client: NumPyClient, msg: Message) -> Message:
    """Call client.fit on the message's arrays and config; reply with arrays + metrics."""
    parameters = msg.content["arrays"].to_numpy_ndarrays()
    return fit_reply(msg, client.fit(parameters, config_of(msg)))


def fit_reply(msg: Message, fitted: tuple) -> Message:
    """The train reply to `msg` from a NumPyClient.fit result (arrays, num_examples, metrics)."""
    arrays, num_examples, metrics = fitted
    content = RecordDict(
        {"arrays": ArrayRecord(arrays), "metrics": _metric_record({**metrics, keys.NUM_EXAMPLES: num_examples})}
    )
    return Message(content, reply_to=msg)


def evaluate_reply(client: NumPyClient, msg: Message) -> Message:
    """Call client.evaluate; reply with loss, accuracy and num-examples."""
    parameters = msg.content["arrays"].to_numpy_ndarrays()
    return evaluation_reply(msg, client.evaluate(parameters, config_of(msg)))


def evaluation_reply(msg: Message, evaluated: tuple) -> Message:
    """The evaluate reply to `msg` from a NumPyClient.evaluate result (loss, num_examples, metrics)."""
    loss, num_examples, metrics = evaluated
    content = RecordDict({"metrics": _metric_record({keys.LOSS: loss, **metrics, keys.NUM_EXAMPLES: num_examples})})
    return Message(content, reply_to=msg)
