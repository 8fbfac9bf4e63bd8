"""Accuracy of DP-FTRL's noises (tree, BLT, amplified banded) against DP-FedAvg with amplification, at equal
epsilon, on full MNIST (docs/dp-toolbox.md, "Matrix-factorization noise", table (b) of issue 42).

    nice -n 10 python -m benchmarks.mf_accuracy --data-dir /path/to/mnist [--clients 200] [--rounds 50]
        [--per-round 20] [--amplified-bands 5] [--epsilon 8] [--deltas 1e-5 1e-10] [--seeds 1 2 3] [--jobs 2]
    python -m benchmarks.mf_accuracy --table RESULTS_DIR     # the table of runs already made

Every run goes through the launcher, `python -m dpfl_tools.launch --engine inprocess --clients M --sweep
seed=1,2,3 -c "..."`, one launcher per (arm, delta), so its runs share one strategy optimization
(`optimize_strategy` is kept per process). All arms: the same M clients (IID partition), n rounds, m expected
clients a round, one local epoch of SGD, clipping norm, central noise, and `target-epsilon-mode = calibrate`
(each arm's ledger sets its own sigma for the target epsilon at each delta; the tree: below):

- dp-ftrl tree: epochs of b = M / m rounds, each node once per epoch (one tree per epoch); the product calibrates
  no tree, so sigma is `benchmarks.mf_noise.tree_row`'s: the multiplier whose equivalent Gaussian (sum_j
  ceil(log2(b + 1)) releases, the bound the tree's ledger prints) gives the target epsilon;
- dp-ftrl blt: min separation b = M / m, at most k = n / b rounds per node, BLT optimized by jax-privacy;
- dp-ftrl banded, amplified: cyclic Poisson sampling over `--amplified-bands` groups (b bands), each node of the
  round's group sampled with p = m b / M;
- dp-fedavg: Poisson client sampling at q = m / M, amplified accounting.

Reported: mean +- sd over the seeds of the final test accuracy (10,000 digits), the epsilon each run printed and
its sigma. Writes the run folders and the launchers' logs under --results (default results/mf_accuracy).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.mf_noise import tree_row

RESULTS = Path("results") / "mf_accuracy"  # git ignores results/
ARMS = {
    "dp-ftrl tree": "algorithm='dp-ftrl' ftrl-strategy='tree'",
    "dp-ftrl blt": "algorithm='dp-ftrl' ftrl-strategy='blt'",
    "dp-ftrl banded (amplified)": "algorithm='dp-ftrl' ftrl-strategy='banded' ftrl-amplified=true",
    "dp-fedavg (amplified)": "algorithm='dp-fedavg' client-sampling='poisson'",
}


def folder_name(arm: str, delta: float) -> str:
    return f"{arm.split(' (')[0].replace(' ', '-')}-delta{delta:g}"


def launch_command(args: argparse.Namespace, arm: str, delta: float) -> list[str]:
    """The launcher call of one (arm, delta): its seeds as a sweep."""
    common = (
        f"dataset='mnist' data-dir='{args.data_dir}' partitioner='iid' model='cnn-mnist' num-rounds={args.rounds} "
        f"sample-rate={args.per_round / args.clients:g} local-epochs=1 batch-size=32 lr=0.05 momentum=0.5 "
        f"clipping-norm=0.5 noise-placement='central' delta={delta:g} eval-every={args.eval_every} tensorboard=false"
    )
    own = ARMS[arm]
    if "'tree'" in own:  # the tree's noise is not calibrated by the product: sigma of its equivalent Gaussian
        own += (
            f" noise-multiplier={tree_row(args.rounds, args.clients // args.per_round, args.epsilon, delta)['sigma']}"
        )
    else:
        own += f" target-epsilon={args.epsilon:g} target-epsilon-mode='calibrate'"
    if "amplified=true" in own:
        own += f" ftrl-epoch-rounds={args.amplified_bands}"
    return [
        sys.executable,
        "-m",
        "dpfl_tools.launch",
        "--engine",
        "inprocess",
        "--clients",
        str(args.clients),
        "--results",
        str(Path(args.results) / folder_name(arm, delta)),
        "--sweep",
        "seed=" + ",".join(map(str, args.seeds)),
        "-c",
        f"{common} {own}",
    ]


def run_one(args: argparse.Namespace, arm: str, delta: float) -> int:
    command = launch_command(args, arm, delta)
    log = Path(args.results) / f"{folder_name(arm, delta)}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    print("$", " ".join(command), f"> {log}", flush=True)
    with log.open("w") as out:
        return subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ}).returncode


def read_runs(results: Path, arm: str, delta: float) -> list[dict]:
    """(seed, accuracy, epsilon, sigma) of each completed run folder of (arm, delta)."""
    rows = []
    for summary_file in sorted((results / folder_name(arm, delta)).glob("*/summary.json")):
        summary = json.loads(summary_file.read_text())
        config = json.loads((summary_file.parent / "config.json").read_text())
        ledger = summary.get("ledger") or {}
        rows.append(
            {
                "seed": config["seed"],
                "accuracy": summary["final_accuracy"],
                "epsilon": summary["epsilon"],
                "sigma": ledger.get("noise_multiplier", summary.get("noise_multiplier")),
            }
        )
    return rows


def table(results: Path, deltas: list[float]) -> str:
    lines = [
        "| delta | arm | accuracy, mean ± sd | per seed | epsilon printed | sigma |",
        "|---|---|---|---|---|---|",
    ]
    for delta in deltas:
        for arm in ARMS:
            rows = sorted(read_runs(results, arm, delta), key=lambda r: r["seed"])
            if not rows:
                lines.append(f"| {delta:g} | {arm} | not run | | | |")
                continue
            accs = [r["accuracy"] for r in rows]
            sd = statistics.stdev(accs) if len(accs) > 1 else 0.0
            eps = sorted({f"{r['epsilon']:.3f}" for r in rows})
            sig = sorted({f"{r['sigma']:.3f}" for r in rows if r["sigma"] is not None})
            lines.append(
                f"| {delta:g} | {arm} | {statistics.mean(accs):.4f} ± {sd:.4f} | "
                f"{', '.join(f'{a:.4f}' for a in accs)} | {', '.join(eps)} | {', '.join(sig)} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", default=os.environ.get("DPFL_MNIST_DIR", ""), help="the four MNIST IDX .gz")
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--per-round", type=int, default=20, help="m: expected clients a round (b = M / m)")
    parser.add_argument("--amplified-bands", type=int, default=5, help="bands and groups of the amplified banded")
    parser.add_argument("--epsilon", type=float, default=8.0)
    parser.add_argument("--deltas", type=float, nargs="+", default=[1e-5, 1e-10])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--jobs", type=int, default=2, help="launchers at once")
    parser.add_argument("--results", default=str(RESULTS))
    parser.add_argument("--table", metavar="RESULTS_DIR", help="only print the table of the runs in this folder")
    args = parser.parse_args()
    if args.table:
        print(table(Path(args.table), args.deltas))
        return
    if not args.data_dir:
        raise SystemExit("--data-dir (or DPFL_MNIST_DIR): the folder with the four MNIST IDX .gz files")
    jobs = [(arm, delta) for arm in ARMS for delta in args.deltas]
    with ThreadPoolExecutor(args.jobs) as pool:
        codes = list(pool.map(lambda job: run_one(args, *job), jobs))
    for (arm, delta), code in zip(jobs, codes):
        if code:
            print(f"{arm} at delta {delta:g}: the launcher exited {code} (its log is beside the run folders)")
    print(table(Path(args.results), args.deltas))


if __name__ == "__main__":
    main()
