"""The algorithm registry: everything the app knows about each algorithm, in one record.

A record names the server strategy and how to build it from the run config, the client and how
to build it, the run-config keys the algorithm owns, the settings it ignores, its non-private
reference and its plot label. `fl_app.server_app`, `fl_app.client_app`, `fl_app.config`,
`fl_app.launch` and `fl_app.results` read these records and never branch on an algorithm's
name. The rules between DP settings live with the strategies (`check_settings`), so a strategy
built from Python checks exactly what `fl_app.config.validate` checks for a run config.

Adding an algorithm: write its strategy and client classes, then add one `Algorithm` record to
`ALGORITHMS` below (docs/architecture.md walks through an example).

Client classes are imported inside the builders: a ClientApp imports Opacus only for DP-SGD.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flwr.app import Context
from flwr.client import NumPyClient
from flwr.serverapp.strategy import FedAdagrad, FedAdam, FedAvg, FedAvgM, FedYogi, Strategy

from dpcore.privacy.dpsgd_noise import DEFAULT_SAMPLE_DELTA
from dpcore.privacy.settings import check_calibration_reachable
from strategies.adaptive_clipping import AdaptiveClipping
from strategies.ali_dpfl import ALIDPFL
from strategies.dp_fedavg import DPFedAvg
from strategies.dp_ftrl import DPFTRL
from strategies.partial_sharing import PartialSharingDPFedAvg, PersonalizedDPFedAvg
from strategies.round_loop import DPRoundLoop
from strategies.topk import DPFedSAMTopK
from strategies.wavelet import DPFedAvgWavelet

if TYPE_CHECKING:
    from fl_app.settings import Settings


@dataclass(frozen=True)
class ClientSetup:
    """What every client builder gets: the run's settings, the node's Context, its data and model."""

    settings: Settings
    context: Context
    partition_id: int
    trainset: Any
    testset: Any
    model: Any

    def training_kwargs(self) -> dict:
        """The local-training settings every TrainingClient takes (device: dpcore.task.device)."""
        from dpcore.task.device import resolve_device, use_channels_last

        training, device = self.settings.training, resolve_device(self.settings.training.device)
        return dict(
            batch_size=training.batch_size,
            lr=training.lr,
            momentum=training.momentum,
            weight_decay=training.weight_decay,
            local_epochs=training.local_epochs,
            local_steps=training.local_steps,
            partition_id=self.partition_id,
            seed=self.settings.run.seed,
            secure_rng=self.settings.privacy.secure_rng,
            lr_decay=training.lr_decay,
            device=device,
            channels_last=use_channels_last(training.model, device),
        )


def load_client_partition(s: Settings, partition_id: int, num_partitions: int) -> tuple[Any, Any]:
    """(train, test) of one client: the run's data and partitioner (the ClientApp's, and the server's sizes)."""
    from dpcore.task.data import load_partition

    d = s.data
    return load_partition(
        d.dataset,
        partition_id,
        num_partitions,
        d.partitioner,
        alpha=d.dirichlet_alpha,
        classes_per_client=d.classes_per_client,
        seed=s.run.seed,
        data_dir=d.data_dir,
        validation_fraction=d.validation_fraction,
    )


