"""A Ray head of the launch's own, shared by its runs, which takes only drivers that show its random token."""

from __future__ import annotations

import fcntl
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

from dpfl.dpcore.task.atomic import lock_held
from dpfl_tools.processes import command, die_with_launcher, end_process_tree, free_port

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
    owner_lock: int = -1  # an open descriptor of temp/OWNER_LOCK, flock'ed while this launch lives


TEMP_PREFIX = "dpfl-ray-"
OWNER_LOCK = ".dpfl-launch.lock"


def hold_owner_lock(temp: Path) -> int:
    """Lock temp/OWNER_LOCK for as long as this process lives (the kernel drops it when the launch dies, however
    it dies): what tells a later launch that the folder is stale."""
    fd = os.open(temp / OWNER_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def remove_stale_ray_temps(parent: Path | None = None) -> list[Path]:
    """Remove the Ray temp folders of this user's dead launches (their owner lock is free, or they have none: a
    launch killed before it took it); those of live launches stay. Returns what was removed."""
    removed = []
    for folder in Path(parent or tempfile.gettempdir()).glob(TEMP_PREFIX + "*"):
        try:
            if not folder.is_dir() or folder.is_symlink() or folder.stat().st_uid != os.getuid():
                continue
            if lock_held(folder / OWNER_LOCK):
                continue  # a live launch's
        except OSError:
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed


def start_ray_head(env: dict, log_file: Path, taken: set[int] = frozenset()) -> RayHead:
    """A Ray head of this launch's own, shared by its runs: each run's simulation joins it (`join_env` in the
    SuperLink's environment) instead of starting Ray (2.4-3.5 s of `ray.init` per run, in round 1).
    `ray start --head --block` in its own process group, on free ports, with a private temp folder
    (short: Ray's socket paths must fit in 107 characters), taking only drivers that show its token
    (`ray_token_auth`; without it anyone who can reach its port runs code as this user). `wait_ray_head`
    waits for it, `stop_ray_head` ends it by PID and group. `taken`: ports it must not use (the SuperLink's,
    free until it starts)."""
    taken = set(taken)
    remove_stale_ray_temps()
    temp = Path(tempfile.mkdtemp(prefix=TEMP_PREFIX))  # 0700; Ray makes its own --temp-dir 0777, so that goes inside
    owner_lock = hold_owner_lock(temp)
    port = free_port(taken)
    auth = ray_token_auth()
    cmd = [
        command("ray"),
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
    return RayHead(proc, temp, {"RAY_ADDRESS": f"127.0.0.1:{port}", **auth}, owner_lock)


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
        if head.owner_lock >= 0:
            os.close(head.owner_lock)
