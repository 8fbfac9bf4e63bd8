"""The server's own work on a round's train replies, per reply: the DP wrapper's whole `aggregate_train` (decode,
checks, norm bound, sum, noise, ledger), and the decoding alone done two ways, Flower's
`ArrayRecord.to_numpy_ndarrays()` (np.load: a copy of every array) against the reply gate's `reply_arrays`
(views of the bytes that arrived), in one run.

    python -m benchmarks.server_replies [--replies 100] [--models cnn-mnist,resnet18-gn] [--repeats 3]

Every reply is an honest update under distributed noise (clipped to C, plus its noise share), as this project's
clients send it. One thread. The last column is what the copy-free read saves of Flower's decode.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
import numpy as np
import torch
from flwr.app import ArrayRecord, MetricRecord, RecordDict

from benchmarks.mechanisms_bench import timed
from dpfl.dpcore.privacy import protocol as keys
from dpfl.dpcore.task.models import build_model
from dpfl.strategies.dp_fedavg import DPFedAvg
from dpfl.strategies.legacy.adapter import reply_message
from dpfl.strategies.parts.reply_rules import reply_arrays

INPUTS = {"cnn-mnist": (1, 28, 28), "cnn-cifar10": (3, 32, 32), "resnet18-gn": (3, 32, 32)}
C, SIGMA = 1.0, 1.0


def replies(shapes: list[tuple], count: int, noise_shares: float, rng: np.random.Generator) -> list:
    """`count` replies of honest updates: clipped to C plus a noise share of std sigma C / sqrt(n_s). Ten
    distinct contents, each sent by count / 10 nodes (drawing 100 resnet18-gn updates would take a minute)."""
    contents = []
    for _ in range(min(count, 10)):
        update = [rng.standard_normal(s, dtype=np.float32) for s in shapes]
        scale = np.float32(C / np.sqrt(sum(float(np.sum(u * u)) for u in update)))
        noise_std = np.float32(SIGMA * C / np.sqrt(noise_shares))
        arrays = [u * scale + noise_std * rng.standard_normal(u.shape, dtype=np.float32) for u in update]
        metrics = {keys.UPLOAD_KIND: keys.UPLOAD_UPDATE, keys.NUM_EXAMPLES: 64, keys.UPDATE_NORM: 1.0}
        contents.append(RecordDict({"arrays": ArrayRecord(arrays), "metrics": MetricRecord(metrics)}))
    return [reply_message(node + 1, contents[node % len(contents)]) for node in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replies", type=int, default=100)
    parser.add_argument("--models", default="cnn-mnist,resnet18-gn")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("model        parameters  aggregate_train ms/reply  Flower's decode ms/reply  reply_arrays ms/reply  saved")
    for name in args.models.split(","):
        model = build_model(name, INPUTS[name], 10)
        shapes = [tuple(v.shape) for v in model.state_dict().values()]
        strategy = DPFedAvg(sample_rate=1.0, clipping_norm=C, noise_multiplier=SIGMA, noise_placement="distributed")
        strategy.setup_population(args.replies)
        messages = replies(shapes, args.replies, strategy.population.noise_shares, np.random.default_rng(0))
        initial = ArrayRecord([np.zeros(s, np.float32) for s in shapes])
        rounds = iter(range(1, 10**6))

        def aggregate():
            strategy.begin_round(initial)
            _, metrics = strategy.aggregate_train(next(rounds), messages)
            assert metrics["clients"] == args.replies, dict(metrics)

        records = [m.content["arrays"] for m in messages]
        whole, _ = timed(aggregate, args.repeats)
        flower, _ = timed(lambda: [r.to_numpy_ndarrays() for r in records], args.repeats)
        ours, _ = timed(lambda: [reply_arrays(r) for r in records], args.repeats)
        per = 1e3 / args.replies
        print(
            f"{name:12s} {sum(int(np.prod(s)) for s in shapes):>10,}  {whole * per:>24.3f}  {flower * per:>24.3f}"
            f"  {ours * per:>21.3f}  {1 - ours / flower:>5.0%}"
        )


if __name__ == "__main__":
    main()
