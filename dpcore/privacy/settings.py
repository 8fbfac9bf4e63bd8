"""The DP settings' allowed values and the rules between them, checked in one place.

Each rule raises `SettingError` naming the setting both as the Python argument and as the
run-config key (`run_config_key`), its value and what is allowed. The strategies call these rules when they are
built from Python; `fl_app.config.validate` calls the same rules (through the algorithm
registry) before any training starts.
"""

from __future__ import annotations

from dpfl.dpcore.privacy.accountants import ACCOUNTANTS as ACCOUNTANT_NAMES  # the accountant registry's names

from .modes import ClientSamplingMode, NoisePlacementMode, TargetEpsilonMode, values

NOISE_PLACEMENTS = values(NoisePlacementMode)  # ("central", "distributed", "local")
CLIENT_SAMPLINGS = values(ClientSamplingMode)  # ("poisson", "fixed")
TARGET_EPSILON_MODES = values(TargetEpsilonMode)  # ("stop", "calibrate")
MU_SOURCES = ("server", "clients")


# The run-config key of each rule argument whose key is not the argument with '-' for '_' (the keys are declared
# in fl_app/settings.py, which this neutral core does not import; tests/test_config.py checks that every argument
# a rule names maps to a key of [tool.flwr.app.config]).
RUN_CONFIG_KEYS = {"epoch_rounds": "ftrl-epoch-rounds"}
PYTHON_ONLY = frozenset({"num_sampled_clients"})  # arguments of the Python API that no run-config key sets


class SettingError(ValueError):
    """A DP setting has a value that is not allowed (alone or with another setting)."""


def run_config_key(argument: str) -> str:
    """The run-config key of a rule's Python argument: `RUN_CONFIG_KEYS`, else the argument with '-' for '_'."""
    return RUN_CONFIG_KEYS.get(argument, argument.replace("_", "-"))


def key_clause(argument: str) -> str:
    """`run-config key 'noise-placement'`, or that an argument of the Python API alone has none."""
    if argument in PYTHON_ONLY:
        return "a Python argument; no run-config key sets it"
    return f"run-config key '{run_config_key(argument)}'"


def name(argument: str) -> str:
    """`noise_placement (run-config key 'noise-placement')`."""
    return f"{argument} ({key_clause(argument)})"


def require(condition: bool, argument: str, value, allowed: str) -> None:
    """Raise SettingError("<argument>=<value> (run-config key ...): must be <allowed>") unless condition."""
    if not condition:
        raise SettingError(f"{argument}={value!r} ({key_clause(argument)}): {allowed}")


def one_of(argument: str, value, choices: tuple) -> None:
    require(value in choices, argument, value, "must be one of: " + ", ".join(map(str, choices)))


