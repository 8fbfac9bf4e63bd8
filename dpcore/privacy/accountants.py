"""The accountants: eps(delta) of a composition of noisy releases, one small class per accountant behind a registry.

`epsilon_of` composes Poisson-sampled Gaussian events (sigma, q, steps) with the accountant named in the
registry: Google dp-accounting's privacy-loss-distribution (PLD) accountant by default (pessimistic
discretisation, so its epsilon is an upper bound, on a grid coarsened for small multipliers: `pld_intervals`;
unsampled events, q = 1, in closed form: `gaussian_epsilon`),
Opacus' RDP or PRV selectable. Every figure passes one check, `checked_epsilon` (finite, >= 0): where the
accountant gives no bound (it raises, or returns a negative, NaN or infinite epsilon, as Opacus 1.6's RDP and PRV
do at a large delta and huge noise) PLD's stands in (RDP's for PLD's overflow), with a warning, and
`accountant_used` names it and why; RDP's where PRV's multiplier is below 0.2. Beside them: the RDP bounds of
sampling without replacement (`fixed_size_epsilon`) and of DP-FTRL's trees (`tree_aggregation_rdp_epsilon`). The
ledgers (`dpcore.privacy.ledger`) keep the events; this module only composes them.
"""

from __future__ import annotations

import functools
import logging
import math
from logging import WARNING
from typing import Protocol

import numpy as np
from flwr.common import log

from dpfl.dpcore.task.opacus_import import import_opacus

DEFAULT_ACCOUNTANT = "pld"
MIN_SIGMA = 1e-12  # below: epsilon is infinite (Opacus' RDP divides by sigma^2)
NUMERIC_MIN_SIGMA = 0.2  # below it Opacus' PRV takes minutes and gigabytes (PLD took 110 s, 7.8 GB at 0.02 on 1e-3)
PLD_DISCRETIZATION = 1e-3  # dp-accounting's value_discretization_interval: within 1e-3 of 1e-4's epsilon, 10x faster
PLD_POINTS = 125_000  # grid points of one step's PLD at sigma 0.2 on PLD_DISCRETIZATION (about 1 MB): the most kept
PLD_TOLERANCE = 0.002  # a coarse grid's epsilon is kept once halving the interval moves it by less than this share
# below this composed multiplier (epsilon above about 5e5) float64 cannot hold the closed form's eps(delta): the grid
EXACT_GAUSSIAN_MIN_SIGMA = 1e-3

Event = tuple[float, float, int]


def epsilon_of(events: list[Event], delta: float, accountant: str = DEFAULT_ACCOUNTANT) -> float:
    """eps(delta) of a composition of sampled-Gaussian events; inf if any has sigma = 0. Composition is
    commutative, so the events are summed per (sigma, q) first: the same releases in any order print the
    same number (PLD's discretisation would otherwise differ in the sixth digit)."""
    return _bound(canonical(events), float(delta), accountant)[0]


def accountant_used(events: list[Event], delta: float, accountant: str) -> str:
    """Which accountant's bound `epsilon_of` gives for these events: the configured one, or RDP (and why)."""
    return _bound(canonical(events), float(delta), accountant)[1]


def canonical(events: list[Event]) -> tuple[Event, ...]:
    """The events with the steps of equal (sigma, q) summed, sorted."""
    steps: dict[tuple[float, float], int] = {}
    for sigma, q, n in events:
        if n > 0:
            key = (float(sigma), float(q))
            steps[key] = steps.get(key, 0) + int(n)
    return tuple((sigma, q, n) for (sigma, q), n in sorted(steps.items()))


class Accountant(Protocol):
    """An accountant of the registry: eps(delta) of a composition of Poisson-sampled Gaussian events
    (sigma, q, steps). `min_sigma`: the smallest multiplier it computes in bounded time and memory (below, RDP
    stands in)."""

    name: str
    min_sigma: float

    def epsilon(self, events: tuple[Event, ...], delta: float) -> float: ...


ACCOUNTANT_REGISTRY: dict[str, Accountant] = {}


def register_accountant(cls: type) -> type:
    """Class decorator: adds one instance of an accountant class to the registry under its `name`."""
    ACCOUNTANT_REGISTRY[cls.name] = cls()
    return cls


