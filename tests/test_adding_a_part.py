"""docs/architecture.md's "Adding a part" through the run config is true: in a copy of the repository, a toy part
is offered as run-config key `toy-shift` by editing only the files that page lists, and redrawing the two it
says `python -m dpfl.fl_app.config --write` redraws. The copy then validates the key (named in the error with its
value and what is allowed), builds dp-fedavg's wrapper with the part, and refuses the key for ali-dpfl, whose
builder does not read it (the record lists no owned_keys)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# the files the page lists: the part's own module, its settings, the builder that passes it, the registry record
PART_MODULE = "strategies/parts/toy_shift.py"
EDITED = {PART_MODULE, "fl_app/settings.py", "fl_app/builders.py", "fl_app/algorithms.py"}
REDRAWN = {"docs/run-config.md", "pyproject.toml"}  # by python -m dpfl.fl_app.config --write

TOY_PART = '''"""A toy part: every client is told a shift."""

from dpfl.dpcore.privacy.settings import require

from .part import Part


class ToyShift(Part):
    keyword = "toy_shift"

    def __init__(self, shift: float) -> None:
        self.shift = shift

    def check(self, privacy, others: frozenset[str]) -> None:
        require(self.shift >= 0, "toy_shift", self.shift, "must be >= 0")

    def client_config(self, dp, server_round: int) -> dict:
        return {"toy-shift": self.shift}
'''

TOY_SETTINGS = '''@dataclass(frozen=True)
class ToySettings:
    """The toy part."""

    shift: float = setting(0.0, "how far every client moves each weight (dp-fedavg)", low=0.0, high=1.0,
                           key="toy-shift")


'''

TOY_BUILDER = """

def toy_level(s: Settings) -> dict:
    from dpfl.strategies.parts.toy_shift import ToyShift

    return {**client_level(s), "parts": [ToyShift(s.toy.shift)]}
"""

CHECK = """
import json
from dpfl.fl_app.algorithms import algorithm, check_config
from dpfl.fl_app.config import validate

out = {}
s = validate({"algorithm": "dp-fedavg", "toy-shift": 0.5})
check_config(s, algorithm("dp-fedavg"))
strategy = algorithm("dp-fedavg").build_strategy(s)
out["parts"] = [type(p).__name__ for p in strategy.parts]
out["config"] = strategy.parts[-1].client_config(strategy, 1)
ali_dpfl = {"algorithm": "ali-dpfl", "target-epsilon": 8.0, "toy-shift": 0.5}
for config, name in ((ali_dpfl, "ali-dpfl"), ({"toy-shift": 2.0}, "dp-fedavg")):
    try:
        check_config(validate(config), algorithm(name))
    except ValueError as error:
        out[name] = str(error)
print(json.dumps(out))
"""


def edit(path: Path, pattern: str, replacement: str) -> None:
    text = path.read_text()
    new, count = re.subn(pattern, replacement, text, count=1, flags=re.S)
    assert count == 1, f"{path}: {pattern!r} not found"
    path.write_text(new)


def product_copy(target: Path) -> None:
    """The tracked files outside tests/, as they are in the working tree."""
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for name in listed.splitlines():
        if not name.startswith("tests/") and (ROOT / name).is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, target / name)


def changed_files(copy: Path) -> set[str]:
    return {
        str(path.relative_to(copy))
        for path in copy.rglob("*")
        if path.is_file()
        and "__pycache__" not in path.parts
        and (
            not (ROOT / path.relative_to(copy)).is_file()
            or path.read_bytes() != (ROOT / path.relative_to(copy)).read_bytes()
        )
    }


@pytest.mark.slow
def test_a_part_offered_through_the_run_config_touches_only_the_files_the_page_lists(tmp_path):
    page = (ROOT / "docs" / "architecture.md").read_text()
    for name in EDITED | REDRAWN:
        assert f"`{name}`" in page or name == PART_MODULE, f"docs/architecture.md does not list {name}"
    assert "its own module in `strategies/parts/`" in page

    product_copy(tmp_path)
    (tmp_path / PART_MODULE).write_text(TOY_PART)
    edit(tmp_path / "fl_app/settings.py", r"(@dataclass\(frozen=True\)\nclass Settings:)", TOY_SETTINGS + r"\1")
    edit(
        tmp_path / "fl_app/settings.py",
        r"(\n    audit: AuditSettings = field\(default_factory=AuditSettings\)\n)",
        r"\1    toy: ToySettings = field(default_factory=ToySettings)\n",
    )
    (tmp_path / "fl_app/builders.py").write_text((tmp_path / "fl_app/builders.py").read_text() + TOY_BUILDER)
    edit(
        tmp_path / "fl_app/algorithms.py",
        r'("dp-fedavg",\n\s+"[^"]*",\n\s+DPFedAvg,\n\s+)client_level,(\n\s+sgd_client,)',
        r"\1toy_level,\2",
    )
    edit(tmp_path / "fl_app/algorithms.py", r"(from dpfl\.fl_app\.builders import \()", r"\1\n    toy_level,")
    run = dict(cwd=tmp_path, capture_output=True, text=True, timeout=120)
    subprocess.run([sys.executable, "-m", "dpfl.fl_app.config", "--write"], check=True, **run)
    assert changed_files(tmp_path) == EDITED | REDRAWN
    assert "toy-shift" in (tmp_path / "docs/run-config.md").read_text()
    assert re.search(r"\ntoy-shift = 0\.0 ", (tmp_path / "pyproject.toml").read_text())

    done = subprocess.run([sys.executable, "-c", CHECK], **run)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["parts"] == ["DistributedNoise", "ToyShift"] and out["config"] == {"toy-shift": 0.5}
    # no owned_keys: the registry reads the builders, and ali-dpfl's does not read toy-shift
    assert "'toy-shift' = 0.5 is not read by algorithm 'ali-dpfl'" in out["ali-dpfl"]
    assert "toy-shift" in out["dp-fedavg"] and "2.0" in out["dp-fedavg"]
