"""Many simulated clients under `flwr run`: the whole run's peak memory and seconds per round.

    python -m benchmarks.scale --data-dir /path/to/mnist [--clients 1000 10000] [--algorithm dp-fedsam]
        [--sample-rate 0.01] [--rounds 3] [--extra "key=value ..."] [--checkout DIR] [--out FILE]

Per client count: `python -m dpfl_tools.launch --clients N -c "dataset='mnist' data-dir=... partitioner='iid'
sample-rate=q num-rounds=R algorithm=..."` (the full MNIST, IID partitions), with the process tree of the
launcher sampled every 0.5 s: the launcher, `flwr run`, the SuperLink and its SuperExec, `flwr-simulation`
(the ServerApp and Flower's simulation engine with every node's Context), the Ray workers running the
ClientApps and Ray's own processes. Reported: the peak of the summed RSS (pages shared between processes,
such as torch's libraries, counted once per process) and of the summed PSS (shared pages split between
the processes that map them: the memory the run really takes), each process group at the RSS peak, and
from the run folder the seconds of round 1 and the median of the later rounds (`seconds` in
diagnostics.jsonl) with the clients per round.

The dataset and partition caches are built first, in this process (their time printed apart), so that the
runs measure a warm start; `DPFL_CACHE_DIR` defaults to a folder of its own under the temp folder.
`--checkout DIR` runs the launcher of another checkout of the project (e.g. `git worktree add` of an older
commit) for a before/after comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

GROUPS = (  # (group, what its command line contains), first match wins
    ("ray actors (ClientApps)", "ray::ClientAppActor"),
    ("ray actors (ClientApps)", "workers/default_worker.py"),  # a Ray worker before it takes its actor's name
    ("flwr-simulation (ServerApp, nodes)", "flwr-simulation"),
    ("SuperLink", "flower-superlink"),
    ("SuperExec", "flower-superexec"),
    ("flwr run", "bin/flwr run"),
    ("launcher", "dpfl_tools.launch"),
)
OTHER = "ray system (head, GCS, raylet, agents)"


def children() -> dict[int, list[int]]:
    """Parent pid -> child pids, from /proc."""
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            tree.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    return tree


def descendants(root: int) -> list[int]:
    tree, out, todo = children(), [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += tree.get(pid, [])
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used so far (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def memory_kib(pid: int) -> tuple[int, int]:
    """(RSS, PSS) of a process in KiB; (0, 0) once it is gone."""
    try:
        rss = next(
            int(line.split()[1])
            for line in Path(f"/proc/{pid}/status").read_text().splitlines()
            if line.startswith("VmRSS:")
        )
        pss = next(
            int(line.split()[1])
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
            if line.startswith("Pss:")
        )
        return rss, pss
    except (OSError, StopIteration):
        return 0, 0


def group_of(pid: int) -> str | None:
    """The process group of `pid` by its command line (None once it is gone)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    return next((group for group, mark in GROUPS if mark in cmdline), OTHER) if cmdline else None