@register_accountant
class PLDAccountant:
    """dp-accounting's privacy-loss distributions (the tightest of the three; the default), on any sigma: the
    grid is coarsened where it would grow (`pld_intervals`); unsampled events need no grid (`gaussian_epsilon`)."""

    name, min_sigma = "pld", MIN_SIGMA

    def epsilon(self, events: tuple[Event, ...], delta: float) -> float:
        return _pld_epsilon(list(events), delta)


@register_accountant
class RDPAccountant:
    """Opacus' RDP accountant: what its RDPAccountant.get_privacy_spent computes, per-step RDP cached."""

    name, min_sigma = "rdp", MIN_SIGMA

    def epsilon(self, events: tuple[Event, ...], delta: float) -> float:
        import_opacus()
        from opacus.accountants import RDPAccountant as OpacusRDP
        from opacus.accountants.analysis import rdp as rdp_analysis

        rdp = sum(_rdp_per_step(sigma, q) * steps for sigma, q, steps in events)
        return _quiet(rdp_analysis.get_privacy_spent, orders=OpacusRDP.DEFAULT_ALPHAS, rdp=rdp, delta=delta)[0]


@register_accountant
class PRVAccountant:
    """Opacus' privacy random variables accountant (its grid is not ours to coarsen: RDP below sigma 0.2)."""

    name, min_sigma = "prv", NUMERIC_MIN_SIGMA

    def epsilon(self, events: tuple[Event, ...], delta: float) -> float:
        import_opacus()
        from opacus.accountants import PRVAccountant as OpacusPRV

        acc = OpacusPRV()
        acc.history = list(events)
        return _quiet(acc.get_epsilon, delta=delta)


ACCOUNTANTS = tuple(ACCOUNTANT_REGISTRY)  # the names a setting may take
FALLBACK_ACCOUNTANT = "rdp"  # below an accountant's min_sigma, and where PLD gives no bound


class AccountantError(ValueError):
    """An accountant gave no bound for a setting: it raised, or returned a negative, NaN or infinite epsilon
    for multipliers >= MIN_SIGMA. The message names the accountant and the setting."""


def setting_text(events: tuple[Event, ...], delta: float) -> str:
    """The setting an accountant was asked about, as its errors and warnings name it."""
    return " + ".join(f"(sigma={s:.6g}, q={q:.6g}, steps={n})" for s, q, n in events) + f" at delta={delta:.6g}"


def checked_epsilon(accountant: str, events: tuple[Event, ...], delta: float) -> float:
    """The registered accountant's eps(delta), checked: the one place every accountant's figure passes before a
    ledger prints it. It must be finite and >= 0 (the events asked about all have sigma >= MIN_SIGMA: no noise's
    infinite epsilon is decided before any accountant is asked); else AccountantError. Opacus 1.6's RDP and PRV
    return negative epsilons where delta is large and the noise huge (RDP -0.0052 at sigma 10, q 0.1, 1 step,
    delta 0.01; PRV -0.095 at sigma 50, q 0.1, 10 steps, delta 0.1); dp-accounting's PLD conversion can overflow
    to inf near eps ~ 700 (a run's log: epsilon_against_server 706, inf, inf, 727)."""
    try:
        eps = float(ACCOUNTANT_REGISTRY[accountant].epsilon(events, delta))
    except (ArithmeticError, ValueError) as exc:  # e.g. dp-accounting's math range error at sigma 1e-6
        lowest = min(sigma for sigma, _, _ in events)
        raise AccountantError(
            f"{accountant} failed at a noise multiplier of {lowest:.3g} charged: {type(exc).__name__}: {exc}"
        ) from exc
    if not (math.isfinite(eps) and eps >= 0):
        raise AccountantError(f"{accountant} returned epsilon {eps!r}, not a bound, for {setting_text(events, delta)}")
    return eps


