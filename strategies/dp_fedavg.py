"""DP-FedAvg / DP-FedSAM server strategy on Flower's Message API (ALGORITHMS.md section 0).

Clients upload the model update Delta_i = w_i - w_global. The server

1. samples clients (`poisson`: each with probability q; `fixed`: exactly m = qM),
2. rejects malformed or non-finite updates (logged, counted, never averaged in),
3. `central`: clips each update to C and adds N(0, sigma^2 C^2 I) to the sum;
   `distributed`: clients clipped and added N(0, sigma^2 C^2 / m I) each; the server
   tops the noise up by N(0, sigma^2 C^2 (m - k)/m I) when only k < m updates arrived,
4. divides by the fixed m (uniform average) and steps w <- w + eta_s * average,
5. charges one sampled-Gaussian event (sigma, q) to the ledger and reports epsilon.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from logging import INFO, WARNING

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Result
from flwr.supercore import log

from fl_app.privacy.ledger import ClientLevelLedger, calibrate_noise_multiplier
from fl_app.privacy.mechanisms import (
    clip_to_norm,
    distributed_noise_std,
    flatten,
    gaussian_noise,
    make_rng,
    topup_noise_std,
    unflatten,
    update_problem,
)

NOISE_PLACEMENTS = ("central", "distributed")
CLIENT_SAMPLINGS = ("poisson", "fixed")
TARGET_EPSILON_MODES = ("stop", "calibrate")

RoundCallback = Callable[[dict], None]


class DPFedAvg(FedAvg):
    """Client-level DP federated averaging with clipping, Gaussian noise and a privacy ledger.

    Parameters
    ----------
    sample_rate : q, the probability that a client is sampled in a round.
    clipping_norm : C, bound on the global L2 norm of each update (0: no clipping,
        only with noise_multiplier = 0, for the non-private reference).
    noise_multiplier : sigma (0: no noise, epsilon = inf).
    noise_placement : "central" (trusted server adds the noise) or "distributed".
    client_sampling : "poisson" or "fixed" (exactly m without replacement; accounted
        as Poisson with the same q, an approximation stated in the summary).
    delta : target delta; 0 means 1/M.
    target_epsilon, target_epsilon_mode : "stop" before a round would exceed the
        target, or "calibrate" sigma up front for the configured number of rounds.
    secure_aggregation : the server only ever sees the sum (SecAgg+); changes the
        "against the server" figure only.
    """

    def __init__(self, *, sample_rate: float, clipping_norm: float, noise_multiplier: float,
                 noise_placement: str = "central", client_sampling: str = "poisson",
                 server_learning_rate: float = 1.0, delta: float = 0.0, accountant: str = "rdp",
                 target_epsilon: float = 0.0, target_epsilon_mode: str = "stop",
                 secure_aggregation: bool = False, seed: int = 0, secure_rng: bool = False,
                 min_available_nodes: int = 2, fraction_evaluate: float = 0.0,
                 on_round_end: RoundCallback | None = None) -> None:
        super().__init__(fraction_train=sample_rate, fraction_evaluate=fraction_evaluate,
                         min_train_nodes=0, min_evaluate_nodes=0, min_available_nodes=min_available_nodes)
        validate_dp_settings(sample_rate=sample_rate, clipping_norm=clipping_norm,
                             noise_multiplier=noise_multiplier, noise_placement=noise_placement,
                             client_sampling=client_sampling, target_epsilon=target_epsilon,
                             target_epsilon_mode=target_epsilon_mode, delta=delta)
        self.sample_rate = sample_rate
        self.clipping_norm = clipping_norm
        self.noise_multiplier = noise_multiplier
        self.noise_placement = noise_placement
        self.client_sampling = client_sampling
        self.server_learning_rate = server_learning_rate
        self.requested_delta = delta
        self.accountant = accountant
        self.target_epsilon = target_epsilon
        self.target_epsilon_mode = target_epsilon_mode
        self.secure_aggregation = secure_aggregation
        self.seed = seed
        self.secure_rng = secure_rng
        self.on_round_end = on_round_end
        # Set when the population is known (first round).
        self.num_clients = 0
        self.expected_clients = 0.0
        self.ledger: ClientLevelLedger | None = None
        self.stop_reason = ""
        self.history: list[dict] = []
        self._global: ArrayRecord | None = None
        self._num_rounds = 0

    # ------------------------------------------------------------------ set-up
    def setup_population(self, num_clients: int) -> None:
        """Fix M, m = qM, delta (default 1/M) and, for `calibrate`, sigma."""
        self.num_clients = num_clients
        if self.client_sampling == "fixed":
            self.expected_clients = float(max(1, round(self.sample_rate * num_clients)))
        else:
            self.expected_clients = self.sample_rate * num_clients
        delta = self.requested_delta if self.requested_delta > 0 else 1.0 / num_clients
        if self.target_epsilon > 0 and self.target_epsilon_mode == "calibrate":
            self.noise_multiplier = calibrate_noise_multiplier(
                self.target_epsilon, delta, self.sample_rate, max(1, self._num_rounds), self.accountant)
            log(INFO, "Calibrated noise multiplier %.4f for epsilon %.3g after %d rounds",
                self.noise_multiplier, self.target_epsilon, self._num_rounds)
        self.ledger = ClientLevelLedger(delta, self.accountant, self.noise_placement, self.secure_aggregation)

    def summary(self) -> None:
        log(INFO, "\t├──> Client-level DP (%s)", type(self).__name__)
        log(INFO, "\t│\t├── q=%.4g  C=%.4g  sigma=%.4g  noise=%s  sampling=%s",
            self.sample_rate, self.clipping_norm, self.noise_multiplier, self.noise_placement,
            self.client_sampling)
        log(INFO, "\t│\t└── accountant=%s  target_epsilon=%s (%s)", self.accountant,
            self.target_epsilon or "none", self.target_epsilon_mode)

    # ------------------------------------------------------------------ train
    def sample_clients(self, server_round: int, node_ids: list[int]) -> list[int]:
        """Poisson (each with prob. q) or fixed-size (exactly m) sampling, seeded per round."""
        rng = make_rng(self.seed, 1, server_round, secure=self.secure_rng)
        nodes = sorted(node_ids)
        if self.client_sampling == "fixed":
            k = min(len(nodes), int(self.expected_clients))
            return sorted(rng.choice(nodes, size=k, replace=False).tolist())
        return [n for n, u in zip(nodes, rng.random(len(nodes))) if u < self.sample_rate]

    def client_train_config(self, server_round: int) -> dict:
        """What clients need to privatize their update this round."""
        distributed = self.noise_placement == "distributed"
        return {
            "server-round": server_round,
            "clipping-norm": float(self.clipping_norm),
            "privatize": distributed,
            "noise-std": distributed_noise_std(self.noise_multiplier, self.clipping_norm,
                                               self.expected_clients) if distributed else 0.0,
        }

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        if self.ledger is None:
            self.setup_population(len(wait_for_nodes(grid, self.min_available_nodes)))
        self._global = arrays
        node_ids = self.sample_clients(server_round, list(grid.get_node_ids()))
        log(INFO, "configure_train: sampled %d of %d clients (m=%.1f)", len(node_ids),
            len(list(grid.get_node_ids())), self.expected_clients)
        train_config = ConfigRecord({**dict(config), **self.client_train_config(server_round)})
        record = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: train_config})
        return self._construct_messages(record, node_ids, MessageType.TRAIN)

    def decode_update(self, content: RecordDict) -> list[np.ndarray]:
        """The update arrays of one reply (subclasses decode compressed forms)."""
        return content[self.arrayrecord_key].to_numpy_ndarrays()

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        assert self._global is not None and self.ledger is not None
        global_arrays = self._global.to_numpy_ndarrays()
        shapes = [a.shape for a in global_arrays]
        accepted, failures, rejected = self.accepted_updates(server_round, replies, shapes)
        updates, norms, losses = [], [], []
        for vector, metrics in accepted:
            vector, norm = self.server_clip(vector, metrics)
            updates.append(vector)
            norms.append(norm)
            if "train-loss" in metrics:
                losses.append(float(metrics["train-loss"]))

        new_global = self.noisy_average_step(server_round, updates, flatten(global_arrays))

        finite_norms = np.array([n for n in norms if math.isfinite(n)])
        clip_active = self.clipping_norm > 0
        metrics = {
            "clients": len(updates),
            "rejected": rejected,
            "failures": failures,
            "clipped_fraction": float(np.mean(finite_norms > self.clipping_norm))
            if clip_active and finite_norms.size else 0.0,
            "update_norm_mean": float(finite_norms.mean()) if finite_norms.size else 0.0,
            "update_norm_std": float(finite_norms.std()) if finite_norms.size else 0.0,
            "train_loss": float(np.mean(losses)) if losses else math.nan,
            "server_noise_std": self.last_server_noise_std,
            **self.privacy_metrics(),
        }
        return ArrayRecord(unflatten(new_global, shapes)), MetricRecord(metrics)

    def accepted_updates(self, server_round: int, replies: Iterable[Message],
                         shapes: list) -> tuple[list[tuple[np.ndarray, dict]], int, int]:
        """(flat update, metrics) of every well-formed reply, and the counts of failed and rejected ones."""
        accepted, failures, rejected = [], 0, 0
        for msg in replies:
            if msg.has_error():
                failures += 1
                log(WARNING, "Round %d: node %d failed: %s", server_round, msg.metadata.src_node_id,
                    msg.error.reason)
                continue
            try:
                arrays = self.decode_update(msg.content)
                problem = update_problem(arrays, shapes)
            except Exception as exc:  # malformed content of any kind
                problem = f"undecodable update ({exc})"
            if problem:
                rejected += 1
                log(WARNING, "Round %d: rejected update from node %d: %s", server_round,
                    msg.metadata.src_node_id, problem)
                continue
            accepted.append((flatten(arrays), dict(next(iter(msg.content.metric_records.values()), {}))))
        return accepted, failures, rejected

    def server_clip(self, vector: np.ndarray, metrics) -> tuple[np.ndarray, float]:
        """(update to sum, its norm before clipping): `central` clips here; `distributed`
        clients clipped and reported their norm."""
        if self.noise_placement == "central":
            return clip_to_norm(vector, self.clipping_norm)
        return vector, float(metrics.get("update-norm", math.nan))

    def accounted_noise_multiplier(self) -> float:
        """The sigma the ledger charges per round (a strategy whose noise is not N(0, sigma^2 C^2 I)
        returns the multiplier its noise really has)."""
        return self.noise_multiplier

    def noisy_average_step(self, server_round: int, updates: list[np.ndarray], global_vector: np.ndarray,
                           received: int | None = None) -> np.ndarray:
        """w + eta_s * (sum_i Delta_i + server noise) / m, and the round charged to the ledger.

        `received`: how many client noise shares the updates carry (default len(updates); under
        SecAgg+ one summed vector carries the shares of every client that made it into the sum).
        """
        assert self.ledger is not None
        received = len(updates) if received is None else received
        aggregate = self.noisy_sum(server_round, updates, global_vector.size, received)
        aggregate /= np.float32(self.expected_clients)
        self.ledger.record_round(self.accounted_noise_multiplier(), self.sample_rate, self.expected_clients,
                                 received)
        return global_vector + np.float32(self.server_learning_rate) * aggregate

    def noisy_sum(self, server_round: int, updates: list[np.ndarray], size: int,
                  received: int | None = None) -> np.ndarray:
        """Sum of updates plus the server's noise: all of it (central) or the top-up (distributed)
        for the m - received noise shares that did not arrive."""
        total = np.sum(updates, axis=0, dtype=np.float32) if updates else np.zeros(size, np.float32)
        if self.noise_placement == "central":
            std = self.noise_multiplier * self.clipping_norm
        else:
            std = topup_noise_std(self.noise_multiplier, self.clipping_norm, self.expected_clients,
                                  len(updates) if received is None else received)
        self.last_server_noise_std = std
        return total + gaussian_noise(size, std, make_rng(self.seed, 2, server_round, secure=self.secure_rng))

    def privacy_metrics(self) -> dict:
        assert self.ledger is not None
        return {"epsilon": self.ledger.epsilon(), "delta": self.ledger.delta,
                "epsilon_against_server": self.ledger.epsilon_against_server()}

    # ------------------------------------------------------------------ loop
    def budget_exhausted(self) -> bool:
        """`stop` mode: would the next round push epsilon above the target?"""
        if self.ledger is None or self.target_epsilon <= 0 or self.target_epsilon_mode != "stop":
            return False
        return self.ledger.model.epsilon_after(self.accounted_noise_multiplier(),
                                               self.sample_rate) > self.target_epsilon

    def budget_stop_reason(self, server_round: int) -> str:
        return f"target epsilon {self.target_epsilon} reached: round {server_round} would spend more"

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3, timeout: float = 3600,
              train_config: ConfigRecord | None = None, evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None) -> Result:
        """Flower's round loop, plus: stop on the privacy budget, one record per round."""
        self._num_rounds = num_rounds
        log(INFO, "Starting %s strategy:", type(self).__name__)
        self.summary()
        train_config = train_config or ConfigRecord()
        evaluate_config = evaluate_config or ConfigRecord()
        result, arrays = Result(), initial_arrays
        if evaluate_fn and (res := evaluate_fn(0, arrays)) is not None:
            result.evaluate_metrics_serverapp[0] = res
        if self.ledger is None:
            self.setup_population(len(wait_for_nodes(grid, self.min_available_nodes)))
        self.stop_reason = "num-rounds reached"
        for rnd in range(1, num_rounds + 1):
            if self.budget_exhausted():
                self.stop_reason = self.budget_stop_reason(rnd)
                log(WARNING, "Stopping before round %d: %s", rnd, self.stop_reason)
                break
            t0 = time.perf_counter()
            log(INFO, "")
            log(INFO, "[ROUND %d/%d]", rnd, num_rounds)
            instructions = list(self.configure_train(rnd, arrays, train_config, grid))
            replies = list(grid.send_and_receive(instructions, timeout=timeout))
            arrays, train_metrics = self.aggregate_train(rnd, replies)
            result.arrays = arrays
            result.train_metrics_clientapp[rnd] = train_metrics
            record = {"round": rnd, **dict(train_metrics), **failed_nodes_record(replies, instructions)}
            eval_msgs = self.configure_evaluate(rnd, arrays, evaluate_config, grid)
            if eval_msgs:
                client_eval = self.aggregate_evaluate(rnd, grid.send_and_receive(eval_msgs, timeout=timeout))
                if client_eval is not None:
                    result.evaluate_metrics_clientapp[rnd] = client_eval
                    record.update(self.client_evaluation_record(client_eval))
            if evaluate_fn and (res := evaluate_fn(rnd, arrays)) is not None:
                result.evaluate_metrics_serverapp[rnd] = res
                record.update(dict(res))
            record["seconds"] = time.perf_counter() - t0
            self.history.append(record)
            log(INFO, "Round %d: %s", rnd, format_record(record))
            if self.on_round_end:
                self.on_round_end(record)
        return result

    def client_evaluation_record(self, metrics: MetricRecord) -> dict:
        """How the clients' aggregated evaluation metrics appear in the round's record."""
        return {f"client_{k}": v for k, v in metrics.items()}

    def describe(self) -> dict:
        """Settings and privacy figures for summary.json."""
        assert self.ledger is not None
        return {
            "noise_multiplier": self.noise_multiplier,
            "clipping_norm": self.clipping_norm,
            "client_sampling_rate": self.sample_rate,
            "client_sampling": self.client_sampling,
            "num_clients": self.num_clients,
            "expected_clients_per_round": self.expected_clients,
            "noise_placement": self.noise_placement,
            "accountant": self.accountant,
            "accounting_note": ("fixed-size sampling is accounted as Poisson sampling with the same q "
                                "(an approximation)" if self.client_sampling == "fixed"
                                else "Poisson client sampling, sampled Gaussian mechanism (exact)"),
            "server_threat_model": self.ledger.server_threat_model,
            "secure_aggregation": self.secure_aggregation,
            "stop_reason": self.stop_reason,
            "ledger": self.ledger.state_dict(),
            **self.privacy_metrics(),
        }


