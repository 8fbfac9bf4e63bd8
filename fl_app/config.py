"""The run config: every key, its default, and one validation pass at start-up.

`[tool.flwr.app.config]` in pyproject.toml carries the same keys and defaults
(a test keeps them equal). `validate()` names the key, the value and what is
allowed, and runs before any training starts.
"""

from __future__ import annotations

import difflib
import math
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dpcore.privacy.dpsgd_noise import DPSGD_NOISES, GRAD_SAMPLE_MODES, WAVELET_CALIBRATIONS
from dpcore.privacy.mechanisms import TOPK_MODES
from dpcore.privacy.settings import (
    ACCOUNTANT_NAMES,
    CLIENT_SAMPLINGS,
    MU_SOURCES,
    NOISE_PLACEMENTS,
    TARGET_EPSILON_MODES,
)
from dpcore.task.data import DATASETS, PARTITIONERS
from dpcore.task.device import DEVICE_CHOICES, device_problem
from dpcore.task.models import MODELS
from fl_app.algorithms import ALGORITHMS, DEFAULT_ALGORITHM, SERVER_STRATEGIES, check_config

FLOAT_MAX = 1e6  # no float key needs more; larger values overflow the accountants or the model
INT_MAX = 10**7  # rounds, steps, epochs, sizes
NOISE_RANGE = (1e-3, 1e3)  # noise multipliers: below, Opacus' RDP divides by ~0; above, it takes seconds per call
RATE_MIN = 1e-6  # sample-rate and mu-max: smaller values gave a NaN model (1 / q) or a ZeroDivisionError (1 / mu-max)
AUDIT_CANARIES_MAX = 10_000  # each canary is a model-sized vector held by the server: 1e7 of them ran out of memory
# results-dir may not be the filesystem root nor lie in these trees (the launcher runs as any user, root included)
SYSTEM_TREES = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/proc", "/sbin", "/sys",
                "/usr")


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
    nonzero_low: float | None = None  # 0, or at least this (noise multipliers: the accountants' range)
    note: str = ""  # why the bounds are what they are, added to the error message

    @property
    def upper(self) -> float:
        """The largest value allowed: `high`, else a cap that keeps the arithmetic finite."""
        if self.high is not None:
            return self.high
        return INT_MAX if type(self.default) is int else FLOAT_MAX

    def allowed(self) -> str:
        if self.choices:
            return "one of: " + ", ".join(map(str, self.choices))
        kind = {bool: "true or false", int: "an integer", float: "a number", str: "a string without "
                "control characters"}[type(self.default)]
        if type(self.default) in (int, float):
            lo = "-inf" if self.low is None else self.low
            interval = f"{'(' if self.low_open else '['}{lo}, {self.upper:g}{')' if self.high_open else ']'}"
            kind += (f": 0 or in [{self.nonzero_low:g}, {self.upper:g}]" if self.nonzero_low is not None
                     else f" in {interval}")
        return f"{kind} ({self.note})" if self.note else kind


