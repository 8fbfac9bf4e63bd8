"""Node cohorts against one client a node, both on Flower's own simulation engine (Ray) under plain `flwr run .`.

    python -m benchmarks.node_cohorts [--clients 50] [--rounds 4] [--supernodes 2] [--busy 0] [-c "key=value ..."]

1. one client a node: `--federation-config "num-supernodes=N client-resources-num-cpus=1"`, num-clients = 0;
2. node cohorts: `num-supernodes=P`, num-clients = N: each SuperNode hosts N / P clients and trains its sampled
   ones as one batched cohort (docs/node-cohorts.md).

The same run config and seed (secure-rng = false) on both, so the two sample the same clients and print the same
epsilon. Seconds per round: the median of rounds 2..R (round 1 pays Ray's start and the first imports), from the
run folder's diagnostics. `--busy K`: K processes spinning on the CPU beside both runs (a busy machine). Both
runs happen in this one invocation, so the ratio compares like with like on a shared machine.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import tempfile
import time
from pathlib import Path

from dpfl.fl_app.results import read_rounds
from dpfl_tools.superlink import flwr_run_simulation, own_simulation_superlink

ROOT = Path(__file__).resolve().parents[1]


def spin() -> None:
    while True:
        pass


def flwr_run(env: dict, out: Path, supernodes: int, config: dict) -> dict:
    """One `flwr run .`: {seconds per steady round, round 1's seconds, epsilon, accuracy, wall seconds}."""
    started = time.perf_counter()
    run = flwr_run_simulation(env, ROOT, {**config, "results-dir": str(out)}, supernodes, timeout=3600)
    if run.returncode != 0:
        raise RuntimeError((run.stdout + run.stderr)[-3000:])
    rounds = read_rounds(out)
    steady = [r["seconds"] for r in rounds[1:]] or [rounds[0]["seconds"]]
    return {
        "round_s": statistics.median(steady),
        "round1_s": rounds[0]["seconds"],
        "epsilon": rounds[-1].get("epsilon"),
        "accuracy": rounds[-1].get("accuracy"),
        "wall_s": time.perf_counter() - started,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--supernodes", type=int, default=2, help="P, the SuperNodes hosting the clients")
    parser.add_argument("--busy", type=int, default=0, help="processes spinning on the CPU beside both runs")
    parser.add_argument("-c", "--config", default="", help="more run-config keys, 'key=value ...'")
    args = parser.parse_args()
    config = {"num-rounds": args.rounds, "secure-rng": False}
    for item in args.config.split():
        key, value = item.split("=", 1)
        config[key] = eval(value, {}, {})  # noqa: S307 - a benchmark's own command line: numbers and quoted strings
    busy = [multiprocessing.Process(target=spin, daemon=True) for _ in range(args.busy)]
    for p in busy:
        p.start()
    try:
        with tempfile.TemporaryDirectory() as tmp, own_simulation_superlink(Path(tmp) / "home") as env:
            single = flwr_run(env, Path(tmp) / "one-a-node", args.clients, {**config, "num-clients": 0})
            cohort = flwr_run(env, Path(tmp) / "cohorts", args.supernodes, {**config, "num-clients": args.clients})
    finally:
        for p in busy:
            p.kill()
    print(f"{args.clients} clients, {args.rounds} rounds, busy processes beside: {args.busy}, config {config}")
    print(f"{'':28} {'s/round':>8} {'round 1 s':>9} {'wall s':>7} {'epsilon':>8} {'accuracy':>8}")
    for name, r in ((f"one client a node ({args.clients})", single), (f"node cohorts ({args.supernodes})", cohort)):
        print(
            f"{name:28} {r['round_s']:8.2f} {r['round1_s']:9.2f} {r['wall_s']:7.1f} {r['epsilon']:8.4f} "
            f"{r['accuracy']:8.4f}"
        )
    print(f"node cohorts / one client a node, seconds per steady round: {cohort['round_s'] / single['round_s']:.2f}x")


if __name__ == "__main__":
    main()
