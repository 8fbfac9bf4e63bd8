"""Google's dp-accounting as the independent check on every epsilon the ledger prints."""

import logging
import math

import dp_accounting
from dp_accounting import pld, rdp

logging.getLogger("absl").setLevel(logging.ERROR)


def dp_accounting_epsilons(sigma: float, q: float, steps: int, delta: float) -> tuple[float, float]:
    """(PLD epsilon, RDP epsilon) of `steps` Poisson-sampled Gaussian events with (sigma, q)."""
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps
    )
    pld_acc = pld.PLDAccountant(value_discretization_interval=1e-4)
    pld_acc.compose(event)
    rdp_acc = rdp.RdpAccountant()
    rdp_acc.compose(event)
    return pld_acc.get_epsilon(delta), rdp_acc.get_epsilon(delta)


def gaussian_delta(mu: float, eps: float) -> float:
    """delta(eps) of the mu-GDP Gaussian mechanism, written out here with scipy (not dp-accounting):
    Phi(mu/2 - eps/mu) - e^eps Phi(-mu/2 - eps/mu), the second term in logs (e^eps overflows past eps 709)."""
    from scipy.special import log_ndtr, ndtr

    return float(ndtr(mu / 2 - eps / mu) - math.exp(eps + log_ndtr(-mu / 2 - eps / mu)))
