"""Golden test (issue 33 item 9): a redesign step changes no number a run writes or prints.

Each route below is a short seeded run (secure-rng = false, 2 rounds, the digits data set, an MLP) through the
app's own entry point on an in-process grid. What it leaves behind is compared with the record
in tests/golden/<route>.json, written on main 7f236f5 before the redesign:

- metrics.jsonl, diagnostics.jsonl, summary.json, diagnostics-summary.json, status.json, config.json;
- the checkpoint's state (history and ledger) and the norms of its global arrays (the model after the run);
- the TensorBoard scalars (tag, round, value);
- the log lines the project's code prints (the flwr logger, INFO and up; Flower's own lines are left out);
- the names of the files in the run folder (plot.png's pixels are not compared).

Every run goes through `run_route`, the one function that knows the app's import paths: when a module moves,
change its import there.

Floats, in files and in log lines, agree within REL_TOL (1e-5 relative): the same code on another CPU takes other
float32 kernels and moves a trained model by 1e-8 to 1e-6 (seen between two machines of this project); a change of
behaviour moves them by far more. Everything else is exact, with its type, so 1 and
1.0, 0.0 and -0.0, differ. The epsilons are pure float64 accounting and agree to the last bit anyway. Only what
legitimately differs between two runs of the same code is left out: `DROPPED_KEYS` (the one place that says
which), the run folder's absolute path, which reads as "<results-dir>", and the wall-clock seconds of Flower's
`Strategy execution finished in ...s` line (`LOG_SECONDS`), which read as "<seconds>".

Re-recording overwrites the record, so it is legitimate only for a deliberate change of behaviour (say which
in the commit): `python -m tests.test_golden --record [route ...]`, or `DPFL_GOLDEN_RECORD=1 python -m pytest
tests/test_golden.py`. Recording runs each route twice and refuses to write a route whose two runs differ.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import sys
import tempfile
from pathlib import Path

import flwr
import numpy as np
import pytest

GOLDEN_DIR = Path(__file__).parent / "golden"
RECORD_ENV = "DPFL_GOLDEN_RECORD"
RESULTS_DIR = "<results-dir>"  # the run folder's absolute path, wherever it appears
# Floats (and the arrays' norms) agree to this relative tolerance: the same code on another CPU picks other
# float32 kernels (vector width, summation order), which moves a trained model by about 1e-8 relative; a change
# of behaviour moves it by far more.
REL_TOL = 1e-5
ABS_TOL = 1e-12
FLOAT_IN_TEXT = re.compile(r"-?\d+\.\d+(?:e[+-]?\d+)?")  # a decimal number in a log line, e.g. 2.6078838515361955

# Keys left out wherever they appear: they differ between two runs of the same code.
DROPPED_KEYS = frozenset(
    {
        "seconds",  # wall-clock seconds (diagnostics.jsonl, diagnostics-summary.json, the checkpoint's history)
        "time",  # status.json: when the status was written (Unix time)
        "pid",  # status.json: the process that wrote it
        "host",  # status.json: the machine it ran on
    }
)
# The wall-clock seconds on the log's closing line (Flower's format, printed by strategies.loop.flower_log).
LOG_SECONDS = re.compile(r"(Strategy execution finished in )\d+\.\d+s$")
# TensorBoard's event file is named events.out.tfevents.<time>.<host>.<pid>.<n>; its wall_time is not recorded.
EVENTS_FILE = re.compile(r"events\.out\.tfevents\.\d+\..*")

NUM_NODES = 6
BASE = {
    "dataset": "digits",
    "model": "mlp",
    "num-rounds": 2,
    "local-steps": 2,
    "batch-size": 16,
    "seed": 0,  # Poisson sampling then takes 3 and 4 of the 6 nodes (dp-fedavg)
    "secure-rng": False,  # noise and sampling drawn from 'seed': reproducible
}
DP2_FEDSAM = {
    "algorithm": "dp2-fedsam",
    "partitioner": "pathological",
    "classes-per-client": 2,
    "head-steps": 2,
    "noise-multiplier": 1.3,
}
ALI_DPFL = {
    "algorithm": "ali-dpfl",
    "partitioner": "iid",
    "sample-rate": 1.0,
    "batch-sample-rate": 0.1,
    "sample-noise-multiplier": 1.5,
    "sample-clipping-norm": 1.0,
    "lr": 0.5,
    "momentum": 0.0,
    "target-epsilon": 3.0,
}
ROUTES: dict[str, dict] = {
    "dp-fedavg-central": {"algorithm": "dp-fedavg", "noise-placement": "central"},
    "dp-fedavg-distributed": {"algorithm": "dp-fedavg", "noise-placement": "distributed"},
    "dp-fedsam": {"algorithm": "dp-fedsam"},
    "dp-fedsam-topk": {"algorithm": "dp-fedsam-topk", "sparsity": 0.4},
    "dp-fedavg-wav": {"algorithm": "dp-fedavg-wav", "noise-placement": "central", "wavelet-calibration": "paper"},
    "dp2-fedsam": DP2_FEDSAM,
    "ali-dpfl": ALI_DPFL,
    "dp-ftrl": {"algorithm": "dp-ftrl", "partitioner": "iid"},
    "adaptive-clipping": {
        "algorithm": "dp-fedavg",
        "sample-rate": 1.0,
        "adaptive-clipping": True,
        "clip-count-noise-multiplier": 2.0,
    },
    "local-dp": {"algorithm": "dp-fedavg", "noise-placement": "local", "noise-multiplier": 4.0},
    "fixed-sampling": {"algorithm": "dp-fedavg", "client-sampling": "fixed"},
    "secagg": {"algorithm": "dp-fedavg", "partitioner": "iid", "sample-rate": 1.0, "secure-aggregation": True},
    "audit-canaries": {"algorithm": "dp-fedavg", "audit-canaries": 4},
    # beyond issue 33's list: the other registry entries, DP-SGD-WAV, sigma calibrated to a budget, a budget
    # that stops the run, the other accountants and a wrapped server optimizer
    "centaur": {"algorithm": "centaur", "partitioner": "pathological", "head-steps": 2},
    "dp-fedavg-ft": {"algorithm": "dp-fedavg-ft", "fine-tune-steps": 2},
    "dp-fedsam-ft-budget-stop": {"algorithm": "dp-fedsam-ft", "target-epsilon": 4.0},
    "ali-dpfl-wav": {**ALI_DPFL, "dpsgd-noise": "wavelet", "wavelet-calibration": "paper"},
    "calibrate-rdp": {
        "algorithm": "dp-fedsam",
        "target-epsilon": 5.0,
        "target-epsilon-mode": "calibrate",
        "accountant": "rdp",
    },
    "fedadam-prv": {"algorithm": "dp-fedavg", "server-strategy": "fedadam", "accountant": "prv"},
    # issue 40: the cohort engine (dpfl_tools.cohort.CohortGrid), the round's clients trained as one batched model
    "dp-fedsam-cohort": {"algorithm": "dp-fedsam", "engine": "cohort"},
    "dp2-fedsam-cohort": {**DP2_FEDSAM, "engine": "cohort"},  # personal heads in the batch: dp2-fedsam's numbers
    "ali-dpfl-cohort": {**ALI_DPFL, "engine": "cohort"},  # DP-SGD in the batch: ali-dpfl's numbers and ledger
}


def run_route(overrides: dict, run_dir: Path) -> Path:
    """Run the app once with BASE | overrides into `run_dir`, as the ServerApp does, on an in-process grid of
    NUM_NODES nodes (overrides' "engine" = "cohort": the cohort engine's). The only place that knows the app's
    import paths."""
    import torch

    from dpfl.fl_app.client_app import app as client_app
    from dpfl.fl_app.config import validate
    from dpfl.fl_app.server_app import run_federated
    from dpfl_tools.cohort import CohortGrid
    from dpfl_tools.inprocess import InProcessGrid

    torch.set_num_threads(1)
    np.random.seed(0)  # Flower's SecAgg+ quantization rounds stochastically with the global NumPy generator
    overrides = dict(overrides)
    grid_class = CohortGrid if overrides.pop("engine", "inprocess") == "cohort" else InProcessGrid
    cfg = validate({**BASE, **overrides, "results-dir": str(run_dir)})
    run_federated(grid_class(client_app, NUM_NODES, cfg), cfg)
    return run_dir


class LogLines(logging.Handler):
    """The flwr logger's messages (INFO and up) while active that the project's code logs: what a run prints.
    Flower's own lines (its strategy summary, its warnings) are left out: they are Flower's, not the project's."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        self.flower_dir = Path(flwr.__file__).resolve().parent

    def emit(self, record: logging.LogRecord) -> None:
        if not Path(record.pathname).resolve().is_relative_to(self.flower_dir):
            self.lines.append(f"{record.levelname}: {record.getMessage()}")

    def __enter__(self) -> LogLines:
        logger = logging.getLogger("flwr")
        self.level_before = logger.level
        logger.setLevel(logging.INFO)
        logger.addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        logger = logging.getLogger("flwr")
        logger.removeHandler(self)
        logger.setLevel(self.level_before)


