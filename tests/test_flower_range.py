"""The supported Flower range: no patch of Flower internals unless asked for (`flower-speed-patches`), and
then only on a release they were tested on; a federation smaller than min-nodes is refused, never waited on."""

import time

import flwr
import pytest

from dpfl_tools import pull_backoff
from fl_app.server_app import TooFewNodes, wait_for_nodes


def pull_defaults() -> dict:
    from flwr.supercore.inflatable import inflatable_utils

    return dict(inflatable_utils.pull_objects.__kwdefaults__ or {})


def test_the_installed_flower_is_in_the_supported_range_and_patchable():
    release = ".".join(flwr.__version__.split(".")[:2])
    assert release in pull_backoff.PATCHED_FLOWER, flwr.__version__
    assert pull_backoff.flower_patch_problem() is None


def test_an_unknown_flower_release_is_not_patched(monkeypatch):
    before = pull_defaults()
    monkeypatch.setattr(flwr, "__version__", "1.99.0")
    message = pull_backoff.apply_server_patches()
    assert "flwr 1.99.0 is not a release the speed patches were tested on" in message
    assert "stock behaviour" in message
    assert pull_defaults() == before


def test_the_default_server_path_patches_nothing(tmp_path, monkeypatch):
    """The ServerApp's main with the default config leaves Flower's pull defaults as they are."""
    from flwr.app import Context, RecordDict

    from dpfl_tools.inprocess import InProcessGrid
    from fl_app import server_app
    from fl_app.server_app import main as server_main

    monkeypatch.setattr(server_app, "PromptGrid", lambda grid, **_: grid)  # the in-process grid answers at once

    before = pull_defaults()
    run_config = {
        "dataset": "digits",
        "model": "mlp",
        "partitioner": "iid",
        "num-rounds": 1,
        "local-steps": 1,
        "results-dir": str(tmp_path / "run"),
        "tensorboard": False,
    }
    from fl_app.client_app import app as client_app

    grid = InProcessGrid(client_app, 2, run_config)
    server_main(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=run_config))
    assert pull_defaults() == before


class CountingGrid:
    def __init__(self, counts):
        self.counts = list(counts)

    def get_node_ids(self):
        return list(range(self.counts.pop(0) if len(self.counts) > 1 else self.counts[0]))


def test_a_simulation_smaller_than_min_nodes_is_refused_at_once_naming_the_keys():
    start = time.monotonic()
    with pytest.raises(TooFewNodes) as error:
        wait_for_nodes(CountingGrid([0, 2]), 5, 600, simulation=True, poll=0.01, settle=0.2)
    assert time.monotonic() - start < 5
    assert "'min-nodes' = 5" in str(error.value) and "num-supernodes=5" in str(error.value)
    assert "min-nodes=2" in str(error.value)


def test_a_deployment_waits_for_late_nodes_then_gives_up_at_the_timeout():
    assert wait_for_nodes(CountingGrid([1, 1, 2, 3]), 3, 10, simulation=False, poll=0.01) == 3
    with pytest.raises(TooFewNodes, match="'node-wait-timeout' = 0.3 s: start 2 more SuperNodes"):
        wait_for_nodes(CountingGrid([1]), 3, 0.3, simulation=False, poll=0.01)


def test_a_simulation_takes_its_population_once_registration_is_over():
    """Nodes registering one after another: the count is taken once it has stopped changing, not at min-nodes."""
    grid = CountingGrid([0, 1, 2, 3, 4, 5])
    assert wait_for_nodes(grid, 2, 10, simulation=True, poll=0.01, steady=0.1) == 5


IMPORT_THE_APPS = """
import sys
from flwr.server.superlink.fleet.vce import vce_api
from flwr.superlink.grid import http_grid
from flwr.supercore.inflatable import inflatable_utils
from flwr.supernode import start_client_internal

def flower():
    return {
        "simulation pickup": vce_api.add_messages_to_queue,
        "reply object pulls": http_grid.pull_objects,
        "object pull backoff": dict(inflatable_utils.pull_objects.__kwdefaults__),
        "message pull backoff": dict(inflatable_utils.pull_and_inflate_object_from_tree.__kwdefaults__),
        "supernode sleeps": start_client_internal.time,
    }

before = flower()
import fl_app.client_app, fl_app.server_app
after = flower()
changed = [name for name in before if after[name] is not before[name] and after[name] != before[name]]
print("changed:", changed, "tooling imported:", sorted(m for m in sys.modules if m.startswith("dpfl_tools")))
"""


@pytest.mark.parametrize("speed_patches", ["unset", "1"])
def test_importing_the_apps_patches_nothing_unless_the_tooling_asks(speed_patches):
    """Importing the ClientApp and the ServerApp leaves every function of Flower that the opt-in patches replace
    as it was, and loads no tooling; only the launcher's SPEED_PATCHES_ENV = 1 (runs with flower-speed-patches)
    puts the simulation's message pickup in place, from dpfl_tools."""
    import os
    import subprocess
    import sys

    from fl_app import SPEED_PATCHES_ENV

    env = {k: v for k, v in os.environ.items() if k != SPEED_PATCHES_ENV}
    if speed_patches == "1":
        env[SPEED_PATCHES_ENV] = "1"
    out = subprocess.run([sys.executable, "-c", IMPORT_THE_APPS], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    if speed_patches == "unset":
        assert out.stdout.strip() == "changed: [] tooling imported: []"
    else:
        assert out.stdout.strip() == (
            "changed: ['simulation pickup'] tooling imported: "
            "['dpfl_tools', 'dpfl_tools.pull_backoff', 'dpfl_tools.simulation_pickup']"
        )


def test_without_the_tooling_the_speed_patches_error_names_the_key(monkeypatch):
    """The FAB does not ship dpfl_tools: where it is not installed, asking for the patches fails with the key."""
    import sys

    from fl_app import speed_patches

    for name in ("dpfl_tools", "dpfl_tools.pull_backoff"):
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed: importing it fails
    with pytest.raises(RuntimeError, match="run-config key 'flower-speed-patches' = true needs the dpfl_tools"):
        speed_patches("pull_backoff")
