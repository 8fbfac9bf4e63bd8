"""A private network namespace for the launcher, so that only its owner can reach its SuperLink.

Flower's SuperLink (1.41/1.42, open source) takes runs from whoever reaches its loopback port: no owner-only
authentication, no Unix socket. Loopback is shared by every account on the machine; the loopback of a network
namespace of one's own is not. `isolate_network()` moves the calling process into a new network namespace
whose loopback is up; everything it starts afterwards (SuperLink, Ray, `flwr run`) listens and connects
there. Other accounts can neither connect to those ports nor enter the namespace (setns needs
CAP_SYS_ADMIN over it, and /proc/<pid>/ns/net needs ptrace access). Its owner enters it with
`nsenter_prefix()`. Root makes the namespace directly; any other user first makes a user namespace of their
own (uid and gid mapped to themselves), in which they hold the capabilities for it. Linux only.

The launcher's isolation step: `own_user_namespace` (first, while the process is single-threaded), then
`isolate` (the runs' datasets downloaded first, unless the runs need the network: `network_need`).
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import struct
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dpfl.fl_app.settings import Settings
    from dpfl_tools.plan import PlannedRun

CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000  # linux/sched.h
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1  # linux/sockios.h, linux/if.h
CAP_SYS_ADMIN = 21
IFREQ = "16sH22x"  # struct ifreq: the interface name, then ifr_flags in a 24-byte union


def unshare(flags: int) -> None:
    """unshare(2) (Python 3.11 has no os.unshare); OSError with the errno when the kernel refuses."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare: {os.strerror(err)}")


def needs_user_namespace() -> bool:
    """Does this process lack CAP_SYS_ADMIN (a non-root user), so that it needs a user namespace of its own
    to make a network namespace?"""
    with open("/proc/self/status") as status:
        caps = next(int(line.split()[1], 16) for line in status if line.startswith("CapEff:"))
    return not caps >> CAP_SYS_ADMIN & 1


def enter_user_namespace() -> None:
    """Move this process into a new user namespace with its uid and gid mapped to themselves (files and
    processes keep their owner); there it holds the capabilities to make a network namespace. The kernel
    allows this only in a single-threaded process: call it before anything starts a thread (numpy's
    OpenBLAS does at import)."""
    uid, gid = os.getuid(), os.getgid()
    unshare(CLONE_NEWUSER)
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)


def loopback_up() -> None:
    """Bring up `lo` of this process's network namespace (a new one starts with it down: no 127.0.0.1)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack(IFREQ, fcntl.ioctl(s, SIOCGIFFLAGS, struct.pack(IFREQ, b"lo", 0)))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack(IFREQ, b"lo", flags | IFF_UP))


def isolate_network(user_namespace: bool | None = None) -> None:
    """Move this process into a new network namespace with only its loopback, up. `user_namespace`: make a
    user namespace first (default: where this process lacks CAP_SYS_ADMIN; then it must be single-threaded).
    OSError with the errno where the kernel refuses (e.g. unprivileged user namespaces switched off)."""
    if needs_user_namespace() if user_namespace is None else user_namespace:
        enter_user_namespace()
    unshare(CLONE_NEWNET)
    loopback_up()


def nsenter_prefix(pid: int, user_namespace: bool) -> list[str]:
    """The command that runs a program in the network namespace of process `pid`, for its owner: root enters
    the network namespace; another user first their user namespace, keeping their uid."""
    if user_namespace:
        return ["nsenter", f"--target={pid}", "--user", "--net", "--preserve-credentials"]
    return ["nsenter", f"--target={pid}", "--net"]


def own_user_namespace(mode: str) -> bool | OSError:
    """The user namespace that a non-root launcher needs for its network namespace (`isolate`), made first: the
    kernel makes one only for a single-threaded process, and validating the config imports numpy, whose
    OpenBLAS starts threads. It changes nothing of the network by itself. True when made, False when not
    needed (root, --network-isolation off), the kernel's OSError when refused (`isolate` reports it)."""
    try:
        if mode == "off" or not needs_user_namespace():
            return False
        enter_user_namespace()
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
    from dpfl.dpcore.task.data import downloads, load_dataset

    for name, data_dir in dict.fromkeys((s.data.dataset, s.data.data_dir) for s in settings):
        if downloads(name, data_dir):
            print(f"Downloading dataset {name!r} into the cache before the network namespace closes", flush=True)
            try:
                load_dataset(name, data_dir)
            except RuntimeError as exc:
                raise SystemExit(str(exc)) from None


def isolate(mode: str, runs: list[PlannedRun], env: dict, user_namespace: bool | OSError) -> list[str] | None:
    """Move the launcher into a private network namespace (`isolate_network`) before it starts anything,
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
            isolate_network(user_namespace=False)  # root, or in its own user namespace already
            return nsenter_prefix(os.getpid(), user_namespace is True)
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