def normalized(value, run_dir: str):
    """`value` with DROPPED_KEYS left out and the run folder's path as RESULTS_DIR, at any depth."""
    if isinstance(value, dict):
        return {k: normalized(v, run_dir) for k, v in value.items() if k not in DROPPED_KEYS}
    if isinstance(value, (list, tuple)):
        return [normalized(v, run_dir) for v in value]
    if isinstance(value, str):
        return value.replace(run_dir, RESULTS_DIR)
    return value


def read_json_lines(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def tensorboard_scalars(run_dir: Path) -> dict[str, list]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [[e.step, e.value] for e in events.Scalars(tag)] for tag in sorted(events.Tags()["scalars"])}


def array_digest(array: np.ndarray) -> list:
    """dtype, shape, L2 norm and L1 norm (float64) of one array: compared within REL_TOL, as every float is."""
    values = array.astype(np.float64).ravel()
    return [str(array.dtype), list(array.shape), float(np.linalg.norm(values)), float(np.abs(values).sum())]


def checkpoint(run_dir: Path) -> dict:
    """The checkpoint's state (JSON) and, per global array, its `array_digest`."""
    with np.load(run_dir / "checkpoint.npz", allow_pickle=False) as saved:
        state = json.loads(bytes(saved["state"]).decode())
        arrays = {name: array_digest(saved[name]) for name in saved.files if name != "state"}
    return {"state": state, "arrays": arrays}


