"""Flower's first retry for a message's objects that are not there yet: 1 s, made shorter.

A Flower message travels as the message and then its objects (arrays, configs). A receiver that sees the
message at once asks for objects the sender has not finished pushing, gets ObjectUnavailableError, and
Flower 1.41 retries after `PULL_INITIAL_BACKOFF` = 1 s, doubling up to 10 s. Three places meet it:

- a ClientApp task asks its SuperNode for the message before the node has pulled it from the SuperLink
  (`run_clientapp` -> `pull_and_inflate_object_from_tree`; measured: 1.2 s of a 2.5 s training task);
- a SuperNode asks the SuperLink for the objects of a message the ServerApp is still pushing
  (`start_client_internal` -> `pull_objects`);
- the ServerApp asks the SuperLink for the objects of a reply a SuperNode is still pushing
  (the deployed Grid's `pull_messages` -> `pull_objects`).

With fast polling on both sides (`dpfl_tools.supernode --idle-poll`, `PromptGrid`) that retry was the largest
wait left in a deployed round: 0.9-1.1 s at one to three of a SecAgg+ round's four exchanges. A shorter
first retry keeps Flower's doubling, cap and limits; it costs a few more small requests while an object
is in flight.

The other end of the same loop: a reply whose message arrives but whose objects never do (a node that
crashed mid-push, or a hostile one that withholds them) keeps Flower's `pull_objects` retrying for up to
`PULL_MAX_TIME` = 7200 s, and the SuperLink drops the reply only when its push session has been idle for
180 s, a wait a node can renew by pushing one object at a time. A round's timeout is checked only between
pulls, so it did not bound that wait. `object_pulls_end_by` gives the pulls the time left in the round.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager

PULL_BACKOFF = 0.05  # seconds before the first retry (Flower: 1)
PATCHED_FLOWER = ("1.41", "1.42")  # the Flower releases these patches were written for and are tested on
PULL_BACKOFF_RANGE = (0.01, 1.0)  # what the command-line options accept


def flower_patch_problem() -> str | None:
    """Why the installed Flower is not patched (None: it may be): a release these patches do not know."""
    import flwr

    release = ".".join(flwr.__version__.split(".")[:2])
    if release not in PATCHED_FLOWER:
        return (
            f"flwr {flwr.__version__} is not a release the speed patches were tested on "
            f"({', '.join(PATCHED_FLOWER)}): Flower's stock behaviour is kept"
        )
    return None


def apply_server_patches() -> str:
    """The ServerApp's opt-in speed patches (run-config key `flower-speed-patches`): replies' objects retried
    after PULL_BACKOFF s, not 1 s, and their pulls ended at the round's timeout. Returns what was done (a log
    line); on a Flower release they were not tested on, nothing is patched."""
    problem = flower_patch_problem()
    if problem:
        return problem
    done = [
        shorten_pull_backoff() and f"object pulls retried after {PULL_BACKOFF} s",
        bound_reply_object_pulls() and "reply object pulls end at round-timeout",
    ]
    return "Flower speed patches: " + ("; ".join(d for d in done if d) or "none applied (this flwr lacks them)")


def pull_backoff_option(text: str) -> float:
    """argparse `type` of the `--pull-backoff` options: seconds, within PULL_BACKOFF_RANGE."""
    import argparse

    low, high = PULL_BACKOFF_RANGE
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not low <= seconds <= high:
        raise argparse.ArgumentTypeError(f"--pull-backoff = {text!r}: must be a number of seconds from {low} to {high}")
    return seconds


def shorten_pull_backoff(seconds: float = PULL_BACKOFF) -> bool:
    """Set the default first retry of Flower's `pull_objects` and `pull_and_inflate_object_from_tree` (its
    callers pass none) to `seconds`, in this process. False, with nothing changed, where the installed
    Flower lacks either default."""
    from flwr.supercore.inflatable import inflatable_utils

    pulls = (inflatable_utils.pull_objects, inflatable_utils.pull_and_inflate_object_from_tree)
    if not all("initial_backoff" in (pull.__kwdefaults__ or {}) for pull in pulls):
        return False
    for pull in pulls:
        pull.__kwdefaults__["initial_backoff"] = seconds
    return True


_reply_pull_deadline: float | None = None  # set by object_pulls_end_by
DEADLINE_BACKOFF_CAP = 1.0  # s between retries of a bounded pull (Flower: 1 s doubling to 10 s)
BOUNDED_PULL_KEYS = ("max_time", "initial_backoff", "backoff_cap")


def bound_reply_object_pulls() -> bool:
    """Make the `pull_objects` of Flower's deployed Grid (`flwr.superlink.grid.http_grid`) give up at the
    deadline `object_pulls_end_by` sets: `max_time` = min(Flower's, deadline - now) at each call, so k
    withheld replies in one pull cost the time left once, not k times, and retries at most
    DEADLINE_BACKOFF_CAP apart, so a pull ends within 1.2 s of the deadline (the cap plus Flower's 20% jitter;
    Flower's own 10 s cap would let it overrun by 12 s). Installed once per process; False, with nothing
    changed, where that Grid has no `pull_objects` taking these arguments."""
    try:
        from flwr.superlink.grid import http_grid
    except ImportError:
        return False
    pull_objects = getattr(http_grid, "pull_objects", None)
    if getattr(pull_objects, "bounded_by_round", False):
        return True
    defaults = getattr(pull_objects, "__kwdefaults__", None) or {}
    if not all(key in defaults for key in BOUNDED_PULL_KEYS):
        return False

    @functools.wraps(pull_objects)
    def pull_objects_until_deadline(*args, **kwargs):
        if _reply_pull_deadline is not None:
            left = max(0.0, _reply_pull_deadline - time.monotonic())
            limit = kwargs.get("max_time", defaults["max_time"])
            kwargs["max_time"] = left if limit is None else min(left, limit)
            for key in ("initial_backoff", "backoff_cap"):
                kwargs[key] = min(kwargs.get(key, defaults[key]), DEADLINE_BACKOFF_CAP)
        return pull_objects(*args, **kwargs)

    pull_objects_until_deadline.bounded_by_round = True
    http_grid.pull_objects = pull_objects_until_deadline
    return True


@contextmanager
def object_pulls_end_by(deadline: float | None) -> Iterator[None]:
    """Inside the block, the deployed Grid's object pulls (`bound_reply_object_pulls`) give up at `deadline`
    (`time.monotonic()` seconds; None: Flower's own limit), and the Grid turns such a reply into an error
    reply."""
    global _reply_pull_deadline
    outer, _reply_pull_deadline = _reply_pull_deadline, deadline
    try:
        yield
    finally:
        _reply_pull_deadline = outer
