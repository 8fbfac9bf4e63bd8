"""Flower's own output of `Strategy.start`, kept under the DP round loop (issue 34 item 4).

`FlowerLog` prints the lines that `flwr.serverapp.strategy.Strategy.start` prints without DP, in the same order
and format (the banner through Flower's own `log_strategy_start_info`, the other formats copied from Flower
1.41/1.42's strategy.py below), beside the round loop's own `Round r/R:` line. The metric records in them hold
only what the ledger covers (`strategies.loop.run_record.published_keys`) unless `publish_diagnostics` is on: the train
aggregate keeps the privacy figures, the clients' evaluation (computed on their own data, a diagnostic in the
round record too) is left out, the server's evaluation is kept. What was left out is named once, at the end of
the run; the returned Result keeps everything.
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable
from logging import INFO

from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
from flwr.common import log
from flwr.serverapp.strategy import Result
from flwr.serverapp.strategy.strategy_utils import log_strategy_start_info

from dpfl.strategies.loop.run_record import published_keys

# Flower's formats (flwr/serverapp/strategy/strategy.py, Strategy.start)
STARTING = "Starting %s strategy:"
INITIAL_EVALUATION = "Initial global evaluation results: %s"
ROUND_HEADER = "[ROUND %s/%s]"
AGGREGATED = "\t└──> Aggregated MetricRecord: %s"
GLOBAL_EVALUATION = "Global evaluation"
GLOBAL_RECORD = "\t└──> MetricRecord: %s"
STOPPED_EARLY = "Stopping early after round %s"  # Flower 1.43's should_stop
FINISHED = "Strategy execution finished in %.2fs"
FINAL_RESULTS = "Final results:"

# Flower's node-count lines of the wrapped strategy, dropped by `wrapped.quiet_flower_info`
COUNT_LINES = "configure_train/evaluate: Sampled N nodes, aggregate_train/evaluate: Received N results and M failures"


class FlowerLog:
    """What Flower's `Strategy.start` prints, for one run of `dp` (a `DPRoundLoop`); it notes what it withholds."""

    def __init__(self, dp) -> None:
        self.dp = dp
        self.withheld: dict[str, dict[str, None]] = {"train": {}, "clients' evaluation": {}}  # ordered sets
        self.started = time.time()

    def start(
        self,
        num_rounds: int,
        arrays: ArrayRecord,
        train_config: ConfigRecord | None,
        evaluate_config: ConfigRecord | None,
    ) -> None:
        """The banner: the strategy's name, Flower's start info, the strategy's summary."""
        log(INFO, STARTING, self.dp.name)
        log_strategy_start_info(num_rounds, arrays, train_config, evaluate_config)
        self.dp.summary()
        log(INFO, "")
        self.started = time.time()

    def initial_evaluation(self, evaluate_fn: Callable, arrays: ArrayRecord, result: Result) -> None:
        """`evaluate_fn(0, arrays)`, logged as Flower logs it, into `result` (round 0)."""
        res = evaluate_fn(0, arrays)
        log(INFO, INITIAL_EVALUATION, res)
        if res is not None:
            result.evaluate_metrics_serverapp[0] = res

    def round_begins(self, server_round: int, num_rounds: int) -> None:
        log(INFO, "")
        log(INFO, ROUND_HEADER, server_round, num_rounds)

    def train_aggregated(self, metrics: MetricRecord) -> None:
        log(INFO, AGGREGATED, self.covered(metrics, "train"))

    def evaluation_aggregated(self, metrics: MetricRecord) -> None:
        log(INFO, AGGREGATED, self.covered(metrics, "clients' evaluation"))

    def global_evaluation(self, evaluate_fn: Callable, server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        """`evaluate_fn(server_round, arrays)`, logged as Flower logs it."""
        log(INFO, GLOBAL_EVALUATION)
        res = evaluate_fn(server_round, arrays)
        log(INFO, GLOBAL_RECORD, res)
        return res

    def stopped_early(self, server_round: int) -> None:
        log(INFO, STOPPED_EARLY, server_round)

    def finished(self, result: Result) -> None:
        """Flower's closing lines, the Final results as the log may show them, then the withheld note (once)."""
        shown = Result(
            arrays=result.arrays,
            train_metrics_clientapp={r: self.covered(m, "train") for r, m in result.train_metrics_clientapp.items()},
            evaluate_metrics_clientapp={
                r: self.covered(m, "clients' evaluation") for r, m in result.evaluate_metrics_clientapp.items()
            },
            evaluate_metrics_serverapp=result.evaluate_metrics_serverapp,
        )
        log(INFO, "")
        log(INFO, FINISHED, time.time() - self.started)
        log(INFO, "")
        log(INFO, FINAL_RESULTS)
        log(INFO, "")
        for line in io.StringIO(str(shown)):
            log(INFO, "\t%s", line.strip("\n"))
        log(INFO, "")
        if note := withheld_note(self.withheld, self.dp.run.publish_diagnostics):
            log(INFO, "%s", note)

    def covered(self, metrics: MetricRecord, kind: str) -> MetricRecord:
        """`metrics` less what the ledger does not cover (noted under `kind`); all of it with publish_diagnostics.
        The clients' evaluation is covered by nothing."""
        if self.dp.run.publish_diagnostics:
            return metrics
        published = published_keys(self.dp) if kind == "train" else frozenset()
        self.withheld[kind].update(dict.fromkeys(k for k in metrics.keys() if k not in published))
        return MetricRecord({k: v for k, v in metrics.items() if k in published})


NOTE_NAMES = 20  # at most this many names a kind in the note: a client may send any number of metric keys


def listed(names: list[str]) -> str:
    """The first NOTE_NAMES names, comma-separated, and how many more there are."""
    more = len(names) - NOTE_NAMES
    return ", ".join(names[:NOTE_NAMES]) + (f" and {more} more" if more > 0 else "")


def withheld_note(withheld: dict[str, dict], publish_diagnostics: bool) -> str:
    """The one line that names what Flower's lines in the log left out ("" with publish_diagnostics: nothing was); a
    strategy's own log lines (a subclass's `log(INFO, ...)`) are not filtered, and may print them."""
    if publish_diagnostics:
        return ""
    named = "; ".join(f"{kind} metrics {listed(list(keys))}" for kind, keys in withheld.items() if keys)
    return (
        "Left out of Flower's lines in the log, as epsilon does not cover them: "
        f"{named + '; ' if named else ''}Flower's node-count lines ({COUNT_LINES}). The returned Result holds the "
        "metrics; publish_diagnostics=True (run config publish-diagnostics = true) prints them all"
    )
