"""Integrity at the edges (issue 26): values that passed validation and crashed the run later, folders a run
must not write into, the launcher's checks before it starts anything, run folders, bad data files."""

from pathlib import Path

import pytest

from dpfl.fl_app.config import ConfigError, validate

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- config values that crashed the run later


@pytest.mark.parametrize(
    "key,value,message",
    [
        (
            "audit-canaries",
            10**7,
            "run-config key 'audit-canaries' = 10000000: must be an integer in [0, 10000] "
            "(each canary is a model-sized vector in the server's memory)",
        ),
        (
            "mu-max",
            1e-300,
            "run-config key 'mu-max' = 1e-300: must be a number in [1e-06, 1e+06] "
            "(the clients' mu ratios are divided by it)",
        ),
        ("sample-rate", 1e-300, "run-config key 'sample-rate' = 1e-300: must be a number in [1e-06, 1]"),
    ],
)
def test_values_that_crashed_later_are_refused_at_validation(key, value, message):
    with pytest.raises(ConfigError) as err:
        validate({key: value})
    assert str(err.value) == message


def test_the_bounds_themselves_are_allowed():
    cfg = validate({"audit-canaries": 10_000, "sample-rate": 1e-6})
    assert (cfg.audit.canaries, cfg.federation.sample_rate) == (10_000, 1e-6)
    assert validate({"algorithm": "ali-dpfl", "target-epsilon": 2.0, "mu-max": 1e-6}).dpsgd.mu_max == 1e-6


@pytest.mark.parametrize(
    "path,where",
    [
        ("/", "'/' is the filesystem root"),
        ("/etc", "'/etc' is in the system tree /etc"),
        ("/usr/local/dpfl-results", "'/usr/local/dpfl-results' is in the system tree /usr"),
        ("/proc/self", "in the system tree /proc"),
    ],
)
def test_results_dir_in_a_system_folder_is_refused(path, where):
    with pytest.raises(ConfigError) as err:
        validate({"results-dir": path})
    msg = str(err.value)
    assert msg.startswith(
        f"run-config key 'results-dir' = {path!r}: must be a folder outside the filesystem root "
        "and /bin, /boot, /dev, /etc,"
    ) and msg.endswith(where), msg


def test_results_dir_holding_other_files_is_refused_but_a_run_folder_or_empty_one_is_not(tmp_path):
    (tmp_path / "thesis.tex").write_text("mine")
    (tmp_path / "data").mkdir()
    with pytest.raises(ConfigError) as err:
        validate({"results-dir": str(tmp_path)})
    assert str(err.value) == (
        f"run-config key 'results-dir' = {str(tmp_path)!r}: must be a new or empty folder, or a dpfl run folder "
        "(one holding config.json or status.json or metrics.jsonl or checkpoint.npz or .dpfl-run.lock); "
        "it holds 2 other entries ('data', 'thesis.tex')"
    )
    assert validate({"results-dir": str(tmp_path / "data")}).output.results_dir == str(tmp_path / "data")  # empty
    assert validate({"results-dir": str(tmp_path / "new" / "run")})  # not there yet
    (tmp_path / "status.json").write_text('{"status": "failed"}')  # a run folder: resumed or refused by the run
    assert validate({"results-dir": str(tmp_path)})


def test_a_misspelled_key_names_its_close_matches():
    with pytest.raises(ConfigError) as err:
        validate({"nosie-multiplier": 2.0, "sample_rate": 0.1})
    assert str(err.value).startswith(
        "unknown run-config key(s) 'nosie-multiplier' = 2.0 (did you mean "
        "'noise-multiplier' or 'mu-noise-multiplier' or 'sample-noise-multiplier'?), "
        "'sample_rate' = 0.1 (did you mean 'sample-rate'"
    ), str(err.value)


# ---------------------------------------------------------------- the launcher checks before it starts anything


def launch_refusal(argv: list[str]) -> str:
    """The message of the launcher's SystemExit for `argv` (raised before any process starts)."""
    from dpfl_tools.launch import main

    with pytest.raises(SystemExit) as err:
        main(argv)
    return str(err.value.code)


