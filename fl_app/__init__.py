"""dpfl's Flower apps and their wiring: what the FAB ships to every node (the tooling is in dpfl_tools)."""

import importlib
from types import ModuleType

PROJECT_PACKAGES = (
    "dpcore",
    "fl_app",
    "strategies",
    "clients",
)  # this repository's packages: the apps' code, what the FAB holds
# set (to 1) in the environment of the processes that run Flower's simulation, where `flower-speed-patches` is
# true (the launcher does it; with plain `flwr run`, export it before the SuperLink starts)
SPEED_PATCHES_ENV = "DPFL_FLOWER_SPEED_PATCHES"


def speed_patches(module: str) -> ModuleType:
    """`dpfl_tools.<module>`: opt-in patches of Flower internals, imported only where run-config key
    'flower-speed-patches' asks for them. The FAB does not ship dpfl_tools; where it is not installed, the error
    names the key."""
    try:
        return importlib.import_module(f"dpfl_tools.{module}")
    except ModuleNotFoundError as exc:
        if exc.name not in ("dpfl_tools", f"dpfl_tools.{module}"):
            raise
        raise RuntimeError(
            "run-config key 'flower-speed-patches' = true needs the dpfl_tools package, which the FAB does not ship: "
            "install dpfl (pip install) where this app runs, or set flower-speed-patches = false"
        ) from exc
