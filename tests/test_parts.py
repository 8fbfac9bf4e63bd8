"""A part added from outside the wrapper's files (docs/architecture.md, "Adding a part"): a toy part and its
settings, defined here only, run through a short in-process run. Nothing in strategies/ knows it exists."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg

from dpfl.dpcore.privacy.settings import SettingError, require
from dpfl.strategies import DifferentialPrivacy
from dpfl.strategies.loop.options import PrivacyOptions, RunOptions, SamplingOptions
from dpfl.strategies.parts.part import AfterRound, Part
from dpfl.strategies.parts.reply_rules import MetricRule
from dpfl_tools.inprocess import InProcessGrid

TOY_SHIFT, TOY_ECHO = "toy-shift", "toy-echo"


@dataclass(frozen=True)
class ToySettings:
    """The toy part's settings: how far every client moves each weight."""

    shift: float = 0.25


class ToyShift(Part):
    """Tells the clients a shift (client config), refuses a reply that does not echo it (reply problem), and
    publishes the shift summed over the rounds so far (after-round, published keys). A number from the settings
    only, so publishing it costs no privacy."""

    keyword = "toy_shift"
    published_keys = frozenset({"toy_shift_total"})
    reply_rules = {TOY_ECHO: MetricRule(required=True)}

    def __init__(self, settings: ToySettings) -> None:
        self.settings = settings
        self.total = 0.0

    def check(self, privacy, others: frozenset[str]) -> None:
        require(self.settings.shift >= 0, "toy_shift", self.settings.shift, "must be >= 0")

    def client_config(self, dp, server_round: int) -> dict:
        return {TOY_SHIFT: self.settings.shift}

    def reply_problem(self, dp, metrics: dict) -> str | None:
        return None if metrics[TOY_ECHO] == self.settings.shift else f"echoed {metrics[TOY_ECHO]}"

    def after_round(self, dp, server_round: int, accepted: list, norms: list) -> AfterRound:
        self.total += self.settings.shift
        return AfterRound(record={"toy_shift_total": self.total, "toy_accepted": len(accepted)})

    def describe(self, dp) -> dict:
        return {"toy_shift": self.settings.shift}

    def state_dict(self) -> dict:
        return {"toy_shift_total": self.total}


