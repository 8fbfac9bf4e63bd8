"""Accuracy of DP-FTRL's noises (tree, BLT, amplified banded) against DP-FedAvg with amplification, at equal
epsilon, on full MNIST (docs/dp-toolbox.md, "Matrix-factorization noise", table (b) of issue 42).

    nice -n 10 python -m benchmarks.mf_accuracy --data-dir /path/to/mnist [--clients 200] [--rounds 50]
        [--per-round 20] [--local-steps 3] [--lr 0.1] [--amplified-bands 5] [--epsilon 8] [--deltas 1e-5 1e-10]
        [--seeds 1 2 3]
    python -m benchmarks.mf_accuracy --table RESULTS_DIR     # the table of runs already made

Every run goes through the launcher (`dpfl_tools.launch.main` with `--engine inprocess --clients M -c "..."`, as
`python -m dpfl_tools.launch` takes them). The four arms run side by side, one process each, and an arm's
process makes its runs seed by seed (each seed at every delta): its strategy is optimized once
(`optimize_strategy` is kept per process; a BLT takes minutes), and a sweep cut short holds whole seeds. All
arms: the same M clients (IID partition), n rounds, m expected clients a round, local SGD steps, learning rate,
clipping norm, central noise, evaluation only after the last round, and `target-epsilon-mode = calibrate` (each
arm's ledger sets its own sigma for the target epsilon at each delta; the tree: below):

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
import shlex
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from benchmarks.mf_noise import tree_prefix_norms, tree_row
from dpfl.dpcore.privacy.matrix_factorization import ToeplitzStrategy
from dpfl.strategies.parts.dp_ftrl_mf import prefix_noise_norms

RESULTS = Path("results") / "mf_accuracy"  # git ignores results/
ARMS = {
    "dp-ftrl tree": "algorithm='dp-ftrl' ftrl-strategy='tree'",
    "dp-ftrl blt": "algorithm='dp-ftrl' ftrl-strategy='blt'",
    "dp-ftrl banded (amplified)": "algorithm='dp-ftrl' ftrl-strategy='banded' ftrl-amplified=true",
    "dp-fedavg (amplified)": "algorithm='dp-fedavg' client-sampling='poisson'",
}


def slug(arm: str) -> str:
    return arm.split(" (")[0].replace(" ", "-")


def folder_name(arm: str, delta: float) -> str:
    return f"{slug(arm)}-delta{delta:g}"


def launch_args(args: argparse.Namespace, arm: str, delta: float, seed: int) -> list[str]:
    """The launcher's arguments for one run of `arm` at (delta, seed)."""
    common = (
        f"dataset='mnist' data-dir='{args.data_dir}' partitioner='iid' model='cnn-mnist' num-rounds={args.rounds} "
        f"sample-rate={args.per_round / args.clients:g} local-steps={args.local_steps} batch-size=32 lr={args.lr:g} "
        f"momentum=0.5 clipping-norm=0.5 noise-placement='central' delta={delta:g} eval-every={args.rounds} "
        f"tensorboard=false seed={seed}"
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
    folder = Path(args.results) / folder_name(arm, delta)
    return ["--engine", "inprocess", "--clients", str(args.clients), "--results", str(folder), "-c", f"{common} {own}"]


def run_arm(args: argparse.Namespace, arm: str) -> int:
    """All runs of one arm in this process, seed by seed (each seed at every delta), so that its strategy is
    optimized once (`optimize_strategy` is kept per process) and a sweep cut short has whole seeds."""
    from dpfl_tools.launch import main as launch

    failed = 0
    for seed in args.seeds:
        for delta in args.deltas:
            argv = launch_args(args, arm, delta, seed)
            print("$ python -m dpfl_tools.launch", shlex.join(argv), flush=True)
            failed += launch(argv) != 0
    return failed


def run_arm_process(args: argparse.Namespace, arm: str) -> int:
    """`run_arm` in a process of its own (the arms run side by side), its output in <results>/<arm>.log."""
    log = Path(args.results) / f"{slug(arm)}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    own = [a for a in sys.argv[1:] if a != "--arm"]
    print(f"{arm}: log {log}", flush=True)
    with log.open("w") as out:
        command = [sys.executable, "-m", "benchmarks.mf_accuracy", *own, "--arm", arm]
        return subprocess.run(command, stdout=out, stderr=subprocess.STDOUT).returncode


def read_runs(results: Path, arm: str, delta: float) -> list[dict]:
    """(seed, accuracy, epsilon, sigma) of each completed run folder of (arm, delta)."""
    rows = []
    for summary_file in sorted((results / folder_name(arm, delta)).glob("*/summary.json")):
        summary = json.loads(summary_file.read_text())
        config = json.loads((summary_file.parent / "config.json").read_text())
        ledger = summary.get("ledger") or {}
        sigma = ledger.get("noise_multiplier", summary.get("noise_multiplier"))
        rows.append(
            {
                "seed": config["seed"],
                "accuracy": summary["final_accuracy"],
                "epsilon": summary["epsilon"],
                "sigma": sigma,
                "noise": None if sigma is None else sigma * prefix_norms(summary, config),
            }
        )
    return rows


def prefix_norms(summary: dict, config: dict) -> np.ndarray:
    """The std of the noise in the t-th released prefix sum of clipped updates per unit of sigma, t = 1..n
    (per coordinate, clipping norm 1): sqrt(t) for DP-FedAvg (t independent draws), the tree's sqrt(nodes summed),
    ||row t of A C^-1|| for BLT and banded (their coefficients from summary.json)."""
    n = summary["rounds_completed"]
    if config["algorithm"] == "dp-fedavg":
        return np.sqrt(np.arange(1, n + 1))
    if summary["ftrl"].get("strategy", "tree") == "tree":
        return tree_prefix_norms(n, summary["ftrl"]["epoch_rounds"])
    return prefix_noise_norms(ToeplitzStrategy.from_dict(summary["ftrl"]["coefficients"]), n)


def table(results: Path, deltas: list[float]) -> str:
    lines = [
        "| delta | arm | accuracy, mean ± sd | per seed | epsilon printed | sigma | prefix-sum noise, mean / last |",
        "|---|---|---|---|---|---|---|",
    ]
    for delta in deltas:
        for arm in ARMS:
            rows = sorted(read_runs(results, arm, delta), key=lambda r: r["seed"])
            if not rows:
                lines.append(f"| {delta:g} | {arm} | not run | | | | |")
                continue
            accs = [r["accuracy"] for r in rows]
            sd = statistics.stdev(accs) if len(accs) > 1 else 0.0
            eps = sorted({f"{r['epsilon']:.3f}" for r in rows})
            sig = sorted({f"{r['sigma']:.3f}" for r in rows if r["sigma"] is not None})
            noise = sorted({f"{r['noise'].mean():.2f} / {r['noise'][-1]:.2f}" for r in rows if r["noise"] is not None})
            lines.append(
                f"| {delta:g} | {arm} | {statistics.mean(accs):.4f} ± {sd:.4f} | "
                f"{', '.join(f'{a:.4f}' for a in accs)} | {', '.join(eps)} | {', '.join(sig)} | {', '.join(noise)} |"
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
    parser.add_argument("--local-steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--arm", choices=list(ARMS), help="run this arm's runs in this process (one worker)")
    parser.add_argument("--results", default=str(RESULTS))
    parser.add_argument("--table", metavar="RESULTS_DIR", help="only print the table of the runs in this folder")
    args = parser.parse_args()
    if args.table:
        print(table(Path(args.table), args.deltas))
        return
    if not args.data_dir:
        raise SystemExit("--data-dir (or DPFL_MNIST_DIR): the folder with the four MNIST IDX .gz files")
    if args.arm:
        raise SystemExit(run_arm(args, args.arm))
    with ThreadPoolExecutor(len(ARMS)) as pool:
        codes = dict(zip(ARMS, pool.map(lambda arm: run_arm_process(args, arm), ARMS)))
    for arm, code in codes.items():
        if code:
            print(f"{arm}: {code} runs failed (see its log beside the run folders)")
    print(table(Path(args.results), args.deltas))


if __name__ == "__main__":
    main()
