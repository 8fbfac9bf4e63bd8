"""dpfl_tools.netns: a process in its own network namespace listens on a loopback that the rest of the machine
cannot reach and its owner can enter; the launcher's --network-isolation fallbacks and what it does first."""

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from dpfl_tools.netns import nsenter_prefix

ROOT = Path(__file__).resolve().parents[1]
NOBODY = 65534

# isolates itself, listens on a free loopback port, prints "<port> <uid> <gid> <net namespace>", waits for stdin
LISTENER = """
import os, socket, sys
from dpfl_tools.netns import isolate_network
isolate_network()
s = socket.socket()
s.bind(("127.0.0.1", 0))
s.listen()
print(s.getsockname()[1], os.getuid(), os.getgid(), os.readlink("/proc/self/ns/net"), flush=True)
sys.stdin.read()
"""
CONNECT = "import socket, sys; socket.create_connection(('127.0.0.1', int(sys.argv[1])), timeout=5).close()"


def as_nobody() -> None:
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)


def nobody_python() -> str:
    """A Python that uid 65534 may run (this venv's may sit in root's 0700 home); skip without root or one."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to run processes as uid 65534")
    for python in dict.fromkeys([sys.executable, shutil.which("python3"), "/usr/bin/python3"]):
        try:
            if python and subprocess.run([python, "-c", ""], preexec_fn=as_nobody, capture_output=True).returncode == 0:
                return python
        except OSError:  # not executable by uid 65534
            continue
    pytest.skip("no Python that uid 65534 can run")


def start_listener(python: str, preexec=None) -> tuple[subprocess.Popen, int, list[str]]:
    """The LISTENER process, its port and the rest of what it printed; skips where the kernel refuses."""
    proc = subprocess.Popen(
        [python, "-c", LISTENER],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=preexec,
    )
    line = proc.stdout.readline().split()
    if not line:
        error = proc.communicate()[1].strip().splitlines()
        pytest.skip(f"this kernel makes no network namespace here: {error[-1] if error else proc.returncode}")
    return proc, int(line[0]), line[1:]


def can_connect(port: int, command_prefix: tuple[str, ...] = (), python: str = sys.executable, preexec=None) -> bool:
    return (
        subprocess.run(
            [*command_prefix, python, "-c", CONNECT, str(port)], capture_output=True, preexec_fn=preexec, timeout=30
        ).returncode
        == 0
    )


def test_a_port_in_the_namespace_is_reachable_inside_only():
    """As root: the listener's namespace is a new one; its port cannot be reached from the test's
    namespace (the machine's loopback) but is through `nsenter_prefix` (its loopback is up)."""
    proc, port, (uid, _, net) = start_listener(sys.executable)
    try:
        assert net != os.readlink("/proc/self/ns/net") and uid == str(os.getuid())
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        assert can_connect(port, nsenter_prefix(proc.pid, user_namespace=os.geteuid() != 0))
    finally:
        proc.communicate("")


def test_another_account_can_neither_connect_nor_enter():
    """uid 65534 can neither reach a root process's isolated port nor enter its network namespace."""
    python = nobody_python()
    proc, port, _ = start_listener(sys.executable)
    try:
        assert not can_connect(port, python=python, preexec=as_nobody)
        entered = subprocess.run(
            [*nsenter_prefix(proc.pid, user_namespace=False), "true"],
            capture_output=True,
            text=True,
            preexec_fn=as_nobody,
        )
        assert entered.returncode != 0 and re.search("Permission denied|Operation not permitted", entered.stderr), (
            entered
        )
        assert can_connect(port, nsenter_prefix(proc.pid, user_namespace=False))  # while root can
    finally:
        proc.communicate("")


def test_a_non_root_user_isolates_through_a_user_namespace_of_their_own():
    """As uid 65534: a user namespace first (the uid and gid stay 65534, mapped to themselves), then the
    network namespace with loopback up; the owner enters both with `nsenter_prefix(pid, True)`, root's own
    loopback does not reach the port."""
    python = nobody_python()
    proc, port, (uid, gid, _) = start_listener(python, preexec=as_nobody)
    try:
        assert (uid, gid) == (str(NOBODY), str(NOBODY))
        assert not can_connect(port)
        inside = subprocess.run(
            [
                *nsenter_prefix(proc.pid, user_namespace=True),
                python,
                "-c",
                CONNECT + "; import os; print(os.getuid())",
                str(port),
            ],
            capture_output=True,
            text=True,
            preexec_fn=as_nobody,
            timeout=30,
        )
        assert inside.returncode == 0 and inside.stdout.split() == [str(NOBODY)], inside
    finally:
        proc.communicate("")


def test_a_dataset_downloaded_before_isolation_is_read_from_the_cache_inside(tmp_path):
    """What the launcher's prefetch relies on: load_dataset of a hub dataset (its download faked) fills the
    cache; a process in a network namespace, whose download would fail, reads the same arrays from it."""
    fake = (
        "import numpy as np, dpcore.task.data as d\n"
        "rng = np.random.default_rng(0)\n"
        "d.download = lambda name: d.RawImages(rng.integers(0, 255, (60, 28, 28), dtype=np.uint8), np.arange(60) % 10,"
        " rng.integers(0, 255, (20, 28, 28), dtype=np.uint8), np.arange(20) % 10)\n"
    )
    offline = (
        "from dpfl_tools.netns import isolate_network; isolate_network()\n"
        "import dpfl.dpcore.task.data as d\n"
        "def no_network(name): raise RuntimeError('downloaded inside the namespace')\n"
        "d.download = no_network\n"
    )
    show = "train, test = d.load_dataset('mnist'); print(float(train.x.sum()), len(test.y))"
    env = {**os.environ, "DPFL_CACHE_DIR": str(tmp_path)}
    outputs = [
        subprocess.run(
            [sys.executable, "-c", code + show], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
        )
        for code in (fake, offline)
    ]
    assert all(out.returncode == 0 for out in outputs), [out.stderr[-2000:] for out in outputs]
    assert outputs[0].stdout == outputs[1].stdout and outputs[1].stdout.split()[1] == "20"


# the launcher with unshare refused (EPERM) or faked, and downloads faked; it stops where it would start its
# first process
LAUNCH = """
import errno, sys
import dpfl_tools.launch as launch, dpfl_tools.netns as netns
import dpfl.dpcore.task.data as data
if sys.argv[1] == "refused":
    def refused(flags):
        raise OSError(errno.EPERM, "unshare: Operation not permitted")
    netns.unshare = refused
else:  # what the launcher would do, without leaving the test's network
    netns.isolate_network = lambda **kw: print("isolated", flush=True)
data.load_dataset = lambda name, data_dir="": print("downloaded", name, flush=True)
def first_process(home):
    print("started", flush=True)
    sys.exit(0)
launch.start_watchdog = first_process
sys.exit(launch.main(sys.argv[2:]))
"""


def launch_until_started(tmp_path, unshare: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", LAUNCH, unshare, "--clients", "2", "--results", str(tmp_path / "results"), *args],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )


REACHABLE = "this launch's SuperLink is reachable by every local account on this machine"


@pytest.mark.parametrize("mode", ["auto", "require"])
@pytest.mark.slow  # 2-9 s together: the fast tier keeps its 5-minute margin on 2 cores
def test_a_refused_namespace_warns_or_stops_the_launch(tmp_path, mode):
    """The kernel refuses: auto says so in one line (with the errno) and starts the launch; require exits
    with the reason before anything starts (no results folder either)."""
    out = launch_until_started(tmp_path, "refused", "--network-isolation", mode)
    reason = "no private network namespace ([Errno 1] unshare: Operation not permitted)"
    if mode == "auto":
        assert out.returncode == 0 and out.stdout.split() == ["started"], out
        assert out.stderr == f"Network isolation: {reason}; {REACHABLE}, and runs submitted to it execute as you\n"
    else:
        assert out.returncode == 1 and "started" not in out.stdout, out
        assert out.stderr.strip() == f"--network-isolation require: {reason}"
        assert not (tmp_path / "results").exists()


@pytest.mark.parametrize("mode", ["auto", "require"])
@pytest.mark.parametrize("need", ["wandb-online", "ray-address"])
@pytest.mark.slow  # 2-9 s together: the fast tier keeps its 5-minute margin on 2 cores
def test_runs_that_need_the_network_skip_isolation_or_are_refused(tmp_path, mode, need):
    """W&B online mode (the ServerApp logs through the network) and a Ray cluster named in RAY_ADDRESS."""
    args = ["-c", "wandb=true wandb-mode='online'"] if need == "wandb-online" else []
    env = {"RAY_ADDRESS": "10.0.0.1:6379"} if need == "ray-address" else {}
    out = launch_until_started(tmp_path, "allowed", "--network-isolation", mode, *args, env=env)
    assert "isolated" not in out.stdout
    why = "wandb-mode='offline'" if need == "wandb-online" else "RAY_ADDRESS=10.0.0.1:6379 names a Ray cluster"
    assert "not isolated because" in out.stderr and why in out.stderr, out
    if mode == "auto":
        assert out.returncode == 0 and out.stdout.split() == ["started"] and REACHABLE in out.stderr, out
    else:
        assert out.returncode == 1 and out.stderr.startswith("--network-isolation require: not isolated"), out


@pytest.mark.slow
def test_datasets_that_download_are_loaded_once_before_isolating_and_off_leaves_the_network_alone(tmp_path):
    """A hub dataset is loaded once for both runs (--reference), before the namespace; an embedded one is not;
    --network-isolation off does neither."""
    mnist = ["--reference", "-c", "dataset='mnist' model='mlp'"]
    isolated = launch_until_started(tmp_path, "allowed", *mnist)
    assert isolated.returncode == 0 and isolated.stdout.splitlines() == [
        "Downloading dataset 'mnist' into the cache before the network namespace closes",
        "downloaded mnist",
        "isolated",
        "started",
    ], isolated
    embedded = launch_until_started(tmp_path, "allowed", "-c", "dataset='digits' model='mlp'")
    assert embedded.returncode == 0 and embedded.stdout.split() == ["isolated", "started"], embedded
    off = launch_until_started(tmp_path, "allowed", "--network-isolation", "off", *mnist)
    assert off.returncode == 0 and off.stdout.split() == ["started"] and off.stderr == "", off
