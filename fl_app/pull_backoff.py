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

With fast polling on both sides (`fl_app.supernode --idle-poll`, `PromptGrid`) that retry was the largest
wait left in a deployed round: 0.9-1.1 s at one to three of a SecAgg+ round's four exchanges. A shorter
first retry keeps Flower's doubling, cap and limits; it costs a few more small requests while an object
is in flight.
"""

from __future__ import annotations

PULL_BACKOFF = 0.05  # seconds before the first retry (Flower: 1)


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
