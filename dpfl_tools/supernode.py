"""`flower-supernode` with a shorter idle poll, for small federations where a round's wall time matters.

    python -m dpfl_tools.supernode [--idle-poll 0.2] <flower-supernode arguments...>

Flower 1.41's SuperNode loop (`flwr/supernode/start_client_internal.py`) sleeps 3 s whenever it asks the
SuperLink for a message and finds none, and checks every 0.5 s whether its ClientApp has replied; neither
has an option. After each reply a node finds nothing yet and sleeps, so every message exchange costs about
3.5 s however short its task (SecAgg+ has four exchanges a round). This wrapper runs Flower's own
`flower-supernode` entry point, unchanged but for those sleeps: the idle one capped at `--idle-poll`
seconds, the 0.5 s checks of the node's own memory at 0.02 s (they ask no one); and the first retry for a
message's objects the ServerApp is still pushing (Flower: 1 s; `--pull-backoff`, `dpfl_tools.pull_backoff`).

The price is load on the SuperLink: each idle node asks 1 / idle-poll times a second instead of once every
3 s. For a few nodes (a lab, loopback, a benchmark) that is nothing; for hundreds of nodes keep Flower's
`flower-supernode`. The wrapper refuses to start on a Flower whose SuperNode loop it does not recognise,
rather than silently changing nothing.
"""

from __future__ import annotations

import argparse
import inspect
import sys
import time

from dpfl_tools.pull_backoff import PULL_BACKOFF, flower_patch_problem, pull_backoff_option, shorten_pull_backoff

FLOWER_IDLE_SLEEP = 3  # s: after asking the SuperLink for a message and finding none
FLOWER_LOCAL_WAIT = 0.5  # s: waits that only look at the node's own memory (reply in? objects in?)
FLOWER_IDLE_SLEEPS = (
    f"time.sleep({FLOWER_IDLE_SLEEP})",
    f"time.sleep({FLOWER_LOCAL_WAIT})",
)  # as Flower 1.41 writes them
LOCAL_WAIT_CAP = 0.02  # s: what the FLOWER_LOCAL_WAIT waits become


class CappedSleep:
    """Stands in for the `time` module inside Flower's SuperNode loop: its idle sleep (3 s, before the next
    request to the SuperLink) sleeps at most `cap`; its other waits (0.5 s: has the ClientApp replied, are the
    reply's objects in the node's store? in-memory checks, no request) at most min(cap, LOCAL_WAIT_CAP).
    Every other attribute is the real `time` module's."""

    def __init__(self, cap: float) -> None:
        self.cap = cap

    def sleep(self, seconds: float) -> None:
        limit = self.cap if seconds >= FLOWER_IDLE_SLEEP else min(self.cap, LOCAL_WAIT_CAP)
        time.sleep(min(seconds, limit))

    def __getattr__(self, name: str):
        return getattr(time, name)


def shorten_idle_sleeps(cap: float):
    """Cap the sleeps of Flower's SuperNode loop at `cap` seconds; returns the patched module. Raises
    RuntimeError where the installed Flower's loop is not the one this wrapper knows."""
    import flwr
    from flwr.supernode import start_client_internal as loop

    source = inspect.getsource(loop)
    if getattr(loop, "time", None) is not time or not all(s in source for s in FLOWER_IDLE_SLEEPS):
        raise RuntimeError(
            f"flwr {flwr.__version__}: its SuperNode loop is not the one dpfl_tools.supernode knows "
            f"(module-level `time` with {' and '.join(FLOWER_IDLE_SLEEPS)}); run flower-supernode"
        )
    loop.time = CappedSleep(cap)
    return loop


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--idle-poll",
        type=float,
        default=0.2,
        help="seconds between a SuperNode's requests for a message when idle (Flower: 3); its "
        f"in-memory waits for a reply (Flower: 0.5 s) are capped at {LOCAL_WAIT_CAP} s",
    )
    parser.add_argument(
        "--pull-backoff",
        type=pull_backoff_option,
        default=PULL_BACKOFF,
        help="seconds before the first retry for a message's objects not yet on the SuperLink (Flower: 1)",
    )
    args, flower_args = parser.parse_known_args(argv)
    if not 0.01 <= args.idle_poll <= 3:
        parser.error(f"--idle-poll = {args.idle_poll}: must be between 0.01 and 3 seconds")
    from flwr.supernode.cli import flower_supernode

    problem = flower_patch_problem()
    if problem is None:
        try:
            shorten_idle_sleeps(args.idle_poll)
        except RuntimeError as error:
            problem = f"{error}: Flower's stock behaviour is kept"
    if problem:
        print(f"dpfl_tools.supernode: {problem}", flush=True)
    else:
        backoff = (
            f"object pulls retried after {args.pull_backoff} s"
            if shorten_pull_backoff(args.pull_backoff)
            else "Flower's object pull backoff (this flwr has no default to set)"
        )
        print(
            f"dpfl_tools.supernode: Flower's SuperNode with its idle sleeps capped at {args.idle_poll} s; {backoff}",
            flush=True,
        )
    sys.argv = ["flower-supernode", *flower_args]
    flower_supernode()


if __name__ == "__main__":
    main()
