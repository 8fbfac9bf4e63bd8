"""DP-FTRL with matrix-factorization noise (docs/dp-toolbox.md §4): a BLT or banded Toeplitz strategy C in place of
the binary tree (`dpcore.privacy.matrix_factorization`), composed as the tree part is:

    DifferentialPrivacy(FedAvg(), clipping_norm=Cl, noise_multiplier=sigma, sample_rate=q,
                        noise_placement="central", ftrl=MatrixFactorizationFTRL("blt", min_sep=b))

- participation (min-separation): a client (its client id, asked of its node: `strategies.parts.sampling.
  ClientIdentities`, so a restarted SuperNode keeps its client's record) is sent a train message only if it has not
  taken part in the last b - 1 rounds and in fewer than k rounds so far; each round up to m = max(1, round(q M))
  eligible clients are chosen and marked; the reply gate refuses a reply from a node not sent this round's message
  and a second reply;
- the strategy C is optimized once at start by jax-privacy for the run's n rounds and (b, k) (or taken as given),
  and kept in the checkpoint and summary.json;
- the model: w_t = w_{t-1} + eta (x_t + sigma Cl (C^-1 z)_t) / m (x_t: the round's sum of clipped updates), so
  the released prefix sums are A x + sigma Cl A C^-1 z; with server momentum gamma, v_t = gamma v_{t-1} + g_t and
  w_t = w_{t-1} + eta v_t / m. The noise z_t is drawn from a key of the run (OS entropy unless seeded) and round
  t, so a resumed run replays the stream to the same state;
- the ledger (`MatrixFactorizationLedger`): one Gaussian release at sigma / sens, sens the min-separation
  sensitivity of C; `target_epsilon_mode = 'calibrate'` sets sigma = sens_n x the Gaussian multiplier of the target.

The checkpoint holds the noise key: keep it as private as the server's memory.
"""

from __future__ import annotations

import functools
import math
import secrets

import numpy as np

from dpfl.dpcore.privacy.calibration import calibrate_noise_multiplier
from dpfl.dpcore.privacy.matrix_factorization import (
    MatrixFactorizationLedger,
    NoiseStream,
    ToeplitzStrategy,
    optimize_strategy,
)
from dpfl.dpcore.privacy.mechanisms import gaussian_noise, make_rng, sum_updates
from dpfl.dpcore.privacy.settings import one_of, require
from dpfl.strategies.parts.dp_ftrl import check_ftrl, choose, client_ids
from dpfl.strategies.parts.part import Part
from dpfl.strategies.parts.sampling import ClientIdentities, Selection, round_note

NOISE_STREAM = 23  # make_rng stream of z_t (from the run's noise key)
SELECTION_STREAM = 24


