"""What a DP run records beyond each round's line: the run's progress (`RunRecord`, an object the round loop holds:
its rounds, why it stopped, the arrays after the last round) and the statements about the guarantee that the
round records and summary.json carry (the not-a-guarantee marks, the sampling entries and their caveats), which
read the strategy, its parts and its ledger."""

from __future__ import annotations

from dataclasses import dataclass, field

from flwr.app import ArrayRecord

from dpfl.dpcore.privacy import figures
from dpfl.strategies.parts.part import PartView

# The round-record keys the ledger covers: the released model's evaluation on server-held data, the privacy
# figures, and what the server derives from public settings or DP outputs (ALI-DPFL's tau and mu). Every other
# key is a raw statistic of client replies, not covered by epsilon (README, "What a run writes"). Declared with
# every figure in dpcore/privacy/figures.py.
PUBLISHED_KEYS = figures.published_names()


@dataclass
class RunRecord:
    """The run so far: one dict per completed round (`history`), the last completed round, why the run stopped,
    the global arrays after the last round, and R_s (the rounds the run is configured for; 0: unknown, a legacy
    strategy without num_rounds). `state_dict` is its part of the checkpoint."""

    history: list[dict] = field(default_factory=list)
    completed_rounds: int = 0
    stop_reason: str = ""
    latest_arrays: ArrayRecord | None = None
    num_rounds: int = 0

    def add(self, record: dict, arrays: ArrayRecord) -> None:
        """A round is complete: its record, and the global arrays it released."""
        self.history.append(record)
        self.completed_rounds = int(record["round"])
        self.latest_arrays = arrays

    def state_dict(self) -> dict:
        return {"completed_rounds": self.completed_rounds, "history": self.history, "stop_reason": self.stop_reason}

    def load_state_dict(self, state: dict) -> None:
        self.completed_rounds = int(state["completed_rounds"])
        self.history = list(state["history"])
        self.stop_reason = state["stop_reason"]


def bound_note(asked: str, ledger) -> str | None:
    """A line for the log when the printed epsilon is another bound than the accountant asked for (the tighter of
    two valid bounds under fixed-size sampling, DP-FTRL's tree bound, or RDP where PLD fails or PRV would need
    minutes and gigabytes); None when it is the one asked for."""
    used = ledger.model_bound_by() if hasattr(ledger, "model_bound_by") else asked
    if used.split(" ")[0] == asked:  # e.g. "pld (equivalent Gaussian)": the accountant asked for
        return None
    return f"The epsilon printed is the bound of {used}, not of the accountant asked for ({asked})"


def published_keys(dp) -> frozenset:
    """The round-record keys the ledger covers for this strategy (and what its parts add or withdraw)."""
    published = PUBLISHED_KEYS
    for part in dp.parts:
        published = part.publish(published)
    return published


def split_record(dp, record: dict) -> tuple[dict, dict]:
    """(what the ledger covers, the non-private diagnostics with the round number)."""
    published = published_keys(dp)
    return (
        {k: v for k, v in record.items() if k in published},
        {"round": record["round"], **{k: v for k, v in record.items() if k not in published}},
    )


def server_guarantee_caveats(dp) -> list[str]:
    """Why `epsilon_against_server` is not a guarantee (empty: it is one, or there is no such figure): what the
    parts say."""
    return [caveat for part in dp.parts for caveat in part.server_caveats(PartView(dp))]


def guarantee_marks(dp) -> dict:
    """What every per-round output carries when a figure beside it is not a guarantee (metrics.jsonl, the round's
    log line, TensorBoard and W&B, whose tags then say so): nothing when every figure is a guarantee. A part that
    publishes a paper's claimed epsilon beside the true one (wavelet noise under `paper` calibration) marks it."""
    marks = {}
    if dp.guarantee_caveats():
        marks["epsilon_is_guarantee"] = False
    if server_guarantee_caveats(dp):
        marks["epsilon_against_server_is_guarantee"] = False
    if any(part.publishes_claimed_epsilon for part in dp.parts):
        marks["claimed_epsilon_is_guarantee"] = False
    return marks


def describe_sampling(dp) -> dict:
    """The summary.json entries every DP strategy shares."""
    caveats, server_caveats = dp.guarantee_caveats(), server_guarantee_caveats(dp)
    server = (
        {"epsilon_against_server_is_guarantee": False, "epsilon_against_server_caveats": server_caveats}
        if server_caveats
        else {}
    )
    population = dp.population
    return {
        **server,
        "wrapped_strategy": type(dp.strategy).__name__,
        "client_sampling_rate": population.sample_rate,
        "client_sampling": population.client_sampling,
        "num_clients": population.num_clients,
        "expected_clients_per_round": population.expected_clients,
        "accountant": dp.ledger.accountant,
        "stop_reason": dp.record.stop_reason,
        "secure_rng": dp.run.secure_rng,
        "epsilon_is_guarantee": not caveats,
        "epsilon_caveats": caveats,
    }
