"""Flower's legacy log (`DefaultWorkflow`, the legacy `Server`, SecAgg+) kept under a DP strategy, less what epsilon
does not cover (issue 34 item 4).

Flower prints `[INIT]`, `[ROUND r]`, the node-count lines of each round, `[SUMMARY]`, `Run finished ...` and its
History. A legacy DP strategy of this package (`strategies.legacy.adapter.LegacyDPFedAvg`) puts a `FlowerLegacyLog` on the
flwr logger while it runs (from `initialize_parameters` to the end of `[SUMMARY]`, never at import):

- the node-count lines (`configure_fit: strategy sampled N clients (out of M)`, `aggregate_fit: received N results
  and M failures`, the evaluate ones, SecAgg+'s stage and status lines and its warnings and errors that count
  nodes) are withheld: how many nodes took part is not covered by epsilon;
- `[SUMMARY]`'s History is printed as published: the fit metrics the ledger covers (epsilon, delta) and the
  server's own evaluation; the app's fit metrics (its `fit_metrics_aggregation_fn`) and the clients' evaluation
  (distributed loss and metrics) stay in Flower's History object but are not printed;
- everything else passes, and one line at the end names what was withheld.

With `publish_diagnostics` Flower's log is printed whole. Either way the end of `[SUMMARY]` says which bound the
printed epsilon is where it is not the one of the accountant asked for (`run_record.bound_note`).
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from logging import INFO

from flwr.common import log
from flwr.server import History

from dpfl.strategies.loop.flower_log import listed
from dpfl.strategies.loop.wrapped import filtered_flower_log

LEGACY_SERVER_PATHS = ("/flwr/server/workflow/", "/flwr/server/server.py")
# Flower's lines that count nodes: sampled, answered and failed each round (fit and evaluate); SecAgg+'s stages
# (DEBUG), its status (whether enough nodes finished the protocol) and its warnings and errors that count nodes.
COUNT_LINES = (
    "configure_fit:",
    "aggregate_fit:",
    "configure_evaluate:",
    "aggregate_evaluate:",
    "[Stage ",
    "Secure aggregation ",
    "Insufficient available nodes",
    "The number of samples should be greater than 1",
    "Not enough shares to recover secret",
    "Number of shares in the SecAgg+ protocol",
)
COUNT_LINES_NAMED = (
    "Flower's node-count lines (configure_fit/configure_evaluate and aggregate_fit/aggregate_evaluate counts, "
    "SecAgg+'s stage and status lines)"
)
HISTORY_FORMATS = ("%s", "\t%s")  # how Flower logs each line of str(History)


def from_legacy_server(record: logging.LogRecord) -> bool:
    """Whether Flower's legacy workflows or legacy Server logged the record."""
    path = record.pathname.replace("\\", "/")
    return any(part in path for part in LEGACY_SERVER_PATHS)


def is_count_line(record: logging.LogRecord) -> bool:
    return from_legacy_server(record) and str(record.msg).startswith(COUNT_LINES)


class CountLineFilter(logging.Filter):
    """Drops Flower's legacy node-count lines (`COUNT_LINES`); every other line passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not is_count_line(record)


def quiet_workflow_logs(enabled: bool = True) -> AbstractContextManager:
    """While active (and `enabled`), Flower's legacy workflows print no node counts (`CountLineFilter`). The legacy
    strategies of this package do this themselves while they run; use it around a workflow with another strategy."""
    return filtered_flower_log(CountLineFilter(), enabled)


class FlowerLegacyLog(logging.Filter):
    """Flower's legacy log during one run: node-count lines withheld, `[SUMMARY]`'s History printed as published.

    The strategy tells it what it returned to Flower's History (`fit`, `centralized`, `distributed`); from that it
    keeps `shown`, the History less what epsilon does not cover, and prints it in place of Flower's History lines.
    """

    def __init__(self, publish_all: bool = False, closing: Callable[[], str] = str) -> None:
        self.publish_all = publish_all  # publish_diagnostics: Flower's log whole, and the closing line
        self.closing = closing  # the line said at the end of [SUMMARY] ("": none), asked for then
        self.shown = History()
        self.withheld: dict[str, dict[str, None]] = {"fit": {}, "evaluate": {}}  # ordered sets of names
        self.in_summary = False  # between "Run finished" and the blank line after the History
        self.history_printed = False

    # ------------------------------------------------------------------ what the strategy returned to History
    def fit(self, server_round: int, published: dict, unpublished: dict) -> None:
        """A round's fit metrics: `published` (the ledger's) are shown, `unpublished` (the app's) withheld."""
        self.shown.add_metrics_distributed_fit(server_round, published)
        self.withheld["fit"].update(dict.fromkeys(k for k in unpublished if k not in published))

    def centralized(self, server_round: int, loss: float, metrics: dict) -> None:
        """The server's evaluation of the released model (shown)."""
        self.shown.add_loss_centralized(server_round, loss)
        self.shown.add_metrics_centralized(server_round, metrics)

    def distributed(self, loss: float | None, metrics: dict) -> None:
        """The clients' evaluation, which Flower's History takes when there is a loss (withheld: computed on the
        clients' data, covered by nothing)."""
        if loss is not None:
            self.withheld["evaluate"].update(dict.fromkeys(["loss", *metrics]))

    # ------------------------------------------------------------------ on the flwr logger
    def install(self) -> None:
        """On the flwr logger, in place of any FlowerLegacyLog left there (by a run that raised)."""
        flower = logging.getLogger("flwr")
        flower.filters = [f for f in flower.filters if not isinstance(f, FlowerLegacyLog)] + [self]

    def uninstall(self) -> None:
        # a new list: Logger.filter may be iterating the old one (this filter removes itself from inside it)
        flower = logging.getLogger("flwr")
        flower.filters = [f for f in flower.filters if f is not self]

    def filter(self, record: logging.LogRecord) -> bool:
        if not from_legacy_server(record):
            return True
        message = str(record.msg)
        if message == "[INIT]":  # another run starts: this one ended without its [SUMMARY]
            self.uninstall()
            return True
        if is_count_line(record) and not self.publish_all:
            return False
        if message.startswith("Run finished"):
            self.in_summary = True
        elif self.in_summary and message in HISTORY_FORMATS and not self.publish_all:
            self.print_history(message)
            return False
        elif self.in_summary and message == "":  # the blank line that ends [SUMMARY]
            if not self.publish_all:
                self.print_history("%s")
                log(INFO, "%s", self.note())
            if closing := self.closing():
                log(INFO, "%s", closing)
            self.uninstall()
        return True

    def print_history(self, first_format: str) -> None:
        """The shown History, once, in Flower's format (the first line in `first_format`, the others tabbed)."""
        if self.history_printed:
            return
        self.history_printed = True
        for i, line in enumerate(io.StringIO(str(self.shown))):
            log(INFO, first_format if i == 0 else "\t%s", line.strip("\n"))

    def note(self) -> str:
        """The one line that names what the log left out, and how to print it."""
        withheld = []
        if self.withheld["fit"]:
            withheld.append(f"History's fit metrics {listed(list(self.withheld['fit']))} (fit_metrics_aggregation_fn)")
        if self.withheld["evaluate"]:
            withheld.append(
                f"the clients' evaluation (History's distributed {listed(list(self.withheld['evaluate']))})"
            )
        return (
            "Left out of Flower's lines in the log, as epsilon does not cover them: "
            f"{'; '.join([*withheld, COUNT_LINES_NAMED])}. Flower's History holds the metrics; publish_diagnostics=True "
            "prints them all"
        )
