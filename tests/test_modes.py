"""The modes as `str` enums (dpcore/privacy/modes.py, issue 41 item 4): their values are the allowed values of the
settings and of the run-config keys, a member reads and prints as its string, and code compares a mode with the
members, not with string literals."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from dpfl.dpcore.privacy import settings
from dpfl.dpcore.privacy.modes import ClientSamplingMode, NoisePlacementMode, PrivacyUnit, TargetEpsilonMode, values
from dpfl.fl_app.algorithms import ALGORITHMS
from dpfl.fl_app.config import SPEC

ROOT = Path(__file__).resolve().parents[1]
MODES = {
    "noise_placement": NoisePlacementMode,
    "client_sampling": ClientSamplingMode,
    "target_epsilon_mode": TargetEpsilonMode,
    "privacy_unit": PrivacyUnit,
}
# Comparisons with a string literal not yet replaced, in files other sessions edit at the same time (issue 41):
# file -> count. A ratchet: the count may only go down, to none.
NOT_YET: dict[str, int] = {}


def test_the_enums_are_the_allowed_values():
    assert values(NoisePlacementMode) == settings.NOISE_PLACEMENTS == ("central", "distributed", "local")
    assert values(ClientSamplingMode) == settings.CLIENT_SAMPLINGS == ("poisson", "fixed")
    assert values(TargetEpsilonMode) == settings.TARGET_EPSILON_MODES == ("stop", "calibrate")
    for key, mode in (
        ("noise-placement", NoisePlacementMode),
        ("client-sampling", ClientSamplingMode),
        ("target-epsilon-mode", TargetEpsilonMode),
    ):
        assert SPEC[key].choices == values(mode), key
    assert {a.privacy_unit for a in ALGORITHMS.values()} == set(values(PrivacyUnit))


@pytest.mark.parametrize("member", [m for mode in MODES.values() for m in mode])
def test_a_member_is_its_string_wherever_it_is_read_or_printed(member):
    value = member.value
    assert member == value and hash(member) == hash(value) and value in {member}
    assert str(member) == f"{member}" == value and "%s" % member == value
    assert json.dumps({"mode": member}) == json.dumps({"mode": value})


def mode_literal_comparisons(path: Path) -> int:
    """Comparisons of a name, attribute or getattr called like a mode with a string literal (== "local", in ("a", "b"))."""
    found = 0
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        named = any(
            (isinstance(s, ast.Name) and s.id in MODES)
            or (isinstance(s, ast.Attribute) and s.attr in MODES)
            or (
                isinstance(s, ast.Call)
                and getattr(s.func, "id", "") == "getattr"
                and len(s.args) > 1
                and getattr(s.args[1], "value", None) in MODES
            )
            for s in sides
        )
        literal = any(
            (isinstance(s, ast.Constant) and isinstance(s.value, str))
            or (isinstance(s, ast.Tuple | ast.List | ast.Set) and any(isinstance(e, ast.Constant) for e in s.elts))
            for s in sides
        )
        found += named and literal
    return found


def test_no_mode_is_compared_with_a_string_literal_outside_its_enum():
    product = [p for d in ("dpcore", "strategies", "clients", "fl_app", "dpfl") for p in (ROOT / d).rglob("*.py")]
    counts = {str(p.relative_to(ROOT)): mode_literal_comparisons(p) for p in product}
    assert {name: n for name, n in counts.items() if n} == NOT_YET
    assert counts["dpcore/privacy/ledger.py"] == 0 and counts["dpcore/privacy/settings.py"] == 0


def test_the_scan_sees_a_literal_comparison(tmp_path):
    code = tmp_path / "x.py"
    code.write_text(
        "if self.noise_placement == 'local': pass\nif client_sampling in ('fixed',): pass\n"
        "if getattr(dp, 'target_epsilon_mode', 'stop') == 'stop': pass\n"
        "if noise_placement == NoisePlacementMode.LOCAL: pass\n"
    )
    assert mode_literal_comparisons(code) == 3
