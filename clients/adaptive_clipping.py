"""The client's part of adaptive clipping under distributed noise (docs/dp-toolbox.md §3), as a Flower mod:
after the wrapped client (or `dp_privatize_mod`) has clipped and noised its update and reported its norm before
clipping (`update-norm`), `clip_bit_mod` adds the noisy clipped bit

    (1[||Delta|| <= C_t] - 1/2) + N(0, s_b^2),   s_b = sigma_b / sqrt(n_s) (the train config's share),

to the reply's metrics (`clip-bit`); the server sums the bits and tops up the missing shares, so the count carries
N(0, sigma_b^2) whoever took part. Put it outside the privatizing mod: `mods=[clip_bit_mod, dp_privatize_mod]`.
"""

from __future__ import annotations

import numpy as np
from flwr.app import Context, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp.typing import ClientAppCallable, Mod

from dpfl.clients.identity import noise_stream
from dpfl.dpcore.privacy import protocol as keys
from dpfl.dpcore.privacy.mechanisms import make_rng


def make_clip_bit_mod(seed: int | None = None) -> Mod:
    """`seed=None`: the count noise from OS entropy."""

    def clip_bit_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        if msg.metadata.message_type != MessageType.TRAIN or not msg.has_content():
            return call_next(msg, context)
        config = dict(msg.content.config_records.get("config") or next(iter(msg.content.config_records.values()), {}))
        if keys.CLIP_COUNT_NOISE_STD not in config:
            return call_next(msg, context)
        reply = call_next(msg, context)
        if reply.has_error():
            return reply
        records = reply.content.metric_records
        name = "metrics" if "metrics" in records else next(iter(records), "metrics")
        metrics = dict(records.get(name, {}))
        if keys.UPDATE_NORM not in metrics:
            raise ValueError(
                "clip_bit_mod: the reply has no 'update-norm' (the norm before clipping): put the mod "
                "outside dp_privatize_mod, or use a client of this package"
            )
        bit = (1.0 if float(metrics[keys.UPDATE_NORM]) <= float(config[keys.CLIPPING_NORM]) else 0.0) - 0.5
        rng = make_rng(
            0 if seed is None else seed,
            13,
            int(config.get(keys.SERVER_ROUND, 0)),
            noise_stream(msg, context),
            secure=seed is None,
        )
        bit += float(rng.normal(0.0, float(config[keys.CLIP_COUNT_NOISE_STD])))
        content = RecordDict(dict(reply.content.items()))
        content[name] = MetricRecord({**metrics, keys.CLIP_BIT: float(np.float64(bit))})
        return Message(content, reply_to=msg)

    return clip_bit_mod


clip_bit_mod = make_clip_bit_mod()

__all__ = ["clip_bit_mod", "make_clip_bit_mod"]
