"""The newest Flower nightly the registry serves, and whether pyproject's flwr range holds it.

Prints one line, `VERSION in-range` or `VERSION outside-range`, for .ci/run: the Flower-facing tests run on that
nightly; a failure inside the range fails CI, one outside it is reported and the range stays as it is (it is
widened by hand, in pyproject.toml, only after a green pass). Where the registry does not answer, the nightly last
checked (`LAST_CHECKED`) stands in, and stderr says so.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

LAST_CHECKED = "1.43.0.dev20261026"


def registry_versions(package: str = "flwr-nightly") -> list[Version]:
    """Every version of `package` that `pip index versions --pre` lists (empty where pip fails)."""
    run = subprocess.run(
        [sys.executable, "-m", "pip", "index", "versions", package, "--pre"], capture_output=True, text=True
    )
    listed = re.search(r"^Available versions:(.*)$", run.stdout, re.MULTILINE)
    versions = []
    for text in listed.group(1).split(",") if listed else []:
        try:
            versions.append(Version(text.strip()))
        except InvalidVersion:
            continue
    return versions


def flwr_range(pyproject: Path) -> SpecifierSet:
    """The flwr specifier of the project's dependencies, e.g. >=1.41,<1.44."""
    dependencies = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    (flower,) = [r for r in map(Requirement, dependencies) if r.name == "flwr"]
    return SpecifierSet(str(flower.specifier), prereleases=True)


def main() -> None:
    versions = registry_versions()
    if not versions:
        print(f"the registry listed no flwr-nightly: using {LAST_CHECKED}, the nightly last checked", file=sys.stderr)
    newest = max(versions, default=Version(LAST_CHECKED))
    inside = flwr_range(Path(__file__).parents[1] / "pyproject.toml").contains(newest)
    print(newest, "in-range" if inside else "outside-range")


if __name__ == "__main__":
    main()
