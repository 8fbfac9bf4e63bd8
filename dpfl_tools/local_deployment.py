"""A real Flower deployment on loopback (for tests and benchmarks): flower-superlink, flower-supernode and `flwr run`.

Every process gets its own FLWR_HOME under the test's tmp folder, ports come from 19000-19999
(never Flower's defaults), telemetry / dependency installation / update checks are off, and
`close()` ends every process this harness started, with its descendants, by PID.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
ENV = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
}
PORT_RANGE = (19000, 19999)


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
    while time.monotonic() < deadline and (any(_alive(p) for p in pids) or _group_alive(proc.pid)):
        proc.poll()
        time.sleep(0.2)
    _signal([p for p in pids if _alive(p)], proc.pid, signal.SIGKILL)
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
                if marker in (entry / "environ").read_bytes() and _alive(int(entry.name)):
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
        while sig == signal.SIGTERM and time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.2)
        pids = [p for p in pids if _alive(p)]


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


def _group_alive(group: int) -> bool:
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


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


# ---------------------------------------------------------------- certificates and keys
def make_certificates(folder: Path) -> dict[str, Path]:
    """A self-signed CA and a server certificate for 127.0.0.1 / localhost signed by it (PEM files)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "dpfl test CA")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP384R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    paths = {"ca": folder / "ca.crt", "cert": folder / "server.pem", "key": folder / "server.key"}
    paths["ca"].write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths["key"].write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return paths


