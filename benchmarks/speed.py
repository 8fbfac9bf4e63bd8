"""Speed ratios, all measured in one run on this machine (docs/performance.md's table).

    python -m benchmarks.speed [--deployment [--cold]] [--rounds 6] [--clients 20] [--repeats 3]

1. cold start: a fresh process from `import dpfl.fl_app.client_app` to "data ready for partition i"
   (data and partitions cached), against a bare `python -c "import torch"`;
2. an in-process round of the default job against a bare PyTorch loop doing the same SAM steps for the same
   partitions (the median over rounds 2.. of the per-round ratio);
3. step costs on the MNIST CNN: SAM / SGD at batch 32, Opacus DP-SGD (`ew`) / SGD at batch 16, 32, 64;
4. `flwr run` (Ray, 50 clients): round 1 against a steady round, a steady round against the bare loop
   (`benchmarks.simulation_round`);
5. our DP-FedAvg against Flower's DP wrapper and `fixedclipping_mod`, in process, 4 rounds, q = 1 and 0.5
   (`benchmarks.flower_dp_baseline`);
6. with --deployment: 3 real SuperNodes on loopback, a deployed round against the in-process one and SecAgg+
   against a plain deployed round (`benchmarks.deployment_round`; --cold adds Flower's default isolation).
About 7 minutes on 2 shared cores, 11 with --deployment --cold.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import torch

from benchmarks import deployment_round, flower_dp_baseline, simulation_round
from benchmarks.dpsgd_bench import sgd_steps, time_per_step
from benchmarks.round_overhead import bare_rounds, product_rounds, steady_ratio, step_seconds
from dpfl.clients.dpsgd import dpsgd_steps
from dpfl.dpcore.task.models import build_model
from dpfl.fl_app.config import validate

READY = (
    "import dpfl.fl_app.client_app; from dpfl.dpcore.task.partitions import load_partition; "
    "load_partition('mnist-embedded', 3, 50, 'dirichlet', alpha=0.5, seed=42)"
)


def process_seconds(code: str, repeats: int) -> float:
    """Median wall time of a fresh `python -c code`."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def dpsgd_ratio(batch: int, repeats: int) -> float:
    """Opacus DP-SGD (ew) step time / plain SGD step time on the MNIST CNN at expected batch `batch`."""
    n, q, steps = 20 * batch, 0.05, 20
    x, y = torch.randn(n, 1, 28, 28), torch.randint(0, 10, (n,))
    runs = {
        "sgd": lambda m, g: sgd_steps(m, x, y, steps, q, g),
        "ew": lambda m, g: dpsgd_steps(
            m,
            x,
            y,
            steps=steps,
            sample_rate=q,
            noise_multiplier=1.0,
            clipping_norm=1.0,
            lr=0.01,
            grad_sample_mode="ew",
            sampling_generator=g,
        ),
    }
    times = {k: [] for k in runs}
    for repeat in range(repeats + 1):  # the first one warms up
        for key, run in runs.items():
            model, generator = build_model("cnn-mnist", (1, 28, 28), 10, seed=0), torch.Generator().manual_seed(repeat)
            ms = time_per_step(lambda: run(model, generator), steps)
            if repeat:
                times[key].append(ms)
    return statistics.median(times["ew"]) / statistics.median(times["sgd"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--deployment", action="store_true", help="also the real-deployment ratios (3 SuperNodes)")
    parser.add_argument("--cold", action="store_true", help="with --deployment: also Flower's default isolation")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, python "
        f"{platform.python_version()}, torch {torch.__version__} (1 thread)"
    )
    process_seconds(READY, 1)  # fills the data and partition cache
    ready, bare_torch = process_seconds(READY, args.repeats), process_seconds("import torch", args.repeats)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = validate({"num-rounds": args.rounds, "results-dir": tmp})
        product, rounds = product_rounds(cfg, args.clients)
    bare = bare_rounds(cfg, args.clients, rounds)
    sgd, sam = step_seconds(False), step_seconds(True)
    rows = [
        ("cold start: ClientApp import to partition ready / import torch", ready / bare_torch, 1.3),
        (
            "in-process round of the default job / bare PyTorch loop, same partitions and SAM steps (rounds 2..)",
            steady_ratio(product, bare),
            1.10,
        ),
        ("SAM step / SGD step (MNIST CNN, batch 32)", sam / sgd, 2.05),
    ]
    rows += [
        (f"DP-SGD step (Opacus ew) / SGD step, batch {b}", dpsgd_ratio(b, args.repeats), 1.8) for b in (16, 32, 64)
    ]
    print(
        f"cold start {ready:.2f} s, import torch {bare_torch:.2f} s; in-process rounds "
        f"{' '.join(f'{t:.2f}' for t in product)} s, bare {' '.join(f'{t:.2f}' for t in bare)} s "
        f"({args.clients} clients, sampled {[len(r) for r in rounds]})"
    )
    sim = simulation_round.measure(50, 6)
    rows += [
        (
            "`flwr run` (Ray, 50 clients, the launcher's Ray head): round 1 / median of rounds 2-6",
            sim["round1"] / sim["steady"],
            2.0,
        ),
        (
            "`flwr run` (50 clients, `--no-ray-head`: Ray started by the run): round 1 / median of rounds 2-6",
            sim["round1_own_ray"] / sim["steady_own_ray"],
            2.0,
        ),
        (
            f"`flwr run` (the launcher's Ray head), local-epochs = {simulation_round.HEAVY_EPOCHS} (5x the local "
            "work): round 1 / median of rounds 2-4",
            sim["round1_heavy"] / sim["steady_heavy"],
            2.0,
        ),
        (
            "`flwr run`: steady round / bare PyTorch loop, same SAM steps (Ray: 2 clients at once)",
            sim["steady"] / sim["bare"],
            1.10,
        ),
    ]
    print(
        f"flwr run: round 1 {sim['round1']:.2f} s, steady {sim['steady']:.2f} s, bare {sim['bare']:.2f} s, "
        f"whole job {sim['wall']:.1f} s; with --no-ray-head round 1 {sim['round1_own_ray']:.2f} s, steady "
        f"{sim['steady_own_ray']:.2f} s, whole job {sim['wall_own_ray']:.1f} s; with local-epochs="
        f"{simulation_round.HEAVY_EPOCHS} round 1 {sim['round1_heavy']:.2f} s, steady {sim['steady_heavy']:.2f} s; "
        f"round 1's parts measured apart: ray.init {sim['ray_init']:.2f} s, "
        f"Ray actor ready {sim['actor_ready']:.2f} s, import dpfl.fl_app.client_app in the actor "
        f"{sim['app_import_in_actor']:.2f} s, first local training of a process {sim['first_fit']:.2f} s "
        f"(second {sim['second_fit']:.2f} s)"
    )
    for q in (1.0, 0.5):
        flower = flower_dp_baseline.compare(50, 4, q)  # 4 rounds: 2 read 0.99-1.13x at q = 0.5
        rows.append(
            (
                f"DP-FedAvg, 50 clients, q = {q:g}: our seconds per round / Flower's DP wrapper + fixedclipping_mod",
                flower["ours"][0] / flower["flower"][0],
                1.0,
            )
        )
        for name, (per_round, _, epsilon, delta, accuracy) in flower.items():
            print(
                f"DP-FedAvg q={q:g} {name}: {per_round:.3f} s/round, epsilon {epsilon:.3f} (delta {delta:.3g}), "
                f"accuracy {accuracy:.3f}"
            )
    if args.deployment:
        dep = deployment_round.measure(3, 3, args.cold)
        rows += [
            (
                "deployed round (3 SuperNodes, warm ClientApps) / in-process round, same clients and steps",
                dep["deployed"] / dep["inprocess"],
                1.5,
            ),
            ("SecAgg+ deployed round / plain deployed round", dep["secagg"] / dep["deployed"], 2.0),
        ]
        rows += [
            (
                f"deployed round on dpfl_tools.supernode (idle poll {deployment_round.IDLE_POLL} s) / in-process round",
                dep["deployed_fast"] / dep["inprocess"],
                1.5,
            ),
            (
                "SecAgg+ / plain deployed round, both on dpfl_tools.supernode",
                dep["secagg_fast"] / dep["deployed_fast"],
                2.0,
            ),
        ]
        if args.cold:
            rows.append(
                (
                    "deployed round, Flower's default isolation (a flwr-clientapp process per message) / "
                    "in-process round",
                    dep["deployed_cold"] / dep["inprocess"],
                    1.5,
                )
            )
        print(
            f"deployment: in-process round {dep['inprocess']:.2f} s, deployed {dep['deployed']:.2f} s "
            f"(its ClientApp tasks {dep['deployed_clientapps_busy']:.2f} s), SecAgg+ {dep['secagg']:.2f} s "
            f"(its 4 exchanges' ClientApp tasks {dep['secagg_clientapps_busy']:.2f} s)"
            + (f", Flower's default isolation {dep['deployed_cold']:.2f} s" if args.cold else "")
            + f"; on dpfl_tools.supernode: deployed {dep['deployed_fast']:.2f} s, SecAgg+ {dep['secagg_fast']:.2f} s"
        )
    print("| ratio | measured | target |\n|---|---|---|")
    for name, value, target in rows:
        print(f"| {name} | {value:.2f}x | <= {target}x |")


if __name__ == "__main__":
    main()
