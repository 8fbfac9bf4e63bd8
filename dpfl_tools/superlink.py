"""The one way the tooling starts a `flower-superlink`, for the launcher and the loopback deployment alike: its
command line (`superlink_command`) and the wait until it is ready (`wait_ready`). Then the launcher's own
simulation SuperLink on free ports with a private FLWR_HOME (`own_superlink_env`, `start_local_superlink`), the
hint that reaches it, and its stop.
"""

from __future__ import annotations

import faulthandler
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from dpfl_tools.processes import BIN, command, die_with_launcher, end_process_tree, end_processes_with_home, free_port


class SuperLinkFailed(RuntimeError):
    """A SuperLink that exited or did not become ready; `proc` is left to the caller to end."""

    def __init__(self, message: str, proc: subprocess.Popen) -> None:
        super().__init__(message)
        self.proc = proc


def superlink_command(
    port: int,
    *,
    certificates: dict[str, Path] | None = None,
    supernode_auth: bool = False,
    simulation: tuple[int, Path, Path] | None = None,
    database: Path | None = None,
) -> list[str]:
    """`flower-superlink` on 127.0.0.1:`port`, runtime dependency installation off: with TLS from `certificates`
    (ca, cert, key) or else --insecure; `supernode_auth`: SuperNode authentication; `simulation`: (control API
    port, state database, log file) of a simulation SuperLink that runs each ServerApp in a subprocess;
    `database`: the state file (registered SuperNodes, runs, messages) that a restarted SuperLink reopens
    (Flower's default: state in memory, gone with the process)."""
    cmd = [command("flower-superlink"), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--disable-runtime-dependency-installation"]
    if certificates:
        cmd += ["--ssl-ca-certfile", str(certificates["ca"]), "--ssl-certfile", str(certificates["cert"])]
        cmd += ["--ssl-keyfile", str(certificates["key"])]
    else:
        cmd += ["--insecure"]
    if supernode_auth:
        cmd += ["--enable-supernode-auth"]
    if simulation:
        control_port, database, log_file = simulation
        cmd += ["--simulation", "--isolation", "subprocess", "--control-api-address", f"127.0.0.1:{control_port}"]
        cmd += ["--database", str(database), "--log-file", str(log_file)]
    elif database is not None:
        cmd += ["--database", str(database)]
    return cmd


def wait_ready(proc: subprocess.Popen, ready: Callable[[], bool], log_file: Path, timeout: float = 60) -> None:
    """Wait until the started SuperLink `proc` is `ready()`; SuperLinkFailed where it exits first or is not ready
    within `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SuperLinkFailed(f"flower-superlink exited with code {proc.returncode}; see {log_file}", proc)
        if ready():
            return
        time.sleep(0.3)
    raise SuperLinkFailed(f"flower-superlink did not become ready within {timeout:g} s; see {log_file}", proc)


def superlink_healthy(port: int) -> bool:
    """Does the SuperLink on 127.0.0.1:`port` answer its /health endpoint?"""
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).is_success
    except httpx.HTTPError:
        return False


def own_superlink_env(base: dict, home: Path) -> tuple[dict, int, int]:
    """(environment, HTTP port, control port) of a SuperLink of our own: free ports, a private FLWR_HOME.

    `flwr run` finds its local SuperLink through FLWR_LOCAL_SUPERLINK_HTTP_API_PORT and
    FLWR_LOCAL_CONTROL_API_PORT, so it talks to this one and never to one started elsewhere. This Python's
    own bin folder goes first on PATH, so `.venv/bin/python -m dpfl_tools.launch` finds this environment's
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
    flwr = " ".join(shlex.quote(c) for c in [*(enter or []), command("flwr")])
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


def start_local_superlink(env: dict, http_port: int, control_port: int, log_file: Path) -> subprocess.Popen:
    """Start the launch's own local simulation SuperLink (its own process group) and wait until it is healthy;
    exits with the reason where it does not start."""
    database = Path(env["FLWR_HOME"]) / "state.db"
    cmd = superlink_command(http_port, simulation=(control_port, database, log_file))
    os.close(os.open(log_file, os.O_WRONLY | os.O_CREAT, 0o600))  # the owner's only (the SuperLink appends)
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        preexec_fn=die_with_launcher(),
    )
    try:
        wait_ready(proc, lambda: superlink_healthy(http_port), log_file)
    except SuperLinkFailed as failed:
        stop(proc, env["FLWR_HOME"])
        sys.exit(str(failed))
    return proc


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


@contextmanager
def own_simulation_superlink(home: Path, base: dict | None = None) -> Iterator[dict]:
    """A simulation SuperLink of our own for `flwr run` (free ports, private FLWR_HOME `home`, telemetry and
    runtime dependency installation off, this checkout first on PYTHONPATH); yields the environment that
    reaches it, and ends it by PID when done. The tests' and benchmarks' `flwr run`s use it."""
    root = Path(__file__).resolve().parents[1]
    base = dict(os.environ if base is None else base)
    base.update(
        FLWR_TELEMETRY_ENABLED="0",
        FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1",
        RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO="0",
        PYTHONPATH=os.pathsep.join(p for p in (str(root), base.get("PYTHONPATH", "")) if p),
    )
    env, http_port, control_port = own_superlink_env(base, home)
    proc = start_local_superlink(env, http_port, control_port, home / "superlink.log")
    try:
        yield env
    finally:
        stop(proc, env["FLWR_HOME"])


def flwr_run_simulation(env: dict, app: Path, run_config: dict, supernodes: int, timeout: float = 600):
    """Plain `flwr run <app> --stream` with `run_config` on `supernodes` simulated SuperNodes of one CPU each,
    through the SuperLink `env` reaches (`own_simulation_superlink`); the finished process, output captured."""
    from dpfl_tools.plan import format_run_config
    from dpfl_tools.processes import BIN

    return subprocess.run(
        [str(BIN / "flwr"), "run", str(app), "--stream", "--run-config", format_run_config(run_config)]
        + ["--federation-config", f"num-supernodes={supernodes} client-resources-num-cpus=1"],
        env=env,
        timeout=timeout,
        capture_output=True,
        text=True,
    )