@functools.lru_cache(maxsize=4096)
def _bound(events: tuple[Event, ...], delta: float, accountant: str) -> tuple[float, str]:
    """(eps(delta), the accountant that gave it, and why where it is not the configured one). Memoised (PRV
    evaluations are slow and many ledgers share histories). Where the configured accountant gives no bound
    (`checked_epsilon`), PLD's stands in, else RDP's, with a warning where a figure was returned that is no bound (an
    accountant that raised is named in the reason alone, as before); below the accountant's min_sigma RDP's,
    else PLD's. Each is a valid bound; AccountantError where none gives one."""
    if not events:
        return 0.0, accountant
    if any(sigma < MIN_SIGMA and q > 0 for sigma, q, _ in events):
        return math.inf, accountant  # (next to) no noise: Opacus' RDP would divide by zero
    events = tuple(e for e in events if e[1] > 0)
    if not events:
        return 0.0, accountant
    chosen = ACCOUNTANT_REGISTRY[accountant]
    lowest = min(sigma for sigma, _, _ in events)
    if lowest < chosen.min_sigma:
        # PRV's discretisation grows without bound as sigma -> 0: such compositions get RDP's bound. The
        # multiplier named is the one charged (under fixed-size sampling's replace-one relation, sigma / 2).
        why = [
            f"a noise multiplier of {lowest:.3g} charged, below {chosen.min_sigma}: {accountant} would need minutes "
            "and gigabytes"
        ]
        candidates = [FALLBACK_ACCOUNTANT, DEFAULT_ACCOUNTANT]
    else:
        why, candidates = [], [accountant, DEFAULT_ACCOUNTANT, FALLBACK_ACCOUNTANT]
    failed, refused = [], []
    for name in dict.fromkeys(candidates):
        try:
            eps = checked_epsilon(name, events, delta)
        except AccountantError as exc:
            failed.append(str(exc))
            refused += [str(exc)] if exc.__cause__ is None else []  # a figure returned that is no bound
            continue
        for reason in refused:
            log(WARNING, "%s: the epsilon printed is %s's bound instead", reason, name)
        return eps, name if name == accountant else f"{name} ({'; '.join(why + failed)})"
    raise AccountantError(f"no accountant gives a bound: {'; '.join(why + failed)}")


def pld_intervals(events: tuple[Event, ...]) -> list[float]:
    """The value_discretization_intervals `_pld_epsilon` may use, coarsest first, halved down to PLD_DISCRETIZATION.

    Where every multiplier is >= 0.2 (NUMERIC_MIN_SIGMA) it is PLD_DISCRETIZATION alone. Below, the coarsest keeps
    the grid near PLD_POINTS points: a Gaussian's privacy loss at multiplier s spans about W(s) = 1/s^2 + 20/s
    (dp-accounting truncates at about 10 standard deviations), k Poisson-sampled steps widen it by about
    sqrt(1 + k q), k unsampled ones compose to one Gaussian at s / sqrt(k); the interval is max(1e-3, max W /
    PLD_POINTS). A coarser grid gives a larger pessimistic estimate, still an upper bound."""
    if min(sigma for sigma, _, _ in events) >= NUMERIC_MIN_SIGMA:
        return [PLD_DISCRETIZATION]

    def width(sigma: float, q: float, steps: int) -> float:
        s = sigma / math.sqrt(steps) if q >= 1 else sigma
        return (s**-2 + 20 / s) * (1.0 if q >= 1 else math.sqrt(1 + steps * q))

    intervals = [max(PLD_DISCRETIZATION, max(width(*e) for e in events) / PLD_POINTS)]
    while intervals[-1] > PLD_DISCRETIZATION:
        intervals.append(max(PLD_DISCRETIZATION, intervals[-1] / 2))
    return intervals


def _pld_epsilon(events: list[Event], delta: float) -> float:
    """`gaussian_epsilon` where no event is sampled (q = 1) and the composition is not too sharp for it; else
    dp-accounting's PLD (pessimistic estimate) of the composed Poisson-subsampled Gaussian events, on the grids
    of `pld_intervals` from the coarsest, each halving the last, until the estimate moves by less than
    PLD_TOLERANCE (or the grid is PLD_DISCRETIZATION): within about that share of the finest grid's bound, in
    seconds where the finest grid would take minutes and gigabytes. A grid is kept at once where it provably is
    within that share: pessimistic rounding raises each of the n PLDs composed (one per sampled step, one per
    Gaussian) by less than the interval, so epsilon by less than n times it."""
    if all(q >= 1 for _, q, _ in events) and composed_sigma(events) >= EXACT_GAUSSIAN_MIN_SIGMA:
        eps = gaussian_epsilon(events, delta)
        if eps is not None:
            return eps
    composed = sum(1 if q >= 1 else steps for _, q, steps in events)
    last = math.inf
    for interval in pld_intervals(tuple(events)):
        eps = _pld_epsilon_on(tuple(events), delta, interval)
        if composed * interval <= PLD_TOLERANCE * eps or abs(last - eps) <= PLD_TOLERANCE * eps:
            break
        last = eps
    return eps


