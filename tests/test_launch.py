"""The launcher owns its SuperLink: free ports and a private FLWR_HOME, nothing left after Ctrl-C,
a non-zero exit when the run did not complete."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dpfl_tools import launch, processes
from dpfl_tools.launch import QUIET_ENV, flwr_run
from dpfl_tools.plan import format_run_config, reference_run_config, sweep_runs
from dpfl_tools.ray_head import start_ray_head, stop_ray_head, wait_ray_head
from dpfl_tools.superlink import own_superlink_env

ROOT = Path(__file__).resolve().parents[1]


def processes_mentioning(text: str) -> list[int]:
    """Living processes with `text` in their command line or environment: the SuperLink names the results
    folder in its arguments; what it spawns (flwr-simulation, Ray) inherits the FLWR_HOME inside it."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z" and any(
                    text.encode() in (entry / name).read_bytes() for name in ("cmdline", "environ")
                ):
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def describe(pids: list[int]) -> list[str]:
    """'pid state command line' of each process, for a failure message."""
    out = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            out.append(f"{pid} {state} {command[:200]}")
        except OSError:
            continue
    return out


def processes_named(name: str, text: str) -> list[int]:
    """Of `processes_mentioning(text)`, those whose command line has `name`."""
    named = []
    for pid in processes_mentioning(text):
        try:
            if name.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                named.append(pid)
        except OSError:
            continue
    return named


def simulation_running(text: str) -> bool:
    return bool(processes_named("flwr-simulation", text))


def test_own_superlink_env_uses_free_ports_and_a_private_home(tmp_path):
    env, http_port, control_port = own_superlink_env({}, tmp_path / "home")
    assert http_port != control_port and 19000 <= http_port < 20000
    assert env["FLWR_HOME"] == str(tmp_path / "home") and env["FLWR_LOCAL_SUPERLINK_HTTP_API_PORT"] == str(http_port)


FAKE_FLWR = """#!/bin/sh
printf '\\033[92mINFO \\033[0m:      Round 1/2: accuracy=0.5\\n'
printf '\\033[93mWARNING \\033[0m:   on stderr\\n' >&2
exit 3
"""


def test_flwr_run_output_to_a_pipe_or_file_has_no_colour_codes(tmp_path, monkeypatch, capsys):
    """Flower colours its log levels whatever the output is; the launcher passes them on only to a terminal
    (pytest's captured stdout and stderr are not terminals)."""
    flwr = tmp_path / "flwr"
    flwr.write_text(FAKE_FLWR)
    flwr.chmod(0o755)
    monkeypatch.setattr(processes, "BIN", tmp_path)
    assert flwr_run(dict(os.environ), "num-rounds=2", 2) == 3  # the exit code comes through
    out, err = capsys.readouterr()
    assert out.splitlines()[-1] == "INFO :      Round 1/2: accuracy=0.5"
    assert err == "WARNING :   on stderr\n"


def test_a_command_not_beside_this_python_is_taken_from_the_path(tmp_path, monkeypatch):
    """`pip install --user` or `--target` puts Flower's and Ray's commands in a bin of their own, not beside the
    Python that runs the launcher."""
    here, elsewhere = tmp_path / "venv-bin", tmp_path / "target-bin"
    for folder in (here, elsewhere):
        folder.mkdir()
        (folder / "flwr").write_text("#!/bin/sh\n")
        (folder / "flwr").chmod(0o755)
    monkeypatch.setattr(processes, "BIN", here)
    monkeypatch.setenv("PATH", str(elsewhere))
    assert processes.command("flwr") == str(here / "flwr")  # beside this Python first
    (here / "flwr").unlink()
    assert processes.command("flwr") == str(elsewhere / "flwr")  # else on PATH
    assert processes.command("flower-superlink") == str(here / "flower-superlink")  # nowhere: the error names BIN's


def hint_commands(text: str) -> dict[str, str]:
    """The `flwr ls` and `flwr log` command lines the launcher prints, by subcommand."""
    return {
        m.group(2): m.group(0).strip()
        for m in re.finditer(r"^  (FLWR_HOME=.*) (ls|log) ?(<run-id>)?$", text, re.MULTILINE)
    }


