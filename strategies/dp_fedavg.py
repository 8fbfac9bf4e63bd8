"""Client-level DP around any Flower Message-API strategy: DP-FedAvg / DP-FedSAM (docs/algorithms.md §0-§2).

`DifferentialPrivacy(strategy, ...)` wraps a Flower strategy as Flower's own DP wrappers do
(`DifferentialPrivacy(FedAdam(...), clipping_norm=..., noise_multiplier=..., sample_rate=...)` is DP-FedAdam);
`DPFedAvg` is the same class, around FedAvg by default. Clients upload their new weights (any Flower client)
or the update Delta_i = w_i - w_global (this project's clients and mod). On the shared round loop
(`strategies.round_loop`) the server

1. samples clients (`poisson`: each with probability q; `fixed`: exactly m = qM),
2. rejects malformed or non-finite updates (logged, counted, never averaged in),
3. clips and noises through its noise placement (`strategies.noise_placement`):
   `central`: clips each update to C and adds N(0, sigma^2 C^2 I) to the sum;
   `distributed`: clients clipped and added N(0, sigma^2 C^2 / n_s I) each; the server
   tops the noise up by N(0, sigma^2 C^2 (n_s - k)/n_s I) for the k <= n_s updates that arrived,
   so the sum carries N(0, sigma^2 C^2 I) whatever k is (n_s: `noise_share_count`),
4. divides by the fixed m (uniform average) and forms w' = w + eta_s * average, which the wrapped
   strategy's aggregation and server optimizer take as post-processing (`DPRoundLoop.release`),
5. charges one sampled-Gaussian event (sigma, q) to the ledger and reports epsilon.

Only what the ledger covers is published per round (`DPRoundLoop.split_record`); counts, norms,
losses and the clipped fraction are non-private diagnostics.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from logging import INFO, WARNING

import numpy as np
from flwr.app import ArrayRecord, Message, MetricRecord
from flwr.common import log
from flwr.serverapp.strategy import Strategy

from dpcore.privacy import protocol as keys
from dpcore.privacy.accountants import DEFAULT_ACCOUNTANT
from dpcore.privacy.audit import CANARY_KINDS, audit_epsilon, canary_direction, new_canary_seed
from dpcore.privacy.calibration import calibrate_noise_multiplier, default_client_delta
from dpcore.privacy.ledger import ClientLevelLedger
from dpcore.privacy.mechanisms import (
    TRUNCATION_PROBABILITY,
    flatten,
    gaussian_noise,
    l2_norm,
    make_rng,
)
from dpcore.privacy.settings import check_client_level_dp, check_secure_aggregation, one_of, require

from .noise_placement import noise_placement as make_noise_placement
from .reply_gate import MetricRule
from .round_loop import CheckpointCallback, DPRoundLoop, RoundCallback


class DifferentialPrivacy(DPRoundLoop):
    """Client-level DP around a Flower strategy: clipping, Gaussian noise (central or distributed), sampling
    with amplification, the privacy ledger, the budget stop or calibration, the canary audit.

    Parameters (besides the round loop's: strategy (first, FedAvg if None), sample_rate, client_sampling,
    server_learning_rate, delta (0: 1/M), accountant, seed, secure_rng, min_available_nodes, fraction_evaluate,
    on_round_end, on_checkpoint)
    ----------
    clipping_norm : C, bound on the global L2 norm of each update (0: no clipping,
        only with noise_multiplier = 0, for the non-private reference).
    noise_multiplier : sigma (0: no noise, epsilon = inf).
    noise_placement : "central" (trusted server adds the noise), "distributed", or "local" (local DP: each client's
        `clients.local_dp` mod noises its own update, docs/dp-toolbox.md §2).
    target_epsilon, target_epsilon_mode : "stop" before a round would exceed the
        target, or "calibrate" sigma up front for the configured number of rounds.
    secure_aggregation : the server only ever sees the sum (SecAgg+, `strategies.secagg`);
        changes the "against the server" figure only.
    audit_canaries : K canary clients for the one-shot empirical privacy estimate
        (`dpcore.privacy.audit`): each, sampled with probability q per round, adds C * u_i to the sum;
        K more directions are never inserted; the estimate is in `describe()["audit"]`.
    audit_canary_kind : "isotropic" (the paper's random directions) or "smooth" (coarse Haar directions).
    adaptive_clipping : a `strategies.adaptive_clipping.AdaptiveClipping` (Andrew et al.): C moves toward a
        quantile of the update norms each round; the update noise is sigma_Delta, the ledger charges sigma.
    ftrl : a `strategies.dp_ftrl.DPFTRL` (Kairouz et al.): no sampling; each node at most once per epoch (enforced),
        the running sum of clipped updates released by the binary-tree mechanism (docs/dp-toolbox.md §4).

    Fixed-size client sampling is charged as the Gaussian mechanism at sigma / 2 (replace-one), with the smaller
    of the bounds without amplification and with sampling without replacement (`dpcore.privacy.ledger.ClientLevelLedger`).
    """

    clients_clip_under_central_noise = False
    reply_metric_rules = {
        keys.UPDATE_NORM: MetricRule(low=0.0, high=1e15),
        keys.TRAIN_LOSS: MetricRule(low=0.0, high=1e15),
        keys.LOCAL_NOISE_MULTIPLIER: MetricRule(low=0.0, high=1e15),
    }

    def __init__(
        self,
        strategy: Strategy | None = None,
        *,
        sample_rate: float,
        clipping_norm: float,
        noise_multiplier: float,
        noise_placement: str = "central",
        client_sampling: str = "poisson",
        server_learning_rate: float = 1.0,
        delta: float = 0.0,
        accountant: str = DEFAULT_ACCOUNTANT,
        target_epsilon: float = 0.0,
        target_epsilon_mode: str = "stop",
        secure_aggregation: bool = False,
        seed: int = 0,
        secure_rng: bool = True,
        min_available_nodes: int = 2,
        fraction_evaluate: float | None = None,
        audit_canaries: int = 0,
        audit_canary_kind: str = "isotropic",
        publish_diagnostics: bool = False,
        adaptive_clipping=None,
        ftrl=None,
        on_round_end: RoundCallback | None = None,
        on_checkpoint: CheckpointCallback | None = None,
    ) -> None:
        require(
            audit_canaries == 0 or audit_canaries >= 2,
            "audit_canaries",
            audit_canaries,
            "must be 0 (no audit) or >= 2 (the null cosines' spread needs two)",
        )
        one_of("audit_canary_kind", audit_canary_kind, CANARY_KINDS)
        self.check_settings(
            sample_rate=sample_rate,
            clipping_norm=clipping_norm,
            noise_multiplier=noise_multiplier,
            noise_placement=noise_placement,
            client_sampling=client_sampling,
            target_epsilon=target_epsilon,
            target_epsilon_mode=target_epsilon_mode,
            delta=delta,
            accountant=accountant,
            secure_aggregation=secure_aggregation,
            adaptive_clipping=adaptive_clipping,
            ftrl=ftrl,
            audit_canaries=audit_canaries,
        )
        super().__init__(
            strategy,
            sample_rate=sample_rate,
            client_sampling=client_sampling,
            server_learning_rate=server_learning_rate,
            delta=delta,
            accountant=accountant,
            seed=seed,
            secure_rng=secure_rng,
            min_available_nodes=min_available_nodes,
            fraction_evaluate=fraction_evaluate,
            publish_diagnostics=publish_diagnostics,
            on_round_end=on_round_end,
            on_checkpoint=on_checkpoint,
        )
        self.clipping_norm = clipping_norm
        self.noise_multiplier = noise_multiplier
        self.noise = make_noise_placement(noise_placement, self.clients_clip_under_central_noise)
        self.target_epsilon = target_epsilon
        self.target_epsilon_mode = target_epsilon_mode
        self.secure_aggregation = secure_aggregation
        self.last_server_noise_std = 0.0
        self.audit_canaries, self.audit_canary_kind = audit_canaries, audit_canary_kind
        self.canary_seed = new_canary_seed() if secure_rng else int(make_rng(seed, 8).integers(2**63))
        self.audit_start: np.ndarray | None = None  # the global vector before round 1
        self.signal_checked = False  # the noise-to-signal warning is given once, at the first round
        self.adaptive_clipping = adaptive_clipping  # strategies.adaptive_clipping.AdaptiveClipping, or None
        self.ftrl = ftrl  # strategies.dp_ftrl.DPFTRL, or None
        if adaptive_clipping is not None:
            self.reply_metric_rules = {**self.reply_metric_rules, keys.CLIP_BIT: MetricRule(low=-1e15, high=1e15)}

    @classmethod
    def check_settings(
        cls,
        *,
        sample_rate: float,
        clipping_norm: float,
        noise_multiplier: float,
        noise_placement: str = "central",
        client_sampling: str = "poisson",
        target_epsilon: float = 0.0,
        target_epsilon_mode: str = "stop",
        delta: float = 0.0,
        accountant: str = DEFAULT_ACCOUNTANT,
        secure_aggregation: bool = False,
        adaptive_clipping=None,
        ftrl=None,
        audit_canaries: int = 0,
        **_,
    ) -> None:
        """The rules of these settings (the same call checks a run config before training)."""
        check_client_level_dp(
            sample_rate=sample_rate,
            clipping_norm=clipping_norm,
            noise_multiplier=noise_multiplier,
            noise_placement=noise_placement,
            client_sampling=client_sampling,
            target_epsilon=target_epsilon,
            target_epsilon_mode=target_epsilon_mode,
            delta=delta,
            accountant=accountant,
        )
        if secure_aggregation:
            check_secure_aggregation(noise_placement, clipping_norm)
        if adaptive_clipping is not None:
            adaptive_clipping.check(
                noise_multiplier=noise_multiplier,
                noise_placement=noise_placement,
                secure_aggregation=secure_aggregation,
                clipping_norm=clipping_norm,
            )
        if ftrl is not None:
            ftrl.check(
                noise_placement=noise_placement,
                secure_aggregation=secure_aggregation,
                adaptive_clipping=adaptive_clipping,
                audit_canaries=audit_canaries,
                target_epsilon_mode=target_epsilon_mode,
                noise_multiplier=noise_multiplier,
                clipping_norm=clipping_norm,
            )

    @property
    def noise_placement(self) -> str:
        return self.noise.name

    # ------------------------------------------------------------------ set-up
    def default_delta(self, num_clients: int) -> float:
        return default_client_delta(num_clients)

    def make_ledger(self, delta: float) -> ClientLevelLedger:
        """The client-level ledger; for `calibrate`, sigma for the configured number of rounds first."""
        if self.ftrl is not None:
            return self.ftrl.make_ledger(self, delta)  # one tree-aggregation event per epoch, no sampling
        if self.target_epsilon > 0 and self.target_epsilon_mode == "calibrate":
            fixed = self.client_sampling == "fixed"  # charged as sigma / 2 without amplification (the ledger)
            rounds = max(1, self.num_rounds)
            reserve = 0.0 if fixed else rounds * TRUNCATION_PROBABILITY  # what sampling reserves out of delta
            self.noise_multiplier = (2.0 if fixed else 1.0) * calibrate_noise_multiplier(
                self.target_epsilon, delta - reserve, 1.0 if fixed else self.sample_rate, rounds, self.accountant
            )
            log(
                INFO,
                "Calibrated noise multiplier %.4f for epsilon %.3g after %d rounds",
                self.noise_multiplier,
                self.target_epsilon,
                self.num_rounds,
            )
        return ClientLevelLedger(
            delta, self.accountant, self.noise_placement, self.secure_aggregation, self.client_sampling
        )

    def ledger_from_state(self, state: dict) -> ClientLevelLedger:
        if self.ftrl is not None:
            raise ValueError(
                "a DP-FTRL run cannot resume: its tree's noise is not checkpointed, and redrawing it "
                "would release the same nodes twice"
            )
        return ClientLevelLedger.from_state_dict(state)

    def extra_state(self) -> dict:
        return {
            "noise_multiplier": self.noise_multiplier,
            "clipping_norm": self.clipping_norm,
        }  # as calibrated, adapted

    def load_extra_state(self, state: dict) -> None:
        self.noise_multiplier = float(state["noise_multiplier"])
        self.clipping_norm = float(state.get("clipping_norm", self.clipping_norm))

    def summary(self) -> None:
        super().summary()
        log(INFO, "\t├──> Client-level DP (%s)", type(self).__name__)
        log(
            INFO,
            "\t│\t├── q=%.4g  C=%.4g  sigma=%.4g  noise=%s  sampling=%s",
            self.sample_rate,
            self.clipping_norm,
            self.noise_multiplier,
            self.noise_placement,
            self.client_sampling,
        )
        log(
            INFO,
            "\t│\t└── accountant=%s  target_epsilon=%s (%s)",
            self.accountant,
            self.target_epsilon or "none",
            self.target_epsilon_mode,
        )

    # ------------------------------------------------------------------ train
    def sample_clients(self, server_round: int, node_ids: list[int]) -> list[int]:
        """DP-FTRL: the nodes its participation rule allows (no sampling); else the round loop's sampling."""
        if self.ftrl is None:
            return super().sample_clients(server_round, node_ids)
        if self.ledger is None:
            self.setup_population(len(node_ids))
        chosen = self.ftrl.select(self, server_round, node_ids)
        self.round_nodes = set(chosen)  # the reply gate takes replies from these nodes only, once each
        return chosen

    def client_train_config(self, server_round: int) -> dict:
        """What clients need to privatize their update this round."""
        config = {
            keys.SERVER_ROUND: server_round,
            **self.noise.client_config(self.update_noise_multiplier(), self.clipping_norm, self.noise_shares),
        }
        if self.adaptive_clipping is not None:
            config.update(self.adaptive_clipping.client_config(self.noise_placement, self.noise_shares))
        return config

    def begin_round(self, arrays: ArrayRecord) -> None:
        if self.audit_canaries and self.audit_start is None:
            self.audit_start = flatten(arrays.to_numpy_ndarrays())
        super().begin_round(arrays)
        if not self.signal_checked and self.ledger is not None:
            self.signal_checked = True
            if warning := noise_to_signal_warning(
                self.noise_multiplier, self.expected_clients, sum(a.size for a in self.global_arrays())
            ):
                log(WARNING, "%s", warning)

    def canary_updates(self, server_round: int, dim: int) -> list[np.ndarray]:
        """C * u_i of the canaries sampled this round (each with probability q, like a client)."""
        if not self.audit_canaries:
            return []
        draws = make_rng(self.seed, 9, server_round, secure=self.secure_rng).random(self.audit_canaries)
        return [
            self.clipping_norm * canary_direction(self.canary_seed, i, dim, self.audit_canary_kind)
            for i in np.flatnonzero(draws < self.sample_rate)
        ]

    def audit(self) -> dict | None:
        """The one-shot estimate from the model delta of the rounds run so far (None without canaries)."""
        if not self.audit_canaries or self.audit_start is None or self.latest_arrays is None:
            return None
        final = flatten(self.latest_arrays.to_numpy_ndarrays())
        return audit_epsilon(
            final - self.audit_start,
            self.canary_seed,
            self.audit_canaries,
            self.audit_canaries,
            self.ledger.delta,
            self.audit_canary_kind,
        )

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        assert self.current_arrays is not None and self.ledger is not None
        global_arrays = self.global_arrays()
        accepted, failures, rejected = self.accepted_updates(server_round, replies)
        updates, norms, losses = [], [], []
        for vector, metrics in accepted:
            vector, norm = self.server_clip(vector, metrics)
            updates.append(vector)
            norms.append(norm)
            if keys.TRAIN_LOSS in metrics:
                losses.append(float(metrics[keys.TRAIN_LOSS]))

        canaries = self.canary_updates(server_round, sum(a.size for a in global_arrays))
        new_global = self.noisy_average_step(
            server_round, updates + canaries, flatten(global_arrays), received=len(updates)
        )

        finite_norms = np.array([n for n in norms if math.isfinite(n)])
        clip_active = self.clipping_norm > 0
        metrics = {
            "clients": len(updates),
            "rejected": rejected,
            "failures": failures,
            "clipped_fraction": float(np.mean(finite_norms > self.clipping_norm))
            if clip_active and finite_norms.size
            else 0.0,
            "update_norm_mean": float(finite_norms.mean()) if finite_norms.size else 0.0,
            "update_norm_std": float(finite_norms.std()) if finite_norms.size else 0.0,
            "train_loss": float(np.mean(losses)) if losses else math.nan,
            "server_noise_std": self.last_server_noise_std,
            **self.privacy_metrics(),
        }
        if self.adaptive_clipping is not None:  # C_{t+1} from the noised count (after this round's noise used C_t)
            metrics.update(self.adaptive_clipping.after_round(self, server_round, accepted, norms))
        arrays, _ = self.release(server_round, new_global)
        return arrays, MetricRecord(metrics)

    def needs_marked_updates(self) -> bool:
        """Distributed noise: a reply counts only if the client (or its mod) added its noise share."""
        return self.noise_placement in ("distributed", "local") and self.noise_multiplier > 0

    def upload_problem(self, vector: np.ndarray, metrics: dict) -> str | None:
        """Distributed noise: an upload above the bound an honest one stays under (p <= 1e-12) is refused."""
        if problem := getattr(self.noise, "reply_problem", lambda *_: None)(metrics, self.noise_multiplier):
            return problem
        if self.adaptive_clipping is not None and (
            problem := self.adaptive_clipping.reply_problem(metrics, self.noise_placement, self.noise_shares)
        ):
            return problem
        bound = self.noise.upload_norm_bound(
            self.update_noise_multiplier(), self.clipping_norm, self.noise_shares, vector.size
        )
        norm = l2_norm(vector)
        return f"upload norm {norm:.6g} above the bound {bound:.6g} of an honest noisy update" if norm > bound else None

    def server_clip(self, vector: np.ndarray, metrics: dict) -> tuple[np.ndarray, float]:
        """(update to sum, its norm before clipping), by the noise placement."""
        return self.noise.server_clip(vector, metrics, self.clipping_norm)

    def update_noise_multiplier(self) -> float:
        """The multiplier of the noise on the update sum: sigma, or under adaptive clipping sigma_Delta of
        Theorem 1 (the count's noise takes the rest; the ledger still charges sigma)."""
        if self.adaptive_clipping is None:
            return self.noise_multiplier
        return self.adaptive_clipping.update_noise_multiplier(self.noise_multiplier)

    def accounted_noise_multiplier(self) -> float:
        """The sigma the ledger charges per round (a strategy whose noise is not N(0, sigma^2 C^2 I)
        returns the multiplier its noise really has)."""
        return self.noise_multiplier

    def noisy_average_step(
        self, server_round: int, updates: list[np.ndarray], global_vector: np.ndarray, received: int | None = None
    ) -> np.ndarray:
        """w + eta_s * (sum_i Delta_i + server noise) / m, and the round charged to the ledger (with the
        probability that this round's sample was truncated to n_s, reserved out of delta).

        `received`: how many client noise shares the updates carry (default len(updates); under
        SecAgg+ one summed vector carries the shares of every client that made it into the sum).
        """
        assert self.ledger is not None
        if self.ftrl is not None:  # w_0 + eta (tree-noised prefix sum) / m, charged to the tree ledger
            return self.ftrl.step(self, server_round, updates, global_vector)
        received = len(updates) if received is None else received
        aggregate = self.noisy_sum(server_round, updates, global_vector.size, received)
        aggregate /= np.float32(self.expected_clients)
        self.ledger.record_round(
            self.accounted_noise_multiplier(),
            self.sample_rate,
            self.noise_shares,
            received,
            truncation_probability=self.round_truncation_probability,
            sampled_from=self.round_sampled_from,
        )
        return global_vector + np.float32(self.server_learning_rate) * aggregate

    def noisy_sum(
        self, server_round: int, updates: list[np.ndarray], size: int, received: int | None = None
    ) -> np.ndarray:
        """Sum of updates plus the server's noise: all of it (central) or the top-up (distributed)
        for the n_s - received noise shares that did not arrive."""
        total = np.sum(updates, axis=0, dtype=np.float32) if updates else np.zeros(size, np.float32)
        std = self.noise.server_noise_std(
            self.update_noise_multiplier(),
            self.clipping_norm,
            self.noise_shares,
            len(updates) if received is None else received,
        )
        self.last_server_noise_std = std
        return total + gaussian_noise(size, std, make_rng(self.seed, 2, server_round, secure=self.secure_rng))

    def privacy_metrics(self) -> dict:
        assert self.ledger is not None
        return {
            "epsilon": self.ledger.epsilon(),
            "delta": self.ledger.delta,
            "epsilon_against_server": self.ledger.epsilon_against_server(),
        }

    # ------------------------------------------------------------------ loop
    def budget_exhausted(self) -> bool:
        """Would the next round push epsilon above the target? The target is a hard cap in both modes:
        `calibrate` picks sigma so that the configured rounds end at the target, but a run given more rounds
        than it was calibrated for (a resume with a larger num-rounds, a legacy strategy whose num_rounds is
        below its ServerConfig's) stops here too."""
        if self.ledger is None or self.target_epsilon <= 0:
            return False
        return (
            self.ledger.epsilon_after_rounds(
                self.accounted_noise_multiplier(), self.sample_rate, 1, self.next_truncation_probability()
            )
            > self.target_epsilon
        )

    def budget_stop_reason(self, server_round: int) -> str:
        calibrated = " (sigma was calibrated for fewer rounds)" if self.target_epsilon_mode == "calibrate" else ""
        return f"target epsilon {self.target_epsilon} reached: round {server_round} would spend more{calibrated}"

    def guarantee_caveats(self) -> list[str]:
        """Seeded noise only matters when there is noise."""
        return super().guarantee_caveats() if self.noise_multiplier > 0 else []

    def server_guarantee_caveats(self) -> list[str]:
        """Distributed or local noise without SecAgg+: what reaches the server in the clear beside the noisy
        upload, which the per-upload figure does not cover. Under distributed noise, this project's clients and
        dp_privatize_mod send their update's norm before clipping (and TrainingClient its training loss and
        example count); under either, with fraction_evaluate > 0, the clients' evaluate replies (loss, accuracy,
        example count). (Under SecAgg+ clients send weight 1 and no metrics, and the figure is a diagnostic.)"""
        if self.noise_placement == "central" or self.secure_aggregation or self.noise_multiplier <= 0:
            return []
        caveats = []
        if self.noise_placement == "distributed":
            caveats.append(
                "clients send their update norm before clipping, training loss and example count in the clear "
                "beside the noisy upload: epsilon_against_server covers the upload only, not those figures"
            )
        if self.fraction_evaluate > 0:
            caveats.append(
                "clients' evaluate replies (loss, accuracy, example count; fraction-evaluate > 0) reach the server "
                "in the clear: epsilon_against_server covers the noisy uploads only, not those replies"
            )
        return caveats

    def published_keys(self) -> frozenset:
        """Under SecAgg+ the server figure depends on how many noise shares reached the sum: a diagnostic."""
        published = super().published_keys() | (
            self.adaptive_clipping.published_keys if self.adaptive_clipping else frozenset()
        )
        return published - {"epsilon_against_server"} if self.secure_aggregation else published

    def describe(self) -> dict:
        """Settings and privacy figures for summary.json (what the ledger covers)."""
        assert self.ledger is not None
        ledger = self.ledger.state_dict()
        if self.secure_aggregation:  # its per-round multipliers reveal how many shares arrived
            ledger["server"] = "in diagnostics-summary.json (not private)"
        privacy = self.privacy_metrics()
        published = self.published_keys()
        return {
            "noise_multiplier": self.noise_multiplier,
            "clipping_norm": self.clipping_norm,
            **self.describe_sampling(),
            "noise_shares": self.noise_shares,
            "noise_placement": self.noise_placement,
            "accounting_note": self.ledger.relation,
            "server_threat_model": self.ledger.server_threat_model,
            "secure_aggregation": self.secure_aggregation,
            **({"adaptive_clipping": self.adaptive_clipping.describe()} if self.adaptive_clipping else {}),
            **({"ftrl": self.ftrl.describe()} if self.ftrl else {}),
            "ledger": ledger,
            **({"audit": self.audit()} if self.audit_canaries else {}),
            **{k: v for k, v in privacy.items() if k in published},
        }

    def describe_diagnostics(self) -> dict:
        if not self.secure_aggregation:
            return super().describe_diagnostics()
        return {
            **super().describe_diagnostics(),
            "ledger": self.ledger.state_dict(),
            "epsilon_against_server": self.ledger.epsilon_against_server(),
        }


NOISE_TO_SIGNAL_LIMIT = 10.0  # sigma sqrt(d) / m above this: the default job learns at 6.4, stalls at 16


def noise_to_signal_warning(noise_multiplier: float, expected_clients: float, dim: int) -> str | None:
    """A warning when the noise on the average update, of norm about sigma C sqrt(d) / m, is more than
    NOISE_TO_SIGNAL_LIMIT times the largest average update C can be (learning is then unlikely), with the
    remedies; None otherwise."""
    if noise_multiplier <= 0 or expected_clients <= 0:
        return None
    ratio = noise_multiplier * math.sqrt(dim) / expected_clients
    if ratio <= NOISE_TO_SIGNAL_LIMIT:
        return None
    needed = math.ceil(noise_multiplier * math.sqrt(dim) / NOISE_TO_SIGNAL_LIMIT)
    return (
        f"the noise on the average update (norm about sigma*C*sqrt(d)/m) is {ratio:.3g} times the largest "
        f"average update C (sigma = {noise_multiplier:g}, d = {dim} parameters, m = {expected_clients:g} "
        f"clients per round): the model will hardly learn. Remedies: about {needed} or more clients per round "
        f"(more clients, or a higher sample-rate), a smaller noise-multiplier (a larger epsilon), or a smaller "
        f"model"
    )


DPFedAvg = DifferentialPrivacy  # DP-FedAvg: the wrapper around FedAvg (its default strategy)
