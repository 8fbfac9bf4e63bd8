"""What the benchmarks against Flower's own DP share: a ClientApp that replies with its new weights, as any
Flower client does (our `TrainingClient` trains), and one in-process run of a strategy timed by its server
evaluations."""

from __future__ import annotations

import time

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from dpfl.dpcore.task.data import load_dataset
from dpfl.dpcore.task.torch_helpers import evaluate_model, get_weights, set_weights
from dpfl.fl_app.algorithms import ALGORITHMS
from dpfl.fl_app.client_app import build_client
from dpfl.fl_app.server_app import build_global_model
from dpfl.fl_app.settings import Settings
from dpfl_tools.inprocess import InProcessGrid


def weights_client_app(mods=()) -> ClientApp:
    """Local SGD with our TrainingClient on the node's partition; the reply holds the new weights (and
    num-examples 1, train-loss), with `mods` on train (e.g. Flower's fixedclipping_mod)."""
    app = ClientApp()

    @app.train(mods=list(mods))
    def train(msg: Message, context: Context) -> Message:
        torch.set_num_threads(1)
        client = build_client(context)
        set_weights(client.model, msg.content["arrays"].to_numpy_ndarrays())
        loss, _ = client.train(dict(msg.content["config"]))
        return Message(
            RecordDict(
                {
                    "arrays": ArrayRecord(get_weights(client.model)),
                    "metrics": MetricRecord({"num-examples": 1, "train-loss": loss}),
                }
            ),
            reply_to=msg,
        )

    return app


def timed_run(strategy, cfg: Settings, clients: int, client_app: ClientApp) -> tuple[list[float], list[float]]:
    """(seconds between consecutive server evaluations, i.e. per round after the first; accuracy after each
    round) of `strategy.start` on an in-process grid of `clients` nodes, from the run config's model."""
    model = build_global_model(cfg, ALGORITHMS[cfg.run.algorithm])
    _, testset = load_dataset(cfg.data.dataset, cfg.data.data_dir)
    marks, accuracies = [], []

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        set_weights(model, arrays.to_numpy_ndarrays())
        loss, accuracy = evaluate_model(model, testset)
        marks.append(time.perf_counter())
        accuracies.append(accuracy)
        return MetricRecord({"accuracy": accuracy, "loss": loss})

    strategy.start(
        InProcessGrid(client_app, clients, cfg),
        ArrayRecord(get_weights(model)),
        num_rounds=cfg.run.num_rounds,
        evaluate_fn=evaluate_fn,
    )
    return [b - a for a, b in zip(marks, marks[1:])], accuracies
