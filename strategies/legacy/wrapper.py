"""`LegacyDifferentialPrivacy`: Flower's legacy DP wrapper signature around any legacy strategy.

    LegacyDifferentialPrivacy(FedAdam(initial_parameters=...), noise_multiplier, clipping_norm, num_sampled_clients)

takes the arguments of Flower's `DifferentialPrivacyServerSideFixedClipping`. The DP round is `LegacyDPFedAvg`'s
around a `DPFedAvg` (central noise): fixed-size sampling of m = num_sampled_clients nodes, clipping to C, the
fixed denominator m, Gaussian noise sigma C / m, the ledger. The wrapped strategy writes the clients' train config
(its own `configure_fit`: its on_fit_config_fn, FedProx's proximal_mu), sent to the wrapper's sample. It then gets
the DP average as if it were its only result, and its `aggregate_fit` (FedAdam's, FedAvgM's momentum, ...) is
post-processing of that release, costing no epsilon, as in the Message-API wrapper; a strategy whose aggregation
needs each client's update or loss (Bulyan, QFedAvg, Krum, ...) is refused when the wrapper is built. Its SecAgg+
form (clients clip and add their noise share, the server reads the secure sum) is
`strategies.legacy.secagg.SecAggPlusDifferentialPrivacy`.
"""

from __future__ import annotations

from collections.abc import Callable
from logging import INFO
from types import SimpleNamespace

import numpy as np
from flwr.common import Code, FitRes, Parameters, Status, log, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import (
    FaultTolerantFedAvg,
    FedAdagrad,
    FedAdam,
    FedAvg,
    FedAvgM,
    FedProx,
    FedYogi,
    Strategy,
)

from dpfl.strategies.dp_fedavg import DPFedAvg
from dpfl.strategies.legacy.adapter import LegacyDPFedAvg
from dpfl.strategies.loop.options import refuse_more_than_connected

# Flower's strategies whose aggregate_fit, given the DP average as its only result, is a server step on it (or, for
# FaultTolerantFedAvg, the average itself: its completion-rate check sees one result and no failure)
WRAPPABLE = (FedAvg, FedProx, FedAdam, FedYogi, FedAdagrad, FedAvgM, FaultTolerantFedAvg)
REPLACED = "aggregate_fit"  # the aggregation of the clients' results that the DP average replaces


def check_wrappable(strategy) -> None:
    """Refuses a strategy whose aggregation the wrapper cannot privatize: its class must be one of `WRAPPABLE` or
    derive from one, and no class on the way there may override `aggregate_fit` (Flower's Bulyan, QFedAvg, Krum,
    FedMedian, ..., or an app's own, aggregate each client's update or loss, which the wrapper replaces by the DP
    average)."""
    mro = type(strategy).__mro__
    allowed = next((c for c in mro if c in WRAPPABLE), None)
    overriding = next((c for c in mro[: mro.index(allowed)] if REPLACED in vars(c)), None) if allowed else None
    if allowed is not None and overriding is None:
        return
    name = type(strategy).__name__
    flower = next((c for c in mro if c.__module__.split(".")[0] == "flwr"), None)
    kind = f" (a subclass of Flower's {flower.__name__})" if flower not in (None, type(strategy)) else ""
    why = f"{overriding.__name__}.{REPLACED} overrides {allowed.__name__}'s aggregation; " if overriding else ""
    raise TypeError(
        f"LegacyDifferentialPrivacy cannot wrap {name}{kind}: {why}the wrapper hands the strategy's {REPLACED} one "
        "result, the DP average, and only a server step on that average is post-processing the ledger covers; an "
        "aggregation that needs each client's update or loss (Bulyan, QFedAvg, Krum, FedMedian, ...) cannot be "
        f"privatized this way. Allowed: {', '.join(c.__name__ for c in WRAPPABLE)}, or a subclass of one of them "
        f"that does not override {REPLACED}"
    )


class StandInClients:
    """Just enough of a ClientManager for a wrapped strategy's configure_fit to write its FitIns: the connected count,
    and as many stand-in clients as it asks for (at least one); it never waits and draws no random numbers."""

    def __init__(self, available: int) -> None:
        self.available = available

    def num_available(self) -> int:
        return self.available

    def wait_for(self, num_clients: int, timeout: int = 0) -> bool:
        return True

    def sample(self, num_clients: int, min_num_clients: int | None = None, criterion=None) -> list:
        return [SimpleNamespace(cid=str(i), node_id=i) for i in range(1, max(1, int(num_clients)) + 1)]

    def all(self) -> dict:
        return {client.cid: client for client in self.sample(self.available)}


def no_fit_metrics(_: list) -> dict:
    """The wrapped strategy's fit-metrics function while it aggregates the DP average, which no client sent."""
    return {}


