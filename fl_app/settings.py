"""The run's settings: one frozen dataclass per concern, each field one run-config key.

A field is declared once, with `setting(default, doc, choices, bounds)`: its default, what it does and
what is allowed. Everything else is drawn from these declarations: `fl_app.config.SPEC` (key -> `Key`),
the validation and its error messages, docs/run-config.md, and pyproject.toml's
`[tool.flwr.app.config]` (a test keeps it equal). After start-up the code reads typed fields
(`settings.privacy.noise_multiplier`), never a run-config dict.

The run-config key of a field is its name with '-' for '_', unless `setting(..., key=...)` names it
(`settings.secagg.enabled` is 'secure-aggregation'). `setting` and `Key` are in `fl_app.run_config_keys`.

The settings know nothing of the algorithm registry (`fl_app.algorithms` reads them, never the other way):
the `algorithm` key allows the registry's names, which `fl_app.config.SPEC` adds to its declaration.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, ClassVar

from dpfl.dpcore.privacy.dpsgd_noise import DPSGD_NOISES, GRAD_SAMPLE_MODES, WAVELET_CALIBRATIONS
from dpfl.dpcore.privacy.matrix_factorization import STRATEGIES as FTRL_STRATEGIES
from dpfl.dpcore.privacy.mechanisms import TOPK_MODES
from dpfl.dpcore.privacy.settings import (
    ACCOUNTANT_NAMES,
    CLIENT_SAMPLINGS,
    MU_SOURCES,
    NOISE_PLACEMENTS,
    TARGET_EPSILON_MODES,
)
from dpfl.dpcore.task.catalogue import DATASETS
from dpfl.dpcore.task.device import DEVICE_CHOICES
from dpfl.dpcore.task.models import MODELS
from dpfl.dpcore.task.partitions import PARTITIONERS
from dpfl.fl_app.run_config_keys import KEY, NOISE_RANGE, RATE_MIN, Key, setting

AUDIT_CANARIES_MAX = 10_000  # each canary is a model-sized vector held by the server: 1e7 of them ran out of memory
DEFAULT_ALGORITHM = "dp-fedsam"  # the `algorithm` key's default (the registry, fl_app.algorithms, holds them all)
SERVER_STRATEGIES = ("fedavg", "fedadam", "fedyogi", "fedadagrad", "fedavgm")  # fl_app.builders.wrapped_strategy


@dataclass(frozen=True)
class RunSettings:
    """What runs, for how long, from which seed."""

    algorithm: str = setting(DEFAULT_ALGORITHM, "what runs")  # allowed: the registry's names (fl_app.config.SPEC)
    num_rounds: int = setting(30, "federated rounds", low=1)
    eval_every: int = setting(
        1,
        "evaluation (the server's, and the clients' where the algorithm has it) every N rounds and after the last",
        low=1,
    )
    seed: int = setting(42, "drives partitioning, sampling, noise and init", low=0, high=2**63 - 1)


@dataclass(frozen=True)
class DataSettings:
    """Which data, and how it is split across the clients."""

    dataset: str = setting("mnist-embedded", "dataset name", DATASETS)
    data_dir: str = setting("", "absolute folder with local dataset files (empty: embedded data or download)")
    partitioner: str = setting("dirichlet", "how the data is split across clients", PARTITIONERS)
    validation_fraction: float = setting(
        0.0,
        "fraction of the training data the server holds out as its "
        "validation set (never given to clients; evaluated beside the test "
        "set: val_accuracy)",
        low=0,
        high=0.5,
    )
    dirichlet_alpha: float = setting(0.5, "Dirichlet concentration (smaller = more non-IID)", low=0, low_open=True)
    classes_per_client: int = setting(2, "labels per client for the pathological partitioner", low=1)


@dataclass(frozen=True)
class TrainingSettings:
    """The model and each client's local training."""

    model: str = setting("cnn-mnist", "model architecture", MODELS)
    device: str = setting(
        "auto", f"where torch trains and evaluates: {DEVICE_CHOICES} (auto: CUDA when torch sees one, else the CPU)"
    )
    local_epochs: int = setting(2, "local passes over the client's data per round", low=1)
    local_steps: int = setting(0, "local steps per round (0: use local-epochs)", low=0)
    batch_size: int = setting(32, "local minibatch size", low=1)
    lr: float = setting(0.1, "local learning rate eta", low=0, low_open=True)
    momentum: float = setting(0.5, "local SGD momentum", low=0, high=1, high_open=True)
    weight_decay: float = setting(5e-4, "local weight decay", low=0)
    sam_rho: float = setting(0.05, "SAM perturbation radius rho (paper: 0.5, which stalls the small MNIST CNN)", low=0)
    lr_decay: float = setting(
        1.0,
        "learning rates are multiplied by this every round (1: none; DP2-FedSAM paper: 0.99)",
        low=0,
        high=1,
        low_open=True,
    )