class MatrixFactorizationFTRL(Part):
    """The min-separation participation rule (selection) and the matrix-factorization noise with the FTRL model
    (mechanism) of DP-FTRL (one run per instance).

    kind : 'blt' or 'banded'. min_sep : b (0: M // m). max_participations : k (0: ceil(n / b), no further limit).
    momentum : gamma of the server momentum. max_buffers : the most BLT buffers jax-privacy may choose.
    strategy : a strategy already computed (`ToeplitzStrategy`), else it is optimized at start.
    """

    roles = ("selection", "mechanism")
    sampling_form = None  # no sampling: its own ledger charges the participation rule
    keyword = "ftrl"

    def __init__(
        self,
        kind: str = "blt",
        min_sep: int = 0,
        max_participations: int = 0,
        momentum: float = 0.0,
        max_buffers: int = 6,
        strategy: ToeplitzStrategy | None = None,
        amplified: bool = False,
    ) -> None:
        one_of("ftrl_strategy", kind, ("blt", "banded"))
        require(int(min_sep) == min_sep and min_sep >= 0, "epoch_rounds", min_sep, "must be an integer >= 0")
        require(
            int(max_participations) == max_participations and max_participations >= 0,
            "ftrl_max_participations",
            max_participations,
            "must be an integer >= 0 (0: ceil(rounds / min separation))",
        )
        require(0 <= momentum < 1, "ftrl_momentum", momentum, "must be in [0, 1)")
        require(
            not amplified or kind == "banded",
            "ftrl_amplified",
            amplified,
            "the amplified form (cyclic Poisson sampling) is accounted for 'banded' only",
        )
        self.kind = kind
        self.requested_min_sep, self.requested_participations = int(min_sep), int(max_participations)
        self.momentum, self.max_buffers, self.amplified = float(momentum), int(max_buffers), bool(amplified)
        self.group_rate = 1.0  # amplified: p, the probability a node of the round's group is sampled
        self.strategy = strategy
        self.min_sep = self.max_participations = self.clients_per_round = 0
        self.key = 0  # the noise key: z_t from make_rng(key, NOISE_STREAM, t)
        self.identities = ClientIdentities()  # node id -> client id (asked of the node)
        self.taken: dict[int, list[int]] = {}  # client id -> [last round its node was sent a train message, rounds]
        self.stream: NoiseStream | None = None
        self.velocity: np.ndarray | None = None

    def check(self, privacy, others: frozenset[str]) -> None:
        check_ftrl(privacy, others, modes=("stop", "calibrate"))

    # ------------------------------------------------------------------ population, ledger
    def make_ledger(self, dp, delta: float) -> MatrixFactorizationLedger:
        """Fix m, b, k and the noise key from the population and the run, compute C (jax-privacy), the ledger."""
        rounds = max(1, dp.record.num_rounds)
        self.clients_per_round = max(1, round(dp.population.sample_rate * dp.population.num_clients))
        self.min_sep = self.requested_min_sep or max(1, dp.population.num_clients // self.clients_per_round)
        self.max_participations = self.requested_participations or math.ceil(rounds / self.min_sep)
        if self.amplified:  # each node in one group of b, sampled with p = q b when its group's round comes
            self.group_rate = dp.population.sample_rate * self.min_sep
            require(
                self.group_rate <= 1,
                "sample_rate",
                dp.population.sample_rate,
                f"with ftrl-amplified each of the {self.min_sep} groups is sampled at sample-rate x {self.min_sep}, "
                "which must be at most 1: lower sample-rate or ftrl-epoch-rounds",
            )
            self.max_participations = 1  # the sensitivity of one participation; the ledger composes the cycles
        if self.strategy is None:
            self.strategy = optimize_strategy(
                self.kind, rounds, self.min_sep, self.max_participations, self.max_buffers
            )
        self.strategy.check_coefficients(rounds)  # before round 1, not at the first sensitivity
        self.key = (
            secrets.randbits(128) if dp.run.secure_rng else int(make_rng(dp.run.seed, NOISE_STREAM).integers(2**63))
        )
        return MatrixFactorizationLedger(
            delta,
            dp.privacy.accountant,
            self.strategy.as_dict(),
            self.min_sep,
            self.max_participations,
            cycle=self.min_sep if self.amplified else 0,
            sample_rate=self.group_rate,
        )

    def calibrated_noise_multiplier(self, dp, ledger: MatrixFactorizationLedger) -> float:
        """sigma = sens_n x the multiplier whose eps(delta) is the target (n: the configured rounds): of one Gaussian
        release, or amplified, of ceil(n / b) Poisson-sampled ones at rate p."""
        rounds = max(1, dp.record.num_rounds)
        releases, rate = (math.ceil(rounds / ledger.cycle), ledger.sample_rate) if ledger.cycle else (1, 1.0)
        multiplier = calibrate_noise_multiplier(
            dp.privacy.target_epsilon, ledger.delta, rate, releases, dp.privacy.accountant
        )
        return multiplier * ledger.sensitivity(rounds)

    def ledger_from_state(self, state: dict) -> MatrixFactorizationLedger:
        return MatrixFactorizationLedger.from_state_dict(state)

    def accounted_noise_multiplier(self, dp) -> float:
        return dp.privacy.noise_multiplier

    def next_truncation_probability(self, dp) -> float:
        return 0.0

    # ------------------------------------------------------------------ the participation rule
    def identify(self, dp, grid, server_round: int, node_ids: list[int]) -> list[int]:
        """The connected nodes that hold a client id (`ClientIdentities.resolve`; round 1 refuses to start where a
        node offers none)."""
        return self.identities.resolve(grid, server_round, node_ids, round_note(dp, server_round))

    def eligible(self, client: int, server_round: int) -> bool:
        last, count = self.taken.get(client, (None, 0))
        return count < self.max_participations and (last is None or server_round - last >= self.min_sep)

    def select(self, dp, server_round: int, node_ids: list[int]) -> Selection:
        """Up to m of the nodes of eligible clients, those clients marked as having taken part (no sampling);
        amplified: each node of the round's group (client id mod b = (t - 1) mod b) with probability p."""
        clients = client_ids(self.identities, node_ids)
        if self.amplified:
            turn = (server_round - 1) % self.min_sep
            group = [n for n in sorted(clients) if clients[n] % self.min_sep == turn]
            rng = make_rng(dp.run.seed, SELECTION_STREAM, server_round, secure=dp.run.secure_rng)
            return Selection([n for n, u in zip(group, rng.random(len(group))) if u < self.group_rate])
        eligible = [n for n in sorted(clients) if self.eligible(clients[n], server_round)]
        chosen = choose(dp, SELECTION_STREAM, server_round, eligible, self.clients_per_round)
        for node in chosen:
            client = clients[node]
            self.taken[client] = [int(server_round), self.taken.get(client, (None, 0))[1] + 1]
        return Selection(chosen)

    # ------------------------------------------------------------------ the noise and the model
    def draw(self, dim: int, step: int) -> np.ndarray:
        """z_t ~ N(0, I) of round t (the caller scales by sigma Cl: the stream is linear)."""
        return gaussian_noise(dim, 1.0, make_rng(self.key, NOISE_STREAM, step))

    def release(
        self, dp, server_round: int, updates: list[np.ndarray], global_vector: np.ndarray, received: int
    ) -> tuple[np.ndarray, float]:
        """(w_{t-1} + eta (x_t + sigma Cl (C^-1 z)_t) / m, or its momentum form; the std of the prefix sum's
        noise, sigma Cl ||row t of A C^-1||)."""
        size, rounds = global_vector.size, dp.ledger.rounds
        if self.stream is None:  # a fresh run, or a resumed one: replay the rounds already charged
            self.stream = NoiseStream(self.strategy, size)
            self.stream.replay(rounds, lambda t: self.draw(size, t))
        std = dp.privacy.noise_multiplier * dp.privacy.clipping_norm
        noise = (self.stream.next(self.draw(size, rounds + 1)) * std).astype(np.float32)
        total = sum_updates(updates, size)
        step = total + noise
        if self.momentum > 0:
            velocity = self.velocity if self.velocity is not None else np.zeros(size, np.float32)
            self.velocity = np.float32(self.momentum) * velocity + step
            step = self.velocity
        eta = np.float32(dp.run.server_learning_rate)
        prefix_std = std * float(prefix_noise_norms(self.strategy, rounds + 1)[-1])
        return global_vector + eta * step / np.float32(self.clients_per_round), prefix_std

    # ------------------------------------------------------------------ records
    def state_dict(self) -> dict:
        return {
            "ftrl_mf": {
                "strategy": None if self.strategy is None else self.strategy.as_dict(),
                "min_sep": self.min_sep,
                "max_participations": self.max_participations,
                "clients_per_round": self.clients_per_round,
                "group_rate": self.group_rate,
                "key": str(self.key),
                "taken": {str(n): v for n, v in self.taken.items()},
                "velocity": None if self.velocity is None else self.velocity.tolist(),
            }
        }

    def load_state_dict(self, state: dict) -> None:
        own = state["ftrl_mf"]
        self.strategy = None if own["strategy"] is None else ToeplitzStrategy.from_dict(own["strategy"])
        self.min_sep, self.max_participations = int(own["min_sep"]), int(own["max_participations"])
        self.clients_per_round, self.key = int(own["clients_per_round"]), int(own["key"])
        self.group_rate = float(own.get("group_rate", 1.0))
        self.taken = {int(n): [int(v[0]), int(v[1])] for n, v in own["taken"].items()}
        self.velocity = None if own["velocity"] is None else np.asarray(own["velocity"], np.float32)
        self.stream = None  # replayed at the next release

    def describe(self, dp) -> dict:
        ledger = dp.ledger
        return {
            "ftrl": {
                "strategy": self.kind,
                "coefficients": None if self.strategy is None else self.strategy.as_dict(),
                "min_separation": self.min_sep,
                "amplified": self.amplified,
                "group_sample_rate": self.group_rate if self.amplified else None,
                "max_participations": self.max_participations,
                "clients_per_round": self.clients_per_round,
                "momentum": self.momentum,
                "sensitivity": ledger.sensitivity() if ledger.rounds else None,
                "equivalent_noise_multiplier": ledger.equivalent_noise_multiplier() if ledger.rounds else None,
                "participation_rule": (
                    f"cyclic Poisson sampling: client id mod {self.min_sep} groups, round t's group sampled with "
                    f"probability {self.group_rate:g}"
                    if self.amplified
                    else f"each client in rounds at least {self.min_sep} apart, at most {self.max_participations} times"
                )
                + ", enforced by the server (nodes not chosen are not sent a train message and their replies are "
                "refused)",
            }
        }

    def summary(self) -> str | None:
        if self.strategy is None:
            return None
        return (
            f"\t│\t└── DP-FTRL {self.kind}: {self.strategy.memory()} model-sized noise buffers, min separation "
            f"{self.min_sep}, at most {self.max_participations} rounds per client"
        )


@functools.lru_cache(maxsize=8)
def prefix_noise_norms(strategy: ToeplitzStrategy, n: int) -> np.ndarray:
    """||row t of A C^-1|| for t = 1..n: the std of the t-th released prefix sum's noise per unit of sigma Cl
    (C^-1's Toeplitz coefficients are the stream's response to a unit impulse)."""
    stream = NoiseStream(strategy, 1)
    inverse = np.array([stream.next(np.array([1.0 if t == 0 else 0.0]))[0] for t in range(n)])
    return np.sqrt(np.cumsum(np.cumsum(inverse) ** 2))
