"""Faults at a run's edges: bad config keys and strings are refused as config errors, a damaged checkpoint is
refused in one line naming the file, a full disk names the file and leaves a true status, and TensorBoard's
event files are the owner's only, as every other run file."""

import errno
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dpfl_tools.inprocess import InProcessGrid
from fl_app.client_app import app as client_app
from fl_app.config import ConfigError, validate
from fl_app.dashboards import TensorBoardWriter
from fl_app.results import PreviousRunError, RunDirectory
from fl_app.server_app import run_federated

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


def test_a_checkpoint_whose_state_does_not_fit_is_refused_before_any_round(tmp_path):
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
    from fl_app.results import append_line

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


def test_a_run_whose_writer_was_killed_reads_interrupted(tmp_path):
    from dpfl_tools.launch import run_status
    from fl_app.results import LOCK_FILE, read_status

    code = (
        "import sys, os, signal; from fl_app.results import RunDirectory; r = RunDirectory(sys.argv[1]); "
        "r.write_status('running'); os.kill(os.getpid(), signal.SIGKILL)"
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=Path(__file__).parents[1])
    assert json.loads((tmp_path / "status.json").read_text())["status"] == "running"  # what the dead run left
    assert read_status(tmp_path)["status"] == "interrupted" and "resume = true" in read_status(tmp_path)["note"]
    assert run_status(tmp_path) == "interrupted"  # the launcher's view
    writer = hold_lock(tmp_path / LOCK_FILE)  # a live writer: still running
    try:
        assert read_status(tmp_path)["status"] == "running"
    finally:
        writer.kill()
        writer.wait()
    (tmp_path / "metrics.jsonl").write_text('{"round": 1}\n')
    with pytest.raises(PreviousRunError, match="holds a previous run \\(interrupted, 1 rounds"):
        RunDirectory(tmp_path)


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