# a launcher's first steps: its network namespace, its SuperLink there, the hint; then waits for stdin
ISOLATED_SUPERLINK = """
import os, sys
from pathlib import Path
from dpfl_tools import netns
from dpfl_tools.launch import QUIET_ENV
from dpfl_tools.superlink import own_superlink_env, start_local_superlink, stop, superlink_hint
user_namespace = netns.needs_user_namespace()
netns.isolate_network()
env, http_port, control_port = own_superlink_env({**os.environ, **QUIET_ENV}, Path(sys.argv[1]))
proc = start_local_superlink(env, http_port, control_port, Path(sys.argv[2]))
print(superlink_hint(env, http_port, control_port, netns.nsenter_prefix(os.getpid(), user_namespace)), flush=True)
try:
    sys.stdin.read()
finally:
    stop(proc, env["FLWR_HOME"])
"""


@pytest.mark.slow  # 2-9 s together: the fast tier keeps its 5-minute margin on 2 cores
def test_the_printed_flwr_ls_reaches_the_launchers_superlink(tmp_path):
    """The hint names both ports and FLWR_HOME; its `flwr ls`, run from a shell with none of them set and
    outside the launcher's network namespace (which it enters with nsenter), talks to the launcher's
    SuperLink instead of starting one on Flower's default port."""
    linker = subprocess.Popen(
        [sys.executable, "-c", ISOLATED_SUPERLINK, str(tmp_path / "home"), str(tmp_path / "superlink.log")],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        hint = "".join(linker.stdout.readline() for _ in range(3))
        http_port, control_port = map(
            int,
            re.search(
                r"127.0.0.1:(\d+) \(HTTP API\), control API 127.0.0.1:(\d+) "
                r"in the launcher's private network namespace",
                hint,
            ).groups(),
        )
        commands = hint_commands(hint)
        assert set(commands) == {"ls", "log"} and commands["log"].endswith("flwr log <run-id>")
        assert f"FLWR_LOCAL_SUPERLINK_HTTP_API_PORT={http_port}" in commands["ls"]
        assert f"nsenter --target={linker.pid} --net" in commands["ls"], hint
        shell_env = {k: v for k, v in os.environ.items() if not k.startswith("FLWR_LOCAL")}
        shell_env.update(QUIET_ENV, FLWR_HOME=str(tmp_path / "elsewhere"))
        listed = subprocess.run(commands["ls"], shell=True, env=shell_env, capture_output=True, text=True, timeout=120)
    finally:
        linker.communicate("")
    assert listed.returncode == 0, listed.stdout + listed.stderr
    assert "Starting local SuperLink" not in listed.stdout + listed.stderr
    assert not (tmp_path / "elsewhere").exists()  # nothing of flwr's own defaults was used


def test_reference_run_config_round_trips():
    assert format_run_config({"a": "x", "b": True, "c": 0.5}) == "a='x' b=true c=0.5"
    assert "noise-multiplier=0.0" in reference_run_config("algorithm='dp-fedsam'")


def test_sweep_makes_one_run_per_value():
    assert sweep_runs("num-rounds=10", "noise-multiplier=0.5, 1,2") == [
        ("noise-multiplier-0.5", "num-rounds=10 noise-multiplier=0.5"),
        ("noise-multiplier-1", "num-rounds=10 noise-multiplier=1"),
        ("noise-multiplier-2", "num-rounds=10 noise-multiplier=2"),
    ]
    with pytest.raises(SystemExit, match="key=v1,v2"):
        sweep_runs("", "noise-multiplier")


@pytest.mark.slow
def test_the_shared_ray_head_takes_a_job_with_its_token_and_leaves_nothing(tmp_path):
    """The launcher's Ray head: up, a driver that joins it as each run's simulation does (RAY_ADDRESS and the
    head's token) runs a task on it, and a driver without the token is refused; a driver that joins with a
    runtime_env, as Flower's does, starts no idle worker it cannot use (Ray's default: one per CPU); stopped,
    none of its processes and not its temp folder is left."""
    env = {**os.environ, **QUIET_ENV, "RAY_USAGE_STATS_ENABLED": "0", "FLWR_HOME": str(tmp_path / "home")}
    for key in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN"):
        env.pop(key, None)
    head = start_ray_head(env, tmp_path / "ray-head.log")
    job = (
        "import ray\nray.init(log_to_driver=False)\n"
        "print(ray.get(ray.remote(lambda: 6 * 7).remote()), ray.cluster_resources()['CPU'])"
    )

    def run_job(join_env: dict) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-c", job], capture_output=True, text=True, timeout=120, env={**env, **join_env}
        )

    try:
        assert wait_ray_head(head.proc, tmp_path / "ray-head.log"), (tmp_path / "ray-head.log").read_text()
        assert oct(head.temp.stat().st_mode & 0o777) == "0o700"  # its sockets and logs: the owner's only
        assert oct((tmp_path / "ray-head.log").stat().st_mode & 0o777) == "0o600"
        assert set(head.join_env) == {"RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN"}
        assert len(head.join_env["RAY_AUTH_TOKEN"]) == 64
        out = run_job(head.join_env)
        from ray._private.utils import get_num_cpus  # what Flower's own ray.init() would give its actors

        assert out.returncode == 0 and out.stdout.split() == ["42", f"{float(get_num_cpus())}"], out.stderr[-2000:]
        out = run_job({"RAY_ADDRESS": head.join_env["RAY_ADDRESS"]})  # a stranger who found the port (20 s)
        assert out.returncode != 0 and "42" not in out.stdout, (out.stdout, out.stderr[-2000:])
        assert "Failed to connect to Ray cluster" in out.stderr, out.stderr[-2000:]
        assert len(processes_named("gcs_server", str(tmp_path))) == 1
        assert idle_workers_after_a_flower_like_driver_joins(env, head, str(tmp_path)) == []
    finally:
        stop_ray_head(head)
    time.sleep(0.5)
    assert processes_mentioning(str(tmp_path)) == [], describe(processes_mentioning(str(tmp_path)))
    assert not head.temp.exists()


