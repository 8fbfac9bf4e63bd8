"""Under `flwr run` (Ray): round 1 against a steady round, a steady round against the bare loop, and
where round 1's extra time goes.

    python -m benchmarks.simulation_round [--clients 50] [--rounds 6]

1. `python -m dpfl_tools.launch --clients N -c "num-rounds=R"`: the launcher's own SuperLink and Ray head, N
   simulated clients with one CPU each (two Ray actors on two cores); seconds per round from the run folder.
   Also with `--no-ray-head`, where the simulation starts Ray itself (as under a plain `flwr run`), and with
   5x the local work (`local-epochs=10`, 4 rounds): round 1's start-up is a fixed cost, not a share of a round.
2. The bare PyTorch loop doing the same local SAM steps for the steady rounds' client counts, on one thread
   (`benchmarks.round_overhead.expected_bare_loop_seconds`: which partitions trained is not known under
   `flwr run`, so a round's bare time is its client count x a partition's mean bare time).
3. Round 1's parts, each measured apart in fresh processes: `ray.init` (not `import ray`), a Ray actor started and ready
   (Ray started by Flower's own `RayBackend`, so the actor is in a worker process started for it, as in every run),
   `import dpfl.fl_app.client_app` inside that actor, and a process's first local training against its second.
   The actor and the import alone are what a run's first reply waits for after Flower builds its pool.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from dpfl.fl_app.results import read_rounds
from dpfl_tools.launch import QUIET_ENV

PARTS = r"""
import json, time
import ray
from flwr.server.superlink.fleet.vce.backend.raybackend import RayBackend
t0 = time.perf_counter()
# Ray as a run starts it (Flower's RayBackend.init_ray, with its runtime_env): workers of the run's own
RayBackend({"init_args": {"num_cpus": 2, "log_to_driver": False}, "client_resources": {"num_cpus": 1}})
t1 = time.perf_counter()

@ray.remote(num_cpus=1)
class Actor:
    def ready(self):
        return True
    def load_app(self):
        import dpfl.fl_app.client_app
        return True

actor = Actor.remote()
ray.get(actor.ready.remote())
t2 = time.perf_counter()
ray.get(actor.load_app.remote())
t3 = time.perf_counter()
ray.shutdown()
print(json.dumps({"ray_init": t1 - t0, "actor_ready": t2 - t1, "app_import_in_actor": t3 - t2}))
"""

FIRST_FIT = r"""
import json, time, torch
torch.set_num_threads(1)
from flwr.app import Context, RecordDict
from dpfl.fl_app.client_app import build_client
from dpfl.fl_app.config import validate
from dpfl.dpcore.task.torch_helpers import get_weights
ctx = Context(run_id=1, node_id=1, node_config={"partition-id": 3, "num-partitions": 50}, state=RecordDict(),
              run_config=validate({}))
times = []
for _ in range(2):
    t = time.perf_counter()
    client = build_client(ctx)
    client.fit(get_weights(client.model), {"server-round": 1})
    times.append(time.perf_counter() - t)
print(json.dumps({"first_fit": times[0], "second_fit": times[1]}))
"""


def launch_rounds(
    clients: int, rounds: int, ray_head: bool = True, overrides: str = ""
) -> tuple[list[float], list[int], float]:
    """(seconds per round, clients per round, wall seconds) of one `python -m dpfl_tools.launch` run; `ray_head`
    False: `--no-ray-head` (the simulation starts Ray itself, as under a plain `flwr run`); `overrides`: more
    run-config, 'key=value ...'."""
    import time

    with tempfile.TemporaryDirectory(prefix="sim-bench-") as tmp:
        t0 = time.perf_counter()
        subprocess.run(
            [
                sys.executable,
                "-m",
                "dpfl_tools.launch",
                "--clients",
                str(clients),
                "--results",
                tmp,
                *([] if ray_head else ["--no-ray-head"]),
                "-c",
                f"num-rounds={rounds} tensorboard=false {overrides}",
            ],
            check=True,
            capture_output=True,
        )
        wall = time.perf_counter() - t0
        (run,) = Path(tmp).glob("*-dp")
        rows = read_rounds(run)  # seconds and clients are diagnostics
    return [r["seconds"] for r in rows], [r["clients"] for r in rows], wall


def fresh_json(code: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, **QUIET_ENV, "RAY_DEDUP_LOGS": "0"},
    )  # Ray set as the launcher sets it
    return json.loads(out.stdout.strip().splitlines()[-1])


HEAVY_EPOCHS = 10  # 5x the default job's local work: round 1's start-up against longer rounds


def measure(clients: int, rounds: int) -> dict:
    """The default job with the launcher's Ray head and with `--no-ray-head`, the same job with
    HEAVY_EPOCHS local epochs (4 rounds), and round 1's parts measured apart."""
    from benchmarks.round_overhead import expected_bare_loop_seconds
    from dpfl.fl_app.config import validate

    own_seconds, _, own_wall = launch_rounds(clients, rounds, ray_head=False)
    seconds, counts, wall = launch_rounds(clients, rounds)
    heavy_seconds, _, _ = launch_rounds(clients, 4, overrides=f"local-epochs={HEAVY_EPOCHS}")
    steady = statistics.median(seconds[1:])
    cfg = validate({"num-rounds": rounds})
    bare = expected_bare_loop_seconds(cfg, clients, counts[1:])
    return {
        "round1": seconds[0],
        "steady": steady,
        "bare": bare,
        "wall": wall,
        "counts": counts,
        "round1_own_ray": own_seconds[0],
        "steady_own_ray": statistics.median(own_seconds[1:]),
        "wall_own_ray": own_wall,
        "round1_heavy": heavy_seconds[0],
        "steady_heavy": statistics.median(heavy_seconds[1:]),
        **fresh_json(PARTS),
        **fresh_json(FIRST_FIT),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    r = measure(args.clients, args.rounds)
    print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}))
    print(
        f"round 1 / steady round: {r['round1'] / r['steady']:.2f}x ({r['round1_own_ray'] / r['steady_own_ray']:.2f}x "
        f"with --no-ray-head; {r['round1_heavy'] / r['steady_heavy']:.2f}x with local-epochs={HEAVY_EPOCHS}); "
        f"round 1 - steady round: {r['round1'] - r['steady']:.2f} s ({r['round1_heavy'] - r['steady_heavy']:.2f} s "
        f"with local-epochs={HEAVY_EPOCHS}); steady round / bare loop: {r['steady'] / r['bare']:.2f}x"
    )


if __name__ == "__main__":
    main()
