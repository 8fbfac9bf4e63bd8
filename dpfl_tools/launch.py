"""Run the app with `flwr run` in local simulation, and clean up after it.

    python -m dpfl_tools.launch [--clients N] [--reference] [-c "key=value ..."] [--sweep "key=v1,v2,..."]
    python -m dpfl_tools.launch --resume RUN_DIR [--clients N] [-c "num-rounds=..."]
    python -m dpfl_tools.launch --engine cohort [--processes P] [--clients N] [-c ...]   (no flwr run)

--engine inprocess runs each run's ServerApp code in this process on `dpfl_tools.inprocess.InProcessGrid` (the
clients one after the other); --engine cohort on `dpfl_tools.cohort.CohortGrid` (a round's clients trained
together as one batched model, on device = auto: CUDA where torch sees it). Same run folders, no SuperLink, Ray
or network namespace. --processes P: the nodes split over P worker processes (`dpfl_tools.process_grid`), each
such a grid for its share, side by side on the cores and one GPU. The default, --engine flwr:

What it does, so that nothing is left behind:
0. checks every run's config (pyproject's defaults and the overrides, as the ServerApp will), --clients
   against min-nodes and what a run folder already holds (a damaged status.json or metrics.jsonl, a directory
   where a run file belongs, a previous run in a fresh run's folder: refused; a dead run's `running`: rewritten
   `interrupted`), and exits with the one-line reason before it starts anything (every engine); then moves
   itself into a private network namespace (`--network-isolation`, dpfl_tools.netns), so that what it starts
   listens on a loopback no other local account can reach (Flower's SuperLink takes runs from anyone who
   reaches it), after downloading the runs' datasets into the cache;
1. starts its own local simulation SuperLink on free ports with a private FLWR_HOME (never one
   that is already running: `flwr run` is pointed at this one), with runtime dependency
   installation and telemetry off, and remembers its PID; next to it, a Ray head of its own that every
   run's simulation connects to (RAY_ADDRESS), so no run pays Ray's start-up in its round 1
   (`--no-ray-head`: each run starts Ray itself, as plain `flwr run` does); either Ray takes only drivers
   with the launch's random token (`ray_token_auth`);
2. `flwr run . --stream` with N simulated clients, one CPU each (`--cpus-per-client`) and a share of the
   GPUs where torch sees any (`--gpus-per-client`; `dpfl_tools.simulation_resources`), and
   results-dir = ./results/<time>-<random>-<name> (or the results-dir given; --resume: the run folder);
3. with --reference, a second run without clipping or noise (the non-private
   FedAvg reference) and one plot with both; with --sweep key=v1,v2,..., one run per value
   (e.g. noise multipliers: the points of the privacy-utility frontier in `python -m dpfl_tools.report`);
4. ends the SuperLink and the Ray head it started, by PID and process group, also after Ctrl-C or a failed run, and exits
   non-zero unless every run folder says `completed` (status.json); a SIGKILLed launcher takes them along too
   (each child gets SIGTERM when it dies, PR_SET_PDEATHSIG, and a watchdog process ends what they leave).

The tools come from this Python's own environment (`.venv/bin/python -m dpfl_tools.launch` works without an
activated venv); `kill -USR1 <launcher pid>` prints where the launcher is, should it ever seem stuck.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from dpfl.fl_app import SPEED_PATCHES_ENV
from dpfl.fl_app.plain_output import call_plain_when_piped
from dpfl_tools import ROOT
from dpfl_tools.netns import isolate, own_user_namespace
from dpfl_tools.plan import PlannedRun, plan_runs, run_stamp
from dpfl_tools.processes import FLOWER_QUIET_ENV, command, die_with_launcher, end_processes_with_home
from dpfl_tools.ray_head import ray_token_auth, start_ray_head, stop_ray_head, wait_ray_head
from dpfl_tools.simulation_resources import federation_config, gpus_per_client
from dpfl_tools.superlink import own_superlink_env, start_local_superlink, stop, superlink_hint

QUIET_ENV = {  # the SuperLink and the simulation it starts inherit these
    **FLOWER_QUIET_ENV,
    # Ray's behaviour from its next versions on (actors that ask for no GPU keep CUDA_VISIBLE_DEVICES), which also
    # ends the FutureWarning that ray.init otherwise prints in the middle of round 1
    "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",
    # Ray's raylet starts one idle Python worker per CPU when the first driver joins, without the job's runtime_env;
    # Flower's actors need workers with the run's runtime_env (its PYTHONPATH), so those never run a task: here
    # 0.27 CPU-seconds and 80 MiB each, beside the run's real workers' start (tests/test_launch.py counts them)
    "RAY_prestart_worker_first_driver": "0",
}


def watchdog(home: str) -> None:
    """The launcher's watchdog process: reads its stdin (a pipe from the launcher) to the end; an end without
    "done" means the launcher died before its cleanup (SIGKILL, an OOM kill): end every process of its
    private FLWR_HOME, what the SuperLink's SIGTERM leaves (its `flwr-simulation`) included."""
    if sys.stdin.read() != "done":
        end_processes_with_home(home, grace=3)  # no one waits for their results any more


