"""Faults at a run's edges: bad config keys and strings are refused as config errors, a damaged checkpoint is
refused in one line naming the file, a damaged run folder (status.json, a half-written metrics line, a directory
where a run file belongs) in one line naming the file and what to do on every engine of the launcher and in the
report, a full disk names the file and leaves a true status, and TensorBoard's event files are the owner's only,
as every other run file."""

import errno
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dpfl.fl_app.client_app import app as client_app
from dpfl.fl_app.config import ConfigError, validate
from dpfl.fl_app.dashboards import TensorBoardWriter
from dpfl.fl_app.results import PreviousRunError, RunDirectory, lock_run_folder, read_status
from dpfl.fl_app.run_files import RunFileError
from dpfl.fl_app.server_app import run_federated
from dpfl_tools.inprocess import InProcessGrid
from tests.independent_accountant import dp_accounting_epsilons

SMALL = {
    "dataset": "digits",
    "model": "mlp",
    "partitioner": "iid",
    "local-steps": 2,
    "sample-rate": 1.0,
    "secure-rng": False,
}


# ---------------------------------------------------------------- validate() refuses, never raises otherwise
@pytest.mark.parametrize("key", [1, None, 2.5, ("a",)])
def test_a_key_that_is_not_a_string_is_a_config_error_naming_it(key):
    with pytest.raises(ConfigError, match="run-config keys are strings") as err:
        validate({key: True, "num-rounds": 3})
    assert repr(key) in str(err.value)


@pytest.mark.parametrize("key", ["results-dir", "run-name", "data-dir", "dataset"])
def test_a_lone_surrogate_is_a_config_error_naming_the_key(key, tmp_path):
    value = str(tmp_path / "run\ud800") if key.endswith("-dir") else "run\udc80"
    with pytest.raises(ConfigError, match=f"run-config key '{key}'") as err:
        validate({key: value})
    str(err.value).encode("utf-8")  # the message itself prints anywhere


# ---------------------------------------------------------------- a damaged checkpoint
def write_good_checkpoint(path):
    run_dir = RunDirectory(path)
    run_dir.write_checkpoint({"completed_rounds": 1}, _Arrays([np.ones(3, np.float32)]))
    run_dir.close()


class _Arrays:
    def __init__(self, arrays):
        self.arrays = arrays

    def to_numpy_ndarrays(self):
        return self.arrays


def damage(file, how):
    if how == "truncated":
        file.write_bytes(file.read_bytes()[:100])
    elif how == "garbage":
        file.write_bytes(os.urandom(300))
    elif how == "empty":
        file.write_bytes(b"")
    elif how == "state not JSON":
        np.savez(open(file, "wb"), state=np.frombuffer(b"{not json", np.uint8), array_0=np.ones(3))
    elif how == "state not an object":
        np.savez(open(file, "wb"), state=np.frombuffer(b"[1, 2]", np.uint8), array_0=np.ones(3))
    elif how == "object array":
        np.savez(open(file, "wb"), state=np.frombuffer(b"{}", np.uint8), array_0=np.array([{"a": 1}], object))
    elif how == "rounds not a count":
        np.savez(open(file, "wb"), state=np.frombuffer(b'{"completed_rounds": "two"}', np.uint8), array_0=np.ones(3))
    elif how == "no state":
        np.savez(open(file, "wb"), array_0=np.ones(3))


@pytest.mark.parametrize(
    "how",
    [
        "truncated",
        "garbage",
        "empty",
        "state not JSON",
        "state not an object",
        "object array",
        "no state",
        "rounds not a count",
    ],
)
def test_a_damaged_checkpoint_is_refused_in_one_line_naming_the_file(how, tmp_path):
    write_good_checkpoint(tmp_path)
    damage(tmp_path / "checkpoint.npz", how)
    with pytest.raises(PreviousRunError) as err:
        RunDirectory(tmp_path, resume=True)
    message = str(err.value)
    assert str(tmp_path / "checkpoint.npz") in message and "\n" not in message
    assert "restore it from a backup" in message and "resume = false" in message
    RunDirectory(tmp_path / "other").close()  # nothing was left locked or half-made