def check_client_level_dp(
    *,
    sample_rate: float,
    clipping_norm: float,
    noise_multiplier: float,
    noise_placement: str,
    client_sampling: str,
    target_epsilon: float = 0.0,
    target_epsilon_mode: str = "stop",
    delta: float = 0.0,
    accountant: str = "pld",
) -> None:
    """The rules every client-level DP strategy shares (docs/algorithms.md §0)."""
    require(0 < sample_rate <= 1, "sample_rate", sample_rate, "must be in (0, 1]")
    require(clipping_norm >= 0, "clipping_norm", clipping_norm, "must be >= 0 (0: no clipping)")
    require(noise_multiplier >= 0, "noise_multiplier", noise_multiplier, "must be >= 0 (0: no noise)")
    require(
        not (noise_multiplier > 0 and clipping_norm == 0),
        "noise_multiplier",
        noise_multiplier,
        f"needs {name('clipping_norm')} > 0 (noise without clipping bounds nothing); set clipping-norm, or "
        "noise-multiplier = 0 for a non-private run",
    )
    one_of("noise_placement", noise_placement, NOISE_PLACEMENTS)
    one_of("client_sampling", client_sampling, CLIENT_SAMPLINGS)
    one_of("target_epsilon_mode", target_epsilon_mode, TARGET_EPSILON_MODES)
    one_of("accountant", accountant, ACCOUNTANT_NAMES)
    require(target_epsilon >= 0, "target_epsilon", target_epsilon, "must be >= 0 (0: no target)")
    require(0 <= delta < 1, "delta", delta, "must be in [0, 1) (0: min(1e-5, 0.01 / number of clients))")
    require(
        not (target_epsilon > 0 and noise_multiplier == 0 and target_epsilon_mode == TargetEpsilonMode.STOP),
        "target_epsilon",
        target_epsilon,
        f"cannot be met with {name('noise_multiplier')} = 0 (epsilon is infinite); use "
        "target-epsilon-mode = 'calibrate' or a positive noise-multiplier",
    )
    require(
        not (target_epsilon > 0 and target_epsilon_mode == TargetEpsilonMode.CALIBRATE and clipping_norm == 0),
        "target_epsilon_mode",
        target_epsilon_mode,
        f"'calibrate' needs {name('clipping_norm')} > 0",
    )
    require(
        not (noise_placement == NoisePlacementMode.LOCAL and noise_multiplier == 0),
        "noise_placement",
        noise_placement,
        f"'local' needs {name('noise_multiplier')} > 0: each client noises its own update",
    )
    require(
        not (
            noise_placement == NoisePlacementMode.LOCAL
            and target_epsilon > 0
            and target_epsilon_mode == TargetEpsilonMode.CALIBRATE
        ),
        "target_epsilon_mode",
        target_epsilon_mode,
        "'calibrate' cannot be used with noise_placement = 'local' "
        "(run-config key 'noise-placement'): the clients choose their own noise; use 'stop'",
    )


def check_delta(delta: float, population: int, allow_large_delta: bool = False, unit: str = "clients") -> None:
    """delta < 1/M, M the number of clients (client-level DP) or of a client's samples (sample-level DP): with
    delta >= 1/M, "publish one of the M at random, whole" is (0, delta)-DP, so no epsilon says anything. Refused
    (SettingError naming delta, its value and 1/M) unless `allow_large_delta`; then `large_delta_caveats` marks the
    run's epsilon as no guarantee."""
    bound = 1.0 / max(1, population)
    require(
        allow_large_delta or delta < bound,
        "delta",
        delta,
        f"must be < 1/M = {bound:.6g} (M = {population} {unit}): with delta >= 1/M, publishing one of the M whole is "
        "(0, delta)-DP, so epsilon guarantees nothing. Set a smaller delta (0: the default), or "
        f"{name('allow_large_delta')} = true to publish the figure marked as no guarantee",
    )


def large_delta_caveats(delta: float, population: int, unit: str = "clients") -> list[str]:
    """Why epsilon is no guarantee when `check_delta` let delta >= 1/M through (none: delta < 1/M)."""
    if delta < 1.0 / max(1, population):
        return []
    return [
        f"delta = {delta:g} >= 1/M = {1.0 / max(1, population):.6g} (M = {population} {unit}), accepted by "
        "allow-large-delta: publishing one of the M whole is (0, delta)-DP, so epsilon guarantees nothing"
    ]


def check_calibration_reachable(
    *, target_epsilon: float, delta: float, sample_rate: float, rounds: int, client_sampling: str, accountant: str
) -> None:
    """target-epsilon-mode = 'calibrate': the target must be reachable with the largest noise multiplier the
    calibration tries (`CALIBRATION_RANGE`, 1e3), at the largest delta the run can have (delta, or 1e-5 when 0), as DPFedAvg's
    `make_ledger` calibrates: Poisson at q = sample_rate less the truncation reserve, fixed-size at q = 1 (and
    sigma / 2). Refused here, before any process starts, rather than in round 1."""
    from .accountants import epsilon_of
    from .calibration import CALIBRATION_RANGE
    from .mechanisms import TRUNCATION_PROBABILITY

    fixed, high = client_sampling == ClientSamplingMode.FIXED, CALIBRATION_RANGE[1]
    largest_delta = (delta or 1e-5) - (0.0 if fixed else rounds * TRUNCATION_PROBABILITY)
    least = epsilon_of([(high, 1.0 if fixed else sample_rate, rounds)], largest_delta, accountant)
    require(
        target_epsilon >= least,
        "target_epsilon",
        target_epsilon,
        f"cannot be met by {name('target_epsilon_mode')} = 'calibrate': even noise multiplier {high:g} gives "
        f"epsilon {least:.4g} after {rounds} rounds at sample rate {sample_rate:g} and delta {largest_delta:.4g}; "
        f"allowed: a target >= {least:.4g}, or fewer rounds, a lower sample-rate or a larger delta",
    )


