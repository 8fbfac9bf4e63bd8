"""The selection part says what the ledger charges of its sampling (issue 41, the ledger asks the parts): the
client-level ledger reads a `SamplingForm` (Poisson or fixed-size), never compares the sampling's name."""

import pytest

from dpfl.dpcore.privacy.ledger import ClientLevelLedger
from dpfl.dpcore.privacy.modes import SAMPLING_FORMS, SamplingForm
from dpfl.strategies.dp_fedavg import DPFedAvg
from dpfl.strategies.parts.sampling import ClientSampling
from tests.independent_accountant import dp_accounting_epsilons

DELTA, SIGMA, Q, ROUNDS = 1e-5, 2.0, 0.1, 20


def charged(ledger: ClientLevelLedger) -> ClientLevelLedger:
    for _ in range(ROUNDS):
        ledger.record_round(SIGMA, Q, 10)
    return ledger


@pytest.mark.parametrize("fixed_size, sigma, q", [(True, SIGMA / 2, 1.0), (False, SIGMA, Q)])
def test_the_ledger_charges_the_form_it_is_given_whatever_its_name(fixed_size, sigma, q):
    """A form named neither 'poisson' nor 'fixed': fixed-size is charged (sigma / 2, q = 1), Poisson (sigma, q),
    each against dp-accounting directly."""
    ledger = charged(ClientLevelLedger(DELTA, sampling=SamplingForm("toy", fixed_size=fixed_size)))
    assert ledger.release_event(SIGMA, Q) == (sigma, q)
    assert ledger.client_sampling == "toy" and ledger.state_dict()["client_sampling"] == "toy"
    independent = dp_accounting_epsilons(sigma, q, ROUNDS, DELTA)[0]
    assert ledger.epsilon() == pytest.approx(independent, rel=0.02)


def test_the_selection_part_supplies_the_form_the_wrapper_s_ledger_charges():
    assert ClientSampling("fixed").sampling_form == SamplingForm("fixed", fixed_size=True)
    assert ClientSampling().sampling_form == SamplingForm("poisson", fixed_size=False)
    for sampling in ("fixed", "poisson"):
        dp = DPFedAvg(sample_rate=Q, clipping_norm=1.0, noise_multiplier=SIGMA, client_sampling=sampling)
        dp.selection.sampling_form = SamplingForm("toy", fixed_size=sampling == "poisson")  # the part decides
        ledger = dp.mechanism.make_ledger(dp, DELTA)
        assert ledger.sampling is dp.selection.sampling_form
        assert ledger.release_event(SIGMA, Q) == ((SIGMA / 2, 1.0) if sampling == "poisson" else (SIGMA, Q))


@pytest.mark.parametrize("name", ["fixed", "poisson"])
def test_a_saved_ledger_reads_back_with_its_form(name):
    ledger = charged(ClientLevelLedger(DELTA, sampling=SAMPLING_FORMS[name]))
    restored = ClientLevelLedger.from_state_dict(ledger.state_dict(), ledger.server_view)
    assert restored.sampling == SAMPLING_FORMS[name] and restored.epsilon() == ledger.epsilon()
    state = ledger.state_dict()
    del state["client_sampling"]  # a state saved before the key was recorded: Poisson
    assert ClientLevelLedger.from_state_dict(state, ledger.server_view).sampling == SAMPLING_FORMS["poisson"]
    assert ClientLevelLedger(DELTA, client_sampling=name).sampling == SAMPLING_FORMS[name]  # by its name
