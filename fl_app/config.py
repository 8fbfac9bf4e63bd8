"""The run config's one validation pass at start-up, and its key reference.

The keys are declared in `fl_app.settings` (one dataclass per concern); `SPEC` maps each run-config key to
its declaration, the `algorithm` key's with the registry's names as its choices (the settings know nothing
of the registry). `validate()` turns a run config into typed `Settings`, or raises ConfigError naming the
key, the value and what is allowed, before any training starts. `[tool.flwr.app.config]` in
pyproject.toml carries the same keys and defaults, and docs/run-config.md is drawn from them (tests keep
both equal).
"""

from __future__ import annotations

import difflib
import math
import os
import sys
from collections.abc import Mapping
from dataclasses import fields, replace
from functools import lru_cache
from typing import Any

from dpfl.dpcore.task.device import device_problem
from dpfl.fl_app.algorithms import ALGORITHMS, algorithm, check_config
from dpfl.fl_app.run_config_keys import Key
from dpfl.fl_app.settings import KEYS, WHERE, Settings

# results-dir may not be the filesystem root nor lie in these trees (the launcher runs as any user, root included)
SYSTEM_TREES = (
    "/bin",
    "/boot",
    "/dev",
    "/etc",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/proc",
    "/sbin",
    "/sys",
    "/usr",
)


class ConfigError(ValueError):
    """A run-config key has a value that is not allowed."""


SPEC: dict[str, Key] = {  # every run-config key (fl_app.settings declares them)
    spec.name: replace(spec, choices=tuple(ALGORITHMS)) if spec.attribute == "run.algorithm" else spec for spec in KEYS
}


def concern_keys(concern: str) -> list[Key]:
    """The keys of one concern (a field name of Settings), in declaration order."""
    return [spec for spec in SPEC.values() if WHERE[spec.name][0] == concern]


def _check_type(key: str, value: Any, spec: Key) -> Any:
    expected = type(spec.default)
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:
            raise ConfigError(f"run-config key '{key}' = {value!r}: must be {spec.allowed()}") from None
    if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
        raise ConfigError(f"run-config key '{key}' = {value!r}: must be {spec.allowed()}")
    return value


def _check_value(key: str, value: Any, spec: Key) -> None:
    bad = bool(spec.choices) and value not in spec.choices
    if isinstance(value, str):
        bad |= any(ord(c) < 32 or ord(c) == 127 or 0xD800 <= ord(c) <= 0xDFFF for c in value)  # controls, surrogates
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"run-config key '{key}' = {value!r}: must be {spec.allowed()}")
        bad |= value >= spec.upper if spec.high_open else value > spec.upper
        bad |= value != 0 and abs(value) < sys.float_info.min  # subnormal
        bad |= spec.nonzero_low is not None and 0 < value < spec.nonzero_low
    if spec.low is not None:
        bad |= value <= spec.low if spec.low_open else value < spec.low
    if spec.high is not None:
        bad |= value >= spec.high if spec.high_open else value > spec.high
    if isinstance(value, float) and value != value:  # NaN
        bad = True
    if bad:
        raise ConfigError(f"run-config key '{key}' = {value!r}: must be {spec.allowed()}")


def _check_creatable(key: str, path: str) -> None:
    """The folder exists, or its nearest existing ancestor is a writable folder (nothing is created here)."""
    folder = os.path.abspath(os.path.expanduser(path))
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise ConfigError(f"run-config key '{key}' = {path!r}: cannot be created ({folder!r} is not a writable folder)")


def _check_results_dir(path: str) -> None:
    """results-dir is not the filesystem root, lies in no system tree, and is new, empty or a dpfl run folder
    (whatever else a folder holds would be mixed with the run's files, or overwritten)."""
    from dpfl.fl_app.results import RUN_FILES

    folder = os.path.realpath(os.path.expanduser(path))
    system = next((t for t in SYSTEM_TREES if folder == t or folder.startswith(t + "/")), None)
    if folder == "/" or system:
        where = "the filesystem root" if folder == "/" else f"in the system tree {system}"
        raise ConfigError(
            f"run-config key 'results-dir' = {path!r}: must be a folder outside the filesystem root "
            f"and {', '.join(SYSTEM_TREES)}; {folder!r} is {where}"
        )
    if os.path.isdir(folder) and not any(os.path.exists(os.path.join(folder, f)) for f in RUN_FILES):
        others = sorted(os.listdir(folder))
        if others:
            raise ConfigError(
                f"run-config key 'results-dir' = {path!r}: must be a new or empty folder, or a dpfl "
                f"run folder (one holding {' or '.join(RUN_FILES)}); it holds {len(others)} other "
                f"entries ({', '.join(map(repr, others[:3]))}{', ...' if len(others) > 3 else ''})"
            )