SPEC: dict[str, Key] = {
    "algorithm": Key(DEFAULT_ALGORITHM, "what runs", tuple(ALGORITHMS)),
    "dataset": Key("mnist-embedded", "dataset name", DATASETS),
    "data-dir": Key("", "absolute folder with local dataset files (empty: embedded data or download)"),
    "partitioner": Key("dirichlet", "how the data is split across clients", PARTITIONERS),
    "validation-fraction": Key(0.0, "fraction of the training data the server holds out as its validation set "
                                    "(never given to clients; evaluated beside the test set: val_accuracy)",
                               low=0, high=0.5),
    "dirichlet-alpha": Key(0.5, "Dirichlet concentration (smaller = more non-IID)", low=0, low_open=True),
    "classes-per-client": Key(2, "labels per client for the pathological partitioner", low=1),
    "model": Key("cnn-mnist", "model architecture", MODELS),
    "device": Key("auto", f"where torch trains and evaluates: {DEVICE_CHOICES} (auto: CUDA when torch sees one, "
                          "else the CPU)"),
    "num-rounds": Key(30, "federated rounds", low=1),
    "eval-every": Key(1, "evaluation (the server's, and the clients' where the algorithm has it) every N rounds "
                         "and after the last", low=1),
    "sample-rate": Key(0.5, "q: probability that a client is sampled in a round", low=RATE_MIN, high=1),
    "client-sampling": Key("poisson", "client sampling scheme", CLIENT_SAMPLINGS),
    "min-nodes": Key(2, "wait for this many connected nodes before round 1", low=1),
    "flower-speed-patches": Key(False, "patch Flower internals for speed (flwr 1.41/1.42 only, checked at start): "
                                       "object pulls retried after 0.05 s, reply object pulls ended at round-timeout"),
    "node-wait-timeout": Key(600.0, "seconds to wait for min-nodes connected nodes before the run is refused (a "
                                    "simulation with fewer SuperNodes is refused at once)", low=0, low_open=True),
    "round-timeout": Key(3600.0, "seconds a message exchange waits for client replies; a reply not in by then, "
                                 "objects included, counts as a failed client", low=0, low_open=True),
    "clipping-norm": Key(0.5, "C: bound on the L2 norm of each client update (0: no clipping)", low=0),
    "noise-multiplier": Key(1.0, "sigma: noise std / C (0: no noise)", low=0, nonzero_low=NOISE_RANGE[0], high=NOISE_RANGE[1]),
    "noise-placement": Key("distributed", "who adds the Gaussian noise (local: local DP, each client noises its own update)", NOISE_PLACEMENTS),
    "delta": Key(0.0, "target delta (0: min(1e-5, 0.01 / number of clients); ali-dpfl: 1e-5 per client's samples)",
                 low=0, high=1, high_open=True),
    "target-epsilon": Key(0.0, "privacy budget (0: none)", low=0),
    "target-epsilon-mode": Key("stop", "stop before exceeding the budget, or calibrate sigma to it",
                               TARGET_EPSILON_MODES),
    "accountant": Key("pld", "privacy accountant: dp-accounting's PLD (tightest), Opacus' RDP or PRV",
                      ACCOUNTANT_NAMES),
    "server-strategy": Key("fedavg", "the Flower strategy the DP wrapper runs around: its aggregation and server "
                                     "optimizer act on the privatized average", SERVER_STRATEGIES),
    "server-lr": Key(1.0, "server learning rate: eta_s of w + eta_s * average (fedavg), the optimizer's eta "
                          "(fedadam, fedyogi, fedadagrad), FedAvgM's server_learning_rate", low=0, low_open=True),
    "server-momentum": Key(0.9, "fedavgm: server momentum", low=0, high=1, high_open=True),
    "local-epochs": Key(2, "local passes over the client's data per round", low=1),
    "local-steps": Key(0, "local steps per round (0: use local-epochs)", low=0),
    "batch-size": Key(32, "local minibatch size", low=1),
    "lr": Key(0.1, "local learning rate eta", low=0, low_open=True),
    "momentum": Key(0.5, "local SGD momentum", low=0, high=1, high_open=True),
    "weight-decay": Key(5e-4, "local weight decay", low=0),
    "sam-rho": Key(0.05, "SAM perturbation radius rho (paper: 0.5, which stalls the small MNIST CNN)", low=0),
    "sparsity": Key(0.4, "dp-fedsam-topk: fraction p of coordinates each client uploads (k = ceil(p * size))",
                    low=0, high=1, low_open=True),
    "topk-mode": Key("per-layer", "dp-fedsam-topk: top-k per tensor or over the whole update", TOPK_MODES),
    "wavelet-calibration": Key("exact", "dp-fedavg-wav: 'paper' (published noise, true epsilon reported) or "
                               "'exact' (sigma_H = sigma * sqrt(n): the configured epsilon holds)",
                               WAVELET_CALIBRATIONS),
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
                                   low=NOISE_RANGE[0], high=NOISE_RANGE[1]),
    "sample-clipping-norm": Key(1.0, "ali-dpfl: DP-SGD per-sample gradient clipping norm C", low=0, low_open=True),
    "batch-sample-rate": Key(0.05, "ali-dpfl: DP-SGD Poisson batch sampling rate q_s", low=0, high=1,
                             low_open=True),
    "grad-sample-mode": Key("ew", "ali-dpfl: Opacus per-sample gradient mode (ew: fastest measured on CPU)",
                            GRAD_SAMPLE_MODES),
    "dpsgd-noise": Key("gaussian", "ali-dpfl: DP-SGD noise, or 'wavelet' (DP-SGD-WAV: clip and noise the Haar "
                                   "coefficients)", DPSGD_NOISES),
    "adaptive": Key(True, "ali-dpfl: local steps tau from eq. (9) each round (false: fixed tau = local-steps)"),
    "gamma": Key(5.0, "ali-dpfl: heterogeneity Gamma of eq. (9) (paper: 0 IID, 1/5/10 for Dir 1/0.5/0.05)",
                 low=0),
    "mu-source": Key("server", "ali-dpfl: where mu is estimated (server data: free; clients: noised, charged)",
                     MU_SOURCES),
    "mu-max": Key(1.0, "ali-dpfl, mu-source = clients: each client's mu ratio is clipped to [0, mu-max]",
                  low=RATE_MIN, note="the clients' mu ratios are divided by it"),
    "num-partitions": Key(0, "ali-dpfl: the SuperNodes' node-config num-partitions, for the public partition sizes "
                             "that weigh the average (0: the number of nodes connected at the start)", low=0),
    "mu-noise-multiplier": Key(10.0, "ali-dpfl, mu-source = clients: noise std / mu-max of each mu release",
                               low=NOISE_RANGE[0], high=NOISE_RANGE[1]),
    "adaptive-clipping": Key(False, "adapt the clipping norm toward a quantile of the update norms each round "
                             "(Andrew et al.; clipping-norm is C_0; docs/dp-toolbox.md §3)"),
    "target-quantile": Key(0.5, "adaptive-clipping: target quantile gamma of the update norms", low=0, high=1,
                           low_open=True, high_open=True),
    "clip-learning-rate": Key(0.2, "adaptive-clipping: eta_C in C <- C exp(-eta_C (b_bar - gamma))", low=0,
                              low_open=True),
    "clip-count-noise-multiplier": Key(10.0, "adaptive-clipping: sigma_b, noise std of the count of unclipped "
                                       "clients (must exceed noise-multiplier / 2)", low=0, low_open=True),
    "ftrl-epoch-rounds": Key(0, "dp-ftrl: b, rounds per epoch; each node takes part at most once per epoch, one "
                                "tree per epoch (0: number of nodes // clients per round, where clients per round = "
                                "round(sample-rate * nodes))", low=0),
    "ftrl-momentum": Key(0.0, "dp-ftrl: server momentum gamma on the noisy prefix sums (DP-FTRLM; 0: plain DP-FTRL)",
                         low=0, high=1, high_open=True),
    "audit-canaries": Key(0, "K canary clients for the one-shot empirical privacy estimate (Andrew et al.), "
                             "reported beside the accounted epsilon (0: no audit; client-level algorithms)", low=0,
                          high=AUDIT_CANARIES_MAX, note="each canary is a model-sized vector in the server's memory"),
    "audit-canary-kind": Key("isotropic", "canary directions: 'isotropic' (random, the paper's) or 'smooth' (coarse "
                                          "Haar directions, where noise that is weak along smooth directions shows)",
                             ("isotropic", "smooth")),
    "seed": Key(42, "drives partitioning, sampling, noise and init", low=0, high=2**63 - 1),
    "secure-rng": Key(True, "draw DP noise and client sampling from OS entropy (false: reproducible from 'seed', "
                            "and the printed epsilon is NOT a guarantee: anyone with the seed can remove the noise)"),
    "secure-aggregation": Key(False, "sum client updates with Flower's SecAgg+: the server sees only the sum "
                              "(needs noise-placement = distributed)"),
    "secagg-num-shares": Key(1.0, "SecAgg+ key shares per client, as a fraction of the sampled clients",
                             low=0, high=1, low_open=True),
    "secagg-reconstruction-threshold": Key(0.5, "SecAgg+ shares needed to unmask, as a fraction of the shares",
                                           low=0, high=1, low_open=True),
    "tensorboard": Key(True, "write TensorBoard events into the run folder (tensorboard --logdir <results>)"),
    "wandb": Key(False, "also log the dashboards' scalars to Weights & Biases (needs the wandb extra)"),
    "wandb-mode": Key("offline", "W&B mode: offline (files in the run folder, no account or network) or online",
                      ("offline", "online")),
    "wandb-project": Key("dpfl", "W&B project name"),
    "publish-diagnostics": Key(False, "also show the non-private diagnostics (counts, update norms, clipped fraction, "
                                      "losses, client evaluation) in the log and dashboards; they are always in the "
                                      "run folder's diagnostics.jsonl, which epsilon does not cover"),
    "resume": Key(False, "continue the run in results-dir (or run-name) from its last checkpoint, ledger included"),
    "results-dir": Key("", "absolute folder for this run's results (empty: ~/dpfl-results/<run-name>)"),
    "run-name": Key("", "name of the run folder (empty: <time>-<algorithm>-<dataset>)"),
}


