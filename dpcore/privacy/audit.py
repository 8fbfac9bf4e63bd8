"""One-shot empirical privacy estimation with canary clients (docs/algorithms.md §7).

Andrew et al., "One-shot Empirical Privacy Estimation for Federated Learning" (ICLR 2024,
arXiv 2302.03098). K canary clients join the run: canary i has a secret random unit direction
u_i and, whenever it is sampled (like a real client, probability q per round), contributes the
update C * u_i to the sum that is then noised and released. K' more directions are drawn and never
inserted. After the last round, with Delta = w_final - w_initial:

    observed cosines  cos(Delta, u_i), i inserted       mean mu_1
    null cosines      cos(Delta, u_j), j never inserted  mean mu_0, standard deviation s_0 (~ 0, 1/sqrt(d))

The Gaussian mechanism shifts a canary's cosine without changing its spread (in high dimension), so the
estimate is the epsilon at the run's delta of mu-GDP with mu = (mu_1 - mu_0) / s_0 (`gdp_epsilon`). With K
canaries the estimate has sampling error (standard error of mu, by the delta method, sqrt((s_1^2/K + s_0^2/K')
/ s_0^2 + mu^2 / (2 (K' - 1))): the means' error and that of s_0): `epsilon_lower_bound` is the epsilon at mu
minus 3.09 standard errors, a one-sided 99.9% bound: a run whose bound exceeds its accounted epsilon leaks
more than it claims. (Fitting a separate spread to the observed cosines, which also vary with how often each
canary was sampled, made the estimate overshoot the accounted epsilon at delta = 1e-5 in our checks: its tail
is driven by the error of the fitted spread.) One run, no retraining: an estimate of what an adversary who
sees only the final model can learn about one client, to put beside the accounted epsilon (an upper bound).
A mechanism that leaks more than it claims (no noise, or the paper-calibrated wavelet noise) audits
far above its claim; an honest Gaussian run audits below its accounted epsilon.
"""

from __future__ import annotations

import math
import secrets

import numpy as np
import pywt

from .mechanisms import haar_padded_size

CANARY_KINDS = ("isotropic", "smooth")
LOWER_BOUND_CONFIDENCE = 0.999  # epsilon_lower_bound: the estimate at mu - z * standard error, one-sided
LOWER_BOUND_Z = 3.0902
SMOOTH_BLOCK = 16  # `smooth` canaries: Haar coefficients whose block is >= 16 entries (the coarsest n/16)


def canary_direction(seed: int, index: int, dim: int, kind: str = "isotropic") -> np.ndarray:
    """u_index, regenerated from (seed, index): a uniformly random unit vector in R^dim (`isotropic`, the
    paper's canaries), or one uniformly random in the span of the coarsest Haar basis vectors (`smooth`:
    slowly varying directions, where noise that is weak along smooth directions shows)."""
    rng = np.random.default_rng([seed, index])
    if kind == "isotropic":
        v = rng.standard_normal(dim)
    else:
        n = haar_padded_size(dim)
        levels = int(math.log2(n))
        coeffs = pywt.wavedec(np.zeros(n), "haar", level=levels)
        for c in coeffs[: max(1, levels - int(math.log2(SMOOTH_BLOCK)) + 1)]:
            c[:] = rng.standard_normal(c.size)
        v = pywt.waverec(coeffs, "haar")[:dim]
    return (v / np.linalg.norm(v)).astype(np.float32)


def new_canary_seed() -> int:
    """A secret seed for the canary directions (OS entropy: the clients cannot aim at them)."""
    return secrets.randbits(63)


def gdp_epsilon(mu: float, delta: float) -> float:
    """epsilon(delta) of mu-Gaussian DP (the Gaussian mechanism with sensitivity / noise std = mu):
    the root of delta = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2) (Dong, Roth and Su, Cor. 2.13)."""
    from scipy import optimize, stats

    if mu <= 0:
        return 0.0
    if mu > 37:  # Phi underflows: the two Gaussians do not overlap at any useful delta
        return math.inf

    def excess(eps: float) -> float:
        # e^eps Phi(x) as exp(eps + log Phi(x)): e^eps alone overflows past eps ~ 709 (mu ~ 32)
        return stats.norm.cdf(-eps / mu + mu / 2) - math.exp(eps + stats.norm.logcdf(-eps / mu - mu / 2)) - delta

    if excess(0.0) <= 0:
        return 0.0
    hi = 1.0
    while excess(hi) > 0:
        hi *= 2
    return float(optimize.brentq(excess, 0.0, hi, xtol=1e-6))


def audit_epsilon(
    final_delta: np.ndarray, seed: int, inserted: int, held_out: int, delta: float, kind: str = "isotropic"
) -> dict:
    """The one-shot estimate from the final model delta: cosines with the inserted canaries (indices
    0 .. inserted-1) and with the never-inserted ones (indices inserted .. inserted+held_out-1)."""
    v = np.asarray(final_delta, dtype=np.float64)
    norm = float(np.linalg.norm(v))
    dim = v.size
    cosines = np.array(
        [
            float(np.dot(v, canary_direction(seed, i, dim, kind))) / norm if norm > 0 else 0.0
            for i in range(inserted + held_out)
        ]
    )
    observed, null = cosines[:inserted], cosines[inserted:]
    mu_1, s_1 = float(observed.mean()), float(observed.std(ddof=1))
    mu_0, s_0 = float(null.mean()), float(max(null.std(ddof=1), 1e-12))
    shift = (mu_1 - mu_0) / s_0
    # of the shift, by the delta method: the means' error, plus that of s_0 itself (var(s_0) ~ s_0^2 / (2 (K' - 1))),
    # which leaving out understated the spread of the shift (seen: 0.21 stated, 0.30 over 150 runs of 50 canaries)
    standard_error = math.sqrt((s_1**2 / inserted + s_0**2 / held_out) / s_0**2 + shift**2 / (2 * (held_out - 1)))
    lower = max(0.0, shift - LOWER_BOUND_Z * standard_error)
    return {
        "epsilon_estimate": gdp_epsilon(shift, delta),
        "gdp_mu": shift,
        "delta": delta,
        "gdp_mu_standard_error": standard_error,
        "epsilon_lower_bound": gdp_epsilon(lower, delta),
        "lower_bound_confidence": LOWER_BOUND_CONFIDENCE,
        "canaries_inserted": inserted,
        "canaries_held_out": held_out,
        "canary_kind": kind,
        "observed_cosine_mean": mu_1,
        "observed_cosine_std": s_1,
        "null_cosine_mean": mu_0,
        "null_cosine_std": s_0,
        "dimension": dim,
        "method": "one-shot empirical estimate, Andrew et al. (ICLR 2024, arXiv 2302.03098)",
    }
