"""Local differential privacy as a Flower mod (docs/dp-toolbox.md §2): each client clips and noises its own update
on the device, so every upload is (epsilon, delta)-DP on its own and nothing needs to be trusted on the server.

`make_local_dp_mod(clipping_norm=C, noise_multiplier=sigma, delta=delta)` wraps any train handler (a Flower
client replying with its new weights, or this project's clients replying with their update):

    Delta = w_local - w_global (floating-point arrays),  upload = clip_C(Delta) + N(0, sigma^2 C^2 I).

Neighbouring relation: replace-one (the client's data replaced by any other), so two clipped updates differ by up
to 2C and the upload is the Gaussian mechanism with multiplier sigma C / (2C) = sigma / 2, no sampling
amplification (the client knows it took part). Its ledger (`dpcore.privacy.ledger.PrivacyLedger`, one
(sigma / 2, 1) event per round it took part in) lives in the client's `Context.state` and survives across rounds;
the reply carries `local-epsilon-round` (one release), `local-epsilon` (composed), `local-rounds` and
`local-noise-multiplier`, and nothing else computed from the data: the wrapped client's own metrics (loss, norm)
are dropped, since under local DP the server is not trusted with them.

The mod does not take C or sigma from the server's train config: the client decides its own noise. The server's
side is `DifferentialPrivacy(..., noise_placement="local")` (`strategies.parts.noise_placement.LocalNoise`): no server
noise, only uploads marked with a local noise multiplier at least the configured one are averaged in.
"""

from __future__ import annotations

import json

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp.typing import ClientAppCallable, Mod

from dpfl.clients.identity import noise_stream
from dpfl.dpcore.privacy import protocol as keys
from dpfl.dpcore.privacy.accountants import DEFAULT_ACCOUNTANT
from dpfl.dpcore.privacy.ledger import PrivacyLedger
from dpfl.dpcore.privacy.mechanisms import clip_and_noise, flatten, float_indices, make_rng, unflatten, update_problem

STATE_KEY = "local-dp-ledger"  # the ConfigRecord in Context.state holding the client's ledger (JSON)


def local_release_multiplier(noise_multiplier: float) -> float:
    """sigma / 2: the multiplier of one upload relative to the replace-one sensitivity 2C."""
    return noise_multiplier / 2.0


def client_ledger(context: Context, delta: float, accountant: str = DEFAULT_ACCOUNTANT) -> PrivacyLedger:
    """The client's own ledger from its Context.state (a new, empty one the first time)."""
    record = context.state.config_records.get(STATE_KEY)
    if record is None:
        return PrivacyLedger(delta, accountant)
    return PrivacyLedger.from_state_dict(json.loads(str(record["state"])))


def save_ledger(context: Context, ledger: PrivacyLedger) -> None:
    context.state[STATE_KEY] = ConfigRecord({"state": json.dumps(ledger.state_dict())})


def make_local_dp_mod(
    clipping_norm: float,
    noise_multiplier: float,
    delta: float,
    accountant: str = DEFAULT_ACCOUNTANT,
    seed: int | None = None,
) -> Mod:
    """The local-DP mod. `seed=None`: noise from OS entropy (a seed makes it reproducible and removable)."""
    if not clipping_norm > 0:
        raise ValueError(f"make_local_dp_mod: clipping_norm={clipping_norm!r} must be > 0")
    if not noise_multiplier > 0:
        raise ValueError(f"make_local_dp_mod: noise_multiplier={noise_multiplier!r} must be > 0")
    if not 0 < delta < 1:
        raise ValueError(f"make_local_dp_mod: delta={delta!r} must be in (0, 1)")
    one_release = PrivacyLedger(delta, accountant)
    one_release.record(local_release_multiplier(noise_multiplier), 1.0)
    epsilon_round = one_release.epsilon()

    def local_dp_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        if (
            msg.metadata.message_type != MessageType.TRAIN
            or not msg.has_content()
            or len(msg.content.array_records) != 1
        ):
            return call_next(msg, context)
        global_arrays = next(iter(msg.content.array_records.values())).to_numpy_ndarrays()
        reply = call_next(msg, context)
        if reply.has_error():
            return reply
        ((array_key, array_record),) = reply.content.array_records.items()
        arrays = [np.asarray(a) for a in array_record.to_numpy_ndarrays()]
        is_update = any(r.get(keys.UPLOAD_KIND) == keys.UPLOAD_UPDATE for r in reply.content.metric_records.values())
        floats = float_indices(global_arrays)
        problem = update_problem([arrays[i] for i in floats], [global_arrays[i].shape for i in floats])
        if problem:
            raise ValueError(f"local_dp_mod: the client's reply does not match the global model: {problem}")
        update = flatten([arrays[i] for i in floats])
        if not is_update:
            update = update - flatten([global_arrays[i] for i in floats])
        rng = make_rng(
            0 if seed is None else seed,
            11,
            noise_stream(msg, context),
            int(dict(next(iter(msg.content.config_records.values()), {})).get(keys.SERVER_ROUND, 0)),
            secure=seed is None,
        )
        update, _ = clip_and_noise(update, clipping_norm, noise_multiplier * clipping_norm, rng)
        ledger = client_ledger(context, delta, accountant)
        ledger.record(local_release_multiplier(noise_multiplier), 1.0)
        save_ledger(context, ledger)
        upload = list(global_arrays)  # arrays that are not floating point: as the server sent them
        for i, part in zip(floats, unflatten(update, [global_arrays[i].shape for i in floats])):
            upload[i] = part.astype(global_arrays[i].dtype, copy=False)
        names = list(array_record.keys())
        metrics = MetricRecord(
            {
                keys.UPLOAD_KIND: keys.UPLOAD_UPDATE,
                keys.NUM_EXAMPLES: 1,
                keys.LOCAL_NOISE_MULTIPLIER: float(noise_multiplier),
                keys.LOCAL_EPSILON_ROUND: float(epsilon_round),
                keys.LOCAL_EPSILON: float(ledger.epsilon()),
                keys.LOCAL_ROUNDS: int(sum(n for _, _, n in ledger.history)),
                keys.LOCAL_DELTA: float(delta),
            }
        )
        content = RecordDict(
            {
                array_key: ArrayRecord({k: Array(np.asarray(a, order="C")) for k, a in zip(names, upload)}),
                "metrics": metrics,
            }
        )
        return Message(content, reply_to=msg)

    return local_dp_mod


__all__ = ["make_local_dp_mod"]