@pytest.mark.slow  # 2-9 s together: the fast tier keeps its 5-minute margin on 2 cores
def test_the_launcher_refuses_a_bad_config_in_seconds_and_starts_nothing(tmp_path):
    import subprocess
    import sys
    import time

    results = tmp_path / "results"
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "dpfl_tools.launch", "--results", str(results), "-c", "nosie-multiplier=2.0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    seconds = time.monotonic() - t0
    assert out.returncode == 1 and out.stdout == "", out
    assert out.stderr.startswith(
        "unknown run-config key(s) 'nosie-multiplier' = 2.0 (did you mean 'noise-multiplier'"
    ), out.stderr
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr and "code: 15" not in out.stderr
    assert not results.exists()  # no SuperLink, no Ray head, no logs: nothing was started
    # ~1.5-2 s idle (Python, Flower and torch imports), 30 s seen in CI's slow tier with 4 processes on 2 cores: the
    # seconds are printed, not asserted (a timed assert fails by load); what is asserted is that nothing started
    print(f"launcher refused a misspelled key in {seconds:.2f} s")


@pytest.mark.parametrize(
    "argv,message",
    [
        (["-c", "sample-rate=1.5"], "run-config key 'sample-rate' = 1.5: must be a number in [1e-06, 1]"),
        (
            ["-c", "audit-canaries=10000000"],
            "run-config key 'audit-canaries' = 10000000: must be an integer in "
            "[0, 10000] (each canary is a model-sized vector in the server's memory)",
        ),
        (
            ["--clients", "2", "-c", "min-nodes=5"],
            "--clients 2 is fewer than run-config key 'min-nodes' = 5: the run "
            "would wait for nodes that never come; pass --clients 5 (or more), or "
            '-c "min-nodes=2"',
        ),
        (
            ["--sweep", "noise-multiplier=1,0.0001"],
            "run-config key 'noise-multiplier' = 0.0001: must be a number: 0 or in [0.001, 1000]",
        ),
        (
            ["--reference", "-c", "results-dir='/tmp/x'"],
            "run-config key 'results-dir' = '/tmp/x' names one folder for 2 "
            "runs (--sweep, --reference): leave it out, and each run gets its "
            "own under --results",
        ),
        (
            ["-c", "lr=0.1 oops momentum = 0.9"],
            "-c 'lr=0.1 oops momentum = 0.9': 'oops', 'momentum', '=', '0.9' is not "
            "key=value (without spaces around '='; quote strings: key='text')",
        ),
    ],
)
def test_the_launcher_names_the_problem(tmp_path, argv, message):
    results = tmp_path / "results"
    assert launch_refusal(["--results", str(results), *argv]) == message
    assert not results.exists()


def test_the_launcher_honours_a_given_results_dir_and_resumes_a_run_folder(tmp_path):
    import argparse
    import json

    import numpy as np

    from dpfl.fl_app.config import SPEC
    from dpfl_tools.plan import parse_overrides, plan_runs

    args = argparse.Namespace(
        resume="",
        sweep="",
        reference=False,
        clients=4,
        results=str(tmp_path / "results"),
        run_config=f"num-rounds=3 results-dir='{tmp_path / 'mine'}'",
    )
    [(name, overrides, run_dir, _)] = plan_runs(args, "stamp")
    assert run_dir == tmp_path / "mine" and parse_overrides(overrides)["results-dir"] == str(tmp_path / "mine")
    assert overrides.count("results-dir") == 1

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(
        json.dumps(
            {
                **{k: s.default for k, s in SPEC.items()},
                "num-rounds": 2,
                "noise-multiplier": 2.0,
                "results-dir": str(run),
            }
        )
    )
    with open(run / "checkpoint.npz", "wb") as f:  # a checkpoint the resume check reads
        np.savez(f, state=np.frombuffer(b'{"completed_rounds": 2}', np.uint8), array_0=np.zeros(1, np.float32))
    args = argparse.Namespace(
        resume=str(run), sweep="", reference=False, clients=4, results=str(tmp_path / "r"), run_config="num-rounds=5"
    )
    [(name, overrides, run_dir, _)] = plan_runs(args, "stamp")
    assert run_dir == run and parse_overrides(overrides) == {
        "num-rounds": 5,
        "noise-multiplier": 2.0,
        "resume": True,
        "results-dir": str(run),
    }
    args.run_config = "noise-multiplier=1.0"  # the run's settings may not change (but for num-rounds)
    assert launch_refusal(["--resume", str(run), "-c", "noise-multiplier=1.0"]) == (
        f"resume = true, but the run in {run} was made with other settings: 'noise-multiplier' = 2.0 there, 1.0 now"
    )
    (run / "checkpoint.npz").unlink()
    assert launch_refusal(["--resume", str(run)]) == (
        f"resume = true, but {run / 'checkpoint.npz'} does not exist (the run in {run} completed no round, or this "
        "is not its folder): set resume = false to start afresh"
    )


