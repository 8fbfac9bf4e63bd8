"""Matrix-factorization noise for DP-FTRL's prefix sums (docs/dp-toolbox.md §4): the strategies are computed with
Google DeepMind's jax-privacy (`jax_privacy.matrix_factorization`, float64), the rounds' noise is streamed in
numpy.

The prefix sums S = A x of the rounds' sums of clipped updates x_1, x_2, ... (A: the lower-triangular all-ones
matrix) are released as A (x + C^-1 z), z_t ~ N(0, sigma^2 Cl^2 I) (Cl: the clipping norm), for a lower-triangular
Toeplitz strategy C (BLT c_0 = 1; banded ||c|| = 1) (McKenna, "Scaling up the Banded Matrix Factorization Mechanism for
Differentially Private ML", arXiv 2405.15913; Choquette-Choo et al., "(Amplified) Banded Matrix Factorization: A
unified approach to private training", arXiv 2306.08153). The release is the Gaussian mechanism C x + z with
sensitivity sens(C) Cl, where sens(C) is the largest ||C u|| over the participation patterns u allowed:
min-separation b (a node in rounds i < j only if j - i >= b), at most k rounds (`minsep_sensitivity`). So it is
one Gaussian release with noise multiplier sigma / sens(C).

Strategies (`ToeplitzStrategy`):

- `blt`: Buffered Linear Toeplitz (Dvijotham, McMahan, Pillutla, Steinke and Thakurta, "Efficient and
  Near-Optimal Noise Generation for Streaming Differential Privacy", arXiv 2404.16706; McMahan, Xu and Zhang,
  "A Hassle-free Algorithm for Private Learning in Practice: Don't Use Tree Aggregation, Use BLTs", arXiv
  2408.08868): C's Toeplitz coefficients are c_0 = 1, c_k = sum_i omega_i theta_i^(k-1). C^-1 z is streamed with
  one buffer per theta_i: y_t = z_t - sum_i omega_i buf_i, then buf_i <- theta_i buf_i + y_t;
- `banded`: banded Toeplitz with b bands c_0..c_{b-1}: y_t = (z_t - sum_{j=1}^{b-1} c_j y_{t-j}) / c_0, keeping
  the last b - 1 outputs.

Either holds O(buffers x d) or O(b x d) numbers, never an n x n matrix. jax is imported only by the functions that
optimize or measure a strategy, never by the noise stream nor by `import dpcore`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .accountants import DEFAULT_ACCOUNTANT, accountant_used, epsilon_of
from .ledger import check_ledger_settings

INSTALL = 'pip install -e ".[mf]"'  # jax-privacy (it brings jax) for the blt and banded strategies
STRATEGIES = ("tree", "blt", "banded")


def jax_privacy_modules():
    """(jax, jax_privacy.matrix_factorization), or ImportError naming the install command."""
    try:
        import jax
        from jax_privacy import matrix_factorization
    except ImportError as exc:
        raise ImportError(
            f"the DP-FTRL strategies 'blt' and 'banded' need jax-privacy ({exc}); install it with: {INSTALL}"
        ) from None
    return jax, matrix_factorization


def require_jax_privacy(key: str, value: str) -> None:
    """Refuse a matrix-factorization strategy before training when jax-privacy is not installed."""
    try:
        jax_privacy_modules()
    except ImportError as exc:
        raise ValueError(f"run-config key {key!r} = {value!r}: {exc}") from None


@dataclass(frozen=True)
class ToeplitzStrategy:
    """A lower-triangular Toeplitz strategy C (the strategy matrix of the factorization A = (A C^-1) C, the
    matrix-mechanism term; no Flower `Strategy`): `blt` (buf_decay theta, output_scale omega) or `banded` (the band
    coefficients c_0..c_{b-1}). JSON-safe through `as_dict` / `from_dict`."""

    kind: str
    buf_decay: tuple[float, ...] = ()
    output_scale: tuple[float, ...] = ()
    bands: tuple[float, ...] = ()

    def toeplitz_coefs(self, n: int) -> np.ndarray:
        """C's first column, c_0..c_{n-1} (float64)."""
        if self.kind == "banded":
            coef = np.zeros(n)
            coef[: min(n, len(self.bands))] = self.bands[:n]
            return coef
        powers = np.arange(max(n - 1, 0))[:, None]
        tail = (np.asarray(self.buf_decay) ** powers * np.asarray(self.output_scale)).sum(axis=1)
        return np.concatenate([[1.0], tail])[:n]

    def check_coefficients(self, n: int) -> None:
        """Refuse c_0..c_{n-1} unless non-negative and non-increasing: `minsep_sensitivity`'s worst case (k
        participations exactly b apart) is tight only then. jax-privacy 2.0.0 refused other coefficients; its head
        (2.3.0.dev0) projects them onto that set and returns an upper bound instead."""
        coef = self.toeplitz_coefs(n)
        negative = np.flatnonzero(coef < 0)
        rising = np.flatnonzero(np.diff(coef) > 0)
        if negative.size or rising.size:
            bad = [f"c_{j} = {coef[j]:.6g}" for j in negative[:3]]
            bad += [f"c_{j + 1} = {coef[j + 1]:.6g} > c_{j} = {coef[j]:.6g}" for j in rising[:3]]
            raise ValueError(
                f"the {self.kind} strategy's Toeplitz coefficients c_0..c_{n - 1} must be non-negative and "
                f"non-increasing (c_0 >= c_1 >= ... >= 0) for the min-separation sensitivity: {'; '.join(bad)}"
            )

    def dense(self, n: int) -> np.ndarray:
        """C as an n x n matrix (tests and the benchmark only)."""
        coef = self.toeplitz_coefs(n)
        index = np.arange(n)[:, None] - np.arange(n)[None, :]
        return np.where(index >= 0, coef[np.clip(index, 0, n - 1)], 0.0)

    def memory(self) -> int:
        """How many model-sized vectors the noise stream holds."""
        return len(self.buf_decay) if self.kind == "blt" else max(len(self.bands) - 1, 0)

    def as_dict(self) -> dict:
        if self.kind == "banded":
            return {"kind": "banded", "bands": list(self.bands)}
        return {"kind": "blt", "buf_decay": list(self.buf_decay), "output_scale": list(self.output_scale)}

    @classmethod
    def from_dict(cls, state: dict) -> "ToeplitzStrategy":
        if state["kind"] == "banded":
            return cls("banded", bands=tuple(float(c) for c in state["bands"]))
        return cls(
            "blt",
            buf_decay=tuple(float(v) for v in state["buf_decay"]),
            output_scale=tuple(float(v) for v in state["output_scale"]),
        )


