"""What a DP run records beyond each round's line: its checkpoint state and the guarantee it can state
(summary.json's sampling entries and caveats, the not-a-guarantee marks every round carries). A job of the round
loop (`DPRoundLoop`), kept apart from its Flower-facing loop."""

from __future__ import annotations

from flwr.app import MetricRecord


def bound_note(asked: str, ledger) -> str | None:
    """A line for the log when the printed epsilon is another bound than the accountant asked for (the tighter of
    two valid bounds under fixed-size sampling, DP-FTRL's tree bound, or RDP where PLD fails or PRV would need
    minutes and gigabytes); None when it is the one asked for."""
    used = ledger.model_bound_by() if hasattr(ledger, "model_bound_by") else asked
    if used.split(" ")[0] == asked:  # e.g. "pld (equivalent Gaussian)": the accountant asked for
        return None
    return f"The epsilon printed is the bound of {used}, not of the accountant asked for ({asked})"


class RunRecord:
    """The checkpoint state (`state_dict`, with the strategy's `extra_state`, its parts' and its ledger's) and the
    statements about the guarantee (`guarantee_caveats`, `guarantee_marks`, `describe_sampling`)."""

    parts: list = []  # strategies.parts.part.Part

    def state_dict(self) -> dict:
        """Everything a resumed run needs, JSON-serializable (the ledger's own state included)."""
        return {
            "completed_rounds": self.completed_rounds,
            "history": self.history,
            "stop_reason": self.stop_reason,
            "num_clients": self.num_clients,
            "expected_clients": self.expected_clients,
            "noise_shares": self.noise_shares,
            "ledger": None if self.ledger is None else self.ledger.state_dict(),
            **self.extra_state(),
            **{k: v for part in self.parts for k, v in part.state_dict().items()},
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue after `state["completed_rounds"]` with the ledger as it was then."""
        self.completed_rounds = int(state["completed_rounds"])
        self.history = list(state["history"])
        self.stop_reason = state["stop_reason"]
        self.num_clients, self.expected_clients = int(state["num_clients"]), float(state["expected_clients"])
        self.noise_shares = int(state["noise_shares"])
        self.ledger = None if state["ledger"] is None else self.ledger_from_state(state["ledger"])
        self.load_extra_state(state)
        for part in self.parts:
            part.load_state_dict(state)

    def extra_state(self) -> dict:
        """The strategy's own state beyond the round loop's."""
        return {}

    def load_extra_state(self, state: dict) -> None:
        pass

    def ledger_from_state(self, state: dict):
        raise NotImplementedError

    def client_evaluation_record(self, metrics: MetricRecord) -> dict:
        """How the clients' aggregated evaluation metrics appear in the round's record."""
        return {f"client_{k}": v for k, v in metrics.items()}

    def round_details(self) -> dict:
        """Entries for the round record that are not metrics (MetricRecord holds numbers only)."""
        return {"problems": list(self.round.problems)} if self.round.problems else {}

    def guarantee_caveats(self) -> list[str]:
        """Why the printed epsilon is not a guarantee (empty: it is one)."""
        if not self.secure_rng:
            return ["noise derivable from the seed (secure-rng = false): anyone who knows 'seed' can remove it"]
        return []

    def server_guarantee_caveats(self) -> list[str]:
        """Why `epsilon_against_server` is not a guarantee (empty: it is one, or there is no such figure): what
        the parts say."""
        return [caveat for part in self.parts for caveat in part.server_caveats(self)]

    def guarantee_marks(self) -> dict:
        """What every per-round output carries when a figure beside it is not a guarantee (metrics.jsonl, the
        round's log line, TensorBoard and W&B, whose tags then say so): nothing when both are guarantees."""
        marks = {}
        if self.guarantee_caveats():
            marks["epsilon_is_guarantee"] = False
        if self.server_guarantee_caveats():
            marks["epsilon_against_server_is_guarantee"] = False
        if self.publishes_claimed_epsilon():
            marks["claimed_epsilon_is_guarantee"] = False
        return marks

    def publishes_claimed_epsilon(self) -> bool:
        """Whether the rounds publish a paper's claimed epsilon beside the true one (wavelet noise under `paper`
        calibration): that figure is no guarantee."""
        return any(part.publishes_claimed_epsilon for part in self.parts)

    def describe_diagnostics(self) -> dict:
        """End-of-run figures computed from raw client replies (diagnostics-summary.json, not private)."""
        rounds = [r for r in self.history if "problems" in r]
        diagnostics = {"rounds_with_failed_or_rejected_replies": [r["round"] for r in rounds]} if rounds else {}
        for part in self.parts:
            diagnostics.update(part.describe_diagnostics(self))
        return diagnostics

    def describe_sampling(self) -> dict:
        """The summary.json entries every DP strategy shares."""
        caveats, server_caveats = self.guarantee_caveats(), self.server_guarantee_caveats()
        server = (
            {"epsilon_against_server_is_guarantee": False, "epsilon_against_server_caveats": server_caveats}
            if server_caveats
            else {}
        )
        return {
            **server,
            "wrapped_strategy": type(self.strategy).__name__,
            "client_sampling_rate": self.sample_rate,
            "client_sampling": self.client_sampling,
            "num_clients": self.num_clients,
            "expected_clients_per_round": self.expected_clients,
            "accountant": self.accountant,
            "stop_reason": self.stop_reason,
            "secure_rng": self.secure_rng,
            "epsilon_is_guarantee": not caveats,
            "epsilon_caveats": caveats,
        }