def start_watchdog(home: Path) -> subprocess.Popen:
    """`watchdog(home)` in a session of its own (Ctrl-C to the launcher's terminal does not reach it); the
    launcher writes "done" to its stdin after its own cleanup (`release_watchdog`)."""
    env = {k: v for k, v in os.environ.items() if k != "FLWR_HOME"}
    code = "import sys; from dpfl_tools.launch import watchdog; watchdog(sys.argv[1])"
    return subprocess.Popen(
        [sys.executable, "-c", code, str(home)],
        cwd=ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        start_new_session=True,
        text=True,
    )


def release_watchdog(proc: subprocess.Popen) -> None:
    """The launcher's cleanup is done: the watchdog exits without ending anything."""
    try:
        proc.communicate("done", timeout=10)
    except (subprocess.TimeoutExpired, BrokenPipeError):
        proc.kill()


def run_status(run_dir: Path, since: float = 0.0) -> str:
    """What the run folder says: completed, failed, interrupted (a ServerApp that died), or missing; `stale` when
    its status.json was written before `since` (a previous run's, e.g. of a resume that was refused)."""
    from dpfl.fl_app.results import read_status  # numpy: not before the namespace is made
    from dpfl.fl_app.run_files import RunFileError

    try:
        record = read_status(run_dir)
    except RunFileError as exc:
        print(exc, file=sys.stderr)
        return "damaged"
    return record.get("status", "missing") if record.get("time", since) >= since else "stale"


def checked_runs(args: argparse.Namespace, stamp: str) -> list[PlannedRun]:
    """This launch's runs (`plan_runs`), each run's folder checked as the run will read it (`check_run_folder`:
    a directory where a run file belongs, a damaged status.json or metrics.jsonl, a previous run in a fresh run's
    folder), for every engine before anything starts: SystemExit with the one line that names the file and what
    to do. A dead run's `running` status is rewritten `interrupted` on the way."""
    from dpfl.fl_app.results import PreviousRunError, check_run_files, check_run_folder
    from dpfl.fl_app.run_files import RunFileError

    try:
        if args.resume:  # before plan_runs reads the folder's config.json and checkpoint.npz
            check_run_files(Path(args.resume).resolve())
        runs = plan_runs(args, stamp)  # every run's config checked
        for run in runs:
            check_run_folder(run.folder, run.settings.output.resume)
    except (RunFileError, PreviousRunError) as exc:
        raise SystemExit(str(exc)) from None
    return runs


def flwr_run(env: dict, run_config: str, clients: int, gpus_per_client: float = 0.0, cpus_per_client: int = 1) -> int:
    cmd = [
        command("flwr"),
        "run",
        str(ROOT),
        "--stream",
        "--run-config",
        run_config,
        "--federation-config",
        federation_config(clients, gpus_per_client, cpus_per_client),
    ]
    print("$", " ".join(shlex.quote(c) for c in cmd), flush=True)
    return call_plain_when_piped(cmd, env, preexec_fn=die_with_launcher())  # colour codes only on a terminal