@functools.lru_cache(maxsize=16)
def optimize_strategy(
    kind: str, n: int, min_sep: int, max_participations: int, max_buffers: int = 6
) -> ToeplitzStrategy:
    """The strategy for n rounds under (b = min_sep, k = max_participations) participation, optimized by
    jax-privacy in float64 for the mean squared error of the prefix sums: `buffered_toeplitz.optimize` (blt),
    `toeplitz.optimize_banded_toeplitz` with min(b, n) bands (banded). Takes seconds to minutes, so it is kept per
    process, keyed by all five arguments (the runs of one launcher with --engine inprocess or cohort share it; a
    `ToeplitzStrategy` is immutable)."""
    jax, mf = jax_privacy_modules()
    with jax.enable_x64(True):
        if kind == "blt":
            blt = mf.buffered_toeplitz.optimize(
                n=n, min_sep=min_sep, max_participations=max_participations, error="mean", max_buffers=max_buffers
            )
            return ToeplitzStrategy(
                "blt",
                buf_decay=tuple(float(v) for v in np.asarray(blt.buf_decay)),
                output_scale=tuple(float(v) for v in np.asarray(blt.output_scale)),
            )
        if kind == "banded":
            coef = mf.toeplitz.optimize_banded_toeplitz(n=n, bands=min(min_sep, n))
            return ToeplitzStrategy("banded", bands=tuple(float(v) for v in np.asarray(coef)))
    raise ValueError(f"strategy {kind!r} is not one of: blt, banded")


