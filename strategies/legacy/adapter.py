"""Legacy-API (`flwr.server.strategy`) form of the DP strategies.

`LegacyDPFedAvg` wraps a Message-API `DPFedAvg` (or a subclass) by delegation: sampling, the
train config, rejection of malformed updates, central clipping, noise and its top-up, the
fixed denominator m, the server learning rate, the privacy ledger and the round record are
the wrapped strategy's own code, reached through its public methods. This class only
translates FitIns/FitRes <-> Messages, so the legacy and the Message-API strategies cannot
drift apart. How the workflow's results carry the updates is a piece it is composed with
(`aggregation`): `SeparateUpdates` (each result is one client's update: Flower's default fit
workflow) or `strategies.legacy.secagg.SecureSum` (every result carries SecAgg+'s one sum; its SecAgg+
forms are in `strategies.legacy.secagg`). While it runs, Flower's own log is kept, less what epsilon
does not cover (`strategies.legacy.log`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from logging import INFO

import numpy as np
from flwr.app import ArrayRecord, Context, Error, MetricRecord, RecordDict
from flwr.common import FitIns, FitRes, Parameters, Scalar, log, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server import LegacyContext, ServerConfig
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import FedAvg as LegacyFedAvg
from flwr.server.workflow import DefaultWorkflow
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result

from dpfl.dpcore.privacy import protocol as keys
from dpfl.dpcore.privacy.modes import TargetEpsilonMode
from dpfl.strategies.dp_fedavg import DPFedAvg
from dpfl.strategies.legacy.log import FlowerLegacyLog
from dpfl.strategies.loop.reply_gate import client_exception, note_problem, stop_if_every_client_failed
from dpfl.strategies.loop.round_loop import ensure_population, evaluation_due
from dpfl.strategies.loop.run_record import bound_note, split_record
from dpfl.strategies.loop.wrapped import reply_message
from dpfl.strategies.parts.part import arrays_key, fraction_evaluate

LegacyEvaluateFn = Callable[[int, list, dict], "tuple[float, dict[str, Scalar]] | None"]


def _numbers(metrics, finite: bool = True) -> dict:
    """The numeric entries of a legacy metrics mapping (MetricRecord holds numbers only): the finite ones, or all of
    them (inf and nan too) with finite=False."""
    if not isinstance(metrics, Mapping):
        return {}
    return {
        str(k): v
        for k, v in metrics.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and (not finite or math.isfinite(v))
    }


def legacy_content(array_key: str, res: FitRes) -> RecordDict:
    """A FitRes as Message content for the wrapped strategy's reply gate; parameters that do not decode
    give content without arrays (which the gate rejects), never an exception."""
    content = RecordDict({"metrics": MetricRecord(_numbers({**res.metrics, keys.NUM_EXAMPLES: res.num_examples}))})
    try:
        content[array_key] = ArrayRecord(parameters_to_ndarrays(res.parameters))
    except Exception:  # undecodable bytes from a client
        pass
    return content


def fit_res_problem(res: FitRes) -> str | None:
    """Why a legacy FitRes is refused before it is read (its metrics must be a mapping: a dict, as Flower declares,
    or the ConfigRecord Flower's own compat layer hands over), or None."""
    if not isinstance(res.metrics, Mapping):
        return f"FitRes.metrics is {type(res.metrics).__name__}, not a dict: the reply is refused"
    return None


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
    """Why a legacy failure failed: 'node <id>: <status>' for a (proxy, FitRes), the exception raised on the node
    for a failed message (its own line of the Error's reason: `reply_gate.client_exception`), else the exception."""
    if isinstance(failure, tuple):
        proxy, res = failure
        return f"node {proxy.node_id}: {res.status.message}"
    if failure.args and isinstance(failure.args[0], Error):
        return client_exception(failure.args[0].reason)
    return f"{type(failure).__name__}: {failure}"


def summed_by_secagg(results: list) -> bool:
    """Whether the results are Flower's SecAgg+ sum: its workflow hands every result the same Parameters object."""
    return len(results) >= 2 and all(res.parameters is results[0][1].parameters for _, res in results)


def weighted_numeric_mean(results: list) -> dict:
    """The example-weighted mean of each numeric metric every client reported (num-examples left out)."""
    total = sum(res.num_examples for _, res in results)
    if not total:
        return {}
    common = set.intersection(*(set(_numbers(res.metrics)) for _, res in results)) - {keys.NUM_EXAMPLES}
    return {k: sum(res.num_examples * float(res.metrics[k]) for _, res in results) / total for k in common}


class SeparateUpdates:
    """How Flower's default fit workflow hands over the updates: each result is one client's, and the results go to
    the wrapped strategy as replies, through its reply gate (`LegacyDPFedAvg.aggregation`; SecAgg+'s sum is read by
    `strategies.legacy.secagg.SecureSum`)."""

    secure = False

    def check_round(self) -> None:
        """Nothing to check before a round samples (SecureSum: that DPSecAggPlusWorkflow runs it)."""

    def describe(self) -> dict:
        return {}

    def aggregate(
        self, dp: DPFedAvg, global_arrays: list[np.ndarray], server_round: int, results: list, failures: list
    ) -> tuple[list[np.ndarray], dict, list]:
        """(new global arrays, round metrics, the results the reply gate accepted) from the wrapped strategy's
        aggregate_train over the results."""
        if summed_by_secagg(results):
            raise ValueError(
                "these results are one SecAgg+ sum (Flower's SecAggPlusWorkflow), which this strategy would count "
                "as separate clients' updates: use SecAggPlusDifferentialPrivacy in place of LegacyDifferentialPrivacy "
                "(or SecAggPlusDPFedAvg(DPFedAvg(noise_placement='distributed', ...)) in place of LegacyDPFedAvg) "
                "with DPSecAggPlusWorkflow in place of SecAggPlusWorkflow (all from dpfl), or leave SecAgg+ out"
            )
        replies = [
            reply_message(proxy.node_id, error=Error(code=1, reason=f"node {proxy.node_id}: {problem}"))
            if (problem := fit_res_problem(res))
            else reply_message(proxy.node_id, legacy_content(arrays_key(dp), res))
            for proxy, res in results
        ]
        failed = [reply_message(0, error=Error(code=1, reason=failure_reason(f))) for f in failures]
        arrays, metric_record = dp.aggregate_train(server_round, replies + failed)
        read = {id(reply) for reply in dp.round.accepted_replies}
        accepted = [result for result, reply in zip(results, replies) if id(reply) in read]
        return arrays.to_numpy_ndarrays(), dict(metric_record), accepted


class LegacyDPFedAvg(LegacyFedAvg):
    """A Message-API DP strategy (`dp`) as a `flwr.server.strategy.Strategy`.

    Parameters
    ----------
    dp : the DPFedAvg (or subclass) that does all the DP work.
    evaluate_fn : Flower's legacy centralized evaluation, (round, ndarrays, config) -> (loss, metrics).
    on_fit_config_fn : extra train config (the DP keys of `dp` win on a clash).
    on_evaluate_config_fn, evaluate_metrics_aggregation_fn : as in Flower's FedAvg: the app's own federated
        evaluation config, and its function that aggregates the clients' evaluate metrics (default: the
        example-weighted mean of the numeric metrics every client reported).
    fit_metrics_aggregation_fn : the app's function over the (num_examples, metrics) of the replies the DP round
        accepted (a duplicate, unsampled or malformed reply is not passed; clients that sent no metrics left out,
        never the DP average; not called when none sent any); what it returns (numbers, inf included) joins the
        round's fit metrics in Flower's History, outside what epsilon covers; if it raises, the round goes on
        without them (a diagnostic).
    aggregation : how the workflow's results carry the updates: `SeparateUpdates()` (default) or SecAgg+'s
        `strategies.legacy.secagg.SecureSum()`.

    The fit metrics it returns to Flower are the ledger's (epsilon, delta) and the app's; the non-private counts
    and norms go to the round record's diagnostics only. Flower's log prints the ledger's only
    (`strategies.legacy.log`, unless publish_diagnostics).
    """

    def __init__(
        self,
        dp: DPFedAvg,
        *,
        evaluate_fn: LegacyEvaluateFn | None = None,
        on_fit_config_fn: Callable[[int], dict] | None = None,
        on_evaluate_config_fn: Callable[[int], dict] | None = None,
        evaluate_metrics_aggregation_fn: Callable[[list], dict] | None = None,
        fit_metrics_aggregation_fn: Callable[[list], dict] | None = None,
        initial_parameters: Parameters | None = None,
        num_rounds: int = 0,
        aggregation=None,
    ) -> None:
        super().__init__(
            fraction_fit=dp.population.sample_rate,
            fraction_evaluate=fraction_evaluate(dp),
            min_fit_clients=0,
            min_evaluate_clients=0,
            min_available_clients=dp.population.min_available_nodes,
            evaluate_fn=evaluate_fn,
            on_fit_config_fn=on_fit_config_fn,
            on_evaluate_config_fn=on_evaluate_config_fn,
            evaluate_metrics_aggregation_fn=evaluate_metrics_aggregation_fn,
            fit_metrics_aggregation_fn=fit_metrics_aggregation_fn,
            initial_parameters=initial_parameters,
        )
        self.dp = dp
        self.aggregation = aggregation or SeparateUpdates()
        self.flower_log = FlowerLegacyLog()  # a new one for each run (initialize_parameters)
        self.dp.record.num_rounds = int(num_rounds)  # for target-epsilon-mode = calibrate
        self.dp.record.stop_reason = "num-rounds reached"
        self.result = Result()
        self._global: list[np.ndarray] | None = None
        self._pending: dict | None = None  # the round's record until its evaluation is in
        self._sampled_round = 0  # the last round whose clients were sampled
        self._round_start = 0.0
        # The model of a round that was sampled but aggregated nothing (an empty sample, or SecAgg+ halted):
        # released with noise only, as DPFedAvg.start does; Flower's workflow does not see it, so the next
        # round trains and evaluates on it instead of on the workflow's stale parameters.
        self._noise_only: Parameters | None = None

    # ------------------------------------------------------------------ views of the wrapped strategy
    @property
    def secure_aggregation(self) -> bool:
        return self.aggregation.secure

    @property
    def record(self):
        """The wrapper's record of the run (`strategies.loop.run_record.RunRecord`: history, stop_reason, ...)."""
        return self.dp.record

    @property
    def ledger(self):
        return self.dp.ledger

    def __repr__(self) -> str:
        return f"LegacyDPFedAvg({self.dp.name}, secure_aggregation={self.secure_aggregation})"

    def describe(self) -> dict:
        return {**self.dp.describe(), "secure_aggregation": self.secure_aggregation, **self.aggregation.describe()}

    def describe_diagnostics(self) -> dict:
        return self.dp.describe_diagnostics()

    def ensure_population(self, client_manager: ClientManager) -> None:
        """Before round 1: wait for `min_available_nodes` nodes, then fix M, m and delta.

        `calibrate` needs the number of rounds the run will have; Flower's ServerConfig does not tell
        the strategy, so it must come as `num_rounds` (or through `start`): refused otherwise, before any
        client trains, rather than calibrated for one round and overspent.
        """
        if (
            self.dp.ledger is None
            and self.dp.privacy.target_epsilon_mode == TargetEpsilonMode.CALIBRATE
            and self.dp.privacy.target_epsilon > 0
            and self.dp.record.num_rounds <= 0
        ):
            raise ValueError(
                "target_epsilon_mode='calibrate' needs the number of rounds: pass num_rounds= (the "
                "ServerConfig's num_rounds) to the legacy strategy, or use target_epsilon_mode='stop'"
            )
        ensure_population(self.dp, self.node_counter(client_manager))

    def node_counter(self, client_manager: ClientManager) -> Callable[[], int]:
        """How the wrapped strategy counts the connected nodes before round 1."""
        return client_manager.num_available

    # ------------------------------------------------------------------ fit
    def initialize_parameters(self, client_manager: ClientManager) -> Parameters | None:
        """The run begins (Flower's workflows and legacy Server call this first): Flower's log is kept, less what
        epsilon does not cover, until its [SUMMARY] ends (`strategies.legacy.log`; all of it with
        publish_diagnostics), which closes with the bound the printed epsilon is where it is not the accountant's
        asked for."""
        self.flower_log = FlowerLegacyLog(publish_all=self.dp.run.publish_diagnostics, closing=self.bound_line)
        self.flower_log.install()
        return super().initialize_parameters(client_manager)

    def bound_line(self) -> str:
        """The line that names the bound the printed epsilon is, where it is not the accountant's asked for ("" where
        it is, or before any round)."""
        return (self.dp.ledger is not None and bound_note(self.dp.ledger.accountant, self.dp.ledger)) or ""

    def configure_fit(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, FitIns]]:
        self.aggregation.check_round()  # e.g. SecAgg+'s sum under Flower's plain SecAggPlusWorkflow: refused here
        self.ensure_population(client_manager)
        self._pending = None
        if self.dp.round.refused:  # the budget refused an earlier round (said once, then): the run has ended
            return []
        if self._noise_only is not None:  # the last release, which the workflow did not see
            parameters = self._noise_only
        self._round_start = time.perf_counter()
        self._global = parameters_to_ndarrays(parameters)
        self.dp.begin_round(ArrayRecord(self._global))  # what DPFedAvg.aggregate_train measures updates against
        proxies = {proxy.node_id: proxy for proxy in client_manager.all().values()}
        # the budget is checked at the round's own sample, before anything is sent; how many: a diagnostic
        sampled = self.dp.sample_clients(server_round, list(proxies))
        if self.dp.round.refused:
            return []
        config = self.fit_config(server_round, parameters, client_manager)
        config.update(self.dp.client_train_config(server_round))
        config[keys.SECURE_AGGREGATION] = self.secure_aggregation
        fit_ins = FitIns(parameters, config)
        self._sampled_round = server_round  # sampled: the round is charged, even if nothing comes of it
        return [(proxies[node], fit_ins) for node in sampled]

    def fit_config(self, server_round: int, parameters: Parameters, client_manager: ClientManager) -> dict:
        """The app's train config of the round (its on_fit_config_fn), before the DP keys are added."""
        return dict(self.on_fit_config_fn(server_round)) if self.on_fit_config_fn else {}

    def aggregate_fit(
        self, server_round: int, results: list[tuple[ClientProxy, FitRes]], failures: list
    ) -> tuple[Parameters | None, dict[str, Scalar]]:
        """The round's release; Flower's History takes the ledger's fit metrics and the app's (outside epsilon), the
        app's over the results the round accepted."""
        parameters, published, accepted = self.release(server_round, results, failures)
        app_metrics = self.app_fit_metrics(server_round, accepted)
        self.flower_log.fit(server_round, published, app_metrics)
        return parameters, {**app_metrics, **published}

    def release(
        self, server_round: int, results: list[tuple[ClientProxy, FitRes]], failures: list
    ) -> tuple[Parameters, dict[str, Scalar], list]:
        """The DP round over the results: (the released model, the fit metrics the ledger covers, the results it
        accepted)."""
        if self._global is None:
            raise RuntimeError("aggregate_fit before configure_fit")
        failures = unique_failures(failures)
        self._noise_only = None
        new_global, metrics, accepted = self.aggregate_updates(server_round, results, failures)
        reasons = [failure_reason(f) for f in failures]
        self._pending = {"round": server_round, **metrics, **({"failed_nodes": reasons} if reasons else {})}
        self.result.arrays = ArrayRecord(new_global)
        self.result.train_metrics_clientapp[server_round] = MetricRecord(metrics)
        published, _ = split_record(self.dp, {"round": server_round, **metrics})
        published.pop("round")
        return ndarrays_to_parameters(new_global), _numbers(published), accepted

    def aggregate_updates(
        self, server_round: int, results: list[tuple[ClientProxy, FitRes]], failures: list
    ) -> tuple[list[np.ndarray], dict, list]:
        """(new global arrays, round metrics, the results accepted): the results as `aggregation` reads them."""
        return self.aggregation.aggregate(self.dp, self._global, server_round, results, failures)

    def app_fit_metrics(self, server_round: int, accepted: list[tuple[ClientProxy, FitRes]]) -> dict:
        """The app's fit_metrics_aggregation_fn over the (num_examples, metrics) of the accepted results; {} without
        it, when none sent metrics, or if it raises (noted in the round's diagnostics). Its numbers are kept as it
        returns them, inf included (a client's sample-epsilon at sigma 0), as the Message-API wrapper keeps them."""
        sent = [
            (res.num_examples, dict(res.metrics)) for _, res in accepted if not fit_res_problem(res) and res.metrics
        ]
        if self.fit_metrics_aggregation_fn is None or not sent:
            return {}
        try:
            return _numbers(self.fit_metrics_aggregation_fn(sent), finite=False)
        except Exception as exc:  # the app's function on what clients sent
            note_problem(self.dp, server_round, f"fit_metrics_aggregation_fn failed ({type(exc).__name__}: {exc})")
            return {}

    # ------------------------------------------------------------------ evaluation and the round record
    def evaluate(self, server_round: int, parameters: Parameters) -> tuple[float, dict[str, Scalar]] | None:
        """Centralized evaluation (Flower's legacy evaluate_fn), added to the round's record.

        A round that was sampled but aggregated nothing (its sample was empty, or SecAgg+ halted: fewer than 2
        sampled, or too few finished the protocol) is released here as DPFedAvg.start releases it: the model plus
        the full noise, charged to the ledger (the sampling ran; an unchanged model would tell that it came up
        short). How it came up short is a diagnostic; the nodes that failed in SecAgg+'s stages (`halted_failures`)
        are its failures. If every sampled node failed and no earlier round had a usable reply, the run stops
        here instead, before the release (`reply_gate.stop_if_every_client_failed`)."""
        if server_round >= 1 and self._pending is None and self._sampled_round == server_round:
            failures = unique_failures(self.halted_failures())
            stop_if_every_client_failed(self.dp, server_round, len(failures), [failure_reason(f) for f in failures])
            note_problem(
                self.dp,
                server_round,
                "no aggregate (an empty sample, or SecAgg+ halted: fewer than 2 "
                "sampled or too few finished the protocol): the round releases noise only",
            )
            parameters, _, _ = self.release(server_round, [], failures)
            self._noise_only = parameters
        res = super().evaluate(server_round, parameters)
        if res is not None:
            self.flower_log.centralized(server_round, res[0], res[1])
            self.result.evaluate_metrics_serverapp[server_round] = MetricRecord(_numbers({"loss": res[0], **res[1]}))
        if res is not None and self._pending is not None and self._pending["round"] == server_round:
            self._pending.update(_numbers({"loss": res[0], **res[1]}))
        return res

    def halted_failures(self) -> list:
        """The failures of a round that reached no aggregate_fit: those SecAgg+'s stages collected (DPSecAggPlusWorkflow
        hands the aggregation its round's list), none under the default fit workflow."""
        return list(getattr(self.aggregation, "failures", ()))

    def configure_evaluate(self, server_round: int, parameters: Parameters, client_manager: ClientManager) -> list:
        if self._noise_only is not None:  # the round's release, which the workflow did not see
            parameters = self._noise_only
        instructions = super().configure_evaluate(server_round, parameters, client_manager)
        if not instructions:  # no client evaluation this round: the record is complete
            self._emit(server_round)
        return instructions

    def aggregate_evaluate(self, server_round: int, results: list, failures: list):
        """Flower's weighted loss; the app's evaluate_metrics_aggregation_fn over the clients' metrics, else their
        numeric metrics weighted by example counts. A reply that breaks the app's function is not raised."""
        results = [
            (proxy, res)
            for proxy, res in results  # plausible example counts and a finite loss only
            if isinstance(res.num_examples, int)
            and 0 < res.num_examples < 2**31
            and isinstance(res.loss, (int, float))
            and math.isfinite(res.loss)
        ]
        try:
            loss, metrics = super().aggregate_evaluate(server_round, results, failures)
        except Exception as exc:  # the app's aggregation function on hostile metrics
            note_problem(self.dp, server_round, f"client evaluation not aggregated ({type(exc).__name__}: {exc})")
            loss, metrics = None, {}
        if self.evaluate_metrics_aggregation_fn is None:
            metrics = weighted_numeric_mean(results)
        self.flower_log.distributed(loss, metrics)
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
        self.dp.finish_round(record, self._round_start, self.result.arrays)

    # ------------------------------------------------------------------ run (fl_app)
    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
        eval_every: int = 1,
    ) -> Result:
        """Run `num_rounds` with Flower's DefaultWorkflow (SecAgg+ when secure_aggregation), like DPFedAvg.start."""
        self.dp.record.num_rounds = int(num_rounds)
        self.initial_parameters = ndarrays_to_parameters(initial_arrays.to_numpy_ndarrays())
        self.result.arrays = initial_arrays  # until a round changes them
        if evaluate_fn is not None:

            def legacy_evaluate(rnd: int, ndarrays: list, config: dict):
                if not evaluation_due(self.dp, rnd, eval_every, num_rounds):
                    return None
                metrics = evaluate_fn(rnd, ArrayRecord(ndarrays))
                return None if metrics is None else (float(metrics.get("loss", math.nan)), dict(metrics))

            self.evaluate_fn = legacy_evaluate
        log(
            INFO,
            "Starting %s (legacy API, secure aggregation %s):",
            self.dp.name,
            "on" if self.secure_aggregation else "off",
        )
        self.dp.summary()
        context = LegacyContext(
            Context(run_id=0, node_id=0, node_config={}, state=RecordDict(), run_config={}),
            config=ServerConfig(num_rounds=num_rounds, round_timeout=timeout),
            strategy=self,
        )
        try:
            DefaultWorkflow(fit_workflow=self.fit_workflow(timeout))(grid, context)
        finally:  # the run's log filter, if the run raised before its [SUMMARY]
            self.flower_log.uninstall()
        if self.dp.ledger is None:  # no round ran
            self.ensure_population(context.client_manager)
        return self.result

    def fit_workflow(self, timeout: float | None):
        """Flower's default fit workflow (None); SecAgg+ supplies its own."""
        return None