@dataclass(frozen=True)
class Algorithm:
    """One algorithm of the product.

    strategy_class, strategy_settings : the server strategy and its keyword arguments from the run's
        Settings (the round-loop ones are added by `strategy_kwargs`); `strategy_class.check_settings`
        checks them.
    build_client : ClientSetup -> the NumPyClient that trains on a node.
    owned_keys : run-config keys that only this algorithm (and others listing them) may change.
    unused_keys : keys of other privacy models that this algorithm ignores, with the key to use instead.
    reference : run-config overrides that make its non-private reference run.
    privacy_unit : "client" (client-level DP) or "sample" (sample-level DP-SGD).
    shares_body_only : the server holds and broadcasts the body; heads stay on the clients.
    opacus_model : the model is made Opacus-compatible (the server's copy too).
    secure_aggregation : can run under SecAgg+ (sums of dense client-level updates).
    check_config : extra rules of this algorithm on the Settings (raise ValueError naming the key).
    """

    name: str
    description: str
    strategy_class: type[DPRoundLoop]
    strategy_settings: Callable[[Settings], dict]
    build_client: Callable[[ClientSetup], NumPyClient]
    owned_keys: tuple[str, ...] = ()
    unused_keys: dict[str, str | None] = field(default_factory=dict)
    reference: dict = field(
        default_factory=lambda: {"noise-multiplier": 0.0, "clipping-norm": 0.0, "target-epsilon": 0.0}
    )
    privacy_unit: str = "client"
    shares_body_only: bool = False
    opacus_model: bool = False
    secure_aggregation: bool = False
    check_config: Callable[[Settings], None] | None = None

    def strategy_kwargs(self, s: Settings) -> dict:
        """Every DP keyword argument of the strategy, from the run's settings (the wrapped Flower strategy
        comes from `wrapped_strategy`)."""
        fedavg_step = s.server.lr if s.server.strategy == "fedavg" else 1.0  # else the optimizer's eta
        return dict(
            sample_rate=s.federation.sample_rate,
            client_sampling=s.federation.client_sampling,
            server_learning_rate=fedavg_step,
            delta=s.privacy.delta,
            accountant=s.privacy.accountant,
            target_epsilon=s.privacy.target_epsilon,
            seed=s.run.seed,
            secure_rng=s.privacy.secure_rng,
            min_available_nodes=s.federation.min_nodes,
            publish_diagnostics=s.output.publish_diagnostics,
            **self.strategy_settings(s),
        )

    def build_strategy(self, s: Settings, **hooks) -> DPRoundLoop:
        """The DP wrapper of this algorithm around the run's Flower strategy (`server-strategy`)."""
        return self.strategy_class(wrapped_strategy(s), **self.strategy_kwargs(s), **hooks)

    def run_label(self, summary: dict) -> str:
        """How a run of this algorithm is labelled in plots and reports."""
        if self.privacy_unit == "sample":
            return f"{self.name} (sample-level, target epsilon {summary.get('target_epsilon')})"
        sigma = summary.get("noise_multiplier")
        return f"{self.name} sigma={sigma}" if sigma else f"{self.name} non-private reference"


# ---------------------------------------------------------------------------- the wrapped Flower strategy
SERVER_STRATEGIES = ("fedavg", "fedadam", "fedyogi", "fedadagrad", "fedavgm")


def wrapped_strategy(s: Settings) -> Strategy:
    """The Flower strategy the DP wrapper runs around (`server-strategy`): its aggregation and server optimizer
    act on the privatized average. eta = server-lr for FedAdam/FedYogi/FedAdagrad (eta_l = lr, what clients
    use), FedAvgM's server_learning_rate = server-lr with momentum server-momentum; FedAvg: the wrapper's own
    step w + server-lr * average. Evaluation: fraction-evaluate of the clients."""
    common = dict(
        fraction_train=1.0,
        fraction_evaluate=s.federation.fraction_evaluate,
        min_train_nodes=0,
        min_evaluate_nodes=0,
        min_available_nodes=s.federation.min_nodes,
    )
    name = s.server.strategy
    if name in ("fedadam", "fedyogi", "fedadagrad"):
        optimizer = {"fedadam": FedAdam, "fedyogi": FedYogi, "fedadagrad": FedAdagrad}[name]
        return optimizer(eta=s.server.lr, eta_l=s.training.lr, **common)
    if name == "fedavgm":
        return FedAvgM(server_learning_rate=s.server.lr, server_momentum=s.server.momentum, **common)
    return FedAvg(**common)


# ---------------------------------------------------------------------------- strategy settings
def adaptive_clipping(s: Settings) -> AdaptiveClipping | None:
    """`adaptive-clipping = true`: the part the DP wrapper is composed with (docs/dp-toolbox.md §3)."""
    if not s.adaptive_clipping.enabled:
        return None
    return AdaptiveClipping(
        target_quantile=s.adaptive_clipping.target_quantile,
        learning_rate=s.adaptive_clipping.learning_rate,
        count_noise_multiplier=s.adaptive_clipping.count_noise_multiplier,
    )


