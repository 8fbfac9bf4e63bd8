"""Run the app with `flwr run` in local simulation, and clean up after it.

    python -m fl_app.launch [--clients N] [--reference] [-c "key=value ..."] [--sweep "key=v1,v2,..."]

What it does, so that nothing is left behind:
1. starts its own local simulation SuperLink on free ports with a private FLWR_HOME (never one
   that is already running: `flwr run` is pointed at this one), with runtime dependency
   installation and telemetry off, and remembers its PID; next to it, a Ray head of its own that every
   run's simulation connects to (RAY_ADDRESS), so no run pays Ray's start-up in its round 1
   (`--no-ray-head`: each run starts Ray itself, as plain `flwr run` does); either Ray takes only drivers
   with the launch's random token (`ray_token_auth`);
2. `flwr run . --stream` with N simulated clients, one CPU each (`--cpus-per-client`) and a share of the
   GPUs where torch sees any (`--gpus-per-client`; `fl_app.simulation_resources`), and
   results-dir = ./results/<name>;
3. with --reference, a second run without clipping or noise (the non-private
   FedAvg reference) and one plot with both; with --sweep key=v1,v2,..., one run per value
   (e.g. noise multipliers: the points of the privacy-utility frontier in `python -m fl_app.report`);
4. ends the SuperLink and the Ray head it started, by PID and process group, also after Ctrl-C or a failed run, and exits
   non-zero unless every run folder says `completed` (status.json).

The tools come from this Python's own environment (`.venv/bin/python -m fl_app.launch` works without an
activated venv); `kill -USR1 <launcher pid>` prints where the launcher is, should it ever seem stuck.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import httpx

from fl_app.local_deployment import BIN, end_process_tree, end_processes_with_home, free_port
from fl_app.plain_output import call_plain_when_piped
from fl_app.simulation_resources import federation_config, gpus_per_client

ROOT = Path(__file__).resolve().parents[1]
QUIET_ENV = {  # the SuperLink and the simulation it starts inherit these
    "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1", "FLWR_DISABLE_UPDATE_CHECK": "1",
    # Ray's behaviour from its next versions on (actors that ask for no GPU keep CUDA_VISIBLE_DEVICES), which also
    # ends the FutureWarning that ray.init otherwise prints in the middle of round 1
    "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",
    # Ray's raylet starts one idle Python worker per CPU when the first driver joins, without the job's runtime_env;
    # Flower's actors need workers with the run's runtime_env (its PYTHONPATH), so those never run a task: here
    # 0.27 CPU-seconds and 80 MiB each, beside the run's real workers' start (tests/test_launch.py counts them)
    "RAY_prestart_worker_first_driver": "0",
}


def superlink_healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).is_success
    except httpx.HTTPError:
        return False


def own_superlink_env(base: dict, home: Path) -> tuple[dict, int, int]:
    """(environment, HTTP port, control port) of a SuperLink of our own: free ports, a private FLWR_HOME.

    `flwr run` finds its local SuperLink through FLWR_LOCAL_SUPERLINK_HTTP_API_PORT and
    FLWR_LOCAL_CONTROL_API_PORT, so it talks to this one and never to one started elsewhere. This Python's
    own bin folder goes first on PATH, so `.venv/bin/python -m fl_app.launch` finds this environment's
    `flower-superlink`, `flwr` and `flwr-simulation` without an activated venv.
    """
    taken: set[int] = set()
    http_port, control_port = free_port(taken), free_port(taken)
    home.mkdir(parents=True, exist_ok=True)
    env = {**base, "FLWR_HOME": str(home), "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(http_port),
           "FLWR_LOCAL_CONTROL_API_PORT": str(control_port), "PATH": f"{BIN}{os.pathsep}{base.get('PATH', '')}"}
    return env, http_port, control_port


def superlink_hint(env: dict, http_port: int, control_port: int) -> str:
    """Where this launch's SuperLink listens, and the `flwr ls` / `flwr log` commands that reach it from another
    shell while the launch runs: `flwr` finds a local SuperLink only through FLWR_HOME and the two port
    variables (without them it starts a SuperLink of its own on Flower's default ports)."""
    prefix = " ".join(f"{key}={shlex.quote(env[key])}" for key in
                      ("FLWR_HOME", "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT", "FLWR_LOCAL_CONTROL_API_PORT"))
    flwr = shlex.quote(str(BIN / "flwr"))
    return (f"SuperLink of this launch: 127.0.0.1:{http_port} (HTTP API), control API 127.0.0.1:{control_port}. "
            f"While it runs, from another shell (flwr log follows the run; --show prints what is there):"
            f"\n  {prefix} {flwr} ls\n  {prefix} {flwr} log <run-id>")


RAY_READY = "Ray runtime started"  # what `ray start --block` prints once its head node is up


def ray_token_auth() -> dict[str, str]:
    """Ray's token authentication with a fresh random token, for the environment of a Ray cluster's start
    (the launcher's head, or a run's own `ray.init`) and of the drivers that may join it: that cluster
    takes no driver without the token. (Ray's GCS and raylet listen on every interface and run whatever
    a connected driver sends.)"""
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}


