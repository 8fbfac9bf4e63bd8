"""ALI-DPFL server strategy (the ALI-DPFL paper's Algorithm 2; docs/algorithms.md §5).

Sample-level DP: every client runs DP-SGD (`clients.dpsgd`) and keeps its own
ledger; the server adds no noise. On the shared round loop (`strategies.loop.round_loop`),
each round the server

1. sends the global model and tau (local DP-SGD steps) to the sampled clients,
2. rejects malformed replies, then averages the returned models with weights
   p_i = |D_i| / sum_j |D_j| over the clients that replied (eq. 4),
3. mirrors each client's ledger from the cumulative counts it reports (DP-SGD steps,
   mu releases) and reports the maximum epsilon over clients,

   Ledgers and step counts are kept per client: its client id, which the server asks each node for once
   (`strategies.parts.sampling.ClientIdentities`: node config `client-id`, else `partition-id`), so a SuperNode
   that restarts under a new node id is told its client's spent counts and charged on the same ledger. A client id
   a connected node claimed first is refused to a second node (not sampled); where no node answers the query (a
   ClientApp of one's own) the records are kept by node id, with a warning. Each node is told its own client's
   spent counts. The partition id a train reply names only looks its public |D_i| up (the weight); it binds
   nothing, so no reply can move another client's ledger.
4. computes the next tau: 1 if R_s >= R_c (Lemma 1), else eq. (9) with
   T = min(R_s * tau_prev, R_c), B = min_i q_s |D_i|, d = number of parameters,
   rounded to the nearest integer >= 1 (`adaptive = False`: tau stays `local_steps`),
5. stops after R_s rounds, or once the clients have taken R_c steps or none can take
   another step within the target epsilon.

mu, the strong-convexity estimate sum_i p_i ||grad F(w_i) - grad F(w)|| / ||w_i - w||:
`mu_source = "server"` evaluates the gradients on the server's own data (a
`gradient_fn` the app supplies; no client data, no privacy cost); `"clients"` is the
paper's version on each client's data, released clipped to [0, mu_max] with Gaussian
noise that the clients' ledgers charge.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from logging import INFO

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from dpfl.dpcore.privacy import protocol as keys
from dpfl.dpcore.privacy.dpsgd_noise import DEFAULT_SAMPLE_DELTA, DPSGDNoise, dpsgd_multipliers, max_local_steps
from dpfl.dpcore.privacy.ledger import SampleLevelLedgers
from dpfl.dpcore.privacy.mechanisms import flatten, l2_norm
from dpfl.dpcore.privacy.settings import check_dpsgd, require, require_a_step
from dpfl.strategies.loop.options import DPSGDOptions, RunOptions, SamplingOptions, ServerData
from dpfl.strategies.loop.reply_gate import ReplyGate, note_problem
from dpfl.strategies.loop.round_loop import DPRoundLoop
from dpfl.strategies.loop.run_record import describe_sampling
from dpfl.strategies.loop.wrapped import release
from dpfl.strategies.parts.part import config_key
from dpfl.strategies.parts.reply_rules import MetricRule
from dpfl.strategies.parts.sampling import ClientIdentities, ClientSampling
from dpfl.strategies.parts.wavelet import PaperClaim
from dpfl.strategies.sample_level.ali_dpfl_clients import (
    ClientSpending,
    claimed_epsilon,
    client_of,
    row_problem,
    update_ledgers,
)
from dpfl.strategies.sample_level.local_steps import (
    LocalIterations,
    estimate_mu,
    needs_mu,
    next_tau,
    releases_mu,
    round_local_steps,
    set_dimension,
)

REPLY_RULES = {  # what an ALI-DPFL train reply must hold
    keys.NUM_EXAMPLES: MetricRule(required=True, low=1, high=2**31, integer=True),
    keys.PARTITION_ID: MetricRule(required=True, low=0, high=2**31, integer=True),
    keys.NUM_PARTITIONS: MetricRule(low=1, high=2**31, integer=True),
    keys.LOCAL_STEPS: MetricRule(required=True, low=0, high=2**31, integer=True),
    keys.DPSGD_STEPS: MetricRule(required=True, low=0, high=2**53, integer=True),
    keys.MU_RELEASES: MetricRule(low=0, high=2**31, integer=True),
    keys.MU: MetricRule(),
    keys.EPSILON: MetricRule(low=0.0),
    keys.BUDGET_LEFT: MetricRule(low=0, high=1, integer=True),
}


class ALIDPFL(DPRoundLoop):
    """ALI-DPFL: adaptive local DP-SGD iterations, weighted model averaging, per-client ledgers.

        ALIDPFL(FedAvg(), dpsgd=DPSGDOptions(0.1, 1.0, 1.0, target_epsilon=5.0), sampling=SamplingOptions(1.0))

    strategy : the wrapped Flower strategy (FedAvg if None).
    dpsgd : the clients' DP-SGD and its accounting (`strategies.loop.options.DPSGDOptions`).
    sampling : which clients train each round (the paper: all, q = 1); client sampling does not enter the
        sample-level accounting.
    run : eta_s, the randomness, the outputs and their hooks (`strategies.loop.options.RunOptions`).
    server_data : the server's gradient function (mu_source = server) and the public partition sizes.
    """

    def __init__(
        self,
        strategy: Strategy | None = None,
        *,
        dpsgd: DPSGDOptions,
        sampling: SamplingOptions,
        run: RunOptions | None = None,
        server_data: ServerData | None = None,
    ) -> None:
        self.check_settings(dpsgd=dpsgd)
        server_data = server_data or ServerData()
        require(
            not (dpsgd.adaptive and dpsgd.mu_source == "server" and server_data.gradient_fn is None),
            "mu_source",
            dpsgd.mu_source,
            "'server' with adaptive=True needs a gradient_fn (the server's data)",
        )
        require(
            dpsgd.num_partitions >= 0, "num_partitions", dpsgd.num_partitions, "must be >= 0 (0: the connected nodes)"
        )
        run = run or RunOptions()
        claim = PaperClaim(lambda: self.noise.claims_differ)  # DP-SGD-WAV's claimed epsilon: no guarantee
        gate = ReplyGate(REPLY_RULES, run.publish_diagnostics)
        per_client = ClientSampling(sampling.client_sampling, ClientIdentities(required=False))  # records by client
        super().__init__(strategy, sampling=sampling, run=run, selection=per_client, parts=[claim], gate=gate)
        self.dpsgd, self.server_data = dpsgd, server_data
        self.schedule = LocalIterations(max(1, dpsgd.local_steps))  # R_c, tau, d
        self.spent = ClientSpending()  # the server's mirror of each client's ledger

    @classmethod
    def check_settings(cls, *, dpsgd: DPSGDOptions, **_) -> None:
        """The rules of these settings (the same call checks a run config before training)."""
        d = dpsgd
        check_dpsgd(
            sample_noise_multiplier=d.sample_noise_multiplier,
            sample_clipping_norm=d.sample_clipping_norm,
            batch_sample_rate=d.batch_sample_rate,
            target_epsilon=d.target_epsilon,
            dpsgd_noise=d.dpsgd_noise,
            wavelet_calibration=d.wavelet_calibration,
            grad_sample_mode=d.grad_sample_mode,
            accountant=d.accountant,
            mu_source=d.mu_source,
            mu_noise_multiplier=d.mu_noise_multiplier,
        )
        require(d.gamma >= 0, "gamma", d.gamma, "must be >= 0")
        require(d.mu_max > 0, "mu_max", d.mu_max, "must be > 0")
        require(d.local_steps >= 0, "local_steps", d.local_steps, "must be >= 0 (0: 1)")
        delta = d.delta or DEFAULT_SAMPLE_DELTA  # R_c > 0, checked with one step (the set-up computes R_c)
        budget = dpsgd_multipliers(d.sample_noise_multiplier, d.dpsgd_noise, d.wavelet_calibration).budget
        steps = max_local_steps(d.target_epsilon, delta, budget, d.batch_sample_rate, d.accountant, limit=1)
        require_a_step(steps, d.target_epsilon, d.sample_noise_multiplier, d.batch_sample_rate, delta)

    # ------------------------------------------------------------------ set-up
    def make_ledger(self) -> SampleLevelLedgers:
        """The per-client ledgers (at the configured delta, else DEFAULT_SAMPLE_DELTA), R_c and the first tau."""
        delta = self.dpsgd.delta or DEFAULT_SAMPLE_DELTA
        self.schedule.steps_budget = max_local_steps(
            self.dpsgd.target_epsilon, delta, self.noise.budget, self.dpsgd.batch_sample_rate, self.dpsgd.accountant
        )
        require_a_step(
            self.schedule.steps_budget,
            self.dpsgd.target_epsilon,
            self.dpsgd.sample_noise_multiplier,
            self.dpsgd.batch_sample_rate,
            delta,
        )
        if self.dpsgd.adaptive and self.record.num_rounds >= self.schedule.steps_budget:
            self.schedule.tau = 1  # Lemma 1
        log(
            INFO,
            "ALI-DPFL: R_s = %d rounds, R_c = %d DP-SGD steps (epsilon %.3g, delta %.3g), first tau = %d",
            self.record.num_rounds,
            self.schedule.steps_budget,
            self.dpsgd.target_epsilon,
            delta,
            self.schedule.tau,
        )
        return SampleLevelLedgers(delta, self.dpsgd.accountant)

    def ledger_from_state(self, state: dict) -> SampleLevelLedgers:
        return SampleLevelLedgers.from_state_dict(state)

    def state_dict(self) -> dict:
        """The round loop's state with R_c, tau, the server's mirror of the clients' spending and whether it is kept
        by node id (the node -> client map is asked again after a resume)."""
        identities = {"identities": self.selection.identities.state_dict()}
        return {**super().state_dict(), **self.schedule.state_dict(), **self.spent.state_dict(), **identities}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.schedule.load_state_dict(state)
        self.spent.load_state_dict(state)
        self.selection.identities.load_state_dict(state.get("identities", {"by_node_id": True}))  # older: by node

    @property
    def noise(self) -> DPSGDNoise:
        """The DP-SGD multipliers at the model's size d (DP-SGD-WAV's true multiplier depends on it)."""
        d = self.dpsgd
        return dpsgd_multipliers(
            d.sample_noise_multiplier, d.dpsgd_noise, d.wavelet_calibration, self.schedule.dimension or 1
        )

    def summary(self) -> None:
        log(INFO, "\t├──> Sample-level DP-SGD on every client (%s)", type(self).__name__)
        log(
            INFO,
            "\t│\t├── q_s=%.4g  C=%.4g  sigma=%.4g  target_epsilon=%.4g  accountant=%s",
            self.dpsgd.batch_sample_rate,
            self.dpsgd.sample_clipping_norm,
            self.dpsgd.sample_noise_multiplier,
            self.dpsgd.target_epsilon,
            self.dpsgd.accountant,
        )
        log(
            INFO,
            "\t│\t└── adaptive=%s  gamma=%.3g  mu_source=%s  client q=%.4g",
            self.dpsgd.adaptive,
            self.dpsgd.gamma,
            self.dpsgd.mu_source,
            self.population.sample_rate,
        )

    # ------------------------------------------------------------------ train
    def client_train_config(self, server_round: int) -> dict:
        """tau and whether to release mu (`configure_train` adds each node's own spent counts)."""
        return {
            keys.SERVER_ROUND: server_round,
            keys.LOCAL_STEPS: round_local_steps(self),
            keys.RELEASE_MU: releases_mu(self),
            keys.PRIVATIZE: False,
        }

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The round's train messages, each telling its node the DP-SGD steps and mu releases the server has
        charged its client (a client whose own state was lost, e.g. after a restart under a new node id, never
        spends them again). What a train reply claims never changes what another node is told."""
        return [self.tell_spent(m) for m in super().configure_train(server_round, arrays, config, grid)]

    def tell_spent(self, message: Message) -> Message:
        node, content = message.metadata.dst_node_id, RecordDict(dict(message.content.items()))
        client = client_of(self, node)
        content[config_key(self)] = ConfigRecord(
            {
                **dict(message.content[config_key(self)]),
                keys.SPENT_STEPS: self.spent.steps_taken.get(client, 0),
                keys.SPENT_MU_RELEASES: self.spent.mu_releases.get(client, 0),
            }
        )
        return Message(content=content, dst_node_id=node, message_type=message.metadata.message_type)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        assert self.round.arrays is not None and self.ledger is not None
        tau = round_local_steps(self)
        self.schedule.tau_list.append(tau)
        global_arrays = self.round.global_arrays()
        set_dimension(self, sum(a.size for a in global_arrays))
        shapes = [a.shape for a in global_arrays]
        if releases_mu(self):
            self.spent.mu_rounds += 1
        accepted, failures, rejected = self.gate.accepted(self, server_round, replies)
        rows, weights, nodes = [], [], []
        for (vector, metrics), node in zip(accepted, self.round.accepted_nodes):
            problem, weight = row_problem(self, metrics, tau)
            if problem:
                rejected += 1
                note_problem(
                    self,
                    server_round,
                    f"rejected the reply of node {node} (partition {metrics.get(keys.PARTITION_ID)}): {problem}",
                )
                continue
            rows.append((vector, metrics))
            weights.append(weight)
            nodes.append(node)
        weights = np.array(weights, dtype=np.float64)
        global_vector = flatten(global_arrays)
        if rows:
            average = np.sum([w * v for w, (v, _) in zip(weights / weights.sum(), rows)], axis=0, dtype=np.float64)
            new_global = (global_vector + self.run.server_learning_rate * average).astype(np.float32)
        else:
            new_global = global_vector
        update_ledgers(self, server_round, [m for _, m in rows], [client_of(self, n) for n in nodes])
        mu = estimate_mu(self, global_arrays, shapes, rows, weights) if needs_mu(self) else math.nan
        self.schedule.tau, tau_star = next_tau(self, mu, global_vector.size)
        self.spent.clients_out_of_budget = bool(rows) and all(int(m.get(keys.BUDGET_LEFT, 1)) == 0 for _, m in rows)
        taken = [int(m[keys.LOCAL_STEPS]) for _, m in rows]
        norms = [l2_norm(v) for v, _ in rows]
        eps = self.ledger.epsilon_per_client()
        metrics = {
            "clients": len(rows),
            "rejected": rejected,
            "failures": failures,
            "tau": tau,
            "tau_star": tau_star,
            "tau_next": self.schedule.tau,
            "mu": mu,
            "local_steps_max": max(taken, default=0),
            "local_steps_total": self.spent.total_steps,
            "steps_budget": self.schedule.steps_budget,
            "update_norm_mean": float(np.mean(norms)) if norms else 0.0,
            "epsilon_min": min(eps.values(), default=0.0),
            **self.privacy_metrics(),
        }
        arrays, _ = release(self, server_round, new_global)
        return arrays, MetricRecord(metrics)

    def privacy_metrics(self) -> dict:
        assert self.ledger is not None
        claimed = {"claimed_epsilon": claimed_epsilon(self)} if self.noise.claims_differ else {}
        return {"epsilon": self.ledger.epsilon(), "delta": self.ledger.delta, **claimed}

    def finish_round(self, record: dict, started: float, arrays: ArrayRecord) -> None:
        """The round loop's record with each client's epsilon so far (dashboards' rounds x clients heatmap)."""
        assert self.ledger is not None
        record["epsilon_per_client"] = {str(c): e for c, e in self.ledger.epsilon_per_client().items()}
        super().finish_round(record, started, arrays)

    # ------------------------------------------------------------------ loop
    def budget_exhausted(self) -> bool:
        if self.ledger is None:
            return False
        return self.spent.total_steps >= self.schedule.steps_budget or self.spent.clients_out_of_budget

    def budget_stop_reason(self, server_round: int) -> str:
        if self.spent.total_steps >= self.schedule.steps_budget:
            return (
                f"clients reached R_c = {self.schedule.steps_budget} DP-SGD steps (target epsilon "
                f"{self.dpsgd.target_epsilon}) before round {server_round}"
            )
        return (
            f"no client can take another DP-SGD step within target epsilon {self.dpsgd.target_epsilon} "
            f"(before round {server_round})"
        )

    def guarantee_caveats(self) -> list[str]:
        """The round loop's, and allow_large_delta's: the clients let delta >= 1/n through (n: their samples)."""
        caveats = super().guarantee_caveats()
        if self.dpsgd.allow_large_delta and self.ledger is not None:
            caveats.append(
                f"allow-large-delta: a client with n <= 1/delta = {1 / self.ledger.delta:.6g} samples trains at delta "
                f"{self.ledger.delta:g} >= 1/n, where publishing one of its samples whole is (0, delta)-DP: epsilon "
                "guarantees nothing for it"
            )
        return caveats

    def describe(self) -> dict:
        assert self.ledger is not None
        return {
            "privacy_unit": "one training sample of a client (sample-level DP-SGD; each client's own ledger)",
            "sample_noise_multiplier": self.dpsgd.sample_noise_multiplier,
            "sample_clipping_norm": self.dpsgd.sample_clipping_norm,
            "batch_sample_rate": self.dpsgd.batch_sample_rate,
            **describe_sampling(self),
            "target_epsilon": self.dpsgd.target_epsilon,
            "adaptive": self.dpsgd.adaptive,
            "gamma": self.dpsgd.gamma,
            "mu_source": self.dpsgd.mu_source,
            "mu_max": self.dpsgd.mu_max if releases_mu(self) else None,
            "mu_noise_multiplier": self.dpsgd.mu_noise_multiplier if releases_mu(self) else None,
            "dpsgd_noise": self.dpsgd.dpsgd_noise,
            "grad_sample_mode": self.dpsgd.grad_sample_mode,
            "wavelet_calibration": self.dpsgd.wavelet_calibration if self.dpsgd.dpsgd_noise == "wavelet" else None,
            "accounted_noise_multiplier": self.noise.accounted,
            "rounds_budget": self.record.num_rounds,
            "steps_budget": self.schedule.steps_budget,
            "tau_list": list(self.schedule.tau_list),
            "local_steps_total": self.spent.total_steps,
            "ledger": self.ledger.state_dict(),
            "epsilon_per_client": self.ledger.epsilon_per_client(),
            **self.privacy_metrics(),
        }