# ---------------------------------------------------------------- run folders: the owner's, one writer, unique


def test_run_folder_files_are_the_owners_only(tmp_path):
    import stat

    import numpy as np
    from flwr.app import ArrayRecord

    from dpfl.fl_app.results import RunDirectory, plot_runs
    from dpfl.fl_app.settings import Settings

    run = RunDirectory(tmp_path / "run")
    run.write_config(Settings())
    run.write_status("running")
    run.append_round({"round": 1, "accuracy": 0.5}, {"round": 1})
    run.write_checkpoint({"rounds": 1}, ArrayRecord([np.zeros(3, np.float32)]))
    run.write_summary({"strategy": "x"}, {"seconds": 1.0})
    plot_runs([run.path], run.path / "plot.png")
    modes = {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in [run.path, *run.path.iterdir()]}
    assert modes == {
        "run": "0o700",
        **{
            name: "0o600"
            for name in (
                ".dpfl-run.lock",
                "config.json",
                "status.json",
                "metrics.jsonl",
                "diagnostics.jsonl",
                "checkpoint.npz",
                "summary.json",
                "diagnostics-summary.json",
                "plot.png",
            )
        },
    }


def test_the_launchers_flower_home_is_the_owners_only(tmp_path):
    import stat

    from dpfl_tools.superlink import own_superlink_env

    own_superlink_env({}, tmp_path / "home")
    assert oct(stat.S_IMODE((tmp_path / "home").stat().st_mode)) == "0o700"


HOLD_LOCK = """
import sys, time
from dpfl.fl_app.results import RunDirectory
run = RunDirectory(sys.argv[1])
print("locked", flush=True)
time.sleep(60)
"""


@pytest.mark.slow
def test_a_run_folder_has_one_writer(tmp_path):
    import os
    import subprocess
    import sys

    from dpfl.fl_app.results import RunDirectory, RunFolderLockedError, lock_run_folder

    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline() == "locked\n"
        with pytest.raises(RunFolderLockedError) as err:
            RunDirectory(tmp_path)
        assert str(err.value) == (
            f"results-dir {tmp_path} is being written by another run (pid {holder.pid} holds "
            f"{tmp_path / '.dpfl-run.lock'}): wait for it to end, or choose another results-dir "
            "or run-name"
        )
    finally:
        holder.kill()
        holder.wait()
    run = RunDirectory(tmp_path)  # the holder died: its lock went with it
    with pytest.raises(RunFolderLockedError):
        RunDirectory(tmp_path)  # a second writer in the same process is refused too
    run.write_status("completed")  # the run's last word releases the folder
    os.close(lock_run_folder(tmp_path))


def test_two_runs_started_in_the_same_second_get_different_folders(monkeypatch):
    import time

    from dpfl.fl_app.config import validate
    from dpfl.fl_app.results import resolve_run_dir
    from dpfl_tools.plan import run_stamp

    monkeypatch.setattr(time, "strftime", lambda fmt, *a: "20260101-120000")
    cfg = validate({})
    names = {resolve_run_dir(cfg).name for _ in range(20)}
    assert len(names) == 20 and all(
        n.startswith("20260101-120000-") and n.endswith("-dp-fedsam-mnist-embedded") for n in names
    ), names
    assert len({run_stamp() for _ in range(20)}) == 20