def observe(route: str, tmp_dir: Path) -> dict:
    """Run `route` once into a fresh folder under `tmp_dir` and return everything it wrote and printed."""
    run_dir = tmp_dir / route
    with LogLines() as log:
        run_route(ROUTES[route], run_dir)
    files = sorted(EVENTS_FILE.sub("events.out.tfevents.<time>.<host>.<pid>.<n>", p.name) for p in run_dir.iterdir())
    observed = {
        "files": files,
        "config": json.loads((run_dir / "config.json").read_text()),
        "status": json.loads((run_dir / "status.json").read_text()),
        "summary": json.loads((run_dir / "summary.json").read_text()),
        "metrics": read_json_lines(run_dir / "metrics.jsonl"),
        "diagnostics": read_json_lines(run_dir / "diagnostics.jsonl"),
        "diagnostics_summary": json.loads((run_dir / "diagnostics-summary.json").read_text()),
        "checkpoint": checkpoint(run_dir),
        "tensorboard": tensorboard_scalars(run_dir),
        "log": [LOG_SECONDS.sub(r"\g<1><seconds>s", line) for line in log.lines],
    }
    return normalized(observed, str(run_dir))


def same_float(expected: float, actual: float) -> bool:
    """Equal within REL_TOL (relative; ABS_TOL near zero), with the same sign: what two CPUs' float32 kernels
    give for the same computation. NaN equals NaN, an infinity only itself."""
    if math.isnan(expected) or math.isnan(actual):
        return math.isnan(expected) and math.isnan(actual)
    return math.copysign(1.0, expected) == math.copysign(1.0, actual) and math.isclose(
        expected, actual, rel_tol=REL_TOL, abs_tol=ABS_TOL
    )


def same_text(expected: str, actual: str) -> bool:
    """Equal text, the decimal numbers in it (a logged float's repr) compared by `same_float`."""
    e_parts, a_parts = FLOAT_IN_TEXT.split(expected), FLOAT_IN_TEXT.split(actual)
    e_numbers, a_numbers = FLOAT_IN_TEXT.findall(expected), FLOAT_IN_TEXT.findall(actual)
    return (
        e_parts == a_parts
        and len(e_numbers) == len(a_numbers)
        and all(e == a or same_float(float(e), float(a)) for e, a in zip(e_numbers, a_numbers))
    )