def _check_type(key: str, value: Any, spec: Key) -> Any:
    expected = type(spec.default)
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:
            raise ConfigError(f"run-config key '{key}' = {value!r}: must be {spec.allowed()}") from None
    if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
        raise ConfigError(f"run-config key '{key}' = {value!r}: must be {spec.allowed()}")
    return value


def _check_value(key: str, value: Any, spec: Key) -> None:
    bad = bool(spec.choices) and value not in spec.choices
    if isinstance(value, str):
        bad |= any(ord(c) < 32 or ord(c) == 127 for c in value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"run-config key '{key}' = {value!r}: must be {spec.allowed()}")
        bad |= value >= spec.upper if spec.high_open else value > spec.upper
        bad |= value != 0 and abs(value) < sys.float_info.min  # subnormal
        bad |= spec.nonzero_low is not None and 0 < value < spec.nonzero_low
    if spec.low is not None:
        bad |= value <= spec.low if spec.low_open else value < spec.low
    if spec.high is not None:
        bad |= value >= spec.high if spec.high_open else value > spec.high
    if isinstance(value, float) and value != value:  # NaN
        bad = True
    if bad:
        raise ConfigError(f"run-config key '{key}' = {value!r}: must be {spec.allowed()}")


def _check_creatable(key: str, path: str) -> None:
    """The folder exists, or its nearest existing ancestor is a writable folder (nothing is created here)."""
    folder = os.path.abspath(os.path.expanduser(path))
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise ConfigError(f"run-config key '{key}' = {path!r}: cannot be created ({folder!r} is not a writable folder)")