def exit_on_signal(signum: int, _frame) -> None:
    """SIGTERM / SIGHUP end the launcher through its `finally` (which stops the SuperLink and all it started),
    not at once as Python's default would, leaving the simulation and Ray running."""
    sys.exit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=50, help="simulated clients (SuperNodes)")
    parser.add_argument("-c", "--run-config", default="", help="run-config overrides, 'key=value ...'")
    parser.add_argument("--reference", action="store_true", help="also run the non-private reference")
    parser.add_argument("--results", default=str(Path.cwd() / "results"), help="parent folder of run folders")
    parser.add_argument(
        "--sweep", default="", help="one run per value: 'key=v1,v2,...' (e.g. noise-multiplier=0.5,1,2)"
    )
    parser.add_argument(
        "--resume",
        default="",
        metavar="RUN_DIR",
        help="continue the run in this folder from its last checkpoint, with its settings (-c: "
        "e.g. more num-rounds); pass the same --clients as the run had",
    )
    parser.add_argument(
        "--no-ray-head",
        dest="ray_head",
        action="store_false",
        help="let each run start Ray itself (default: one Ray head for all runs of this launch, "
        "unless RAY_ADDRESS already names a cluster)",
    )
    parser.add_argument(
        "--gpus-per-client",
        type=float,
        default=None,
        help="GPUs each simulated client asks Ray for (default: the visible GPUs shared by the "
        "clients that run at once, 1 / min(clients, CPUs) of one GPU; none without a GPU "
        "or with device='cpu')",
    )
    parser.add_argument(
        "--cpus-per-client",
        type=int,
        default=1,
        choices=range(1, 1025),
        metavar="C",
        help="CPUs each simulated client asks Ray for: at most CPUs / C clients (Ray workers, about "
        "1 GB each) run at once (default 1)",
    )
    parser.add_argument(
        "--network-isolation",
        choices=("auto", "require", "off"),
        default="auto",
        help="run the SuperLink and everything else in a private network namespace, which no other "
        "local account can reach (Flower's SuperLink runs whatever app reaches its port, as "
        "you). auto (default): where the kernel allows it and the runs need no network (W&B "
        "online, a RAY_ADDRESS cluster), else a warning; require: exit instead; off: other "
        "local accounts can submit runs that execute as you",
    )
    parser.add_argument(
        "--engine",
        choices=("flwr", "inprocess", "cohort"),
        default="flwr",
        help="flwr (default): `flwr run` with Ray; inprocess: in this process, clients one by one; cohort: in this "
        "process, a round's clients trained together as one batched model (dpfl_tools.cohort)",
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        help="--engine inprocess / cohort: split the nodes over this many worker processes, each a grid for its "
        "share, training side by side (default 1: this process)",
    )
    args = parser.parse_args(argv)
    if args.processes < 1 or (args.processes > 1 and args.engine == "flwr"):
        parser.error(
            f"--processes {args.processes}: allowed are 1 or more, and more than 1 only with --engine inprocess or "
            "cohort (with flwr, Flower's Ray simulation runs its own actors: --cpus-per-client)"
        )
    if args.engine != "flwr":
        return run_in_process(args)
    user_namespace = own_user_namespace(args.network_isolation)  # first: the process must be single-threaded
    gpus = gpus_per_client(args.gpus_per_client, args.clients, args.run_config, args.cpus_per_client)
    if hasattr(faulthandler, "register"):  # `kill -USR1 <pid>` prints where the launcher is (a hang's report)
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    for sig in (signal.SIGTERM, signal.SIGHUP):  # a scheduler's stop or a closed terminal: clean up as on Ctrl-C
        signal.signal(sig, exit_on_signal)

    base = {**os.environ, **QUIET_ENV}
    stamp = run_stamp()
    runs = checked_runs(args, stamp)  # every run's config and folder checked before anything starts
    if any(run.settings.federation.flower_speed_patches for run in runs):
        base[SPEED_PATCHES_ENV] = "1"  # the simulation's opt-in patches (dpfl_tools.simulation_pickup)
    enter = isolate(args.network_isolation, runs, base, user_namespace)  # before anything starts
    log_dir = Path(args.results)
    log_dir.mkdir(parents=True, exist_ok=True)
    env, http_port, control_port = own_superlink_env(base, log_dir / f".flwr-home-{stamp}-{os.getpid()}")
    guard = start_watchdog(Path(env["FLWR_HOME"]))  # ends what the launcher started should it be SIGKILLed
    own_ray = not env.get("RAY_ADDRESS")  # a cluster the user named keeps its own settings
    head = (
        start_ray_head(env, log_dir / "ray-head.log", {http_port, control_port}) if args.ray_head and own_ray else None
    )
    if head is not None:
        env.update(head.join_env)  # the SuperLink's simulations join it
    elif own_ray:
        env.update(ray_token_auth())  # each run's own Ray takes only its own drivers
    proc = None
    run_dirs = []
    try:
        proc = start_local_superlink(env, http_port, control_port, log_dir / "superlink.log")  # while the head starts
        print(superlink_hint(env, http_port, control_port, enter), flush=True)
        if head is not None and not wait_ray_head(head.proc, log_dir / "ray-head.log"):
            stop(proc, env["FLWR_HOME"])
            del env["RAY_ADDRESS"]  # each run's own Ray, with the head's token
            proc = start_local_superlink(env, http_port, control_port, log_dir / "superlink.log")
        for name, overrides, run_dir, _ in runs:
            started = time.time()
            rc = flwr_run(env, overrides, args.clients, gpus, args.cpus_per_client)
            status = run_status(run_dir, since=started)
            if rc != 0 or status != "completed":
                print(
                    f"Run '{name}' did not complete (flwr run exit code {rc}, run folder status {status!r}); "
                    "see the log above and its status.json",
                    file=sys.stderr,
                )
                return rc or 1
            run_dirs.append(run_dir)
    finally:
        stop_ray_head(head)  # first, as a group (its agents, signalled one by one by stop(), linger 20 s)
        stop(proc, env["FLWR_HOME"])
        release_watchdog(guard)
        shutil.rmtree(env["FLWR_HOME"], ignore_errors=True)  # its SuperLink's state (about 3 MB): gone with it
    print_summaries(run_dirs, args, stamp)
    return 0