def test_a_checkpoint_whose_state_does_not_fit_is_refused_before_any_round(tmp_path, capfd):
    cfg = validate({**SMALL, "num-rounds": 1, "results-dir": str(tmp_path / "run")})
    run_federated(InProcessGrid(client_app, 3, cfg), cfg)
    file = tmp_path / "run" / "checkpoint.npz"
    with np.load(file) as data:
        state = json.loads(data["state"].tobytes().decode())
        arrays = {k: data[k] for k in data.files if k != "state"}
    state["ledger"] = "two"
    np.savez(open(file, "wb"), state=np.frombuffer(json.dumps(state).encode(), np.uint8), **arrays)
    resumed = validate({**SMALL, "num-rounds": 2, "resume": True, "results-dir": str(tmp_path / "run")})
    with pytest.raises(PreviousRunError, match="its state does not fit this run") as err:
        run_federated(InProcessGrid(client_app, 3, resumed), resumed)
    assert str(file) in str(err.value)
    for engine in ("inprocess", "cohort"):  # the launcher's in-process engines: the same line, no traceback
        argv = ["--resume", str(tmp_path / "run"), "--engine", engine, "--clients", "3", "-c", "num-rounds=2"]
        assert launcher_refusal(argv, capfd) == str(err.value)


# ---------------------------------------------------------------- a damaged status.json
DAMAGED_STATUS = {
    "cut short": b'{"status": "runn',
    "garbage": bytes(range(256)),
    "binary": b"\x89PNG\r\n\x1a\n\x00",
    "empty": b"",
    "a list": b'["running"]',
    "an unknown status": b'{"status": "paused", "pid": 1}',
}


def damaged_run(folder: Path, how: str) -> Path:
    """A run folder (config.json, a checkpoint of round 1) whose status.json is damaged `how`."""
    write_good_checkpoint(folder)
    (folder / "config.json").write_text(json.dumps(validate({**SMALL, "results-dir": str(folder)}).run_config()))
    (folder / "status.json").write_bytes(DAMAGED_STATUS[how])
    return folder


def one_line_naming(message: str, file: Path) -> bool:
    return str(file) in message and "\n" not in message and "delete status.json and resume" in message


@pytest.mark.parametrize("how", sorted(DAMAGED_STATUS))
@pytest.mark.parametrize("resume", [True, False], ids=["resume", "fresh run"])
def test_a_damaged_status_is_refused_in_one_line_before_any_round(tmp_path, how, resume):
    folder = damaged_run(tmp_path / "run", how)
    cfg = validate({**SMALL, "num-rounds": 2, "resume": resume, "results-dir": str(folder)})
    grid = InProcessGrid(client_app, 3, cfg)
    with pytest.raises(RunFileError) as err:
        run_federated(grid, cfg)
    assert one_line_naming(str(err.value), folder / "status.json"), err.value
    assert grid.sent == [] and (folder / "status.json").read_bytes() == DAMAGED_STATUS[how]  # nothing trained
    os.close(lock_run_folder(folder))  # the ServerApp released the folder's lock


@pytest.mark.slow
def test_after_the_damaged_status_is_deleted_the_resume_continues_with_the_ledger(tmp_path):
    cfg = validate({**SMALL, "num-rounds": 1, "results-dir": str(tmp_path)})
    grid = InProcessGrid(client_app, 3, cfg)
    run_federated(grid, cfg)
    (tmp_path / "status.json").write_bytes(DAMAGED_STATUS["cut short"])
    resumed = validate({**SMALL, "num-rounds": 2, "resume": True, "results-dir": str(tmp_path)})
    with pytest.raises(RunFileError, match="delete status.json and resume"):
        run_federated(grid, resumed)
    (tmp_path / "status.json").unlink()  # what the refusal says to do
    summary = run_federated(grid, resumed)
    assert summary["resumed_after_round"] == 1 and sum(s for _, _, s in summary["ledger"]["model"]["history"]) == 2
    eps_pld, _ = dp_accounting_epsilons(1.0, 1.0, 2, summary["delta"])  # sigma 1, q 1, 2 rounds: nothing lost
    assert eps_pld * 0.99 <= summary["epsilon"] <= eps_pld * 1.02
    assert read_status(tmp_path)["status"] == "completed"


def test_the_launcher_refuses_a_damaged_status_before_it_starts_anything(tmp_path, monkeypatch):
    import dpfl_tools.launch as launch

    monkeypatch.setattr(launch, "isolate", lambda *a: pytest.fail("the launcher went on"))
    folder = damaged_run(tmp_path / "run", "cut short")
    for argv in (["--resume", str(folder)], ["-c", f"results-dir='{folder}'"]):
        with pytest.raises(SystemExit) as err:
            launch.main([*argv, "--clients", "3", "--results", str(tmp_path / "results")])
        assert one_line_naming(str(err.value.code), folder / "status.json"), err.value.code