def client_level(s: Settings) -> dict:
    return dict(
        clipping_norm=s.privacy.clipping_norm,
        noise_multiplier=s.privacy.noise_multiplier,
        noise_placement=s.privacy.noise_placement,
        target_epsilon_mode=s.privacy.target_epsilon_mode,
        secure_aggregation=s.secagg.enabled,
        audit_canaries=s.audit.canaries,
        audit_canary_kind=s.audit.canary_kind,
        adaptive_clipping=adaptive_clipping(s),
    )


def ftrl_settings(s: Settings) -> dict:
    """DP-FTRL (docs/dp-toolbox.md §4): the wrapper with central noise (the noise-placement default, distributed,
    does not apply: the tree is noised at the server) and the DPFTRL part."""
    return {
        **client_level(s),
        "noise_placement": "central",
        "ftrl": DPFTRL(epoch_rounds=s.ftrl.epoch_rounds, momentum=s.ftrl.momentum),
    }


def topk_settings(s: Settings) -> dict:
    return {**client_level(s), "sparsity": s.topk.sparsity, "topk_mode": s.topk.mode}


def wavelet_settings(s: Settings) -> dict:
    return {**client_level(s), "wavelet_calibration": s.wavelet.calibration}


def dpsgd_settings(s: Settings) -> dict:
    d = s.dpsgd
    return dict(
        batch_sample_rate=d.sample_rate,
        sample_noise_multiplier=d.noise_multiplier,
        sample_clipping_norm=d.clipping_norm,
        adaptive=d.adaptive,
        local_steps=s.training.local_steps,
        gamma=d.gamma,
        mu_source=d.mu_source,
        mu_noise_multiplier=d.mu_noise_multiplier,
        mu_max=d.mu_max,
        dpsgd_noise=d.noise,
        wavelet_calibration=s.wavelet.calibration,
        grad_sample_mode=d.grad_sample_mode,
        num_partitions=d.num_partitions,
    )


# ---------------------------------------------------------------------------- clients
def sgd_client(setup: ClientSetup) -> NumPyClient:
    from clients.base import TrainingClient

    return TrainingClient(setup.model, setup.trainset, setup.testset, **setup.training_kwargs())


def sam_client(setup: ClientSetup) -> NumPyClient:
    from clients.sam import SAMClient

    return SAMClient(
        setup.model, setup.trainset, setup.testset, rho=setup.settings.training.sam_rho, **setup.training_kwargs()
    )


def topk_sam_client(setup: ClientSetup) -> NumPyClient:
    from clients.topk import TopKSAMClient

    return TopKSAMClient(
        setup.model, setup.trainset, setup.testset, rho=setup.settings.training.sam_rho, **setup.training_kwargs()
    )


def fine_tuned(inner: Callable[[ClientSetup], NumPyClient]) -> Callable[[ClientSetup], NumPyClient]:
    """A -FT baseline: `inner` trains; evaluation fine-tunes the global model locally first."""

    def build(setup: ClientSetup) -> NumPyClient:
        from clients.personalized import FineTuneClient

        return FineTuneClient(inner(setup), setup.settings.personalization.fine_tune_steps)

    return build


def head_store(context: Context, partition_id: int):
    """Where this node keeps its personal head: a file under node config `state-dir` (a deployment),
    else Context.state (simulation, where Context.state lives as long as the run)."""
    from clients.personalized import ContextHeadStore, FileHeadStore

    state_dir = context.node_config.get("state-dir")
    if state_dir is None:
        return ContextHeadStore(context.state)
    if not os.path.isabs(os.path.expanduser(str(state_dir))):
        raise ValueError(f"node config state-dir={state_dir!r} must be an absolute folder path")
    return FileHeadStore(
        Path(os.path.expanduser(str(state_dir))) / f"personal-head-run{context.run_id}-partition{partition_id}.npz"
    )