class LegacyDifferentialPrivacy(LegacyDPFedAvg):
    """Client-level DP (central noise) around any `flwr.server.strategy.Strategy`, in Flower's signature.

    Parameters
    ----------
    strategy : the app's legacy strategy (FedAvg, FedProx, FedAdam, FedYogi, FedAdagrad, FedAvgM,
        FaultTolerantFedAvg or a subclass that keeps their aggregate_fit; others are refused, `check_wrappable`).
        Its configure_fit writes the train config (its on_fit_config_fn, FedProx's proximal_mu; the DP keys win on a
        clash); its initial_parameters, evaluate_fn, on_evaluate_config_fn, fraction_evaluate, min_evaluate_clients
        and evaluate_metrics_aggregation_fn are used as they are; its min_available_clients is the number of nodes to wait for. Its fit_metrics_aggregation_fn
        gets the (num_examples, metrics) of the replies the round accepted (never the DP average); what it returns
        is added to the round's fit metrics (Flower's History, not printed unless publish_diagnostics), outside
        what epsilon covers; if it raises, the round goes on without them.
    noise_multiplier, clipping_norm : sigma and C.
    num_sampled_clients : m, the clients sampled each round (fixed-size sampling, as the ledger accounts it).
        Fewer than m nodes connected at round 1 is refused with an error naming both.
    num_rounds : the number of rounds, for the log's `Round r/R` (Flower's ServerConfig does not tell the strategy;
        without it the log reads `Round r`) and for target_epsilon_mode='calibrate'.
    aggregation : how the workflow's results carry the updates (`strategies.legacy.adapter.LegacyDPFedAvg`).
    dp_keywords : further DPFedAvg settings (delta, accountant, target_epsilon, seed, publish_diagnostics, ...).

    The wrapper samples the clients itself, so the strategy's fraction_fit and min_fit_clients are not used
    (said once in the log).
    """

    def __init__(
        self,
        strategy: Strategy,
        noise_multiplier: float,
        clipping_norm: float,
        num_sampled_clients: int,
        *,
        num_rounds: int = 0,
        aggregation=None,
        **dp_keywords,
    ) -> None:
        if int(num_sampled_clients) < 1:
            raise ValueError(f"num_sampled_clients={num_sampled_clients!r} must be >= 1")
        check_wrappable(strategy)
        dp = DPFedAvg(
            noise_multiplier=noise_multiplier,
            clipping_norm=clipping_norm,
            sample_rate=1.0,  # m / M once the population is known (node_counter)
            client_sampling="fixed",
            min_available_nodes=int(getattr(strategy, "min_available_clients", 2)),
            **dp_keywords,
        )
        super().__init__(
            dp,
            evaluate_fn=getattr(strategy, "evaluate_fn", None),
            on_evaluate_config_fn=getattr(strategy, "on_evaluate_config_fn", None),
            evaluate_metrics_aggregation_fn=getattr(strategy, "evaluate_metrics_aggregation_fn", None),
            fit_metrics_aggregation_fn=getattr(strategy, "fit_metrics_aggregation_fn", None),
            initial_parameters=getattr(strategy, "initial_parameters", None),
            num_rounds=num_rounds,
            aggregation=aggregation,
        )
        self.fraction_evaluate = getattr(strategy, "fraction_evaluate", self.fraction_evaluate)
        self.min_evaluate_clients = getattr(strategy, "min_evaluate_clients", self.min_evaluate_clients)
        self.strategy = strategy
        self.num_sampled_clients = int(num_sampled_clients)
        log(
            INFO,
            "LegacyDifferentialPrivacy samples %d clients a round itself (fixed-size, as the ledger accounts it): "
            "%s's fraction_fit=%s and min_fit_clients=%s are not used",
            self.num_sampled_clients,
            type(strategy).__name__,
            getattr(strategy, "fraction_fit", None),
            getattr(strategy, "min_fit_clients", None),
        )

    def __repr__(self) -> str:
        return f"LegacyDifferentialPrivacy({self.strategy!r}, num_sampled_clients={self.num_sampled_clients})"

    def node_counter(self, client_manager: ClientManager) -> Callable[[], int]:
        """Counts the nodes and sets q = m / M (fixed-size sampling of m); m > M is refused (`refuse_more_than_connected`)."""

        def count() -> int:
            available = client_manager.num_available()
            if available >= self.dp.population.min_available_nodes:  # the population is fixed now (ensure_population)
                refuse_more_than_connected(self.num_sampled_clients, available, self.dp.population.min_available_nodes)
            self.dp.population.sample_rate = min(1.0, self.num_sampled_clients / max(1, available))
            return available

        return count

    def fit_config(self, server_round: int, parameters: Parameters, client_manager: ClientManager) -> dict:
        """The wrapped strategy's own train config of the round: its configure_fit over `StandInClients` (its
        sampling is not used), the first instruction's FitIns config ({} if it gives none)."""
        instructions = self.strategy.configure_fit(
            server_round, parameters, StandInClients(client_manager.num_available())
        )
        return dict(instructions[0][1].config) if instructions else {}

    def aggregate_updates(
        self, server_round: int, results: list[tuple[ClientProxy, FitRes]], failures: list
    ) -> tuple[list[np.ndarray], dict, list]:
        """The DP average, then the wrapped strategy's server step on it (post-processing)."""
        dp_average, metrics, accepted = super().aggregate_updates(server_round, results, failures)
        return self.server_step(server_round, dp_average), metrics, accepted

    def server_step(self, server_round: int, dp_average: list[np.ndarray]) -> list[np.ndarray]:
        """The wrapped strategy's aggregate_fit with the DP average as its only result (weight 1), in the DP
        average's dtypes; the DP average itself if the strategy returns nothing."""
        only = FitRes(Status(Code.OK, ""), ndarrays_to_parameters(dp_average), 1, {})
        own_fn = getattr(self.strategy, "fit_metrics_aggregation_fn", None)
        if own_fn is not None:
            self.strategy.fit_metrics_aggregation_fn = no_fit_metrics
        try:
            parameters, _ = self.strategy.aggregate_fit(server_round, [(None, only)], [])
        finally:
            if own_fn is not None:
                self.strategy.fit_metrics_aggregation_fn = own_fn
        if parameters is None:
            return dp_average
        stepped = parameters_to_ndarrays(parameters)
        return [np.asarray(a, dtype=d.dtype) for a, d in zip(stepped, dp_average)]
