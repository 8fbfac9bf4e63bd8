"""A SuperExec for `flower-supernode --isolation process` that keeps torch and flwr imported.

    python -m dpfl_tools.clientapp_executor --runtime-api-address 127.0.0.1:<supernode --port> --insecure \
        [--parent-pid <supernode pid>] [--poll-interval 0.05]

Flower 1.41 runs every message in a fresh `flwr-clientapp` process that imports flwr, torch and the
app again (about 3 s here before any training). This executor imports the heavy libraries once, then
asks the SuperNode's Runtime API for ClientApp tasks exactly as `flower-superexec` does and forks one
child per task, which runs Flower's own `run_clientapp` (pull the message and the FAB, install it,
import the app from it, reply, exit). Each message still gets its own process, imports the app's own
modules fresh from its FAB and keeps nothing in memory between messages; only the libraries named in
`--preload` (never app code) are shared, copy-on-write, with torch's first-use costs already paid. A child's random state is made fresh after the
fork (`fresh_random_state`), as a new process's would be.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import time

from dpfl_tools.pull_backoff import PULL_BACKOFF, flower_patch_problem, pull_backoff_option, shorten_pull_backoff

APP_NAMESPACE = "dpfl"  # every package of the app is under it (installed or in a FAB): a task takes them from its FAB
PRELOAD = ("numpy", "torch", "flwr.supernode.runtime.run_clientapp")


def warm_up_torch() -> None:
    """Pay torch's lazy first-use costs (autograd engine, oneDNN kernels) once, on a throw-away network of
    its own, single-threaded (no OpenMP pool exists when the executor forks). No torch.optim optimizer:
    the app's local training does not construct one (clients.base.LocalSGD), so torch._dynamo, which the
    first one imports, stays out of the executor and its children."""
    import torch

    torch.set_num_threads(1)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.MaxPool2d(2), torch.nn.Flatten(), torch.nn.Linear(100, 3)
    )
    for _ in range(2):
        net.zero_grad()
        torch.nn.functional.cross_entropy(net(torch.randn(2, 1, 12, 12)), torch.tensor([0, 1])).backward()


def fresh_random_state() -> None:
    """In a forked child: what a fresh process would have. Python's `random` reseeds itself at fork;
    numpy's and torch's global generators do not, so both are reseeded from OS entropy (a fresh torch
    2.14 process starts from a random seed too). The app's DP noise never uses them (it draws from
    `secrets`), but nothing a task draws may repeat in the next task."""
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if "torch" in sys.modules:
        sys.modules["torch"].seed()


def forget_own_modules() -> None:
    """In a forked child, before the task loads its app: drop `dpfl` and its modules (the app's packages,
    `dpfl.fl_app` and the rest, imported to run this executor) from `sys.modules`. Flower's `load_app` imports the
    app from the run's FAB folder but keeps a package already imported, so without this a task would run the
    executor's installed `dpfl.fl_app` beside the FAB's other packages. (Named, not taken from `__name__`, which
    is `__main__` under `python -m`: that once left the executor's `fl_app` in every task.)"""
    for name in [m for m in sys.modules if m.partition(".")[0] == APP_NAMESPACE]:
        del sys.modules[name]


def run_task(runtime_api_address: str, token: str, insecure: bool, certificates: bytes | None) -> int:
    """In the child: one ClientApp task through Flower's own code path; returns the exit code."""
    from flwr.supernode.runtime.run_clientapp import run_clientapp

    fresh_random_state()
    forget_own_modules()
    try:
        run_clientapp(
            runtime_api_address=runtime_api_address,
            token=token,
            insecure=insecure,
            certificates=certificates,
            parent_pid=os.getppid(),
            runtime_dependency_install=False,
        )
    except SystemExit as done:  # flwr_exit ends the task with sys.exit
        return done.code if isinstance(done.code, int) else 1
    finally:  # which copy of the app the task ran (the run's FAB, never the executor's own)
        app = sys.modules.get("dpfl.fl_app")
        print(
            f"ClientApp task pid {os.getpid()} ran fl_app from "
            f"{os.path.dirname(os.path.dirname(app.__file__)) if app else '(not loaded)'}",
            flush=True,
        )
    return 0


def fork_task(target, *args) -> int:
    """Run `target(*args)` in a forked child that ends with its return value; return the child's PID."""
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        code = target(*args)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runtime-api-address", required=True, help="the SuperNode's Runtime API (its --port)")
    parser.add_argument("--insecure", action="store_true", help="plain HTTP to the Runtime API")
    parser.add_argument("--root-certificates", help="CA certificate of the Runtime API (TLS)")
    parser.add_argument("--parent-pid", type=int, help="exit when this process (the SuperNode) is gone")
    parser.add_argument("--poll-interval", type=float, default=0.05, help="seconds between task requests")
    parser.add_argument("--preload", default=",".join(PRELOAD), help="modules imported once (libraries only)")
    parser.add_argument(
        "--pull-backoff",
        type=pull_backoff_option,
        default=PULL_BACKOFF,
        help="seconds before a task retries pulling a message not yet on the node (Flower: 1)",
    )
    args = parser.parse_args(argv)
    if args.insecure == bool(args.root_certificates):
        parser.error("give exactly one of --insecure and --root-certificates")
    if problem := flower_patch_problem():  # it speaks Flower's internal Runtime API
        raise SystemExit(
            f"dpfl_tools.clientapp_executor: {problem}; run the SuperNode without it (Flower's own "
            "flwr-clientapp per message)"
        )
    for module in filter(None, args.preload.split(",")):
        importlib.import_module(module)
    if "torch" in sys.modules:
        warm_up_torch()
    backoff = (
        f"message pull retried after {args.pull_backoff} s"
        if shorten_pull_backoff(args.pull_backoff)
        else "Flower's message pull backoff (this flwr has no default to set)"
    )

    from flwr.proto.runtime_pb2 import AcquireTaskRequest  # pylint: disable=E0611
    from flwr.supercore.constant import TaskType
    from flwr.supercore.interceptors import RuntimeVersionHttpInterceptor
    from flwr.supercore.retry import make_simple_http_retry_invoker
    from flwr.supercore.runtime import RuntimeHttpClient
    from flwr.supercore.tls import validate_and_resolve_root_certificates

    certificates = validate_and_resolve_root_certificates(args.root_certificates, args.insecure)
    client = RuntimeHttpClient.from_server_address(
        server_address=args.runtime_api_address,
        insecure=args.insecure,
        root_certificates=certificates,
        interceptors=[RuntimeVersionHttpInterceptor(component_name="SuperExec")],
        retry_invoker=make_simple_http_retry_invoker(),
    )
    children: dict[int, float] = {}  # pid -> when it was forked (time.time())

    def stop(signum, _frame) -> None:
        for pid in children:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        client.close()
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    request = AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP])
    print(f"ClientApp executor ready (pid {os.getpid()}), preloaded: {args.preload}; {backoff}", flush=True)
    while args.parent_pid is None or _alive(args.parent_pid):
        for pid, started in list(children.items()):  # reap finished tasks
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                del children[pid]
                print(
                    f"ClientApp task pid {pid} exit {os.waitstatus_to_exitcode(status)} "
                    f"started {started:.3f} ended {time.time():.3f}",
                    flush=True,
                )
        response = client.AcquireTask(request)
        if response.HasField("task") and response.token:
            pid = fork_task(run_task, args.runtime_api_address, response.token, args.insecure, certificates)
            children[pid] = time.time()
        else:
            time.sleep(args.poll_interval)
    stop(signal.SIGTERM, None)


if __name__ == "__main__":
    main()