def differences(expected, actual, where: str = "") -> list[str]:
    """Where `actual` differs from `expected`: by type, floats within `same_float`, everything else by repr."""
    if isinstance(expected, dict) and isinstance(actual, dict):
        found = [f"{where}/{k}: missing" for k in expected if k not in actual]
        found += [f"{where}/{k}: unexpected {actual[k]!r}" for k in actual if k not in expected]
        for k in [k for k in expected if k in actual]:
            found += differences(expected[k], actual[k], f"{where}/{k}")
        return found
    if isinstance(expected, list) and isinstance(actual, list) and len(expected) == len(actual):
        return [d for i, (e, a) in enumerate(zip(expected, actual)) for d in differences(e, a, f"{where}[{i}]")]
    if type(expected) is type(actual) is float and same_float(expected, actual):
        return []
    if type(expected) is type(actual) is str and same_text(expected, actual):
        return []
    if type(expected) is not type(actual) or repr(expected) != repr(actual):
        return [f"{where}: expected {expected!r}, got {actual!r}"]
    return []


def golden_file(route: str) -> Path:
    return GOLDEN_DIR / f"{route}.json"


def record(route: str) -> dict:
    """Run `route` twice; if both runs agree, write its golden file. Only for a deliberate behaviour change."""
    with tempfile.TemporaryDirectory(prefix=f"golden-{route}-") as tmp:
        first = observe(route, Path(tmp, "first"))
        second = observe(route, Path(tmp, "second"))
    found = differences(first, second)
    if found:
        raise AssertionError(f"{route}: two runs of the same code differ, not recorded:\n" + "\n".join(found[:20]))
    GOLDEN_DIR.mkdir(exist_ok=True)
    golden_file(route).write_text(json.dumps(first, indent=1, sort_keys=True, allow_nan=True) + "\n")
    return first


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_route_is_unchanged(route, tmp_path):
    if os.environ.get(RECORD_ENV) == "1":
        record(route)
        pytest.skip(f"recorded {golden_file(route)} ({RECORD_ENV}=1)")
    expected = json.loads(golden_file(route).read_text())
    found = differences(expected, observe(route, tmp_path))
    assert not found, f"{route} differs from {golden_file(route)}:\n" + "\n".join(found[:40])


def test_differences_sees_a_change_beyond_float_rounding():
    """Floats agree within REL_TOL; a larger change, an int for a float, -0.0 for 0.0, NaN for a number count."""
    x = 0.1
    assert differences({"a": [x]}, {"a": [x]}) == []
    assert differences({"a": [x]}, {"a": [float(np.nextafter(x, 1.0))]}) == []
    assert differences({"a": [x]}, {"a": [x * (1 + 10 * REL_TOL)]}) == [
        f"/a[0]: expected 0.1, got {x * (1 + 10 * REL_TOL)!r}"
    ]
    assert differences({"a": 1.0}, {"a": 1}) and differences({"a": 0.0}, {"a": -0.0})
    assert differences({"a": 1.0}, {"a": float("nan")}) and not differences({"a": float("nan")}, {"a": float("nan")})
    assert differences({"a": "loss=2.25"}, {"a": "loss=2.26"}) and differences({"a": 1}, {"a": 2})
    assert not differences({"a": f"loss={x}"}, {"a": f"loss={x * (1 + REL_TOL / 10)}"})
    assert differences({"a": "round 1: 2.5"}, {"a": "round 2: 2.5"}) and differences({"a": "a 1.5"}, {"a": "b 1.5"})
    assert differences({"a": 1}, {}) == ["/a: missing"] and differences({}, {"b": 1}) == ["/b: unexpected 1"]


if __name__ == "__main__":
    if "--record" not in sys.argv[1:]:
        sys.exit(f"usage: python -m tests.test_golden --record [route ...]  (routes: {', '.join(ROUTES)})")
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    os.environ.setdefault("DPFL_CACHE_DIR", tempfile.mkdtemp(prefix="dpfl-golden-cache-"))
    for name in [a for a in sys.argv[1:] if a != "--record"] or list(ROUTES):
        record(name)
        print("recorded", golden_file(name))