def previous_run(folder: Path, checkpoint: bool = True) -> Path:
    """A run folder as a run killed after round 2 leaves it: config, status, two rounds, a checkpoint."""
    import json

    import numpy as np
    from flwr.app import ArrayRecord

    from dpfl.fl_app.config import validate
    from dpfl.fl_app.results import RunDirectory

    run = RunDirectory(folder)
    run.write_config(validate({"results-dir": str(folder)}))
    run.write_status("running")
    for r in (1, 2):
        run.append_round({"round": r, "epsilon": r / 10}, {"round": r})
    if checkpoint:
        run.write_checkpoint({"completed_rounds": 2}, ArrayRecord([np.ones(2, np.float32)]))
    run.close()
    assert json.loads((folder / "status.json").read_text())["status"] == "running"
    return folder


def test_a_refused_resume_leaves_the_round_files_as_they_were(tmp_path):
    from dpfl.fl_app.config import validate
    from dpfl.fl_app.results import PreviousRunError, RunDirectory

    folder = previous_run(tmp_path / "run")
    before = {name: (folder / name).read_bytes() for name in ("metrics.jsonl", "diagnostics.jsonl")}
    run = RunDirectory(folder, resume=True)
    with pytest.raises(PreviousRunError, match="'noise-multiplier' = 1.0 there, 2.0 now"):
        run.write_config(validate({"results-dir": str(folder), "resume": True, "noise-multiplier": 2.0}))
    assert {name: (folder / name).read_bytes() for name in before} == before
    assert before["metrics.jsonl"].count(b"\n") == 2


def test_the_launcher_fails_a_run_whose_status_is_a_previous_runs(tmp_path):
    import json
    import time

    from dpfl_tools.launch import run_status

    (tmp_path / "status.json").write_text(json.dumps({"status": "completed", "time": time.time() - 60}))
    assert run_status(tmp_path) == "completed"
    assert run_status(tmp_path, since=time.time()) == "stale"  # the resumed run never wrote: not a success


def test_resume_without_a_checkpoint_is_an_error_naming_it(tmp_path):
    from dpfl.fl_app.results import PreviousRunError, RunDirectory

    folder = previous_run(tmp_path / "run", checkpoint=False)
    with pytest.raises(PreviousRunError) as err:
        RunDirectory(folder, resume=True)
    assert str(err.value) == (
        f"resume = true, but {folder / 'checkpoint.npz'} does not exist (the run in {folder} "
        "completed no round, or this is not its folder): set resume = false to start afresh"
    )
    assert (folder / "metrics.jsonl").read_text().count("\n") == 2


def test_a_full_disk_leaves_no_half_written_file(tmp_path, monkeypatch):
    import errno
    import os

    from dpfl.fl_app.results import RunDirectory, read_metrics

    run = RunDirectory(tmp_path / "run")
    run.write_status("running")
    run.append_round({"round": 1}, {"round": 1})
    before = {p.name: p.read_bytes() for p in run.path.iterdir()}
    real_fsync = os.fsync

    def full(fd):  # the data reached the page cache; the disk refuses it
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        run.write_status("completed")
    monkeypatch.setattr(os, "fsync", real_fsync)

    class FullFile:  # a write that gets half a line out, then finds the disk full
        def __init__(self, path):
            self.f = open(path, "ab")

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            self.f.write(data[:5])
            self.f.flush()
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fdopen", lambda fd, mode: FullFile(f"/proc/self/fd/{fd}"))
    with pytest.raises(OSError, match="No space left"):
        run.append_round({"round": 2}, {"round": 2})
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in run.path.iterdir()} == before  # no temp files, no half lines
    assert read_metrics(run.path) == [{"round": 1}]


# ---------------------------------------------------------------- bad data files and caches: one line naming the file


