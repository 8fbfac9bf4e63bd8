"""The supported Flower range: no patch of Flower internals unless asked for (`flower-speed-patches`), and
then only on a release they were tested on; a federation smaller than min-nodes is refused, never waited on;
Flower 1.43's API (should_stop, Result's initial model, reply_to_message_ids, dropped replies) on every release."""

import time

import flwr
import numpy as np
import pytest
from flwr.serverapp.strategy import FedAvg

from dpfl.fl_app.transport import PromptGrid, TooFewNodes, wait_for_nodes
from dpfl.strategies import DifferentialPrivacy
from dpfl_tools import pull_backoff
from dpfl_tools.inprocess import InProcessGrid
from tests.independent_accountant import dp_accounting_epsilons
from tests.test_wrapper import M, model, weights_client


def pull_defaults() -> dict:
    from flwr.supercore.inflatable import inflatable_utils

    return dict(inflatable_utils.pull_objects.__kwdefaults__ or {})


def flwr_requirement() -> str:
    """The flwr range of pyproject.toml's dependencies, e.g. '>=1.41,<1.44'."""
    import tomllib
    from pathlib import Path

    from packaging.requirements import Requirement

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    (flower,) = [r for r in map(Requirement, project["dependencies"]) if r.name == "flwr"]
    return str(flower.specifier)


def test_the_installed_flower_is_in_the_supported_range():
    """CI's passes (the newest release, 1.41.0, the 1.43 nightly) each run this: the range must hold them all."""
    from packaging.specifiers import SpecifierSet

    assert SpecifierSet(flwr_requirement(), prereleases=True).contains(flwr.__version__), flwr.__version__


