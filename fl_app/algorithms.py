"""The algorithm registry: everything the app knows about each algorithm, in one record.

A record names the server strategy and how to build it from the run config, the client and how
to build it, the run-config keys the algorithm owns, the settings it ignores, its non-private
reference and its plot label. `fl_app.server_app`, `fl_app.client_app`, `fl_app.config`,
the launcher (`dpfl_tools.plan`) and `fl_app.results` read these records and never branch on an algorithm's
name. The rules between DP settings live with the strategies (`check_settings`), so a strategy
built from Python checks exactly what `fl_app.config.validate` checks for a run config.

Adding an algorithm: write its strategy and client classes, then add one `Algorithm` record to
`ALGORITHMS` below, with its builders in `fl_app.builders` (docs/architecture.md walks through an example).

A run resolves its record once (`algorithm(settings.run.algorithm)`: the validation, the ServerApp's run and
the ClientApp's client each do it at their start) and passes it down; the registry reads the settings
(`fl_app.settings`), which know nothing of it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache

from flwr.client import NumPyClient

from dpfl.dpcore.privacy.modes import PrivacyUnit, TargetEpsilonMode
from dpfl.dpcore.privacy.settings import check_calibration_reachable
from dpfl.fl_app.builders import (
    ClientSetup,
    check_dpsgd_config,
    check_ftrl_config,
    check_head_prefix,
    client_level,
    dpsgd_client,
    dpsgd_settings,
    fine_tuned,
    ftrl_settings,
    partial_sharing_client,
    run_options,
    sam_client,
    sampling_options,
    sgd_client,
    topk_sam_client,
    topk_settings,
    wavelet_settings,
    wrapped_strategy,
)
from dpfl.fl_app.settings import CONCERNS, WHERE, Settings
from dpfl.strategies.dp_fedavg import DPFedAvg
from dpfl.strategies.loop.round_loop import DPRoundLoop
from dpfl.strategies.partial_sharing import PartialSharingDPFedAvg, PersonalizedDPFedAvg
from dpfl.strategies.presets import DPFedAvgWavelet, DPFedSAMTopK
from dpfl.strategies.sample_level.ali_dpfl import ALIDPFL


@dataclass(frozen=True)
class Algorithm:
    """One algorithm of the product.

    strategy_class, strategy_settings : the server strategy and its keyword arguments from the run's
        Settings, option objects or a part's flat keywords (`strategy_kwargs` adds the SamplingOptions and
        RunOptions); `strategy_class.check_settings` checks them.
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
    strategy_class: Callable[..., DPRoundLoop]  # a class or a preset (strategies.presets.DPFedSAMTopK)
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

    def strategy_kwargs(self, s: Settings, on_round_end=None, on_checkpoint=None) -> dict:
        """Every DP keyword argument of the strategy, from the run's settings: the sampling and run option objects
        (with the run's hooks) and what its builder (`strategy_settings`) gives (the wrapped Flower strategy comes
        from `wrapped_strategy`)."""
        return dict(
            sampling=sampling_options(s),
            run=run_options(s, on_round_end=on_round_end, on_checkpoint=on_checkpoint),
            **self.strategy_settings(s),
        )

    def build_strategy(self, s: Settings, on_round_end=None, on_checkpoint=None, **server) -> DPRoundLoop:
        """The DP wrapper of this algorithm around the run's Flower strategy (`server-strategy`); `server`: what
        the server computes from its own data (ALI-DPFL's `server_data`)."""
        kwargs = self.strategy_kwargs(s, on_round_end, on_checkpoint)
        return self.strategy_class(wrapped_strategy(s), **kwargs, **server)

    def run_label(self, summary: dict) -> str:
        """How a run of this algorithm is labelled in plots and reports."""
        if self.privacy_unit == PrivacyUnit.SAMPLE:
            return f"{self.name} (sample-level, target epsilon {summary.get('target_epsilon')})"
        sigma = summary.get("noise_multiplier")
        return f"{self.name} sigma={sigma}" if sigma else f"{self.name} non-private reference"


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
HEAD_KEYS = ("head-prefix", "head-epochs", "head-steps", "head-lr")  # read by the personal-head clients only

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
            owned_keys=(
                "ftrl-strategy",
                "ftrl-epoch-rounds",
                "ftrl-max-participations",
                "ftrl-amplified",
                "ftrl-momentum",
            ),
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


