"""ClientApp: node config + run config -> NumPyClient -> train / evaluate replies."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from flwr.app import Context, Message
from flwr.client import Client, NumPyClient
from flwr.client.mod import secaggplus_mod
from flwr.clientapp import ClientApp

from clients.adapter import evaluate_reply, train_reply
from clients.base import TrainingClient
from clients.dpsgd import DPSGDClient
from clients.mods import uniform_weight_mod
from clients.personalized import (
    ContextHeadStore,
    DP2FedSAMClient,
    FileHeadStore,
    FineTuneClient,
    HeadStore,
    PartialSharingClient,
)
from clients.sam import SAMClient
from clients.topk import TopKSAMClient
from fl_app.config import FINE_TUNED, PARTIAL_SHARING, validate
from fl_app.task.data import load_partition
from fl_app.task.models import build_model, split_state_keys
from fl_app.privacy.dpsgd_noise import DEFAULT_SAMPLE_DELTA

app = ClientApp()


def partition_of(context: Context) -> tuple[int, int]:
    """(partition-id, num-partitions) from the node config, with a clear error if missing."""
    node = context.node_config
    missing = [k for k in ("partition-id", "num-partitions") if k not in node]
    if missing:
        raise ValueError(f"node config lacks {', '.join(missing)}: start the SuperNode with "
                         "--node-config \"partition-id=<i> num-partitions=<n>\"")
    pid, n = int(node["partition-id"]), int(node["num-partitions"])
    if not 0 <= pid < n:
        raise ValueError(f"node config partition-id={pid} is out of range: must be in [0, {n - 1}] "
                         f"for num-partitions={n}")
    return pid, n


def head_store(context: Context, partition_id: int) -> HeadStore:
    """Where this node keeps its personal head: a file under node config `state-dir` (a deployment),
    else Context.state (simulation, where Context.state lives as long as the run)."""
    state_dir = context.node_config.get("state-dir")
    if state_dir is None:
        return ContextHeadStore(context.state)
    if not os.path.isabs(os.path.expanduser(str(state_dir))):
        raise ValueError(f"node config state-dir={state_dir!r} must be an absolute folder path")
    return FileHeadStore(Path(os.path.expanduser(str(state_dir)))
                         / f"personal-head-run{context.run_id}-partition{partition_id}.npz")


def build_client(context: Context) -> NumPyClient:
    cfg = validate(context.run_config)
    pid, n = partition_of(context)
    trainset, testset = load_partition(cfg["dataset"], pid, n, cfg["partitioner"],
                                       alpha=cfg["dirichlet-alpha"], classes_per_client=cfg["classes-per-client"],
                                       seed=cfg["seed"], data_dir=cfg["data-dir"])
    model = build_model(cfg["model"], trainset.x.shape[1:], trainset.num_classes, seed=cfg["seed"])
    kwargs = dict(batch_size=cfg["batch-size"], lr=cfg["lr"], momentum=cfg["momentum"],
                  weight_decay=cfg["weight-decay"], local_epochs=cfg["local-epochs"],
                  local_steps=cfg["local-steps"], partition_id=pid, seed=cfg["seed"],
                  secure_rng=cfg["secure-rng"], lr_decay=cfg["lr-decay"])
    algorithm = cfg["algorithm"]
    if algorithm == "ali-dpfl":
        return DPSGDClient(model, trainset, testset, state=context.state, sample_rate=cfg["batch-sample-rate"],
                           noise_multiplier=cfg["sample-noise-multiplier"],
                           clipping_norm=cfg["sample-clipping-norm"], target_epsilon=cfg["target-epsilon"],
                           delta=cfg["delta"] or DEFAULT_SAMPLE_DELTA, accountant=cfg["accountant"],
                           grad_sample_mode=cfg["grad-sample-mode"], mu_max=cfg["mu-max"],
                           mu_noise_multiplier=cfg["mu-noise-multiplier"], noise=cfg["dpsgd-noise"],
                           wavelet_calibration=cfg["wavelet-calibration"], **kwargs)
    if algorithm in PARTIAL_SHARING:
        _, head_keys = split_state_keys(model, cfg["head-prefix"])
        personal = dict(head_keys=head_keys, head_store=head_store(context, pid), head_epochs=cfg["head-epochs"],
                        head_steps=cfg["head-steps"], head_lr=cfg["head-lr"] or cfg["lr"])
        if algorithm == "dp2-fedsam":
            return DP2FedSAMClient(model, trainset, testset, rho=cfg["sam-rho"], **personal, **kwargs)
        return PartialSharingClient(model, trainset, testset, **personal, **kwargs)
    if algorithm == "dp-fedsam-topk":
        return TopKSAMClient(model, trainset, testset, rho=cfg["sam-rho"], **kwargs)
    if algorithm in ("dp-fedsam", "dp-fedsam-ft"):
        client = SAMClient(model, trainset, testset, rho=cfg["sam-rho"], **kwargs)
    else:
        client = TrainingClient(model, trainset, testset, **kwargs)
    return FineTuneClient(client, cfg["fine-tune-steps"]) if algorithm in FINE_TUNED else client


# secure-aggregation = true: SecAgg+ speaks Flower's legacy protocol, so the same NumPyClient answers
# through a client_fn ClientApp under secaggplus_mod (weight 1, no plaintext metrics: uniform_weight_mod).
def numpy_client_fn(context: Context) -> Client:
    return build_client(context).to_client()


secure_app = ClientApp(client_fn=numpy_client_fn, mods=[secaggplus_mod, uniform_weight_mod])


def secure_aggregation(context: Context) -> bool:
    return bool(context.run_config.get("secure-aggregation", False))


@app.train()
def train(msg: Message, context: Context) -> Message:
    torch.set_num_threads(1)  # one simulated client per CPU
    if secure_aggregation(context):
        return secure_app(msg, context)
    return train_reply(build_client(context), msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    torch.set_num_threads(1)
    if secure_aggregation(context):
        return secure_app(msg, context)
    return evaluate_reply(build_client(context), msg)