def idx_bytes(array) -> bytes:
    """An unsigned-byte IDX file holding `array`."""
    import numpy as np

    return b"\x00\x00\x08" + bytes([array.ndim]) + np.asarray(array.shape, ">i4").tobytes() + array.tobytes()


def mnist_folder(folder: Path, train: int = 20, test: int = 10, train_labels: int | None = None) -> Path:
    """A data-dir with the four MNIST .gz files: `train` and `test` random digits."""
    import gzip

    import numpy as np

    rng = np.random.default_rng(0)
    folder.mkdir(parents=True)
    stems = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
    arrays = (
        rng.integers(0, 256, (train, 28, 28), np.uint8),
        rng.integers(0, 10, train_labels or train, np.uint8),
        rng.integers(0, 256, (test, 28, 28), np.uint8),
        rng.integers(0, 10, test, np.uint8),
    )
    for stem, array in zip(stems, arrays):
        (folder / f"{stem}.gz").write_bytes(gzip.compress(idx_bytes(array)))
    return folder


def data_error(folder: Path) -> str:
    from dpfl.dpcore.task.data import load_dataset
    from dpfl.dpcore.task.data_files import DataFileError

    with pytest.raises(DataFileError) as err:
        load_dataset("mnist", str(folder))
    assert "\n" not in str(err.value)
    return str(err.value)


def test_good_idx_files_load(tmp_path):
    from dpfl.dpcore.task.data import load_dataset

    pool, test = load_dataset("mnist", str(mnist_folder(tmp_path / "mnist")))
    assert (len(pool), len(test), pool.x.shape[1:]) == (20, 10, (1, 28, 28))


def test_a_truncated_gz_names_the_file(tmp_path):
    folder = mnist_folder(tmp_path / "mnist")
    gz = folder / "train-images-idx3-ubyte.gz"
    gz.write_bytes(gz.read_bytes()[:200])
    assert data_error(folder) == (
        f"{gz}: cannot be read as gzip (EOFError: Compressed file ended before the "
        "end-of-stream marker was reached); replace it with a complete copy"
    )


def test_garbage_named_gz_names_the_file(tmp_path):
    folder = mnist_folder(tmp_path / "mnist")
    gz = folder / "t10k-labels-idx1-ubyte.gz"
    gz.write_bytes(b"<html>404 Not Found</html>")
    assert data_error(folder) == (
        f"{gz}: cannot be read as gzip (BadGzipFile: Not a gzipped file (b'<h')); replace it with a complete copy"
    )


def test_an_idx_file_shorter_than_its_header_says_names_the_file(tmp_path):
    import gzip

    folder = mnist_folder(tmp_path / "mnist")
    gz = folder / "train-images-idx3-ubyte.gz"
    gz.write_bytes(gzip.compress(gzip.decompress(gz.read_bytes())[:1000]))
    assert data_error(folder) == (
        f"{gz}: its header says shape (20, 28, 28) (15680 bytes of data), but it holds "
        "984: truncated; replace it with a complete copy"
    )


def test_images_and_labels_of_different_counts_are_refused(tmp_path):
    folder = mnist_folder(tmp_path / "mnist", train_labels=19)
    assert data_error(folder) == (
        f"{folder / 'train-images-idx3-ubyte.gz'} holds images of shape (20, 28, 28) and "
        f"{folder / 'train-labels-idx1-ubyte.gz'} labels of shape (19,): expected (N, H, W) "
        "and (N,) with the same N"
    )


def test_a_plain_file_shadowing_the_gz_is_named_with_the_gz(tmp_path):
    folder = mnist_folder(tmp_path / "mnist")
    (folder / "train-labels-idx1-ubyte").write_bytes(b"partial")
    assert data_error(folder) == (
        f"{folder / 'train-labels-idx1-ubyte'}: not an unsigned-byte IDX file (it starts with b'part', not "
        "b'\\x00\\x00\\x08'); replace it with a complete copy (it is read instead of train-labels-idx1-ubyte.gz "
        "beside it: remove one of the two)"
    )