def partial_sharing_client(sam: bool) -> Callable[[ClientSetup], NumPyClient]:
    """DP2-FedSAM (SAM on the body) or CENTAUR (SGD): the head stays on the client."""

    def build(setup: ClientSetup) -> NumPyClient:
        from clients.personalized import DP2FedSAMClient, PartialSharingClient
        from dpcore.task.models import split_state_keys

        p, training = setup.settings.personalization, setup.settings.training
        _, head_keys = split_state_keys(setup.model, p.head_prefix)
        personal = dict(
            head_keys=head_keys,
            head_store=head_store(setup.context, setup.partition_id),
            head_epochs=p.head_epochs,
            head_steps=p.head_steps,
            head_lr=p.head_lr or training.lr,
            **setup.training_kwargs(),
        )
        if sam:
            return DP2FedSAMClient(setup.model, setup.trainset, setup.testset, rho=training.sam_rho, **personal)
        return PartialSharingClient(setup.model, setup.trainset, setup.testset, **personal)

    return build


def dpsgd_client(setup: ClientSetup) -> NumPyClient:
    from clients.dpsgd import DPSGDClient

    d, privacy = setup.settings.dpsgd, setup.settings.privacy
    return DPSGDClient(
        setup.model,
        setup.trainset,
        setup.testset,
        state=setup.context.state,
        sample_rate=d.sample_rate,
        noise_multiplier=d.noise_multiplier,
        clipping_norm=d.clipping_norm,
        target_epsilon=privacy.target_epsilon,
        delta=privacy.delta or DEFAULT_SAMPLE_DELTA,
        accountant=privacy.accountant,
        grad_sample_mode=d.grad_sample_mode,
        mu_max=d.mu_max,
        mu_noise_multiplier=d.mu_noise_multiplier,
        noise=d.noise,
        wavelet_calibration=setup.settings.wavelet.calibration,
        num_partitions=int(setup.context.node_config["num-partitions"]),
        **setup.training_kwargs(),
    )


# ---------------------------------------------------------------------------- extra config rules
def check_head_prefix(s: Settings) -> None:
    """The head prefix must name some but not all of the model's parameters."""
    from dpcore.task.data import dataset_info
    from dpcore.task.models import build_model, split_state_keys

    prefix, model = s.personalization.head_prefix, s.training.model
    if not prefix:
        return
    info = dataset_info(s.data.dataset)
    try:
        split_state_keys(build_model(model, info["input_shape"], info["num_classes"]), prefix)
    except ValueError as exc:
        raise ValueError(f"run-config key 'head-prefix' = {prefix!r} does not fit model {model!r}: {exc}") from None


def check_dpsgd_config(s: Settings) -> None:
    if s.privacy.target_epsilon_mode != "stop":
        raise ValueError(
            f"run-config key 'target-epsilon-mode' = {s.privacy.target_epsilon_mode!r}: only 'stop' is "
            "allowed (clients stop at R_c steps)"
        )
    if s.wavelet.calibration != "exact" and s.dpsgd.noise != "wavelet":
        raise ValueError(
            f"run-config key 'wavelet-calibration' = {s.wavelet.calibration!r} applies only with "
            "dpsgd-noise = 'wavelet'"
        )


def check_ftrl_config(s: Settings) -> None:
    if s.server.strategy != "fedavg":
        raise ValueError(
            f"run-config key 'server-strategy' = {s.server.strategy!r}: DP-FTRL is its own server "
            "optimizer (FTRL on the noisy prefix sums, momentum: 'ftrl-momentum'); use 'fedavg'"
        )
    if s.privacy.noise_placement == "local":
        raise ValueError(
            "run-config key 'noise-placement' = 'local': DP-FTRL adds the tree's noise at the server "
            "('central', which it uses whatever the key says otherwise)"
        )
    if s.output.resume:
        raise ValueError(
            "run-config key 'resume' = True is not supported with DP-FTRL (its tree's noise is not "
            "checkpointed, and redrawing it would release the same nodes twice)"
        )