@dataclass(frozen=True)
class FederationSettings:
    """Which clients take part in a round, and how long the server waits for them."""

    num_clients: int = setting(
        0,
        "M, the client population, hosted by the SuperNodes (node cohorts: each "
        "node trains the clients its node config assigns it, one message a "
        "node); 0: each SuperNode is one client, as its partition-id says",
        low=0,
    )
    sample_rate: float = setting(0.5, "q: probability that a client is sampled in a round", low=RATE_MIN, high=1)
    client_sampling: str = setting("poisson", "client sampling scheme", CLIENT_SAMPLINGS)
    min_nodes: int = setting(2, "wait for this many connected nodes before round 1", low=1)
    node_wait_timeout: float = setting(
        600.0,
        "seconds to wait for min-nodes connected nodes before the run is "
        "refused (a simulation with fewer SuperNodes is refused at once)",
        low=0,
        low_open=True,
    )
    round_timeout: float = setting(
        3600.0,
        "seconds a message exchange waits for client replies; a reply not in by "
        "then, objects included, counts as a failed client",
        low=0,
        low_open=True,
    )
    fraction_evaluate: float = setting(
        0.0,
        "fraction of clients evaluating each round (0: none; for dp2-fedsam, "
        "centaur and *-ft: all, for the personalized accuracy)",
        low=0,
        high=1,
    )
    flower_speed_patches: bool = setting(
        False,
        "patch Flower internals for speed (flwr 1.41/1.42 only, checked at "
        "start): object pulls retried after 0.05 s, reply object pulls ended "
        "at round-timeout",
    )


@dataclass(frozen=True)
class ServerSettings:
    """The Flower strategy the DP wrapper runs around, and its server optimizer."""

    strategy: str = setting(
        "fedavg",
        "the Flower strategy the DP wrapper runs around: its aggregation and server "
        "optimizer act on the privatized average",
        SERVER_STRATEGIES,
        key="server-strategy",
    )
    lr: float = setting(
        1.0,
        "server learning rate: eta_s of w + eta_s * average (fedavg), the optimizer's eta "
        "(fedadam, fedyogi, fedadagrad), FedAvgM's server_learning_rate",
        low=0,
        low_open=True,
        key="server-lr",
    )
    momentum: float = setting(0.9, "fedavgm: server momentum", low=0, high=1, high_open=True, key="server-momentum")


@dataclass(frozen=True)
class PrivacySettings:
    """Client-level DP and its accounting: clip, noise, the budget, the accountant."""

    clipping_norm: float = setting(0.5, "C: bound on the L2 norm of each client update (0: no clipping)", low=0)
    noise_multiplier: float = setting(
        1.0, "sigma: noise std / C (0: no noise)", low=0, nonzero_low=NOISE_RANGE[0], high=NOISE_RANGE[1]
    )
    noise_placement: str = setting(
        "distributed",
        "who adds the Gaussian noise (local: local DP, each client noises its own update)",
        NOISE_PLACEMENTS,
    )
    delta: float = setting(
        0.0,
        "target delta (0: min(1e-5, 0.01 / number of clients); ali-dpfl: 1e-5 per client's samples)",
        low=0,
        high=1,
        high_open=True,
    )
    allow_large_delta: bool = setting(
        False,
        "accept delta >= 1/M (M: the clients; ali-dpfl: a client's samples), which guarantees nothing, and publish "
        "epsilon marked as NOT a guarantee (false: such a delta is refused before round 1)",
    )
    target_epsilon: float = setting(0.0, "privacy budget (0: none)", low=0)
    target_epsilon_mode: str = setting(
        "stop", "stop before exceeding the budget, or calibrate sigma to it", TARGET_EPSILON_MODES
    )
    accountant: str = setting(
        "pld", "privacy accountant: dp-accounting's PLD (tightest), Opacus' RDP or PRV", ACCOUNTANT_NAMES
    )
    secure_rng: bool = setting(
        True,
        "draw DP noise and client sampling from OS entropy (false: reproducible from "
        "'seed', and the printed epsilon is NOT a guarantee: anyone with the seed can "
        "remove the noise)",
    )


