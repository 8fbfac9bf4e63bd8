"""Seconds to bring a worker's replies to the ProcessGrid's process: through the pipe, and with their arrays in
shared memory (dpfl_tools/shared_arrays.py: the worker's block kept across rounds), in one run.

    python -m benchmarks.reply_transfer [--replies 10] [--parameters 11200000] [--repeats 3]

A spawned worker builds --replies train replies of --parameters float32 values each (resnet18-gn's 11.2 M by
default: 45 MB a reply) and sends them --repeats times each way; the line per way gives each repeat's seconds,
from the worker's start of sending (its replies built) to the replies decoded in this process, and the last line
the ratio of the medians.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time


def task_identity() -> None:
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1


def worker(conn, replies: int, parameters: int) -> None:
    """Answer each request ("pipe" or "shared") with fresh replies, sent that way."""
    import numpy as np
    from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

    from dpfl_tools.shared_arrays import ReplyBlock

    task_identity()
    rng = np.random.default_rng(0)
    block = ReplyBlock()
    while (way := conn.recv()) is not None:
        msgs = [
            Message(
                RecordDict(
                    {
                        "arrays": ArrayRecord(
                            [rng.standard_normal(parameters // 8, dtype=np.float32) for _ in range(8)]
                        ),
                        "metrics": MetricRecord({"num-examples": 64}),
                    }
                ),
                dst_node_id=1,
                message_type="train",
            )
            for _ in range(replies)
        ]
        conn.send("built")
        conn.recv()  # go: the timed part starts here
        conn.send(block.pack(msgs) if way == "shared" else (msgs, None, []))
    block.close(unlink=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replies", type=int, default=10)
    parser.add_argument("--parameters", type=int, default=11_200_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    from dpfl_tools.shared_arrays import ReplyBlock

    task_identity()
    spawn = multiprocessing.get_context("spawn")
    mine, theirs = spawn.Pipe()
    proc = spawn.Process(target=worker, args=(theirs, args.replies, args.parameters), daemon=True)
    proc.start()
    seconds: dict[str, list[float]] = {"pipe": [], "shared": []}
    block = ReplyBlock()
    for _ in range(args.repeats):
        for way in seconds:
            mine.send(way)
            mine.recv()  # built
            started = time.perf_counter()
            mine.send("go")
            replies = block.unpack(*mine.recv())
            replies[-1].content["arrays"].to_numpy_ndarrays()  # the last array decodes: all bytes are here
            seconds[way].append(time.perf_counter() - started)
    mine.send(None)
    proc.join()
    block.close(unlink=False)
    mb = args.replies * args.parameters * 4 / 1e6
    for way, times in seconds.items():
        print(f"{way}: {args.replies} replies ({mb:.0f} MB): " + ", ".join(f"{t:.3f} s" for t in times))
    ratio = statistics.median(seconds["shared"]) / statistics.median(seconds["pipe"])
    print(f"shared memory / pipe = {ratio:.2f}x")


if __name__ == "__main__":
    main()
