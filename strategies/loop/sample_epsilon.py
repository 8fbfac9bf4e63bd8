"""The server's view of clients' own sample-level ledgers (`clients.opacus_ledger`): the largest epsilon.

Each client's train reply carries its cumulative `sample-epsilon` at `sample-delta`; a run's sample-level
guarantee is the weakest client's, so the server shows the maximum over the clients that reported this round,
in the log and in the round's aggregated train metrics (Flower's History and Result). The figure is what the
clients say of themselves: the server cannot check it (each client's privacy is its own to keep).

    FedAvg(..., fit_metrics_aggregation_fn=max_sample_epsilon)        # legacy API
    FedAvg(..., train_metrics_aggr_fn=max_sample_epsilon_records)     # Message API
    with_max_sample_epsilon(weighted_average)                         # keep your own legacy aggregation too
"""

from __future__ import annotations

import math
from collections.abc import Callable
from logging import INFO

from flwr.app import MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords

from dpfl.dpcore.privacy import protocol as keys

SAMPLE_KEYS = (keys.SAMPLE_EPSILON, keys.SAMPLE_DELTA, keys.SAMPLE_STEPS, keys.SAMPLE_ACCOUNTANT)
MAX_KEY = "sample-epsilon-max"


def _reported(metrics: list[dict]) -> list[tuple[float, float]]:
    """(epsilon, delta) of each reply that reports a finite, non-negative pair."""
    pairs = []
    for m in metrics:
        eps, delta = m.get(keys.SAMPLE_EPSILON), m.get(keys.SAMPLE_DELTA)
        if isinstance(eps, (int, float)) and isinstance(delta, (int, float)) and not isinstance(eps, bool):
            if 0 <= eps and not math.isnan(eps) and 0 < delta < 1:
                pairs.append((float(eps), float(delta)))
    return pairs


def sample_epsilon_summary(metrics: list[dict], announce: bool = True) -> dict:
    """{'sample-epsilon-max', 'sample-delta'} over the replies (the largest delta any of them used); {} if none
    reported, and (`announce`) a log line."""
    pairs = _reported(metrics)
    if not pairs:
        return {}
    eps, delta = max(e for e, _ in pairs), max(d for _, d in pairs)
    if announce:
        log(
            INFO,
            "Sample-level DP: epsilon = %.4g at delta = %g (the largest of %d clients' ledgers)",
            eps,
            delta,
            len(pairs),
        )
    return {MAX_KEY: eps, keys.SAMPLE_DELTA: delta}


def with_max_sample_epsilon(aggregate: Callable | None = None) -> Callable:
    """A legacy `fit_metrics_aggregation_fn`: `aggregate` (yours, or none) over the clients' other metrics, plus
    the largest sample-level epsilon."""

    def fit_metrics_aggregation_fn(results: list[tuple[int, dict]]) -> dict:
        own = [(n, {k: v for k, v in m.items() if k not in SAMPLE_KEYS}) for n, m in results]
        return {**(aggregate(own) if aggregate else {}), **sample_epsilon_summary([m for _, m in results])}

    return fit_metrics_aggregation_fn


max_sample_epsilon = with_max_sample_epsilon()


def max_sample_epsilon_records(records: list[RecordDict], weighting_key: str) -> MetricRecord:
    """A Message-API `train_metrics_aggr_fn`: Flower's weighted average of the other metrics, plus the largest
    sample-level epsilon (an average of epsilons would understate the weakest client's)."""
    metrics = [dict(r) for record in records for r in record.metric_records.values()]
    others = [
        RecordDict({name: MetricRecord({k: v for k, v in r.items() if k not in SAMPLE_KEYS})})
        for record in records
        for name, r in record.metric_records.items()
    ]
    return MetricRecord({**dict(aggregate_metricrecords(others, weighting_key)), **sample_epsilon_summary(metrics)})
