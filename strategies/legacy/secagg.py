"""SecAgg+ for the client-level DP strategies: the server sees only the sum of the noisy updates
(docs/algorithms.md §0; Flower's SecAgg+ exists on its legacy API only).

Under Flower's SecAgg+ (`DPSecAggPlusWorkflow`) the legacy strategy never sees an individual update:
every result carries the same vector, the weighted mean sum_i(w_i x_i) / sum_i(w_i) of the k
clients that finished the protocol. Clients report weight w_i = 1 (`clients.mods`), so the mean
is uniform and sum = k * mean; that sum goes through the wrapped strategy's noisy average step,
which tops the noise up for the n_s - k shares that did not arrive. `SecureSum` is that reading,
the one piece both SecAgg+ strategies are composed with: `SecAggPlusDPFedAvg` (the legacy adapter
`strategies.legacy.adapter.LegacyDPFedAvg` around a DPFedAvg) and `SecAggPlusDifferentialPrivacy` (Flower's
legacy DP wrapper signature around any legacy strategy, `strategies.legacy.wrapper`).

SecAgg+ quantizes each upload x to integers after clipping every coordinate to [-R, R].
`secagg_clipping_range` picks R = C + z s (s = noise-share std, z from a union bound over
all coordinates of all clients) so that the quantizer clips nothing except with
probability `failure_probability` per round: a clipped coordinate would change the sum
nonlinearly and void the accounting of the sum as one Gaussian release, so the ledger reserves that
probability out of delta every round (`SecureAggregation.failure_probability`), as it does the truncation
probability: epsilon is the accountant's at delta - sum over rounds of (truncation + quantizer clip).
"""

from __future__ import annotations

import math
from logging import INFO
from statistics import NormalDist

import numpy as np
from flwr.app import Context
from flwr.common import log, parameters_to_ndarrays
from flwr.compat.common import recorddict_compat as compat
from flwr.server.strategy import Strategy
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_PARAMS_RECORD
from flwr.serverapp import Grid

from dpfl.dpcore.privacy import protocol as keys
from dpfl.dpcore.privacy.mechanisms import flatten, l2_norm, unflatten, update_problem
from dpfl.dpcore.privacy.settings import check_secure_aggregation
from dpfl.strategies.dp_fedavg import DPFedAvg, extra_updates
from dpfl.strategies.legacy.adapter import LegacyDPFedAvg, LegacyEvaluateFn
from dpfl.strategies.legacy.wrapper import LegacyDifferentialPrivacy
from dpfl.strategies.loop.reply_gate import node_problem, note_problem
from dpfl.strategies.parts.part import sees_only_the_sum
from dpfl.strategies.parts.reply_rules import upload_norm_bound
from dpfl.strategies.parts.secure_aggregation import SecureAggregation

SECAGG_MODULUS_RANGE = 2**32  # Flower's default and maximum
SECAGG_QUANTIZATION_RANGE = 2**22  # Flower's default: precision 2R / 2^22 per coordinate
SECAGG_FIT_METRICS_NOTE = (
    "Under SecAgg+ the server sees only the sum: the clients' fit metrics are not sent (dp_privatize_mod replies "
    "with weight 1 and no metrics), and the round's fit metrics are the ledger's (epsilon, delta) only"
)
SECAGG_APP_FIT_METRICS_NOTE = (
    "Under SecAgg+ the server sees only the sum: dp_privatize_mod replies with weight 1 and no fit metrics, so the "
    "app's fit_metrics_aggregation_fn is not called and the round's fit metrics are the ledger's (epsilon, delta). "
    "To pass the clients' fit metrics through knowingly, build the clients' mod with "
    "make_dp_privatize_mod(send_fit_metrics=True): they then travel in plaintext beside the secure sum (weight 1 "
    "each), outside SecAgg+'s and epsilon's guarantee, and reach the app's function and Flower's History (the log "
    "prints them only with publish_diagnostics=True)"
)