class RayHead(NamedTuple):
    """A Ray head of the launch's own: its process, a private temp folder, and what a driver needs to join it
    (`join_env`: RAY_ADDRESS and the head's token)."""

    proc: subprocess.Popen
    temp: Path
    join_env: dict[str, str]


def start_ray_head(env: dict, log_file: Path) -> RayHead:
    """A Ray head of this launch's own, shared by its runs: each run's simulation joins it (`join_env` in the
    SuperLink's environment) instead of starting Ray (2.4-3.5 s of `ray.init` per run, in round 1).
    `ray start --head --block` in its own process group, on free ports, with a private temp folder
    (short: Ray's socket paths must fit in 107 characters), taking only drivers that show its token
    (`ray_token_auth`; without it anyone who can reach its port runs code as this user). `wait_ray_head`
    waits for it, `stop_ray_head` ends it by PID and group."""
    taken: set[int] = set()
    temp = Path(tempfile.mkdtemp(prefix="dpfl-ray-"))
    port = free_port(taken)
    auth = ray_token_auth()
    cmd = [str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", str(port),
           "--include-dashboard=false",
           "--disable-usage-stats", "--temp-dir", str(temp),
           "--dashboard-agent-listen-port", str(free_port(taken)), "--metrics-export-port", str(free_port(taken)),
           "--ray-client-server-port", str(free_port(taken)),
           "--min-worker-port", "0", "--max-worker-port", "0"]  # workers: ports the OS picks (Ray: 10002-19999)
    with open(log_file, "wb") as log:
        proc = subprocess.Popen(cmd, env={**env, **auth}, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    return RayHead(proc, temp, {"RAY_ADDRESS": f"127.0.0.1:{port}", **auth})


def wait_ray_head(proc: subprocess.Popen, log_file: Path, timeout: float = 60) -> bool:
    """Is the head up (within `timeout` s)? False, and a message, where it exited or is still starting."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if RAY_READY in log_file.read_text(errors="replace"):
            return True
        time.sleep(0.2)
    print(f"The shared Ray head did not start ({'exit code ' + str(proc.returncode) if proc.poll() is not None else 'timeout'}; "
          f"see {log_file}): each run starts Ray itself", file=sys.stderr)
    return False


def stop_ray_head(head: RayHead | None) -> None:
    """End the head's processes at once (Ray's own graceful stop takes 3.5 s and keeps nothing we need; its
    object store leaves no files), then its temp folder."""
    if head is not None:
        end_process_tree(head.proc, grace=0)
        shutil.rmtree(head.temp, ignore_errors=True)


def start_superlink(env: dict, http_port: int, control_port: int, log_file: Path) -> subprocess.Popen:
    """Start our own local simulation SuperLink (its own process group) and wait until it is healthy."""
    cmd = [str(BIN / "flower-superlink"), "--insecure", "--simulation", "--isolation", "subprocess",
           "--control-api-address", f"127.0.0.1:{control_port}", "--host", "127.0.0.1",
           "--port", str(http_port), "--database", str(Path(env["FLWR_HOME"]) / "state.db"),
           "--log-file", str(log_file)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"flower-superlink exited with code {proc.returncode}; see {log_file}")
        if superlink_healthy(http_port):
            return proc
        time.sleep(0.5)
    stop(proc, env["FLWR_HOME"])
    sys.exit(f"flower-superlink did not become healthy within 60 s; see {log_file}")


STOP_LIMIT = 90  # seconds: stop() takes at most 20 + 5 + 10 s plus its scans of /proc


def stop(proc: subprocess.Popen | None, home: str) -> None:
    """End the SuperLink we started and everything it spawned (the simulation and Ray run in its process
    group), by PID and group: SIGTERM, up to 20 s for the whole group to exit, then SIGKILL. Waiting for the
    SuperLink alone left a `flwr-simulation` that outlived its SIGTERM running after Ctrl-C."""
    if proc is None:
        return
    # A second Ctrl-C or SIGTERM waits until the cleanup is done instead of cutting it short; the watchdog
    # bounds how long that can be (never hang here: print where, and exit)
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGHUP})
    faulthandler.dump_traceback_later(STOP_LIMIT, exit=True)
    try:
        end_process_tree(proc, grace=20)
        end_processes_with_home(home)  # anything of this launch (its private FLWR_HOME) that left the group
    finally:
        faulthandler.cancel_dump_traceback_later()
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def run_status(run_dir: Path) -> str:
    """What the run folder says: completed, failed, running (a ServerApp that died), or missing."""
    status = run_dir / "status.json"
    return json.loads(status.read_text()).get("status", "missing") if status.exists() else "missing"


def flwr_run(env: dict, run_config: str, clients: int, gpus_per_client: float = 0.0, cpus_per_client: int = 1) -> int:
    cmd = [str(BIN / "flwr"), "run", str(ROOT), "--stream", "--run-config", run_config,
           "--federation-config", federation_config(clients, gpus_per_client, cpus_per_client)]
    print("$", " ".join(shlex.quote(c) for c in cmd), flush=True)
    return call_plain_when_piped(cmd, env)  # Flower's colour codes only on a terminal


def format_run_config(values: dict) -> str:
    """`key=value ...` as `flwr run --run-config` reads it (strings quoted)."""
    def literal(v) -> str:
        if isinstance(v, bool):
            return str(v).lower()
        return f"'{v}'" if isinstance(v, str) else repr(v)
    return " ".join(f"{k}={literal(v)}" for k, v in values.items())


def reference_run_config(run_config: str) -> str:
    """The non-private reference of a run: its algorithm's `reference` overrides (fl_app.algorithms)."""
    from flwr.common.config import parse_config_args

    from fl_app.algorithms import reference_overrides
    from fl_app.config import SPEC

    overrides = parse_config_args([run_config]) if run_config.strip() else {}
    return format_run_config(reference_overrides(overrides, {k: spec.default for k, spec in SPEC.items()}))