def algorithm(name: str) -> Algorithm:
    if name not in ALGORITHMS:
        raise ValueError(f"algorithm={name!r} is not one of: {', '.join(ALGORITHMS)}")
    return ALGORITHMS[name]


def owners(key: str) -> list[str]:
    """The algorithms that own a run-config key (empty: a key every algorithm may set)."""
    return [a.name for a in ALGORITHMS.values() if key in a.owned_keys]


KEY_OF = {field: key for key, field in WHERE.items()}  # (concern, attribute) -> run-config key


class ReadingSettings:
    """`Settings` (or one concern of them) that notes the run-config key of every field read through it."""

    def __init__(self, value, seen: set[str], concern: str = "") -> None:
        self._value, self._seen, self._concern = value, seen, concern

    def __getattr__(self, name: str):
        value = getattr(self._value, name)
        if not self._concern:
            return ReadingSettings(value, self._seen, name) if name in CONCERNS else value
        self._seen.add(KEY_OF[(self._concern, name)])
        return value


def keys_read(algo: Algorithm, s: Settings) -> frozenset[str]:
    """The run-config keys the algorithm's strategy builder (`strategy_kwargs`) and the training settings every
    client takes (`ClientSetup.training_kwargs`) read from `s`, and its `owned_keys` (read by its client)."""
    seen: set[str] = set()
    algo.strategy_kwargs(ReadingSettings(s, seen))
    ClientSetup(ReadingSettings(s, seen), None, 0, None, None, None).training_kwargs()
    return frozenset(seen | set(algo.owned_keys))


@cache
def default_keys_read(name: str) -> frozenset[str]:
    """`keys_read` at the default settings (what the builder reads whatever the switches say)."""
    return keys_read(ALGORITHMS[name], Settings())


def algorithm_specific_keys() -> frozenset[str]:
    """Keys some algorithm's builders read and another's do not (the keys every builder reads, such as
    sample-rate, and those none reads, the data, model and output keys the apps read, are the whole family's)."""
    reads = [default_keys_read(name) for name in ALGORITHMS]
    return frozenset.union(*reads) - frozenset.intersection(*reads)


def refuse_keys_not_read(s: Settings, algo: Algorithm) -> None:
    """An algorithm-specific key changed from its default that this algorithm's builders do not read is refused,
    naming the key, its value, the algorithm and the algorithm-specific keys it does read."""
    values, specific = s.run_config(), algorithm_specific_keys()
    read = keys_read(algo, s) | default_keys_read(algo.name)
    for key in sorted(specific - read):
        if values[key] != s.DEFAULTS[key]:
            raise ValueError(
                f"run-config key '{key}' = {values[key]!r} is not read by algorithm {algo.name!r}, whose own keys "
                f"are {', '.join(sorted(specific & read)) or 'none'}: leave it at {s.DEFAULTS[key]!r} or change "
                "the algorithm"
            )


def check_config(s: Settings, algo: Algorithm) -> None:
    """The rules of the run's algorithm: owned and unused keys, the strategy's settings (the very
    `check_settings` a strategy built from Python runs), SecAgg+ support and the algorithm's own
    rules. `algo`: the run's record (`algorithm(s.run.algorithm)`). Raises ValueError naming the key, the value
    and what is allowed."""
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
            algo.privacy_unit == PrivacyUnit.CLIENT
            and s.privacy.target_epsilon > 0
            and s.privacy.target_epsilon_mode == TargetEpsilonMode.CALIBRATE
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
    refuse_keys_not_read(s, algo)


def reference_overrides(overrides: dict, defaults: dict) -> dict:
    """Run-config overrides of the non-private reference of a run configured by `overrides`.

    The reference keeps the data, model and training settings, drops the keys its own algorithm
    does not accept (another's owned or algorithm-specific keys it does not read), and applies the algorithm's
    `reference` overrides.
    """
    algo = ALGORITHMS[overrides.get("algorithm", defaults["algorithm"])]
    ref_algorithm = ALGORITHMS[algo.reference.get("algorithm", algo.name)]
    owned = {k for a in ALGORITHMS.values() for k in a.owned_keys}
    dropped = (owned | algorithm_specific_keys()) - default_keys_read(ref_algorithm.name)
    kept = {k: v for k, v in overrides.items() if k not in dropped}
    return {**kept, **algo.reference}
