"""DP-FedAvg-WAV: the epsilon the paper claims against the one it has, and the accuracy of
`exact` calibration against plain DP-FedAvg at the same epsilon.

    python -m benchmarks.wavelet_vs_dpfedavg [--rounds 30] [--clients 50] [--seeds 42]
    python -m benchmarks.wavelet_vs_dpfedavg --epsilon-only

Part 1 (seconds): the paper's client-level setting (noise scales 1, 1.5, 3; 300 rounds;
delta 1e-5; 100 clients; q = 0.1 assumed, the paper does not state it) for a 1024-vector
and for the cnn-mnist model (26,010 parameters -> n = 32,768): epsilon at sigma_H (what the
paper's analysis gives) and at sigma_H / sqrt(n) (what the mechanism has). Every epsilon
comes from the project's ledger (Opacus RDP).

Part 2 (minutes): in-process federated runs on mnist-embedded (M clients, Poisson q = 0.5,
sigma = 1.0, C = 0.5, central noise, the other keys at their defaults): dp-fedavg,
dp-fedavg-wav `exact` (same sigma, so the same epsilon), dp-fedavg-wav `paper`
(its claimed and true epsilon), and the non-private reference.
"""

from __future__ import annotations

import argparse
import logging
import math
import tempfile
import warnings
from pathlib import Path

import torch

from dpfl.dpcore.privacy.ledger import PrivacyLedger
from dpfl.dpcore.privacy.mechanisms import haar_padded_size


def pld_epsilon(sigma: float, q: float, rounds: int, delta: float) -> float:
    """Cross-check with Google's dp-accounting PLD accountant (a test dependency); nan if absent."""
    try:
        import dp_accounting
        from dp_accounting import pld
    except ImportError:
        return math.nan
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), rounds
    )
    accountant = pld.PLDAccountant(value_discretization_interval=1e-1 if sigma < 0.1 else 1e-3)
    accountant.compose(event)
    return accountant.get_epsilon(delta)


def epsilon_table() -> None:
    print("Paper's client-level setting: T = 300 rounds, q = 0.1 (assumed), delta = 1e-5.")
    print("eps: the project's ledger (Opacus RDP); PLD: dp-accounting's PLD accountant as a cross-check")
    print(
        f"{'model size d':>12} {'n':>7} {'sigma_H':>7} {'claimed eps':>11} {'(PLD)':>7} {'sigma_eff':>9} "
        f"{'true eps':>10} {'(PLD)':>9}"
    )
    for d in (1024, 26010):
        n = haar_padded_size(d)
        for sigma in (1.0, 1.5, 3.0):
            ledger = PrivacyLedger(1e-5, "rdp")
            sigma_eff = sigma / math.sqrt(n)
            claimed = ledger.epsilon_after(sigma, 0.1, 300)
            true = ledger.epsilon_after(sigma_eff, 0.1, 300)
            print(
                f"{d:>12,} {n:>7,} {sigma:>7.2f} {claimed:>11.3f} {pld_epsilon(sigma, 0.1, 300, 1e-5):>7.3f} "
                f"{sigma_eff:>9.4f} {true:>10.4g} {pld_epsilon(sigma_eff, 0.1, 300, 1e-5):>9.3g}",
                flush=True,
            )


RUNS = [
    ("dp-fedavg", {"algorithm": "dp-fedavg"}),
    ("dp-fedavg-wav exact", {"algorithm": "dp-fedavg-wav", "wavelet-calibration": "exact"}),
    ("dp-fedavg-wav paper", {"algorithm": "dp-fedavg-wav", "wavelet-calibration": "paper"}),
    ("non-private", {"algorithm": "dp-fedavg", "noise-multiplier": 0.0, "clipping-norm": 0.0}),
]


def accuracy_runs(rounds: int, clients: int, seeds: list[int]) -> None:
    from dpfl.fl_app.client_app import app as client_app
    from dpfl.fl_app.config import validate
    from dpfl.fl_app.server_app import run_federated
    from dpfl_tools.inprocess import InProcessGrid

    logging.getLogger("flwr").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    print(
        f"\nmnist-embedded, cnn-mnist, {clients} clients, q = 0.5 (Poisson), sigma = 1.0, C = 0.5, "
        f"{rounds} rounds, central noise"
    )
    print(f"{'run':<22} {'seed':>5} {'accuracy':>9} {'epsilon':>10} {'claimed eps':>12} {'sigma_eff':>10}")
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in RUNS:
            for seed in seeds:
                cfg = validate(
                    {
                        "num-rounds": rounds,
                        "sample-rate": 0.5,
                        "noise-multiplier": 1.0,
                        "clipping-norm": 0.5,
                        "noise-placement": "central",
                        "seed": seed,
                        "results-dir": str(Path(tmp, f"{name.replace(' ', '-')}-{seed}")),
                        **overrides,
                    }
                )
                s = run_federated(InProcessGrid(client_app, clients, cfg), cfg)
                claimed = s.get("claimed_epsilon", s["epsilon"])
                sigma_eff = s.get("effective_noise_multiplier", s["noise_multiplier"])
                eps = s["epsilon"] if s["epsilon"] is not None else math.inf
                print(
                    f"{name:<22} {seed:>5} {s['final_accuracy']:>9.4f} {eps:>10.4g} "
                    f"{(claimed if claimed is not None else math.inf):>12.4g} {sigma_eff:>10.4g}",
                    flush=True,
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--seeds", type=int, nargs="+", default=[42])
    parser.add_argument("--epsilon-only", action="store_true", help="only the claimed-vs-true epsilon table")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="Optimal order")
    epsilon_table()
    if not args.epsilon_only:
        accuracy_runs(args.rounds, args.clients, args.seeds)


if __name__ == "__main__":
    main()