@dataclass(frozen=True)
class AdaptiveClippingSettings:
    """Adaptive clipping toward a quantile of the update norms (docs/dp-toolbox.md §3)."""

    enabled: bool = setting(
        False,
        "adapt the clipping norm toward a quantile of the update norms each round "
        "(Andrew et al.; clipping-norm is C_0; docs/dp-toolbox.md §3)",
        key="adaptive-clipping",
    )
    target_quantile: float = setting(
        0.5,
        "adaptive-clipping: target quantile gamma of the update norms",
        low=0,
        high=1,
        low_open=True,
        high_open=True,
    )
    learning_rate: float = setting(
        0.2,
        "adaptive-clipping: eta_C in C <- C exp(-eta_C (b_bar - gamma))",
        low=0,
        low_open=True,
        key="clip-learning-rate",
    )
    count_noise_multiplier: float = setting(
        10.0,
        "adaptive-clipping: sigma_b, noise std of the count of unclipped clients (must exceed noise-multiplier / 2)",
        low=0,
        low_open=True,
        key="clip-count-noise-multiplier",
    )


@dataclass(frozen=True)
class TopKSettings:
    """dp-fedsam-topk's sparse uploads."""

    sparsity: float = setting(
        0.4,
        "dp-fedsam-topk: fraction p of coordinates each client uploads (k = ceil(p * size))",
        low=0,
        high=1,
        low_open=True,
    )
    mode: str = setting(
        "per-layer", "dp-fedsam-topk: top-k per tensor or over the whole update", TOPK_MODES, key="topk-mode"
    )


@dataclass(frozen=True)
class WaveletSettings:
    """Haar-wavelet noise (dp-fedavg-wav; ali-dpfl with dpsgd-noise = 'wavelet')."""

    calibration: str = setting(
        "exact",
        "dp-fedavg-wav: 'paper' (published noise, true epsilon reported) or "
        "'exact' (sigma_H = sigma * sqrt(n): the configured epsilon holds)",
        WAVELET_CALIBRATIONS,
        key="wavelet-calibration",
    )


@dataclass(frozen=True)
class PersonalizationSettings:
    """Personal heads (dp2-fedsam, centaur) and local fine-tuning (*-ft)."""

    head_prefix: str = setting(
        "", "dp2-fedsam/centaur: parameter-name prefix of the personal head (empty: last linear layer)"
    )
    head_epochs: int = setting(2, "dp2-fedsam/centaur: tau_h as passes over the data (body: local-epochs)", low=1)
    head_steps: int = setting(0, "dp2-fedsam/centaur: tau_h head SGD steps per round (0: use head-epochs)", low=0)
    head_lr: float = setting(0.0, "dp2-fedsam/centaur: head learning rate eta_h (0: same as lr)", low=0)
    fine_tune_steps: int = setting(
        0, "dp-fedavg-ft/dp-fedsam-ft: local steps before evaluating (0: the round's local-steps/local-epochs)", low=0
    )


