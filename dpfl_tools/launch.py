"""Run the app with `flwr run` in local simulation, and clean up after it.

    python -m fl_app.launch [--clients N] [--reference] [-c "key=value ..."] [--sweep "key=v1,v2,..."]
    python -m fl_app.launch --resume RUN_DIR [--clients N] [-c "num-rounds=..."]

What it does, so that nothing is left behind:
0. checks every run's config (pyproject's defaults and the overrides, as the ServerApp will) and --clients
   against min-nodes, and exits with the one-line reason before it starts anything; then moves itself into a
   private network namespace (`--network-isolation`, fl_app.netns), so that what it starts listens on a
   loopback no other local account can reach (Flower's SuperLink takes runs from anyone who reaches it),
   after downloading the runs' datasets into the cache;
1. starts its own local simulation SuperLink on free ports with a private FLWR_HOME (never one
   that is already running: `flwr run` is pointed at this one), with runtime dependency
   installation and telemetry off, and remembers its PID; next to it, a Ray head of its own that every
   run's simulation connects to (RAY_ADDRESS), so no run pays Ray's start-up in its round 1
   (`--no-ray-head`: each run starts Ray itself, as plain `flwr run` does); either Ray takes only drivers
   with the launch's random token (`ray_token_auth`);
2. `flwr run . --stream` with N simulated clients, one CPU each (`--cpus-per-client`) and a share of the
   GPUs where torch sees any (`--gpus-per-client`; `fl_app.simulation_resources`), and
   results-dir = ./results/<time>-<random>-<name> (or the results-dir given; --resume: the run folder);
3. with --reference, a second run without clipping or noise (the non-private
   FedAvg reference) and one plot with both; with --sweep key=v1,v2,..., one run per value
   (e.g. noise multipliers: the points of the privacy-utility frontier in `python -m fl_app.report`);
4. ends the SuperLink and the Ray head it started, by PID and process group, also after Ctrl-C or a failed run, and exits
   non-zero unless every run folder says `completed` (status.json); a SIGKILLed launcher takes them along too
   (each child gets SIGTERM when it dies, PR_SET_PDEATHSIG, and a watchdog process ends what they leave).

The tools come from this Python's own environment (`.venv/bin/python -m fl_app.launch` works without an
activated venv); `kill -USR1 <launcher pid>` prints where the launcher is, should it ever seem stuck.
"""

from __future__ import annotations

import argparse
import ctypes
import faulthandler
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import httpx

from fl_app import netns
from fl_app.local_deployment import BIN, end_process_tree, end_processes_with_home, free_port
from fl_app.plain_output import call_plain_when_piped
from fl_app.pull_backoff import SPEED_PATCHES_ENV
from fl_app.simulation_resources import federation_config, gpus_per_client

if TYPE_CHECKING:  # not imported at start: the user namespace needs a process without threads (numpy starts some)
    from fl_app.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
