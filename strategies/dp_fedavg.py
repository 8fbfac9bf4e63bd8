"""Client-level DP around any Flower Message-API strategy: DP-FedAvg / DP-FedSAM (docs/algorithms.md §0-§2).

`DifferentialPrivacy(strategy, ...)` wraps a Flower strategy as Flower's own DP wrappers do
(`DifferentialPrivacy(FedAdam(...), clipping_norm=..., noise_multiplier=..., sample_rate=...)` is DP-FedAdam);
`DPFedAvg` is the same class, around FedAvg by default. Clients upload their new weights (any Flower client) or the
update Delta_i = w_i - w_global (this project's clients and mod). On the shared round loop
(`strategies.loop.round_loop`) the server

1. samples clients (`poisson`: each with probability q; `fixed`: exactly m = qM),
2. rejects malformed or non-finite updates (logged, counted, never averaged in),
3. clips and noises through its noise placement (`strategies.parts.noise_placement`):
   `central`: clips each update to C and adds N(0, sigma^2 C^2 I) to the sum;
   `distributed`: clients clipped and added N(0, sigma^2 C^2 / n_s I) each; the server
   tops the noise up by N(0, sigma^2 C^2 (n_s - k)/n_s I) for the k <= n_s updates that arrived,
   so the sum carries N(0, sigma^2 C^2 I) whatever k is (n_s: `noise_share_count`),
4. divides by the fixed m (uniform average) and forms w' = w + eta_s * average, which the wrapped
   strategy's aggregation and server optimizer take as post-processing (`strategies.loop.wrapped.release`),
5. charges one sampled-Gaussian event (sigma, q) to the ledger and reports epsilon.

Only what the ledger covers is published per round (`strategies.loop.run_record.split_record`); counts, norms,
losses and the clipped fraction are non-private diagnostics.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import replace
from logging import INFO, WARNING

import numpy as np
from flwr.app import ArrayRecord, Message, MetricRecord
from flwr.common import log
from flwr.serverapp.strategy import Strategy
from flwr.supercore.privacy_accounting import PrivacySpent

from dpfl.dpcore.privacy import protocol as keys
from dpfl.dpcore.privacy.calibration import default_client_delta
from dpfl.dpcore.privacy.ledger import ClientLevelLedger
from dpfl.dpcore.privacy.mechanisms import flatten, l2_norm
from dpfl.dpcore.privacy.modes import TargetEpsilonMode
from dpfl.dpcore.privacy.settings import check_client_level_dp, check_delta, large_delta_caveats
from dpfl.strategies.loop.flower_accountant import flower_accountant_keywords, flower_accounting_note
from dpfl.strategies.loop.options import PrivacyOptions, RunOptions, SamplingOptions, refuse_unknown, take
from dpfl.strategies.loop.reply_gate import ReplyGate
from dpfl.strategies.loop.round_loop import DPRoundLoop
from dpfl.strategies.loop.run_record import describe_sampling, published_keys
from dpfl.strategies.loop.wrapped import metric_replies, own_metrics, release
from dpfl.strategies.parts.audit import AuditCanaries
from dpfl.strategies.parts.mechanism import GaussianMechanism
from dpfl.strategies.parts.noise_placement import noise_placement as make_noise_placement
from dpfl.strategies.parts.part import (
    ROLES,
    Part,
    PartView,
    failure_probability,
    filling,
    keywords_of,
    sees_only_the_sum,
)
from dpfl.strategies.parts.reply_rules import MetricRule
from dpfl.strategies.parts.roles import check_roles
from dpfl.strategies.parts.secure_aggregation import SecureAggregation

ADJUSTABLE = ("clipping_norm", "noise_multiplier")  # the settings a part's after_round may give new values


def keyword_parts(keywords: dict, run: RunOptions) -> list[Part]:
    """The parts the README's flat keywords name: `adaptive_clipping=`, `ftrl=` (the part itself),
    `audit_canaries=` / `audit_canary_kind=`, `secure_aggregation=True`."""
    secure = SecureAggregation.from_keywords(keywords)  # first: its rules are checked before the others'
    given = [keywords.pop("adaptive_clipping", None), keywords.pop("ftrl", None)]
    audit = AuditCanaries.from_keywords(keywords, run.seed, run.secure_rng)
    return [p for p in (secure, *given, audit) if p is not None]


def sort_keywords(name: str, privacy, sampling, run, parts, keywords: dict) -> tuple:
    """(PrivacyOptions, SamplingOptions, RunOptions, parts) from the option objects and the flat keywords (the
    parts `keyword_parts` builds from them after the given ones); `name` is the strategy's, for errors."""
    keywords = dict(keywords)
    privacy, sampling = take(PrivacyOptions, keywords, privacy), take(SamplingOptions, keywords, sampling)
    run = take(RunOptions, keywords, run)
    parts = [*parts, *keyword_parts(keywords, run)]
    refuse_unknown(name, keywords)
    return privacy, sampling, run, parts


