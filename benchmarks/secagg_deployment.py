"""SecAgg+ on a real deployment: the same run with and without secure aggregation.

    python -m benchmarks.secagg_deployment [--nodes 3] [--rounds 2]

Starts a SuperLink and N SuperNodes on loopback (ports 19000-19999, private FLWR_HOME, all
ended by PID at the end), runs the app twice with `flwr run` (secure-aggregation true / false,
otherwise identical), and prints accuracy, both epsilons and seconds per round of each, and
the ratios. Same seed, same clients, same noise: the runs differ only by SecAgg+ quantization.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from dpfl.fl_app.results import read_rounds, read_summary
from dpfl_tools.local_deployment import Deployment

RUN = {
    "dataset": "digits",
    "model": "mlp",
    "partitioner": "iid",
    "sample-rate": 1.0,
    "local-epochs": 1,
    "flower-speed-patches": True,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="secagg-bench-") as tmp:
        d = Deployment(Path(tmp))
        try:
            d.start_superlink()
            for i in range(args.nodes):
                d.start_supernode(f"n{i}", f"partition-id={i} num-partitions={args.nodes}")
            for i in range(args.nodes):
                d.wait_connected(f"n{i}")
            results = {}
            for secure in (True, False):
                folder = Path(tmp) / f"secure-{secure}"
                t0 = time.perf_counter()
                cli = d.run_app(
                    {
                        **RUN,
                        "num-rounds": args.rounds,
                        "min-nodes": args.nodes,
                        "secure-aggregation": secure,
                        "results-dir": str(folder),
                    },
                    log=f"cli-{secure}",
                )
                if cli.wait(timeout=3600) != 0 or not (folder / "summary.json").exists():
                    raise SystemExit(f"run failed:\n{d.log(f'cli-{secure}')[-3000:]}")
                summary, rounds = read_summary(folder), read_rounds(folder)  # with the diagnostics
                results[secure] = (summary, rounds, time.perf_counter() - t0)
        finally:
            d.close()
    for secure, (s, rounds, wall) in results.items():
        per_round = sum(r["seconds"] for r in rounds) / len(rounds)
        print(
            f"secure-aggregation={str(secure).lower():5}  accuracy={s['final_accuracy']:.4f}  "
            f"epsilon={s['epsilon']:.4f}  epsilon_against_server={s['epsilon_against_server']:.4f}  "
            f"seconds/round={per_round:.1f}  wall={wall:.0f}s"
        )
    (on, on_rounds, _), (off, off_rounds, _) = results[True], results[False]
    max_loss_gap = max(abs(a["loss"] - b["loss"]) for a, b in zip(on_rounds, off_rounds))
    print(
        f"accuracy difference: {abs(on['final_accuracy'] - off['final_accuracy']):.4f}; "
        f"largest per-round loss difference: {max_loss_gap:.2e}"
    )
    print(
        f"epsilon against the server, without / with SecAgg+: "
        f"{off['epsilon_against_server'] / on['epsilon_against_server']:.1f}x"
    )
    print(
        f"time per round, with / without SecAgg+: "
        f"{sum(r['seconds'] for r in on_rounds) / sum(r['seconds'] for r in off_rounds):.1f}x"
    )
    print("SecAgg+ settings:", json.dumps(on["secagg"]))


if __name__ == "__main__":
    main()