def _check_results_dir(path: str) -> None:
    """results-dir is not the filesystem root, lies in no system tree, and is new, empty or a dpfl run folder
    (whatever else a folder holds would be mixed with the run's files, or overwritten)."""
    from fl_app.results import RUN_FILES

    folder = os.path.realpath(os.path.expanduser(path))
    system = next((t for t in SYSTEM_TREES if folder == t or folder.startswith(t + "/")), None)
    if folder == "/" or system:
        where = "the filesystem root" if folder == "/" else f"in the system tree {system}"
        raise ConfigError(f"run-config key 'results-dir' = {path!r}: must be a folder outside the filesystem root "
                          f"and {', '.join(SYSTEM_TREES)}; {folder!r} is {where}")
    if os.path.isdir(folder) and not any(os.path.exists(os.path.join(folder, f)) for f in RUN_FILES):
        others = sorted(os.listdir(folder))
        if others:
            raise ConfigError(f"run-config key 'results-dir' = {path!r}: must be a new or empty folder, or a dpfl "
                              f"run folder (one holding {' or '.join(RUN_FILES)}); it holds {len(others)} other "
                              f"entries ({', '.join(map(repr, others[:3]))}{', ...' if len(others) > 3 else ''})")


def _unknown_keys(run_config: Mapping[str, Any]) -> ConfigError:
    """The error for keys not in SPEC: each with its close matches (a misspelling), then every known key."""
    def one(key: str) -> str:
        close = difflib.get_close_matches(key, SPEC, n=3, cutoff=0.6)
        hint = f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""
        return f"'{key}' = {run_config[key]!r}{hint}"

    unknown = sorted(set(run_config) - set(SPEC))
    return ConfigError(f"unknown run-config key(s) {', '.join(map(one, unknown))}; known keys: {', '.join(SPEC)}")