def sweep_runs(run_config: str, sweep: str) -> list[tuple[str, str]]:
    """(name, run config) per value of `sweep` = "key=v1,v2,...", each value added to `run_config`."""
    key, sep, values = sweep.partition("=")
    if not sep or not key.strip() or not values.strip():
        raise SystemExit(f"--sweep {sweep!r}: expected key=v1,v2,... (e.g. noise-multiplier=0.5,1,2)")
    return [(f"{key.strip()}-{v.strip()}", f"{run_config} {key.strip()}={v.strip()}".strip())
            for v in values.split(",") if v.strip()]


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
    parser.add_argument("--sweep", default="", help="one run per value: 'key=v1,v2,...' (e.g. noise-multiplier=0.5,1,2)")
    parser.add_argument("--no-ray-head", dest="ray_head", action="store_false",
                        help="let each run start Ray itself (default: one Ray head for all runs of this launch, "
                             "unless RAY_ADDRESS already names a cluster)")
    parser.add_argument("--gpus-per-client", type=float, default=None,
                        help="GPUs each simulated client asks Ray for (default: the visible GPUs shared by the "
                             "clients that run at once, 1 / min(clients, CPUs) of one GPU; none without a GPU "
                             "or with device='cpu')")
    parser.add_argument("--cpus-per-client", type=int, default=1, choices=range(1, 1025), metavar="C",
                        help="CPUs each simulated client asks Ray for: at most CPUs / C clients (Ray workers, about "
                             "1 GB each) run at once (default 1)")
    args = parser.parse_args(argv)
    gpus = gpus_per_client(args.gpus_per_client, args.clients, args.run_config, args.cpus_per_client)
    if hasattr(faulthandler, "register"):  # `kill -USR1 <pid>` prints where the launcher is (a hang's report)
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    for sig in (signal.SIGTERM, signal.SIGHUP):  # a scheduler's stop or a closed terminal: clean up as on Ctrl-C
        signal.signal(sig, exit_on_signal)

    base = {**os.environ, **QUIET_ENV}
    stamp = time.strftime("%Y%m%d-%H%M%S")
    runs = sweep_runs(args.run_config, args.sweep) if args.sweep else [("dp", args.run_config)]
    if args.reference:
        runs.append(("reference", reference_run_config(args.run_config)))
    log_dir = Path(args.results)
    log_dir.mkdir(parents=True, exist_ok=True)
    env, http_port, control_port = own_superlink_env(base, log_dir / f".flwr-home-{stamp}-{os.getpid()}")
    own_ray = not env.get("RAY_ADDRESS")  # a cluster the user named keeps its own settings
    head = start_ray_head(env, log_dir / "ray-head.log") if args.ray_head and own_ray else None
    if head is not None:
        env.update(head.join_env)  # the SuperLink's simulations join it
    elif own_ray:
        env.update(ray_token_auth())  # each run's own Ray takes only its own drivers
    proc = None
    run_dirs = []
    try:
        proc = start_superlink(env, http_port, control_port, log_dir / "superlink.log")  # while the head starts
        print(superlink_hint(env, http_port, control_port), flush=True)
        if head is not None and not wait_ray_head(head.proc, log_dir / "ray-head.log"):
            stop(proc, env["FLWR_HOME"])
            del env["RAY_ADDRESS"]  # each run's own Ray, with the head's token
            proc = start_superlink(env, http_port, control_port, log_dir / "superlink.log")
        for name, overrides in runs:
            run_dir = Path(args.results, f"{stamp}-{name}").resolve()
            rc = flwr_run(env, f"{overrides} results-dir='{run_dir}'".strip(), args.clients, gpus, args.cpus_per_client)
            status = run_status(run_dir)
            if rc != 0 or status != "completed":
                print(f"Run '{name}' did not complete (flwr run exit code {rc}, run folder status {status!r}); "
                      "see the log above and its status.json", file=sys.stderr)
                return rc or 1
            run_dirs.append(run_dir)
    finally:
        stop_ray_head(head)  # first, as a group (its agents, signalled one by one by stop(), linger 20 s)
        stop(proc, env["FLWR_HOME"])
    for run_dir in run_dirs:
        s = json.loads((run_dir / "summary.json").read_text())
        d = json.loads((run_dir / "diagnostics-summary.json").read_text())
        accuracy = (f"final_accuracy={s['final_accuracy']:.4f}" if s.get("final_accuracy") is not None else
                    f"personalized_accuracy={d['personalized_accuracy']:.4f} (not private)"
                    if d.get("personalized_accuracy") is not None else "")
        print(f"{run_dir}: {s['strategy']} {accuracy} epsilon={s['epsilon']} delta={s['delta']:.3g} "
              f"rounds={s['rounds_completed']}")
    if len(run_dirs) > 1:
        from fl_app.results import plot_runs

        print("comparison plot:", plot_runs(run_dirs, run_dirs[0] / "plot-vs-reference.png"))
        print("report: python -m fl_app.report", " ".join(shlex.quote(str(d)) for d in run_dirs),
              "-o", shlex.quote(str(Path(args.results, f"{stamp}-report.html"))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