class TreeSampler(threading.Thread):
    """Samples the memory of a process tree every `interval` s until the root exits; keeps the peaks."""

    def __init__(self, root: int, interval: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.root, self.interval = root, interval
        self.peak_rss = self.peak_pss = 0
        self.groups_at_peak: dict[str, int] = {}
        self.processes_at_peak = 0
        self.samples = 0
        self.cpu: dict[int, tuple[str, float]] = {}  # pid -> (group, CPU seconds at its last sample)

    def run(self) -> None:
        while os.path.exists(f"/proc/{self.root}"):
            self.sample()
            time.sleep(self.interval)

    def cpu_by_group(self) -> dict[str, float]:
        """CPU seconds per process group, as last sampled."""
        groups: dict[str, float] = {}
        for group, seconds in self.cpu.values():
            groups[group] = groups.get(group, 0.0) + seconds
        return groups

    def sample(self) -> None:
        pids = descendants(self.root)
        memory = {pid: memory_kib(pid) for pid in pids}
        rss, pss = sum(r for r, _ in memory.values()), sum(p for _, p in memory.values())
        self.samples += 1
        self.peak_pss = max(self.peak_pss, pss)
        for pid in pids:  # the group again each time: a Ray worker takes its actor's name once it runs one
            group, seconds = self.cpu.get(pid, (OTHER, 0.0))
            self.cpu[pid] = (group_of(pid) or group, max(cpu_seconds(pid), seconds))
        if rss > self.peak_rss:
            self.peak_rss, self.processes_at_peak = rss, len(pids)
            groups: dict[str, int] = {}
            for pid, (r, _) in memory.items():
                group = group_of(pid) or OTHER
                groups[group] = groups.get(group, 0) + r
            self.groups_at_peak = groups


def warm_caches(data_dir: str, clients: list[int], seed: int) -> float:
    """Build the dataset and partition caches the runs read (seconds taken)."""
    from dpfl.dpcore.task.data import load_dataset
    from dpfl.dpcore.task.partitions import load_partition

    start = time.perf_counter()
    load_dataset("mnist", data_dir)
    for n in clients:
        load_partition("mnist", 0, n, "iid", seed=seed, data_dir=data_dir)
    return time.perf_counter() - start


def launch(clients: int, run_config: str, checkout: Path, interval: float, launcher_args: str = "") -> dict:
    """One launcher run under the sampler: its memory peaks, seconds per round and wall time."""
    with tempfile.TemporaryDirectory(prefix="scale-bench-") as tmp:
        cmd = [
            sys.executable,
            "-m",
            "dpfl_tools.launch",
            "--clients",
            str(clients),
            "--results",
            tmp,
            "-c",
            run_config,
            *launcher_args.split(),
        ]
        start = time.perf_counter()
        with open(Path(tmp) / "launch.log", "wb") as log:
            proc = subprocess.Popen(cmd, cwd=checkout, stdout=log, stderr=subprocess.STDOUT)
            sampler = TreeSampler(proc.pid, interval)
            sampler.start()
            rc = proc.wait()
            sampler.join()
        wall = time.perf_counter() - start
        runs = sorted(Path(tmp).glob("*-dp"))
        rows = [json.loads(line) for line in (runs[0] / "diagnostics.jsonl").read_text().splitlines()] if runs else []
        if rc != 0 or not rows:
            tail = (Path(tmp) / "launch.log").read_text(errors="replace")[-3000:]
            raise SystemExit(f"the launch with {clients} clients failed (exit code {rc}):\n{tail}")
    seconds = [r["seconds"] for r in rows]
    return {
        "clients": clients,
        "rss_peak_mib": sampler.peak_rss / 1024,
        "pss_peak_mib": sampler.peak_pss / 1024,
        "groups_at_rss_peak_mib": {k: round(v / 1024) for k, v in sorted(sampler.groups_at_peak.items())},
        "processes_at_peak": sampler.processes_at_peak,
        "samples": sampler.samples,
        "cpu_s_by_group": {k: round(v, 1) for k, v in sorted(sampler.cpu_by_group().items())},
        "round1_s": seconds[0],
        "later_rounds_median_s": statistics.median(seconds[1:]) if len(seconds) > 1 else None,
        "clients_per_round": [r.get("clients") for r in rows],
        "wall_s": wall,
    }


def own_rss_kib() -> int:
    return next(
        int(line.split()[1]) for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmRSS:")
    )


def per_node_costs(num_nodes: int, run_config: dict, checkout: Path) -> dict:
    """In this process, what Flower's simulation engine keeps per node and what a DP²-FedSAM head adds: Flower's
    node registration and each node's Context (its run config read from the app's pyproject.toml and fused
    with the overrides, as `flwr-simulation` does), then a personal head saved into every node's Context.state
    (what that process holds once every client has trained). KiB and milliseconds per node."""
    import dataclasses

    from flwr.server.superlink.fleet.vce import vce_api
    from flwr.server.superlink.linkstate import LinkStateFactory
    from flwr.supercore.constant import FLWR_IN_MEMORY_DB_NAME, NOOP_FEDERATION_ID
    from flwr.supercore.object_store import ObjectStoreFactory
    from flwr.supercore.run import Run
    from flwr.superlink.federation import NoOpFederationManager

    from dpfl.clients.personalized import ContextHeadStore
    from dpfl.dpcore.task.models import build_model, split_state_keys

    run = dataclasses.replace(Run.create_empty(1), federation_id=NOOP_FEDERATION_ID, override_config=run_config)
    factory = LinkStateFactory(FLWR_IN_MEMORY_DB_NAME, NoOpFederationManager(), ObjectStoreFactory())
    before, start = own_rss_kib(), time.perf_counter()
    stores = vce_api._register_node_info_stores(vce_api._register_nodes(num_nodes, factory), run, str(checkout))
    node_kib, node_ms = (own_rss_kib() - before) / num_nodes, 1000 * (time.perf_counter() - start) / num_nodes
    model = build_model("cnn-mnist", (1, 28, 28), 10)
    state = model.state_dict()
    head = {k: state[k].numpy().copy() for k in split_state_keys(model)[1]}
    before = own_rss_kib()
    for store in stores.values():
        ContextHeadStore(store.retrieve_context(1).state).save(head)
    return {
        "nodes": num_nodes,
        "flower_node_kib": round(node_kib, 2),
        "flower_node_ms": round(node_ms, 3),
        "head_parameters": int(sum(a.size for a in head.values())),
        "head_kib_in_context": round((own_rss_kib() - before) / num_nodes, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--data-dir",
        default=os.environ.get("DPFL_MNIST_DIR", ""),
        help="folder with the four MNIST IDX .gz files (default: $DPFL_MNIST_DIR)",
    )
    parser.add_argument("--clients", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--algorithm", default="dp-fedsam")
    parser.add_argument("--sample-rate", type=float, default=0.01)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--extra", default="", help="more run-config, 'key=value ...'")
    parser.add_argument(
        "--checkout",
        default=str(Path(__file__).resolve().parents[1]),
        help="the project checkout whose launcher runs (default: this one)",
    )
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between memory samples")
    parser.add_argument("--launcher-args", default="", help="more arguments of dpfl_tools.launch, e.g. --no-ray-head")
    parser.add_argument("--out", default="", help="append the results (one JSON line per run) to this file")
    parser.add_argument(
        "--per-node",
        action="store_true",
        help="instead of runs: Flower's memory per simulated node and a DP²-FedSAM head's, in process",
    )
    args = parser.parse_args()
    if args.per_node:
        from flwr.common.config import parse_config_args

        overrides = parse_config_args(
            [f"dataset='mnist' partitioner='iid' sample-rate={args.sample_rate} {args.extra}"]
        )
        for n in args.clients:
            print(json.dumps(per_node_costs(n, overrides, Path(args.checkout))), flush=True)
        return
    if not args.data_dir:
        raise SystemExit("--data-dir (or DPFL_MNIST_DIR) must name a folder with the four MNIST IDX .gz files")
    os.environ.setdefault("DPFL_CACHE_DIR", str(Path(tempfile.gettempdir()) / "dpfl-scale-cache"))
    print(
        f"caches in {os.environ['DPFL_CACHE_DIR']}: built or found in "
        f"{warm_caches(args.data_dir, args.clients, 42):.1f} s",
        flush=True,
    )
    run_config = (
        f"dataset='mnist' data-dir='{args.data_dir}' partitioner='iid' sample-rate={args.sample_rate} "
        "flower-speed-patches=true "
        f"num-rounds={args.rounds} algorithm='{args.algorithm}' tensorboard=false {args.extra}"
    ).strip()
    for clients in args.clients:
        r = launch(clients, run_config, Path(args.checkout), args.interval, args.launcher_args)
        r.update(
            algorithm=args.algorithm,
            sample_rate=args.sample_rate,
            rounds=args.rounds,
            extra=args.extra,
            launcher_args=args.launcher_args,
            checkout=Path(args.checkout).name,
            load_average=os.getloadavg()[0],
        )
        setting = ", ".join(x for x in (args.extra, args.launcher_args) if x)
        print(
            f"{args.algorithm} {clients} clients (q={args.sample_rate}, {args.rounds} rounds{', ' + setting if setting else ''}): "
            f"peak RSS {r['rss_peak_mib']:.0f} MiB (target <= 4096), peak PSS {r['pss_peak_mib']:.0f} MiB; "
            f"round 1 {r['round1_s']:.1f} s, later rounds {r['later_rounds_median_s'] or float('nan'):.2f} s "
            f"(median; clients per round {r['clients_per_round']}); wall {r['wall_s']:.0f} s",
            flush=True,
        )
        print(
            "  at the RSS peak (MiB):",
            ", ".join(f"{k} {v}" for k, v in r["groups_at_rss_peak_mib"].items()),
            flush=True,
        )
        print("  CPU seconds:", ", ".join(f"{k} {v}" for k, v in r["cpu_s_by_group"].items()), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}) + "\n")


if __name__ == "__main__":
    main()