SAMPLE_LEVEL_KEYS = (
    "sample-noise-multiplier",
    "sample-clipping-norm",
    "batch-sample-rate",
    "grad-sample-mode",
    "dpsgd-noise",
    "adaptive",
    "gamma",
    "mu-source",
    "mu-max",
    "mu-noise-multiplier",
    "wavelet-calibration",
)
HEAD_KEYS = ("head-prefix",)

ALGORITHMS: dict[str, Algorithm] = {
    a.name: a
    for a in (
        Algorithm(
            "dp-fedavg",
            "DP-FedAvg: local SGD, clip + Gaussian noise (docs/algorithms.md §1)",
            DPFedAvg,
            client_level,
            sgd_client,
            secure_aggregation=True,
        ),
        Algorithm(
            "dp-fedsam",
            "DP-FedSAM: local SAM, clip + Gaussian noise (§2)",
            DPFedAvg,
            client_level,
            sam_client,
            secure_aggregation=True,
        ),
        Algorithm(
            "dp-fedsam-topk",
            "DP-FedSAM-top_k: DP-FedSAM with top-k sparse uploads (§3)",
            DPFedSAMTopK,
            topk_settings,
            topk_sam_client,
            owned_keys=("sparsity", "topk-mode"),
            secure_aggregation=True,
        ),
        Algorithm(
            "dp-fedavg-wav",
            "DP-FedAvg-WAV: Haar-wavelet noise at the server (§6)",
            DPFedAvgWavelet,
            wavelet_settings,
            sgd_client,
            owned_keys=("wavelet-calibration",),
            unused_keys={"adaptive-clipping": None},
        ),
        Algorithm(
            "dp2-fedsam",
            "DP²-FedSAM: shared body with SAM, personal heads (§4)",
            PartialSharingDPFedAvg,
            client_level,
            partial_sharing_client(sam=True),
            owned_keys=HEAD_KEYS,
            shares_body_only=True,
            check_config=check_head_prefix,
        ),
        Algorithm(
            "centaur",
            "CENTAUR: DP²-FedSAM with SGD on the body (§4)",
            PartialSharingDPFedAvg,
            client_level,
            partial_sharing_client(sam=False),
            owned_keys=HEAD_KEYS,
            shares_body_only=True,
            check_config=check_head_prefix,
        ),
        Algorithm(
            "dp-fedavg-ft",
            "DP-FedAvg-FT: DP-FedAvg, evaluated after local fine-tuning (§4)",
            PersonalizedDPFedAvg,
            client_level,
            fine_tuned(sgd_client),
            owned_keys=("fine-tune-steps",),
        ),
        Algorithm(
            "dp-fedsam-ft",
            "DP-FedSAM-FT: DP-FedSAM, evaluated after local fine-tuning (§4)",
            PersonalizedDPFedAvg,
            client_level,
            fine_tuned(sam_client),
            owned_keys=("fine-tune-steps",),
        ),
        Algorithm(
            "dp-ftrl",
            "DP-FTRL: no sampling, each node at most once per epoch, tree-aggregated noise (docs/dp-toolbox.md §4)",
            DPFedAvg,
            ftrl_settings,
            sgd_client,
            owned_keys=("ftrl-epoch-rounds", "ftrl-momentum"),
            unused_keys={
                "client-sampling": None,
                "adaptive-clipping": None,
                "audit-canaries": None,
                "audit-canary-kind": None,
            },
            reference={"algorithm": "dp-fedavg", "noise-multiplier": 0.0, "clipping-norm": 0.0, "target-epsilon": 0.0},
            check_config=check_ftrl_config,
        ),
        Algorithm(
            "ali-dpfl",
            "ALI-DPFL: DP-SGD clients, adaptive local iterations (§5; DP-SGD-WAV with dpsgd-noise = 'wavelet', §6)",
            ALIDPFL,
            dpsgd_settings,
            dpsgd_client,
            owned_keys=SAMPLE_LEVEL_KEYS,
            unused_keys={
                "clipping-norm": "sample-clipping-norm",
                "noise-multiplier": "sample-noise-multiplier",
                "noise-placement": None,
                "audit-canaries": None,
                "audit-canary-kind": None,
                "adaptive-clipping": None,
            },
            reference={"algorithm": "dp-fedavg", "noise-multiplier": 0.0, "clipping-norm": 0.0, "target-epsilon": 0.0},
            privacy_unit="sample",
            opacus_model=True,
            check_config=check_dpsgd_config,
        ),
    )
}
DEFAULT_ALGORITHM = "dp-fedsam"


