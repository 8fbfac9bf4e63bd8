"""The one DP round loop that every strategy of this package runs (docs/algorithms.md §0).

`DPRoundLoop` wraps any Flower Message-API strategy (`strategy`, FedAvg by default), as Flower's own DP
wrappers do, and adds what differential privacy needs around it:

1. the population: wait for `min_available_nodes`, then fix M and m (expected clients per round)
   and build the ledger (`make_ledger`, per strategy);
2. sampling: Poisson (each node with probability q) or fixed-size (exactly m), seeded per round;
3. the reply gate: every reply is decoded and checked (`accepted_updates`) before anything reads it;
4. the budget stop: before each round, `budget_exhausted()` may end the run;
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

Client-level DP-FedAvg (`strategies.dp_fedavg`) and sample-level ALI-DPFL
(`strategies.ali_dpfl`) are siblings on this base; they differ in the train config, the
aggregation and the ledger. The legacy adapter (`strategies.legacy`) drives the same methods
from Flower's legacy workflow.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from logging import DEBUG, INFO, WARNING

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, Metadata, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Result, Strategy

from dpcore.privacy import figures
from dpcore.privacy import protocol as keys
from dpcore.privacy.mechanisms import (
    TRUNCATION_PROBABILITY,
    flatten,
    float_indices,
    make_rng,
    noise_share_count,
    truncation_probability,
    unflatten,
    update_problem,
)
from dpcore.privacy.settings import CLIENT_SAMPLINGS, one_of, require

from .reply_gate import MetricRule, read_metrics

RoundCallback = Callable[[dict, dict], None]  # (published record, non-private diagnostics)
CheckpointCallback = Callable[[dict, ArrayRecord], None]

# The round-record keys the ledger covers: the released model's evaluation on server-held data, the
# privacy figures, and what the server derives from public settings or DP outputs (ALI-DPFL's tau and mu).
# Every other key is a raw statistic of client replies, not covered by epsilon (README, "What a run writes").
# Declared with every figure in dpcore/privacy/figures.py.
PUBLISHED_KEYS = figures.published_names()


class DPRoundLoop(Strategy):
    """Sampling, reply gate, budget stop and round record for a DP strategy, around a Flower strategy.

    Parameters
    ----------
    strategy : the wrapped Flower Message-API strategy (FedAvg, FedProx, FedAdam, FedYogi, FedAvgM, a user's
        own); None: FedAvg with `fraction_evaluate` and `min_available_nodes`. Its aggregation and server
        optimizer act on the privatized model; its evaluation settings (fraction_evaluate) are its own.
    sample_rate : q, the probability that a client is sampled in a round.
    client_sampling : "poisson" (each with probability q) or "fixed" (exactly m = round(q M)).
    server_learning_rate : eta_s in w <- w + eta_s * aggregate.
    delta : target delta; 0 means the strategy's default (`default_delta`).
    accountant : the ledger's accountant ("pld", the default, "rdp" or "prv").
    seed, secure_rng : OS entropy for sampling and noise (default), or streams seeded from `seed`
        (reproducible, but then anyone who knows the seed can remove the noise: the printed epsilon
        is marked as no guarantee).
    min_available_nodes : wait for this many connected nodes before round 1.
    fraction_evaluate : fraction of clients evaluating each round (0: none); only with strategy=None (set it
        on the wrapped strategy otherwise).
    publish_diagnostics : also print the non-private diagnostics (counts, norms, rejected replies) in the log;
        by default they go to the `on_round_end` hook's second argument only (diagnostics.jsonl).
    on_round_end : called with each round's (published record, diagnostics) (the run directory, dashboards).
    on_checkpoint : called with (state_dict(), global arrays) after each round, before on_round_end.

    Subclasses implement `make_ledger`, `client_train_config`, `aggregate_train`,
    `privacy_metrics`, `budget_exhausted`, `budget_stop_reason` and `describe`, and declare the
    metrics they read from a train reply in `reply_metric_rules`.
    """

    reply_metric_rules: dict[str, MetricRule] = {}

    def __init__(
        self,
        strategy: Strategy | None = None,
        *,
        sample_rate: float,
        client_sampling: str = "poisson",
        server_learning_rate: float = 1.0,
        delta: float = 0.0,
        accountant: str = "pld",
        seed: int = 0,
        secure_rng: bool = True,
        min_available_nodes: int = 2,
        fraction_evaluate: float | None = None,
        publish_diagnostics: bool = False,
        on_round_end: RoundCallback | None = None,
        on_checkpoint: CheckpointCallback | None = None,
    ) -> None:
        if strategy is None:
            strategy = FedAvg(
                fraction_train=1.0,
                fraction_evaluate=fraction_evaluate or 0.0,
                min_train_nodes=0,
                min_evaluate_nodes=0,
                min_available_nodes=min_available_nodes,
            )
        elif fraction_evaluate is not None:
            raise ValueError(
                f"fraction_evaluate = {fraction_evaluate!r} is set on the wrapped strategy "
                f"({type(strategy).__name__}(fraction_evaluate=...)), not on the DP wrapper"
            )
        if not isinstance(strategy, Strategy):
            raise TypeError(
                f"strategy = {strategy!r}: must be a Flower Message-API strategy "
                "(flwr.serverapp.strategy.Strategy, e.g. FedAvg()); for a legacy flwr.server.strategy "
                "use strategies.legacy.LegacyDPFedAvg"
            )
        self.strategy = strategy
        self.min_available_nodes = min_available_nodes
        require(0 < sample_rate <= 1, "sample_rate", sample_rate, "must be in (0, 1]")
        one_of("client_sampling", client_sampling, CLIENT_SAMPLINGS)
        require(0 <= delta < 1, "delta", delta, "must be in [0, 1) (0: the default delta)")
        self.sample_rate = sample_rate
        self.client_sampling = client_sampling
        self.server_learning_rate = server_learning_rate
        self.requested_delta = delta
        self.accountant = accountant
        self.seed = seed
        self.secure_rng = secure_rng
        self.publish_diagnostics = publish_diagnostics
        self.on_round_end = on_round_end
        self.on_checkpoint = on_checkpoint
        self.completed_rounds = 0
        self.num_clients = 0  # M, set with the population
        self.expected_clients = 0.0  # m
        self.noise_shares = 0  # n_s: the most clients a round keeps (noise_share_count)
        self.round_truncation_probability = 0.0  # P(this round's sample was truncated to n_s)
        self.round_sampled_from: tuple[int, int] | None = None  # fixed-size sampling: m of N nodes this round
        self.round_problems: list[str] = []  # failed and rejected replies of the round in flight (diagnostics)
        self.round_nodes: set[int] | None = None  # the nodes sampled this round (None: not sampled here)
        self.round_population: set[int] = set()  # the nodes connected when this round sampled
        self.round_accepted_nodes: list[int] = []  # the node (SuperLink's id) of each accepted update, in order
        self.ledger = None
        self.stop_reason = ""
        self.history: list[dict] = []
        self.num_rounds = 0
        self.current_arrays: ArrayRecord | None = None  # the global arrays of the round in flight
        self.latest_arrays: ArrayRecord | None = None  # the global arrays after the last completed round
        self.round_global: list[np.ndarray] = []  # the current arrays, decoded (begin_round)
        self.round_global_vector = np.zeros(0, np.float32)  # their floating-point part, flat
        self.float_positions: list[int] = []  # which of the current arrays DP trains and noises (floating point)

    # ------------------------------------------------------------------ the wrapped strategy's keys
    @property
    def arrayrecord_key(self) -> str:
        return getattr(self.strategy, "arrayrecord_key", "arrays")

    @property
    def configrecord_key(self) -> str:
        return getattr(self.strategy, "configrecord_key", "config")

    @property
    def weighted_by_key(self) -> str:
        return getattr(self.strategy, "weighted_by_key", keys.NUM_EXAMPLES)

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
        if self.client_sampling == "fixed":
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
        """Poisson (each with prob. q) or fixed-size (exactly m) sampling, seeded per round; a Poisson
        sample larger than n_s keeps a uniform n_s of it (probability <= 1e-12 for the population the run
        started with; the ledger reserves the round's probability out of delta)."""
        if self.ledger is None:  # sampling needs the population (n_s, delta)
            self.setup_population(len(node_ids))
        rng = make_rng(self.seed, 1, server_round, secure=self.secure_rng)
        nodes = sorted(node_ids)
        self.round_population = set(nodes)
        if self.client_sampling == "fixed":
            self.round_truncation_probability = 0.0
            k = min(len(nodes), int(self.expected_clients))
            self.round_sampled_from = (len(nodes), k)  # (N, m): the ledger's sampling-without-replacement bound
            sampled = pick(rng, nodes, k)
        else:
            self.round_truncation_probability = truncation_probability(len(nodes), self.sample_rate, self.noise_shares)
            sampled = [n for n, u in zip(nodes, rng.random(len(nodes))) if u < self.sample_rate]
            if len(sampled) > self.noise_shares:
                sampled = pick(rng, sampled, self.noise_shares)
        self.round_nodes = {int(n) for n in sampled}
        return sampled

    def next_truncation_probability(self) -> float:
        """What the budget check assumes the next round reserves out of delta."""
        return (
            max(TRUNCATION_PROBABILITY, self.round_truncation_probability) if self.client_sampling == "poisson" else 0.0
        )

    def client_train_config(self, server_round: int) -> dict:
        """What the sampled clients need this round (protocol keys)."""
        raise NotImplementedError

    def begin_round(self, arrays: ArrayRecord) -> None:
        """The global arrays that this round's updates are measured against (a new round: no problems yet)."""
        self.current_arrays = arrays
        self.round_global = arrays.to_numpy_ndarrays()  # decoded once a round, not once per reply
        self.float_positions = float_indices(self.round_global)
        self.round_global_vector = flatten(self.global_arrays())  # what a weights reply's update is taken from
        self.round_problems = []
        self.round_nodes = None

    def global_arrays(self) -> list[np.ndarray]:
        """The floating-point arrays of the round's global model: what DP trains, clips and noises."""
        assert self.current_arrays is not None
        return [self.round_global[i] for i in self.float_positions]

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The wrapped strategy's train content (its config, arrays) with the DP keys, to the nodes sampled here."""
        self.ensure_population(lambda: len(list(grid.get_node_ids())))
        self.begin_round(arrays)
        node_ids = self.sample_clients(server_round, list(grid.get_node_ids()))  # how many: a diagnostic, not logged
        content = self.wrapped_train_content(server_round, arrays, config)
        wrapped_config = content.config_records.get(self.configrecord_key, ConfigRecord())
        content[self.configrecord_key] = ConfigRecord(
            {**dict(wrapped_config), **self.client_train_config(server_round)}
        )
        return [Message(content=content, dst_node_id=int(node), message_type=MessageType.TRAIN) for node in node_ids]

    def wrapped_train_content(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord) -> RecordDict:
        """What the wrapped strategy would send this round (its own sampling is discarded, and so is its log
        line, which counts nodes): asked on a stand-in grid of as many nodes as it waits for, so it never waits."""
        grid = StandInGrid(
            max(1, getattr(self.strategy, "min_available_nodes", 1), getattr(self.strategy, "min_train_nodes", 1))
        )
        with quiet_flower_info():
            messages = list(self.strategy.configure_train(server_round, arrays, ConfigRecord(dict(config)), grid))
        if not messages:
            return RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: ConfigRecord(dict(config))})
        return RecordDict(dict(messages[0].content.items()))

    # ------------------------------------------------------------------ the wrapped strategy's part
    def release(self, server_round: int, new_global: np.ndarray) -> tuple[ArrayRecord, MetricRecord | None]:
        """The privatized model w' (flat, floating-point arrays only) through the wrapped strategy's aggregation
        and server optimizer (post-processing): it receives one reply holding w', so FedAvg returns w' and
        FedAdam steps on w' - w. Keys, order, shapes and dtypes are those the server sent; other arrays come
        back unchanged."""
        assert self.current_arrays is not None
        names = list(self.current_arrays.keys())
        proposal = conform(names, self.round_global, self.float_positions, new_global)
        reply = reply_message(
            0, RecordDict({self.arrayrecord_key: proposal, "metrics": MetricRecord({self.weighted_by_key: 1})})
        )
        with quiet_flower_info():
            arrays, metrics = self.strategy.aggregate_train(server_round, [reply])
        if arrays is None:
            return proposal, metrics
        returned = [arrays[k].numpy() for k in arrays.keys()]
        if list(arrays.keys()) != list(proposal.keys()) or [a.shape for a in returned] != [
            a.shape for a in self.round_global
        ]:
            log(
                WARNING,
                "Round %d: %s returned arrays that do not match the model; the DP average is kept",
                server_round,
                type(self.strategy).__name__,
            )
            return proposal, metrics
        return conform(
            names, self.round_global, self.float_positions, flatten([returned[i] for i in self.float_positions])
        ), metrics

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

    def summary(self) -> None:
        """The wrapped strategy's summary (the DP subclasses add theirs)."""
        log(INFO, "\t├──> Wrapped strategy: %s", type(self.strategy).__name__)
        self.strategy.summary()

    # ------------------------------------------------------------------ the reply gate
    def decode_update(self, content: RecordDict) -> tuple[list[np.ndarray], bool]:
        """(arrays of one reply, whether they are the update): the update itself when the reply is marked
        `UPLOAD_UPDATE` (this project's clients and mod), else the client's new weights (a Flower client's
        reply), whose update is derived. Subclasses decode compressed forms."""
        is_update = any(
            record.get(keys.UPLOAD_KIND) == keys.UPLOAD_UPDATE for record in content.metric_records.values()
        )
        return content[self.arrayrecord_key].to_numpy_ndarrays(), is_update

    def reply_update(self, content: RecordDict) -> tuple[np.ndarray | None, str | None]:
        """(flat update over the floating-point arrays, None) or (None, why the reply cannot be used)."""
        assert self.current_arrays is not None
        arrays, is_update = self.decode_update(content)
        everything = self.round_global
        if len(arrays) != len(everything):
            return None, f"expected {len(everything)} arrays, got {len(arrays)}"
        if not is_update and self.needs_marked_updates():
            return None, (
                "not privatized: under distributed noise the client adds its noise share; add "
                "clients.mods.dp_privatize_mod to the ClientApp's train (a plain weights reply was sent)"
            )
        global_floats = [everything[i] for i in self.float_positions]
        floats = [np.asarray(arrays[i]) for i in self.float_positions]
        problem = update_problem(floats, [a.shape for a in global_floats])
        if problem is None and [np.shape(a) for a in arrays] != [a.shape for a in everything]:
            problem = "a non-floating-point array has the wrong shape"
        if problem:
            return None, problem
        vector = flatten(floats)
        return (vector if is_update else vector - self.round_global_vector), None

    def needs_marked_updates(self) -> bool:
        """Whether only privatized (marked) updates may be averaged in (distributed noise)."""
        return False

    def accepted_updates(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[list[tuple[np.ndarray, dict]], int, int]:
        """(flat update, checked metrics) of every reply that passes the gate (`strategies.reply_gate`),
        and the counts of failed and rejected replies. Nothing in a reply can raise here.

        Who replied is the SuperLink's word (the reply's `src_node_id`), never the client's: a reply from a node this
        round did not sample, or a second reply from one node, is rejected. `round_accepted_nodes` lists the node of
        each accepted update."""
        accepted, failures, rejected = [], 0, 0
        self.round_accepted_nodes = []
        seen: set[int] = set()
        for msg in replies:
            node = int(msg.metadata.src_node_id)
            if not msg.has_error() and (self.round_nodes is not None and node not in self.round_nodes or node in seen):
                rejected += 1
                self.note_problem(
                    server_round,
                    f"rejected a reply of node {node}: "
                    + ("a second reply" if node in seen else "not sampled this round"),
                )
                continue
            if msg.has_error():
                failures += 1
                self.note_problem(server_round, f"node {msg.metadata.src_node_id} failed: {msg.error.reason}")
                continue
            try:
                vector, problem = self.reply_update(msg.content)
                if problem is None:
                    metrics, problem = read_metrics(msg.content, self.reply_metric_rules)
                if problem is None:
                    problem = self.upload_problem(vector, metrics)
            except Exception as exc:  # malformed content of any kind
                problem = f"undecodable reply ({type(exc).__name__}: {exc})"
            if problem:
                rejected += 1
                self.note_problem(server_round, f"rejected the reply of node {msg.metadata.src_node_id}: {problem}")
                continue
            seen.add(node)
            accepted.append((vector, metrics))
            self.round_accepted_nodes.append(node)
        return accepted, failures, rejected

    def note_problem(self, server_round: int, problem: str) -> None:
        """A failed or rejected reply: into the round's diagnostics (`problems`), and into the log only with
        publish_diagnostics (how many replies failed is a count of participants: not covered by epsilon)."""
        self.round_problems.append(problem)
        log(WARNING if self.publish_diagnostics else DEBUG, "Round %d: %s", server_round, problem)

    def upload_problem(self, vector: np.ndarray, metrics: dict) -> str | None:
        """Why a well-formed upload is still refused (e.g. above the norm bound), else None."""
        return None

    # ------------------------------------------------------------------ budget and record
    def privacy_metrics(self) -> dict:
        raise NotImplementedError

    def budget_exhausted(self) -> bool:
        """Would the next round spend more than the budget allows?"""
        return False

    def budget_stop_reason(self, server_round: int) -> str:
        raise NotImplementedError

    def evaluation_due(self, server_round: int, eval_every: int, num_rounds: int) -> bool:
        """Evaluate every `eval_every` rounds and after the last one (the configured last, or the last the
        budget allows)."""
        return server_round % eval_every == 0 or server_round == num_rounds or self.budget_exhausted()

    def round_details(self) -> dict:
        """Entries for the round record that are not metrics (MetricRecord holds numbers only)."""
        return {"problems": list(self.round_problems)} if self.round_problems else {}

    def published_keys(self) -> frozenset:
        """The round-record keys the ledger covers for this strategy."""
        return PUBLISHED_KEYS

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
        log(INFO, "Round %d/%d: %s", record["round"], self.num_rounds, line)
        if self.on_round_end:
            self.on_round_end(published, diagnostics)

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict:
        """Everything a resumed run needs, JSON-serializable (the ledger's own state included)."""
        return {
            "completed_rounds": self.completed_rounds,
            "history": self.history,
            "stop_reason": self.stop_reason,
            "num_clients": self.num_clients,
            "expected_clients": self.expected_clients,
            "noise_shares": self.noise_shares,
            "ledger": None if self.ledger is None else self.ledger.state_dict(),
            **self.extra_state(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue after `state["completed_rounds"]` with the ledger as it was then."""
        self.completed_rounds = int(state["completed_rounds"])
        self.history = list(state["history"])
        self.stop_reason = state["stop_reason"]
        self.num_clients, self.expected_clients = int(state["num_clients"]), float(state["expected_clients"])
        self.noise_shares = int(state["noise_shares"])
        self.ledger = None if state["ledger"] is None else self.ledger_from_state(state["ledger"])
        self.load_extra_state(state)

    def extra_state(self) -> dict:
        """The strategy's own state beyond the round loop's."""
        return {}

    def load_extra_state(self, state: dict) -> None:
        pass

    def ledger_from_state(self, state: dict):
        raise NotImplementedError

    def client_evaluation_record(self, metrics: MetricRecord) -> dict:
        """How the clients' aggregated evaluation metrics appear in the round's record."""
        return {f"client_{k}": v for k, v in metrics.items()}

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
        eval_every: int = 1,
    ) -> Result:
        """Flower's round loop, plus: stop on the privacy budget, one record per round. `evaluate_fn` and the
        clients' evaluation run every `eval_every` rounds and after the last round (the configured last, or the
        last the budget allows)."""
        self.set_num_rounds(num_rounds)
        log(INFO, "Starting %s strategy:", type(self).__name__)
        self.summary()
        train_config = train_config or ConfigRecord()
        evaluate_config = evaluate_config or ConfigRecord()
        result, arrays = Result(), initial_arrays
        if evaluate_fn and not self.completed_rounds and (res := evaluate_fn(0, arrays)) is not None:
            result.evaluate_metrics_serverapp[0] = res
        self.ensure_population(lambda: len(list(grid.get_node_ids())))
        self.stop_reason = "num-rounds reached"
        if self.completed_rounds:
            log(
                INFO,
                "Resuming after round %d (ledger: epsilon %s so far)",
                self.completed_rounds,
                self.privacy_metrics().get("epsilon"),
            )
        for rnd in range(self.completed_rounds + 1, num_rounds + 1):
            if self.budget_exhausted():
                self.stop_reason = self.budget_stop_reason(rnd)
                log(WARNING, "Stopping before round %d: %s", rnd, self.stop_reason)
                break
            started = time.perf_counter()
            instructions = list(self.configure_train(rnd, arrays, train_config, grid))
            replies = list(grid.send_and_receive(instructions, timeout=timeout))
            arrays, train_metrics = self.aggregate_train(rnd, replies)
            result.arrays = arrays
            result.train_metrics_clientapp[rnd] = train_metrics
            record = {"round": rnd, **dict(train_metrics), **failed_nodes_record(replies, instructions)}
            if missing := unanswered_nodes(replies, instructions):  # hung or gone at the timeout: failures too
                record["failures"] = int(record.get("failures", 0)) + len(missing)
                for node in missing:
                    self.note_problem(rnd, f"node {node} failed: {NO_REPLY}")
            due = self.evaluation_due(rnd, eval_every, num_rounds)
            eval_msgs = self.configure_evaluate(rnd, arrays, evaluate_config, grid) if due else []
            if eval_msgs:
                client_eval = self.aggregate_evaluate(rnd, grid.send_and_receive(eval_msgs, timeout=timeout))
                if client_eval is not None:
                    result.evaluate_metrics_clientapp[rnd] = client_eval
                    record.update(self.client_evaluation_record(client_eval))
            if evaluate_fn and due and (res := evaluate_fn(rnd, arrays)) is not None:
                result.evaluate_metrics_serverapp[rnd] = res
                record.update(dict(res))
            self.finish_round(record, started, arrays)
        return result

    def guarantee_caveats(self) -> list[str]:
        """Why the printed epsilon is not a guarantee (empty: it is one)."""
        if not self.secure_rng:
            return ["noise derivable from the seed (secure-rng = false): anyone who knows 'seed' can remove it"]
        return []

    def server_guarantee_caveats(self) -> list[str]:
        """Why `epsilon_against_server` is not a guarantee (empty: it is one, or there is no such figure)."""
        return []

    def guarantee_marks(self) -> dict:
        """What every per-round output carries when a figure beside it is not a guarantee (metrics.jsonl, the
        round's log line, TensorBoard and W&B, whose tags then say so): nothing when both are guarantees."""
        marks = {}
        if self.guarantee_caveats():
            marks["epsilon_is_guarantee"] = False
        if self.server_guarantee_caveats():
            marks["epsilon_against_server_is_guarantee"] = False
        if self.publishes_claimed_epsilon():
            marks["claimed_epsilon_is_guarantee"] = False
        return marks

    def publishes_claimed_epsilon(self) -> bool:
        """Whether the rounds publish a paper's claimed epsilon beside the true one (wavelet noise under `paper`
        calibration): that figure is no guarantee."""
        return False

    def describe_diagnostics(self) -> dict:
        """End-of-run figures computed from raw client replies (diagnostics-summary.json, not private)."""
        rounds = [r for r in self.history if "problems" in r]
        return {"rounds_with_failed_or_rejected_replies": [r["round"] for r in rounds]} if rounds else {}

    def describe_sampling(self) -> dict:
        """The summary.json entries every DP strategy shares."""
        caveats, server_caveats = self.guarantee_caveats(), self.server_guarantee_caveats()
        server = (
            {"epsilon_against_server_is_guarantee": False, "epsilon_against_server_caveats": server_caveats}
            if server_caveats
            else {}
        )
        return {
            **server,
            "wrapped_strategy": type(self.strategy).__name__,
            "client_sampling_rate": self.sample_rate,
            "client_sampling": self.client_sampling,
            "num_clients": self.num_clients,
            "expected_clients_per_round": self.expected_clients,
            "accountant": self.accountant,
            "stop_reason": self.stop_reason,
            "secure_rng": self.secure_rng,
            "epsilon_is_guarantee": not caveats,
            "epsilon_caveats": caveats,
        }


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


LOG_KEYS = figures.round_line_names()
DIAGNOSTIC_LOG_KEYS = figures.round_line_names(published=False)


DIAGNOSTICS_MARK = "  | not private: "  # what follows it on a log line is not covered by epsilon
LOG_LINE = re.compile(r"(?:Round (\d+)/\d+|Finished): (.*)$")


def format_record(record: dict, keys: tuple[str, ...] = LOG_KEYS) -> str:
    """`key=value` for the keys present (None left out), numbers to 4 significant digits, two spaces apart."""
    return "  ".join(
        f"{k}={record[k]:.4g}" if isinstance(record[k], float) else f"{k}={record[k]}"
        for k in keys
        if record.get(k) is not None
    )


def parse_log_line(line: str) -> tuple[dict, dict] | None:
    """(published values, diagnostics) of a `Round r/R: ...` line (with `round`) or of the run's `Finished: ...`
    line as `flwr log` prints them (a prefix such as Flower's `INFO :` is allowed); None for any other line.
    Keys are those of metrics.jsonl (Finished: summary.json), after DIAGNOSTICS_MARK diagnostics.jsonl's;
    numbers come back to the line's 4 significant digits."""
    match = LOG_LINE.search(line.rstrip())
    if match is None:
        return None

    def value(v: str):
        if v in ("True", "False"):  # the not-a-guarantee marks
            return v == "True"
        return int(v) if v.lstrip("-").isdigit() else float(v)

    def values(text: str) -> dict:
        pairs = (item.split("=", 1) for item in text.split())
        return {k: value(v) for k, v in pairs}

    published, _, diagnostics = match.group(2).partition(DIAGNOSTICS_MARK.strip())
    round_number = {"round": int(match.group(1))} if match.group(1) else {}
    return {**round_number, **values(published)}, values(diagnostics)


# ---------------------------------------------------------------------------- helpers of the wrapper
def pick(rng: np.random.Generator, node_ids: list[int], k: int) -> list[int]:
    """k of the node ids uniformly without replacement, sorted. Indices are drawn, not the ids: numpy would
    hold Flower's 64-bit node ids as floats and return ids of nodes that do not exist."""
    return sorted(node_ids[i] for i in rng.choice(len(node_ids), size=k, replace=False))


def conform(names: list[str], template: list[np.ndarray], positions: list[int], vector: np.ndarray) -> ArrayRecord:
    """The arrays `template` (named `names`) with those at `positions` replaced by consecutive slices of `vector`,
    in their own dtype: same keys in the same order, same shapes and dtypes."""
    everything = list(template)
    parts = unflatten(np.asarray(vector), [everything[i].shape for i in positions])
    for i, part in zip(positions, parts):
        everything[i] = part.astype(everything[i].dtype, copy=False)
    return ArrayRecord({name: Array(np.asarray(a, order="C")) for name, a in zip(names, everything)})


class StandInGrid:
    """Just enough of a Grid for a wrapped strategy's configure_train to write its content: `n` node ids."""

    def __init__(self, n: int) -> None:
        self.n = n

    def get_node_ids(self) -> list[int]:
        return list(range(1, self.n + 1))


class FlowerInfoFilter(logging.Filter):
    """Drops Flower's INFO lines (a wrapped strategy's "Sampled N nodes", "Received N results"): they count
    nodes, which epsilon does not cover. Warnings and errors pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING


@contextmanager
def filtered_flower_log(log_filter: logging.Filter, enabled: bool = True):
    """While active (and `enabled`), the flwr logger passes its records through `log_filter`."""
    flower_logger = logging.getLogger("flwr")
    if enabled:
        flower_logger.addFilter(log_filter)
    try:
        yield
    finally:
        flower_logger.removeFilter(log_filter)


def quiet_flower_info(enabled: bool = True):
    """While active (and `enabled`), the flwr logger drops INFO lines (`FlowerInfoFilter`)."""
    return filtered_flower_log(FlowerInfoFilter(), enabled)


def reply_message(node_id: int, content: RecordDict | None = None, error=None) -> Message:
    """A reply Message from `node_id`, as a Message-API strategy's aggregate_train expects one."""
    metadata = Metadata(
        run_id=0,
        message_id="",
        src_node_id=node_id,
        dst_node_id=0,
        reply_to_message_id="",
        group_id="",
        created_at=time.time(),
        ttl=0.0,
        message_type=MessageType.TRAIN,
    )
    return Message(content, metadata=metadata) if error is None else Message(error, metadata=metadata)