def _unknown_keys(run_config: Mapping[str, Any]) -> ConfigError:
    """The error for keys not in SPEC: each with its close matches (a misspelling), then every known key."""

    def one(key: str) -> str:
        if not isinstance(key, str):
            return f"{key!r} (a {type(key).__name__}: run-config keys are strings)"
        close = difflib.get_close_matches(key, SPEC, n=3, cutoff=0.6)
        hint = f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""
        return f"'{key}' = {run_config[key]!r}{hint}"

    unknown = sorted(set(run_config) - set(SPEC), key=repr)
    return ConfigError(f"unknown run-config key(s) {', '.join(map(one, unknown))}; known keys: {', '.join(SPEC)}")


def validate(run_config: Mapping[str, Any]) -> Settings:
    """The typed settings of a run config: every key checked, defaults filled in, combinations checked;
    raises ConfigError naming the key, the value and what is allowed."""
    if set(run_config) - set(SPEC):
        raise _unknown_keys(run_config)
    values = {}
    for key, value in run_config.items():
        values[key] = _check_type(key, value, SPEC[key])
        _check_value(key, values[key], SPEC[key])
    settings = Settings.from_run_config(values)
    _check_paths(settings)
    _check_combinations(settings)
    return settings


def client_settings(run_config: Mapping[str, Any]) -> Settings:
    """`validate` for a ClientApp, which validates the same run config for every message it answers: the last
    run configs' Settings (frozen) are remembered, so a round of 100 clients validates once; an invalid config
    raises on every call."""
    try:  # each value with its type: True == 1 == 1.0 as keys, but validate tells a bool from an int from a float
        key = tuple(sorted((k, type(v).__name__, v) for k, v in run_config.items()))
        hash(key)
    except TypeError:  # a value that cannot be a key (not a scalar): validate names it
        return validate(run_config)
    return _validated(key)


@lru_cache(maxsize=8)
def _validated(items: tuple) -> Settings:
    return validate({k: v for k, _, v in items})


def _check_paths(s: Settings) -> None:
    """data-dir and results-dir are absolute, data-dir exists, results-dir can hold a run, run-name is a name."""
    for key, path in (("results-dir", s.output.results_dir), ("data-dir", s.data.data_dir)):
        if path and not os.path.isabs(os.path.expanduser(path)):
            raise ConfigError(
                f"run-config key '{key}' = {path!r}: must be an absolute path "
                "(relative paths resolve against the SuperLink's folder, not yours)"
            )
    if s.data.data_dir and not os.path.isdir(os.path.expanduser(s.data.data_dir)):
        raise ConfigError(f"run-config key 'data-dir' = {s.data.data_dir!r}: must be an existing folder")
    if s.output.results_dir:
        _check_results_dir(s.output.results_dir)
        _check_creatable("results-dir", s.output.results_dir)
    if s.output.run_name and ("/" in s.output.run_name or s.output.run_name in (".", "..")):
        raise ConfigError(f"run-config key 'run-name' = {s.output.run_name!r}: must be a plain folder name")


