"""benchmarks/mf_accuracy.py: its four arms differ only in the noise, the tree's sigma gives the target epsilon
(dp-accounting directly), and its table is the mean and sd of the run folders' summaries."""

import argparse
import json
import statistics

import numpy as np
import pytest

from benchmarks.mf_accuracy import ARMS, launch_args, table
from dpfl.fl_app.config import validate
from dpfl_tools.plan import parse_overrides
from tests.independent_accountant import dp_accounting_epsilons

ARGS = argparse.Namespace(
    data_dir="/data/mnist", clients=200, rounds=50, per_round=20, amplified_bands=5, epsilon=8.0, local_steps=3,
    lr=0.1, results="/tmp/r",
)  # fmt: skip
OWN = {"algorithm", "ftrl-strategy", "ftrl-amplified", "ftrl-epoch-rounds", "client-sampling", "noise-multiplier"}
OWN |= {"target-epsilon", "target-epsilon-mode"}


@pytest.mark.slow
@pytest.mark.parametrize("delta", [1e-5, 1e-10])
def test_the_arms_share_every_setting_but_the_noise_and_the_tree_sigma_gives_the_target(delta, tmp_path):
    configs = {}
    for arm in ARMS:
        argv = launch_args(ARGS, arm, delta, seed=2)
        assert argv[:4] == ["--engine", "inprocess", "--clients", "200"] and argv[-2] == "-c"
        configs[arm] = parse_overrides(argv[-1])
        validate(
            {**configs[arm], "data-dir": str(tmp_path), "min-nodes": 200}
        )  # each arm's config is one the app accepts
    shared = [{k: v for k, v in c.items() if k not in OWN} for c in configs.values()]
    assert all(s == shared[0] for s in shared) and shared[0]["num-rounds"] == 50 and shared[0]["delta"] == delta
    assert shared[0]["seed"] == 2 and shared[0]["local-steps"] == 3 and shared[0]["clipping-norm"] == 0.5
    assert shared[0]["sample-rate"] == pytest.approx(0.1)  # m = 20 expected of 200, for every arm
    tree = configs["dp-ftrl tree"]
    assert "target-epsilon" not in tree and tree["ftrl-strategy"] == "tree"
    # 5 trees of 10 rounds, ceil(log2(11)) = 4 releases each: 20 Gaussian releases at sigma, q = 1
    pld_eps, _ = dp_accounting_epsilons(tree["noise-multiplier"], 1.0, 20, delta)
    assert pld_eps == pytest.approx(8.0, rel=2e-3)
    for arm in ("dp-ftrl blt", "dp-ftrl banded (amplified)", "dp-fedavg (amplified)"):
        assert configs[arm]["target-epsilon"] == 8.0 and configs[arm]["target-epsilon-mode"] == "calibrate"
    assert configs["dp-ftrl banded (amplified)"]["ftrl-amplified"] is True
    assert configs["dp-ftrl banded (amplified)"]["ftrl-epoch-rounds"] == 5  # p = 0.1 x 5 = 0.5 per group
    assert configs["dp-fedavg (amplified)"]["client-sampling"] == "poisson"


def test_the_table_is_the_mean_and_sd_of_the_run_folders_and_the_prefix_noise_of_their_strategy(tmp_path):
    accuracies = [0.91, 0.93, 0.86]
    blt = {"kind": "blt", "buf_decay": [0.5], "output_scale": [0.25]}  # c_0 = 1, c_k = 0.25 0.5^(k-1)
    for seed, acc in zip((3, 1, 2), accuracies):
        run = tmp_path / "dp-ftrl-blt-delta1e-05" / f"run-seed-{seed}"
        run.mkdir(parents=True)
        (run / "config.json").write_text(json.dumps({"seed": seed, "algorithm": "dp-ftrl"}))
        summary = {"final_accuracy": acc, "epsilon": 7.9996, "rounds_completed": 6}
        summary |= {"ledger": {"noise_multiplier": 3.25}, "ftrl": {"strategy": "blt", "coefficients": blt}}
        (run / "summary.json").write_text(json.dumps(summary))
    lines = table(tmp_path, [1e-5]).splitlines()
    (row,) = [line for line in lines if "| dp-ftrl blt |" in line]
    mean, sd = statistics.mean(accuracies), statistics.stdev(accuracies)
    # the prefix sums' noise: sigma x the row norms of A C^-1 (mean and last), C the dense 6 x 6 Toeplitz matrix
    c = np.array([1.0] + [0.25 * 0.5**k for k in range(5)])
    dense = sum(np.diag(np.full(6 - k, c[k]), -k) for k in range(6))
    noise = 3.25 * np.linalg.norm(np.tril(np.ones((6, 6))) @ np.linalg.inv(dense), axis=1)
    assert row == (
        f"| 1e-05 | dp-ftrl blt | {mean:.4f} ± {sd:.4f} | 0.9300, 0.8600, 0.9100 | 8.000 | 3.250 | {noise.mean():.2f} / {noise[-1]:.2f} |"
    )
    assert sum("not run" in line for line in lines) == 3