def run_in_process(args: argparse.Namespace) -> int:
    """--engine inprocess / cohort: each planned run through the ServerApp's `run_federated` on a Grid in this
    process with --clients nodes (--processes P > 1: a ProcessGrid of P such grids)."""
    from dpfl.fl_app.client_app import app as client_app
    from dpfl.fl_app.results import PreviousRunError, read_status
    from dpfl.fl_app.run_files import RunFileError
    from dpfl.fl_app.server_app import run_federated
    from dpfl_tools.cohort import CohortGrid
    from dpfl_tools.inprocess import InProcessGrid
    from dpfl_tools.process_grid import ProcessGrid

    grid_class = CohortGrid if args.engine == "cohort" else InProcessGrid
    stamp = run_stamp()
    run_dirs = []
    for run in checked_runs(args, stamp):
        grid_args = (client_app, args.clients, run.settings)
        try:  # what the folder check cannot see (a checkpoint whose state does not fit): one line, as there
            if args.processes == 1:
                run_federated(grid_class(*grid_args, keep_messages=False), run.settings)
            else:
                with ProcessGrid(
                    *grid_args, processes=args.processes, grid_class=grid_class, keep_messages=False
                ) as grid:
                    run_federated(grid, run.settings)
        except (RunFileError, PreviousRunError) as exc:
            raise SystemExit(str(exc)) from None
        status = read_status(run.folder).get("status", "missing")
        if status != "completed":
            print(f"Run '{run.name}' did not complete (run folder status {status!r})", file=sys.stderr)
            return 1
        run_dirs.append(run.folder)
    print_summaries(run_dirs, args, stamp)
    return 0


def print_summaries(run_dirs: list[Path], args: argparse.Namespace, stamp: str) -> None:
    """Each run's accuracy and epsilon; with several runs, the comparison plot and the report command."""
    for run_dir in run_dirs:
        s = json.loads((run_dir / "summary.json").read_text())
        d = json.loads((run_dir / "diagnostics-summary.json").read_text())
        accuracy = (
            f"final_accuracy={s['final_accuracy']:.4f}"
            if s.get("final_accuracy") is not None
            else f"personalized_accuracy={d['personalized_accuracy']:.4f} (not private)"
            if d.get("personalized_accuracy") is not None
            else ""
        )
        print(
            f"{run_dir}: {s['strategy']} {accuracy} epsilon={s['epsilon']} delta={s['delta']:.3g} "
            f"rounds={s['rounds_completed']}"
        )
    if len(run_dirs) > 1:
        from dpfl.fl_app.results import plot_runs

        print("comparison plot:", plot_runs(run_dirs, run_dirs[0] / "plot-vs-reference.png"))
        print(
            "report: python -m dpfl_tools.report",
            " ".join(shlex.quote(str(d)) for d in run_dirs),
            "-o",
            shlex.quote(str(Path(args.results, f"{stamp}-report.html"))),
        )


if __name__ == "__main__":
    sys.exit(main())
