"""The run directory: config.json, status.json, metrics.jsonl, diagnostics.jsonl, checkpoint.npz,
summary.json, diagnostics-summary.json, plot.png.

metrics.jsonl and summary.json hold what the privacy ledger covers (fit to publish); diagnostics.jsonl
and diagnostics-summary.json hold the raw statistics of client replies (counts, norms, losses, client
evaluation, timing), which no noise covers. Non-finite numbers (epsilon of a non-private run is inf)
are written as null.
`python -m dpfl.fl_app.results RUN_DIR [REFERENCE_RUN_DIR ...]` redraws a run's plot with
other runs (e.g. the non-private reference) as extra lines; `--tensorboard RUN_DIR ...` writes
TensorBoard events for older run folders.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import secrets
import socket
import sys
import time
import weakref
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from dpfl.dpcore.task.atomic import atomic_write, lock_held
from dpfl.fl_app.run_files import RunFileError, not_a_file_error, read_diagnostics, read_metrics, read_run_file

if TYPE_CHECKING:
    from dpfl.fl_app.settings import Settings


def json_safe(obj):
    """Replace NaN/inf by None, recursively, so the files are strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if hasattr(obj, "item"):  # numpy scalar
        return json_safe(obj.item())
    return obj


def append_line(path: Path, line: str) -> None:
    """Append `line` to `path` (created 0600), or nothing: a failed write (a full disk) is cut off again, so
    no half line is left for the readers."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        size = os.fstat(fd).st_size
        try:
            with os.fdopen(os.dup(fd), "wb") as f:
                f.write(line.encode())
        except OSError as exc:
            os.ftruncate(fd, size)
            if exc.errno is not None and exc.filename is None:  # a full disk: say which file
                exc.filename = str(path)
            raise
    finally:
        os.close(fd)


def resolve_run_dir(s: Settings) -> Path:
    """results-dir if given, else ~/dpfl-results/<run-name or time-random-algorithm-dataset> (4 random hex
    digits: two runs started in the same second get different folders)."""
    output = s.output
    name = (
        output.run_name or f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}-{s.run.algorithm}-{s.data.dataset}"
    )
    base = Path(os.path.expanduser(output.results_dir)) if output.results_dir else Path.home() / "dpfl-results" / name
    return base.resolve()


class PreviousRunError(ValueError):
    """The results folder holds another run that this one would overwrite or mix with."""


class RunFolderLockedError(PreviousRunError):
    """Another process is writing the run folder (it holds the folder's lock file)."""


RESUMABLE_KEYS = ("resume", "num-rounds")  # what may change between a run and its resumption
LOCK_FILE = ".dpfl-run.lock"  # held (flock) by the run's one writer
RUN_FILES = ("config.json", "status.json", "metrics.jsonl", "checkpoint.npz", LOCK_FILE)  # any: a dpfl run folder
TERMINAL_STATUSES = ("completed", "failed")  # written last: the lock is released with them
WRITTEN_FILES = (  # every file a run writes into its folder (RunDirectory, plot_runs): a directory there is refused
    *RUN_FILES,
    "diagnostics.jsonl",
    "summary.json",
    "diagnostics-summary.json",
    "plot.png",
)


def check_run_files(path: Path) -> None:
    """RunFileError naming the first of the run's files (WRITTEN_FILES) in `path` that is a directory (or another
    non-file): a run would fail on it, a resume at its start, a fresh run at its end (summary.json)."""
    for name in WRITTEN_FILES:
        file = path / name
        if file.exists() and not file.is_file():
            raise not_a_file_error(file)


def unreadable_checkpoint_error(file: Path, why: str) -> PreviousRunError:
    """One line naming a checkpoint that cannot be resumed from, and what to do."""
    return PreviousRunError(
        f"cannot resume from {file}: {why}. The file is damaged (a truncated copy, a full disk, or not written "
        f"by this program): restore it from a backup, or set resume = false with another results-dir or run-name "
        f"to start afresh"
    )


def read_checkpoint(file: Path) -> tuple[dict, list]:
    """(strategy state, global arrays) from checkpoint.npz; PreviousRunError naming the file if it is not one
    this program wrote (truncated, garbage, an object array, state that is not a JSON object)."""
    try:
        with np.load(file, allow_pickle=False) as data:
            names = set(data.files)
            arrays_expected = {f"array_{i}" for i in range(len(names) - 1)}
            if "state" not in names or names - {"state"} != arrays_expected:
                raise ValueError(f"its arrays are {sorted(names)}, not 'state' and array_0.. array_N")
            state = json.loads(data["state"].tobytes().decode())
            arrays = [data[f"array_{i}"] for i in range(len(arrays_expected))]
    except (OSError, EOFError, ValueError, KeyError, UnicodeDecodeError, zipfile.BadZipFile) as exc:
        raise unreadable_checkpoint_error(file, f"{type(exc).__name__}: {exc}") from None
    if not isinstance(state, dict):
        raise unreadable_checkpoint_error(file, f"its state is a JSON {type(state).__name__}, not an object")
    rounds = state.get("completed_rounds")
    if type(rounds) is not int or rounds < 0:
        raise unreadable_checkpoint_error(file, f"its state's completed_rounds = {rounds!r} is not a round count")
    return state, arrays


def no_checkpoint_error(path: Path) -> PreviousRunError:
    """The error of a resume with no checkpoint to continue from (never a silent fresh start)."""
    return PreviousRunError(
        f"resume = true, but {path / 'checkpoint.npz'} does not exist (the run in {path} "
        "completed no round, or this is not its folder): set resume = false to start afresh"
    )


def config_differences(path: Path, s: Settings) -> list[str]:
    """What differs, but for RESUMABLE_KEYS, between the settings and the config.json of the run in `path`."""
    previous_file = path / "config.json"
    if not previous_file.exists():
        return []
    previous, cfg = json.loads(previous_file.read_text()), s.run_config()
    return [
        f"'{k}' = {previous.get(k)!r} there, {cfg.get(k)!r} now"
        for k in sorted(set(previous) | set(cfg))
        if k not in RESUMABLE_KEYS and json_safe(previous.get(k)) != json_safe(cfg.get(k))
    ]


def check_resumable(path: Path, s: Settings) -> None:
    """Can the run in `path` be continued with settings `s` (a checkpoint, the same settings)? PreviousRunError
    if not; the launcher asks before it starts anything."""
    check_run_files(path)
    if not (path / "checkpoint.npz").is_file():
        raise no_checkpoint_error(path)
    read_checkpoint(path / "checkpoint.npz")
    differ = config_differences(path, s)
    if differ:
        raise PreviousRunError(
            f"resume = true, but the run in {path} was made with other settings: " + ", ".join(differ)
        )


STATUSES = ("running", "interrupted", *TERMINAL_STATUSES)
INTERRUPTED_NOTE = (
    "its process was killed while the run went on (status.json said running): the rounds in metrics.jsonl "
    "stand and the checkpoint holds the last of them; continue it with resume = true"
)
# s: how long a reader that found a dead run, and a new writer, wait for the folder's lock (a reader holds it for
# one atomic write of status.json; a live writer holds it for the whole run: the reader's wait is short)
READER_GRACE, WRITER_GRACE = 0.2, 2.0


def damaged_status_error(file: Path, why: str) -> RunFileError:
    """One line naming a status.json this program did not write, what is wrong and what to do."""
    return RunFileError(
        f"{file}: {why}; the file is damaged (cut short, a full disk, or not written by this program): the run's "
        f"rounds stand in metrics.jsonl and checkpoint.npz, so delete {file.name} and resume (resume = true), or "
        "choose another results-dir or run-name"
    )


def read_status_file(path: Path) -> dict | None:
    """status.json of the run folder `path` as written (None without it); RunFileError naming the file where it is
    not a JSON object with a known `status`."""
    file = path / "status.json"
    text = read_run_file(file)
    if text is None:
        return None
    try:
        record = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise damaged_status_error(file, f"not JSON ({exc})") from None
    if not isinstance(record, dict):
        raise damaged_status_error(file, f"a JSON {type(record).__name__}, not an object")
    if record.get("status") not in STATUSES:
        raise damaged_status_error(file, f"'status' = {record.get('status')!r}, not one of {', '.join(STATUSES)}")
    return record


def read_status(path: Path | str, lock_held: bool = False) -> dict:
    """status.json as it stands ({"status": "missing"} without it; RunFileError naming it where it is damaged),
    except that a run whose status says `running` while no process holds the folder's lock (its writer was
    killed: SIGKILL, a crash of the machine) is `interrupted`, and the file is rewritten so, atomically and under
    the folder's lock (a writer starting meanwhile is never overwritten): a plain JSON reader then sees it too.
    `lock_held`: the caller holds the folder's lock, so no other writer can be alive."""
    path = Path(path)
    record = read_status_file(path)
    if record is None or record["status"] != "running":
        return record or {"status": "missing"}
    if lock_held:
        return mark_interrupted(path, record)
    try:
        fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:  # a reader that may not write the folder: the lock tells, the file stays as it is
        dead = not lock_held_by_writer(path)
        return {**record, "status": "interrupted", "note": INTERRUPTED_NOTE} if dead else record
    try:
        if not try_flock(fd, READER_GRACE):
            return record  # its writer lives
        record = read_status_file(path) or {"status": "missing"}  # as it stands under the lock
        return mark_interrupted(path, record) if record["status"] == "running" else record
    finally:
        os.close(fd)


def check_run_folder(path: Path | str, resume: bool, lock_held: bool = False) -> str:
    """What a run reads of its folder `path` before it writes anything, checked in one place (RunDirectory, and
    the launcher for every engine before anything starts): no directory where a run file belongs, a readable
    status.json and metrics.jsonl (RunFileError naming the file, and what to do), a checkpoint to resume from
    (`resume`) or no previous run to overwrite (PreviousRunError). The previous run's status ("missing": none)."""
    path = Path(path)
    check_run_files(path)
    has_checkpoint = (path / "checkpoint.npz").exists()
    if resume and not has_checkpoint:
        raise no_checkpoint_error(path)
    previous_rounds = len(read_metrics(path))
    previous_status = read_status(path, lock_held=lock_held)["status"]
    if not resume and (has_checkpoint or previous_rounds):
        raise PreviousRunError(
            f"results-dir {path} holds a previous run ({previous_status}, {previous_rounds} rounds in "
            f"metrics.jsonl{', a checkpoint' if has_checkpoint else ''}): set resume = true to "
            "continue it, or choose another results-dir or run-name"
        )
    return previous_status


def lock_held_by_writer(path: Path) -> bool:
    """Does a live process hold `path`'s lock file (the run's one writer)? A SIGKILLed ServerApp holds none."""
    return lock_held(path / LOCK_FILE)


def mark_interrupted(path: Path, record: dict) -> dict:
    """Rewrite a dead run's status.json as interrupted, with who found it (`found_dead`: pid, host, time); where
    this process may not write the folder the file stays, and the reader still gets the record."""
    record = {**record, "status": "interrupted", "note": INTERRUPTED_NOTE, "found_dead": writer_identity()}
    text = json.dumps(json_safe(record), indent=2, sort_keys=True) + "\n"
    with contextlib.suppress(OSError):
        atomic_write(path / "status.json", lambda f: f.write(text.encode()))
    return record


def writer_identity() -> dict:
    """pid, host and time of the process that writes a status (a reader on another host knows whose pid it is)."""
    return {"pid": os.getpid(), "host": socket.gethostname(), "time": time.time()}


def try_flock(fd: int, grace: float) -> bool:
    """flock `fd` exclusively within `grace` seconds; False where another process holds it on (a starting writer
    waits for a reader that marks a dead run, and does not fail on it)."""
    deadline = time.monotonic() + grace
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)