def test_the_speed_patches_apply_on_1_41_and_1_42_and_are_refused_by_version_on_1_43(monkeypatch):
    """Flower 1.43 rewrote what the patches lean on (its SuperNode's reply loop; its deployed Grid drops a reply
    whose objects it cannot pull instead of returning an error reply), so they are not applied there."""
    release = ".".join(flwr.__version__.split(".")[:2])
    assert (pull_backoff.flower_patch_problem() is None) == (release in ("1.41", "1.42")), flwr.__version__
    before = pull_defaults()
    monkeypatch.setattr(flwr, "__version__", "1.43.0.dev20261026")
    message = pull_backoff.apply_server_patches()
    assert message.startswith("flwr 1.43.0.dev20261026 is not a release the speed patches were tested on (1.41, 1.42)")
    assert pull_defaults() == before


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

    from dpfl.fl_app import server_app
    from dpfl.fl_app.server_app import main as server_main
    from dpfl_tools.inprocess import InProcessGrid

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
    from dpfl.fl_app.client_app import app as client_app

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
import dpfl.fl_app.client_app, dpfl.fl_app.server_app
after = flower()
changed = [name for name in before if after[name] is not before[name] and after[name] != before[name]]
print("changed:", changed, "tooling imported:", sorted(m for m in sys.modules if m.startswith("dpfl_tools")))
"""


@pytest.mark.flower_version
@pytest.mark.slow
@pytest.mark.parametrize("speed_patches", ["unset", "1"])
def test_importing_the_apps_patches_nothing_unless_the_tooling_asks(speed_patches):
    """Importing the ClientApp and the ServerApp leaves every function of Flower that the opt-in patches replace
    as it was, and loads no tooling; only the launcher's SPEED_PATCHES_ENV = 1 (runs with flower-speed-patches)
    puts the simulation's message pickup in place, from dpfl_tools."""
    import os
    import subprocess
    import sys

    from dpfl.fl_app import SPEED_PATCHES_ENV

    env = {k: v for k, v in os.environ.items() if k != SPEED_PATCHES_ENV}
    if speed_patches == "1":
        env[SPEED_PATCHES_ENV] = "1"
    out = subprocess.run([sys.executable, "-c", IMPORT_THE_APPS], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    if speed_patches == "unset":
        assert out.stdout.strip() == "changed: [] tooling imported: []"
    else:  # on a Flower the patches were not tested on (1.43), asked for or not, nothing is changed
        changed = "['simulation pickup']" if pull_backoff.flower_patch_problem() is None else "[]"
        assert out.stdout.strip() == (
            f"changed: {changed} tooling imported: "
            "['dpfl_tools', 'dpfl_tools.pull_backoff', 'dpfl_tools.simulation_pickup']"
        )


def test_without_the_tooling_the_speed_patches_error_names_the_key(monkeypatch):
    """The FAB does not ship dpfl_tools: where it is not installed, asking for the patches fails with the key."""
    import sys

    from dpfl.fl_app import speed_patches

    for name in ("dpfl_tools", "dpfl_tools.pull_backoff"):
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed: importing it fails
    with pytest.raises(RuntimeError, match="run-config key 'flower-speed-patches' = true needs the dpfl_tools"):
        speed_patches("pull_backoff")


# ---------------------------------------------------------------- Flower 1.43's API, on every supported release
SIGMA, Q = 1.0, 0.5


def dp_strategy(sample_rate: float = Q) -> DifferentialPrivacy:
    return DifferentialPrivacy(
        FedAvg(fraction_evaluate=0.0),
        clipping_norm=1.0,
        noise_multiplier=SIGMA,
        sample_rate=sample_rate,
        min_available_nodes=M,
    )


def test_should_stop_after_round_2_ends_the_run_there_charged_2_rounds_and_closed(caplog):
    """Flower 1.43's `should_stop(round, result)`: asked after each round with the Result so far; True ends the run
    after that round, whose model is returned, the ledger charged for those rounds only, and the run closes."""
    asked = []

    def should_stop(server_round, result):
        asked.append((server_round, sorted(result.train_metrics_clientapp)))
        return server_round == 2

    strategy, grid = dp_strategy(), InProcessGrid(weights_client(), M, {})
    with caplog.at_level("INFO"):
        result = strategy.start(grid, model(), num_rounds=5, should_stop=should_stop)
    assert asked == [(1, [1]), (2, [1, 2])]
    assert {int(m.content["config"]["server-round"]) for m in grid.sent} <= {1, 2}
    assert strategy.record.completed_rounds == 2 and [r["round"] for r in strategy.record.history] == [1, 2]
    assert strategy.record.stop_reason == "should_stop after round 2"
    fc = result.arrays["fc.weight"].numpy()
    assert not np.array_equal(fc, model()["fc.weight"].numpy())  # round 2's released model, not the initial one
    epsilon, delta = strategy.privacy_metrics()["epsilon"], strategy.ledger.delta
    pld_2, _ = dp_accounting_epsilons(SIGMA, Q, 2, delta)  # 3 rounds' is 20% more (5.84 against 4.85 at 1e-5)
    assert pld_2 * 0.999 <= epsilon <= pld_2 * 1.02, (epsilon, pld_2)
    assert (
        strategy.describe()["epsilon"] == epsilon and strategy.describe()["stop_reason"] == strategy.record.stop_reason
    )
    messages = [r.getMessage() for r in caplog.records]
    stopped = messages.index("Stopping early after round 2")
    assert "Final results:" in messages[stopped:]  # Flower's closing lines follow, as after the last round


def test_the_result_starts_with_the_initial_model():
    """Flower 1.43: Result.arrays holds the initial model until a round releases one (before: empty)."""
    result = dp_strategy().start(InProcessGrid(weights_client(), M, {}), model(), num_rounds=0)
    assert list(result.arrays.keys()) == list(model().keys())
    assert np.array_equal(result.arrays["fc.weight"].numpy(), model()["fc.weight"].numpy())


class DroppingGrid:
    """A deployed Grid as Flower 1.43's HttpGrid is: pull_messages(reply_to_message_ids, *, message_ids=None)
    (the old name deprecated), and a reply whose objects it cannot pull (here node 101's) is left out, no error
    reply in its place. `unpushed`: nodes whose message the SuperLink refused, `refused_id` what push_messages
    returns for them (1.41/1.42: None, 1.43: ""), which the SuperLink's pull request does not take."""

    def __init__(self, unpushed=(), refused_id=None):
        self.inner, self.unpushed, self.refused_id = InProcessGrid(weights_client(), M, {}), unpushed, refused_id
        self.replies, self.pulls = {}, 0

    def get_node_ids(self):
        return self.inner.get_node_ids()

    def push_messages(self, messages):
        ids = []
        for msg in messages:
            if msg.metadata.dst_node_id in self.unpushed:
                msg.metadata.__dict__["_message_id"] = f"refused-{msg.metadata.dst_node_id}"
                ids.append(self.refused_id)
                continue
            (reply,) = self.inner.send_and_receive([msg])
            self.replies[msg.metadata.message_id] = reply
            ids.append(msg.metadata.message_id)
        return ids

    def pull_messages(self, reply_to_message_ids=None, *, message_ids=None):
        if message_ids is not None:
            raise AssertionError("message_ids is deprecated in Flower 1.43: reply_to_message_ids")
        if not all(isinstance(i, str) and i for i in reply_to_message_ids):
            raise TypeError(f"not a message id: {sorted(map(repr, reply_to_message_ids))}")  # as protobuf refuses None
        self.pulls += 1
        return [r for i, r in self.replies.items() if i in set(reply_to_message_ids) and r.metadata.src_node_id != 101]


@pytest.mark.parametrize("unpushed,refused_id", [((), None), ((102,), None), ((102,), "")])
def test_replies_a_grid_drops_without_an_error_reply_count_as_failed_clients(unpushed, refused_id):
    """Flower 1.43's HttpGrid drops a reply it cannot fetch: the round counts it failed as it counts an error
    reply. A message the SuperLink refused (its id None, or "" on 1.43) is a failure too, not an id to pull
    (before: PromptGrid pulled None, which the SuperLink's request refuses with a TypeError)."""
    strategy, grid = (
        dp_strategy(sample_rate=1.0),
        DroppingGrid(unpushed, refused_id),
    )  # every node sampled: 101 and 102 too
    strategy.start(PromptGrid(grid, interval=0.01), model(), num_rounds=1, timeout=0.3)
    (record,) = strategy.record.history
    lost = ["node 101: no reply before round-timeout"] + [f"node {n}: no reply before round-timeout" for n in unpushed]
    assert record["failures"] == len(lost) and sorted(record["failed_nodes"]) == sorted(lost)
    assert record["clients"] == M - len(lost)
