"""ClientApp: node config + run config -> NumPyClient -> train / evaluate replies."""

from __future__ import annotations

import torch
from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from clients.adapter import evaluate_reply, train_reply
from clients.base import TrainingClient
from clients.dpsgd import DPSGDClient
from clients.sam import SAMClient
from fl_app.config import validate
from fl_app.data import load_partition
from fl_app.models import build_model
from strategies.ali_dpfl import DEFAULT_SAMPLE_DELTA

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


def build_client(context: Context) -> TrainingClient:
    cfg = validate(context.run_config)
    pid, n = partition_of(context)
    trainset, testset = load_partition(cfg["dataset"], pid, n, cfg["partitioner"],
                                       alpha=cfg["dirichlet-alpha"], classes_per_client=cfg["classes-per-client"],
                                       seed=cfg["seed"], data_dir=cfg["data-dir"])
    model = build_model(cfg["model"], trainset.x.shape[1:], trainset.num_classes, seed=cfg["seed"])
    kwargs = dict(batch_size=cfg["batch-size"], lr=cfg["lr"], momentum=cfg["momentum"],
                  weight_decay=cfg["weight-decay"], local_epochs=cfg["local-epochs"],
                  local_steps=cfg["local-steps"], partition_id=pid, seed=cfg["seed"],
                  secure_rng=cfg["secure-rng"])
    if cfg["algorithm"] == "ali-dpfl":
        return DPSGDClient(model, trainset, testset, state=context.state, sample_rate=cfg["batch-sample-rate"],
                           noise_multiplier=cfg["sample-noise-multiplier"],
                           clipping_norm=cfg["sample-clipping-norm"], target_epsilon=cfg["target-epsilon"],
                           delta=cfg["delta"] or DEFAULT_SAMPLE_DELTA, accountant=cfg["accountant"],
                           grad_sample_mode=cfg["grad-sample-mode"], mu_max=cfg["mu-max"],
                           mu_noise_multiplier=cfg["mu-noise-multiplier"], noise=cfg["dpsgd-noise"],
                           wavelet_calibration=cfg["wavelet-calibration"], **kwargs)
    if cfg["algorithm"] == "dp-fedsam":
        return SAMClient(model, trainset, testset, rho=cfg["sam-rho"], **kwargs)
    return TrainingClient(model, trainset, testset, **kwargs)


@app.train()
def train(msg: Message, context: Context) -> Message:
    torch.set_num_threads(1)  # one simulated client per CPU
    return train_reply(build_client(context), msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    torch.set_num_threads(1)
    return evaluate_reply(build_client(context), msg)
