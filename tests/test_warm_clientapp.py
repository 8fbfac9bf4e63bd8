"""The warm ClientApp executor (dpfl_tools.clientapp_executor) and the ServerApp's prompt reply polling."""

import json
import subprocess
import sys
import time

import pytest
from flwr.app import Message, RecordDict
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity

from dpfl.fl_app import PROJECT_PACKAGES
from dpfl.fl_app.transport import PromptGrid
from dpfl_tools import ROOT, clientapp_executor

FORK_TWO_TASKS = r"""
import json, random, sys
import numpy as np
import torch
from dpfl_tools import clientapp_executor

def draws(path):
    with open(path, "w") as f:
        json.dump({"numpy": np.random.random(), "python": random.random(), "torch": torch.initial_seed(),
                   "app": "dpfl.fl_app.client_app" in sys.modules}, f)
    return 0

np.random.seed(0)  # the parent's state; children must not share it
torch.manual_seed(0)
for path in sys.argv[1:]:
    pid = clientapp_executor.fork_task(lambda p: (clientapp_executor.fresh_random_state(), draws(p))[1], path)
    assert os.waitpid(pid, 0)[1] == 0
"""


def test_forked_tasks_get_fresh_random_state_and_no_app_code(tmp_path):
    """Two tasks forked from one executor (in a fresh process, as a node runs it) draw different numbers from
    numpy's, Python's and torch's global generators (as two fresh processes would), and the app's own modules
    are not imported before a task loads them from its FAB."""
    paths = [str(tmp_path / f"{i}.json") for i in range(2)]
    done = subprocess.run(
        [sys.executable, "-c", "import os\n" + FORK_TWO_TASKS, *paths], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    first, second = (json.loads(open(p).read()) for p in paths)
    assert first["numpy"] != second["numpy"] and first["python"] != second["python"]
    assert first["torch"] != second["torch"] and 0 not in (first["torch"], second["torch"])
    assert not first["app"] and not second["app"]


LOAD_FROM_FAB = r"""
import json, os, sys
from dpfl_tools import clientapp_executor

def load(fab, out):
    clientapp_executor.forget_own_modules()  # what run_task does first
    from flwr.supercore.object_ref import load_app
    load_app("dpfl.fl_app.client_app:app", ValueError, fab)
    with open(out, "w") as f:
        json.dump({name: sys.modules[name].__file__ for name in ("dpfl", "dpfl.fl_app", "dpfl.fl_app.client_app")}, f)
    return 0

pid = clientapp_executor.fork_task(load, sys.argv[1], sys.argv[2])
assert os.waitpid(pid, 0)[1] == 0
"""


def test_a_forked_task_imports_fl_app_from_the_runs_fab_not_the_executors(tmp_path):
    """The executor runs from an installed dpfl; a task must load the run's own dpfl.fl_app (as a fresh
    flwr-clientapp process would), even though the executor's package is already imported when it forks. The FAB
    holds dpfl/__init__.py, which finds the FAB's fl_app beside it."""
    fab = tmp_path / "fab"
    (fab / "dpfl").mkdir(parents=True)
    (fab / "dpfl" / "__init__.py").write_text((ROOT / "dpfl" / "__init__.py").read_text())
    (fab / "fl_app").mkdir()
    (fab / "fl_app" / "__init__.py").write_text("")
    (fab / "fl_app" / "client_app.py").write_text("from flwr.clientapp import ClientApp\napp = ClientApp()\n")
    out = tmp_path / "loaded.json"
    done = subprocess.run(
        [sys.executable, "-c", LOAD_FROM_FAB, str(fab), str(out)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    loaded = json.loads(out.read_text())
    assert loaded == {
        "dpfl": str(fab / "dpfl" / "__init__.py"),
        "dpfl.fl_app": str(fab / "fl_app" / "__init__.py"),
        "dpfl.fl_app.client_app": str(fab / "fl_app" / "client_app.py"),
    }


def test_executor_preloads_libraries_only():
    """Only libraries are preloaded: nothing of this repository (the FAB's copy is what a task runs)."""
    assert clientapp_executor.APP_NAMESPACE == "dpfl"
    assert not [m for m in clientapp_executor.PRELOAD if m.split(".")[0] in ("dpfl", *PROJECT_PACKAGES)]


class FakeGrid(Grid):
    """Replies arrive over several pulls; counts the pulls."""

    def __init__(self, replies_per_pull):
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1
        self.replies_per_pull, self.pulls = list(replies_per_pull), 0

    def set_run(self, run):
        pass

    @property
    def run(self):
        return None

    def create_message(self, *a, **k):
        raise NotImplementedError

    def get_node_ids(self):
        return [1, 2, 3]

    def push_messages(self, messages):
        self.sent = list(messages)
        return [str(i) for i in range(len(self.sent))]

    def pull_messages(self, message_ids):
        self.pulls += 1
        ids = self.replies_per_pull.pop(0) if self.replies_per_pull else []
        replies = []
        for i in ids:
            replies.append(Message(RecordDict(), reply_to=self.sent[int(i)]))
        return replies

    def send_and_receive(self, messages, *, timeout=None):
        raise AssertionError("PromptGrid must not wait in the wrapped grid's send_and_receive")


def _messages(n):
    msgs = []
    for i in range(n):
        m = Message(RecordDict(), dst_node_id=i + 1, message_type="train")
        m.metadata.__dict__["_message_id"] = str(i)
        msgs.append(m)
    return msgs


def test_prompt_grid_collects_every_reply_over_several_pulls():
    grid = FakeGrid([["0"], [], ["2", "1"]])
    replies = PromptGrid(grid, interval=0.001).send_and_receive(_messages(3))
    assert sorted(r.metadata.reply_to_message_id for r in replies) == ["0", "1", "2"]
    assert grid.pulls == 3  # stops as soon as every reply is in


def test_prompt_grid_returns_what_arrived_when_the_timeout_passes():
    grid = FakeGrid([["1"]])
    replies = PromptGrid(grid, interval=0.01).send_and_receive(_messages(3), timeout=0.1)
    assert [r.metadata.reply_to_message_id for r in replies] == ["1"]
    assert grid.pulls >= 2


def test_prompt_grid_zero_timeout_pulls_nothing():
    grid = FakeGrid([["0"]])
    assert PromptGrid(grid).send_and_receive(_messages(1), timeout=0.0) == [] and grid.pulls == 0


def test_the_object_pull_backoff_is_shortened_for_tasks_nodes_and_the_serverapp(monkeypatch):
    """A receiver that asks for a message's objects before the sender has pushed them gets
    ObjectUnavailableError, and Flower retries after 1 s: a forked task asking its SuperNode
    (`pull_and_inflate_object_from_tree`), a SuperNode or the ServerApp asking the SuperLink (`pull_objects`).
    Every caller passes no backoff, so setting the defaults reaches them all; the rest of Flower's retry
    policy stays."""
    from flwr.supercore.inflatable import inflatable_utils

    from dpfl_tools.pull_backoff import shorten_pull_backoff

    pulls = (inflatable_utils.pull_objects, inflatable_utils.pull_and_inflate_object_from_tree)
    for pull in pulls:  # restored after the test
        monkeypatch.setitem(pull.__kwdefaults__, "initial_backoff", pull.__kwdefaults__["initial_backoff"])
    before = [dict(pull.__kwdefaults__) for pull in pulls]
    assert [b["initial_backoff"] for b in before] == [1, 1]
    assert shorten_pull_backoff(0.05) is True
    for pull, old in zip(pulls, before):
        assert pull.__kwdefaults__ == {**old, "initial_backoff": 0.05}


class WithheldObjectsGrid(FakeGrid):
    """A deployed grid where some replies arrive but their objects never do. `pull_messages` pulls each
    listed reply's objects with the `pull_objects` of Flower's deployed Grid module and, like that Grid,
    turns an ObjectPullError into an error reply. Honest replies are listed from `honest_after` seconds on,
    complete."""

    backstop = 30.0  # a withheld object's own give-up, so an unbounded pull fails the test instead of hanging

    def __init__(self, withheld: set[str], honest_after: float, initial_backoff: float = 0.01) -> None:
        super().__init__([])
        self.withheld, self.honest_after, self.created = withheld, honest_after, time.monotonic()
        self.initial_backoff = initial_backoff

    def pull_messages(self, message_ids):
        from flwr.app import Error
        from flwr.supercore.inflatable.inflatable_utils import ObjectPullError, ObjectUnavailableError
        from flwr.superlink.grid import http_grid

        self.pulls += 1
        started = time.monotonic()
        honest_listed = started - self.created >= self.honest_after  # what the SuperLink lists at this pull

        def never_there(object_id):
            if time.monotonic() - started > self.backstop:
                raise ObjectPullError(object_id, "backstop")
            raise ObjectUnavailableError(object_id)

        replies = []
        for i in sorted(message_ids):
            if i not in self.withheld:
                if honest_listed:
                    replies.append(Message(RecordDict(), reply_to=self.sent[int(i)]))
                continue
            try:
                http_grid.pull_objects([f"object-{i}"], never_there, initial_backoff=self.initial_backoff)
            except ObjectPullError as err:
                replies.append(Message(Error(code=0, reason=str(err)), reply_to=self.sent[int(i)]))
        return replies


def test_replies_whose_objects_never_come_fail_at_the_round_timeout(monkeypatch):
    """Flower pulls a reply's objects for up to 7200 s and the round's timeout is only looked at between
    pulls: one node that withholds its objects would hold the round, and two in one pull twice as long.
    Bounded, two withheld replies cost the timeout once, and an honest reply that came while they held
    the pull is taken by the last look at the deadline."""
    from flwr.superlink.grid import http_grid

    from dpfl_tools.pull_backoff import bound_reply_object_pulls, object_pulls_end_by

    monkeypatch.setattr(http_grid, "pull_objects", http_grid.pull_objects)  # restored after the test
    flower_limit = http_grid.pull_objects.__kwdefaults__["max_time"]
    assert bound_reply_object_pulls() and bound_reply_object_pulls()  # installed once
    assert http_grid.pull_objects.__wrapped__.__kwdefaults__["max_time"] == flower_limit == 7200

    grid = WithheldObjectsGrid(withheld={"0", "1"}, honest_after=0.3)
    started = time.monotonic()
    replies = PromptGrid(grid, interval=0.01, pulls_end_by=object_pulls_end_by).send_and_receive(
        _messages(3), timeout=1.0
    )
    elapsed = time.monotonic() - started
    assert 0.9 < elapsed < 1.8, elapsed  # the round's 1 s once: not 2 s, the 30 s backstop or 7200 s
    by_id = {r.metadata.reply_to_message_id: r for r in replies}
    assert sorted(by_id) == ["0", "1", "2"]
    assert [by_id[i].has_error() for i in "012"] == [True, True, False]
    assert all("backstop" not in by_id[i].error.reason for i in "01")


@pytest.mark.flower_version
@pytest.mark.slow
def test_a_bounded_pull_ends_within_a_retry_cap_of_the_round_timeout(monkeypatch):
    """Flower's retries of an absent object wait 1 s doubling to 10 s (+-20%), so a pull that gives up at the
    deadline could end 12 s after it. Bounded, retries are at most DEADLINE_BACKOFF_CAP apart: with a first
    wait of 2 s and a 2.5 s timeout Flower's next retry would come 4.8-7.2 s in, the bounded one by 3.7 s."""
    from flwr.superlink.grid import http_grid

    from dpfl_tools.pull_backoff import DEADLINE_BACKOFF_CAP, bound_reply_object_pulls, object_pulls_end_by

    monkeypatch.setattr(http_grid, "pull_objects", http_grid.pull_objects)  # restored after the test
    assert bound_reply_object_pulls()
    grid = WithheldObjectsGrid(withheld={"0"}, honest_after=0.0, initial_backoff=2.0)
    started = time.monotonic()
    replies = PromptGrid(grid, interval=0.01, pulls_end_by=object_pulls_end_by).send_and_receive(
        _messages(2), timeout=2.5
    )
    elapsed = time.monotonic() - started
    assert DEADLINE_BACKOFF_CAP == 1.0
    assert 2.4 < elapsed < 2.5 + 1.2 * DEADLINE_BACKOFF_CAP + 0.5, elapsed
    by_id = {r.metadata.reply_to_message_id: r for r in replies}
    assert [by_id[i].has_error() for i in "01"] == [True, False]