def composed_sigma(events: list[Event]) -> float:
    """The multiplier of the one Gaussian mechanism that k_i releases at multipliers sigma_i compose to:
    (sum_i k_i / sigma_i^2)^(-1/2) (Gaussian DP: mu-GDP mechanisms compose to sqrt(sum mu_i^2)-GDP, Dong, Roth and
    Su, "Gaussian Differential Privacy", arXiv 1905.02383, Corollary 3.3; mu = 1 / sigma)."""
    return sum(steps / sigma**2 for sigma, _, steps in events) ** -0.5


def gaussian_epsilon(events: list[Event], delta: float) -> float | None:
    """Exact eps(delta) of unsampled events (q = 1), from above: their composition is one Gaussian mechanism at
    s = `composed_sigma`, whose privacy loss dp-accounting's GaussianPrivacyLoss knows in closed form,
    delta(eps) = Phi(1/(2s) - eps s) - e^eps Phi(-1/(2s) - eps s) (Balle and Wang, "Improving the Gaussian
    Mechanism for Differential Privacy", arXiv 1805.06530, Theorem 8), inverted by dp-accounting's bisection
    below the classical bound B = mu^2/2 + mu sqrt(2 ln(1/delta)) (mu = 1/s), at most 1e-9 B above the exact eps: no
    grid, a few milliseconds where the PLD's grid took 0.1 to 0.2 s. None where float64 cannot confirm
    delta(eps) <= delta."""
    from dp_accounting.pld.common import BinarySearchParameters, inverse_monotone_function
    from dp_accounting.pld.privacy_loss_mechanism import GaussianPrivacyLoss

    sigma = composed_sigma(events)
    upper = sigma**-2 / 2 + math.sqrt(2 * max(0.0, math.log(1 / delta))) / sigma
    loss = GaussianPrivacyLoss(standard_deviation=sigma, sensitivity=1.0)
    search = BinarySearchParameters(lower_bound=0.0, upper_bound=upper, tolerance=1e-9 * upper)
    eps = inverse_monotone_function(loss.get_delta_for_epsilon, delta, search)
    return eps if eps is not None and loss.get_delta_for_epsilon(eps) <= delta else None


def _pld_epsilon_on(events: tuple[Event, ...], delta: float, interval: float) -> float:
    """What dp-accounting's `PLDAccountant(value_discretization_interval=interval)` computes for the events, with
    each (sigma, q)'s one-step PLD built once per process (`_sampled_gaussian_pld`: building it is most of the
    cost, and a run asks after every round)."""
    from dp_accounting.pld import privacy_loss_distribution as pld_lib

    logging.getLogger("absl").setLevel(logging.ERROR)
    total = pld_lib.identity(value_discretization_interval=interval)
    for sigma, q, steps in events:
        if q >= 1:  # k Gaussian releases compose exactly to one at sigma / sqrt(k)
            part = pld_lib.from_gaussian_mechanism(
                standard_deviation=sigma / math.sqrt(steps), value_discretization_interval=interval
            )
        else:
            part = _sampled_gaussian_pld(sigma, q, interval).self_compose(steps)
        total = total.compose(part)
    return float(total.get_epsilon_for_delta(delta))


@functools.lru_cache(maxsize=32)
def _sampled_gaussian_pld(sigma: float, q: float, interval: float):
    """One step of the Poisson-subsampled Gaussian (add/remove-one) as a dp-accounting PLD. Up to about 1 MB
    each (PLD_POINTS), so few are kept: a run uses a handful of (sigma, q); a calibration's probes pass through."""
    from dp_accounting.pld import privacy_loss_distribution as pld_lib

    return pld_lib.from_gaussian_mechanism(
        standard_deviation=sigma, sampling_prob=q, value_discretization_interval=interval
    )


def _quiet(fn, *args, **kwargs):
    """Call an accountant without its library warnings (e.g. Opacus' "optimal order is the smallest alpha"):
    they name no action the user can take, and the epsilon returned is a valid bound either way."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


@functools.lru_cache(maxsize=1024)
def _rdp_per_step(noise_multiplier: float, sample_rate: float):
    """RDP of one sampled-Gaussian step at Opacus' default orders (RDP composes additively)."""
    import_opacus()
    from opacus.accountants import RDPAccountant as OpacusRDP
    from opacus.accountants.analysis import rdp as rdp_analysis

    rdp = _quiet(
        rdp_analysis.compute_rdp,
        q=sample_rate,
        noise_multiplier=noise_multiplier,
        steps=1,
        orders=OpacusRDP.DEFAULT_ALPHAS,
    )
    rdp.setflags(write=False)
    return rdp


