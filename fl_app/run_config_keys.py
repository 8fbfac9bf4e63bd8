"""One run-config key: its declaration in a settings dataclass (`setting`) and what it allows (`Key`).

`fl_app.settings` declares every key with `setting(default, doc, choices, bounds)`; `Key.allowed()` says in
words what a key takes, for the validation's error messages and docs/run-config.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

FLOAT_MAX = 1e6  # no float key needs more; larger values overflow the accountants or the model
INT_MAX = 10**7  # rounds, steps, epochs, sizes
NOISE_RANGE = (1e-3, 1e3)  # noise multipliers: below, Opacus' RDP divides by ~0; above, it takes seconds per call
RATE_MIN = 1e-6  # sample-rate and mu-max: smaller values gave a NaN model (1 / q) or a ZeroDivisionError (1 / mu-max)
KEY = "run-config key"  # where a field's Key lives in its metadata


@dataclass(frozen=True)
class Key:
    """One run-config key: its default, one-line doc and what is allowed (`allowed()` says it in words)."""

    default: Any
    help: str
    choices: tuple = ()
    low: float | None = None  # inclusive unless low_open
    high: float | None = None  # inclusive unless high_open
    low_open: bool = False
    high_open: bool = False
    nonzero_low: float | None = None  # 0, or at least this (noise multipliers: the accountants' range)
    note: str = ""  # why the bounds are what they are, added to the error message
    name: str = ""  # the run-config key
    attribute: str = ""  # where the code reads it: "privacy.noise_multiplier"

    @property
    def upper(self) -> float:
        """The largest value allowed: `high`, else a cap that keeps the arithmetic finite."""
        if self.high is not None:
            return self.high
        return INT_MAX if type(self.default) is int else FLOAT_MAX

    def allowed(self) -> str:
        if self.choices:
            return "one of: " + ", ".join(map(str, self.choices))
        kind = {
            bool: "true or false",
            int: "an integer",
            float: "a number",
            str: "a string without control characters or lone surrogates",
        }[type(self.default)]
        if type(self.default) in (int, float):
            lo = "-inf" if self.low is None else self.low
            interval = f"{'(' if self.low_open else '['}{lo}, {self.upper:g}{')' if self.high_open else ']'}"
            kind += (
                f": 0 or in [{self.nonzero_low:g}, {self.upper:g}]"
                if self.nonzero_low is not None
                else f" in {interval}"
            )
        return f"{kind} ({self.note})" if self.note else kind


def setting(default: Any, help: str, choices: tuple = (), *, key: str = "", **bounds: Any) -> Any:
    """A dataclass field that is one run-config key (`key`: when it is not the field's name with '-')."""
    return field(default=default, metadata={KEY: Key(default, help, tuple(choices), name=key, **bounds)})
