"""What the registry's records are built from, each from the run's Settings: the Flower strategy the DP
wrapper runs around, the strategies' keyword arguments, the clients, and the algorithms' extra config rules.

`fl_app.algorithms` names these functions in its `Algorithm` records; nothing here names an algorithm.
Client classes are imported inside the builders: a ClientApp imports Opacus only for DP-SGD.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from flwr.app import Context
from flwr.client import NumPyClient
from flwr.serverapp.strategy import FedAdagrad, FedAdam, FedAvg, FedAvgM, FedYogi, Strategy

from dpfl.dpcore.privacy.dpsgd_noise import DEFAULT_SAMPLE_DELTA
from dpfl.dpcore.privacy.matrix_factorization import require_jax_privacy
from dpfl.dpcore.privacy.modes import NoisePlacementMode, TargetEpsilonMode
from dpfl.fl_app.settings import Settings
from dpfl.strategies.loop.options import DPSGDOptions, PrivacyOptions, RunOptions, SamplingOptions
from dpfl.strategies.parts.adaptive_clipping import AdaptiveClipping
from dpfl.strategies.parts.audit import AuditCanaries
from dpfl.strategies.parts.dp_ftrl import DPFTRL
from dpfl.strategies.parts.dp_ftrl_mf import MatrixFactorizationFTRL
from dpfl.strategies.parts.part import Part
from dpfl.strategies.parts.secure_aggregation import SecureAggregation


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
        from dpfl.dpcore.task.device import resolve_device, use_channels_last

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
    from dpfl.dpcore.task.partitions import load_partition

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


# ---------------------------------------------------------------------------- the wrapped Flower strategy
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


def sampling_options(s: Settings) -> SamplingOptions:
    """Who takes part: q, Poisson or fixed-size sampling, the nodes to wait for."""
    return SamplingOptions(s.federation.sample_rate, s.federation.client_sampling, s.federation.min_nodes)


def run_options(s: Settings, **hooks) -> RunOptions:
    """eta_s (server-lr under fedavg, else the wrapped optimizer's eta and 1 here), the randomness, the outputs;
    `hooks`: on_round_end, on_checkpoint."""
    fedavg_step = s.server.lr if s.server.strategy == "fedavg" else 1.0
    return RunOptions(
        server_learning_rate=fedavg_step,
        seed=s.run.seed,
        secure_rng=s.privacy.secure_rng,
        publish_diagnostics=s.output.publish_diagnostics,
        **hooks,
    )


def privacy_options(s: Settings) -> PrivacyOptions:
    """C, sigma, who adds the noise, the ledger's delta and accountant, the budget."""
    p = s.privacy
    return PrivacyOptions(
        clipping_norm=p.clipping_norm,
        noise_multiplier=p.noise_multiplier,
        noise_placement=p.noise_placement,
        delta=p.delta,
        allow_large_delta=p.allow_large_delta,
        accountant=p.accountant,
        target_epsilon=p.target_epsilon,
        target_epsilon_mode=p.target_epsilon_mode,
    )


def client_parts(s: Settings, mechanism: Part | None = None) -> list[Part]:
    """The parts the run config composes the wrapper with, in the order they run: SecAgg+ (its rules are checked
    first), adaptive clipping, the algorithm's own `mechanism` (DP-FTRL's), the audit's canaries."""
    canaries, kind = s.audit.canaries, s.audit.canary_kind  # the kind is read (and checked) without canaries too
    audit = canaries and AuditCanaries(canaries, kind, seed=s.run.seed, secure_rng=s.privacy.secure_rng)
    return [p for p in (s.secagg.enabled and SecureAggregation(), adaptive_clipping(s), mechanism, audit) if p]


def client_level(s: Settings) -> dict:
    """The client-level wrapper's option object and parts, made from the Settings."""
    return {"privacy": privacy_options(s), "parts": client_parts(s)}


def ftrl_part(s: Settings) -> Part:
    """DP-FTRL's mechanism (docs/dp-toolbox.md §4): the DPFTRL part (tree) or MatrixFactorizationFTRL (blt,
    banded)."""
    if s.ftrl.strategy == "tree":
        return DPFTRL(epoch_rounds=s.ftrl.epoch_rounds, momentum=s.ftrl.momentum)
    return MatrixFactorizationFTRL(
        s.ftrl.strategy,
        s.ftrl.epoch_rounds,
        s.ftrl.max_participations,
        momentum=s.ftrl.momentum,
        amplified=s.ftrl.amplified,
    )


def ftrl_settings(s: Settings) -> dict:
    """DP-FTRL: the wrapper with central noise (the noise-placement default, distributed, does not apply: the noise
    is added at the server) composed with its part (`client_parts`)."""
    privacy = replace(privacy_options(s), noise_placement=NoisePlacementMode.CENTRAL)
    return {"privacy": privacy, "parts": client_parts(s, ftrl_part(s))}


def topk_settings(s: Settings) -> dict:
    return {**client_level(s), "sparsity": s.topk.sparsity, "topk_mode": s.topk.mode}


def wavelet_settings(s: Settings) -> dict:
    return {**client_level(s), "wavelet_calibration": s.wavelet.calibration}


def dpsgd_settings(s: Settings) -> dict:
    """ALI-DPFL's DP-SGD option object."""
    d = s.dpsgd
    dpsgd = DPSGDOptions(
        batch_sample_rate=d.sample_rate,
        sample_noise_multiplier=d.noise_multiplier,
        sample_clipping_norm=d.clipping_norm,
        target_epsilon=s.privacy.target_epsilon,
        delta=s.privacy.delta,
        accountant=s.privacy.accountant,
        allow_large_delta=s.privacy.allow_large_delta,
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
    return {"dpsgd": dpsgd}


# ---------------------------------------------------------------------------- clients
def sgd_client(setup: ClientSetup) -> NumPyClient:
    from dpfl.clients.base import TrainingClient

    return TrainingClient(setup.model, setup.trainset, setup.testset, **setup.training_kwargs())


def sam_client(setup: ClientSetup) -> NumPyClient:
    from dpfl.clients.sam import SAMClient

    return SAMClient(
        setup.model, setup.trainset, setup.testset, rho=setup.settings.training.sam_rho, **setup.training_kwargs()
    )


def topk_sam_client(setup: ClientSetup) -> NumPyClient:
    from dpfl.clients.topk import TopKSAMClient

    return TopKSAMClient(
        setup.model, setup.trainset, setup.testset, rho=setup.settings.training.sam_rho, **setup.training_kwargs()
    )


def fine_tuned(inner: Callable[[ClientSetup], NumPyClient]) -> Callable[[ClientSetup], NumPyClient]:
    """A -FT baseline: `inner` trains; evaluation fine-tunes the global model locally first."""

    def build(setup: ClientSetup) -> NumPyClient:
        from dpfl.clients.personalized import FineTuneClient

        return FineTuneClient(inner(setup), setup.settings.personalization.fine_tune_steps)

    return build


def head_store(context: Context, partition_id: int):
    """Where this node keeps its personal head: a file under node config `state-dir` (a deployment),
    else Context.state (simulation, where Context.state lives as long as the run)."""
    from dpfl.clients.personalized import ContextHeadStore, FileHeadStore

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
        from dpfl.clients.personalized import DP2FedSAMClient, PartialSharingClient
        from dpfl.dpcore.task.models import split_state_keys

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
    from dpfl.clients.dpsgd import DPSGDClient

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
        allow_large_delta=privacy.allow_large_delta,
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
    from dpfl.dpcore.task.catalogue import dataset_info
    from dpfl.dpcore.task.models import build_model, split_state_keys

    prefix, model = s.personalization.head_prefix, s.training.model
    if not prefix:
        return
    info = dataset_info(s.data.dataset)
    try:
        split_state_keys(build_model(model, info["input_shape"], info["num_classes"]), prefix)
    except ValueError as exc:
        raise ValueError(f"run-config key 'head-prefix' = {prefix!r} does not fit model {model!r}: {exc}") from None


def check_dpsgd_config(s: Settings) -> None:
    if s.privacy.target_epsilon_mode != TargetEpsilonMode.STOP:
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
    if s.privacy.noise_placement == NoisePlacementMode.LOCAL:
        raise ValueError(
            "run-config key 'noise-placement' = 'local': DP-FTRL adds the tree's noise at the server "
            "('central', which it uses whatever the key says otherwise)"
        )
    if s.ftrl.strategy != "tree":
        require_jax_privacy("ftrl-strategy", s.ftrl.strategy)
    elif s.output.resume:
        raise ValueError(
            "run-config key 'resume' = True is not supported with DP-FTRL's tree (its tree's noise is not "
            "checkpointed, and redrawing it would release the same nodes twice; ftrl-strategy 'blt' or 'banded' "
            "resumes)"
        )
    elif s.ftrl.max_participations or s.ftrl.amplified:
        raise ValueError(
            f"run-config keys 'ftrl-max-participations' = {s.ftrl.max_participations!r} and 'ftrl-amplified' = "
            f"{s.ftrl.amplified!r} apply only with ftrl-strategy 'blt' or 'banded' (the tree allows one round per "
            "epoch, without sampling)"
        )
