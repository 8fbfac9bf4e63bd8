"""ClientApp: node config + run config -> NumPyClient -> train / evaluate replies."""

from __future__ import annotations

import os

from flwr.app import Context, Message
from flwr.client import Client, NumPyClient
from flwr.client.mod import secaggplus_mod
from flwr.clientapp import ClientApp

from dpfl.clients.adapter import evaluate_reply, train_reply
from dpfl.clients.cohort.hosting import answer_hosted_clients, as_handler, hosted_clients, serve_cohort
from dpfl.clients.identity import answer_client_id
from dpfl.clients.mods import uniform_weight_mod
from dpfl.dpcore.privacy import protocol as keys
from dpfl.dpcore.privacy.modes import NoisePlacementMode
from dpfl.dpcore.privacy.packing import is_packed
from dpfl.dpcore.task.models import build_model
from dpfl.dpcore.task.threads import node_threads, one_thread_per_client
from dpfl.fl_app import SPEED_PATCHES_ENV, speed_patches
from dpfl.fl_app.algorithms import algorithm
from dpfl.fl_app.builders import ClientSetup, load_client_partition
from dpfl.fl_app.config import client_settings

app = ClientApp()


@app.query(keys.CLIENT_ID_ACTION)
def client_identity(msg: Message, context: Context) -> Message:
    """The server's identity query: the clients this node hosts (num-clients > 0: clients.cohort.hosting), else its
    one client id (node config client-id, else partition-id; clients.identity)."""
    hosted = hosted_clients(context.node_config, client_settings(context.run_config).federation.num_clients)
    return answer_client_id(msg, context) if hosted is None else answer_hosted_clients(hosted, msg)


def install_speed_patches() -> bool:
    """Flower's simulation engine with a message pickup that scales (dpfl_tools.simulation_pickup), where the
    tooling asked for it: SPEED_PATCHES_ENV = 1 in this process's environment, which the launcher sets for runs
    with run-config key 'flower-speed-patches' = true. Flower imports the ClientApp in its simulation process
    before it starts the loop the pickup replaces, so this runs at import; without the variable it imports and
    patches nothing."""
    if os.environ.get(SPEED_PATCHES_ENV) != "1":
        return False
    return speed_patches("simulation_pickup").install()


install_speed_patches()


def partition_of(context: Context) -> tuple[int, int]:
    """(partition-id, num-partitions) from the node config, with a clear error if missing."""
    node = context.node_config
    missing = [k for k in ("partition-id", "num-partitions") if k not in node]
    if missing:
        raise ValueError(
            f"node config lacks {', '.join(missing)}: start the SuperNode with "
            '--node-config "partition-id=<i> num-partitions=<n>"'
        )
    pid, n = int(node["partition-id"]), int(node["num-partitions"])
    if not 0 <= pid < n:
        raise ValueError(
            f"node config partition-id={pid} is out of range: must be in [0, {n - 1}] for num-partitions={n}"
        )
    return pid, n


def build_client(context: Context, model=None) -> NumPyClient:
    """The NumPyClient of the run's algorithm (from the registry) on this node's partition; its model is built
    from the run's seed unless `model` is given (the cohort engine's one module for all its clients)."""
    settings = client_settings(context.run_config)
    pid, n = partition_of(context)
    trainset, testset = load_client_partition(settings, pid, n)
    if model is None:
        shape, classes = trainset.x.shape[1:], trainset.num_classes
        model = build_model(settings.training.model, shape, classes, seed=settings.run.seed)
    algo = algorithm(settings.run.algorithm)  # the run's registry record
    return algo.build_client(ClientSetup(settings, context, pid, trainset, testset, model))


# secure-aggregation = true: SecAgg+ speaks Flower's legacy protocol, so the same NumPyClient answers
# through a client_fn ClientApp under secaggplus_mod (weight 1, no plaintext metrics: uniform_weight_mod).
def numpy_client_fn(context: Context) -> Client:
    return build_client(context).to_client()


secure_app = ClientApp(client_fn=numpy_client_fn, mods=[secaggplus_mod, uniform_weight_mod])


