"""The budget under a population that changes between rounds (issue 35, items 1 and 2).

1. Fixed-size sampling whose population shrinks from 100 to 11 before round 20 (sigma 2, m = 10, target 6.091):
   round 20 at (N, m) = (11, 10) would print 8.118, so it is refused before anything is sent, and every printed
   epsilon stays under the target; the same through the legacy adapter.
2. Poisson sampling with distributed noise whose population grows from 20 to 60: n_s is re-derived for each
   round's population, so the truncation reserve stays <= 1e-12 a round and epsilon is finite and equals
   dp-accounting's figure for what was sent (each client's noise std sigma C / sqrt(n_s) of its round).
"""

import math

import pytest
from flwr.app import ArrayRecord, MessageType
from flwr.client import NumPyClient
from flwr.clientapp import ClientApp
from scipy.stats import binom
from torch import nn

from dpfl.clients.mods import make_dp_privatize_mod
from dpfl.dpcore.privacy import protocol as keys
from dpfl.dpcore.task.torch_helpers import get_weights
from dpfl.strategies import DifferentialPrivacy
from dpfl.strategies.legacy.adapter import LegacyDPFedAvg
from dpfl_tools.inprocess import InProcessGrid
from tests.independent_accountant import dp_accounting_epsilons
from tests.stub_clients import stub_app, zero_update
from tests.test_fixed_sampling import unamplified, without_replacement


class ChangingGrid(InProcessGrid):
    """`sizes[r]` nodes are connected from round r on (the first of them); round r is the one after the last
    finished round (`finished`, set by the strategy's on_round_end)."""

    def __init__(self, client_app, sizes: dict[int, int]) -> None:
        super().__init__(client_app, max(sizes.values()), {})
        self.sizes = sizes
        self.finished = 0

    def get_node_ids(self):
        size = self.sizes[max(r for r in self.sizes if r <= self.finished + 1)]
        return list(self.contexts)[:size]

    def round_ended(self, published: dict, diagnostics: dict) -> None:
        self.finished = int(published["round"])


def model() -> ArrayRecord:
    return ArrayRecord(get_weights(nn.Linear(4, 2)))


SHRINK = {1: 100, 20: 11}  # the case: sigma 2, q 0.1 (m = 10), target 6.091
TARGET = 6.091


def shrinking_strategy(grid: ChangingGrid) -> DifferentialPrivacy:
    return DifferentialPrivacy(
        clipping_norm=1.0,
        noise_multiplier=2.0,
        sample_rate=0.1,
        client_sampling="fixed",
        noise_placement="central",
        delta=1e-5,
        target_epsilon=TARGET,
        on_round_end=grid.round_ended,
    )


@pytest.mark.slow  # 2-9 s together: the fast tier keeps its 5-minute margin on 2 cores
def test_a_shrinking_population_cannot_push_epsilon_past_the_target():
    grid = ChangingGrid(stub_app(zero_update, 4, 2), SHRINK)
    strategy = shrinking_strategy(grid)
    strategy.start(grid, model(), num_rounds=30)
    printed = [r["epsilon"] for r in strategy.record.history]
    assert len(printed) == 19 and max(printed) <= TARGET
    assert printed[-1] == pytest.approx(min(without_replacement(100, 10, 2.0, 19, 1e-5), unamplified(2.0, 19, 1e-5)))
    assert printed[-1] == pytest.approx(5.935, abs=1e-3)
    # round 20 at (100, 10) would have stayed under the target (6.085); at its own (11, 10) it is 8.118
    assert strategy.ledger.epsilon_after_rounds(2.0, 0.1, 1, sampled_from=(100, 10)) == pytest.approx(6.085, abs=1e-3)
    assert strategy.ledger.epsilon_after_rounds(2.0, 0.1, 1, sampled_from=(11, 10)) == pytest.approx(8.118, abs=1e-3)
    assert strategy.record.stop_reason == f"target epsilon {TARGET} reached: round 20 would spend more"
    train = [m for m in grid.sent if m.metadata.message_type == MessageType.TRAIN]
    assert len(train) == 19 * 10  # nothing of round 20 was sent
    assert strategy.ledger.fixed_rounds == [(1.0, 100, 10, 19)]


class Unchanged(NumPyClient):
    def fit(self, parameters, config):
        return parameters, 1, {}


def test_a_shrinking_population_cannot_push_epsilon_past_the_target_through_the_legacy_adapter():
    app = ClientApp(client_fn=lambda context: Unchanged().to_client(), mods=[make_dp_privatize_mod(seed=0)])
    grid = ChangingGrid(app, SHRINK)
    dp = shrinking_strategy(grid)  # the same DP strategy, driven through Flower's legacy workflow
    legacy = LegacyDPFedAvg(dp)
    legacy.start(grid, model(), num_rounds=22)
    printed = [r["epsilon"] for r in legacy.record.history]
    assert len(printed) == 19 and max(printed) <= TARGET
    assert printed[-1] == pytest.approx(5.935, abs=1e-3)
    assert legacy.record.stop_reason == f"target epsilon {TARGET} reached: round 20 would spend more"
    assert len(grid.sent) == 19 * 10  # nothing of round 20 (nor of 21, 22) was sent


def noise_shares(population: int, q: float) -> int:
    """n_s independently: the smallest n with P(Binomial(N, q) >= n) <= 1e-12, else N + 1."""
    return next((n for n in range(1, population + 1) if binom.sf(n - 1, population, q) <= 1e-12), population + 1)


@pytest.mark.slow
def test_a_growing_population_keeps_a_finite_epsilon_with_distributed_noise():
    sigma, clip, q, delta = 1.0, 0.5, 0.5, 1e-5
    sizes = {1: 20, 3: 60}
    grid = ChangingGrid(stub_app(zero_update, 4, 2), sizes)
    strategy = DifferentialPrivacy(
        clipping_norm=clip,
        noise_multiplier=sigma,
        sample_rate=q,
        client_sampling="poisson",
        noise_placement="distributed",
        delta=delta,
        on_round_end=grid.round_ended,
    )
    strategy.start(grid, model(), num_rounds=4)
    populations = [20, 20, 60, 60]
    shares = [noise_shares(n, q) for n in populations]
    assert shares[0] == 21 and shares[2] < 60  # 21 shares would be truncated with probability 0.993 at 60 nodes
    assert binom.sf(21 - 1, 60, q) == pytest.approx(0.993, abs=1e-3)
    truncation = 0.0
    for rnd, (n, n_s) in enumerate(zip(populations, shares), start=1):
        truncation += binom.sf(n_s - 1, n, q)
        printed = strategy.record.history[rnd - 1]["epsilon"]
        assert math.isfinite(printed), (rnd, printed, strategy.ledger.truncation_delta)
        assert printed == pytest.approx(dp_accounting_epsilons(sigma, q, rnd, delta - truncation)[0], rel=1e-3)
    assert strategy.ledger.truncation_delta == pytest.approx(truncation, rel=1e-9)
    assert truncation <= 4e-12
    # each round's clients were sent the noise std of their round's n_s
    for rnd, n_s in enumerate(shares, start=1):
        stds = {
            m.content["config"][keys.NOISE_STD]
            for m in grid.sent
            if m.metadata.message_type == MessageType.TRAIN and m.content["config"][keys.SERVER_ROUND] == rnd
        }
        assert len(stds) == 1 and stds.pop() == pytest.approx(sigma * clip / math.sqrt(n_s), rel=1e-12)
