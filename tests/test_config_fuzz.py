"""A seeded fuzz of run configs: every generated config is either refused with ConfigError (naming the
key) or valid, and for every valid one the ledger's epsilon for its rounds is finite or inf, never NaN,
and computed without hanging."""

import math
import random
import time

from dpfl.dpcore.privacy.accountants import epsilon_of
from dpfl.fl_app.config import SPEC, ConfigError, validate

CONFIGS = 1200
WEIRD = [
    float("inf"),
    -float("inf"),
    float("nan"),
    1e-310,
    1e308,
    -1.0,
    0,
    1,
    10**400,
    2**63,
    True,
    "x",
    "a\x00b",
    "",
    [1.0],
    None,
    1e-300,
    0.5,
    1e6,
    1e7,
    -0.0,
]


def random_value(rng: random.Random, key: str):
    spec = SPEC[key]
    if rng.random() < 0.5:
        return rng.choice(WEIRD)
    if spec.choices:
        return rng.choice(list(spec.choices) + ["nope"])
    if isinstance(spec.default, bool):
        return rng.choice([True, False])
    if isinstance(spec.default, int):
        return rng.choice([0, 1, 2, 5, 100, -3])
    if isinstance(spec.default, float):
        return rng.choice([0.0, 1e-3, 0.1, 0.5, 1.0, 2.0, 100.0])
    return rng.choice(["run", "/tmp/dpfl-fuzz", "relative/x"])


def test_fuzzed_configs_are_valid_or_refused_and_the_ledger_stays_finite():
    rng = random.Random(20261122)
    valid = refused = 0
    for _ in range(CONFIGS):
        keys = rng.sample(sorted(SPEC), rng.randint(1, 6))
        config = {k: random_value(rng, k) for k in keys if random_value(rng, k) is not None}
        try:
            cfg = validate(config)
        except ConfigError as exc:
            refused += 1
            assert any(f"'{k}'" in str(exc) for k in list(config) + list(SPEC)), exc
            continue
        valid += 1
        sigma = cfg.privacy.noise_multiplier
        start = time.perf_counter()
        eps = epsilon_of(
            [(sigma, cfg.federation.sample_rate, min(cfg.run.num_rounds, 10_000))], cfg.privacy.delta or 1e-5
        )
        assert not math.isnan(eps) and eps >= 0
        assert time.perf_counter() - start < 30
    print(f"config fuzz: {CONFIGS} configs, {valid} valid, {refused} refused with ConfigError, 0 other exceptions")
    assert valid > 50 and refused > 500