def minsep_sensitivity(strategy: ToeplitzStrategy, n: int, min_sep: int, max_participations: int | None) -> float:
    """sens(C) of C's leading n x n block: the largest ||C u|| over participation vectors u with at most k ones
    separated by at least b (jax-privacy's `toeplitz.minsep_sensitivity_squared`, float64), for non-negative,
    non-increasing coefficients only (`ToeplitzStrategy.check_coefficients`)."""
    strategy.check_coefficients(n)
    jax, mf = jax_privacy_modules()
    with jax.enable_x64(True):
        coef = jax.numpy.asarray(strategy.toeplitz_coefs(n), dtype=jax.numpy.float64)
        squared = mf.toeplitz.minsep_sensitivity_squared(
            coef, min_sep=int(min_sep), n=int(n), max_participations=max_participations
        )
    return math.sqrt(float(squared))


class NoiseStream:
    """C^-1 z, one round at a time: `next(z_t)` gives (C^-1 z)_t (float64).

    O(buffers x d) memory for blt, O((b - 1) x d) for banded.
    """

    def __init__(self, strategy: ToeplitzStrategy, dim: int) -> None:
        self.strategy = strategy
        self.steps = 0
        self.state = np.zeros((strategy.memory(), int(dim)))  # blt: the buffers; banded: y_{t-1}, ..., y_{t-b+1}

    def next(self, z: np.ndarray) -> np.ndarray:
        s, z = self.strategy, np.asarray(z, np.float64)
        if s.kind == "blt":
            y = z - np.asarray(s.output_scale) @ self.state if self.state.size else z.copy()
            self.state = np.asarray(s.buf_decay)[:, None] * self.state + y
        else:
            past = np.asarray(s.bands[1:]) @ self.state if self.state.size else 0.0
            y = (z - past) / s.bands[0]
            if self.state.size:
                self.state = np.roll(self.state, 1, axis=0)
                self.state[0] = y
        self.steps += 1
        return y

    def replay(self, steps: int, draw: Callable[[int], np.ndarray]) -> None:
        """Advance to `steps` with the same draws z_t = draw(t) (a resumed run: the same state as without a kill)."""
        while self.steps < steps:
            self.next(draw(self.steps + 1))


