"""A deployed round against an in-process one, and SecAgg+ against a plain deployed round.

    python -m benchmarks.deployment_round [--nodes 3] [--rounds 3] [--cold]

The default job (dp-fedsam, mnist-embedded, cnn-mnist) on N partitions with every client in every
round (sample-rate 1), the same local steps everywhere:
- in process: `InProcessGrid`, the N clients one after the other in this process;
- deployed: a real flower-superlink and N flower-supernodes on loopback (`dpfl_tools.local_deployment`),
  `flwr run`, with warm ClientApps (`--isolation process` + `dpfl_tools.clientapp_executor`) and, with
  `--cold`, also Flower's default (`--isolation subprocess`: a fresh `flwr-clientapp` per message);
- SecAgg+: the same deployed job with `secure-aggregation = true`;
- both deployed jobs again on `python -m dpfl_tools.supernode --idle-poll 0.2` nodes (Flower's SuperNode with its
  3 s idle sleep capped).
Seconds per round are the medians of the run folders' `seconds` (round start to the round's record).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
import time
from pathlib import Path

from dpfl.fl_app.results import read_diagnostics
from dpfl_tools.local_deployment import Deployment

IDLE_POLL = 0.2  # dpfl_tools.supernode --idle-poll
JOB = {
    "sample-rate": 1.0,
    "noise-multiplier": 0.0,
    "tensorboard": False,
    "flower-speed-patches": True,
}  # sigma 0: 3 clients would diverge


def round_seconds(folder: Path) -> list[float]:
    return [r["seconds"] for r in read_diagnostics(folder)]  # round times are diagnostics


TASK = re.compile(r"ClientApp task pid \d+ exit -?\d+ started ([\d.]+) ended ([\d.]+)")


def clientapp_busy(tasks: list[tuple[float, float]], nodes: int, stages: int) -> list[float]:
    """Per round, the seconds ClientApps cost: for each of its `stages` message exchanges, the longest task of
    the nodes' tasks (fork to exit; tasks in start order, one per node per exchange), summed. The rest of a
    round is waiting: the nodes pick a message up when their polling wakes (Flower's SuperNode sleeps 3 s
    when it finds none), not when it is sent."""
    spans = [max(end - start for start, end in g) for g in (tasks[i : i + nodes] for i in range(0, len(tasks), nodes))]
    return [sum(spans[i : i + stages]) for i in range(0, len(spans) - stages + 1, stages)]


def deployed_round_seconds(
    nodes: int, rounds: int, runs: dict[str, dict], *, warm: bool, idle_poll: float | None = None
) -> dict[str, tuple[list[float], list[float]]]:
    """{name: (seconds of each round, ClientApp busy seconds of each round)} for each run config in `runs`,
    one after the other on one deployment (busy: warm nodes only, from the executors' logs)."""
    out, seen = {}, 0
    with tempfile.TemporaryDirectory(prefix="deploy-bench-") as tmp:
        d = Deployment(Path(tmp))
        try:
            d.start_superlink()
            for i in range(nodes):
                d.start_supernode(f"n{i}", f"partition-id={i} num-partitions={nodes}", warm=warm, idle_poll=idle_poll)
            for i in range(nodes):
                d.wait_connected(f"n{i}")
            for name, overrides in runs.items():
                folder = Path(tmp) / name
                cli = d.run_app(
                    {**JOB, **overrides, "num-rounds": rounds, "min-nodes": nodes, "results-dir": str(folder)}, log=name
                )
                if cli.wait(timeout=1800) != 0 or not (folder / "summary.json").exists():
                    raise SystemExit(f"deployed run {name} failed:\n{d.log(name)[-3000:]}")
                tasks = [(float(a), float(b)) for i in range(nodes) for a, b in TASK.findall(d.log(f"n{i}-executor"))]
                stages = 4 if overrides.get("secure-aggregation") else 1  # SecAgg+: 4 messages per round
                out[name] = (round_seconds(folder), clientapp_busy(sorted(tasks)[seen:], nodes, stages))
                seen = len(tasks)
        finally:
            d.close()
    return out


def inprocess_round_seconds(nodes: int, rounds: int) -> list[float]:
    """The same job on the in-process grid (clients one after the other, one thread)."""
    import torch

    from dpfl.fl_app.client_app import app as client_app
    from dpfl.fl_app.config import validate
    from dpfl.fl_app.server_app import run_federated
    from dpfl_tools.inprocess import InProcessGrid

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = validate({**JOB, "num-rounds": rounds, "results-dir": tmp})
        run_federated(InProcessGrid(client_app, nodes, cfg), cfg)
        return round_seconds(Path(tmp))


def measure(nodes: int, rounds: int, cold: bool) -> dict[str, float]:
    """Median seconds per round: in-process, deployed (warm; cold if asked), deployed with SecAgg+, and both
    again on `dpfl_tools.supernode` nodes (Flower's idle sleeps capped at IDLE_POLL)."""
    t0 = time.perf_counter()
    result = {"inprocess": statistics.median(inprocess_round_seconds(nodes, rounds))}
    warm = deployed_round_seconds(nodes, rounds, {"plain": {}, "secagg": {"secure-aggregation": True}}, warm=True)
    result.update(
        deployed=statistics.median(warm["plain"][0]),
        secagg=statistics.median(warm["secagg"][0]),
        deployed_clientapps_busy=statistics.median(warm["plain"][1]),
        secagg_clientapps_busy=statistics.median(warm["secagg"][1]),
    )
    fast = deployed_round_seconds(
        nodes, rounds, {"plain": {}, "secagg": {"secure-aggregation": True}}, warm=True, idle_poll=IDLE_POLL
    )
    result.update(deployed_fast=statistics.median(fast["plain"][0]), secagg_fast=statistics.median(fast["secagg"][0]))
    if cold:
        plain, _ = deployed_round_seconds(nodes, rounds, {"plain": {}}, warm=False)["plain"]
        result["deployed_cold"] = statistics.median(plain)
    result["wall"] = time.perf_counter() - t0
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cold", action="store_true", help="also Flower's default: a fresh process per message")
    args = parser.parse_args()
    r = measure(args.nodes, args.rounds, args.cold)
    print(json.dumps({k: round(v, 2) for k, v in r.items()}))
    print(
        f"deployed / in-process: {r['deployed'] / r['inprocess']:.2f}x; "
        f"SecAgg+ / plain deployed: {r['secagg'] / r['deployed']:.2f}x"
    )
    print(
        f"with dpfl_tools.supernode --idle-poll {IDLE_POLL}: deployed / in-process {r['deployed_fast'] / r['inprocess']:.2f}x; "
        f"SecAgg+ / plain deployed: {r['secagg_fast'] / r['deployed_fast']:.2f}x"
    )
    if "deployed_cold" in r:
        print(f"cold deployed / in-process: {r['deployed_cold'] / r['inprocess']:.2f}x")


if __name__ == "__main__":
    main()