@dataclass(frozen=True)
class DPSGDSettings:
    """ali-dpfl: sample-level DP-SGD on the clients, adaptive local iterations."""

    noise_multiplier: float = setting(
        1.0,
        "ali-dpfl: DP-SGD noise multiplier sigma (noise std / C per step)",
        low=NOISE_RANGE[0],
        high=NOISE_RANGE[1],
        key="sample-noise-multiplier",
    )
    clipping_norm: float = setting(
        1.0, "ali-dpfl: DP-SGD per-sample gradient clipping norm C", low=0, low_open=True, key="sample-clipping-norm"
    )
    sample_rate: float = setting(
        0.05, "ali-dpfl: DP-SGD Poisson batch sampling rate q_s", low=0, high=1, low_open=True, key="batch-sample-rate"
    )
    grad_sample_mode: str = setting(
        "ew", "ali-dpfl: Opacus per-sample gradient mode (ew: fastest measured on CPU)", GRAD_SAMPLE_MODES
    )
    noise: str = setting(
        "gaussian",
        "ali-dpfl: DP-SGD noise, or 'wavelet' (DP-SGD-WAV: clip and noise the Haar coefficients)",
        DPSGD_NOISES,
        key="dpsgd-noise",
    )
    adaptive: bool = setting(True, "ali-dpfl: local steps tau from eq. (9) each round (false: fixed tau = local-steps)")
    gamma: float = setting(
        5.0, "ali-dpfl: heterogeneity Gamma of eq. (9) (paper: 0 IID, 1/5/10 for Dir 1/0.5/0.05)", low=0
    )
    mu_source: str = setting(
        "server", "ali-dpfl: where mu is estimated (server data: free; clients: noised, charged)", MU_SOURCES
    )
    mu_max: float = setting(
        1.0,
        "ali-dpfl, mu-source = clients: each client's mu ratio is clipped to [0, mu-max]",
        low=RATE_MIN,
        note="the clients' mu ratios are divided by it",
    )
    num_partitions: int = setting(
        0,
        "ali-dpfl: the SuperNodes' node-config num-partitions, for the public partition "
        "sizes that weigh the average (0: what each node reports from its node config)",
        low=0,
    )
    mu_noise_multiplier: float = setting(
        10.0,
        "ali-dpfl, mu-source = clients: noise std / mu-max of each mu release",
        low=NOISE_RANGE[0],
        high=NOISE_RANGE[1],
    )


@dataclass(frozen=True)
class FTRLSettings:
    """dp-ftrl: tree-aggregated or matrix-factorization noise, participation enforced (docs/dp-toolbox.md §4)."""

    strategy: str = setting(
        "tree",
        "dp-ftrl: the noise of the prefix sums: 'tree' (binary tree, one per epoch), 'blt' (buffered linear "
        "Toeplitz) or 'banded' (banded Toeplitz, b bands), the last two computed with jax-privacy "
        '(pip install -e ".[mf]")',
        FTRL_STRATEGIES,
        key="ftrl-strategy",
    )
    epoch_rounds: int = setting(
        0,
        "dp-ftrl: b; tree: rounds per epoch, each client at most once per epoch, one tree per epoch; blt, banded: "
        "the min separation, each client in rounds at least b apart (0: number of nodes // clients per round, "
        "where clients per round = round(sample-rate * nodes))",
        low=0,
        key="ftrl-epoch-rounds",
    )
    max_participations: int = setting(
        0,
        "dp-ftrl blt, banded: k, the most rounds a client takes part in (0: ceil(num-rounds / b))",
        low=0,
        key="ftrl-max-participations",
    )
    amplified: bool = setting(
        False,
        "dp-ftrl banded: the amplified form, cyclic Poisson sampling (clients in b groups by client id, round t's "
        "group sampled with probability sample-rate * b), accounted as amplified banded MF",
        key="ftrl-amplified",
    )
    momentum: float = setting(
        0.0,
        "dp-ftrl: server momentum gamma on the noisy prefix sums (DP-FTRLM; 0: plain DP-FTRL)",
        low=0,
        high=1,
        high_open=True,
        key="ftrl-momentum",
    )


@dataclass(frozen=True)
class AuditSettings:
    """The one-shot empirical privacy estimate with canary clients."""

    canaries: int = setting(
        0,
        "K canary clients for the one-shot empirical privacy estimate (Andrew et al.), "
        "reported beside the accounted epsilon (0: no audit; client-level algorithms)",
        low=0,
        high=AUDIT_CANARIES_MAX,
        note="each canary is a model-sized vector in the server's memory",
        key="audit-canaries",
    )
    canary_kind: str = setting(
        "isotropic",
        "canary directions: 'isotropic' (random, the paper's) or 'smooth' "
        "(coarse Haar directions, where noise that is weak along smooth "
        "directions shows)",
        ("isotropic", "smooth"),
        key="audit-canary-kind",
    )


@dataclass(frozen=True)
class SecAggSettings:
    """Flower's SecAgg+ around the client-level sum."""

    enabled: bool = setting(
        False,
        "sum client updates with Flower's SecAgg+: the server sees only the sum (needs noise-placement = distributed)",
        key="secure-aggregation",
    )
    num_shares: float = setting(
        1.0,
        "SecAgg+ key shares per client, as a fraction of the sampled clients",
        low=0,
        high=1,
        low_open=True,
        key="secagg-num-shares",
    )
    reconstruction_threshold: float = setting(
        0.5,
        "SecAgg+ shares needed to unmask, as a fraction of the shares",
        low=0,
        high=1,
        low_open=True,
        key="secagg-reconstruction-threshold",
    )


