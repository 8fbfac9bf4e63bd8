"""The one DP round loop that every strategy of this package runs (docs/algorithms.md §0).

`DPRoundLoop` wraps any Flower Message-API strategy (`strategy`, FedAvg by default), as Flower's own DP
wrappers do, and adds what differential privacy needs around it:

1. the population: wait for `min_available_nodes`, then fix M and m (expected clients per round)
   and build the ledger (`make_ledger`, per strategy);
2. sampling: Poisson (each node with probability q, n_s re-derived for the round's population) or
   fixed-size (exactly m), seeded per round;
3. the reply gate (`gate`, an object it holds): every reply decoded and checked before anything reads it;
4. the budget stop: once a round has sampled and before anything is sent, `budget_exhausted()` at the
   round's own (N, m) and truncation probability may refuse it and end the run;
5. the round record: one dict per round in `history`, the `on_checkpoint` hook (the strategy's
   whole state and the global arrays, written before anything of the round is published), then
   the record split in two (`split_record`): what the ledger covers (`PUBLISHED_KEYS`: evaluation
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

from dpfl.dpcore.privacy import figures
from dpfl.dpcore.privacy.mechanisms import noise_share_count
from dpfl.dpcore.privacy.modes import ClientSamplingMode
from dpfl.dpcore.privacy.settings import CLIENT_SAMPLINGS, one_of, require
from dpfl.strategies.loop.dp_round import DPRound
from dpfl.strategies.loop.flower_log import FlowerLog
from dpfl.strategies.loop.log_line import DIAGNOSTIC_LOG_KEYS, DIAGNOSTICS_MARK, format_record
from dpfl.strategies.loop.options import RunOptions, SamplingOptions, refuse_more_than_connected
from dpfl.strategies.loop.reply_gate import ReplyGate
from dpfl.strategies.loop.run_record import RunRecord, bound_note
from dpfl.strategies.loop.wrapped import (
    OWN_AGGREGATE_TRAIN,
    UnusedSamplingLines,
    filtered_flower_log,
    own_aggregate_train,
    quiet_flower_info,
    wrapped_train_content,
)
from dpfl.strategies.parts.part import DenseCodec, Part
from dpfl.strategies.parts.reply_rules import MetricRule
from dpfl.strategies.parts.sampling import ClientSampling, covering_noise_shares

RoundCallback = Callable[[dict, dict], None]  # (published record, non-private diagnostics)
CheckpointCallback = Callable[[dict, ArrayRecord], None]

# The round-record keys the ledger covers: the released model's evaluation on server-held data, the
# privacy figures, and what the server derives from public settings or DP outputs (ALI-DPFL's tau and mu).
# Every other key is a raw statistic of client replies, not covered by epsilon (README, "What a run writes").
# Declared with every figure in dpcore/privacy/figures.py.
PUBLISHED_KEYS = figures.published_names()


class DPRoundLoop(RunRecord, Strategy):
    """Sampling, reply gate, budget stop and round record for a DP strategy, around a Flower strategy.

    Parameters
    ----------
    strategy : the wrapped Flower Message-API strategy (FedAvg, FedProx, FedAdam, FedYogi, FedAvgM, a user's
        own); None: FedAvg with `fraction_evaluate` and `min_available_nodes`. Its aggregation and server
        optimizer act on the privatized model; its evaluation settings (fraction_evaluate) are its own.
    sampling : q, Poisson or fixed-size sampling, the nodes to wait for (`strategies.loop.options.SamplingOptions`).
    run : eta_s, the randomness, evaluation, outputs and hooks (`strategies.loop.options.RunOptions`).
    delta : target delta; 0 means the strategy's default (`default_delta`).
    accountant : the ledger's accountant ("pld", the default, "rdp" or "prv").
    selection : who is sent the train message (the selection role); None: `sampling`'s Poisson or fixed-size.

    Subclasses implement `make_ledger`, `client_train_config`, `aggregate_train`,
    `privacy_metrics`, `budget_exhausted`, `budget_stop_reason` and `describe`, and declare the
    metrics they read from a train reply in `reply_metric_rules`.
    """

    reply_metric_rules: dict[str, MetricRule] = {}  # the metrics a train reply must hold (each strategy's own)

    def __init__(
        self,
        strategy: Strategy | None,
        *,
        sampling: SamplingOptions,
        run: RunOptions,
        delta: float = 0.0,
        accountant: str = "pld",
        selection: Part | None = None,
        parts: list[Part] = (),
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
                "use strategies.legacy.adapter.LegacyDPFedAvg"
            )
        self.strategy = strategy
        self.name = type(
            self
        ).__name__  # in the log (a preset names itself: strategies.parts.topk, strategies.parts.wavelet)
        self.min_available_nodes = sampling.min_available_nodes
        require(0 < sampling.sample_rate <= 1, "sample_rate", sampling.sample_rate, "must be in (0, 1]")
        one_of("client_sampling", sampling.client_sampling, CLIENT_SAMPLINGS)
        require(0 <= delta < 1, "delta", delta, "must be in [0, 1) (0: the default delta)")
        require(
            sampling.num_sampled_clients == 0 or sampling.client_sampling == ClientSamplingMode.FIXED,
            "num_sampled_clients",
            sampling.num_sampled_clients,
            "is a fixed-size sample: only with client_sampling = 'fixed'",
        )
        require(sampling.num_sampled_clients >= 0, "num_sampled_clients", sampling.num_sampled_clients, "must be >= 0")
        self.sample_rate = sampling.sample_rate
        self.client_sampling = sampling.client_sampling
        self.num_sampled_clients = sampling.num_sampled_clients  # m given (Flower's wrappers); 0: round(q M)
        self.selection = selection or ClientSampling(sampling.client_sampling)
        self.codec = DenseCodec()
        self.parts = list(parts)  # the optional pieces of the round (strategies.parts.part), in the order they run
        self.server_learning_rate = run.server_learning_rate
        self.requested_delta = delta
        self.accountant = accountant
        self.seed = run.seed
        self.secure_rng = run.secure_rng
        self.publish_diagnostics = run.publish_diagnostics
        self.gate = ReplyGate(self.reply_metric_rules, run.publish_diagnostics)  # a subclass may build its own
        self.on_round_end = run.on_round_end
        self.on_checkpoint = run.on_checkpoint
        self.completed_rounds = 0
        self.num_clients = 0  # M, set with the population
        self.expected_clients = 0.0  # m
        self.noise_shares = 0  # n_s: the most clients a round keeps (noise_share_count)
        self.round = DPRound()  # the round in flight (begin_round starts a new one)
        self.ledger = None
        self.stop_reason = ""
        self.history: list[dict] = []
        self.num_rounds = 0
        self.latest_arrays: ArrayRecord | None = None  # the global arrays after the last completed round

    # ------------------------------------------------------------------ the wrapped strategy's keys
    @property
    def arrayrecord_key(self) -> str:
        return getattr(self.strategy, "arrayrecord_key", "arrays")

    @property
    def configrecord_key(self) -> str:
        return getattr(self.strategy, "configrecord_key", "config")

    @property
    def fraction_evaluate(self) -> float:
        return float(getattr(self.strategy, "fraction_evaluate", 0.0))

    # ------------------------------------------------------------------ population
    def default_delta(self, num_clients: int) -> float:
        """delta when none is configured."""
        raise NotImplementedError

    def make_ledger(self, delta: float):
        """The strategy's privacy ledger (built once the population is known)."""
        raise NotImplementedError

    def setup_population(self, num_clients: int) -> None:
        """Fix M, m, n_s and delta, and build the ledger."""
        self.num_clients = num_clients
        if self.num_sampled_clients:  # m given: q = m / M
            refuse_more_than_connected(self.num_sampled_clients, num_clients, self.min_available_nodes)
            self.sample_rate = self.num_sampled_clients / num_clients
        if self.client_sampling == ClientSamplingMode.FIXED:
            self.expected_clients = float(max(1, round(self.sample_rate * num_clients)))
        else:
            self.expected_clients = self.sample_rate * num_clients
        self.noise_shares = noise_share_count(num_clients, self.sample_rate, self.client_sampling)
        delta = self.requested_delta if self.requested_delta > 0 else self.default_delta(num_clients)
        self.ledger = self.make_ledger(delta)

    def ensure_population(self, count_nodes: Callable[[], int], poll_seconds: float = 1.0) -> None:
        """Before round 1: wait until `count_nodes()` >= min_available_nodes, then `setup_population`."""
        if self.ledger is not None:
            return
        while (available := count_nodes()) < self.min_available_nodes:
            log(INFO, "Waiting for nodes: %d connected, %d required", available, self.min_available_nodes)
            time.sleep(poll_seconds)
        self.setup_population(available)

    def set_num_rounds(self, num_rounds: int) -> None:
        """R_s, the number of rounds the run is configured for (calibration and ALI-DPFL need it)."""
        self.num_rounds = int(num_rounds)

    # ------------------------------------------------------------------ train
    def sample_clients(self, server_round: int, node_ids: list[int]) -> list[int]:
        """The nodes the selection role picks this round (`strategies.parts.sampling`), noted in the round; n_s first
        covers the round's population (`covering_noise_shares`). Then, before anything is sent, the budget is
        checked at the round's own (N, m) and truncation probability: a round that would spend more than the
        budget allows is refused (`round.refused`, `stop_reason` says why) and no node is returned."""
        if self.ledger is None:  # sampling needs the population (n_s, delta)
            self.setup_population(len(node_ids))
        self.noise_shares = covering_noise_shares(self, len(node_ids))
        selection = self.selection.select(self, server_round, node_ids)
        self.round.population = set(sorted(node_ids))
        self.round.truncation_probability, self.round.sampled_from = (
            selection.truncation_probability,
            selection.sampled_from,
        )
        self.round.nodes = {int(n) for n in selection.nodes}
        if self.budget_exhausted():
            self.round.refused = True
            self.stop_reason = self.budget_stop_reason(server_round)
            log(WARNING, "Stopping before round %d: %s", server_round, self.stop_reason)
            return []
        return selection.nodes

    def client_train_config(self, server_round: int) -> dict:
        """What the sampled clients need this round (protocol keys)."""
        raise NotImplementedError

    def begin_round(self, arrays: ArrayRecord) -> None:
        """A new round (`DPRound`): the global arrays that its updates are measured against, no problems yet."""
        self.round = DPRound.starting(arrays)

    @property
    def current_arrays(self) -> ArrayRecord | None:
        """The global arrays of the round in flight."""
        return self.round.arrays

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The wrapped strategy's train content (its config, arrays) with the DP keys, to the nodes sampled here."""
        self.ensure_population(lambda: len(list(grid.get_node_ids())))
        self.begin_round(arrays)
        node_ids = self.sample_clients(server_round, list(grid.get_node_ids()))  # how many: a diagnostic
        if self.round.refused:
            return []
        content = wrapped_train_content(self, server_round, arrays, config)
        wrapped_config = content.config_records.get(self.configrecord_key, ConfigRecord())
        content[self.configrecord_key] = ConfigRecord(
            {**dict(wrapped_config), **self.client_train_config(server_round)}
        )
        for part in self.parts:
            part.round_begun(self)
        return [Message(content=content, dst_node_id=int(node), message_type=MessageType.TRAIN) for node in node_ids]

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The wrapped strategy's federated evaluation (its counts are not logged: see `quiet_flower_info`)."""
        with quiet_flower_info(not self.publish_diagnostics):
            return list(self.strategy.configure_evaluate(server_round, arrays, config, grid))

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """The wrapped strategy's evaluation aggregate (a non-private diagnostic); a malformed reply is dropped
        with a logged reason, never raised."""
        replies = list(replies)
        try:
            with quiet_flower_info(not self.publish_diagnostics):
                return self.strategy.aggregate_evaluate(server_round, replies)
        except Exception as exc:  # a hostile evaluation reply must not end the run
            self.note_problem(server_round, f"client evaluation not aggregated ({type(exc).__name__}: {exc})")
            return None

    def note_problem(self, server_round: int, problem: str) -> None:
        """A failed or rejected reply, or a client figure not aggregated: into the round's diagnostics (`gate.note`)."""
        self.gate.note(self.round, server_round, problem)

    def summary(self) -> None:
        """The wrapped strategy's summary, less its train-sampling lines, which the wrapper replaces with its own
        (the DP subclasses add theirs)."""
        log(
            INFO,
            "\t├──> Wrapped strategy: %s (the DP wrapper samples the train rounds: its fraction_train and "
            "min_train_nodes are not used; its evaluation is, fraction_evaluate=%.2f)",
            type(self.strategy).__name__,
            self.fraction_evaluate,
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

    def published_keys(self) -> frozenset:
        """The round-record keys the ledger covers for this strategy (and what its parts add or withdraw)."""
        published = PUBLISHED_KEYS
        for part in self.parts:
            published = part.publish(published)
        return published

    def split_record(self, record: dict) -> tuple[dict, dict]:
        """(what the ledger covers, the non-private diagnostics with the round number)."""
        published = self.published_keys()
        return (
            {k: v for k, v in record.items() if k in published},
            {"round": record["round"], **{k: v for k, v in record.items() if k not in published}},
        )

    def finish_round(self, record: dict, started: float, arrays: ArrayRecord) -> None:
        """The round's record is complete: seconds, history, the checkpoint, one log line, on_round_end."""
        record.update(self.round_details())
        record.update(self.guarantee_marks())
        record["seconds"] = time.perf_counter() - started
        self.history.append(record)
        self.completed_rounds = int(record["round"])
        self.latest_arrays = arrays
        if self.on_checkpoint:
            self.on_checkpoint(self.state_dict(), arrays)
        published, diagnostics = self.split_record(record)
        line = format_record(published)
        if self.publish_diagnostics:
            line += DIAGNOSTICS_MARK + format_record(diagnostics, DIAGNOSTIC_LOG_KEYS)
        total = f"/{self.num_rounds}" if self.num_rounds > 0 else ""  # unknown to a legacy strategy without num_rounds
        log(INFO, "Round %d%s: %s", record["round"], total, line)
        self.gate.warn(self.round, record)
        if self.on_round_end:
            self.on_round_end(published, diagnostics)

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
        self.set_num_rounds(num_rounds)
        flower = FlowerLog(self)  # Flower's own lines, as Strategy.start prints them
        flower.start(num_rounds, initial_arrays, train_config, evaluate_config)
        for part in self.parts:
            part.see_model(self, initial_arrays)
        train_config, evaluate_config = train_config or ConfigRecord(), evaluate_config or ConfigRecord()
        result, arrays = Result(arrays=initial_arrays), initial_arrays  # Flower 1.43: the initial model until a round
        if evaluate_fn and not self.completed_rounds:
            flower.initial_evaluation(evaluate_fn, arrays, result)
        self.ensure_population(lambda: len(list(grid.get_node_ids())))
        self.stop_reason = "num-rounds reached"
        if self.completed_rounds:
            epsilon = self.privacy_metrics().get("epsilon")
            log(INFO, "Resuming after round %d (ledger: epsilon %s so far)", self.completed_rounds, epsilon)
        for rnd in range(self.completed_rounds + 1, num_rounds + 1):
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
                    self.note_problem(rnd, f"node {node} failed: {NO_REPLY}")
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
                self.stop_reason = f"should_stop after round {rnd}"
                break
        flower.finished(result)
        if self.ledger is not None and (note := bound_note(self.accountant, self.ledger)):
            log(INFO, "%s", note)
        return result


def evaluation_due(dp: DPRoundLoop, server_round: int, eval_every: int, num_rounds: int) -> bool:
    """Evaluate every `eval_every` rounds and after the last one (the configured last, or the last the budget
    allows); the legacy adapter asks the same."""
    return server_round % eval_every == 0 or server_round == num_rounds or dp.budget_exhausted()


NO_REPLY = "no reply before round-timeout"


def unanswered_nodes(replies: Iterable[Message], instructions: Iterable[Message]) -> list:
    """The nodes whose instruction got no reply at all (a hung node at the timeout: no error message comes); by
    message id where the instructions have one, else as many '?' as instructions outnumber replies."""
    replies, instructions = list(replies), list(instructions)
    answered = {m.metadata.reply_to_message_id for m in replies}
    if all(m.metadata.message_id for m in instructions):
        return [m.metadata.dst_node_id for m in instructions if m.metadata.message_id not in answered]
    return ["?"] * max(0, len(instructions) - len(replies))


def failed_nodes_record(replies: Iterable[Message], instructions: Iterable[Message] = ()) -> dict:
    """{"failed_nodes": ["node <id>: <reason>", ...]} for the replies that are errors and the instructions that
    got no reply (empty if none).

    The node is the instruction's destination (the SuperLink itself answers for a node that went away).
    """
    replies, instructions = list(replies), list(instructions)
    destination = {m.metadata.message_id: m.metadata.dst_node_id for m in instructions}
    failed = [
        f"node {destination.get(m.metadata.reply_to_message_id, m.metadata.src_node_id)}: {m.error.reason}"
        for m in replies
        if m.has_error()
    ]
    failed += [f"node {node}: {NO_REPLY}" for node in unanswered_nodes(replies, instructions)]
    return {"failed_nodes": failed} if failed else {}


# `Round r/R: ...`, `Round r: key=...` (R unknown: a legacy strategy without num_rounds), `Finished: ...`