# ---------------------------------------------------------------- every run-folder fault: one line, every engine
ENGINES = ("flwr", "inprocess", "cohort")  # dpfl_tools.launch --engine's choices
DAMAGED_STATUS_WHY = {  # what the refusal says is wrong with each DAMAGED_STATUS
    "cut short": "not JSON (Unterminated string starting at: line 1 column 12 (char 11))",
    "garbage": "not JSON (Expecting value: line 1 column 1 (char 0))",
    "binary": "not JSON ('utf-8' codec can't decode byte 0x89 in position 0: invalid start byte)",
    "empty": "not JSON (Expecting value: line 1 column 1 (char 0))",
    "a list": "a JSON list, not an object",
    "an unknown status": "'status' = 'paused', not one of running, interrupted, completed, failed",
}
NOT_FILES = ("status.json", "metrics.jsonl", "diagnostics.jsonl", "summary.json", "checkpoint.npz", "config.json")
HALF_LINE = '{"round": 1, "epsilon": 0.5}\n{"round": 2, "epsil'  # a run killed while it wrote round 2
FOLDER_FAULTS = [f"status: {how}" for how in DAMAGED_STATUS_WHY] + [f"{name} a directory" for name in NOT_FILES]


def faulty_run(folder: Path, fault: str) -> Path:
    """damaged_run's folder (a checkpoint of round 1, its config.json) with `fault`."""
    if fault.startswith("status: "):
        return damaged_run(folder, fault.removeprefix("status: "))
    write_good_checkpoint(folder)
    (folder / "config.json").write_text(json.dumps(validate({**SMALL, "results-dir": str(folder)}).run_config()))
    if fault == "half-written metrics line":
        (folder / "metrics.jsonl").write_text(HALF_LINE)
    else:
        name = fault.removesuffix(" a directory")
        (folder / name).unlink(missing_ok=True)
        (folder / name / "inside").mkdir(parents=True)
    return folder


def expected_refusal(folder: Path, fault: str) -> str:
    """The one line every engine, the ServerApp and the report print for `fault` (written out here, not taken
    from the code under test)."""
    if fault.startswith("status: "):
        return (
            f"{folder / 'status.json'}: {DAMAGED_STATUS_WHY[fault.removeprefix('status: ')]}; the file is damaged "
            "(cut short, a full disk, or not written by this program): the run's rounds stand in metrics.jsonl and "
            "checkpoint.npz, so delete status.json and resume (resume = true), or choose another results-dir or "
            "run-name"
        )
    if fault == "half-written metrics line":
        return (
            f"{folder / 'metrics.jsonl'}, line 2: not JSON (Unterminated string starting at: line 1 column 14 "
            "(char 13)); the line is cut short (a run killed while writing it, a full disk) or was not written by "
            "this program: remove line 2 and resume (resume = true writes metrics.jsonl anew from checkpoint.npz), "
            "or start a new run with another results-dir or run-name"
        )
    name = fault.removesuffix(" a directory")
    return (
        f"{folder / name}: a directory where the run keeps its {name} file; move it out of {folder} (or remove it) "
        "and run again, or choose another results-dir or run-name"
    )


def launcher_refusal(argv: list[str], capfd) -> str:
    """The launcher's refusal: a SystemExit whose code is the one line (Python prints it alone, exit status 1),
    and nothing printed before it."""
    import dpfl_tools.launch as launch

    with pytest.raises(SystemExit) as err:
        launch.main(argv)
    printed = capfd.readouterr()
    assert isinstance(err.value.code, str) and "Traceback" not in printed.out + printed.err, printed
    return err.value.code