def test_the_ray_head_never_picks_the_superlinks_ports(tmp_path, monkeypatch):
    """Both are picked free before either process binds them: the head avoids the ports it is given (a Ray
    client server on the SuperLink's HTTP port once killed the head)."""
    monkeypatch.setattr(launch.subprocess, "Popen", lambda cmd, **kwargs: cmd)  # the command, not started
    free = {19001, 19002, 19003, 19004}
    head = start_ray_head({}, tmp_path / "ray-head.log", set(range(19000, 20000)) - free)
    assert {int(a) for a in head.proc if a.isdigit() and 19000 <= int(a) < 20000} == free
    shutil.rmtree(head.temp)


def idle_workers_after_a_flower_like_driver_joins(env: dict, head, text: str) -> list[int]:
    """The Ray worker processes (`ray::IDLE`) that exist 3 s after a driver joined `head` with a runtime_env
    as Flower's RayBackend gives it (the driver's sys.path as PYTHONPATH), before it asked for anything."""
    job = (
        "import os, sys, time, ray\n"
        "ray.init(log_to_driver=False, runtime_env={'env_vars': {'PYTHONPATH': os.pathsep.join(sys.path)}})\n"
        "print('joined', flush=True)\ntime.sleep(30)\n"
    )
    driver = subprocess.Popen(
        [sys.executable, "-c", job],
        env={**env, **head.join_env},
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert driver.stdout.readline().strip() == "joined"
        time.sleep(3)
        return processes_named("ray::IDLE", text)
    finally:
        driver.kill()
        driver.wait()


def test_a_ray_head_that_exits_is_reported_not_waited_for(tmp_path, capsys):
    """(The launcher then restarts its SuperLink without RAY_ADDRESS: each run starts Ray itself.)"""
    (tmp_path / "ray-head.log").write_text("ValueError: Ray component worker_ports is trying to use a port\n")
    failed = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    started = time.monotonic()
    assert wait_ray_head(failed, tmp_path / "ray-head.log", timeout=60) is False
    assert time.monotonic() - started < 10
    assert "did not start (exit code 1" in capsys.readouterr().err


def default_sigint() -> None:
    """In the launcher's process before exec: SIGINT as a terminal's shell leaves it. A shell without job
    control starts background commands with SIGINT ignored, and Python keeps an inherited SIG_IGN: a test
    run from such a shell (CI started in the background) could not Ctrl-C anything."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def check_the_printed_flwr_commands(log: str) -> None:
    """A live launch's log (a file: no colour codes) names its run; the printed `flwr ls` lists it and the
    printed `flwr log` shows its round lines."""
    assert "\x1b[" not in log
    run_id = re.search(r"Successfully started run (\d+)", log).group(1)
    commands = hint_commands(log)
    shell_env = {k: v for k, v in os.environ.items() if not k.startswith("FLWR_")}
    listed = subprocess.run(commands["ls"], shell=True, env=shell_env, capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0 and run_id in listed.stdout, listed.stdout + listed.stderr
    logged = subprocess.run(
        commands["log"].replace("<run-id>", f"--show {run_id}"),
        shell=True,
        env=shell_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "Round 1/200:" in logged.stdout + logged.stderr, logged.stdout + logged.stderr


LONG_LAUNCH = "num-rounds=200 dataset='digits' model='mlp' partitioner='iid' local-steps=2"  # the test ends it


def start_long_launch(tmp_path: Path, preexec_fn=None) -> tuple[subprocess.Popen, Path, Path]:
    """(launcher, results folder, log file) of a launch of 2 clients and 200 short rounds in a session of its
    own, which the test ends; its output goes to a file, not a pipe nobody reads (a full pipe would block it)."""
    results, log_path = tmp_path / "results", tmp_path / "launch.log"
    command = [
        sys.executable,
        "-m",
        "dpfl_tools.launch",
        "--clients",
        "2",
        "--results",
        str(results),
        "-c",
        LONG_LAUNCH,
    ]
    with open(log_path, "wb") as log:
        launcher = subprocess.Popen(
            command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=preexec_fn
        )
    return launcher, results, log_path


def wait_for_round_one(launcher: subprocess.Popen, results: Path, log_path: Path, timeout: float = 300) -> None:
    """Until the launch's run folder has its first round (its metrics.jsonl is not empty); fails with the log's
    end where the launcher exits first or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while not any(f.read_text() for f in results.glob("*-dp/metrics.jsonl")):
        assert time.monotonic() < deadline and launcher.poll() is None, log_path.read_text()[-3000:]
        time.sleep(0.5)


def processes_left(results: Path, timeout: float = 30) -> list[int]:
    """The launch's processes (those naming its results folder) still there after up to `timeout` s."""
    deadline = time.monotonic() + timeout
    while processes_mentioning(str(results)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return processes_mentioning(str(results))


def kill_long_launch(launcher: subprocess.Popen, results: Path) -> None:
    """After a test, passed or failed: SIGKILL whatever of the launch is still running (the launcher's session,
    and its SuperLink, which has a session of its own)."""
    if launcher.poll() is None:
        os.killpg(launcher.pid, signal.SIGKILL)
    for pid in processes_mentioning(str(results)):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.slow
@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_ctrl_c_leaves_nothing_running_and_exits_non_zero(tmp_path, how):
    """Ctrl-C (SIGINT to the terminal's process group) and SIGTERM to the launcher alone (a scheduler); before the
    Ctrl-C, the launch is checked from outside: its owner's printed commands and another account's attempts."""
    launcher, results, log_path = start_long_launch(tmp_path, preexec_fn=default_sigint)
    try:
        wait_for_round_one(launcher, results, log_path)
        assert processes_mentioning(str(results))  # its SuperLink runs with our folder in its command line
        assert simulation_running(str(results))  # the simulation, which runs the rounds, is seen too
        # one Ray: the launcher's head, which the simulation joined (its own ray.init would start a second)
        assert len(processes_named("gcs_server", str(results))) == 1, describe(processes_mentioning(str(results)))
        if how == "ctrl-c":  # meanwhile, from another shell: the commands the launcher printed reach its SuperLink,
            check_the_printed_flwr_commands(log_path.read_text())  # and another account's reach nothing
            check_another_account_cannot_reach(launcher, log_path)
            os.killpg(launcher.pid, signal.SIGINT)  # what Ctrl-C in a terminal sends
        else:
            os.kill(launcher.pid, signal.SIGTERM)
        try:
            code = launcher.wait(timeout=120)  # the launcher's own limit: 20 s + 10 s of grace, then SIGKILL
        except subprocess.TimeoutExpired:
            os.kill(launcher.pid, signal.SIGUSR1)  # the launcher's faulthandler: where it is stuck, into the log
            time.sleep(2)
            pytest.fail(
                f"launcher alive 120 s after {how}; still running: {describe(processes_mentioning(str(results)))}"
                f"\n{log_path.read_text()[-6000:]}"
            )
        assert code != 0, log_path.read_text()[-3000:]
        left = processes_left(results)
        assert left == [], describe(left)
    finally:  # after a failure: leave nothing of this test running
        kill_long_launch(launcher, results)


def check_another_account_cannot_reach(launcher: subprocess.Popen, log_path: Path) -> None:
    """While a launch runs (as root), uid 65534 cannot connect to its SuperLink's ports (where it could submit
    a run of its own app, executed as the launcher's user) nor enter its network namespace; the ports are
    not on the machine's loopback at all (the launcher's owner reaches them with the printed commands)."""
    from tests.test_network_isolation import as_nobody, can_connect, nobody_python

    python = nobody_python()
    ports = re.search(r"127.0.0.1:(\d+) \(HTTP API\), control API 127.0.0.1:(\d+)", log_path.read_text()).groups()
    for port in map(int, ports):
        assert not can_connect(port, python=python, preexec=as_nobody), f"uid 65534 reached port {port}"
        assert not can_connect(port), f"port {port} is on the machine's loopback"
    entered = subprocess.run(
        ["nsenter", f"--target={launcher.pid}", "--net", "true"], capture_output=True, text=True, preexec_fn=as_nobody
    )
    assert entered.returncode != 0, "uid 65534 entered the launcher's network namespace"


@pytest.mark.slow
def test_a_launcher_without_cap_sys_admin_isolates_itself_through_a_user_namespace(tmp_path):
    """A non-root user's path (here root without CAP_SYS_ADMIN, as `setpriv` leaves it): the launcher makes its
    user namespace before validating the config (whose numpy import starts threads, after which the kernel
    refuses one), then its network namespace, and the run completes in it."""
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv, to drop CAP_SYS_ADMIN")
    out = subprocess.run(
        [
            "setpriv",
            "--bounding-set=-sys_admin",
            "--inh-caps=-sys_admin",
            sys.executable,
            "-m",
            "dpfl_tools.launch",
            "--clients",
            "2",
            "--results",
            str(tmp_path / "results"),
            "--network-isolation",
            "require",
            "-c",
            "num-rounds=1 sample-rate=1.0 dataset='digits' model='mlp' partitioner='iid' local-steps=1",
        ],  # every client: a round that samples none fails the run
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if "[Errno 1]" in out.stderr or "[Errno 28]" in out.stderr:  # EPERM, ENOSPC: user namespaces refused
        pytest.skip(f"this kernel gives no user namespace here: {out.stderr.strip()}")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "--user --net --preserve-credentials" in hint_commands(out.stdout)["ls"], out.stdout[:2000]


def test_stop_never_hangs_it_prints_where_and_exits():
    """Should ending the SuperLink's processes ever block, the launcher still exits (faulthandler's watchdog)
    and its log says where it was."""
    code = (
        "import time, dpfl_tools.superlink as superlink\n"
        "superlink.STOP_LIMIT = 1\n"
        "superlink.end_process_tree = lambda proc, grace: time.sleep(60)\n"
        "superlink.stop(object(), '/nonexistent-home')\n"
    )
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=50)
    assert out.returncode != 0 and time.monotonic() - t0 < 30
    assert "Timeout" in out.stderr and "<lambda>" in out.stderr, out.stderr[-2000:]


def test_a_second_signal_waits_for_the_cleanup_to_finish():
    """SIGTERM (or a second Ctrl-C) arriving while stop() ends the processes is held until it is done, then
    ends the launcher as usual (exit 128 + 15)."""
    code = (
        "import os, signal, time, dpfl_tools.launch as launch, dpfl_tools.superlink as superlink\n"
        "signal.signal(signal.SIGTERM, launch.exit_on_signal)\n"
        "superlink.end_process_tree = lambda proc, grace: (os.kill(os.getpid(), signal.SIGTERM), time.sleep(0.3))\n"
        "superlink.end_processes_with_home = lambda home: print('home cleaned', flush=True)\n"
        "superlink.stop(object(), '/nonexistent-home')\n"
        "print('not reached', flush=True)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 128 + signal.SIGTERM and out.stdout.splitlines() == ["home cleaned"], out
