"""The run config: every key, its default, and one validation pass at start-up.

`[tool.flwr.app.config]` in pyproject.toml carries the same keys and defaults
(a test keeps them equal). `validate()` names the key, the value and what is
allowed, and runs before any training starts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fl_app.privacy.dpsgd_noise import GRAD_SAMPLE_MODES
from fl_app.task.data import DATASETS, PARTITIONERS, dataset_info
from fl_app.task.models import MODELS, build_model, split_state_keys

ALI_DPFL_KEYS = ("sample-noise-multiplier", "sample-clipping-norm", "batch-sample-rate", "grad-sample-mode",
                 "dpsgd-noise", "adaptive", "gamma", "mu-source", "mu-max", "mu-noise-multiplier")

ALGORITHMS = ("dp-fedavg", "dp-fedsam", "dp-fedsam-topk", "dp-fedavg-wav", "dp2-fedsam", "centaur",
              "dp-fedavg-ft", "dp-fedsam-ft", "ali-dpfl")
PARTIAL_SHARING = ("dp2-fedsam", "centaur")  # body shared, head kept on each client
FINE_TUNED = ("dp-fedavg-ft", "dp-fedsam-ft")  # global model fine-tuned locally before evaluation
SECURE_AGGREGATION_ALGORITHMS = ("dp-fedavg", "dp-fedsam", "dp-fedsam-topk")  # SecAgg+ sums dense updates


class ConfigError(ValueError):
    """A run-config key has a value that is not allowed."""


@dataclass(frozen=True)
class Key:
    default: Any
    help: str
    choices: tuple = ()
    low: float | None = None  # inclusive unless low_open
    high: float | None = None  # inclusive unless high_open
    low_open: bool = False
    high_open: bool = False

    def allowed(self) -> str:
        if self.choices:
            return "one of: " + ", ".join(map(str, self.choices))
        kind = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[type(self.default)]
        if self.low is not None or self.high is not None:
            lo = "-inf" if self.low is None else self.low
            hi = "inf" if self.high is None else self.high
            kind += f" in {'(' if self.low_open else '['}{lo}, {hi}{')' if self.high_open or self.high is None else ']'}"
        return kind


SPEC: dict[str, Key] = {
    "algorithm": Key("dp-fedsam", "what runs", ALGORITHMS),
    "dataset": Key("mnist-embedded", "dataset name", DATASETS),
    "data-dir": Key("", "absolute folder with local dataset files (empty: embedded data or download)"),
    "partitioner": Key("dirichlet", "how the data is split across clients", PARTITIONERS),
    "dirichlet-alpha": Key(0.5, "Dirichlet concentration (smaller = more non-IID)", low=0, low_open=True),
    "classes-per-client": Key(2, "labels per client for the pathological partitioner", low=1),
    "model": Key("cnn-mnist", "model architecture", MODELS),
    "num-rounds": Key(30, "federated rounds", low=1),
    "sample-rate": Key(0.5, "q: probability that a client is sampled in a round", low=0, high=1, low_open=True),
    "client-sampling": Key("poisson", "client sampling scheme", ("poisson", "fixed")),
    "min-nodes": Key(2, "wait for this many connected nodes before round 1", low=1),
    "clipping-norm": Key(0.5, "C: bound on the L2 norm of each client update (0: no clipping)", low=0),
    "noise-multiplier": Key(1.0, "sigma: noise std / C (0: no noise)", low=0),
    "noise-placement": Key("distributed", "who adds the Gaussian noise", ("central", "distributed")),
    "delta": Key(0.0, "target delta (0: 1/number of clients)", low=0, high=1, high_open=True),
    "target-epsilon": Key(0.0, "privacy budget (0: none)", low=0),
    "target-epsilon-mode": Key("stop", "stop before exceeding the budget, or calibrate sigma to it",
                               ("stop", "calibrate")),
    "accountant": Key("rdp", "privacy accountant (Opacus)", ("rdp", "prv")),
    "server-lr": Key(1.0, "server learning rate eta_s", low=0, low_open=True),
    "local-epochs": Key(2, "local passes over the client's data per round", low=1),
    "local-steps": Key(0, "local steps per round (0: use local-epochs)", low=0),
    "batch-size": Key(32, "local minibatch size", low=1),
    "lr": Key(0.1, "local learning rate eta", low=0, low_open=True),
    "momentum": Key(0.5, "local SGD momentum", low=0, high=1, high_open=True),
    "weight-decay": Key(5e-4, "local weight decay", low=0),
    "sam-rho": Key(0.05, "SAM perturbation radius rho (paper: 0.5, which stalls the small MNIST CNN)", low=0),
    "sparsity": Key(0.4, "dp-fedsam-topk: fraction p of coordinates each client uploads (k = ceil(p * size))",
                    low=0, high=1, low_open=True),
    "topk-mode": Key("per-layer", "dp-fedsam-topk: top-k per tensor or over the whole update",
                     ("per-layer", "global")),
    "wavelet-calibration": Key("exact", "dp-fedavg-wav: 'paper' (published noise, true epsilon reported) or "
                               "'exact' (sigma_H = sigma * sqrt(n): the configured epsilon holds)",
                               ("paper", "exact")),
    "fraction-evaluate": Key(0.0, "fraction of clients evaluating each round (0: none; for dp2-fedsam, centaur "
                                  "and *-ft: all, for the personalized accuracy)", low=0, high=1),
    "lr-decay": Key(1.0, "learning rates are multiplied by this every round (1: none; DP2-FedSAM paper: 0.99)",
                    low=0, high=1, low_open=True),
    "head-prefix": Key("", "dp2-fedsam/centaur: parameter-name prefix of the personal head (empty: last linear layer)"),
    "head-epochs": Key(2, "dp2-fedsam/centaur: tau_h as passes over the data (body: local-epochs)", low=1),
    "head-steps": Key(0, "dp2-fedsam/centaur: tau_h head SGD steps per round (0: use head-epochs)", low=0),
    "head-lr": Key(0.0, "dp2-fedsam/centaur: head learning rate eta_h (0: same as lr)", low=0),
    "fine-tune-steps": Key(0, "dp-fedavg-ft/dp-fedsam-ft: local steps before evaluating (0: the round's "
                              "local-steps/local-epochs)", low=0),
    "sample-noise-multiplier": Key(1.0, "ali-dpfl: DP-SGD noise multiplier sigma (noise std / C per step)",
                                   low=0, low_open=True),
    "sample-clipping-norm": Key(1.0, "ali-dpfl: DP-SGD per-sample gradient clipping norm C", low=0, low_open=True),
    "batch-sample-rate": Key(0.05, "ali-dpfl: DP-SGD Poisson batch sampling rate q_s", low=0, high=1,
                             low_open=True),
    "grad-sample-mode": Key("ew", "ali-dpfl: Opacus per-sample gradient mode (ew: fastest measured on CPU)",
                            GRAD_SAMPLE_MODES),
    "dpsgd-noise": Key("gaussian", "ali-dpfl: DP-SGD noise, or 'wavelet' (DP-SGD-WAV: clip and noise the Haar "
                                   "coefficients)", ("gaussian", "wavelet")),
    "adaptive": Key(True, "ali-dpfl: local steps tau from eq. (9) each round (false: fixed tau = local-steps)"),
    "gamma": Key(5.0, "ali-dpfl: heterogeneity Gamma of eq. (9) (paper: 0 IID, 1/5/10 for Dir 1/0.5/0.05)",
                 low=0),
    "mu-source": Key("server", "ali-dpfl: where mu is estimated (server data: free; clients: noised, charged)",
                     ("server", "clients")),
    "mu-max": Key(1.0, "ali-dpfl, mu-source = clients: each client's mu ratio is clipped to [0, mu-max]",
                  low=0, low_open=True),
    "mu-noise-multiplier": Key(10.0, "ali-dpfl, mu-source = clients: noise std / mu-max of each mu release",
                               low=0, low_open=True),
    "seed": Key(42, "drives partitioning, sampling, noise and init", low=0),
    "secure-rng": Key(False, "draw DP noise from OS entropy (not reproducible; the seed cannot undo it)"),
    "secure-aggregation": Key(False, "sum client updates with Flower's SecAgg+: the server sees only the sum "
                              "(needs noise-placement = distributed)"),
    "secagg-num-shares": Key(1.0, "SecAgg+ key shares per client, as a fraction of the sampled clients",
                             low=0, high=1, low_open=True),
    "secagg-reconstruction-threshold": Key(0.5, "SecAgg+ shares needed to unmask, as a fraction of the shares",
                                           low=0, high=1, low_open=True),
    "results-dir": Key("", "absolute folder for this run's results (empty: ~/dpfl-results/<run-name>)"),
    "run-name": Key("", "name of the run folder (empty: <time>-<algorithm>-<dataset>)"),
}


def _check_type(key: str, value: Any, spec: Key) -> Any:
    expected = type(spec.default)
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
        raise ConfigError(f"run-config key '{key}' = {value!r}: must be {spec.allowed()}")
    return value


def _check_value(key: str, value: Any, spec: Key) -> None:
    bad = bool(spec.choices) and value not in spec.choices
    if spec.low is not None:
        bad |= value <= spec.low if spec.low_open else value < spec.low
    if spec.high is not None:
        bad |= value >= spec.high if spec.high_open else value > spec.high
    if isinstance(value, float) and value != value:  # NaN
        bad = True
    if bad:
        raise ConfigError(f"run-config key '{key}' = {value!r}: must be {spec.allowed()}")


def validate(run_config: Mapping[str, Any]) -> dict[str, Any]:
    """Defaults filled in, every key checked, combinations checked; raises ConfigError."""
    unknown = sorted(set(run_config) - set(SPEC))
    if unknown:
        given = ", ".join(f"'{k}' = {run_config[k]!r}" for k in unknown)
        raise ConfigError(f"unknown run-config key(s) {given}; known keys: {', '.join(SPEC)}")
    cfg = {k: spec.default for k, spec in SPEC.items()}
    for key, value in run_config.items():
        cfg[key] = _check_type(key, value, SPEC[key])
        _check_value(key, cfg[key], SPEC[key])
    _check_combinations(cfg)
    return cfg


def _check_combinations(cfg: dict[str, Any]) -> None:
    def fail(msg: str) -> None:
        raise ConfigError(msg)

    if cfg["algorithm"] == "ali-dpfl":
        _check_ali_dpfl(cfg)
    if cfg["noise-multiplier"] > 0 and cfg["clipping-norm"] == 0:
        fail(f"run-config key 'noise-multiplier' = {cfg['noise-multiplier']} needs 'clipping-norm' > 0 "
             "(noise without clipping bounds nothing); set clipping-norm, or noise-multiplier = 0 "
             "for a non-private run")
    if cfg["target-epsilon"] > 0 and cfg["noise-multiplier"] == 0 and cfg["target-epsilon-mode"] == "stop":
        fail(f"run-config key 'target-epsilon' = {cfg['target-epsilon']} cannot be met with "
             "'noise-multiplier' = 0 (epsilon is infinite); use target-epsilon-mode = 'calibrate' "
             "or a positive noise-multiplier")
    if cfg["target-epsilon"] > 0 and cfg["target-epsilon-mode"] == "calibrate" and cfg["clipping-norm"] == 0:
        fail("run-config key 'target-epsilon-mode' = 'calibrate' needs 'clipping-norm' > 0")
    if cfg["partitioner"] == "natural" and cfg["dataset"] != "femnist":
        fail(f"run-config key 'partitioner' = 'natural' needs dataset = 'femnist' (writers), "
             f"not {cfg['dataset']!r}; allowed for {cfg['dataset']!r}: iid, dirichlet, pathological")
    wavelet_users = ("dp-fedavg-wav", "ali-dpfl") if cfg["dpsgd-noise"] == "wavelet" else ("dp-fedavg-wav",)
    only_for = {"sparsity": ("dp-fedsam-topk",), "topk-mode": ("dp-fedsam-topk",),
                "wavelet-calibration": wavelet_users,
                **{key: ("ali-dpfl",) for key in ALI_DPFL_KEYS}}
    for key, algorithms in only_for.items():
        if cfg[key] != SPEC[key].default and cfg["algorithm"] not in algorithms:
            allowed = " or ".join(f"'{a}'" for a in algorithms)
            fail(f"run-config key '{key}' = {cfg[key]!r} applies only to algorithm = {allowed}, "
                 f"but 'algorithm' = {cfg['algorithm']!r}; remove {key} or change the algorithm")
    if cfg["algorithm"] == "dp-fedsam-topk" and cfg["noise-placement"] != "distributed":
        fail(f"run-config key 'noise-placement' = {cfg['noise-placement']!r}: algorithm 'dp-fedsam-topk' keeps "
             "the top-k coordinates after the noise on the client, so it needs noise-placement = 'distributed'")
    if cfg["algorithm"] == "dp-fedavg-wav" and cfg["noise-placement"] != "central":
        fail(f"run-config key 'noise-placement' = {cfg['noise-placement']!r}: algorithm 'dp-fedavg-wav' adds its "
             "wavelet noise at the server (trusted), so it needs noise-placement = 'central'")
    if cfg["algorithm"] == "dp-fedavg-wav" and cfg["wavelet-calibration"] == "paper" and cfg["accountant"] == "prv":
        fail("run-config key 'accountant' = 'prv' cannot account wavelet-calibration = 'paper': its effective "
             "noise multiplier sigma/sqrt(n) is tiny, and the PRV accountant's memory grows without bound as "
             "sigma -> 0; use accountant = 'rdp'")
    for key in ("results-dir", "data-dir"):
        if cfg[key] and not os.path.isabs(os.path.expanduser(cfg[key])):
            fail(f"run-config key '{key}' = {cfg[key]!r}: must be an absolute path "
                 "(relative paths resolve against the SuperLink's folder, not yours)")
    if cfg["head-prefix"] and cfg["algorithm"] not in PARTIAL_SHARING:
        fail(f"run-config key 'head-prefix' = {cfg['head-prefix']!r} only applies to algorithm = "
             f"{' or '.join(PARTIAL_SHARING)}, not {cfg['algorithm']!r}")
    if cfg["head-prefix"]:
        _check_head_prefix(cfg, fail)
    if cfg["fine-tune-steps"] and cfg["algorithm"] not in FINE_TUNED:
        fail(f"run-config key 'fine-tune-steps' = {cfg['fine-tune-steps']} only applies to algorithm = "
             f"{' or '.join(FINE_TUNED)}, not {cfg['algorithm']!r}")
    if cfg["secure-aggregation"]:
        if cfg["noise-placement"] != "distributed":
            fail(f"run-config key 'secure-aggregation' = True needs noise-placement = 'distributed', not "
                 f"{cfg['noise-placement']!r}: under SecAgg+ the server cannot clip or noise single updates")
        if cfg["clipping-norm"] == 0:
            fail("run-config key 'secure-aggregation' = True needs 'clipping-norm' > 0: SecAgg+ quantizes "
                 "bounded updates")
        if cfg["algorithm"] not in SECURE_AGGREGATION_ALGORITHMS:
            fail(f"run-config key 'secure-aggregation' = True works with algorithm "
                 f"{', '.join(SECURE_AGGREGATION_ALGORITHMS)} (sums of dense updates), not {cfg['algorithm']!r}")
    if cfg["run-name"] and ("/" in cfg["run-name"] or cfg["run-name"] in (".", "..")):
        fail(f"run-config key 'run-name' = {cfg['run-name']!r}: must be a plain folder name")


def _check_head_prefix(cfg: dict[str, Any], fail) -> None:
    """The head prefix must name some but not all of the model's parameters."""
    info = dataset_info(cfg["dataset"])
    try:
        split_state_keys(build_model(cfg["model"], info["input_shape"], info["num_classes"]), cfg["head-prefix"])
    except ValueError as exc:
        fail(f"run-config key 'head-prefix' = {cfg['head-prefix']!r} does not fit model {cfg['model']!r}: {exc}")