def secagg_fit_metrics_note(strategy) -> str:
    """What happens to the fit metrics under SecAgg+ (said once, by DPSecAggPlusWorkflow): the app's, if it has a
    fit_metrics_aggregation_fn."""
    return SECAGG_FIT_METRICS_NOTE if strategy.fit_metrics_aggregation_fn is None else SECAGG_APP_FIT_METRICS_NOTE


def secagg_clipping_range(
    clipping_norm: float, noise_std: float, dim: int, clients: int, failure_probability: float = 1e-9
) -> float:
    """R = C + z s with 2 * dim * clients * P(N(0,1) > z) = failure_probability.

    A clipped update has |Delta_j| <= ||Delta||_2 <= C in every coordinate, and its noise
    share is N(0, s^2), so by a union bound no coordinate of any client exceeds R except
    with the given probability.
    """
    if clipping_norm <= 0:
        raise ValueError(
            f"clipping_norm={clipping_norm!r} must be > 0 under SecAgg+: the quantizer needs bounded updates"
        )
    tail = failure_probability / (2.0 * max(1, dim) * max(1, clients))
    return float(clipping_norm + NormalDist().inv_cdf(1.0 - tail) * noise_std)


def secagg_quantization_range(clients: int, modulus_range: int = SECAGG_MODULUS_RANGE) -> int:
    """Levels per coordinate such that the sum over `clients` cannot overflow the modulus (2^32 by default)."""
    return int(min(SECAGG_QUANTIZATION_RANGE, (modulus_range - 1) // max(2, clients)))


class SecureSum:
    """How SecAgg+ hands over the updates (`LegacyDPFedAvg.aggregation`): every result carries the same mean of the
    k uploads that finished the protocol, each of weight 1, so sum = k * mean; the sum is checked against what k
    honest noisy updates can produce (`sum_bound`) and goes through the wrapped strategy's noisy average step,
    which divides by the fixed denominator and tops the noise up for the n_s - k shares that did not arrive.
    `settings` are DPSecAggPlusWorkflow's, set at each round; without them a round is refused before it samples."""

    secure = True

    def __init__(self) -> None:
        self.settings: dict = {}
        self.failures: list = []  # the round's SecAgg+ failures (DPSecAggPlusWorkflow.setup_stage), read if it halts

    def check_round(self) -> None:
        """Refused under any fit workflow but DPSecAggPlusWorkflow (it sets the quantizer the accounting needs)."""
        if not self.settings:
            raise ValueError(
                "this strategy runs under DPSecAggPlusWorkflow: in DefaultWorkflow(fit_workflow=...), replace "
                "SecAggPlusWorkflow(...) with DPSecAggPlusWorkflow(...) from dpfl (the same arguments)"
            )

    def describe(self) -> dict:
        return {"secagg": self.settings}

    def aggregate(
        self, dp: DPFedAvg, global_arrays: list[np.ndarray], server_round: int, results: list, failures: list
    ) -> tuple[list[np.ndarray], dict, list]:
        """(new global arrays, round metrics, the results accepted: all or none) from SecAgg+'s results: sum = k * mean,
        its nodes and its norm checked."""
        shapes = [a.shape for a in global_arrays]
        weights = {res.num_examples for _, res in results}
        k = len(results)
        updates: list[np.ndarray] = []
        problem = "no client finished the protocol" if k == 0 else self.nodes_problem(dp, results)
        if problem is None and len(weights) > 1:
            problem = (
                f"updates with different weights {sorted(weights)}: the sum of a weighted mean cannot be "
                "recovered; clients must report num_examples = 1 (dpfl.uniform_weight_mod and "
                "dp_privatize_mod do)"
            )
        if problem is None:
            try:
                mean = parameters_to_ndarrays(results[0][1].parameters)
                problem = update_problem(mean, shapes)
            except Exception as exc:  # undecodable sum
                problem = f"undecodable sum ({type(exc).__name__}: {exc})"
            if problem is None:
                total = (flatten(mean).astype(np.float64) * k).astype(np.float32)
                problem = self.sum_problem(dp, total, k)
            if problem is None:
                updates = [total]
        if problem:
            note_problem(dp, server_round, f"rejected the secure sum of {k} updates: {problem}")
        extra = extra_updates(dp, server_round, sum(a.size for a in global_arrays))
        new_global = dp.noisy_average_step(
            server_round, updates + extra, flatten(global_arrays), received=k if updates else 0
        )
        metrics = {
            "clients": k if updates else 0,
            "rejected": 0 if updates else k,
            "failures": len(failures),
            "server_noise_std": dp.round.server_noise_std,
            **dp.privacy_metrics(),
        }
        return unflatten(new_global, shapes), metrics, list(results) if updates else []

    def nodes_problem(self, dp: DPFedAvg, results: list) -> str | None:
        """Why the sum cannot be read as the round's sampled clients' (the reply gate's check of each result's
        node, `reply_gate.node_problem`): a node counted twice, or one the round did not sample (its upload is in
        the sum and cannot be taken out), else None."""
        seen: set[int] = set()
        for proxy, _ in results:
            node = getattr(proxy, "node_id", None)
            if not isinstance(node, int):
                return f"a result without a node id ({node!r})"
            if problem := node_problem(dp.round, node, seen):
                return f"node {node}: {problem}"
            seen.add(node)
        return None

    def sum_bound(self, dp: DPFedAvg, k: int, dim: int) -> float:
        """The norm an honest sum of k uploads exceeds with probability <= 1e-12: each clipped update is at
        most C and the k noise shares sum to N(0, k s^2 I) (`reply_gate.upload_norm_bound` at k C and
        sqrt(k) s), plus SecAgg+'s quantization error (at most one step per coordinate per client)."""
        share_std = float(dp.client_train_config(0)[keys.NOISE_STD])
        step = float(self.settings.get("quantization_step", 0.0))
        quantization = k * step * math.sqrt(dim)
        return upload_norm_bound(k * dp.privacy.clipping_norm, math.sqrt(k) * share_std, dim) + quantization

    def sum_problem(self, dp: DPFedAvg, total: np.ndarray, k: int) -> str | None:
        """Why an unmasked sum is refused: above what k honest clients can produce (`sum_bound`)."""
        if dp.privacy.clipping_norm <= 0:
            return None
        bound, norm = self.sum_bound(dp, k, total.size), l2_norm(total)
        return f"sum norm {norm:.6g} above the bound {bound:.6g} of {k} honest noisy updates" if norm > bound else None


def secure_sum_for(dp: DPFedAvg) -> SecureSum:
    """A SecureSum for `dp`, which must add its noise in client shares (distributed) with C > 0; `dp` is composed
    with `SecureAggregation` (the server sees only the sum) if it is not yet."""
    check_secure_aggregation(dp.noise.name, dp.privacy.clipping_norm)
    if dp.ledger is not None and not sees_only_the_sum(dp):
        raise ValueError(
            "build the strategy with secure_aggregation=True, or wrap it before the first round "
            "(its ledger already exists)"
        )
    if not sees_only_the_sum(dp):  # the server-side figure: the server sees only the sum
        dp.add_part(SecureAggregation())
    return SecureSum()


class SecAggPlusDPFedAvg(LegacyDPFedAvg):
    """A client-level DP strategy (`dp`, distributed noise) whose updates are summed by SecAgg+: LegacyDPFedAvg
    composed with `SecureSum`.

    Parameters
    ----------
    dp : the DPFedAvg (or subclass) that does all the DP work; needs noise_placement = "distributed".
    workflow : the `DPSecAggPlusWorkflow` that `start` runs (it holds the SecAgg+ settings); default
        DPSecAggPlusWorkflow(). In a ServerApp of your own, pass yours to DefaultWorkflow(fit_workflow=...).
    evaluate_fn, on_fit_config_fn, initial_parameters, num_rounds : as in LegacyDPFedAvg.
    """

    def __init__(
        self,
        dp: DPFedAvg,
        *,
        workflow: DPSecAggPlusWorkflow | None = None,
        evaluate_fn: LegacyEvaluateFn | None = None,
        on_fit_config_fn=None,
        initial_parameters=None,
        num_rounds: int = 0,
    ) -> None:
        super().__init__(
            dp,
            evaluate_fn=evaluate_fn,
            on_fit_config_fn=on_fit_config_fn,
            initial_parameters=initial_parameters,
            num_rounds=num_rounds,
            aggregation=secure_sum_for(dp),
        )
        self.workflow = workflow

    def __repr__(self) -> str:
        return f"SecAggPlusDPFedAvg({self.dp.name})"

    @property
    def secagg_settings(self) -> dict:
        """DPSecAggPlusWorkflow's settings of the last round."""
        return self.aggregation.settings

    def fit_workflow(self, timeout: float | None) -> SecAggPlusWorkflow:
        """The given workflow (its own timeout, else `timeout`), or DPSecAggPlusWorkflow(timeout=timeout). `start`
        runs the project's own ClientApp, which has no app fit metrics: the workflow's note on them is not given."""
        workflow = self.workflow or DPSecAggPlusWorkflow()
        if workflow.timeout is None:
            workflow.timeout = timeout
        workflow.metrics_said = True
        return workflow


class SecAggPlusDifferentialPrivacy(LegacyDifferentialPrivacy):
    """`LegacyDifferentialPrivacy` under SecAgg+, in Flower's signature: where an app runs Flower's
    `DifferentialPrivacyClientSideFixedClipping` under `SecAggPlusWorkflow` with `fixedclipping_mod`,

        SecAggPlusDifferentialPrivacy(strategy, noise_multiplier, clipping_norm, num_sampled_clients)

    under `DPSecAggPlusWorkflow` with `dp_privatize_mod`. Each sampled client clips its update to C and adds its
    noise share (distributed noise); the server sees only their sum, which `SecureSum` reads; the ledger charges
    fixed-size sampling of m = num_sampled_clients as LegacyDifferentialPrivacy does; the app's strategy then takes
    its server step on the DP average (post-processing). Further keywords as in LegacyDifferentialPrivacy. Under
    any other fit workflow it refuses round 1 before any client trains (without SecAgg+, use
    LegacyDifferentialPrivacy)."""

    def __init__(
        self, strategy: Strategy, noise_multiplier: float, clipping_norm: float, num_sampled_clients: int, **keywords
    ) -> None:
        super().__init__(
            strategy,
            noise_multiplier,
            clipping_norm,
            num_sampled_clients,
            aggregation=SecureSum(),
            **{"noise_placement": "distributed", "secure_aggregation": True, **keywords},  # the part checks both
        )

    def __repr__(self) -> str:
        return f"SecAggPlusDifferentialPrivacy({self.strategy!r}, num_sampled_clients={self.num_sampled_clients})"


class DPSecAggPlusWorkflow(SecAggPlusWorkflow):
    """Flower's SecAgg+ set up for a strategy that reads its sum (`SecureSum`: SecAggPlusDifferentialPrivacy,
    SecAggPlusDPFedAvg), with `SecAggPlusWorkflow`'s arguments: uniform weights
    (max_weight = 1: the DP mods send weight 1) and a quantizer range R that the noisy updates do not reach
    (`secagg_clipping_range`) with as many levels as the modulus allows (`secagg_quantization_range`), both
    recomputed every round; a max_weight, clipping_range or quantization_range given is replaced (said once in
    the log). R is exceeded with probability at most `failure_probability` a round, which the strategy's ledger
    reserves out of delta every round. It is the one owner of the SecAgg+ settings; the number of rounds comes
    from the ServerConfig."""

    def __init__(
        self,
        num_shares: int | float = 1.0,
        reconstruction_threshold: int | float = 0.5,
        *,
        max_weight: float | None = None,
        clipping_range: float | None = None,
        quantization_range: int | None = None,
        modulus_range: int = SECAGG_MODULUS_RANGE,
        timeout: float | None = None,
        failure_probability: float = 1e-9,
    ) -> None:
        super().__init__(
            num_shares, reconstruction_threshold, max_weight=1.0, modulus_range=modulus_range, timeout=timeout
        )
        if not 0 < failure_probability < 1:
            raise ValueError(
                f"failure_probability={failure_probability!r} must be in (0, 1): the probability per round that "
                "SecAgg+'s quantizer clips a coordinate, reserved out of delta"
            )
        self.failure_probability = failure_probability
        given = {"max_weight": max_weight, "clipping_range": clipping_range, "quantization_range": quantization_range}
        replaced = {k: v for k, v in given.items() if v is not None}
        if replaced:
            log(
                INFO,
                "DPSecAggPlusWorkflow: %s replaced: max_weight is 1 (the DP mods send weight 1) and the quantizer's "
                "clipping_range and quantization_range are set each round from C, the noise and the population",
                ", ".join(f"{k}={v}" for k, v in replaced.items()),
            )
        self.metrics_said = False

    def __call__(self, grid: Grid, context: Context) -> None:
        strategy = getattr(context, "strategy", None)
        secure_sum = getattr(strategy, "aggregation", None)
        if not isinstance(secure_sum, SecureSum):  # before round 1 samples
            raise TypeError(
                f"DPSecAggPlusWorkflow needs a strategy that reads SecAgg+'s sum, not {type(strategy).__name__} (under "
                "SecAgg+ the server cannot clip or noise single updates): SecAggPlusDifferentialPrivacy in place of "
                "LegacyDifferentialPrivacy or Flower's DifferentialPrivacyClientSideFixedClipping (the same "
                "arguments), or SecAggPlusDPFedAvg(DPFedAvg(noise_placement='distributed', ...)) in place of "
                "LegacyDPFedAvg (all from dpfl)"
            )
        dp = strategy.dp
        for part in dp.parts:  # the ledger reserves the quantizer's clip probability out of delta, every round
            if isinstance(part, SecureAggregation):
                part.quantizer_clip_probability = self.failure_probability
        if dp.record.num_rounds <= 0:  # the ServerConfig's, unless the strategy was given num_rounds
            dp.record.num_rounds = int(context.config.num_rounds)
        strategy.ensure_population(context.client_manager)
        if not self.metrics_said:
            self.metrics_said = True
            log(INFO, "%s", secagg_fit_metrics_note(strategy))
        parameters = compat.arrayrecord_to_parameters(context.state.array_records[MAIN_PARAMS_RECORD], keep_input=True)
        dim = sum(a.size for a in parameters_to_ndarrays(parameters))
        clients = max(2, dp.population.num_clients)
        noise_std = float(dp.client_train_config(0)[keys.NOISE_STD])
        self.clipping_range = secagg_clipping_range(
            dp.privacy.clipping_norm, noise_std, dim, clients, self.failure_probability
        )
        self.quantization_range = secagg_quantization_range(clients, self.modulus_range)
        secure_sum.settings = {
            "num_shares": self.num_shares,
            "reconstruction_threshold": self.reconstruction_threshold,
            "max_weight": self.max_weight,
            "clipping_range": self.clipping_range,
            "quantization_range": self.quantization_range,
            "modulus_range": self.modulus_range,
            "quantization_step": 2 * self.clipping_range / self.quantization_range,
            "quantizer_clip_probability_bound": self.failure_probability,
        }
        super().__call__(grid, context)

    def setup_stage(self, grid: Grid, context: Context, state) -> bool:
        """Flower's setup stage, the round's first; the list every stage adds the round's failures to is handed to
        the strategy's SecureSum, which reads it where SecAgg+ halts (that round never reaches aggregate_fit)."""
        context.strategy.aggregation.failures = state.failures
        return super().setup_stage(grid, context, state)