def check_options(privacy: PrivacyOptions, sampling: SamplingOptions, parts: Sequence[Part]) -> None:
    """The rules of these settings: the client-level DP rules, then each part's with the others."""
    check_client_level_dp(
        sample_rate=sampling.sample_rate,
        clipping_norm=privacy.clipping_norm,
        noise_multiplier=privacy.noise_multiplier,
        noise_placement=privacy.noise_placement,
        client_sampling=sampling.client_sampling,
        target_epsilon=privacy.target_epsilon,
        target_epsilon_mode=privacy.target_epsilon_mode,
        delta=privacy.delta,
        accountant=privacy.accountant,
    )
    present = keywords_of(parts)
    for part in parts:
        check_roles(part)
        part.check(privacy, present - {part.keyword})
    for role in ROLES:
        filling(parts, role, None)


REPLY_RULES = {  # what a client-level train reply may hold (each part adds its own)
    keys.UPDATE_NORM: MetricRule(low=0.0, high=1e15),
    keys.TRAIN_LOSS: MetricRule(low=0.0, high=1e15),
    keys.LOCAL_NOISE_MULTIPLIER: MetricRule(low=0.0, high=1e15),
}


class DifferentialPrivacy(DPRoundLoop):
    """Client-level DP around a Flower strategy: clipping, Gaussian noise (central, distributed or local),
    sampling with amplification, the privacy ledger, the budget stop or calibration, and whatever parts it is
    composed with (`strategies.parts.part`).

        DifferentialPrivacy(FedAdam(), clipping_norm=0.5, noise_multiplier=1.0, sample_rate=0.5)
        DifferentialPrivacy(FedAdam(), 1.0, 0.5, privacy=..., sampling=SamplingOptions(0.5), parts=[...])

    Parameters
    ----------
    strategy : the wrapped Flower strategy (first, FedAvg if None).
    noise_multiplier, clipping_norm, num_sampled_clients : sigma, C and m, positionally in Flower's order (as
        `DifferentialPrivacyServerSideFixedClipping(strategy, noise_multiplier, clipping_norm, num_sampled_clients)`
        takes them; or in `privacy` and `sampling`). m: fixed-size sampling of m nodes a round.
    privacy, sampling, run : the option objects (`strategies.loop.options`); or their fields as flat keywords
        (sample_rate, noise_placement, delta, allow_large_delta, accountant, target_epsilon, seed, on_round_end,
        ...).
    parts : the optional pieces of the round (`strategies.parts.part.Part`); the flat keywords `adaptive_clipping`
        (`strategies.parts.adaptive_clipping.AdaptiveClipping`, Andrew et al.), `ftrl` (`strategies.parts.dp_ftrl.DPFTRL`,
        Kairouz et al.), `audit_canaries` / `audit_canary_kind` (`strategies.parts.audit`) and `secure_aggregation`
        (`strategies.parts.secure_aggregation`) add theirs. The noise placement is the first part; the selection,
        mechanism and codec roles default to the round loop's sampling, `GaussianMechanism` and dense replies.
    name : the strategy's name in the log and errors (the class's; a preset's: `strategies.presets.DPFedSAMTopK`).

    Fixed-size client sampling is charged as the Gaussian mechanism at sigma / 2 (replace-one), with the smaller
    of the bounds without amplification and with sampling without replacement (`dpcore.privacy.ledger.ClientLevelLedger`).
    """

    def __init__(
        self,
        strategy: Strategy | None = None,
        noise_multiplier: float | None = None,
        clipping_norm: float | None = None,
        num_sampled_clients: int | None = None,
        *,
        privacy: PrivacyOptions | None = None,
        sampling: SamplingOptions | None = None,
        run: RunOptions | None = None,
        parts: Sequence[Part] = (),
        name: str = "",
        **keywords,
    ) -> None:
        given = {"noise_multiplier": noise_multiplier, "clipping_norm": clipping_norm}
        keywords.update({k: v for k, v in given.items() if v is not None})  # Flower's positional order
        if num_sampled_clients is not None:  # Flower's fixed-size sample of m nodes a round
            keywords.update(num_sampled_clients=num_sampled_clients)
            keywords.setdefault("client_sampling", "fixed")
            keywords.setdefault("sample_rate", 1.0)  # q = m / M once M is known
        (keywords, flower), name = flower_accountant_keywords(**keywords), name or type(self).__name__
        privacy, sampling, run, parts = sort_keywords(name, privacy, sampling, run, parts, keywords)
        check_options(privacy, sampling, parts)
        mechanism = filling(parts, "mechanism", GaussianMechanism())
        self.noise = make_noise_placement(privacy.noise_placement, mechanism.clients_clip_under_central_noise)
        self.privacy = privacy  # replaced when sigma is calibrated (make_ledger) or a part adapts C (after_round)
        parts = [self.noise, *parts]
        rules = {**REPLY_RULES, **{k: v for p in parts for k, v in p.reply_rules.items()}}
        gate = ReplyGate(  # distributed noise: a reply counts only if its client (or mod) added its noise (marked)
            rules,
            run.publish_diagnostics,
            lambda: self.noise.clients_add_noise and self.privacy.noise_multiplier > 0,
            self.upload_problem,
        )
        super().__init__(
            strategy, sampling=sampling, run=run, selection=filling(parts, "selection", None), parts=parts, gate=gate
        )
        self.name, self.mechanism, self.codec = name, mechanism, filling(parts, "codec", self.codec)
        if flower is not None:  # Flower's accountant=: how this wrapper's accounting differs from it, said once
            log(WARNING, "%s", flower_accounting_note(self, flower))

    @classmethod
    def check_settings(cls, *, privacy=None, sampling=None, run=None, parts: Sequence[Part] = (), **keywords) -> None:
        """The rules of these settings, as the constructor takes them (the same call checks a run config)."""
        privacy, sampling, _, parts = sort_keywords(cls.__name__, privacy, sampling, run, parts, keywords)
        check_options(privacy, sampling, parts)

    def add_part(self, part: Part) -> None:
        """Compose with one more part before the first round (SecAgg+'s adapter adds `SecureAggregation`)."""
        check_roles(part)
        part.check(self.privacy, keywords_of(self.parts))
        self.parts.append(part)

    # ------------------------------------------------------------------ set-up
    def make_ledger(self) -> ClientLevelLedger:
        """The mechanism's ledger at the configured delta (else `default_client_delta(M)`); for `calibrate`, sigma for
        the configured number of rounds too, by the mechanism that draws the noise (`calibrated_noise_multiplier`:
        the Gaussian's, or DP-FTRL's matrix-factorization noise's). delta >= 1/M is refused here, before round 1 (`check_delta`)."""
        check_delta(self.privacy.delta, self.population.num_clients, self.privacy.allow_large_delta)
        delta = self.privacy.delta or default_client_delta(self.population.num_clients)
        ledger = self.mechanism.make_ledger(PartView(self), delta)
        if self.privacy.target_epsilon > 0 and self.privacy.target_epsilon_mode == TargetEpsilonMode.CALIBRATE:
            sigma = self.mechanism.calibrated_noise_multiplier(PartView(self), ledger)
            self.privacy = replace(self.privacy, noise_multiplier=sigma)
            log(
                INFO,
                "Calibrated noise multiplier %.4f for epsilon %.3g after %d rounds",
                self.privacy.noise_multiplier,
                self.privacy.target_epsilon,
                self.record.num_rounds,
            )
        return ledger

    def ledger_from_state(self, state: dict) -> ClientLevelLedger:
        return self.mechanism.ledger_from_state(state)

    def state_dict(self) -> dict:
        """The round loop's state with sigma and C (calibrated, adapted)."""
        privacy = self.privacy
        return {
            **super().state_dict(),
            "noise_multiplier": privacy.noise_multiplier,
            "clipping_norm": privacy.clipping_norm,
        }

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        clipping_norm = float(state.get("clipping_norm", self.privacy.clipping_norm))
        self.privacy = replace(
            self.privacy, noise_multiplier=float(state["noise_multiplier"]), clipping_norm=clipping_norm
        )

    def summary(self) -> None:
        super().summary()
        log(INFO, "\t├──> Client-level DP (%s)", self.name)
        log(
            INFO,
            "\t│\t├── q=%.4g  C=%.4g  sigma=%.4g  noise=%s  sampling=%s",
            self.population.sample_rate,
            self.privacy.clipping_norm,
            self.privacy.noise_multiplier,
            self.noise.name,
            f"fixed (m={m})" if (m := self.population.num_sampled_clients) else self.population.client_sampling,
        )
        log(
            INFO,
            "\t│\t└── accountant=%s  target_epsilon=%s (%s)",
            self.privacy.accountant,
            self.privacy.target_epsilon or "none",
            self.privacy.target_epsilon_mode,
        )
        for line in filter(None, (part.summary() for part in self.parts)):
            log(INFO, "%s", line)

    # ------------------------------------------------------------------ train
    def client_train_config(self, server_round: int) -> dict:
        """What clients need to privatize their update this round."""
        config = {keys.SERVER_ROUND: server_round}
        for part in self.parts:
            config.update(part.client_config(PartView(self), server_round))
        return config

    def begin_round(self, arrays: ArrayRecord) -> None:
        for part in self.parts:
            part.see_model(PartView(self), arrays)
        super().begin_round(arrays)
        if not self.record.history and self.ledger is not None:  # warned once, at the first round
            dim = sum(a.size for a in self.round.global_arrays())
            if warning := noise_to_signal_warning(self.privacy.noise_multiplier, self.population.expected_clients, dim):
                log(WARNING, "%s", warning)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        assert self.round.arrays is not None and self.ledger is not None
        replies = list(replies)
        measured = {
            k: v for part in self.parts for k, v in part.round_metrics(PartView(self), server_round, replies).items()
        }
        global_arrays = self.round.global_arrays()
        accepted, failures, rejected = self.gate.accepted(self, server_round, replies)
        updates, norms, losses = [], [], []
        for vector, metrics in accepted:
            vector, norm = self.noise.server_clip(vector, metrics, self.privacy.clipping_norm)
            updates.append(vector)
            norms.append(norm)
            if keys.TRAIN_LOSS in metrics:
                losses.append(float(metrics[keys.TRAIN_LOSS]))

        extra = extra_updates(self, server_round, sum(a.size for a in global_arrays))
        new_global = self.noisy_average_step(server_round, updates + extra, flatten(global_arrays), len(updates))
        arrays, wrapped_metrics = release(self, server_round, new_global, metric_replies(self, server_round))
        own = own_metrics(self, wrapped_metrics)
        metrics = {
            **own,
            **round_statistics(updates, rejected, failures, norms, losses, self.privacy.clipping_norm),
            **measured,
        }
        metrics.update({"server_noise_std": self.round.server_noise_std, **self.privacy_metrics()})
        for part in self.parts:  # e.g. C_{t+1} from the noised count (after this round's noise used C_t)
            after = part.after_round(PartView(self), server_round, accepted, norms)
            metrics.update(after.record)
            for name, value in after.settings.items():
                if name not in ADJUSTABLE:
                    raise ValueError(f"{type(part).__name__} returned {name!r}: only {ADJUSTABLE} may change")
                self.privacy = replace(self.privacy, **{name: value})
        return arrays, MetricRecord(metrics)

    def upload_problem(self, vector: np.ndarray, metrics: dict) -> str | None:
        """What a part refuses, or an upload above the bound an honest one stays under (p <= 1e-12)."""
        for part in self.parts:
            if problem := part.reply_problem(PartView(self), metrics):
                return problem
        bound = self.noise.upload_norm_bound(
            self.update_noise_multiplier(), self.privacy.clipping_norm, self.population.noise_shares, vector.size
        )
        norm = l2_norm(vector)
        return f"upload norm {norm:.6g} above the bound {bound:.6g} of an honest noisy update" if norm > bound else None

    def update_noise_multiplier(self) -> float:
        """The multiplier of the noise on the update sum: sigma, or what the parts leave of it (under adaptive
        clipping sigma_Delta of Theorem 1; the ledger still charges sigma)."""
        multiplier = self.privacy.noise_multiplier
        for part in self.parts:
            multiplier = part.update_noise_multiplier(multiplier)
        return multiplier

    def accounted_noise_multiplier(self) -> float:
        """The sigma the ledger charges per round (the mechanism's: a noise that is not N(0, sigma^2 C^2 I)
        has its own)."""
        return self.mechanism.accounted_noise_multiplier(PartView(self))

    def noisy_average_step(
        self, server_round: int, updates: list[np.ndarray], global_vector: np.ndarray, received: int | None = None
    ) -> np.ndarray:
        """The mechanism's release, w + eta_s * (sum_i Delta_i + server noise) / m, and the round charged to the
        ledger (with the probability that this round's sample was truncated to n_s, and the parts' failure
        probability, reserved out of delta).

        `received`: how many client noise shares the updates carry (default len(updates); under
        SecAgg+ one summed vector carries the shares of every client that made it into the sum).
        """
        assert self.ledger is not None
        received = len(updates) if received is None else received
        new_global, self.round.server_noise_std = self.mechanism.release(
            PartView(self), server_round, updates, global_vector, received
        )
        self.ledger.record_round(
            self.accounted_noise_multiplier(),
            self.population.sample_rate,
            self.population.noise_shares,
            received,
            truncation_probability=self.round.truncation_probability + failure_probability(self.parts),
            sampled_from=self.round.sampled_from,
        )
        return new_global

    def privacy_spent(self) -> PrivacySpent | None:
        """What Flower's DP wrappers' `privacy_spent()` returns, from the ledger: epsilon and delta of the model
        released so far, the rounds charged, and the accountant whose bound it is; None before round 1 (also when
        the budget refused round 1)."""
        if self.ledger is None or not self.record.completed_rounds:
            return None
        return PrivacySpent(
            epsilon=self.ledger.epsilon(),
            delta=self.ledger.delta,
            num_releases=self.record.completed_rounds,
            accounting_method=self.ledger.model_bound_by(),
        )

    def privacy_metrics(self) -> dict:
        assert self.ledger is not None
        return {
            "epsilon": self.ledger.epsilon(),
            "delta": self.ledger.delta,
            "epsilon_against_server": self.ledger.epsilon_against_server(),
        }

    # ------------------------------------------------------------------ loop
    def budget_exhausted(self) -> bool:
        """Would the round push epsilon above the target? Once a round has sampled (`sample_clients`, before
        anything is sent) it is charged at its own (N, m) and truncation probability; after it, the next round is
        predicted with them. The target is a hard cap in both modes: `calibrate` picks sigma so that the
        configured rounds end at the target, but a run given more rounds than it was calibrated for (a resume
        with a larger num-rounds, a legacy strategy whose num_rounds is below its ServerConfig's), or whose
        population shrinks under fixed-size sampling, stops here too."""
        if self.ledger is None or self.privacy.target_epsilon <= 0:
            return False
        epsilon = self.ledger.epsilon_after_rounds(
            self.accounted_noise_multiplier(),
            self.population.sample_rate,
            1,
            self.selection.next_truncation_probability(PartView(self)) + failure_probability(self.parts),
            sampled_from=self.round.sampled_from,
        )
        return epsilon > self.privacy.target_epsilon

    def budget_stop_reason(self, server_round: int) -> str:
        calibrated = self.privacy.target_epsilon_mode == TargetEpsilonMode.CALIBRATE
        note = " (sigma was calibrated for fewer rounds)" if calibrated else ""
        return f"target epsilon {self.privacy.target_epsilon} reached: round {server_round} would spend more{note}"

    def guarantee_caveats(self) -> list[str]:
        """Seeded noise only matters when there is noise; a delta >= 1/M let through; and what the parts say."""
        caveats = super().guarantee_caveats() if self.privacy.noise_multiplier > 0 else []
        if self.ledger is not None:
            caveats += large_delta_caveats(self.ledger.delta, self.population.num_clients)
        return caveats + [c for part in self.parts for c in part.caveats(PartView(self))]

    def describe(self) -> dict:
        """Settings and privacy figures for summary.json (what the ledger covers)."""
        assert self.ledger is not None
        privacy = self.privacy_metrics()
        published = published_keys(self)
        summary = {
            "noise_multiplier": self.privacy.noise_multiplier,
            "clipping_norm": self.privacy.clipping_norm,
            **describe_sampling(self),
            "noise_shares": self.population.noise_shares,
            "noise_placement": self.noise.name,
            "accounting_note": self.ledger.relation,
            "server_threat_model": self.ledger.server_threat_model,
            "secure_aggregation": sees_only_the_sum(self),
            "ledger": self.ledger.state_dict(),
            **{k: v for k, v in privacy.items() if k in published},
        }
        for part in self.parts:
            summary.update(part.describe(PartView(self)))
        return summary


def extra_updates(dp: DifferentialPrivacy, server_round: int, dim: int) -> list[np.ndarray]:
    """The vectors the parts add to the round's sum (the audit's canaries)."""
    return [v for part in dp.parts for v in part.extra_updates(PartView(dp), server_round, dim)]


def round_statistics(updates: list, rejected: int, failures: int, norms: list, losses: list, clip: float) -> dict:
    """The round's non-private diagnostics: counts, the clipped fraction, the norms before clipping, the loss."""
    finite_norms = np.array([n for n in norms if math.isfinite(n)])
    return {
        "clients": len(updates),
        "rejected": rejected,
        "failures": failures,
        "clipped_fraction": float(np.mean(finite_norms > clip)) if clip > 0 and finite_norms.size else 0.0,
        "update_norm_mean": float(finite_norms.mean()) if finite_norms.size else 0.0,
        "update_norm_std": float(finite_norms.std()) if finite_norms.size else 0.0,
        **({"train_loss": float(np.mean(losses))} if losses else {}),  # none reported: none made up
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