@pytest.mark.parametrize("fault", [*FOLDER_FAULTS, "half-written metrics line"])
@pytest.mark.parametrize("resume", [True, False], ids=["resume", "fresh run"])
def test_every_run_folder_fault_is_one_line_on_every_engine(tmp_path, monkeypatch, capfd, fault, resume):
    import dpfl.fl_app.server_app as server_app
    import dpfl_tools.launch as launch

    monkeypatch.setattr(launch, "isolate", lambda *a: pytest.fail("the flwr engine went on"))
    monkeypatch.setattr(server_app, "run_federated", lambda *a: pytest.fail("an in-process engine went on"))
    folder = faulty_run(tmp_path / "run", fault)
    before = {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    expected = expected_refusal(folder, fault)
    given = ["--resume", str(folder)] if resume else ["-c", f"results-dir='{folder}'"]
    for engine in ENGINES:
        argv = [*given, "--engine", engine, "--clients", "3", "--network-isolation", "off"]
        assert launcher_refusal([*argv, "--results", str(tmp_path / "results")], capfd) == expected, engine
    assert {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("fault", [f for f in FOLDER_FAULTS if f != "config.json a directory"])
@pytest.mark.parametrize("resume", [True, False], ids=["resume", "fresh run"])
def test_the_server_app_refuses_a_faulty_folder_in_the_same_line(tmp_path, fault, resume):
    folder = faulty_run(tmp_path / "run", fault)
    cfg = validate({**SMALL, "num-rounds": 2, "resume": resume, "results-dir": str(folder)})
    grid = InProcessGrid(client_app, 3, cfg)
    with pytest.raises((RunFileError, PreviousRunError)) as err:
        run_federated(grid, cfg)
    assert str(err.value) == expected_refusal(folder, fault) and grid.sent == []


@pytest.mark.slow
def test_the_launcher_prints_a_folder_fault_as_one_line_on_every_engine(tmp_path):
    folder = faulty_run(tmp_path / "run", "status.json a directory")
    for engine in ENGINES:
        done = subprocess.run(
            [sys.executable, "-m", "dpfl_tools.launch", "--resume", str(folder), "--engine", engine, "--clients", "3"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert (done.returncode, done.stdout, done.stderr) == (
            1,
            "",
            expected_refusal(folder, "status.json a directory") + "\n",
        )


@pytest.mark.parametrize(
    "fault",
    ["status.json a directory", "summary.json a directory", "metrics.jsonl a directory", "half-written metrics line"],
)
def test_the_report_names_a_faulty_folder_in_one_line(tmp_path, capsys, fault):
    from dpfl_tools.report import main

    folder = faulty_run(tmp_path / "run", fault)
    if fault != "status.json a directory":  # a finished run's, else the report asks its status
        (folder / "status.json").write_text('{"status": "completed"}')
        if not (folder / "summary.json").exists():
            (folder / "summary.json").write_text('{"strategy": "dp-fedavg", "epsilon": 1.0}')
    with pytest.raises(SystemExit) as err:
        main([str(folder), "-o", str(tmp_path / "r.html")])
    printed = capsys.readouterr()
    assert err.value.code == 2 and printed.err == f"dpfl_tools.report: {expected_refusal(folder, fault)}\n", printed
    assert not (tmp_path / "r.html").exists()


def test_the_report_names_a_damaged_status_in_one_line(tmp_path, capsys):
    from dpfl_tools.report import main

    folder = damaged_run(tmp_path / "run", "garbage")  # no summary.json: the report asks its status
    with pytest.raises(SystemExit) as err:
        main([str(folder), "-o", str(tmp_path / "r.html")])
    message = capsys.readouterr().err
    assert err.value.code == 2 and one_line_naming(message.strip(), folder / "status.json"), message


# ---------------------------------------------------------------- a full disk
def test_a_full_disk_names_the_file_and_the_status_is_true(tmp_path, monkeypatch):
    cfg = validate({**SMALL, "num-rounds": 2, "results-dir": str(tmp_path / "run")})

    def full_disk(*_, **__):
        raise OSError(errno.EFBIG, os.strerror(errno.EFBIG))

    monkeypatch.setattr(np, "savez", full_disk)  # the first checkpoint write fails
    with pytest.raises(OSError) as err:
        run_federated(InProcessGrid(client_app, 3, cfg), cfg)
    assert err.value.filename == str(tmp_path / "run" / "checkpoint.npz")
    status = json.loads((tmp_path / "run" / "status.json").read_text())
    assert status["status"] == "failed" and "checkpoint.npz" in status["error"]
    assert status["completed_rounds"] == 0  # no round was saved: metrics.jsonl empty, no checkpoint
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == ""
    assert not (tmp_path / "run" / "checkpoint.npz").exists()


def test_a_failed_append_names_its_file(tmp_path, monkeypatch):
    from dpfl.fl_app.results import append_line

    target = tmp_path / "metrics.jsonl"
    target.write_text("old\n")
    real_fdopen = os.fdopen

    class Full:
        def __init__(self, *a, **k):
            self.f = real_fdopen(*a, **k)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            self.f.write(data[:3])
            self.f.flush()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fdopen", Full)
    with pytest.raises(OSError) as err:
        append_line(target, "a new line\n")
    assert err.value.filename == str(target) and err.value.errno == errno.ENOSPC
    assert target.read_text() == "old\n"  # no half line left


# ---------------------------------------------------------------- TensorBoard's files
def test_tensorboard_event_files_are_the_owners_only(tmp_path):
    writer = TensorBoardWriter(tmp_path, {"seed": 1})
    writer.on_round({"round": 1, "accuracy": 0.5, "epsilon": 1.0})
    events = list(tmp_path.glob("events.out.tfevents.*"))
    assert events and all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in events)


# ---------------------------------------------------------------- a killed run reads "interrupted"
HOLD_LOCK = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(60)
"""


def hold_lock(file):
    """A live process that holds `file`'s flock until it is killed."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(file)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def killed_writer(folder: Path) -> dict:
    """A run whose writer is SIGKILLed right after it wrote `running`; the status.json it left."""
    code = (
        "import sys, os, signal; from dpfl.fl_app.results import RunDirectory; r = RunDirectory(sys.argv[1]); "
        "r.write_status('running'); os.kill(os.getpid(), signal.SIGKILL)"
    )
    subprocess.run([sys.executable, "-c", code, str(folder)], cwd=Path(__file__).parents[1])
    return json.loads((folder / "status.json").read_text())


def test_a_run_whose_writer_was_killed_reads_interrupted_also_in_the_file(tmp_path):
    import socket

    from dpfl.fl_app.results import LOCK_FILE
    from dpfl_tools.launch import run_status

    left = killed_writer(tmp_path)
    assert left["status"] == "running" and left["host"] == socket.gethostname()  # what the dead run left
    record = read_status(tmp_path)
    assert record["status"] == "interrupted" and "resume = true" in record["note"]
    on_disk = json.loads((tmp_path / "status.json").read_text())  # a plain JSON reader is told so too
    assert on_disk["status"] == "interrupted" and on_disk["note"] == record["note"] and on_disk["pid"] == left["pid"]
    assert on_disk["found_dead"]["pid"] == os.getpid() and on_disk["found_dead"]["time"] >= left["time"]
    killed_writer(tmp_path)
    assert run_status(tmp_path) == "interrupted"  # the launcher's view, and it rewrites the file as well
    assert json.loads((tmp_path / "status.json").read_text())["status"] == "interrupted"

    (tmp_path / "status.json").write_text(json.dumps(left))
    writer = hold_lock(tmp_path / LOCK_FILE)  # a live writer: running, and its file is never rewritten
    try:
        assert read_status(tmp_path)["status"] == "running"
        assert json.loads((tmp_path / "status.json").read_text()) == left
    finally:
        writer.kill()
        writer.wait()
    (tmp_path / "metrics.jsonl").write_text('{"round": 1}\n')
    with pytest.raises(PreviousRunError, match="holds a previous run \\(interrupted, 1 rounds"):
        RunDirectory(tmp_path)
    assert json.loads((tmp_path / "status.json").read_text())["status"] == "interrupted"


def test_the_next_launch_removes_the_ray_folders_of_dead_launches(tmp_path):
    from dpfl_tools.ray_head import OWNER_LOCK, TEMP_PREFIX, hold_owner_lock, remove_stale_ray_temps

    live, dead, unlocked, other = (tmp_path / f"{TEMP_PREFIX}{n}" for n in ("live", "dead", "unlocked", "x"))
    for folder in (live, dead, unlocked):
        folder.mkdir()
        (folder / "r").mkdir()
    other_name = tmp_path / "not-ours"
    other_name.mkdir()
    owner = hold_lock(live / OWNER_LOCK)
    os.close(hold_owner_lock(dead))  # its launch ended without cleaning up: the lock is free
    try:
        removed = remove_stale_ray_temps(tmp_path)
    finally:
        owner.kill()
        owner.wait()
    assert sorted(removed) == sorted([dead, unlocked])
    assert live.is_dir() and other_name.is_dir() and not dead.exists() and not unlocked.exists() and not other.exists()


def test_the_report_names_an_interrupted_run_and_what_to_do(tmp_path, capsys):
    from dpfl_tools.report import main

    (tmp_path / "status.json").write_text('{"status": "running", "pid": 1, "time": 0}')  # nobody holds its lock
    with pytest.raises(SystemExit):
        main([str(tmp_path), "-o", str(tmp_path / "r.html")])
    err = capsys.readouterr().err
    assert f"{tmp_path} (interrupted: its process was killed" in err and "resume = true" in err
    assert json.loads((tmp_path / "status.json").read_text())["status"] == "interrupted"  # the file says so now
