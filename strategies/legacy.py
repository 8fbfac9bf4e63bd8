"""Legacy-API (`flwr.server.strategy`) form of the client-level DP strategies, and SecAgg+.

`LegacyDPFedAvg` wraps a Message-API `DPFedAvg` (or a subclass) by delegation: sampling, the
train config, rejection of malformed updates, central clipping, noise and its top-up, the
fixed denominator m, the server learning rate and the privacy ledger are the wrapped
strategy's own code. This class only translates FitIns/FitRes <-> Messages, so the legacy
and the Message-API strategies cannot drift apart.

With `secure_aggregation=True` it runs under Flower's SecAgg+ (`DPSecAggPlusWorkflow`).
`aggregate_fit` then never sees an individual update: every result carries the same vector,
the weighted mean sum_i(w_i x_i) / sum_i(w_i) of the k clients that finished the protocol.
Clients report weight w_i = 1 (`clients.mods`), so the mean is uniform and sum = k * mean;
that sum goes through the same noisy average step, which tops the noise up for the m - k
shares that did not arrive (ALGORITHMS.md section 0).

SecAgg+ quantizes each upload x to integers after clipping every coordinate to [-R, R].
`secagg_clipping_range` picks R = C + z s (s = noise-share std, z from a union bound over
all coordinates of all clients) so that the quantizer clips nothing except with
probability `failure_probability` per round: a clipped coordinate would change the sum
nonlinearly and void the accounting of the sum as one Gaussian release.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from logging import ERROR, INFO, WARNING
from statistics import NormalDist

import numpy as np
from flwr.app import ArrayRecord, Context, Error, Message, MessageType, Metadata, MetricRecord, RecordDict
from flwr.common import FitIns, FitRes, Parameters, Scalar, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.compat.common import recorddict_compat as compat
from flwr.server import LegacyContext, ServerConfig
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import FedAvg as LegacyFedAvg
from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_PARAMS_RECORD
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result
from flwr.supercore import log

from .dp_fedavg import DPFedAvg, format_record
from fl_app.privacy.mechanisms import flatten, unflatten, update_problem

SECAGG_MODULUS_RANGE = 2**32  # Flower's default and maximum
SECAGG_QUANTIZATION_RANGE = 2**22  # Flower's default: precision 2R / 2^22 per coordinate

LegacyEvaluateFn = Callable[[int, list, dict], "tuple[float, dict[str, Scalar]] | None"]


def secagg_clipping_range(clipping_norm: float, noise_std: float, dim: int, clients: int,
                          failure_probability: float = 1e-9) -> float:
    """R = C + z s with 2 * dim * clients * P(N(0,1) > z) = failure_probability.

    A clipped update has |Delta_j| <= ||Delta||_2 <= C in every coordinate, and its noise
    share is N(0, s^2), so by a union bound no coordinate of any client exceeds R except
    with the given probability.
    """
    if clipping_norm <= 0:
        raise ValueError(f"clipping_norm={clipping_norm!r} must be > 0 under SecAgg+: the quantizer needs "
                         "bounded updates")
    tail = failure_probability / (2.0 * max(1, dim) * max(1, clients))
    return float(clipping_norm + NormalDist().inv_cdf(1.0 - tail) * noise_std)


def secagg_quantization_range(clients: int) -> int:
    """Levels per coordinate such that the sum over `clients` cannot overflow the 2^32 modulus."""
    return int(min(SECAGG_QUANTIZATION_RANGE, (SECAGG_MODULUS_RANGE - 1) // max(2, clients)))


def _numbers(metrics: dict) -> dict:
    """The numeric entries of a legacy metrics dict (MetricRecord holds numbers only)."""
    return {k: v for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and not (isinstance(v, float) and math.isnan(v))}


def _reply(node_id: int, content: RecordDict | None = None, error: Error | None = None) -> Message:
    """A reply Message from `node_id`, as the Message-API strategy expects one."""
    metadata = Metadata(run_id=0, message_id="", src_node_id=node_id, dst_node_id=0, reply_to_message_id="",
                        group_id="", created_at=time.time(), ttl=0.0, message_type=MessageType.TRAIN)
    return Message(content, metadata=metadata) if error is None else Message(error, metadata=metadata)


def unique_failures(failures: list) -> list:
    """Failures without repeats (SecAggPlusWorkflow lists a node that fails in its masked-vector
    stage twice, wrapping the same Error)."""
    seen, unique = set(), []
    for f in failures:
        key = id(f.args[0]) if isinstance(f, BaseException) and f.args and isinstance(f.args[0], Error) else id(f)
        if key not in seen:
            seen.add(key)
            unique.append(f)
    return unique


def failure_reason(failure) -> str:
    """Why a legacy failure failed: 'node <id>: <status>' for a (proxy, FitRes), the Error's reason
    (which names the exception raised on the node) for a failed message, else the exception."""
    if isinstance(failure, tuple):
        proxy, res = failure
        return f"node {proxy.node_id}: {res.status.message}"
    if failure.args and isinstance(failure.args[0], Error):
        return failure.args[0].reason
    return f"{type(failure).__name__}: {failure}"


class LegacyDPFedAvg(LegacyFedAvg):
    """A Message-API DP strategy (`dp`) as a `flwr.server.strategy.Strategy`.

    Parameters
    ----------
    dp : the DPFedAvg (or subclass) that does all the DP work.
    secure_aggregation : run under SecAgg+ (`DPSecAggPlusWorkflow`); needs distributed noise.
    evaluate_fn : Flower's legacy centralized evaluation, (round, ndarrays, config) -> (loss, metrics).
    on_fit_config_fn : extra train config (the DP keys of `dp` win on a clash).
    secagg_num_shares, secagg_reconstruction_threshold : SecAgg+ settings used by `start`
        (fractions of the sampled clients / of the shares, as in `SecAggPlusWorkflow`).
    """

    def __init__(self, dp: DPFedAvg, *, secure_aggregation: bool = False,
                 evaluate_fn: LegacyEvaluateFn | None = None,
                 on_fit_config_fn: Callable[[int], dict] | None = None,
                 initial_parameters: Parameters | None = None, num_rounds: int = 0,
                 secagg_num_shares: float = 1.0, secagg_reconstruction_threshold: float = 0.5) -> None:
        super().__init__(fraction_fit=dp.sample_rate, fraction_evaluate=dp.fraction_evaluate,
                         min_fit_clients=0, min_evaluate_clients=0, min_available_clients=dp.min_available_nodes,
                         evaluate_fn=evaluate_fn, on_fit_config_fn=on_fit_config_fn,
                         initial_parameters=initial_parameters)
        if secure_aggregation and dp.noise_placement != "distributed":
            raise ValueError(f"secure_aggregation needs noise_placement='distributed', not "
                             f"{dp.noise_placement!r}: under SecAgg+ the server cannot clip or noise single updates")
        if dp.ledger is not None and dp.secure_aggregation != secure_aggregation:
            raise ValueError("set secure_aggregation before the first round (the ledger already exists)")
        dp.secure_aggregation = secure_aggregation
        self.dp = dp
        self.secure_aggregation = secure_aggregation
        self.secagg_num_shares = secagg_num_shares
        self.secagg_reconstruction_threshold = secagg_reconstruction_threshold
        self.secagg_settings: dict = {}
        self.dp._num_rounds = num_rounds  # for target-epsilon-mode = calibrate
        self.dp.stop_reason = "num-rounds reached"
        self.result = Result()
        self._global: list[np.ndarray] | None = None
        self._pending: dict | None = None  # the round's record until its evaluation is in
        self._sampled_round = 0  # the last round whose instructions went out
        self._round_start = 0.0

    # ------------------------------------------------------------------ views of the wrapped strategy
    @property
    def history(self) -> list[dict]:
        return self.dp.history

    @property
    def ledger(self):
        return self.dp.ledger

    @property
    def stop_reason(self) -> str:
        return self.dp.stop_reason

    def __repr__(self) -> str:
        return f"LegacyDPFedAvg({type(self.dp).__name__}, secure_aggregation={self.secure_aggregation})"

    def describe(self) -> dict:
        return {**self.dp.describe(), "secure_aggregation": self.secure_aggregation,
                **({"secagg": self.secagg_settings} if self.secure_aggregation else {})}

    def ensure_population(self, client_manager: ClientManager, poll_seconds: float = 1.0) -> None:
        """Before round 1: wait for `min_available_nodes` nodes, then fix M, m and delta."""
        if self.dp.ledger is not None:
            return
        while (available := client_manager.num_available()) < self.dp.min_available_nodes:
            log(INFO, "Waiting for nodes: %d connected, %d required", available, self.dp.min_available_nodes)
            time.sleep(poll_seconds)
        self.dp.setup_population(client_manager.num_available())

    # ------------------------------------------------------------------ fit
    def configure_fit(self, server_round: int, parameters: Parameters,
                      client_manager: ClientManager) -> list[tuple[ClientProxy, FitIns]]:
        self.ensure_population(client_manager)
        self._pending = None
        if self.dp.budget_exhausted():
            if self.dp.stop_reason == "num-rounds reached":  # first round refused: say why, once
                self.dp.stop_reason = self.dp.budget_stop_reason(server_round)
                log(WARNING, "Stopping before round %d: %s", server_round, self.dp.stop_reason)
            return []
        self._round_start = time.perf_counter()
        self._global = parameters_to_ndarrays(parameters)
        self.dp._global = ArrayRecord(self._global)  # what DPFedAvg.aggregate_train measures updates against
        proxies = {proxy.node_id: proxy for proxy in client_manager.all().values()}
        sampled = self.dp.sample_clients(server_round, list(proxies))
        log(INFO, "configure_fit: sampled %d of %d clients (m=%.1f)", len(sampled), len(proxies),
            self.dp.expected_clients)
        config = dict(self.on_fit_config_fn(server_round)) if self.on_fit_config_fn else {}
        config.update(self.dp.client_train_config(server_round))
        config["secure-aggregation"] = self.secure_aggregation
        fit_ins = FitIns(parameters, config)
        self._sampled_round = server_round
        return [(proxies[node], fit_ins) for node in sampled]

    def aggregate_fit(self, server_round: int, results: list[tuple[ClientProxy, FitRes]],
                      failures: list) -> tuple[Parameters | None, dict[str, Scalar]]:
        if self._global is None:
            raise RuntimeError("aggregate_fit before configure_fit")
        failures = unique_failures(failures)
        if self.secure_aggregation:
            new_global, metrics = self._aggregate_sum(server_round, results, failures)
        else:
            replies = [_reply(proxy.node_id, RecordDict({
                self.dp.arrayrecord_key: ArrayRecord(parameters_to_ndarrays(res.parameters)),
                "metrics": MetricRecord(_numbers({**res.metrics, "num-examples": res.num_examples}))}))
                for proxy, res in results]
            replies += [_reply(0, error=Error(code=1, reason=failure_reason(f))) for f in failures]
            arrays, metric_record = self.dp.aggregate_train(server_round, replies)
            new_global, metrics = arrays.to_numpy_ndarrays(), dict(metric_record)
        reasons = [failure_reason(f) for f in failures]
        self._pending = {"round": server_round, **metrics, **({"failed_nodes": reasons} if reasons else {})}
        self.result.arrays = ArrayRecord(new_global)
        self.result.train_metrics_clientapp[server_round] = MetricRecord(metrics)
        return ndarrays_to_parameters(new_global), metrics

    def _aggregate_sum(self, server_round: int, results: list[tuple[ClientProxy, FitRes]],
                       failures: list) -> tuple[list[np.ndarray], dict]:
        """SecAgg+: every result carries the same mean of the k uploads; sum = k * mean."""
        shapes = [a.shape for a in self._global]
        weights = {res.num_examples for _, res in results}
        if len(weights) > 1:
            raise ValueError(f"SecAgg+ received updates with different weights {sorted(weights)}: the sum of a "
                             "weighted mean cannot be recovered; clients must report num_examples = 1 "
                             "(clients.mods.uniform_weight_mod / dp_privatize_mod do)")
        k = len(results)
        updates: list[np.ndarray] = []
        problem = "no client finished the protocol" if k == 0 else None
        if k:
            mean = parameters_to_ndarrays(results[0][1].parameters)
            problem = update_problem([np.asarray(a, np.float32) for a in mean], shapes)
            if problem is None:
                updates = [(flatten(mean).astype(np.float64) * k).astype(np.float32)]
        if problem:
            log(ERROR, "Round %d: rejected the secure sum of %d updates: %s", server_round, k, problem)
        new_global = self.dp.noisy_average_step(server_round, updates, flatten(self._global),
                                                received=k if updates else 0)
        metrics = {"clients": k if updates else 0, "rejected": 0 if updates else k, "failures": len(failures),
                   "server_noise_std": self.dp.last_server_noise_std, **self.dp.privacy_metrics()}
        return unflatten(new_global, shapes), metrics

    # ------------------------------------------------------------------ evaluation and the round record
    def evaluate(self, server_round: int, parameters: Parameters) -> tuple[float, dict[str, Scalar]] | None:
        """Centralized evaluation (Flower's legacy evaluate_fn), added to the round's record."""
        res = super().evaluate(server_round, parameters)
        if res is not None:
            self.result.evaluate_metrics_serverapp[server_round] = MetricRecord(_numbers({"loss": res[0], **res[1]}))
        if server_round >= 1 and self._pending is None and self._sampled_round == server_round:
            log(WARNING, "Round %d: no aggregate (SecAgg+ halts when too few sampled nodes finish the protocol); "
                "the model is unchanged and nothing was charged to the ledger", server_round)
        if res is not None and self._pending is not None and self._pending["round"] == server_round:
            self._pending.update(_numbers({"loss": res[0], **res[1]}))
        return res

    def configure_evaluate(self, server_round: int, parameters: Parameters,
                           client_manager: ClientManager) -> list:
        instructions = super().configure_evaluate(server_round, parameters, client_manager)
        if not instructions:  # no client evaluation this round: the record is complete
            self._emit(server_round)
        return instructions

    def aggregate_evaluate(self, server_round: int, results: list, failures: list):
        """Flower's weighted loss, the clients' numeric metrics weighted by their example counts."""
        loss, _ = super().aggregate_evaluate(server_round, results, failures)
        total = sum(res.num_examples for _, res in results)
        metrics: dict = {}
        if total:
            keys = set.intersection(*(set(_numbers(res.metrics)) for _, res in results)) - {"num-examples"}
            metrics = {k: sum(res.num_examples * float(res.metrics[k]) for _, res in results) / total for k in keys}
        client = {"loss": loss, **metrics} if loss is not None else metrics
        if client:
            self.result.evaluate_metrics_clientapp[server_round] = MetricRecord(_numbers(client))
        self._emit(server_round, {f"client_{k}": v for k, v in _numbers(client).items()})
        return loss, metrics

    def _emit(self, server_round: int, extra: dict | None = None) -> None:
        """The round's record is complete: history, log, on_round_end (the run directory)."""
        if self._pending is None or self._pending["round"] != server_round:
            return
        record, self._pending = self._pending, None
        record.update(extra or {})
        record["seconds"] = time.perf_counter() - self._round_start
        self.dp.history.append(record)
        log(INFO, "Round %d: %s", server_round, format_record(record))
        if self.dp.on_round_end:
            self.dp.on_round_end(record)

    # ------------------------------------------------------------------ run (fl_app)
    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3, timeout: float | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None) -> Result:
        """Run `num_rounds` with Flower's DefaultWorkflow (SecAgg+ when secure_aggregation), like DPFedAvg.start."""
        self.dp._num_rounds = num_rounds
        self.initial_parameters = ndarrays_to_parameters(initial_arrays.to_numpy_ndarrays())
        self.result.arrays = initial_arrays  # until a round changes them
        if evaluate_fn is not None:
            def legacy_evaluate(rnd: int, ndarrays: list, config: dict):
                metrics = evaluate_fn(rnd, ArrayRecord(ndarrays))
                return None if metrics is None else (float(metrics.get("loss", math.nan)), dict(metrics))
            self.evaluate_fn = legacy_evaluate
        log(INFO, "Starting %s (legacy API, secure aggregation %s):", type(self.dp).__name__,
            "on" if self.secure_aggregation else "off")
        self.dp.summary()
        context = LegacyContext(Context(run_id=0, node_id=0, node_config={}, state=RecordDict(), run_config={}),
                                config=ServerConfig(num_rounds=num_rounds, round_timeout=timeout), strategy=self)
        fit_workflow = (DPSecAggPlusWorkflow(self.secagg_num_shares, self.secagg_reconstruction_threshold,
                                             timeout=timeout) if self.secure_aggregation else None)
        DefaultWorkflow(fit_workflow=fit_workflow)(grid, context)
        if self.dp.ledger is None:  # no round ran
            self.ensure_population(context.client_manager)
        return self.result


