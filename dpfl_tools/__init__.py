"""dpfl's tooling, which the FAB does not ship: the launcher, a local deployment, the network namespace, the opt-in
patches of Flower internals, the report, the import graph and the in-process test grid. It may import every
package of the project; none of them imports it at module level (tests/test_architecture.py)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository: pyproject.toml, the app that `flwr run` builds