def lock_run_folder(path: Path) -> int:
    """An open descriptor of `path`'s lock file, flock'ed exclusively (released when it is closed, also when the
    process dies); RunFolderLockedError, naming the folder and the holder's pid, if another writer has it."""
    lock = path / LOCK_FILE
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    if not try_flock(fd, WRITER_GRACE):
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise RunFolderLockedError(
            f"results-dir {path} is being written by another run (pid {holder} holds "
            f"{lock}): wait for it to end, or choose another results-dir or run-name"
        )
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


class RunDirectory:
    """Writes one run's files as the run goes; nothing already written is lost on a crash.

    Files: config.json, status.json (running / completed / failed), metrics.jsonl and
    diagnostics.jsonl (one line per round each), checkpoint.npz (after every round: the global arrays
    and the strategy's whole state, the ledger included, replaced atomically), summary.json,
    diagnostics-summary.json and plot.png at the end. The folder is the owner's only (0700, files 0600),
    and has one writer: this object holds its lock file (LOCK_FILE) until the run's last status
    (completed or failed), `close()`, or its end.

    A folder that holds a previous run is refused unless `resume`: then the checkpoint is read
    (`checkpoint`; none is an error), the config must match the previous one (but for RESUMABLE_KEYS), and
    the caller rewrites the round files from the checkpoint's history (`rewrite_rounds`), so no round
    appears twice. Nothing is changed in the folder before those checks pass.
    """

    def __init__(self, path: Path | str, *, resume: bool = False) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        os.chmod(self.path, 0o700)
        self.metrics_file = self.path / "metrics.jsonl"
        self.diagnostics_file = self.path / "diagnostics.jsonl"
        self.checkpoint_file = self.path / "checkpoint.npz"
        check_run_files(self.path)  # before the lock: its file may be a directory too
        self._lock = lock_run_folder(self.path)
        self._release = weakref.finalize(self, os.close, self._lock)
        self.saved_rounds = 0  # rounds the checkpoint holds: what a resume continues from
        try:
            previous_status = check_run_folder(self.path, resume, lock_held=True)
            self.checkpoint = self.read_checkpoint() if resume else None
            self.resumed_status = previous_status if resume else None
        except BaseException:
            self.close()
            raise
        if not resume:
            self.rewrite_rounds([])
        elif self.checkpoint is not None:
            self.saved_rounds = self.checkpoint[0]["completed_rounds"]

    def close(self) -> None:
        """Release the folder's lock (another process may then write it)."""
        self._release()

    def _write_json(self, name: str, obj) -> None:
        text = json.dumps(json_safe(obj), indent=2, sort_keys=True) + "\n"
        atomic_write(self.path / name, lambda f: f.write(text.encode()))

    def write_config(self, s: Settings) -> None:
        """config.json (the flat run config); resuming, the previous run's must agree (but for RESUMABLE_KEYS)."""
        differ = config_differences(self.path, s) if self.checkpoint is not None else []
        if differ:
            self.close()
            raise PreviousRunError(
                f"resume = true, but the run in {self.path} was made with other settings: " + ", ".join(differ)
            )
        self._write_json("config.json", s.run_config())

    def write_status(self, status: str, **details) -> None:
        """status.json with the writer's pid, host and time: running (also what a killed run leaves, until a reader
        finds it dead: `read_status`), completed or failed (these two release the folder's lock)."""
        self._write_json("status.json", {"status": status, **writer_identity(), **details})
        if status in TERMINAL_STATUSES:
            self.close()

    def rewrite_rounds(self, rounds: list[tuple[dict, dict]]) -> None:
        """metrics.jsonl and diagnostics.jsonl from (published, diagnostics) pairs, e.g. a checkpoint's history;
        each replaced atomically."""
        for path, records in (
            (self.metrics_file, [p for p, _ in rounds]),
            (self.diagnostics_file, [d for _, d in rounds]),
        ):
            text = "".join(json.dumps(json_safe(r), sort_keys=True) + "\n" for r in records)
            atomic_write(path, lambda f, text=text: f.write(text.encode()))

    def append_round(self, published: dict, diagnostics: dict) -> None:
        """One round: what the ledger covers to metrics.jsonl, the raw diagnostics to diagnostics.jsonl."""
        for path, record in ((self.metrics_file, published), (self.diagnostics_file, diagnostics)):
            append_line(path, json.dumps(json_safe(record), sort_keys=True) + "\n")

    def write_checkpoint(self, state: dict, arrays) -> None:
        """checkpoint.npz: the global arrays and the strategy's state as JSON, replaced atomically."""
        state_bytes = np.frombuffer(json.dumps(json_safe(state)).encode(), dtype=np.uint8)
        payload = {f"array_{i}": a for i, a in enumerate(arrays.to_numpy_ndarrays())}
        atomic_write(self.checkpoint_file, lambda f: np.savez(f, state=state_bytes, **payload))
        self.saved_rounds = int(state.get("completed_rounds", self.saved_rounds))

    def read_checkpoint(self) -> tuple[dict, list] | None:
        """(strategy state, global arrays) of the last completed round, or None."""
        return read_checkpoint(self.checkpoint_file) if self.checkpoint_file.exists() else None

    def write_summary(self, summary: dict, diagnostics: dict) -> None:
        """summary.json (what the ledger covers) and diagnostics-summary.json (not private)."""
        self._write_json("summary.json", summary)
        self._write_json("diagnostics-summary.json", diagnostics)