@dataclass(frozen=True)
class OutputSettings:
    """Where the run folder is, what the dashboards show, and resuming."""

    tensorboard: bool = setting(True, "write TensorBoard events into the run folder (tensorboard --logdir <results>)")
    wandb: bool = setting(False, "also log the dashboards' scalars to Weights & Biases (needs the wandb extra)")
    wandb_mode: str = setting(
        "offline", "W&B mode: offline (files in the run folder, no account or network) or online", ("offline", "online")
    )
    wandb_project: str = setting("dpfl", "W&B project name")
    publish_diagnostics: bool = setting(
        False,
        "also show the non-private diagnostics (counts, update norms, clipped "
        "fraction, losses, client evaluation) in the log and dashboards; they "
        "are always in the run folder's diagnostics.jsonl, which epsilon does "
        "not cover",
    )
    resume: bool = setting(
        False, "continue the run in results-dir (or run-name) from its last checkpoint, ledger included"
    )
    results_dir: str = setting("", "absolute folder for this run's results (empty: ~/dpfl-results/<run-name>)")
    run_name: str = setting("", "name of the run folder (empty: <time>-<algorithm>-<dataset>)")


@dataclass(frozen=True)
class Settings:
    """A run's validated settings, one object per concern (`fl_app.config.validate` builds it from a run config)."""

    run: RunSettings = field(default_factory=RunSettings)
    data: DataSettings = field(default_factory=DataSettings)
    training: TrainingSettings = field(default_factory=TrainingSettings)
    federation: FederationSettings = field(default_factory=FederationSettings)
    server: ServerSettings = field(default_factory=ServerSettings)
    privacy: PrivacySettings = field(default_factory=PrivacySettings)
    adaptive_clipping: AdaptiveClippingSettings = field(default_factory=AdaptiveClippingSettings)
    topk: TopKSettings = field(default_factory=TopKSettings)
    wavelet: WaveletSettings = field(default_factory=WaveletSettings)
    personalization: PersonalizationSettings = field(default_factory=PersonalizationSettings)
    dpsgd: DPSGDSettings = field(default_factory=DPSGDSettings)
    ftrl: FTRLSettings = field(default_factory=FTRLSettings)
    audit: AuditSettings = field(default_factory=AuditSettings)
    secagg: SecAggSettings = field(default_factory=SecAggSettings)
    output: OutputSettings = field(default_factory=OutputSettings)
    DEFAULTS: ClassVar[dict[str, Any]]  # the run config of Settings(), key -> default (set below)

    @classmethod
    def from_run_config(cls, values: Mapping[str, Any]) -> Settings:
        """From a run config already checked key by key (`fl_app.config.validate`); missing keys: defaults.
        KeyError for a key that is not a setting."""
        given: dict[str, dict[str, Any]] = {concern: {} for concern in CONCERNS}
        for key, value in values.items():
            concern, attribute = WHERE[key]
            given[concern][attribute] = value
        return cls(**{concern: CONCERNS[concern](**given[concern]) for concern in CONCERNS})

    def run_config(self) -> dict[str, Any]:
        """The flat run config (key -> value), as config.json, the dashboards and `flwr run` hold it."""
        return {key: getattr(getattr(self, concern), attribute) for key, (concern, attribute) in WHERE.items()}


def _keys() -> Iterator[Key]:
    """Every run-config key, concern by concern, with its `name` and `attribute` filled in."""
    for concern in fields(Settings):
        for f in fields(concern.default_factory):
            spec = f.metadata[KEY]
            yield replace(spec, name=spec.name or f.name.replace("_", "-"), attribute=f"{concern.name}.{f.name}")


KEYS: tuple[Key, ...] = tuple(_keys())
WHERE: dict[str, tuple[str, str]] = {spec.name: tuple(spec.attribute.split(".")) for spec in KEYS}  # key -> field
CONCERNS: dict[str, type] = {concern.name: concern.default_factory for concern in fields(Settings)}
Settings.DEFAULTS = {spec.name: spec.default for spec in KEYS}
