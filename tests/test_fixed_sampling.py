"""Fixed-size client sampling (issue 27, item 1): the ledger prints the smaller of two valid upper bounds, the
Gaussian mechanism at sigma / 2 without amplification and dp-accounting's replace-one RDP of sampling without
replacement, each checked against dp-accounting used directly, and never below the worst-pair lower bound."""

import logging

import dp_accounting
import numpy as np
import pytest
from dp_accounting import pld, rdp
from flwr.app import Array, ArrayRecord

from dpfl.dpcore.privacy.ledger import ClientLevelLedger
from dpfl.strategies import DifferentialPrivacy
from dpfl_tools.inprocess import InProcessGrid
from tests.test_accounting import worst_pair_lower_bound
from tests.test_wrapper import weights_client

logging.getLogger("absl").setLevel(logging.ERROR)


def without_replacement(population: int, m: int, sigma: float, rounds: int, delta: float) -> float:
    """dp-accounting directly: replace-one RDP of the Gaussian (multiplier sigma / 2 of the sensitivity 2C) on m of
    N sampled without replacement, composed over the rounds."""
    acc = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    acc.compose(
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.SampledWithoutReplacementDpEvent(population, m, dp_accounting.GaussianDpEvent(sigma / 2)),
            rounds,
        )
    )
    return acc.get_epsilon(delta)


def unamplified(sigma: float, rounds: int, delta: float) -> float:
    acc = pld.PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(dp_accounting.GaussianDpEvent(sigma / 2), rounds)
    return acc.get_epsilon(delta)


def fixed_ledger(population: int, m: int, rounds: int, delta: float, sigma: float = 1.0) -> ClientLevelLedger:
    ledger = ClientLevelLedger(delta, client_sampling="fixed")
    for _ in range(rounds):
        ledger.record_round(sigma, m / population, m, sampled_from=(population, m))
    return ledger


@pytest.mark.slow
@pytest.mark.parametrize(
    "population,m,rounds,printed_before,wor,gauss",
    [
        (100, 10, 100, 284.0, 83.94, 284.0),  # sampling without replacement is the smaller bound
        (50, 25, 30, 105.9, 110.41, 105.9),  # no amplification is the smaller bound: it stays
    ],
)
def test_the_smaller_of_two_valid_bounds_each_against_dp_accounting(population, m, rounds, printed_before, wor, gauss):
    delta = 1e-5
    ledger = fixed_ledger(population, m, rounds, delta)
    independent_wor = without_replacement(population, m, 1.0, rounds, delta)
    independent_gauss = unamplified(1.0, rounds, delta)
    assert independent_wor == pytest.approx(wor, abs=0.01)
    assert independent_gauss == pytest.approx(gauss, rel=0.005)
    assert ledger.epsilon() == pytest.approx(min(independent_wor, independent_gauss), rel=0.01)
    assert ledger.epsilon() <= printed_before * 1.01
    assert ledger.epsilon() >= worst_pair_lower_bound(population, m, 1.0, rounds, delta)
    expected_by = "rdp-sampled-without-replacement" if independent_wor < independent_gauss else "pld"
    assert ledger.state_dict()["model_bound_by"].startswith(expected_by)


@pytest.mark.parametrize("population,m,rounds", [(6, 3, 1), (20, 2, 50), (1000, 10, 300)])
def test_never_below_the_worst_pair_lower_bound(population, m, rounds):
    delta = 1 / population if population < 100 else 1e-5
    assert fixed_ledger(population, m, rounds, delta).epsilon() >= worst_pair_lower_bound(
        population, m, 1.0, rounds, delta
    )


@pytest.mark.slow  # 2-9 s together: the fast tier keeps its 5-minute margin on 2 cores
def test_a_round_without_its_sampling_record_falls_back_to_no_amplification():
    ledger = fixed_ledger(100, 10, 20, 1e-5)
    ledger.record_round(1.0, 0.1, 10)  # N and m unknown (e.g. a caller that did not pass them)
    assert ledger.epsilon() == pytest.approx(unamplified(1.0, 21, 1e-5), rel=0.01)


def test_state_round_trip_and_budget_projection():
    ledger = fixed_ledger(100, 10, 40, 1e-5)
    back = ClientLevelLedger.from_state_dict(ledger.state_dict(), ledger.server_view)
    assert back.epsilon() == ledger.epsilon()
    projected = ledger.epsilon_after_rounds(1.0, 0.1, 60)
    assert projected == pytest.approx(without_replacement(100, 10, 1.0, 100, 1e-5), rel=0.01)


def test_the_wrapper_records_each_rounds_population_and_sample():
    strategy = DifferentialPrivacy(
        clipping_norm=1.0,
        noise_multiplier=1.0,
        sample_rate=0.2,
        client_sampling="fixed",
        min_available_nodes=10,
        noise_placement="central",
        delta=1e-5,
    )
    grid = InProcessGrid(weights_client(), 10, {})
    strategy.start(grid, ArrayRecord({"w": Array(np.zeros(8, np.float32))}), num_rounds=3)
    assert strategy.ledger.fixed_rounds == [(0.5, 10, 2, 3)]
    assert strategy.record.history[-1]["epsilon"] == pytest.approx(
        min(without_replacement(10, 2, 1.0, 3, 1e-5), unamplified(1.0, 3, 1e-5)), rel=0.01
    )


def test_a_resumed_fixed_size_run_has_the_q_of_its_population():
    """m given (Flower's num_sampled_clients): q = m / M is fixed with the population, and a run resumed from its
    checkpoint has it again (summary.json's client_sampling_rate), not the constructor's placeholder 1.0."""
    from dpfl import DifferentialPrivacy

    first = DifferentialPrivacy(None, 1.0, 1.0, 3)
    first.setup_population(10)
    resumed = DifferentialPrivacy(None, 1.0, 1.0, 3)
    resumed.load_state_dict(first.state_dict())
    assert first.population.sample_rate == resumed.population.sample_rate == 0.3
    assert resumed.population.expected_clients == 3.0 and resumed.population.num_clients == 10
