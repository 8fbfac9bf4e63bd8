"""A real Flower deployment on loopback (for tests and benchmarks): flower-superlink, flower-supernode and `flwr run`.

Every process gets its own FLWR_HOME under the test's tmp folder, ports come from 19000-19999
(never Flower's defaults), telemetry / dependency installation / update checks are off, and
`close()` ends every process this harness started, with its descendants, by PID.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from dpfl_tools import ROOT
from dpfl_tools.processes import BIN, FLOWER_QUIET_ENV, alive, command, descendants, end_process_tree, free_port
from dpfl_tools.superlink import SuperLinkFailed, superlink_command, wait_ready


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
        self.superlink: subprocess.Popen | None = None
        self.database: Path | None = None

    # -- helpers
    def env(self, home: str) -> dict:
        flwr_home = self.tmp / "homes" / home
        flwr_home.mkdir(parents=True, exist_ok=True)
        # PYTHONPATH: this library is importable on every machine (as after `pip install`), for foreign apps
        return {
            **os.environ,
            **FLOWER_QUIET_ENV,
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
    def start_superlink(self, timeout: float = 60, *, database: Path | None = None, log: str = "superlink") -> None:
        """The SuperLink on a free port (`log`.log); `database`: its state in that file, which a restart reopens
        (`restart_superlink`), else in memory."""
        self.port = self.port or free_port(self.ports)
        self.database = database
        cmd = superlink_command(self.port, certificates=self.certs, supernode_auth=self.auth, database=database)
        self.superlink = self._spawn(log, cmd, self.env("superlink"))

        def ready() -> bool:
            text = self.log(log)
            return "Uvicorn running on" in text and "Starting Flower SuperExec" in text

        try:
            wait_ready(self.superlink, ready, self.tmp / f"{log}.log", timeout)
        except SuperLinkFailed as failed:
            raise RuntimeError(f"{failed}:\n{self.log(log)}") from None

    def restart_superlink(self, timeout: float = 60) -> None:
        """SIGKILL the SuperLink and all it runs (its ServerApp: a crashed machine), then start it again on the same
        port with the same database (log in superlink-restarted.log)."""
        pids = [self.superlink.pid, *descendants(self.superlink.pid)]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.superlink.pid, signal.SIGKILL)  # its group: what left the tree
        self.superlink.wait()
        self.start_superlink(timeout, database=self.database, log="superlink-restarted")

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
        node_module: str = "dpfl_tools.supernode",
    ) -> subprocess.Popen:
        """A SuperNode; `warm`: `--isolation process` with `dpfl_tools.clientapp_executor` running its ClientApps;
        `idle_poll`: `node_module` (`dpfl_tools.supernode` or a module running it) with Flower's idle sleeps capped
        at that many seconds."""
        insecure = (not self.tls) if insecure is None else insecure
        runtime_port = free_port(self.ports)
        node = (
            [command("flower-supernode")]
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
                    "dpfl_tools.clientapp_executor",
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
            if b"flwr-clientapp" in cmdline and alive(pid):
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
            [command("flwr"), "supernode", "register", str(public_key), "test"],
            self.env("cli"),
        )

    def run_app(
        self, run_config: dict, *, app: Path = ROOT, insecure: bool | None = None, log: str = "cli"
    ) -> subprocess.Popen:
        """`flwr run <app> test --stream --run-config ...` in the background (output in <log>.log)."""
        self.write_cli_config(insecure=insecure)
        overrides = " ".join(f"{k}={_toml(v)}" for k, v in run_config.items())
        return self._spawn(
            log, [command("flwr"), "run", str(app), "test", "--stream", "--run-config", overrides], self.env("cli")
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