def run_label(summary: dict) -> str:
    """The run's label in plots: its algorithm's (fl_app.algorithms), or the strategy's name."""
    from dpfl.fl_app.algorithms import ALGORITHMS

    name = summary.get("strategy")
    label = ALGORITHMS[name].run_label(summary) if name in ALGORITHMS else str(name)
    return label if summary.get("epsilon_is_guarantee", True) else f"{label} (epsilon: no guarantee)"


def read_summary(run_dir: Path | str) -> dict:
    """summary.json merged with diagnostics-summary.json (for reports and research; not private)."""
    extra = Path(run_dir, "diagnostics-summary.json")
    return {
        **(json.loads(extra.read_text()) if extra.exists() else {}),
        **json.loads(Path(run_dir, "summary.json").read_text()),
    }


def read_rounds(run_dir: Path | str) -> list[dict]:
    """Each round's published record merged with its diagnostics (for reports and research; not private)."""
    diagnostics = {r["round"]: r for r in read_diagnostics(run_dir)}
    return [{**diagnostics.get(r["round"], {}), **r} for r in read_metrics(run_dir)]


def plot_runs(run_dirs: list[Path | str], out: Path | str, diagnostics: bool = False) -> Path:
    """Accuracy and epsilon per round, one line per run (first run = this run). `diagnostics`: also read
    diagnostics.jsonl (the personalized accuracy of partial sharing is a client evaluation: not private)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_acc, ax_eps) = plt.subplots(1, 2, figsize=(10, 4))
    for run_dir in run_dirs:
        rows = read_rounds(run_dir) if diagnostics else read_metrics(run_dir)
        summary_file = Path(run_dir, "summary.json")
        label = Path(run_dir).name
        if summary_file.exists():
            label = run_label(json.loads(summary_file.read_text()))
        rounds = [r["round"] for r in rows]
        accuracy = [r.get("accuracy", r.get("personalized_accuracy")) for r in rows]  # partial sharing: personalized
        ax_acc.plot(rounds, [math.nan if a is None else a for a in accuracy], marker=".", label=label)
        eps = [r.get("epsilon") for r in rows]
        if any(e is not None for e in eps):
            ax_eps.plot(rounds, eps, marker=".", label=label)
    ax_acc.set(xlabel="round", ylabel="accuracy (server test set, or personalized)", title="Accuracy")
    ax_eps.set(xlabel="round", ylabel="epsilon", title="Privacy spent (non-private runs: infinite)")
    for ax in (ax_acc, ax_eps):
        if ax.get_legend_handles_labels()[0]:  # a non-private run draws no epsilon line
            ax.legend(fontsize=8)
    fig.tight_layout()
    atomic_write(out, lambda f: fig.savefig(f, format="png", dpi=100))  # 0600, never half a file
    plt.close(fig)
    return Path(out)


if __name__ == "__main__":
    args = sys.argv[1:]
    with_diagnostics = "--diagnostics" in args
    args = [a for a in args if a != "--diagnostics"]
    if args and args[0] == "--tensorboard":
        from dpfl.fl_app.dashboards import write_tensorboard

        for run in args[1:]:
            print("TensorBoard events written into", write_tensorboard(run, with_diagnostics))
        sys.exit(0)
    if not args:
        sys.exit(
            "usage: python -m dpfl.fl_app.results [--diagnostics] RUN_DIR [OTHER_RUN_DIR ...]\n"
            "       python -m dpfl.fl_app.results --tensorboard [--diagnostics] RUN_DIR ...\n"
            "--diagnostics: also show the non-private diagnostics (diagnostics.jsonl)"
        )
    print(plot_runs(args, Path(args[0], "plot.png"), with_diagnostics))