@dataclass
class MatrixFactorizationLedger:
    """Client-level DP of DP-FTRL with matrix-factorization noise (`dpcore.privacy.matrix_factorization`): no
    sampling, each client in rounds at least `min_sep` apart and in at most `max_participations` of them (the
    strategy enforces both). After t rounds the release C x + z is one Gaussian mechanism with noise multiplier
    sigma / sens_t, sens_t the min-separation sensitivity of C's leading t x t block (jax-privacy); eps(delta) is
    the configured accountant's (PLD by default) of that one event. Against the server: none."""

    delta: float
    accountant: str = DEFAULT_ACCOUNTANT
    strategy: dict = field(default_factory=dict)  # `ToeplitzStrategy.as_dict()`
    min_sep: int = 1
    max_participations: int = 1
    rounds: int = 0
    noise_multiplier: float = math.inf  # the smallest sigma charged so far
    cycle: int = 0  # amplified banded: b groups, one per round in turn (0: no sampling)
    sample_rate: float = 1.0  # amplified banded: p, each node of the round's group sampled with probability p

    kind = "matrix-factorization"
    server_threat_model = "trusted server: it sees raw clipped updates, no DP against it"

    @property
    def relation(self) -> str:
        if self.cycle:
            return (
                f"add/remove-one, cyclic Poisson sampling: nodes in {self.cycle} groups by node id, round t samples "
                f"group t mod {self.cycle} with probability {self.sample_rate:g}; the amplified banded "
                "matrix-factorization mechanism (arXiv 2306.08153): ceil(t / groups) Poisson-sampled Gaussian "
                "releases at sigma / (C's largest column norm)"
            )
        return (
            "replace-special (a client's updates replaced by zero), no sampling: each client in rounds at least "
            f"{self.min_sep} apart, at most {self.max_participations} times (enforced by the server); one Gaussian "
            "mechanism with noise multiplier sigma / sens, sens: jax-privacy's min-separation sensitivity of "
            f"the {self.strategy.get('kind')} strategy"
        )

    def __post_init__(self) -> None:
        check_ledger_settings(self.delta, self.accountant)
        self._sensitivities: dict[int, float] = {}

    def sensitivity(self, rounds: int | None = None) -> float:
        """sens of C's leading block after `rounds` (default: those charged) rounds."""
        rounds = self.rounds if rounds is None else int(rounds)
        if rounds not in self._sensitivities:
            self._sensitivities[rounds] = minsep_sensitivity(
                ToeplitzStrategy.from_dict(self.strategy), rounds, self.min_sep, self.max_participations
            )
        return self._sensitivities[rounds]

    def equivalent_noise_multiplier(self, noise_multiplier: float | None = None, rounds: int | None = None) -> float:
        """sigma / sens_t."""
        sigma = self.noise_multiplier if noise_multiplier is None else noise_multiplier
        return sigma / self.sensitivity(rounds)

    def _epsilon(self, noise_multiplier: float, rounds: int) -> float:
        if rounds <= 0:
            return 0.0
        return epsilon_of(self._events(noise_multiplier, rounds), self.delta, self.accountant)

    def _events(self, noise_multiplier: float, rounds: int) -> list:
        """One Gaussian release at sigma / sens; amplified: ceil(t / b) sampled ones at sigma / (column norm)."""
        multiplier = self.equivalent_noise_multiplier(noise_multiplier, rounds)
        if self.cycle:
            return [(multiplier, self.sample_rate, math.ceil(rounds / self.cycle))]
        return [(multiplier, 1.0, 1)]

    def record_round(
        self,
        noise_multiplier: float,
        sample_rate: float = 1.0,
        noise_shares: float = 0,
        received: int | None = None,
        truncation_probability: float = 0.0,
        sampled_from: tuple[int, int] | None = None,
    ) -> None:
        """Charge one round: one more row of C (no sampling, so q is not used)."""
        self.rounds += 1
        self.noise_multiplier = min(self.noise_multiplier, float(noise_multiplier))

    def epsilon(self) -> float:
        return self._epsilon(self.noise_multiplier, self.rounds)

    def epsilon_after_rounds(
        self,
        noise_multiplier: float,
        sample_rate: float = 1.0,
        rounds: int = 1,
        truncation_probability: float = 0.0,
        sampled_from: tuple[int, int] | None = None,
    ) -> float:
        return self._epsilon(min(self.noise_multiplier, float(noise_multiplier)), self.rounds + rounds)

    def epsilon_against_server(self) -> float:
        return math.inf

    def model_bound_by(self) -> str:
        events = self._events(self.noise_multiplier, self.rounds) if self.rounds else []
        return f"{accountant_used(events, self.delta, self.accountant)} (Gaussian at sigma / sensitivity)"

    def state_dict(self) -> dict:
        return {
            "kind": self.kind,
            "delta": self.delta,
            "accountant": self.accountant,
            "strategy": self.strategy,
            "min_sep": self.min_sep,
            "max_participations": self.max_participations,
            "rounds": self.rounds,
            "cycle": self.cycle,
            "sample_rate": self.sample_rate,
            "noise_multiplier": self.noise_multiplier if self.rounds else None,
            "relation": self.relation,
            "model_bound_by": self.model_bound_by(),
            "sensitivity": self.sensitivity() if self.rounds else None,
            "equivalent_noise_multiplier": self.equivalent_noise_multiplier() if self.rounds else None,
        }

    @classmethod
    def from_state_dict(cls, state: dict) -> "MatrixFactorizationLedger":
        sigma = state.get("noise_multiplier")
        return cls(
            float(state["delta"]),
            state["accountant"],
            dict(state["strategy"]),
            int(state["min_sep"]),
            int(state["max_participations"]),
            int(state["rounds"]),
            math.inf if sigma is None else float(sigma),
            int(state.get("cycle", 0)),
            float(state.get("sample_rate", 1.0)),
        )