@pytest.mark.parametrize("corruption", ["empty", "truncated", "wrong keys"])
def test_a_corrupted_cache_file_is_rebuilt_with_a_warning_naming_it(tmp_path, monkeypatch, corruption):
    import io

    import numpy as np

    from dpfl.dpcore.task import data

    monkeypatch.setenv("DPFL_CACHE_DIR", str(tmp_path))
    x, y = data._embedded_images("digits")
    [cache] = tmp_path.glob("decoded-*.npz")
    good = cache.read_bytes()
    wrong = io.BytesIO()
    np.savez(wrong, x=np.zeros(3))
    cache.write_bytes({"empty": b"", "truncated": good[: len(good) // 2], "wrong keys": wrong.getvalue()}[corruption])
    with pytest.warns(UserWarning, match=f"cache file {cache} is corrupted .*: rebuilding it"):
        x2, y2 = data._embedded_images("digits")
    np.testing.assert_array_equal(x2, x)
    np.testing.assert_array_equal(y2, y)
    assert cache.read_bytes() == good and [p.name for p in tmp_path.iterdir()] == [cache.name]


def test_a_full_disk_leaves_no_half_written_cache_file(tmp_path, monkeypatch):
    import errno

    import numpy as np

    from dpfl.dpcore.task import data

    monkeypatch.setenv("DPFL_CACHE_DIR", str(tmp_path))

    def half_then_full(f, **arrays):
        f.write(b"PK\x03\x04 half a zip")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(np, "savez", half_then_full)
    x, y = data._embedded_images("digits")  # the cache could not be written: the decoded arrays all the same
    assert x.shape == (1797, 8, 8) and list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- a SIGKILLed launcher takes its processes with it


@pytest.mark.slow
def test_a_sigkilled_launcher_leaves_nothing_running(tmp_path):
    """SIGKILL (no handler, no `finally`) to the launcher alone, mid-run: its SuperLink, the simulation and the
    Ray head go too (each child dies with its parent: PR_SET_PDEATHSIG, and its own cleanup on SIGTERM)."""
    import os
    import signal
    import time

    from tests.test_launch import (
        describe,
        kill_long_launch,
        processes_left,
        processes_named,
        start_long_launch,
        wait_for_round_one,
    )

    launcher, results, log_path = start_long_launch(tmp_path)
    try:
        wait_for_round_one(launcher, results, log_path)
        assert processes_named("flwr-simulation", str(results)) and processes_named("gcs_server", str(results))
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=10)
        t0 = time.monotonic()
        left = describe(processes_left(results))
        print(f"{len(left)} processes left {time.monotonic() - t0:.1f} s after the launcher's SIGKILL")
        assert left == []
    finally:
        kill_long_launch(launcher, results)


@pytest.mark.slow
def test_the_launcher_resumes_a_run_and_refuses_a_changed_one(tmp_path):
    """`--resume RUN_DIR -c num-rounds=2` continues a 1-round run to 2 rounds (the settings from its config.json);
    a resume with other settings exits 1 before anything starts and leaves the round files as they were."""
    import json
    import subprocess
    import sys

    from dpfl.fl_app.results import read_metrics

    results = tmp_path / "results"

    def launch(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "dpfl_tools.launch", "--clients", "2", "--results", str(results), *argv],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=400,
        )

    first = launch("-c", "num-rounds=1 sample-rate=1.0 dataset='digits' model='mlp' partitioner='iid' local-steps=2")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert list(results.glob(".flwr-home-*")) == []  # the launch's private FLWR_HOME goes with its SuperLink
    [run] = results.glob("*-dp")
    resumed = launch("--resume", str(run), "-c", "num-rounds=2")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["resumed_after_round"], summary["rounds_completed"]) == (1, 2)
    assert [r["round"] for r in read_metrics(run)] == [1, 2]
    before = (run / "metrics.jsonl").read_bytes()
    changed = launch("--resume", str(run), "-c", "num-rounds=3 lr=0.5")
    assert changed.returncode == 1 and changed.stderr == (
        f"resume = true, but the run in {run} was made with other settings: 'lr' = 0.1 there, 0.5 now\n"
    )
    assert (run / "metrics.jsonl").read_bytes() == before