def shifting_app(liar: int | None = None) -> ClientApp:
    """Clients that move every weight by the configured shift and echo it (node `liar` echoes a wrong one)."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        shift = float(msg.content["config"][TOY_SHIFT])
        arrays = [a + np.float32(shift) for a in msg.content["arrays"].to_numpy_ndarrays()]
        echo = shift + 1.0 if int(context.node_config["partition-id"]) == liar else shift
        metrics = MetricRecord({"num-examples": 1, TOY_ECHO: echo})
        return Message(RecordDict({"arrays": ArrayRecord(arrays), "metrics": metrics}), reply_to=msg)

    return app


def toy_wrapper(published: list, shift: float = 0.25) -> DifferentialPrivacy:
    """No noise and a large C: the released model moves by exactly the mean shift."""
    return DifferentialPrivacy(
        FedAvg(fraction_evaluate=0.0),
        privacy=PrivacyOptions(clipping_norm=100.0, noise_multiplier=0.0),
        sampling=SamplingOptions(sample_rate=1.0, min_available_nodes=4),
        run=RunOptions(seed=3, secure_rng=False, on_round_end=lambda record, _: published.append(record)),
        parts=[ToyShift(ToySettings(shift))],
    )


def test_a_part_from_outside_runs_through_the_wrapper():
    published: list[dict] = []
    strategy = toy_wrapper(published)
    start = ArrayRecord([np.zeros(3, np.float32)])
    result = strategy.start(InProcessGrid(shifting_app(), 4, {}), start, num_rounds=2)
    assert [r["toy_shift_total"] for r in published] == [0.25, 0.5]  # its published key, in the round record
    assert "toy_accepted" not in published[0]  # not declared published: a diagnostic
    np.testing.assert_array_equal(result.arrays.to_numpy_ndarrays()[0], np.full(3, 0.5, np.float32))  # config used
    assert strategy.describe()["toy_shift"] == 0.25 and strategy.state_dict()["toy_shift_total"] == 0.5


def test_the_parts_reply_problem_and_rules_refuse_a_reply():
    published: list[dict] = []
    strategy = toy_wrapper(published)
    strategy.start(InProcessGrid(shifting_app(liar=2), 4, {}), ArrayRecord([np.zeros(3, np.float32)]), num_rounds=1)
    assert strategy.record.history[0]["toy_accepted"] == 3 and strategy.record.history[0]["rejected"] == 1
    assert any("echoed 1.25" in p for p in strategy.record.history[0]["problems"])


class Spy(Part):
    """Notes what each hook is handed as the wrapper, and tries to reach past the view."""

    def __init__(self) -> None:
        self.seen: list = []
        self.refusals: list[str] = []

    def client_config(self, dp, server_round: int) -> dict:
        self.seen.append(dp)
        for reach in (lambda: dp.aggregate_train, lambda: setattr(dp, "privacy", None)):
            try:
                reach()
            except AttributeError as err:
                self.refusals.append(str(err))
        return {}

    def after_round(self, dp, server_round: int, accepted: list, norms: list) -> AfterRound:
        self.seen.append(dp)
        return AfterRound(record={"spy_q": dp.population.sample_rate, "spy_sigma": dp.privacy.noise_multiplier})


def test_a_part_is_handed_a_read_only_view_of_the_wrapper_not_the_wrapper():
    """Issue 41 item 2: the hooks get a `PartView` (q, sigma, C, n_s, the seed, the round, the ledger, ...); a
    part cannot call the wrapper's methods or set its attributes, and the error names what it may read."""
    from dpfl.strategies.parts.part import PartView

    spy = Spy()
    strategy = toy_wrapper([])
    strategy.add_part(spy)
    strategy.start(InProcessGrid(shifting_app(), 4, {}), ArrayRecord([np.zeros(3, np.float32)]), num_rounds=1)
    assert len(spy.seen) == 2 and all(type(v) is PartView for v in spy.seen)
    assert strategy.record.history[0]["spy_q"] == 1.0 and strategy.record.history[0]["spy_sigma"] == 0.0
    assert "not 'aggregate_train'" in spy.refusals[0] and "population, privacy" in spy.refusals[0]
    assert "read-only: it cannot set 'privacy'" in spy.refusals[1] and strategy.privacy is not None


def test_the_parts_settings_are_checked_when_the_wrapper_is_built():
    with pytest.raises(SettingError, match="toy_shift=-1.0"):
        toy_wrapper([], shift=-1.0)


def test_flat_keywords_positional_order_and_option_objects_build_the_same_wrapper():
    """The README's keywords, Flower's positional order (strategy, noise_multiplier, clipping_norm) and the option
    objects give the same settings; a keyword nobody takes is refused as Python refuses it."""
    flat = DifferentialPrivacy(FedAvg(), clipping_norm=0.5, noise_multiplier=1.2, sample_rate=0.3, seed=4)
    positional = DifferentialPrivacy(FedAvg(), 1.2, 0.5, sample_rate=0.3, seed=4)
    options = DifferentialPrivacy(
        FedAvg(),
        privacy=PrivacyOptions(clipping_norm=0.5, noise_multiplier=1.2),
        sampling=SamplingOptions(sample_rate=0.3),
        run=RunOptions(seed=4),
    )
    for strategy in (flat, positional, options):
        assert (
            strategy.privacy.noise_multiplier,
            strategy.privacy.clipping_norm,
            strategy.population.sample_rate,
            strategy.run.seed,
        ) == (
            1.2,
            0.5,
            0.3,
            4,
        )
        assert [type(p).__name__ for p in strategy.parts] == ["CentralNoise"]
    with pytest.raises(TypeError, match="noise_placment"):
        DifferentialPrivacy(FedAvg(), 1.2, 0.5, sample_rate=0.3, noise_placment="central")
    with pytest.raises(TypeError, match="sample_rate given both"):
        DifferentialPrivacy(FedAvg(), 1.2, 0.5, sample_rate=0.3, sampling=SamplingOptions(sample_rate=0.3))


def test_the_wrappers_constructor_takes_at_most_twelve_parameters():
    import inspect

    parameters = inspect.signature(DifferentialPrivacy.__init__).parameters
    assert len(parameters) - 1 <= 12  # self left out
    assert list(parameters)[1:4] == ["strategy", "noise_multiplier", "clipping_norm"]  # Flower's order