def validate(run_config: Mapping[str, Any]) -> dict[str, Any]:
    """Defaults filled in, every key checked, combinations checked; raises ConfigError."""
    if set(run_config) - set(SPEC):
        raise _unknown_keys(run_config)
    cfg = {k: spec.default for k, spec in SPEC.items()}
    for key, value in run_config.items():
        cfg[key] = _check_type(key, value, SPEC[key])
        _check_value(key, cfg[key], SPEC[key])
    _check_combinations(cfg)
    return cfg


def _check_combinations(cfg: dict[str, Any]) -> None:
    """Rules between keys: the algorithm's (from the registry, the same checks a strategy built
    from Python runs) and the app's own (data and paths)."""
    if cfg["partitioner"] == "natural" and cfg["dataset"] != "femnist":
        raise ConfigError(f"run-config key 'partitioner' = 'natural' needs dataset = 'femnist' (writers), "
                          f"not {cfg['dataset']!r}; allowed for {cfg['dataset']!r}: iid, dirichlet, pathological")
    for key in ("results-dir", "data-dir"):
        if cfg[key] and not os.path.isabs(os.path.expanduser(cfg[key])):
            raise ConfigError(f"run-config key '{key}' = {cfg[key]!r}: must be an absolute path "
                              "(relative paths resolve against the SuperLink's folder, not yours)")
    if problem := device_problem(cfg["device"]):
        raise ConfigError(f"run-config key 'device' = {cfg['device']!r}: {problem}")
    if cfg["data-dir"] and not os.path.isdir(os.path.expanduser(cfg["data-dir"])):
        raise ConfigError(f"run-config key 'data-dir' = {cfg['data-dir']!r}: must be an existing folder")
    if cfg["results-dir"]:
        _check_results_dir(cfg["results-dir"])
        _check_creatable("results-dir", cfg["results-dir"])
    if cfg["run-name"] and ("/" in cfg["run-name"] or cfg["run-name"] in (".", "..")):
        raise ConfigError(f"run-config key 'run-name' = {cfg['run-name']!r}: must be a plain folder name")
    if cfg["resume"] and not (cfg["results-dir"] or cfg["run-name"]):
        raise ConfigError("run-config key 'resume' = True needs 'results-dir' or 'run-name' to find the run to continue")
    if cfg["audit-canaries"] == 1:
        raise ConfigError("run-config key 'audit-canaries' = 1: must be 0 (no audit) or >= 2 (the null cosines' "
                          "spread needs at least two never-inserted canaries; the estimate wants dozens)")
    if cfg["resume"] and cfg["audit-canaries"]:
        raise ConfigError("run-config key 'resume' = True is not supported with 'audit-canaries' > 0 yet (the audit "
                          "measures the model delta from round 1)")
    if cfg["resume"] and cfg["secure-aggregation"]:
        raise ConfigError("run-config key 'resume' = True is not supported with 'secure-aggregation' = true yet "
                          "(Flower's SecAgg+ workflow numbers rounds from 1)")
    try:
        check_config(cfg, {k: spec.default for k, spec in SPEC.items()})
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


# ---------------------------------------------------------------------------- the key reference, drawn from SPEC
KEYS_DOC = "docs/run-config.md"


def key_reference() -> str:
    """docs/run-config.md: every key with its default, what is allowed and what it does, from SPEC."""
    def literal(value: Any) -> str:
        return ("true" if value else "false") if isinstance(value, bool) else (
            f'"{value}"' if isinstance(value, str) else f"{value:g}" if isinstance(value, float) else str(value))

    rows = [f"| `{key}` | `{literal(spec.default)}` | {spec.allowed()} | {spec.help} |"
            for key, spec in SPEC.items()]
    return "\n".join([
        "# Run-config keys", "",
        "Every key of `[tool.flwr.app.config]` in pyproject.toml, drawn from `fl_app/config.py` (`SPEC`), where",
        "each key is declared once with its default, what is allowed and what it does; `validate()` checks a run",
        "config against it before anything trains, and an error names the key, the value and what is allowed.",
        "Regenerate with `python -m fl_app.config --write` (a test keeps this page current).", "",
        "| key | default | allowed | what it does |", "|---|---|---|---|", *rows, ""])


if __name__ == "__main__":
    from pathlib import Path

    target = Path(__file__).resolve().parents[1] / KEYS_DOC
    if "--write" in sys.argv:
        target.write_text(key_reference())
    print(key_reference() if "--write" not in sys.argv else f"wrote {target}")
