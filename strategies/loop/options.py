"""The option objects of the DP wrappers: what a strategy is configured with, grouped by concern.

`DifferentialPrivacy(strategy, privacy=PrivacyOptions(...), sampling=SamplingOptions(...), run=RunOptions(...),
parts=[...])` is the wrapper's own form; the flat keywords of the README (`clipping_norm=..., sample_rate=...,
adaptive_clipping=..., audit_canaries=...`) are sorted into these objects and parts by `sort_keywords`, so both
forms build the same strategy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

from dpfl.dpcore.privacy.accountants import DEFAULT_ACCOUNTANT
from dpfl.dpcore.privacy.settings import require


@dataclass(frozen=True)
class PrivacyOptions:
    """Client-level DP: C, sigma, who adds the noise, the ledger's delta and accountant, the budget.

    clipping_norm : C, bound on the global L2 norm of each update (0: no clipping, only with sigma = 0).
    noise_multiplier : sigma (0: no noise, epsilon = inf).
    noise_placement : "central", "distributed" or "local" (`strategies.parts.noise_placement`).
    delta : target delta; 0: the strategy's default. delta >= 1/M (M clients) is refused once M is known
        (`dpcore.privacy.settings.check_delta`), unless allow_large_delta: then epsilon is published marked as no
        guarantee.
    accountant : the ledger's accountant ("pld", "rdp" or "prv").
    target_epsilon, target_epsilon_mode : "stop" before a round would exceed the target, or "calibrate" sigma up
        front for the configured number of rounds.
    """

    clipping_norm: float
    noise_multiplier: float
    noise_placement: str = "central"
    delta: float = 0.0
    accountant: str = DEFAULT_ACCOUNTANT
    target_epsilon: float = 0.0
    target_epsilon_mode: str = "stop"
    allow_large_delta: bool = False


@dataclass(frozen=True)
class SamplingOptions:
    """Who takes part: q, Poisson or fixed-size sampling, and how many nodes to wait for before round 1.

    num_sampled_clients : m, a fixed-size sample of m nodes a round (Flower's DP wrappers' argument; with it,
        client_sampling is "fixed" and q = m / M once the population M is known). 0: m = round(q M) for "fixed".
        Fewer than m nodes connected at round 1 is refused before anything is sent
        (`refuse_more_than_connected`).
    """

    sample_rate: float
    client_sampling: str = "poisson"
    min_available_nodes: int = 2
    num_sampled_clients: int = 0


@dataclass(frozen=True)
class RunOptions:
    """How the run goes: eta_s, the randomness, the wrapped strategy's evaluation, the outputs and their hooks.

    seed, secure_rng : OS entropy (default), or streams seeded from `seed` (reproducible, no guarantee).
    fraction_evaluate : only with strategy=None (set it on the wrapped strategy otherwise).
    publish_diagnostics : also print the non-private diagnostics in the log.
    on_round_end : called with each round's (published record, diagnostics).
    on_checkpoint : called with (state_dict(), global arrays) after each round, before on_round_end.
    """

    server_learning_rate: float = 1.0
    seed: int = 0
    secure_rng: bool = True
    fraction_evaluate: float | None = None
    publish_diagnostics: bool = False
    on_round_end: Callable | None = None
    on_checkpoint: Callable | None = None


@dataclass(frozen=True)
class DPSGDOptions:
    """ALI-DPFL's sample-level DP-SGD on the clients (`strategies.sample_level.ali_dpfl.ALIDPFL`), and its accounting.

    batch_sample_rate : q_s, Poisson batch sampling rate of DP-SGD on each client.
    sample_noise_multiplier, sample_clipping_norm : sigma and C of DP-SGD.
    target_epsilon : per-client sample-level budget; R_c follows from it.
    delta, accountant : the per-client ledgers' delta (0: 1e-5) and accountant.
    allow_large_delta : a client with n <= 1/delta samples trains (else it refuses:
        `dpcore.privacy.settings.check_delta`), and the run's epsilon is published marked as no guarantee.
    adaptive : eq. (9) each round; False: fixed tau = local_steps (the baseline).
    local_steps : tau of the first round and of the fixed baseline (0 means 1).
    gamma : heterogeneity Gamma of eq. (9).
    mu_source, mu_noise_multiplier : "server" (the server's data) or "clients" (noised, charged; its multiplier).
    mu_max : a client's mu is clipped to [0, mu_max] on the server too (mu_source = clients).
    num_partitions : the deployment's number of partitions (the clients' node config num-partitions) for
        `ServerData.partition_size`; 0: the number each reply reports from its node config (at least the number of
        nodes connected at the start; replies without it: that number).
    dpsgd_noise, wavelet_calibration : "wavelet" for DP-SGD-WAV clients; the ledgers charge
        its true multiplier (`dpsgd_multipliers`), and with `paper` calibration the
        run also reports the epsilon the paper would claim.
    grad_sample_mode : the clients' Opacus per-sample gradient mode (checked against dpsgd_noise).
    """

    batch_sample_rate: float
    sample_noise_multiplier: float
    sample_clipping_norm: float
    target_epsilon: float
    delta: float = 0.0
    accountant: str = DEFAULT_ACCOUNTANT
    allow_large_delta: bool = False
    adaptive: bool = True
    local_steps: int = 1
    gamma: float = 5.0
    mu_source: str = "server"
    mu_noise_multiplier: float = 10.0
    mu_max: float = 1.0
    num_partitions: int = 0
    dpsgd_noise: str = "gaussian"
    wavelet_calibration: str = "exact"
    grad_sample_mode: str = "ew"


@dataclass(frozen=True)
class ServerData:
    """What ALI-DPFL's server computes from its own data, no client's.

    gradient_fn : flat gradient of the server's loss at given weights (mu_source = server).
    partition_size : (partition id, number of partitions) -> |D_i|, the public partition sizes. The
        averaging weights p_i come from it, never from what a client reports (a reply whose
        num-examples differs is rejected); without it the server averages uniformly.
    """

    gradient_fn: Callable[[list], object] | None = None  # weights -> flat gradient (np.ndarray)
    partition_size: Callable[[int, int], int] | None = None


def refuse_more_than_connected(num_sampled_clients: int, connected: int, min_available_nodes: int) -> None:
    """m > M: refused before round 1. A fixed-size sample of m nodes a round divides the noisy sum by m; with
    fewer nodes the run would either be noised for m over a sum of fewer clients (Flower's wrappers: a smaller
    noise than sigma accounts for) or noised for the M it has (sigma C / M on the mean, more than m promised)."""
    require(
        num_sampled_clients <= connected,
        "num_sampled_clients",
        num_sampled_clients,
        f"more than the {connected} nodes connected at round 1 (a fixed-size sample of m needs m nodes): set it to "
        f"at most {connected}, or min_available_nodes (legacy: min_available_clients, now {min_available_nodes}) to "
        f"at least {num_sampled_clients} to wait for more nodes",
    )


def take(option_class, keywords: dict, given=None):
    """`given`, else an `option_class` built from the keywords that name its fields (removed from `keywords`)."""
    names = [f.name for f in fields(option_class)]
    mine = {k: keywords.pop(k) for k in names if k in keywords}
    if given is not None:
        if mine:
            raise TypeError(f"{', '.join(mine)} given both as keywords and in {option_class.__name__}")
        return given
    return option_class(**mine)


def refuse_unknown(owner: str, keywords: dict) -> None:
    """A keyword no option object or part took is a mistake, as for any Python call."""
    if keywords:
        raise TypeError(f"{owner}() got unexpected keyword arguments: {', '.join(sorted(keywords))}")
