"""Client-side privatization as Flower mods: an existing ClientApp or NumPyClient gains DP
without subclassing. Attach them to train only (`@app.train(mods=[...])`, or a legacy
`ClientApp(client_fn, mods=[...])`, which passes evaluate messages through untouched).

`dp_privatize_mod` (made by `make_dp_privatize_mod`): the wrapped client replies with its
new weights, as Flower clients do; the mod turns them into the update
Delta = w_local - w_global over the floating-point arrays (the others go back as the server sent them),
marks the reply as an update (`protocol.UPLOAD_KIND`), and when the strategy asks for it ("privatize" in the train
config) clips Delta to C ("clipping-norm") and adds the noise share N(0, s^2 I)
("noise-std"), docs/algorithms.md §0, with the functions of dpcore.privacy.mechanisms.
It reports ||Delta||_2 before clipping as "update-norm" (the strategy's clipping
statistics), except under secure aggregation.

Under SecAgg+ ("secure-aggregation" in the train config) the reply carries weight
num_examples = 1 and no metrics, so the secure sum is a uniform sum and nothing
data-dependent travels next to it in the clear; `make_dp_privatize_mod(send_fit_metrics=True)`
sends the client's own fit metrics knowingly, in plaintext beside the sum (outside SecAgg+'s
and epsilon's guarantee). Put `secaggplus_mod` first:
`mods=[secaggplus_mod, dp_privatize_mod]`. `uniform_weight_mod` does only this part, for
clients that privatize themselves (`dpfl.TrainingClient`).

Top-k sparsification is not part of these mods; under SecAgg+ a sparse update must be sent
in dense form (zeros included), since the protocol sums dense vectors.

Both work with Message-API ClientApps (content "arrays" + "config") and legacy client_fn
ClientApps (FitIns / FitRes records).
"""

from __future__ import annotations

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp.typing import ClientAppCallable, Mod
from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays
from flwr.compat.common import recorddict_compat as compat

from dpfl.clients.identity import noise_stream
from dpfl.dpcore.privacy import protocol as keys
from dpfl.dpcore.privacy.mechanisms import (
    clip_and_noise,
    flatten,
    float_indices,
    l2_norm,
    make_rng,
    unflatten,
    update_problem,
)

LEGACY_FIT_CONFIG = "fitins.config"
LEGACY_FIT_RESULT = "fitres.parameters"


def _train_instruction(msg: Message) -> tuple[str, list[np.ndarray], dict] | None:
    """(api, global arrays, train config) of a train instruction; None for anything else
    (evaluate, or a SecAgg+ key-exchange stage)."""
    if msg.metadata.message_type != MessageType.TRAIN or not msg.has_content():
        return None
    content = msg.content
    if LEGACY_FIT_CONFIG in content.config_records:
        fitins = compat.recorddict_to_fitins(content, keep_input=True)
        return "legacy", parameters_to_ndarrays(fitins.parameters), dict(fitins.config)
    if len(content.array_records) != 1:
        return None
    arrays = next(iter(content.array_records.values())).to_numpy_ndarrays()
    config = content.config_records.get("config") or next(iter(content.config_records.values()), ConfigRecord())
    return "message", arrays, dict(config)


def _secure(config: dict) -> bool:
    return bool(config.get(keys.SECURE_AGGREGATION, False))


def _uniform(fitres, send_fit_metrics: bool = False) -> None:
    """SecAgg+: weight 1, and no plaintext metrics unless the client sends its own knowingly."""
    fitres.num_examples = 1
    fitres.metrics = dict(fitres.metrics) if send_fit_metrics else {}