def wait_for_nodes(grid: Grid, min_nodes: int, poll_seconds: float = 1.0) -> list[int]:
    """Block until at least `min_nodes` nodes are connected; return their ids."""
    while len(nodes := list(grid.get_node_ids())) < min_nodes:
        log(INFO, "Waiting for nodes: %d connected, %d required", len(nodes), min_nodes)
        time.sleep(poll_seconds)
    return nodes


def failed_nodes_record(replies: Iterable[Message], instructions: Iterable[Message] = ()) -> dict:
    """{"failed_nodes": ["node <id>: <reason>", ...]} for the replies that are errors (empty if none).

    The node is the instruction's destination (the SuperLink itself answers for a node that went away).
    """
    destination = {m.metadata.message_id: m.metadata.dst_node_id for m in instructions}
    failed = [f"node {destination.get(m.metadata.reply_to_message_id, m.metadata.src_node_id)}: {m.error.reason}"
              for m in replies if m.has_error()]
    return {"failed_nodes": failed} if failed else {}


def format_record(record: dict) -> str:
    keys = ("accuracy", "loss", "personalized_accuracy", "epsilon", "delta", "clients", "rejected", "clipped_fraction")
    return "  ".join(f"{k}={record[k]:.4g}" if isinstance(record[k], float) else f"{k}={record[k]}"
                     for k in keys if k in record)