def algorithm(name: str) -> Algorithm:
    if name not in ALGORITHMS:
        raise ValueError(f"algorithm={name!r} is not one of: {', '.join(ALGORITHMS)}")
    return ALGORITHMS[name]


def owners(key: str) -> list[str]:
    """The algorithms that own a run-config key (empty: a key every algorithm may set)."""
    return [a.name for a in ALGORITHMS.values() if key in a.owned_keys]


def check_config(s: Settings) -> None:
    """The rules of the run's algorithm: owned and unused keys, the strategy's settings (the very
    `check_settings` a strategy built from Python runs), SecAgg+ support and the algorithm's own
    rules. Raises ValueError naming the key, the value and what is allowed."""
    algo = ALGORITHMS[s.run.algorithm]
    values, defaults = s.run_config(), s.DEFAULTS  # by key: the owned and unused keys are named
    for key in {k for a in ALGORITHMS.values() for k in a.owned_keys}:
        if values[key] != defaults[key] and key not in algo.owned_keys:
            allowed = " or ".join(owners(key))
            raise ValueError(
                f"run-config key '{key}' = {values[key]!r} applies only to algorithm = {allowed}, "
                f"but 'algorithm' = {algo.name!r}; remove {key} or change the algorithm"
            )
    for key, instead in algo.unused_keys.items():
        if values[key] != defaults[key]:
            hint = f"; use '{instead}'" if instead else ""
            raise ValueError(
                f"run-config key '{key}' = {values[key]!r} is a client-level DP setting that algorithm "
                f"{algo.name!r} ({algo.privacy_unit}-level DP) does not use: leave it at "
                f"{defaults[key]!r}{hint}"
            )
    if s.secagg.enabled and s.server.strategy != "fedavg":
        raise ValueError(
            f"run-config key 'server-strategy' = {s.server.strategy!r} does not run under "
            "'secure-aggregation' = True (SecAgg+ runs Flower's legacy FedAvg workflow): use 'fedavg'"
        )
    if s.secagg.enabled and not algo.secure_aggregation:
        supported = ", ".join(a.name for a in ALGORITHMS.values() if a.secure_aggregation)
        raise ValueError(
            f"run-config key 'secure-aggregation' = True works with algorithm {supported} "
            f"(sums of dense updates), not {algo.name!r}"
        )
    try:
        algo.strategy_class.check_settings(**algo.strategy_kwargs(s))
        if (
            algo.privacy_unit == "client"
            and s.privacy.target_epsilon > 0
            and s.privacy.target_epsilon_mode == "calibrate"
        ):
            check_calibration_reachable(
                target_epsilon=s.privacy.target_epsilon,
                delta=s.privacy.delta,
                sample_rate=s.federation.sample_rate,
                rounds=s.run.num_rounds,
                client_sampling=s.federation.client_sampling,
                accountant=s.privacy.accountant,
            )
    except ValueError as exc:
        raise ValueError(f"algorithm {algo.name!r}: {exc}") from None
    if algo.check_config:
        algo.check_config(s)


def reference_overrides(overrides: dict, defaults: dict) -> dict:
    """Run-config overrides of the non-private reference of a run configured by `overrides`.

    The reference keeps the data, model and training settings, drops the keys its own algorithm
    does not accept, and applies the algorithm's `reference` overrides.
    """
    algo = ALGORITHMS[overrides.get("algorithm", defaults["algorithm"])]
    ref_algorithm = ALGORITHMS[algo.reference.get("algorithm", algo.name)]
    dropped = {k for a in ALGORITHMS.values() for k in a.owned_keys} - set(ref_algorithm.owned_keys)
    kept = {k: v for k, v in overrides.items() if k not in dropped}
    return {**kept, **algo.reference}