class DPSecAggPlusWorkflow(SecAggPlusWorkflow):
    """Flower's SecAgg+ set up for a LegacyDPFedAvg: uniform weights (max_weight = 1) and a quantizer
    range R that the noisy updates do not reach (`secagg_clipping_range`), recomputed every round."""

    def __init__(self, num_shares: int | float = 1.0, reconstruction_threshold: int | float = 0.5, *,
                 failure_probability: float = 1e-9, timeout: float | None = None) -> None:
        super().__init__(num_shares, reconstruction_threshold, max_weight=1.0, timeout=timeout)
        self.failure_probability = failure_probability

    def __call__(self, grid: Grid, context: Context) -> None:
        strategy = getattr(context, "strategy", None)
        if not isinstance(strategy, LegacyDPFedAvg) or not strategy.secure_aggregation:
            raise TypeError("DPSecAggPlusWorkflow needs a LegacyDPFedAvg(..., secure_aggregation=True) "
                            "as the LegacyContext's strategy")
        strategy.ensure_population(context.client_manager)
        dp = strategy.dp
        parameters = compat.arrayrecord_to_parameters(context.state.array_records[MAIN_PARAMS_RECORD], keep_input=True)
        dim = sum(a.size for a in parameters_to_ndarrays(parameters))
        clients = max(2, dp.num_clients)
        noise_std = float(dp.client_train_config(0)["noise-std"])
        self.clipping_range = secagg_clipping_range(dp.clipping_norm, noise_std, dim, clients,
                                                    self.failure_probability)
        self.quantization_range = secagg_quantization_range(clients)
        strategy.secagg_settings = {
            "num_shares": self.num_shares, "reconstruction_threshold": self.reconstruction_threshold,
            "max_weight": self.max_weight, "clipping_range": self.clipping_range,
            "quantization_range": self.quantization_range, "modulus_range": self.modulus_range,
            "quantization_step": 2 * self.clipping_range / self.quantization_range,
            "quantizer_clip_probability_bound": self.failure_probability,
        }
        super().__call__(grid, context)
