"""The one DP round loop that every strategy of this package runs (docs/algorithms.md §0).

`DPRoundLoop` wraps any Flower Message-API strategy (`strategy`, FedAvg by default), as Flower's own DP
wrappers do, and adds what differential privacy needs around it:

1. the population (`population`, an object it holds): wait for `min_available_nodes`, then fix M and m
   (expected clients per round) and build the ledger (`make_ledger`, per strategy);
2. sampling: Poisson (each node with probability q, n_s re-derived for the round's population) or
   fixed-size (exactly m), seeded per round;
3. the reply gate (`gate`, an object it holds): every reply decoded and checked before anything reads it;
4. the budget stop: once a round has sampled and before anything is sent, `budget_exhausted()` at the
   round's own (N, m) and truncation probability may refuse it and end the run;
5. the round record (`record`, an object it holds): one dict per round in `record.history`, the `on_checkpoint` hook (the strategy's
   whole state and the global arrays, written before anything of the round is published), then
   the record split in two (`run_record.split_record`): what the ledger covers (`PUBLISHED_KEYS`: evaluation
   of the released model on server data, the privacy figures) goes to the log line and the
   `on_round_end` hook (metrics.jsonl, dashboards); everything computed from raw client replies
   (counts, norms, losses, client evaluation, bytes, timing) is a non-private diagnostic, handed
   to the hook separately and published only with `publish_diagnostics`.

The wrapped strategy keeps its own jobs: it writes the train content (its config, e.g. FedProx's
`proximal-mu`), its evaluation, and its aggregation and server optimizer, which act on the privatized
model as post-processing (`release`): the DP subclass hands it one reply holding
w + eta_s * (privatized average update), so FedAvg returns exactly that and FedAdam / FedYogi / FedAvgM take
their server step from it. The wrapper samples the nodes itself (the accounting needs its sampling), so the
wrapped strategy's `fraction_train` and `min_train_nodes` are not used. What comes back has the keys, order,
shapes and dtypes of what the server sent; arrays that are not floating point (e.g. BatchNorm's
`num_batches_tracked`) are neither trained on by DP nor noised: they come back as the server sent them.

A reply may carry the client's new weights (what every Flower client sends: the update is
w_client - w_global, derived here) or, from this project's clients and `dp_privatize_mod`, the update itself,
marked with `protocol.UPLOAD_KIND` = `UPLOAD_UPDATE`. Under distributed noise only marked replies are taken:
an unmarked one came from a client that added no noise share, and is refused with a logged reason.

`state_dict()` / `load_state_dict()` carry everything a resumed run needs (the ledger included),
so that a run killed in round r continues from round r with no round charged twice or lost.

Client-level DP-FedAvg (`strategies.dp_fedavg`) and sample-level ALI-DPFL (`strategies.sample_level.ali_dpfl`) are
siblings on this base; they differ in the train config, the aggregation and the ledger. The legacy adapter
(`strategies.legacy.adapter`) drives the same methods from Flower's legacy workflow.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from logging import INFO, WARNING

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Result, Strategy

from dpfl.strategies.loop.dp_round import DPRound
from dpfl.strategies.loop.flower_log import FlowerLog
from dpfl.strategies.loop.log_line import DIAGNOSTIC_LOG_KEYS, DIAGNOSTICS_MARK, format_record
from dpfl.strategies.loop.options import RunOptions, SamplingOptions
from dpfl.strategies.loop.population import Population
from dpfl.strategies.loop.reply_gate import NO_REPLY, ReplyGate, client_exception, note_problem
from dpfl.strategies.loop.run_record import RunRecord, bound_note, guarantee_marks, split_record
from dpfl.strategies.loop.wrapped import (
    OWN_AGGREGATE_TRAIN,
    UnusedSamplingLines,
    filtered_flower_log,
    own_aggregate_train,
    quiet_flower_info,
    wrapped_train_content,
)
from dpfl.strategies.parts.part import DenseCodec, Part, PartView, config_key, fraction_evaluate
from dpfl.strategies.parts.sampling import ClientSampling, covering_noise_shares, identified_nodes

RoundCallback = Callable[[dict, dict], None]  # (published record, non-private diagnostics)
CheckpointCallback = Callable[[dict, ArrayRecord], None]


class DPRoundLoop(Strategy):
    """Sampling, reply gate, budget stop and round record for a DP strategy, around a Flower strategy.

    Parameters
    ----------
    strategy : the wrapped Flower Message-API strategy (FedAvg, FedProx, FedAdam, FedYogi, FedAvgM, a user's
        own); None: FedAvg with `fraction_evaluate` and `min_available_nodes`. Its aggregation and server
        optimizer act on the privatized model; its evaluation settings (fraction_evaluate) are its own.
    sampling : q, Poisson or fixed-size sampling, the nodes to wait for (`strategies.loop.options.SamplingOptions`).
    run : eta_s, the randomness, evaluation, outputs and hooks (`strategies.loop.options.RunOptions`).
    selection : who is sent the train message (the selection role); None: `sampling`'s Poisson or fixed-size.
    parts : the optional pieces of the round (`strategies.parts.part.Part`), in the order they run.
    gate : the reply gate (`strategies.loop.reply_gate.ReplyGate`, built with the metrics a train reply must hold);
        None: one that reads no metric.

    What it holds is objects built with what they read: the wrapped `strategy`, the `population` (M, m, q, n_s),
    the `run` options, the roles' parts, the `gate`, the `record` of the run (`strategies.loop.run_record`), the
    `round` in flight and the `ledger`. Subclasses implement `make_ledger`, `ledger_from_state`,
    `client_train_config`, `aggregate_train`, `privacy_metrics`, `budget_exhausted`, `budget_stop_reason` and
    `describe`, and give the gate the metrics they read from a train reply.
    """

    def __init__(
        self,
        strategy: Strategy | None,
        *,
        sampling: SamplingOptions,
        run: RunOptions,
        selection: Part | None = None,
        parts: list[Part] = (),
        gate: ReplyGate | None = None,
    ) -> None:
        if strategy is None:
            strategy = FedAvg(
                fraction_train=1.0,
                fraction_evaluate=run.fraction_evaluate or 0.0,
                min_train_nodes=0,
                min_evaluate_nodes=0,
                min_available_nodes=sampling.min_available_nodes,
            )
        elif run.fraction_evaluate is not None:
            raise ValueError(
                f"fraction_evaluate = {run.fraction_evaluate!r} is set on the wrapped strategy "
                f"({type(strategy).__name__}(fraction_evaluate=...)), not on the DP wrapper"
            )
        if not isinstance(strategy, Strategy):
            raise TypeError(
                f"strategy = {strategy!r}: must be a Flower Message-API strategy "
                "(flwr.serverapp.strategy.Strategy, e.g. FedAvg()); for a legacy flwr.server.strategy "
                "use dpfl.LegacyDifferentialPrivacy (or dpfl.LegacyDPFedAvg)"
            )
        self.strategy = strategy
        self.name = type(self).__name__  # in the log (a preset names itself: strategies.presets)
        self.population = Population.of(sampling)
        self.selection = selection or ClientSampling(sampling.client_sampling)
        self.codec = DenseCodec()
        self.parts = list(parts)  # the optional pieces of the round (strategies.parts.part), in the order they run
        self.run = run
        self.gate = gate or ReplyGate({}, run.publish_diagnostics)
        self.record = RunRecord()
        self.round = DPRound()  # the round in flight (begin_round starts a new one)
        self.ledger = None

    # ------------------------------------------------------------------ population
    def make_ledger(self):
        """The strategy's privacy ledger, built once the population is fixed (its delta: the configured one, or the
        strategy's default for M)."""
        raise NotImplementedError

    def ledger_from_state(self, state: dict):
        raise NotImplementedError

    def setup_population(self, num_clients: int) -> None:
        """Fix M, m, q and n_s (`Population.fix`), and build the ledger."""
        self.population.fix(num_clients)
        self.ledger = self.make_ledger()

    # ------------------------------------------------------------------ train
    def sample_clients(self, server_round: int, node_ids: list[int]) -> list[int]:
        """The nodes the selection role picks this round (`strategies.parts.sampling`), noted in the round; n_s first
        covers the round's population (`covering_noise_shares`). Then, before anything is sent, the budget is
        checked at the round's own (N, m) and truncation probability: a round that would spend more than the
        budget allows is refused (`round.refused`, `stop_reason` says why) and no node is returned."""
        if self.ledger is None:  # sampling needs the population (n_s, delta)
            self.setup_population(len(node_ids))
        self.population.noise_shares = covering_noise_shares(PartView(self), len(node_ids))
        selection = self.selection.select(PartView(self), server_round, node_ids)
        self.round.population = set(sorted(node_ids))
        self.round.truncation_probability, self.round.sampled_from = (
            selection.truncation_probability,
            selection.sampled_from,
        )
        self.round.nodes = {int(n) for n in selection.nodes}
        if self.budget_exhausted():
            self.round.refused = True
            self.record.stop_reason = self.budget_stop_reason(server_round)
            log(WARNING, "Stopping before round %d: %s", server_round, self.record.stop_reason)
            return []
        return selection.nodes

    def client_train_config(self, server_round: int) -> dict:
        """What the sampled clients need this round (protocol keys)."""
        raise NotImplementedError

    def begin_round(self, arrays: ArrayRecord) -> None:
        """A new round (`DPRound`): the global arrays that its updates are measured against, no problems yet."""
        self.round = DPRound.starting(arrays)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The wrapped strategy's train content (its config, arrays) with the DP keys, to the nodes sampled here."""
        ensure_population(self, lambda: len(list(grid.get_node_ids())))
        self.begin_round(arrays)
        # the connected nodes (those holding a client id, where the selection keys its records by client)
        node_ids = self.sample_clients(server_round, identified_nodes(PartView(self), grid, server_round))
        if self.round.refused:
            return []
        content = wrapped_train_content(self, server_round, arrays, config)
        key = config_key(self)
        content[key] = ConfigRecord(
            {**dict(content.config_records.get(key, ConfigRecord())), **self.client_train_config(server_round)}
        )
        for part in self.parts:
            part.round_begun(PartView(self))
        return [Message(content=content, dst_node_id=int(node), message_type=MessageType.TRAIN) for node in node_ids]

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The wrapped strategy's federated evaluation (its counts are not logged: see `quiet_flower_info`)."""
        with quiet_flower_info(not self.run.publish_diagnostics):
            return list(self.strategy.configure_evaluate(server_round, arrays, config, grid))

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """The wrapped strategy's evaluation aggregate (a non-private diagnostic); a malformed reply is dropped
        with a logged reason, never raised."""
        replies = list(replies)
        try:
            with quiet_flower_info(not self.run.publish_diagnostics):
                return self.strategy.aggregate_evaluate(server_round, replies)
        except Exception as exc:  # a hostile evaluation reply must not end the run
            note_problem(self, server_round, f"client evaluation not aggregated ({type(exc).__name__}: {exc})")
            return None

    def summary(self) -> None:
        """The wrapped strategy's summary, less its train-sampling lines, which the wrapper replaces with its own
        (the DP subclasses add theirs)."""
        log(
            INFO,
            "\t├──> Wrapped strategy: %s (the DP wrapper samples the train rounds: its fraction_train and "
            "min_train_nodes are not used; its evaluation is, fraction_evaluate=%.2f)",
            type(self.strategy).__name__,
            fraction_evaluate(self),
        )
        if own_aggregate_train(self.strategy):
            log(INFO, "\t├──> %s", OWN_AGGREGATE_TRAIN)
        with filtered_flower_log(UnusedSamplingLines()):
            self.strategy.summary()

    # ------------------------------------------------------------------ budget and record
    def privacy_metrics(self) -> dict:
        raise NotImplementedError

    def budget_exhausted(self) -> bool:
        """Would the next round spend more than the budget allows?"""
        return False

    def budget_stop_reason(self, server_round: int) -> str:
        raise NotImplementedError

    def guarantee_caveats(self) -> list[str]:
        """Why the printed epsilon is not a guarantee (empty: it is one)."""
        if not self.run.secure_rng:
            return ["noise derivable from the seed (secure-rng = false): anyone who knows 'seed' can remove it"]
        return []

    def client_evaluation_record(self, metrics: MetricRecord) -> dict:
        """How the clients' aggregated evaluation metrics appear in the round's record."""
        return {f"client_{k}": v for k, v in metrics.items()}

    def describe_diagnostics(self) -> dict:
        """End-of-run figures computed from raw client replies (diagnostics-summary.json, not private)."""
        rounds = [r for r in self.record.history if "problems" in r]
        diagnostics = {"rounds_with_failed_or_rejected_replies": [r["round"] for r in rounds]} if rounds else {}
        for part in self.parts:
            diagnostics.update(part.describe_diagnostics(PartView(self)))
        return diagnostics

    def state_dict(self) -> dict:
        """Everything a resumed run needs, JSON-serializable: the record, the population, the ledger's state and
        the parts' (a subclass adds its own)."""
        return {
            **self.record.state_dict(),
            **self.population.state_dict(),
            "ledger": None if self.ledger is None else self.ledger.state_dict(),
            **{k: v for part in self.parts for k, v in part.state_dict().items()},
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue after `state["completed_rounds"]` with the ledger as it was then."""
        self.record.load_state_dict(state)
        self.population.load_state_dict(state)
        self.ledger = None if state["ledger"] is None else self.ledger_from_state(state["ledger"])
        for part in self.parts:
            part.load_state_dict(state)

    def finish_round(self, record: dict, started: float, arrays: ArrayRecord) -> None:
        """The round's record is complete: seconds, history, the checkpoint, one log line, on_round_end."""
        if self.round.problems:
            record["problems"] = list(self.round.problems)
        record.update(guarantee_marks(self))
        record["seconds"] = time.perf_counter() - started
        self.record.add(record, arrays)
        if self.run.on_checkpoint:
            self.run.on_checkpoint(self.state_dict(), arrays)
        published, diagnostics = split_record(self, record)
        line = format_record(published)
        if self.run.publish_diagnostics:
            line += DIAGNOSTICS_MARK + format_record(diagnostics, DIAGNOSTIC_LOG_KEYS)
        # R_s is unknown to a legacy strategy without num_rounds
        total = f"/{self.record.num_rounds}" if self.record.num_rounds > 0 else ""
        log(INFO, "Round %d%s: %s", record["round"], total, line)
        self.gate.warn(self.round, record)
        if self.run.on_round_end:
            self.run.on_round_end(published, diagnostics)

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
        should_stop: Callable[[int, Result], bool] | None = None,
        eval_every: int = 1,
    ) -> Result:
        """Flower's round loop, plus: stop on the privacy budget, one record per round. `evaluate_fn` and the
        clients' evaluation run every `eval_every` rounds and after the last round (the configured last, or the
        last the budget allows). `should_stop(round, result)` (Flower 1.43's keyword, honoured on every release)
        is asked at the end of each round, once its record is written: True ends the run there, and the ledger
        closes it as after the last round. The log has Flower's own lines (`strategies.loop.flower_log`: what epsilon
        does not cover withheld unless publish_diagnostics) and the round's `Round r/R:` line."""
        self.record.num_rounds = int(num_rounds)  # R_s (calibration and ALI-DPFL need it)
        flower = FlowerLog(self)  # Flower's own lines, as Strategy.start prints them
        flower.start(num_rounds, initial_arrays, train_config, evaluate_config)
        for part in self.parts:
            part.see_model(PartView(self), initial_arrays)
        train_config, evaluate_config = train_config or ConfigRecord(), evaluate_config or ConfigRecord()
        result, arrays = Result(arrays=initial_arrays), initial_arrays  # Flower 1.43: the initial model until a round
        if evaluate_fn and not self.record.completed_rounds:
            flower.initial_evaluation(evaluate_fn, arrays, result)
        ensure_population(self, lambda: len(list(grid.get_node_ids())))
        self.record.stop_reason = "num-rounds reached"
        if self.record.completed_rounds:
            epsilon = self.privacy_metrics().get("epsilon")
            log(INFO, "Resuming after round %d (ledger: epsilon %s so far)", self.record.completed_rounds, epsilon)
        for rnd in range(self.record.completed_rounds + 1, num_rounds + 1):
            started = time.perf_counter()
            flower.round_begins(rnd, num_rounds)
            instructions = list(self.configure_train(rnd, arrays, train_config, grid))
            if self.round.refused:  # over the budget at the round's own sample: nothing was sent
                result.arrays = arrays  # the model so far (the initial one if round 1 is refused)
                break
            replies = list(grid.send_and_receive(instructions, timeout=timeout))
            arrays, train_metrics = self.aggregate_train(rnd, replies)
            flower.train_aggregated(train_metrics)
            result.arrays = arrays
            result.train_metrics_clientapp[rnd] = train_metrics
            record = {"round": rnd, **dict(train_metrics), **failed_nodes_record(replies, instructions)}
            if missing := unanswered_nodes(replies, instructions):  # hung or gone at the timeout: failures too
                record["failures"] = int(record.get("failures", 0)) + len(missing)
                for node in missing:
                    note_problem(self, rnd, f"node {node} failed: {NO_REPLY}")
            due = evaluation_due(self, rnd, eval_every, num_rounds)
            eval_msgs = self.configure_evaluate(rnd, arrays, evaluate_config, grid) if due else []
            if eval_msgs:
                client_eval = self.aggregate_evaluate(rnd, grid.send_and_receive(eval_msgs, timeout=timeout))
                if client_eval is not None:
                    flower.evaluation_aggregated(client_eval)
                    result.evaluate_metrics_clientapp[rnd] = client_eval
                    record.update(self.client_evaluation_record(client_eval))
            if evaluate_fn and due and (res := flower.global_evaluation(evaluate_fn, rnd, arrays)) is not None:
                result.evaluate_metrics_serverapp[rnd] = res
                record.update(dict(res))
            self.finish_round(record, started, arrays)
            if should_stop is not None and should_stop(rnd, result):
                flower.stopped_early(rnd)
                self.record.stop_reason = f"should_stop after round {rnd}"
                break
        flower.finished(result)
        if self.ledger is not None and (note := bound_note(self.ledger.accountant, self.ledger)):
            log(INFO, "%s", note)
        return result