QUIET_ENV = {  # the SuperLink and the simulation it starts inherit these
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
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
    home.chmod(0o700)  # its state.db: the runs' configs and messages
    env = {
        **base,
        "FLWR_HOME": str(home),
        "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(http_port),
        "FLWR_LOCAL_CONTROL_API_PORT": str(control_port),
        "PATH": f"{BIN}{os.pathsep}{base.get('PATH', '')}",
    }
    return env, http_port, control_port


def superlink_hint(env: dict, http_port: int, control_port: int, enter: list[str] | None = None) -> str:
    """Where this launch's SuperLink listens, and the `flwr ls` / `flwr log` commands that reach it from another
    shell while the launch runs: `flwr` finds a local SuperLink only through FLWR_HOME and the two port
    variables (without them it starts a SuperLink of its own on Flower's default ports). `enter`: the
    `nsenter` command into the launcher's private network namespace (`isolate`), which the commands go through."""
    prefix = " ".join(
        f"{key}={shlex.quote(env[key])}"
        for key in ("FLWR_HOME", "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT", "FLWR_LOCAL_CONTROL_API_PORT")
    )
    flwr = " ".join(shlex.quote(c) for c in [*(enter or []), str(BIN / "flwr")])
    where = (
        " in the launcher's private network namespace (no other local account can reach it; the commands "
        "enter it with nsenter)"
        if enter
        else ""
    )
    return (
        f"SuperLink of this launch: 127.0.0.1:{http_port} (HTTP API), control API 127.0.0.1:{control_port}"
        f"{where}. While it runs, from another shell (flwr log follows the run; --show prints what is there):"
        f"\n  {prefix} {flwr} ls\n  {prefix} {flwr} log <run-id>"
    )


def own_user_namespace(mode: str) -> bool | OSError:
    """The user namespace that a non-root launcher needs for its network namespace (`isolate`), made first: the
    kernel makes one only for a single-threaded process, and validating the config imports numpy, whose
    OpenBLAS starts threads. It changes nothing of the network by itself. True when made, False when not
    needed (root, --network-isolation off), the kernel's OSError when refused (`isolate` reports it)."""
    try:
        if mode == "off" or not netns.needs_user_namespace():
            return False
        netns.enter_user_namespace()
    except OSError as exc:
        return exc
    return True


def network_need(settings: list[Settings], env: dict) -> str | None:
    """Why runs with these settings need the machine's network after the launch has started,
    if they do (then no network namespace): a Ray cluster named in RAY_ADDRESS, or W&B online mode, which
    the ServerApp logs through."""
    if env.get("RAY_ADDRESS"):
        return f"RAY_ADDRESS={env['RAY_ADDRESS']} names a Ray cluster outside this launch, which it must reach"
    if any(s.output.wandb and s.output.wandb_mode == "online" for s in settings):
        return (
            "run-config wandb-mode='online' needs the network from the ServerApp; with wandb-mode='offline' "
            "the run logs to its folder, and `wandb sync <run folder>/wandb/offline-run-*` uploads it after"
        )
    return None


def prefetch_datasets(settings: list[Settings]) -> None:
    """Download the runs' datasets that come from the network (`dpcore.task.data.downloads`) into the cache
    now, while the launcher still has the network; the ServerApp and ClientApps read the cache. Exits with
    the data-dir instructions when offline."""
    from dpcore.task.data import downloads, load_dataset

    for name, data_dir in dict.fromkeys((s.data.dataset, s.data.data_dir) for s in settings):
        if downloads(name, data_dir):
            print(f"Downloading dataset {name!r} into the cache before the network namespace closes", flush=True)
            try:
                load_dataset(name, data_dir)
            except RuntimeError as exc:
                raise SystemExit(str(exc)) from None


def isolate(mode: str, runs: list[PlannedRun], env: dict, user_namespace: bool | OSError) -> list[str] | None:
    """Move the launcher into a private network namespace (`netns.isolate_network`) before it starts anything,
    so that no other local account can reach its SuperLink and run code as this user; returns the `nsenter`
    command into it (for `superlink_hint`), None when not isolated. --network-isolation auto: where the
    runs need the network or the kernel refuses, one line on stderr says so and why, and the launch goes on;
    require: exits with that reason instead; off: nothing."""
    if mode == "off":
        return None
    settings = [run.settings for run in runs]
    if need := network_need(settings, env):
        problem = f"not isolated because {need}"
    elif isinstance(user_namespace, OSError):
        problem = f"no private network namespace ({user_namespace})"
    else:
        prefetch_datasets(settings)
        try:
            netns.isolate_network(user_namespace=False)  # root, or in its own user namespace already
            return netns.nsenter_prefix(os.getpid(), user_namespace is True)
        except OSError as exc:
            problem = f"no private network namespace ({exc})"
    if mode == "require":
        raise SystemExit(f"--network-isolation require: {problem}")
    print(
        f"Network isolation: {problem}; this launch's SuperLink is reachable by every local account on this "
        "machine, and runs submitted to it execute as you",
        file=sys.stderr,
        flush=True,
    )
    return None


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_launcher(sig: int = signal.SIGTERM):
    """A Popen preexec_fn: the child gets `sig` when the launcher dies, however it dies (SIGKILL included, when
    no `finally` runs), so that its SuperLink, Ray head and `flwr run` never outlive it. SIGTERM: each ends what
    it started itself. Linux only (prctl PR_SET_PDEATHSIG); None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    libc, launcher = ctypes.CDLL(None, use_errno=True), os.getpid()  # loaded before the fork

    def preexec() -> None:
        libc.prctl(PR_SET_PDEATHSIG, int(sig))
        if os.getppid() != launcher:  # the launcher died before prctl: nobody would signal this child
            os._exit(1)

    return preexec


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
    code = "import sys; from fl_app.launch import watchdog; watchdog(sys.argv[1])"
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


def start_ray_head(env: dict, log_file: Path, taken: set[int] = frozenset()) -> RayHead:
    """A Ray head of this launch's own, shared by its runs: each run's simulation joins it (`join_env` in the
    SuperLink's environment) instead of starting Ray (2.4-3.5 s of `ray.init` per run, in round 1).
    `ray start --head --block` in its own process group, on free ports, with a private temp folder
    (short: Ray's socket paths must fit in 107 characters), taking only drivers that show its token
    (`ray_token_auth`; without it anyone who can reach its port runs code as this user). `wait_ray_head`
    waits for it, `stop_ray_head` ends it by PID and group. `taken`: ports it must not use (the SuperLink's,
    free until it starts)."""
    taken = set(taken)
    temp = Path(tempfile.mkdtemp(prefix="dpfl-ray-"))  # 0700; Ray makes its own --temp-dir 0777, so that goes inside
    port = free_port(taken)
    auth = ray_token_auth()
    cmd = [
        str(BIN / "ray"),
        "start",
        "--head",
        "--block",
        "--node-ip-address",
        "127.0.0.1",
        "--port",
        str(port),
        "--include-dashboard=false",
        "--disable-usage-stats",
        "--temp-dir",
        str(temp / "r"),
        "--dashboard-agent-listen-port",
        str(free_port(taken)),
        "--metrics-export-port",
        str(free_port(taken)),
        "--ray-client-server-port",
        str(free_port(taken)),
        "--min-worker-port",
        "0",
        "--max-worker-port",
        "0",
    ]  # workers: ports the OS picks (Ray: 10002-19999)
    with open(os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as log:
        proc = subprocess.Popen(
            cmd,
            env={**env, **auth},
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=die_with_launcher(),
        )
    return RayHead(proc, temp, {"RAY_ADDRESS": f"127.0.0.1:{port}", **auth})


def wait_ray_head(proc: subprocess.Popen, log_file: Path, timeout: float = 60) -> bool:
    """Is the head up (within `timeout` s)? False, and a message, where it exited or is still starting."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if RAY_READY in log_file.read_text(errors="replace"):
            return True
        time.sleep(0.2)
    print(
        f"The shared Ray head did not start ({'exit code ' + str(proc.returncode) if proc.poll() is not None else 'timeout'}; "
        f"see {log_file}): each run starts Ray itself",
        file=sys.stderr,
    )
    return False


def stop_ray_head(head: RayHead | None) -> None:
    """End the head's processes at once (Ray's own graceful stop takes 3.5 s and keeps nothing we need; its
    object store leaves no files), then its temp folder."""
    if head is not None:
        end_process_tree(head.proc, grace=0)
        shutil.rmtree(head.temp, ignore_errors=True)


def start_superlink(env: dict, http_port: int, control_port: int, log_file: Path) -> subprocess.Popen:
    """Start our own local simulation SuperLink (its own process group) and wait until it is healthy."""
    cmd = [
        str(BIN / "flower-superlink"),
        "--insecure",
        "--simulation",
        "--isolation",
        "subprocess",
        "--control-api-address",
        f"127.0.0.1:{control_port}",
        "--host",
        "127.0.0.1",
        "--port",
        str(http_port),
        "--database",
        str(Path(env["FLWR_HOME"]) / "state.db"),
        "--log-file",
        str(log_file),
    ]
    os.close(os.open(log_file, os.O_WRONLY | os.O_CREAT, 0o600))  # the owner's only (the SuperLink appends)
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        preexec_fn=die_with_launcher(),
    )
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


def run_status(run_dir: Path, since: float = 0.0) -> str:
    """What the run folder says: completed, failed, running (a ServerApp that died), or missing; `stale` when
    its status.json was written before `since` (a previous run's, e.g. of a resume that was refused)."""
    status = run_dir / "status.json"
    if not status.exists():
        return "missing"
    record = json.loads(status.read_text())
    return record.get("status", "missing") if record.get("time", 0) >= since else "stale"


def flwr_run(env: dict, run_config: str, clients: int, gpus_per_client: float = 0.0, cpus_per_client: int = 1) -> int:
    cmd = [
        str(BIN / "flwr"),
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
    return [
        (f"{key.strip()}-{v.strip()}", f"{run_config} {key.strip()}={v.strip()}".strip())
        for v in values.split(",")
        if v.strip()
    ]


def run_stamp() -> str:
    """The start of this launch's run folder names: time to the second and 4 random hex digits, so that two
    launches in the same second into the same --results get different folders."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def app_defaults() -> dict:
    """The app's run config as `flwr run` starts from it: pyproject.toml's [tool.flwr.app.config]."""
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]


CONFIG_PAIR = re.compile(r"(\S+?)=(\'[^\']*\'|\"[^\"]*\"|\S+)")  # flwr.common.config.parse_config_args' pattern


def parse_overrides(run_config: str) -> dict:
    """`key=value ...` as `flwr run --run-config` parses it; a malformed string exits with Flower's reason."""
    import click
    from flwr.common.config import parse_config_args

    try:
        parsed = parse_config_args([run_config]) if run_config.strip() else {}
    except (click.ClickException, ValueError) as exc:
        raise SystemExit(f"-c {run_config!r}: {getattr(exc, 'message', exc)}") from None
    toml_file = run_config.strip().endswith(".toml")  # flwr run -c also takes a TOML file of overrides
    stray = [] if toml_file else CONFIG_PAIR.sub(" ", run_config).split()  # what Flower's parser skips silently
    if stray:
        raise SystemExit(
            f"-c {run_config!r}: {', '.join(map(repr, stray))} is not key=value (without spaces "
            "around '='; quote strings: key='text')"
        )
    return parsed


def resume_run_config(run_dir: Path, run_config: str) -> str:
    """The run config that continues the run in `run_dir`: its config.json's settings (those that differ from
    the defaults), then `run_config`'s overrides (e.g. num-rounds), resume = true and its results-dir."""
    from fl_app.config import SPEC

    previous = run_dir / "config.json"
    if not previous.is_file():
        raise SystemExit(f"--resume {run_dir}: {previous} does not exist (not a dpfl run folder)")
    settings = {
        k: v
        for k, v in json.loads(previous.read_text()).items()
        if k in SPEC and v != SPEC[k].default and k not in ("resume", "results-dir")
    }
    settings.update(parse_overrides(run_config))
    return format_run_config({**settings, "resume": True, "results-dir": str(run_dir)})


class PlannedRun(NamedTuple):
    """One run of a launch: its name, its run config for `flwr run` (the overrides), its folder and its
    settings (pyproject's defaults and the overrides, validated as the ServerApp will)."""

    name: str
    overrides: str
    folder: Path
    settings: Settings


def plan_runs(args: argparse.Namespace, stamp: str) -> list[PlannedRun]:
    """Each run of this launch, its config validated and --clients checked against min-nodes: a bad value
    exits here with the one-line reason, before any process starts."""
    if args.resume:
        if args.sweep or args.reference:
            raise SystemExit("--resume continues one run: it takes no --sweep or --reference")
        runs = [("resumed", resume_run_config(Path(args.resume).resolve(), args.run_config))]
    else:
        runs = sweep_runs(args.run_config, args.sweep) if args.sweep else [("dp", args.run_config)]
        if args.reference:
            runs.append(("reference", reference_run_config(args.run_config)))
    return [check_run(name, overrides, args, stamp, len(runs)) for name, overrides in runs]


def check_run(name: str, overrides: str, args: argparse.Namespace, stamp: str, count: int) -> PlannedRun:
    """One run of `plan_runs`: its folder (the results-dir it names, else <--results>/<stamp>-<name>) and its
    validated config; SystemExit with the reason otherwise."""
    from fl_app.config import ConfigError, validate
    from fl_app.results import PreviousRunError, check_resumable

    if args.clients < 1:
        raise SystemExit(f"--clients {args.clients}: must be at least 1")
    given = parse_overrides(overrides)
    if "results-dir" in given and count > 1:
        raise SystemExit(
            f"run-config key 'results-dir' = {given['results-dir']!r} names one folder for {count} "
            "runs (--sweep, --reference): leave it out, and each run gets its own under --results"
        )
    if "results-dir" not in given:
        given["results-dir"] = str(Path(args.results, f"{stamp}-{name}").resolve())
        overrides = f"{overrides} results-dir='{given['results-dir']}'".strip()
    try:
        settings = validate({**app_defaults(), **given})
        if settings.output.resume:
            check_resumable(Path(settings.output.results_dir), settings)
    except (ConfigError, PreviousRunError) as exc:
        raise SystemExit(str(exc)) from None
    min_nodes = settings.federation.min_nodes
    if args.clients < min_nodes:
        raise SystemExit(
            f"--clients {args.clients} is fewer than run-config key 'min-nodes' = {min_nodes}: "
            f"the run would wait for nodes that never come; pass --clients {min_nodes} (or more), "
            f'or -c "min-nodes={max(args.clients, 1)}"'
        )
    return PlannedRun(name, overrides, Path(settings.output.results_dir), settings)


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
    args = parser.parse_args(argv)
    user_namespace = own_user_namespace(args.network_isolation)  # first: the process must be single-threaded
    gpus = gpus_per_client(args.gpus_per_client, args.clients, args.run_config, args.cpus_per_client)
    if hasattr(faulthandler, "register"):  # `kill -USR1 <pid>` prints where the launcher is (a hang's report)
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    for sig in (signal.SIGTERM, signal.SIGHUP):  # a scheduler's stop or a closed terminal: clean up as on Ctrl-C
        signal.signal(sig, exit_on_signal)

    base = {**os.environ, **QUIET_ENV}
    stamp = run_stamp()
    runs = plan_runs(args, stamp)  # every run's config checked before anything starts
    if any(run.settings.federation.flower_speed_patches for run in runs):
        base[SPEED_PATCHES_ENV] = "1"  # the simulation's opt-in patches (fl_app.simulation_pickup)
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
        proc = start_superlink(env, http_port, control_port, log_dir / "superlink.log")  # while the head starts
        print(superlink_hint(env, http_port, control_port, enter), flush=True)
        if head is not None and not wait_ray_head(head.proc, log_dir / "ray-head.log"):
            stop(proc, env["FLWR_HOME"])
            del env["RAY_ADDRESS"]  # each run's own Ray, with the head's token
            proc = start_superlink(env, http_port, control_port, log_dir / "superlink.log")
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
        from fl_app.results import plot_runs

        print("comparison plot:", plot_runs(run_dirs, run_dirs[0] / "plot-vs-reference.png"))
        print(
            "report: python -m fl_app.report",
            " ".join(shlex.quote(str(d)) for d in run_dirs),
            "-o",
            shlex.quote(str(Path(args.results, f"{stamp}-report.html"))),
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
