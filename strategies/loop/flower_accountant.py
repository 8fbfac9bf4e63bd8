"""Flower's `accountant=` on this project's wrapper: what it sets (`flower_accountant_keywords`), and the warning
logged when the wrapper is built that says how the ledger's accounting differs from Flower's
(`flower_accounting_note`, beside `flower_first_round`: Flower's own figure).

Flower's fixed-clipping wrappers compose one GaussianPrivacyEvent(sigma, m, population_size) a round into the
accountant given (Flower 1.42: add-or-remove-one with no amplification); the ledger charges the sampling the wrapper
does (fixed-size sampling: replace-one, the Gaussian at sigma / 2), so the two figures differ, and the budget is
held under the ledger's.
"""

from __future__ import annotations

from flwr.supercore.privacy_accounting import GaussianPrivacyEvent, PrivacyConfig

from dpfl.dpcore.privacy.accountants import DEFAULT_ACCOUNTANT
from dpfl.dpcore.privacy.settings import SettingError
from dpfl.strategies.parts.part import PartView


def flower_accountant_keywords(accountant=None, **keywords) -> tuple[dict, object]:
    """(the wrapper's keywords, Flower's accountant or None). Flower's `accountant=RdpAccountant(PrivacyConfig(
    target_delta=..., max_epsilon=...))` (or the PrivacyConfig itself) as this wrapper's keywords: its target_delta is
    `delta`, its max_epsilon a budget to stop at (`target_epsilon`, mode "stop"), an RdpAccountant the ledger's "rdp"
    accountant. The ledger computes every figure; Flower's object is read, never composed into (its population_size
    and sampling_method are Flower's model: the ledger takes M from the connected nodes and charges the sampling
    this wrapper does)."""
    config = accountant if isinstance(accountant, PrivacyConfig) else getattr(accountant, "config", None)
    if isinstance(accountant, str) or not isinstance(config, PrivacyConfig):
        return (keywords if accountant is None else {**keywords, "accountant": accountant}), None
    mapped = dict(delta=config.target_delta)
    if config.max_epsilon is not None:
        mapped.update(target_epsilon=config.max_epsilon, target_epsilon_mode="stop")
    for key, value in mapped.items():
        if key in keywords and keywords[key] != value:
            raise SettingError(
                f"{key}={keywords[key]!r} and Flower's accountant={accountant!r} (which sets {key}={value!r}) "
                "disagree: give one of them"
            )
    rdp = type(accountant).__name__ == "RdpAccountant"
    return {**keywords, **mapped, "accountant": "rdp" if rdp else DEFAULT_ACCOUNTANT}, accountant


def flower_first_round(accountant, noise_multiplier: float, sample_size: int) -> str:
    """What Flower's accountant reports after round 1 of Flower's fixed-clipping wrappers: a new accountant of the
    given one's class on its config (Flower's RdpAccountant for a PrivacyConfig alone; the user's object is not
    touched) composes GaussianPrivacyEvent(sigma, m, population_size)."""
    config = accountant if isinstance(accountant, PrivacyConfig) else accountant.config
    kind = type(accountant)
    if isinstance(accountant, PrivacyConfig):
        from flwr.supercore.privacy_accounting.rdp_accountant import RdpAccountant as kind
    relation, population = config.neighboring_relation.value, config.population_size
    model = f"{relation}, {config.sampling_method.value}, population_size={population}"
    try:
        flower = kind(config)
        flower.compose(
            GaussianPrivacyEvent(noise_multiplier=noise_multiplier, sample_size=sample_size, population_size=population)
        )
        spent = flower.get_privacy_spent()
    except Exception as exc:  # Flower's own refusal, named in the line instead of a figure
        return f"Flower's {kind.__name__} ({model}) gives no figure for it ({type(exc).__name__}: {exc})"
    return f"Flower's {kind.__name__} ({model}) would report epsilon {spent.epsilon:.4g} at delta {spent.delta:g}"


def flower_accounting_note(dp, accountant) -> str:
    """The warning the wrapper `dp` logs when it is built with Flower's `accountant`: the neighbouring relation and
    accounting its ledger charges and its epsilon after round 1, for m of the population_size nodes Flower's config
    names (m: num_sampled_clients, else round(q x population_size); the run's own ledger takes M from the nodes
    connected at round 1), beside Flower's figure for the same round (`flower_first_round`), and the budget
    (Flower's max_epsilon) held under the ledger's figure."""
    population = (accountant if isinstance(accountant, PrivacyConfig) else accountant.config).population_size
    m = dp.population.num_sampled_clients or max(1, round(dp.population.sample_rate * population))
    ledger = dp.mechanism.make_ledger(PartView(dp), dp.privacy.delta)
    form = dp.selection.sampling_form
    fixed = form is not None and form.fixed_size
    try:
        ours = ledger.epsilon_after_rounds(
            dp.accounted_noise_multiplier(),
            min(1.0, m / population) if fixed else dp.population.sample_rate,
            sampled_from=(population, m) if fixed else None,
        )
        figure = f"epsilon {ours:.4g} at delta {ledger.delta:g} after round 1"
    except Exception as exc:  # a mechanism whose figure needs the connected nodes: said, not guessed
        figure = f"its figure once the nodes connect ({type(exc).__name__}: {exc})"
    target = dp.privacy.target_epsilon
    budget = f"; max_epsilon={target:g} is held under this wrapper's figure" if target > 0 else ""
    flower = flower_first_round(accountant, dp.privacy.noise_multiplier, m)
    return (
        f"Flower's accountant= is read, not composed into: this wrapper charges {ledger.relation} "
        f"({ledger.accountant} accountant), {figure}, where {flower}{budget}"
    )
