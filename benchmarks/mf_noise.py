"""The noise error of DP-FTRL's released prefix sums: tree, BLT and banded Toeplitz at the same epsilon and delta
(docs/dp-toolbox.md §4, "Matrix-factorization noise: measured").

    python -m benchmarks.mf_noise [--rounds 100 500 2000] [--min-sep 10] [--epsilon 8] [--delta 1e-5]

For n rounds and participation separated by b rounds (k = n / b rounds per node), each noise gets the sigma that
makes the ledger's epsilon equal the target:

- tree: one tree per epoch of b rounds, n / b trees; sigma from `calibrate_noise_multiplier` on the equivalent
  Gaussian, sum_j ceil(log2(b + 1)) releases at q = 1 (the bound `TreeAggregationLedger` prints); the t-th prefix
  sum's noise has std sigma sqrt(nodes summed: popcount(b) per completed epoch + popcount of the epoch's step);
- blt, banded: the strategy jax-privacy optimizes for (n, b, k) (`optimize_strategy`: up to 6 BLT buffers; b bands),
  sigma = sens x the Gaussian multiplier of the target (`MatrixFactorizationFTRL.calibrated_noise_multiplier`);
  the t-th prefix sum's noise has std sigma ||row t of A C^-1|| (`prefix_noise_norms`).

Reported per n (clipping norm 1, per coordinate): the max and the mean over rounds of that std, exactly (no
sampling), the sensitivity and sigma of each, and the seconds the strategy took to optimize. Writes
benchmarks/output/mf_noise.json.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np

from dpfl.dpcore.privacy.calibration import calibrate_noise_multiplier
from dpfl.dpcore.privacy.ledger import TreeAggregationLedger
from dpfl.dpcore.privacy.matrix_factorization import MatrixFactorizationLedger, optimize_strategy
from dpfl.dpcore.privacy.tree_aggregation import nodes_in_prefix, tree_depth
from dpfl.strategies.parts.dp_ftrl_mf import prefix_noise_norms

OUTPUT = Path(__file__).parent / "output" / "mf_noise.json"


def tree_prefix_norms(n: int, min_sep: int) -> np.ndarray:
    """The t-th prefix sum's noise std per unit of sigma, t = 1..n: sqrt(tree nodes summed), popcount(b) per
    completed epoch of b rounds and popcount of the epoch's step."""
    steps = np.arange(n)
    nodes = (steps // min_sep) * nodes_in_prefix(min_sep) + np.array([nodes_in_prefix(s % min_sep + 1) for s in steps])
    return np.sqrt(nodes)


def tree_row(n: int, min_sep: int, epsilon: float, delta: float) -> dict:
    """The tree's sigma for the target and its prefix-sum noise std per round."""
    trees = math.ceil(n / min_sep)
    sigma = calibrate_noise_multiplier(epsilon, delta, 1.0, trees * tree_depth(min_sep))
    ledger = TreeAggregationLedger(delta, epoch_rounds=min_sep)
    for _ in range(n):
        ledger.record_round(sigma)
    stds = sigma * tree_prefix_norms(n, min_sep)
    return {"sigma": sigma, "sensitivity": None, "epsilon": ledger.epsilon(), "stds": stds, "seconds": 0.0}


def mf_row(kind: str, n: int, min_sep: int, epsilon: float, delta: float) -> dict:
    """The optimized strategy's sigma for the target and its prefix-sum noise std per round."""
    k = math.ceil(n / min_sep)
    started = time.perf_counter()
    strategy = optimize_strategy(kind, n, min_sep, k)
    seconds = time.perf_counter() - started
    ledger = MatrixFactorizationLedger(delta, strategy=strategy.as_dict(), min_sep=min_sep, max_participations=k)
    sigma = calibrate_noise_multiplier(epsilon, delta, 1.0, 1) * ledger.sensitivity(n)
    for _ in range(n):
        ledger.record_round(sigma)
    stds = sigma * prefix_noise_norms(strategy, n)
    return {
        "sigma": sigma,
        "sensitivity": ledger.sensitivity(n),
        "epsilon": ledger.epsilon(),
        "stds": stds,
        "seconds": seconds,
        "strategy": strategy.as_dict(),
    }


def measure(n: int, min_sep: int, epsilon: float, delta: float, kinds=("tree", "blt", "banded")) -> dict:
    rows = {}
    for kind in kinds:
        row = tree_row(n, min_sep, epsilon, delta) if kind == "tree" else mf_row(kind, n, min_sep, epsilon, delta)
        stds = row.pop("stds")
        rows[kind] = {**row, "max_std": float(stds.max()), "mean_std": float(stds.mean())}
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, nargs="+", default=[100, 500, 2000])
    parser.add_argument("--min-sep", type=int, default=10)
    parser.add_argument("--epsilon", type=float, default=8.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    args = parser.parse_args()
    results = {}
    print("| n | noise | max std | mean std | sigma | sensitivity | epsilon | optimized in |")
    print("|---|---|---|---|---|---|---|---|")
    for n in args.rounds:
        results[n] = measure(n, args.min_sep, args.epsilon, args.delta)
        for kind, r in results[n].items():
            sens = "" if r["sensitivity"] is None else f"{r['sensitivity']:.3f}"
            print(
                f"| {n} | {kind} | {r['max_std']:.2f} | {r['mean_std']:.2f} | {r['sigma']:.3f} | {sens} | "
                f"{r['epsilon']:.3f} | {r['seconds']:.0f} s |",
                flush=True,
            )
    OUTPUT.parent.mkdir(exist_ok=True)
    OUTPUT.write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