def make_dp_privatize_mod(seed: int | None = None, send_fit_metrics: bool = False) -> Mod:
    """The privatization mod. `seed=None` draws the noise from OS entropy (deployments); a seed
    gives reproducible noise per (seed, round, node), which anyone who knows it can remove.

    `send_fit_metrics` (SecAgg+ only; without it fit metrics are sent anyway): the client's own fit metrics (what
    its `fit` returns, e.g. `train_loss`) go to the server in plaintext beside the secure sum, with weight 1, for
    the app's `fit_metrics_aggregation_fn`. The client discloses them knowingly: they are outside both SecAgg+'s
    guarantee (the server sees each client's values) and epsilon's. The mod's own update norm is never sent
    under SecAgg+."""

    def dp_privatize_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        instruction = _train_instruction(msg)
        if instruction is None:
            return call_next(msg, context)
        api, global_arrays, config = instruction
        if keys.CLIPPING_NORM not in config:
            raise ValueError(
                "dp_privatize_mod: the train config has no 'clipping-norm' (nor 'privatize', "
                "'noise-std'); use it with a DP strategy of this package (DPFedAvg, LegacyDPFedAvg), "
                f"which sends them; config keys received: {sorted(config)}"
            )
        reply = call_next(msg, context)
        if reply.has_error():
            return reply
        if api == "legacy":
            fitres = compat.recorddict_to_fitres(reply.content, keep_input=True)
            weights = parameters_to_ndarrays(fitres.parameters)
        else:
            ((array_key, array_record),) = reply.content.array_records.items()
            weights = array_record.to_numpy_ndarrays()
        weights = [np.asarray(w) for w in weights]
        floats = float_indices(global_arrays)
        problem = update_problem([weights[i] for i in floats], [global_arrays[i].shape for i in floats])
        if problem is None and [w.shape for w in weights] != [a.shape for a in global_arrays]:
            problem = "a non-floating-point array has the wrong shape"
        if problem:
            raise ValueError(f"dp_privatize_mod: the client's model does not match the global model: {problem}")
        update = flatten([weights[i] for i in floats]) - flatten([global_arrays[i] for i in floats])
        if bool(config.get(keys.PRIVATIZE, False)):
            rng = make_rng(
                0 if seed is None else seed,
                3,
                int(config.get(keys.SERVER_ROUND, 0)),
                noise_stream(msg, context),
                secure=seed is None,
            )
            update, norm = clip_and_noise(update, float(config[keys.CLIPPING_NORM]), float(config[keys.NOISE_STD]), rng)
        else:
            norm = l2_norm(update)
        upload = list(global_arrays)  # arrays that are not floating point: as the server sent them
        for i, part in zip(floats, unflatten(update, [global_arrays[i].shape for i in floats])):
            upload[i] = part
        marks = {keys.UPDATE_NORM: norm, keys.UPLOAD_KIND: keys.UPLOAD_UPDATE}
        if api == "legacy":
            fitres.parameters = ndarrays_to_parameters(upload)
            if _secure(config):
                _uniform(fitres, send_fit_metrics)
            else:
                fitres.metrics = {**fitres.metrics, **marks}
            return Message(compat.fitres_to_recorddict(fitres, keep_input=True), reply_to=msg)
        names = list(array_record.keys())
        content = RecordDict(
            {array_key: ArrayRecord({k: Array(np.asarray(a, order="C")) for k, a in zip(names, upload)})}
        )
        for key, record in reply.content.metric_records.items():
            content[key] = MetricRecord({**record, **marks})
        if not reply.content.metric_records:
            content["metrics"] = MetricRecord(marks)
        for key, record in reply.content.config_records.items():
            content[key] = record
        return Message(content, reply_to=msg)

    return dp_privatize_mod


dp_privatize_mod = make_dp_privatize_mod()


def uniform_weight_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Legacy fit replies under SecAgg+: weight 1 and no metrics (for clients that privatize themselves)."""
    instruction = _train_instruction(msg)
    reply = call_next(msg, context)
    if instruction is None or not _secure(instruction[2]) or reply.has_error():
        return reply
    if instruction[0] != "legacy":
        raise ValueError("uniform_weight_mod: SecAgg+ needs a legacy client_fn ClientApp")
    fitres = compat.recorddict_to_fitres(reply.content, keep_input=True)
    _uniform(fitres)
    return Message(compat.fitres_to_recorddict(fitres, keep_input=True), reply_to=msg)


__all__ = ["dp_privatize_mod", "make_dp_privatize_mod", "uniform_weight_mod"]