def secure_aggregation(context: Context) -> bool:
    return bool(context.run_config.get(keys.SECURE_AGGREGATION, False))


def train_mods(context: Context) -> list:
    """The run config's client mods on train (`noise-placement = "local"`: the local-DP mod; adaptive clipping
    under distributed noise: the noisy clipped bit)."""
    from dpfl.clients.adaptive_clipping import make_clip_bit_mod
    from dpfl.clients.local_dp import make_local_dp_mod
    from dpfl.dpcore.privacy.calibration import default_client_delta

    s = client_settings(context.run_config)
    privacy, seed = s.privacy, None if s.privacy.secure_rng else s.run.seed
    mods = []
    if privacy.noise_placement == NoisePlacementMode.LOCAL:  # delta 0: min(1e-5, 0.01 / num-partitions)
        delta = privacy.delta or default_client_delta(int(context.node_config.get("num-partitions", 1)))
        mods.append(
            make_local_dp_mod(privacy.clipping_norm, privacy.noise_multiplier, delta, privacy.accountant, seed=seed)
        )
    if s.adaptive_clipping.enabled and privacy.noise_placement == NoisePlacementMode.DISTRIBUTED:
        mods.append(make_clip_bit_mod(seed))
    return mods


def plain_train(msg: Message, context: Context) -> Message:
    return train_reply(build_client(context), msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    one_thread_per_client()
    if secure_aggregation(context):
        return secure_app(msg, context)
    if hosting(msg, context):
        return serve_cohort(
            lambda m, c, done: train_with(plain_train if done is None else as_handler(done), m, c),
            msg,
            context,
            num_clients(context),
            batch=lambda messages, views: batched("train", messages, views),
        )
    return train_with(plain_train, msg, context)


def batched(kind: str, messages: dict[int, Message], views: dict[int, Context]) -> dict:
    """The hosted clients' replies computed as one batched cohort (clients.cohort.batched; imported here, on the
    first hosted message: torch.func), each client's NumPyClient built on one shared module."""
    import torch

    from dpfl.clients.cohort.batched import answer_batched
    from dpfl.clients.cohort.train import trainer

    torch.set_num_threads(node_threads(next(iter(views.values())).node_config))  # the node's grant, not 1
    clients, model = {}, None
    for client, view in views.items():
        clients[client] = build_client(view, model=model)
        model = model or trainer(clients[client]).model
    return answer_batched(kind, messages, clients)


def num_clients(context: Context) -> int:
    return client_settings(context.run_config).federation.num_clients


def hosting(msg: Message, context: Context) -> bool:
    """Whether `msg` is for the clients this node hosts (packed: dpcore.privacy.packing); a node that hosts clients
    refuses a message that is not packed (a ServerApp without node cohorts), which no one of its clients could
    answer."""
    hosted = hosted_clients(context.node_config, num_clients(context))
    if hosted is not None and not is_packed(msg.content):
        raise ValueError(
            f"this node hosts {len(hosted)} clients (run-config key '{keys.NUM_CLIENTS}' = {num_clients(context)}), "
            "and the server sent one client's message: run the project's ServerApp (its grid packs the messages "
            f"of a node's clients, dpfl.strategies.loop.node_cohorts), or set {keys.NUM_CLIENTS} = 0"
        )
    return hosted is not None


def train_with(handler, msg: Message, context: Context) -> Message:
    """`handler` (the NumPyClient's reply; the cohort engine's precomputed one) under the run's train mods."""
    for mod in reversed(train_mods(context)):
        handler = (lambda m, inner: lambda message, ctx: m(message, ctx, inner))(mod, handler)
    return handler(msg, context)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    one_thread_per_client()
    if secure_aggregation(context):
        return secure_app(msg, context)
    if hosting(msg, context):
        return serve_cohort(
            lambda m, c, done: evaluate_reply(build_client(c), m) if done is None else as_handler(done)(m, c),
            msg,
            context,
            num_clients(context),
            batch=lambda messages, views: batched("evaluate", messages, views),
        )
    return evaluate_reply(build_client(context), msg)