def evaluation_due(dp: DPRoundLoop, server_round: int, eval_every: int, num_rounds: int) -> bool:
    """Evaluate every `eval_every` rounds and after the last one (the configured last, or the last the budget
    allows); the legacy adapter asks the same."""
    return server_round % eval_every == 0 or server_round == num_rounds or dp.budget_exhausted()


def ensure_population(dp: DPRoundLoop, count_nodes: Callable[[], int], poll_seconds: float = 1.0) -> None:
    """Before round 1: wait until `count_nodes()` >= min_available_nodes, then fix the population (once)."""
    if dp.ledger is None:
        dp.setup_population(dp.population.wait(count_nodes, poll_seconds))


def unanswered_nodes(replies: Iterable[Message], instructions: Iterable[Message]) -> list:
    """The nodes whose instruction got no reply at all (a hung node at the timeout: no error message comes); by
    message id where the instructions have one, else as many '?' as instructions outnumber replies."""
    replies, instructions = list(replies), list(instructions)
    answered = {m.metadata.reply_to_message_id for m in replies}
    if all(m.metadata.message_id for m in instructions):
        return [m.metadata.dst_node_id for m in instructions if m.metadata.message_id not in answered]
    return ["?"] * max(0, len(instructions) - len(replies))


def failed_nodes_record(replies: Iterable[Message], instructions: Iterable[Message] = ()) -> dict:
    """{"failed_nodes": ["node <id>: <reason>", ...]} for the replies that are errors (the client's own exception
    line, `client_exception`) and the instructions that got no reply (empty if none).

    The node is the instruction's destination (the SuperLink itself answers for a node that went away).
    """
    replies, instructions = list(replies), list(instructions)
    destination = {m.metadata.message_id: m.metadata.dst_node_id for m in instructions}
    failed = [
        f"node {destination.get(m.metadata.reply_to_message_id, m.metadata.src_node_id)}: "
        f"{client_exception(m.error.reason)}"
        for m in replies
        if m.has_error()
    ]
    failed += [f"node {node}: {NO_REPLY}" for node in unanswered_nodes(replies, instructions)]
    return {"failed_nodes": failed} if failed else {}


# `Round r/R: ...`, `Round r: key=...` (R unknown: a legacy strategy without num_rounds), `Finished: ...`
