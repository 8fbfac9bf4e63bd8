"""A ClientApp whose clients make a chosen update instead of training (for strategy tests)."""

from __future__ import annotations

import numpy as np
import torch
from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from torch import nn

from dpfl.clients.adapter import train_reply
from dpfl.clients.base import TrainingClient
from dpfl.dpcore.privacy.mechanisms import flatten, unflatten
from dpfl.dpcore.task.torch_helpers import get_weights, set_weights


class FixedUpdateClient(TrainingClient):
    """'Training' adds update_fn(partition_id, round) to the weights; the rest is the real client."""

    def __init__(self, model, partition_id, update_fn):
        empty = type(
            "D", (), {"x": np.zeros((0, 1), np.float32), "y": np.zeros(0, np.int64), "__len__": lambda self: 1}
        )()
        super().__init__(model, empty, empty, partition_id=partition_id, seed=0)
        self.update_fn = update_fn

    def train(self, config):
        w = get_weights(self.model)
        delta = self.update_fn(self.partition_id, int(config["server-round"]), flatten(w).size)
        set_weights(self.model, unflatten(flatten(w) + delta, [a.shape for a in w]))
        return 0.0, 1


def stub_app(update_fn, dim_in=1000, dim_out=100) -> ClientApp:
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        torch.manual_seed(0)
        client = FixedUpdateClient(nn.Linear(dim_in, dim_out), int(context.node_config["partition-id"]), update_fn)
        return train_reply(client, msg)

    return app


def zero_update(pid, rnd, size):
    return np.zeros(size, np.float32)