def check_secure_aggregation(noise_placement: str, clipping_norm: float) -> None:
    """SecAgg+ sums what the clients privatized themselves, and quantizes bounded updates."""
    require(
        noise_placement == NoisePlacementMode.DISTRIBUTED,
        "secure_aggregation",
        True,
        f"needs noise_placement='distributed', not {noise_placement!r}: under SecAgg+ the server cannot "
        "clip or noise single updates",
    )
    require(
        clipping_norm > 0,
        "secure_aggregation",
        True,
        f"needs {name('clipping_norm')} > 0: SecAgg+ quantizes bounded updates",
    )


def check_dpsgd(
    *,
    sample_noise_multiplier: float,
    sample_clipping_norm: float,
    batch_sample_rate: float,
    target_epsilon: float,
    dpsgd_noise: str,
    wavelet_calibration: str,
    grad_sample_mode: str,
    accountant: str,
    mu_source: str,
    mu_noise_multiplier: float,
) -> None:
    """The rules of sample-level DP-SGD in every client (ALI-DPFL, docs/algorithms.md §5 and §6)."""
    from .dpsgd_noise import WAVELET_CALIBRATIONS

    require(0 < batch_sample_rate <= 1, "batch_sample_rate", batch_sample_rate, "must be in (0, 1]")
    require(sample_noise_multiplier > 0, "sample_noise_multiplier", sample_noise_multiplier, "must be > 0")
    require(sample_clipping_norm > 0, "sample_clipping_norm", sample_clipping_norm, "must be > 0")
    require(
        target_epsilon > 0,
        "target_epsilon",
        target_epsilon,
        "must be > 0: each client's sample-level budget (R_c, the local step budget, follows from it)",
    )
    require(mu_noise_multiplier > 0, "mu_noise_multiplier", mu_noise_multiplier, "must be > 0")
    one_of("wavelet_calibration", wavelet_calibration, WAVELET_CALIBRATIONS)
    one_of("mu_source", mu_source, MU_SOURCES)
    one_of("accountant", accountant, ACCOUNTANT_NAMES)
    check_dpsgd_clipping(grad_sample_mode, dpsgd_noise)


def require_a_step(steps: int, target_epsilon: float, noise_multiplier: float, sample_rate: float, delta: float):
    """R_c > 0: a target that allows no DP-SGD step is refused (at validation, and again at the set-up)."""
    require(
        steps > 0,
        "target_epsilon",
        target_epsilon,
        f"allows no DP-SGD step with noise multiplier {noise_multiplier}, batch sample rate {sample_rate} and "
        f"delta {delta}: raise the target or the noise multiplier, or lower the sample rate",
    )


def check_dpsgd_clipping(grad_sample_mode: str, dpsgd_noise: str) -> None:
    """Opacus' per-sample gradient mode and the DP-SGD noise: ghost clipping cannot clip in the Haar domain."""
    from .dpsgd_noise import DPSGD_NOISES, GRAD_SAMPLE_MODES

    one_of("grad_sample_mode", grad_sample_mode, GRAD_SAMPLE_MODES)
    one_of("dpsgd_noise", dpsgd_noise, DPSGD_NOISES)
    require(
        not (dpsgd_noise == "wavelet" and grad_sample_mode == "ghost"),
        "grad_sample_mode",
        grad_sample_mode,
        "'ghost' cannot clip per-sample gradients in the Haar domain that dpsgd_noise = 'wavelet' needs: "
        "use hooks, functorch or ew",
    )