def make_node_keys(folder: Path, name: str) -> tuple[Path, Path]:
    """An EC P-384 key pair in OpenSSH format for SuperNode authentication: (private, public)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    folder.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP384R1())
    private, public = folder / name, folder / f"{name}.pub"
    private.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption())
    )
    public.write_bytes(
        key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    )
    return private, public


# ---------------------------------------------------------------- the deployment
class Deployment:
    """One SuperLink and its SuperNodes; `tls` uses `make_certificates`, `auth` SuperNode authentication."""

    def __init__(self, tmp: Path, *, tls: bool = False, auth: bool = False) -> None:
        self.tmp = Path(tmp)
        self.tls, self.auth = tls, auth
        self.ports: set[int] = set()
        self.procs: list[subprocess.Popen] = []
        self.nodes: dict[str, subprocess.Popen] = {}
        self.executors: dict[str, subprocess.Popen] = {}
        self.certs = make_certificates(self.tmp / "certs") if tls else None
        self.port = 0

    # -- helpers
    def env(self, home: str) -> dict:
        flwr_home = self.tmp / "homes" / home
        flwr_home.mkdir(parents=True, exist_ok=True)
        # PYTHONPATH: this library is importable on every machine (as after `pip install`), for foreign apps
        return {
            **os.environ,
            **ENV,
            "FLWR_HOME": str(flwr_home),
            "PATH": f"{BIN}:{os.environ.get('PATH', '')}",
            "PYTHONPATH": str(ROOT),
        }

    def _spawn(self, name: str, cmd: list[str], env: dict) -> subprocess.Popen:
        log = open(self.tmp / f"{name}.log", "wb")  # noqa: SIM115 (closed when the process ends)
        proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            cwd=self.tmp,
        )
        log.close()
        self.procs.append(proc)
        return proc

    def log(self, name: str) -> str:
        path = self.tmp / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    # -- SuperLink
    def start_superlink(self, timeout: float = 60) -> None:
        self.port = free_port(self.ports)
        cmd = [
            str(BIN / "flower-superlink"),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--disable-runtime-dependency-installation",
        ]
        if self.tls:
            cmd += [
                "--ssl-ca-certfile",
                str(self.certs["ca"]),
                "--ssl-certfile",
                str(self.certs["cert"]),
                "--ssl-keyfile",
                str(self.certs["key"]),
            ]
        else:
            cmd += ["--insecure"]
        if self.auth:
            cmd += ["--enable-supernode-auth"]
        proc = self._spawn("superlink", cmd, self.env("superlink"))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"flower-superlink exited ({proc.returncode}):\n{self.log('superlink')}")
            if "Uvicorn running on" in self.log("superlink") and "Starting Flower SuperExec" in self.log("superlink"):
                return
            time.sleep(0.3)
        raise RuntimeError(f"flower-superlink did not start within {timeout} s:\n{self.log('superlink')}")

    # -- SuperNodes
    def start_supernode(
        self,
        name: str,
        node_config: str | None = None,
        *,
        insecure: bool | None = None,
        private_key: Path | None = None,
        extra: list[str] | None = None,
        warm: bool = False,
        idle_poll: float | None = None,
        node_module: str = "fl_app.supernode",
    ) -> subprocess.Popen:
        """A SuperNode; `warm`: `--isolation process` with `fl_app.clientapp_executor` running its ClientApps;
        `idle_poll`: `node_module` (`fl_app.supernode` or a module running it) with Flower's idle sleeps capped
        at that many seconds."""
        insecure = (not self.tls) if insecure is None else insecure
        runtime_port = free_port(self.ports)
        node = (
            [str(BIN / "flower-supernode")]
            if idle_poll is None
            else [sys.executable, "-m", node_module, "--idle-poll", str(idle_poll)]
        )
        cmd = node + ["--superlink", f"127.0.0.1:{self.port}", "--port", str(runtime_port)]
        cmd += ["--insecure"] if insecure else ["--root-certificates", str(self.certs["ca"])]
        if node_config is not None:
            cmd += ["--node-config", node_config]
        if private_key is not None:
            cmd += ["--auth-supernode-private-key", str(private_key)]
        cmd += extra or []
        if warm:
            cmd += ["--isolation", "process"]
        proc = self._spawn(name, cmd, self.env(name))
        self.nodes[name] = proc
        if warm:
            self.executors[name] = self._spawn(
                f"{name}-executor",
                [
                    sys.executable,
                    "-m",
                    "fl_app.clientapp_executor",
                    "--runtime-api-address",
                    f"127.0.0.1:{runtime_port}",
                    "--insecure",
                    "--parent-pid",
                    str(proc.pid),
                ],
                self.env(name),
            )
        return proc

    def wait_connected(self, name: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if "SuperNode ID:" in self.log(name):
                return
            if self.nodes[name].poll() is not None:
                raise RuntimeError(f"SuperNode {name} exited:\n{self.log(name)}")
            time.sleep(0.3)
        raise RuntimeError(f"SuperNode {name} did not connect within {timeout} s:\n{self.log(name)}")

    def stop_node(self, name: str) -> None:
        end_process_tree(self.nodes.pop(name))
        if name in self.executors:
            end_process_tree(self.executors.pop(name))

    def clientapp_running(self, name: str) -> bool:
        """Is the SuperNode `name` executing a ClientApp right now (a live flwr-clientapp below it)?"""
        for pid in descendants(self.nodes[name].pid):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"flwr-clientapp" in cmdline and _alive(pid):
                return True
        return False

    # -- the CLI
    def write_cli_config(self, *, insecure: bool | None = None) -> None:
        insecure = (not self.tls) if insecure is None else insecure
        lines = ["[superlink]", 'default = "test"', "", "[superlink.test]", f'address = "127.0.0.1:{self.port}"']
        lines += ["insecure = true"] if insecure else [f'root-certificates = "{self.certs["ca"]}"']
        home = self.tmp / "homes" / "cli"
        home.mkdir(parents=True, exist_ok=True)
        (home / "config.toml").write_text("\n".join(lines) + "\n")

    def register(self, public_key: Path) -> subprocess.Popen:
        """`flwr supernode register <key> test` in the background (output in register-<name>.log)."""
        return self._spawn(
            f"register-{public_key.stem}",
            [str(BIN / "flwr"), "supernode", "register", str(public_key), "test"],
            self.env("cli"),
        )

    def run_app(
        self, run_config: dict, *, app: Path = ROOT, insecure: bool | None = None, log: str = "cli"
    ) -> subprocess.Popen:
        """`flwr run <app> test --stream --run-config ...` in the background (output in <log>.log)."""
        self.write_cli_config(insecure=insecure)
        overrides = " ".join(f"{k}={_toml(v)}" for k, v in run_config.items())
        return self._spawn(
            log, [str(BIN / "flwr"), "run", str(app), "test", "--stream", "--run-config", overrides], self.env("cli")
        )

    def close(self) -> None:
        for proc in reversed(self.procs):
            end_process_tree(proc)


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f"'{value}'"
    return repr(value)
