"""The runs of one launch, planned before anything starts: each run's name, its run-config overrides for `flwr run`,
its folder, and its settings validated as the ServerApp will validate them (--sweep, --reference, --resume)."""

from __future__ import annotations

import argparse
import json
import re
import secrets
import time
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from dpfl_tools import ROOT

if TYPE_CHECKING:  # not imported at start: the user namespace needs a process without threads (numpy starts some)
    from dpfl.fl_app.settings import Settings


def format_run_config(values: dict) -> str:
    """`key=value ...` as `flwr run --run-config` reads it (strings quoted)."""

    def literal(v) -> str:
        if isinstance(v, bool):
            return str(v).lower()
        return f"'{v}'" if isinstance(v, str) else repr(v)

    return " ".join(f"{k}={literal(v)}" for k, v in values.items())


def reference_run_config(run_config: str) -> str:
    """The non-private reference of a run: its algorithm's `reference` overrides (fl_app.algorithms)."""
    from flwr.common.config import parse_config_args

    from dpfl.fl_app.algorithms import reference_overrides
    from dpfl.fl_app.config import SPEC

    overrides = parse_config_args([run_config]) if run_config.strip() else {}
    return format_run_config(reference_overrides(overrides, {k: spec.default for k, spec in SPEC.items()}))


def sweep_runs(run_config: str, sweep: str) -> list[tuple[str, str]]:
    """(name, run config) per value of `sweep` = "key=v1,v2,...", each value added to `run_config`."""
    key, sep, values = sweep.partition("=")
    if not sep or not key.strip() or not values.strip():
        raise SystemExit(f"--sweep {sweep!r}: expected key=v1,v2,... (e.g. noise-multiplier=0.5,1,2)")
    return [
        (f"{key.strip()}-{v.strip()}", f"{run_config} {key.strip()}={v.strip()}".strip())
        for v in values.split(",")
        if v.strip()
    ]


def run_stamp() -> str:
    """The start of this launch's run folder names: time to the second and 4 random hex digits, so that two
    launches in the same second into the same --results get different folders."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def app_defaults() -> dict:
    """The app's run config as `flwr run` starts from it: pyproject.toml's [tool.flwr.app.config]."""
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]


CONFIG_PAIR = re.compile(r"(\S+?)=(\'[^\']*\'|\"[^\"]*\"|\S+)")  # flwr.common.config.parse_config_args' pattern


def parse_overrides(run_config: str) -> dict:
    """`key=value ...` as `flwr run --run-config` parses it; a malformed string exits with Flower's reason."""
    import click
    from flwr.common.config import parse_config_args

    try:
        parsed = parse_config_args([run_config]) if run_config.strip() else {}
    except (click.ClickException, ValueError) as exc:
        raise SystemExit(f"-c {run_config!r}: {getattr(exc, 'message', exc)}") from None
    toml_file = run_config.strip().endswith(".toml")  # flwr run -c also takes a TOML file of overrides
    stray = [] if toml_file else CONFIG_PAIR.sub(" ", run_config).split()  # what Flower's parser skips silently
    if stray:
        raise SystemExit(
            f"-c {run_config!r}: {', '.join(map(repr, stray))} is not key=value (without spaces "
            "around '='; quote strings: key='text')"
        )
    return parsed


def resume_run_config(run_dir: Path, run_config: str) -> str:
    """The run config that continues the run in `run_dir`: its config.json's settings (those that differ from
    the defaults), then `run_config`'s overrides (e.g. num-rounds), resume = true and its results-dir."""
    from dpfl.fl_app.config import SPEC

    previous = run_dir / "config.json"
    if not previous.is_file():
        raise SystemExit(f"--resume {run_dir}: {previous} does not exist (not a dpfl run folder)")
    settings = {
        k: v
        for k, v in json.loads(previous.read_text()).items()
        if k in SPEC and v != SPEC[k].default and k not in ("resume", "results-dir")
    }
    settings.update(parse_overrides(run_config))
    return format_run_config({**settings, "resume": True, "results-dir": str(run_dir)})


class PlannedRun(NamedTuple):
    """One run of a launch: its name, its run config for `flwr run` (the overrides), its folder and its
    settings (pyproject's defaults and the overrides, validated as the ServerApp will)."""

    name: str
    overrides: str
    folder: Path
    settings: Settings


def plan_runs(args: argparse.Namespace, stamp: str) -> list[PlannedRun]:
    """Each run of this launch, its config validated and --clients checked against min-nodes: a bad value
    exits here with the one-line reason, before any process starts."""
    if args.resume:
        if args.sweep or args.reference:
            raise SystemExit("--resume continues one run: it takes no --sweep or --reference")
        runs = [("resumed", resume_run_config(Path(args.resume).resolve(), args.run_config))]
    else:
        runs = sweep_runs(args.run_config, args.sweep) if args.sweep else [("dp", args.run_config)]
        if args.reference:
            runs.append(("reference", reference_run_config(args.run_config)))
    return [check_run(name, overrides, args, stamp, len(runs)) for name, overrides in runs]


def check_run(name: str, overrides: str, args: argparse.Namespace, stamp: str, count: int) -> PlannedRun:
    """One run of `plan_runs`: its folder (the results-dir it names, else <--results>/<stamp>-<name>) and its
    validated config; SystemExit with the reason otherwise."""
    from dpfl.fl_app.config import ConfigError, validate
    from dpfl.fl_app.results import PreviousRunError, check_resumable

    if args.clients < 1:
        raise SystemExit(f"--clients {args.clients}: must be at least 1")
    given = parse_overrides(overrides)
    if "results-dir" in given and count > 1:
        raise SystemExit(
            f"run-config key 'results-dir' = {given['results-dir']!r} names one folder for {count} "
            "runs (--sweep, --reference): leave it out, and each run gets its own under --results"
        )
    if "results-dir" not in given:
        given["results-dir"] = str(Path(args.results, f"{stamp}-{name}").resolve())
        overrides = f"{overrides} results-dir='{given['results-dir']}'".strip()
    try:
        settings = validate({**app_defaults(), **given})
        if settings.output.resume:
            check_resumable(Path(settings.output.results_dir), settings)
    except (ConfigError, PreviousRunError) as exc:
        raise SystemExit(str(exc)) from None
    min_nodes = settings.federation.min_nodes
    if args.clients < min_nodes:
        raise SystemExit(
            f"--clients {args.clients} is fewer than run-config key 'min-nodes' = {min_nodes}: "
            f"the run would wait for nodes that never come; pass --clients {min_nodes} (or more), "
            f'or -c "min-nodes={max(args.clients, 1)}"'
        )
    return PlannedRun(name, overrides, Path(settings.output.results_dir), settings)