# Client-level DP keys that sample-level ali-dpfl ignores: setting them is a mistake worth naming.
_CLIENT_LEVEL_KEYS = {"clipping-norm": "sample-clipping-norm", "noise-multiplier": "sample-noise-multiplier",
                      "noise-placement": None}


def _check_ali_dpfl(cfg: dict[str, Any]) -> None:
    if cfg["target-epsilon"] <= 0:
        raise ConfigError(f"run-config key 'target-epsilon' = {cfg['target-epsilon']}: algorithm 'ali-dpfl' needs "
                          "each client's sample-level budget > 0 (R_c, the local step budget, follows from it)")
    if cfg["target-epsilon-mode"] != "stop":
        raise ConfigError(f"run-config key 'target-epsilon-mode' = {cfg['target-epsilon-mode']!r}: algorithm "
                          "'ali-dpfl' allows only 'stop' (clients stop at R_c steps)")
    if cfg["dpsgd-noise"] == "wavelet" and cfg["grad-sample-mode"] == "ghost":
        raise ConfigError("run-config key 'grad-sample-mode' = 'ghost' cannot clip per-sample gradients in the Haar "
                          "domain that 'dpsgd-noise' = 'wavelet' needs: use hooks, functorch or ew")
    if cfg["dpsgd-noise"] == "wavelet" and cfg["wavelet-calibration"] == "paper" and cfg["accountant"] == "prv":
        raise ConfigError("run-config key 'accountant' = 'prv' cannot account dpsgd-noise = 'wavelet' with "
                          "wavelet-calibration = 'paper' (true noise multiplier sigma/n is tiny); use 'rdp'")
    for key, instead in _CLIENT_LEVEL_KEYS.items():
        if cfg[key] != SPEC[key].default:
            hint = f"; use '{instead}'" if instead else ""
            raise ConfigError(f"run-config key '{key}' = {cfg[key]!r} is a client-level DP setting that "
                              f"algorithm 'ali-dpfl' (sample-level DP-SGD) does not use: leave it at "
                              f"{SPEC[key].default!r}{hint}")
