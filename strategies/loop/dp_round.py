"""One round of a DP strategy as a value: created when the round begins, filled in by its steps (sampling, the
reply gate, the release), read by the round record. The strategy holds the round in flight (`DPRoundLoop.round`);
nothing of a round outlives the next one's start."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from flwr.app import ArrayRecord, Message

from dpfl.dpcore.privacy.mechanisms import flatten, float_indices


@dataclass
class DPRound:
    """The round in flight.

    arrays : the global arrays sent this round; `everything` decoded once, `float_positions` those DP trains and
        noises (floating point), `global_vector` their flat concatenation (what a weights reply's update is taken
        from).
    nodes : the nodes sampled (None: not sampled here); `population` the nodes connected when it sampled.
    truncation_probability, sampled_from : how the sample was drawn (`strategies.parts.sampling.Selection`).
    problems : failed and rejected replies (diagnostics); `accepted_replies` the replies the reply gate accepted
        (`accepted_nodes` their nodes), in order.
    server_noise_std : the std of the noise the server added to the sum.
    refused : the budget refused the round once it had sampled (`DPRoundLoop.sample_clients`): nothing was sent.
    diverged : why the replies the gate rejected are a diverged model's, not hostile ones (`ReplyGate.divergence`).
    """

    arrays: ArrayRecord | None = None
    everything: list[np.ndarray] = field(default_factory=list)
    float_positions: list[int] = field(default_factory=list)
    global_vector: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    nodes: set[int] | None = None
    population: set[int] = field(default_factory=set)
    truncation_probability: float = 0.0
    sampled_from: tuple[int, int] | None = None
    problems: list[str] = field(default_factory=list)
    accepted_replies: list[Message] = field(default_factory=list)
    server_noise_std: float = 0.0
    refused: bool = False
    diverged: str | None = None

    @classmethod
    def starting(cls, arrays: ArrayRecord) -> DPRound:
        everything = arrays.to_numpy_ndarrays()  # decoded once a round, not once per reply
        positions = float_indices(everything)
        return cls(arrays, everything, positions, flatten([everything[i] for i in positions]))

    @property
    def accepted_nodes(self) -> list[int]:
        return [int(reply.metadata.src_node_id) for reply in self.accepted_replies]

    def global_arrays(self) -> list[np.ndarray]:
        """The floating-point arrays of the round's global model: what DP trains, clips and noises."""
        return [self.everything[i] for i in self.float_positions]
