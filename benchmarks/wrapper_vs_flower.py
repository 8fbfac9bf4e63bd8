"""Our DP wrapper against Flower's `DifferentialPrivacyServerSideFixedClipping`, both around FedAvg, on the same
job in one process (the drop-in comparison a Flower user makes).

    python -m benchmarks.wrapper_vs_flower [--clients 50] [--rounds 4] [--repeats 2]

The job: the default dataset, partitions and model, every client in every round (q = 1), clients that reply
with their new weights as any Flower client does (our `TrainingClient` trains; no mod), central noise
(the server clips each update to C and adds N(0, sigma^2 C^2) to the sum), C = 0.5, sigma = 1, the same
server evaluation each round. Both on `InProcessGrid`, runs alternated (the machine is shared); the ratio is
the median of the per-round seconds of ours over Flower's. Target: at most 1.0x.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping, FedAvg

from dpcore.task.data import load_dataset
from dpcore.task.torch_helpers import evaluate_model, get_weights, set_weights
from fl_app.client_app import build_client
from fl_app.config import validate
from fl_app.inprocess import InProcessGrid
from fl_app.server_app import build_global_model
from strategies import DifferentialPrivacy

C, SIGMA = 0.5, 1.0
weights_client = ClientApp()


@weights_client.train()
def train(msg: Message, context: Context) -> Message:
    """Local SGD with our TrainingClient; reply with the new weights, unmodified."""
    torch.set_num_threads(1)
    client = build_client(context)
    set_weights(client.model, msg.content["arrays"].to_numpy_ndarrays())
    client.train(dict(msg.content["config"]))
    return Message(RecordDict({"arrays": ArrayRecord(get_weights(client.model)),
                               "metrics": MetricRecord({"num-examples": 1})}), reply_to=msg)


def strategies(clients: int) -> dict:
    return {
        "flower": lambda: DifferentialPrivacyServerSideFixedClipping(
            FedAvg(fraction_evaluate=0.0, min_available_nodes=clients), noise_multiplier=SIGMA, clipping_norm=C,
            num_sampled_clients=clients),
        "ours": lambda: DifferentialPrivacy(FedAvg(fraction_evaluate=0.0), clipping_norm=C, noise_multiplier=SIGMA,
                                            sample_rate=1.0, noise_placement="central", min_available_nodes=clients,
                                            delta=1e-5),
    }


def run(make, cfg: dict, clients: int) -> tuple[list[float], float]:
    """(seconds of rounds 2.., final accuracy) of one run."""
    model = build_global_model(cfg)
    _, testset = load_dataset(cfg["dataset"], cfg["data-dir"])
    marks, accuracies = [], []

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        set_weights(model, arrays.to_numpy_ndarrays())
        loss, accuracy = evaluate_model(model, testset)
        marks.append(time.perf_counter())
        accuracies.append(accuracy)
        return MetricRecord({"accuracy": accuracy, "loss": loss})

    make().start(InProcessGrid(weights_client, clients, cfg), ArrayRecord(get_weights(model)),
                 num_rounds=cfg["num-rounds"], evaluate_fn=evaluate_fn)
    return [b - a for a, b in zip(marks[1:], marks[2:])], accuracies[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    seconds, accuracy = {"flower": [], "ours": []}, {}
    with tempfile.TemporaryDirectory() as tmp:
        cfg = validate({"num-rounds": args.rounds, "sample-rate": 1.0, "results-dir": tmp, "tensorboard": False})
        for repeat in range(args.repeats + 1):  # the first pair pays one-time costs only
            for name, make in strategies(args.clients).items():
                per_round, accuracy[name] = run(make, cfg, args.clients)
                if repeat:
                    seconds[name] += per_round
    for name in seconds:
        print(f"{name:6}  s/round {statistics.median(seconds[name]):.3f}  accuracy {accuracy[name]:.3f}")
    print(f"wrapper / Flower's server-side fixed clipping: "
          f"{statistics.median(seconds['ours']) / statistics.median(seconds['flower']):.2f}x seconds per round")


if __name__ == "__main__":
    main()