def validate_dp_settings(*, sample_rate: float, clipping_norm: float, noise_multiplier: float,
                         noise_placement: str, client_sampling: str, target_epsilon: float,
                         target_epsilon_mode: str, delta: float) -> None:
    """Module-level checks shared by every client-level DP strategy."""
    if not 0 < sample_rate <= 1:
        raise ValueError(f"sample_rate={sample_rate!r} must be in (0, 1]")
    if clipping_norm < 0 or noise_multiplier < 0:
        raise ValueError(f"clipping_norm={clipping_norm!r} and noise_multiplier={noise_multiplier!r} "
                         "must be >= 0")
    if noise_multiplier > 0 and clipping_norm == 0:
        raise ValueError(f"noise_multiplier={noise_multiplier!r} needs clipping_norm > 0: "
                         "noise without clipping has no privacy guarantee")
    if noise_placement not in NOISE_PLACEMENTS:
        raise ValueError(f"noise_placement={noise_placement!r} is not one of: {', '.join(NOISE_PLACEMENTS)}")
    if client_sampling not in CLIENT_SAMPLINGS:
        raise ValueError(f"client_sampling={client_sampling!r} is not one of: {', '.join(CLIENT_SAMPLINGS)}")
    if target_epsilon_mode not in TARGET_EPSILON_MODES:
        raise ValueError(f"target_epsilon_mode={target_epsilon_mode!r} is not one of: "
                         f"{', '.join(TARGET_EPSILON_MODES)}")
    if target_epsilon < 0:
        raise ValueError(f"target_epsilon={target_epsilon!r} must be >= 0 (0 = no target)")
    if not 0 <= delta < 1:
        raise ValueError(f"delta={delta!r} must be in [0, 1) (0 = 1/number of clients)")