WorEvent = tuple[float, int, int, int]  # (multiplier w.r.t. the replace-one sensitivity, population N, sample m, steps)


def fixed_size_epsilon(events: list[WorEvent], delta: float) -> float:
    """eps(delta) of a composition of Gaussian mechanisms on m of N sampled without replacement, under the
    replace-one relation: dp-accounting's RDP of `SampledWithoutReplacementDpEvent` (Wang, Balle and
    Kasiviswanathan, AISTATS 2019, Theorem 27) with `NeighboringRelation.REPLACE_ONE`, the multiplier taken
    relative to the replace-one sensitivity (2C for a sum of updates clipped to C). A valid upper bound."""
    steps: dict[tuple[float, int, int], int] = {}
    for sigma, population, sample, n in events:
        if n > 0:
            key = (float(sigma), int(population), int(sample))
            steps[key] = steps.get(key, 0) + int(n)
    return _fixed_size_epsilon(tuple(sorted((s, p, m, n) for (s, p, m), n in steps.items())), float(delta))


@functools.lru_cache(maxsize=1024)
def _fixed_size_epsilon(events: tuple[WorEvent, ...], delta: float) -> float:
    from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

    if not events:
        return 0.0
    if any(sigma < MIN_SIGMA for sigma, _, _, _ in events):
        return math.inf
    rdp = sum(_wor_rdp_per_step(sigma, population, sample) * n for sigma, population, sample, n in events)
    return max(0.0, float(rdp_lib.compute_epsilon(rdp_lib.DEFAULT_RDP_ORDERS, rdp, delta)[0]))


@functools.lru_cache(maxsize=256)
def _wor_rdp_per_step(sigma: float, population: int, sample: int):
    """Per-step replace-one RDP of the Gaussian on m of N without replacement, at dp-accounting's default orders
    (0.2-0.6 s each, so built once per (sigma, N, m); RDP composes additively)."""
    from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

    logging.getLogger("absl").setLevel(logging.ERROR)
    rdp = np.asarray(
        rdp_lib._compute_rdp_sample_wor_gaussian(min(1.0, sample / population), sigma, rdp_lib.DEFAULT_RDP_ORDERS),
        dtype=float,
    )
    rdp.setflags(write=False)
    return rdp


Tree = tuple[float, int]  # (noise multiplier of each node, steps of the tree)


def tree_aggregation_rdp_epsilon(trees: list[Tree], delta: float) -> float:
    """eps(delta) of DP-FTRL's trees, each a `SingleEpochTreeAggregationDpEvent(sigma, steps)` (every client in at
    most one leaf of each tree: Kairouz et al., arXiv 2103.00039, Appendix D), composed by dp-accounting's
    `RdpAccountant` under its `REPLACE_SPECIAL` relation (a client's contributions replaced by zero)."""
    return _tree_rdp_epsilon(tuple((float(s), int(n)) for s, n in trees if n > 0), float(delta))


@functools.lru_cache(maxsize=1024)
def _tree_rdp_epsilon(trees: tuple[Tree, ...], delta: float) -> float:
    import dp_accounting
    from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

    if not trees:
        return 0.0
    if any(sigma < MIN_SIGMA for sigma, _ in trees):
        return math.inf
    accountant = rdp_lib.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_SPECIAL)
    accountant.compose(
        dp_accounting.ComposedDpEvent(
            [dp_accounting.SingleEpochTreeAggregationDpEvent(sigma, steps) for sigma, steps in trees]
        )
    )
    return max(0.0, float(accountant.get_epsilon(delta)))


def tree_gaussian_multiplier(trees: list[Tree]) -> float:
    """The multiplier of the one Gaussian mechanism the trees amount to: a client's leaf moves at most
    ceil(log2(steps + 1)) released nodes of a tree by up to C each, every node with its own N(0, sigma^2 C^2),
    so the trees compose (adaptively, Gaussian mechanisms compose exactly) to (sum_j depth_j / sigma_j^2)^(-1/2)."""
    load = sum((int(steps).bit_length()) / sigma**2 for sigma, steps in trees if steps > 0 and sigma >= MIN_SIGMA)
    if any(sigma < MIN_SIGMA for sigma, steps in trees if steps > 0):
        return 0.0
    return math.inf if load == 0 else load**-0.5
