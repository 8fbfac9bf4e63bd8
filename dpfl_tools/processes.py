"""The processes the tooling starts: free ports, and ending a process with everything it started.

`end_process_tree` ends a process, its descendants (by PID) and its process group; `end_processes_with_home`
whatever is left that carries a launch's private FLWR_HOME; `die_with_launcher` makes a child end with its
parent, however the parent dies. Linux (/proc, prctl).
"""

from __future__ import annotations

import ctypes
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

BIN = Path(sys.executable).parent  # this Python's environment's commands
FLOWER_QUIET_ENV = {  # every Flower process this tooling starts
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
}
PORT_RANGE = (19000, 19999)


def command(name: str) -> str:
    """The path of the Flower or Ray command `name`: beside this Python (its environment's bin), else the one on
    PATH, where `pip install --user` or `--target` puts it; BIN's where there is neither (its error names that)."""
    beside = BIN / name
    return str(beside) if beside.exists() else shutil.which(name) or str(beside)


def free_port(taken: set[int]) -> int:
    """A port in 19000-19999 that nothing listens on (bind test on 127.0.0.1)."""
    for port in random.sample(range(*PORT_RANGE), PORT_RANGE[1] - PORT_RANGE[0]):
        if port in taken:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        taken.add(port)
        return port
    raise RuntimeError("no free port in 19000-19999")


def descendants(pid: int) -> list[int]:
    """PIDs of all living descendants of `pid` (from /proc; detached children keep their parent)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def end_process_tree(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM the process, its descendants (by PID: some detach into their own session) and its
    process group (it was started as a group leader; orphans stay in it), wait, then SIGKILL."""
    pids = [*([proc.pid] if proc.poll() is None else []), *descendants(proc.pid)]
    _signal(pids, proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and (any(alive(p) for p in pids) or group_alive(proc.pid)):
        proc.poll()
        time.sleep(0.2)
    _signal([p for p in pids if alive(p)], proc.pid, signal.SIGKILL)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def end_processes_with_home(home: str, grace: float = 10.0) -> None:
    """SIGTERM, wait, then SIGKILL every living process whose environment sets FLWR_HOME=`home` (a private
    folder per launch): what outlived its process tree and group, e.g. Ray processes in a session of their own."""
    marker = f"FLWR_HOME={home}".encode() + b"\0"
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and entry.name != str(os.getpid()):
            try:
                if marker in (entry / "environ").read_bytes() and alive(int(entry.name)):
                    pids.append(int(entry.name))
            except OSError:
                continue
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while sig == signal.SIGTERM and time.monotonic() < deadline and any(alive(p) for p in pids):
            time.sleep(0.2)
        pids = [p for p in pids if alive(p)]


def _signal(pids: list[int], group: int, sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    try:
        os.killpg(group, sig)
    except (ProcessLookupError, PermissionError):
        pass


def group_alive(group: int) -> bool:
    """Does a living (non-zombie) process remain in process group `group`?"""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == group and fields[0] != "Z":
                return True
    return False


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


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