def _check_combinations(s: Settings) -> None:
    """Rules between keys: the algorithm's (from the registry, the same checks a strategy built
    from Python runs) and the app's own (data, device, resume)."""
    if s.data.partitioner == "natural" and s.data.dataset != "femnist":
        raise ConfigError(
            f"run-config key 'partitioner' = 'natural' needs dataset = 'femnist' (writers), "
            f"not {s.data.dataset!r}; allowed for {s.data.dataset!r}: iid, dirichlet, pathological"
        )
    if problem := device_problem(s.training.device):
        raise ConfigError(f"run-config key 'device' = {s.training.device!r}: {problem}")
    if s.output.resume and not (s.output.results_dir or s.output.run_name):
        raise ConfigError(
            "run-config key 'resume' = True needs 'results-dir' or 'run-name' to find the run to continue"
        )
    if s.audit.canaries == 1:
        raise ConfigError(
            "run-config key 'audit-canaries' = 1: must be 0 (no audit) or >= 2 (the null cosines' "
            "spread needs at least two never-inserted canaries; the estimate wants dozens)"
        )
    if s.output.resume and s.audit.canaries:
        raise ConfigError(
            "run-config key 'resume' = True is not supported with 'audit-canaries' > 0 yet (the audit "
            "measures the model delta from round 1)"
        )
    if s.output.resume and s.secagg.enabled:
        raise ConfigError(
            "run-config key 'resume' = True is not supported with 'secure-aggregation' = true yet "
            "(Flower's SecAgg+ workflow numbers rounds from 1)"
        )
    if s.federation.num_clients and s.secagg.enabled:
        raise ConfigError(
            f"run-config key 'num-clients' = {s.federation.num_clients} (SuperNodes hosting several clients) is not "
            "supported with 'secure-aggregation' = true yet (Flower's SecAgg+ workflow masks one reply a node): "
            "set num-clients = 0 (each SuperNode one client)"
        )
    try:
        check_config(s, algorithm(s.run.algorithm))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


# ---------------------------------------------------------------------------- the key reference, drawn from SPEC
KEYS_DOC = "docs/run-config.md"
APP_CONFIG_TABLE = "[tool.flwr.app.config]"  # pyproject.toml's, the last table of the file


def literal(value: Any) -> str:
    """A value as TOML writes it (and as `flwr run --run-config` reads it)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value) if isinstance(value, float) else str(value)


def app_config_table() -> str:
    """pyproject.toml's [tool.flwr.app.config]: every key with its default and help, concern by concern."""
    lines = [
        APP_CONFIG_TABLE,
        "# drawn from fl_app/settings.py: regenerate with `python -m dpfl.fl_app.config --write`",
    ]
    for concern in fields(Settings):
        lines.append(f"# -- {concern.name}: {concern.default_factory.__doc__.strip()}")
        lines += [f"{f'{spec.name} = {literal(spec.default)}':<40}# {spec.help}" for spec in concern_keys(concern.name)]
    return "\n".join(lines) + "\n"


def with_app_config_table(pyproject: str) -> str:
    """pyproject.toml's text with its [tool.flwr.app.config] table (the file's last) redrawn."""
    return pyproject[: pyproject.index(APP_CONFIG_TABLE)] + app_config_table()


def key_reference() -> str:
    """docs/run-config.md: every key with its default, what is allowed and what it does, from SPEC."""

    def section(concern) -> list[str]:
        rows = [
            f"| `{spec.name}` | `{literal(spec.default)}` | {spec.allowed()} | {spec.help} | `{spec.attribute}` |"
            for spec in concern_keys(concern.name)
        ]
        doc = concern.default_factory.__doc__.strip()
        return [
            f"## {concern.name}: {doc}",
            "",
            "| key | default | allowed | what it does | in code |",
            "|---|---|---|---|---|",
            *rows,
            "",
        ]

    return "\n".join(
        [
            "# Run-config keys",
            "",
            "Every key of `[tool.flwr.app.config]` in pyproject.toml, drawn from `fl_app/settings.py`, where each key",
            "is declared once, in the dataclass of its concern, with its default, what is allowed and what it does.",
            "`fl_app.config.validate()` checks a run config against it before anything trains (an error names the",
            "key, the value and what is allowed) and returns the typed `Settings` the code reads (the last column).",
            "Regenerate with `python -m dpfl.fl_app.config --write` (a test keeps this page current).",
            "",
            *[line for concern in fields(Settings) for line in section(concern)],
        ]
    )


if __name__ == "__main__":
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    if "--write" in sys.argv:
        (root / KEYS_DOC).write_text(key_reference())
        pyproject = root / "pyproject.toml"
        pyproject.write_text(with_app_config_table(pyproject.read_text()))
        print(f"wrote {root / KEYS_DOC} and the {APP_CONFIG_TABLE} table of {pyproject}")
    else:
        print(key_reference())
