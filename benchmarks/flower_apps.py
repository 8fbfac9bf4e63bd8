"""Flower's own DP example apps against the same apps with this project's classes, under `flwr run`.

    python -m benchmarks.flower_apps [--nodes 10] [--write docs/flower_apps.md]

The apps are the project's copies of three Flower examples (the repository's `tests/flower_apps/`, local
digits data): quickstart-pytorch with Flower's `DifferentialPrivacyServerSideFixedClipping` around its FedAvg
(Message API), fl-dp-sa (legacy API, `DifferentialPrivacyClientSideFixedClipping`, SecAgg+, client mods
`[secaggplus_mod, fixedclipping_mod]`) and opacus (Opacus' `PrivacyEngine` made every round in a Message-API
client). Each as written is Flower's control; the project's variant is made from it by replacing the lines of
`PAIRS` (import lines; the opacus app also adds the mod to its train function, the change
docs/dropin.md documents). Both run at the same sigma, C, m and run config on one SuperLink of our own, one
after the other. Per run: the final model's accuracy on the held-out digits, the epsilon the log prints
(Flower's figure, or none where Flower prints none) and the seconds per round (from Flower's `[ROUND 2` line to
its line after the last round, as `flwr run --stream` delivers them, which it does about every 0.5 s). No ratio
is asserted.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import importlib.util
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import flwr
import numpy as np
import torch
from sklearn.datasets import load_digits

from dpfl_tools.plan import format_run_config
from dpfl_tools.processes import command
from dpfl_tools.superlink import own_simulation_superlink

ROOT = Path(__file__).resolve().parents[1]
APPS = ROOT / "tests" / "flower_apps"


@dataclass(frozen=True)
class AppPair:
    """One Flower example: its folder under APPS (Flower's classes: the control) and the lines the project's
    variant replaces (Flower's line, stripped -> the project's lines)."""

    name: str
    folder: str
    api: str  # "message" or "legacy": which of Flower's summary lines the log ends with
    lines: dict[str, str]
    other_lines: int = 0  # non-import lines the replacement changes
    config: dict = field(default_factory=dict)  # run config the benchmark and the tests use


QUICKSTART = AppPair(
    "quickstart-pytorch",
    "quickstart_pytorch",
    "message",
    {
        "from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping, FedAvg": (
            "from flwr.serverapp.strategy import FedAvg\n"
            "from dpfl import DifferentialPrivacy as DifferentialPrivacyServerSideFixedClipping"
        ),
    },
)
FL_DP_SA = AppPair(
    "fl-dp-sa",
    "fl_dp_sa",
    "legacy",
    {
        "from flwr.server.strategy import DifferentialPrivacyClientSideFixedClipping, FedAvg": (
            "from flwr.server.strategy import FedAvg\n"
            "from dpfl import SecAggPlusDifferentialPrivacy as DifferentialPrivacyClientSideFixedClipping"
        ),
        "from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow": (
            "from flwr.server.workflow import DefaultWorkflow\nfrom dpfl import DPSecAggPlusWorkflow as SecAggPlusWorkflow"
        ),
        "from flwr.client.mod import fixedclipping_mod, secaggplus_mod": (
            "from flwr.client.mod import secaggplus_mod\nfrom dpfl import dp_privatize_mod as fixedclipping_mod"
        ),
    },
)
OPACUS = AppPair(
    "opacus",
    "opacus",
    "message",
    {
        "from opacus import PrivacyEngine": "from dpfl import PrivacyEngine, sample_ledger_mod",
        "@app.train()": "@app.train(mods=[sample_ledger_mod])",
    },
    other_lines=1,
)
PAIRS = (QUICKSTART, FL_DP_SA, OPACUS)


# ------------------------------------------------------------------------------------------------ the variant
def make_variant(pair: AppPair, dest: Path) -> Path:
    """A copy of the control app at `dest` with `pair.lines` replaced (each matches exactly one line, its
    indentation kept)."""
    shutil.copytree(APPS / pair.folder, dest, ignore=shutil.ignore_patterns("__pycache__"))
    used = dict.fromkeys(pair.lines, 0)
    for path in sorted(dest.rglob("*.py")):
        out = []
        for line in path.read_text().splitlines(keepends=True):
            key = line.strip()
            if key in pair.lines:
                used[key] += 1
                indent = line[: len(line) - len(line.lstrip())]
                out += [indent + new + "\n" for new in pair.lines[key].splitlines()]
            else:
                out.append(line)
        path.write_text("".join(out))
    assert all(n == 1 for n in used.values()), f"each line to replace must occur once: {used}"
    return dest


class _NoImports(ast.NodeTransformer):
    def visit_Import(self, node):  # noqa: N802 (ast's method name)
        return None

    visit_ImportFrom = visit_Import  # noqa: N815


def non_import_source(path: Path) -> list[str]:
    """The module's source without its import statements, as `ast.unparse` writes it (one line per
    statement or decorator)."""
    return ast.unparse(_NoImports().visit(ast.parse(path.read_text()))).splitlines()


def changed_lines(control: Path, variant: Path) -> list[str]:
    """The non-import lines of `variant`'s modules that differ from `control`'s (added or changed)."""
    changed = []
    for path in sorted(control.rglob("*.py")):
        ours = variant / path.relative_to(control)
        diff = difflib.ndiff(non_import_source(path), non_import_source(ours))
        changed += [f"{ours.name}: {d[2:]}" for d in diff if d.startswith("+ ")]
    return changed


# ------------------------------------------------------------------------------------------------ one run
@dataclass
class Run:
    log: str
    seconds_per_round: float
    final_model: Path


ROUND_START = re.compile(r"\[ROUND (\d+)(?:/\d+)?\]")  # Flower's own round line, both APIs
RUN_END = ("Strategy execution finished", "[SUMMARY]")  # Flower's own line after the last round


def flwr_run(env: dict, app: Path, out: Path, nodes: int, config: dict, timeout: float = 300) -> Run:
    """`flwr run <app> --stream` with `config` and final-model=<out>.pt; the log and the seconds per round:
    from Flower's `[ROUND 2` line to its line after the last round, over the rounds between, each line timed
    as it arrives (round 1 holds the ClientApps' start-up)."""
    values = {**config, "final-model": str(out.with_suffix(".pt"))}
    run_config = format_run_config(values)
    cmd = [command("flwr"), "run", str(app), "--stream", "--run-config", run_config]
    cmd += ["--federation-config", f"num-supernodes={nodes} client-resources-num-cpus=1"]
    proc = subprocess.Popen(
        cmd,
        env={**env, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines, round_2, end, last_round, deadline = [], None, None, 0, time.monotonic() + timeout
    for line in proc.stdout:
        lines.append(line)
        match = ROUND_START.search(line)
        if match:
            last_round = int(match.group(1))
            round_2 = time.monotonic() if last_round == 2 else round_2
        if end is None and any(marker in line for marker in RUN_END):
            end = time.monotonic()
        if time.monotonic() > deadline:
            proc.kill()
            break
    proc.wait()
    log = "".join(lines)
    assert proc.returncode == 0 and out.with_suffix(".pt").exists(), f"flwr run failed:\n{log[-4000:]}"
    timed = round_2 is not None and end is not None and last_round > 1
    return Run(log, (end - round_2) / (last_round - 1) if timed else float("nan"), out.with_suffix(".pt"))


def load_task(app: Path):
    """The app's task module (its Net), imported from its file under a name of its own."""
    path = next(app.glob("*/task.py"))
    spec = importlib.util.spec_from_file_location(f"{app.name}_{path.parent.name}_task", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def digits_test_set() -> tuple[torch.Tensor, torch.Tensor]:
    """The held-out digits every app's loader leaves out (every 5th image), scaled to [-1, 1] as they load it."""
    x, y = load_digits(return_X_y=True)
    test = np.arange(len(y)) % 5 == 0
    return torch.tensor((x[test] / 8.0 - 1.0).reshape(-1, 1, 8, 8), dtype=torch.float32), torch.tensor(y[test])


def final_accuracy(app: Path, state_dict_path: Path) -> tuple[list[str], float]:
    """(the state dict's names, the accuracy of the app's Net with it, loaded strictly by name)."""
    state_dict = torch.load(state_dict_path)
    net = load_task(app).Net()
    net.load_state_dict(state_dict, strict=True)
    net.eval()
    x, y = digits_test_set()
    with torch.no_grad():
        return list(state_dict), float((net(x).argmax(1) == y).float().mean())


def initial_names(app: Path) -> list[str]:
    return list(load_task(app).Net().state_dict())


# ------------------------------------------------------------------------------------------------ epsilon
OUR_ROUND_EPSILON = re.compile(r"\bRound \d+/\d+:.*?\bepsilon=([0-9.eE+-]+|inf)")
FLOWER_MAX_EPSILON = re.compile(r"'max_epsilon': ([0-9.eE+-]+)")


def printed_epsilons(pair: AppPair, log: str, ours: bool) -> list[float]:
    """Every epsilon the log prints, in order: the project's round lines; the opacus app's server (on both sides)
    the `max_epsilon` of its aggregated train metrics, of what its clients' `get_epsilon` returned (each round's,
    then again in Final results); [] where none."""
    if pair is OPACUS:
        pattern = FLOWER_MAX_EPSILON
    else:
        pattern = OUR_ROUND_EPSILON if ours else None
    return [float(m) for m in pattern.findall(log)] if pattern else []


def summary_line(pair: AppPair) -> str:
    """Flower's own line that ends a run's log: the Message API's result, the legacy API's summary."""
    return "Final results:" if pair.api == "message" else "[SUMMARY]"


# ------------------------------------------------------------------------------------------------ the table
def run_pair(env: dict, pair: AppPair, work: Path, nodes: int, repeats: int = 1) -> list[dict]:
    """Both sides of `pair`, `repeats` times, alternating (so both meet the same load); a row a side: accuracy's
    mean and range, the epsilon printed (the same every run: it depends on the settings only), the median
    seconds per round."""
    variant = make_variant(pair, work / f"{pair.folder}-ours")
    runs: dict[str, list[dict]] = {"flower": [], "ours": []}
    for i in range(repeats):
        for side, app in (("flower", APPS / pair.folder), ("ours", variant)):
            run = flwr_run(env, app, work / f"{pair.folder}-{side}-{i}", nodes, pair.config)
            epsilons = printed_epsilons(pair, run.log, ours=side == "ours")
            runs[side].append(
                {
                    "accuracy": final_accuracy(app, run.final_model)[1],
                    "epsilon": epsilons[-1] if epsilons else None,
                    "seconds_per_round": run.seconds_per_round,
                }
            )
            print(pair.name, side, runs[side][-1], flush=True)
    return [
        {
            "app": pair.name,
            "side": side,
            "accuracy": float(np.mean([r["accuracy"] for r in done])),
            "accuracy_range": (min(r["accuracy"] for r in done), max(r["accuracy"] for r in done)),
            "epsilon": done[-1]["epsilon"],
            "seconds_per_round": float(np.median([r["seconds_per_round"] for r in done])),
            "runs": len(done),
        }
        for side, done in runs.items()
    ]


def app_settings(pair: AppPair) -> str:
    """The app's DP settings and rounds as its pyproject sets them (and `pair.config` overrides)."""
    text = (APPS / pair.folder / "pyproject.toml").read_text()
    config = dict(re.findall(r"^([a-z-]+) = (.+)$", text.split("[tool.flwr.app.config]")[1], re.M))
    config.update({k: repr(v) for k, v in pair.config.items()})
    keys = [k for k in config if k != "final-model"]
    return ", ".join(f"{k} = {config[k]}" for k in keys)


def table(rows: list[dict]) -> str:
    lines = ["| app | classes | accuracy | epsilon printed | s / round |", "|---|---|---|---|---|"]
    for r in rows:
        eps = "none" if r["epsilon"] is None else f"{r['epsilon']:.4g}"
        who = "Flower's" if r["side"] == "flower" else "dpfl"
        low, high = r["accuracy_range"]
        accuracy = f"{r['accuracy']:.3f}" + (f" ({low:.2f}-{high:.2f})" if r["runs"] > 1 else "")
        lines.append(f"| {r['app']} | {who} | {accuracy} | {eps} | {r['seconds_per_round']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=10)
    parser.add_argument("--apps", nargs="*", default=[p.name for p in PAIRS])
    parser.add_argument("--repeats", type=int, default=1, help="runs of each side (accuracy: mean and range)")
    parser.add_argument("--write", type=Path, help="write the table into this markdown page")
    args = parser.parse_args()
    started = datetime.now(timezone.utc)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        with own_simulation_superlink(work / "flwr-home") as env:
            for pair in PAIRS:
                if pair.name in args.apps:
                    rows += run_pair(env, pair, work, args.nodes, args.repeats)
    print(table(rows))
    if args.write:
        write_page(args.write, rows, args, started)


def write_page(path: Path, rows: list[dict], args, started: datetime) -> None:
    settings = "\n".join(f"- {p.name}: {app_settings(p)}" for p in PAIRS if p.name in args.apps)
    machine = f"{platform.machine()}, {os.cpu_count()} CPU cores, Python {platform.python_version()}"
    path.write_text(
        PAGE.format(
            date=started.strftime("%Y-%m-%d %H:%M UTC"),
            machine=machine,
            flwr=flwr.__version__,
            torch=torch.__version__,
            command=f"python -m benchmarks.flower_apps --nodes {args.nodes} --repeats {args.repeats} --write {args.write}",
            nodes=args.nodes,
            repeats=args.repeats,
            settings=settings,
            table=table(rows),
        )
    )


PAGE = """# Flower's DP example apps: Flower's classes against dpfl's

{table}

Measured {date} on {machine} (flwr {flwr}, torch {torch}), with

    {command}

Each app is the project's copy of a Flower example (`tests/flower_apps/`, scikit-learn's 8x8 digits in place of
flwr-datasets), run under `flwr run` with {nodes} SuperNodes on one simulation SuperLink, first as written with
Flower's DP classes, then with this project's, the variant made by replacing the lines in
`benchmarks/flower_apps.py`'s `PAIRS` (import lines only, except the opacus app's one: the mod on its train
function, [dropin.md](dropin.md)). Both runs of a pair use the same run config:

{settings}

- accuracy: the final model (saved by the ServerApp, loaded by name with strict=True) on the held-out digits
  (every 5th image): the mean of {repeats} runs of each side, alternating, and in brackets the lowest and highest.
  Neither side seeds its noise, and one run of these small apps moves by up to 0.2: read the ranges, not the
  means alone.
- epsilon printed: the last figure the run's log prints. Flower's wrappers around quickstart-pytorch and fl-dp-sa
  print none (flwr 1.42's Message-API wrapper accounts only where an `accountant` is passed, its legacy wrapper
  never). Flower's opacus server prints the largest client epsilon of the last round: each client's
  `PrivacyEngine` is new every round, so the figure covers one round, the same every round. dpfl's figures come
  from its ledgers and cover the whole run: client-level for quickstart-pytorch and fl-dp-sa (fixed-size
  sampling of m = all 10 clients, charged under the replace-one relation: the Gaussian at sigma / 2; delta = 0
  means min(1e-5, 0.01 / M) = 1e-5); large because these apps use little noise (sigma 0.3) so that 6 rounds on
  1,437 digits learn. Sample-level for opacus: the app's own `max_epsilon`, the largest `get_epsilon` its
  clients report, which under the mod is each client's cumulative ledger (a sigma 1.0 client's), at the app's
  target-delta 1e-5; after round 1 it reads 6.447, against the 6.458 of Opacus' own accountant for that round.
- s / round: from Flower's `[ROUND 2` line to its line after the last round (`Strategy execution finished`,
  `[SUMMARY]`), over the rounds between, as `flwr run --stream` delivers the lines (about every 0.5 s); round 1,
  which starts the ClientApps, is left out. On a machine other jobs may share: compare the two rows of one
  app, not across pages. Why dpfl's opacus rounds take half the time was not investigated; one difference is
  that `from dpfl import PrivacyEngine` imports Opacus without its `logging.basicConfig()`
  (`dpcore/task/opacus_import.py`), which Flower's app, importing `opacus` itself, lets take effect.

`tests/test_flower_example_apps.py` runs the same pairs in CI's slow tier and checks the state-dict names,
that the model learns, the epsilon against an independent accountant and Flower's own summary lines.
"""


if __name__ == "__main__":
    sys.exit(main())
