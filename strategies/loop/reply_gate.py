"""The reply gate: what a client reply must look like before a strategy reads any of it.

Every strategy passes every reply through its reply gate (`ReplyGate.accepted`), which applies these
checks; a reply that fails one is rejected (logged with the node and the reason, counted in
`rejected`, and its noise share topped up like a dropout). Nothing a client sends can raise
in the ServerApp: metric values are read only through `read_metrics`.

- arrays: the count and shapes of the global model, a float dtype, and finite after the cast
  to float32, the dtype they are aggregated in (`dpcore.privacy.mechanisms.update_problem`);
- metrics: one metric record (`metrics`, or the only one), each expected key a finite real
  scalar in its range (`MetricRule`); other keys are ignored;
- norms: under distributed noise an upload may not exceed `upload_norm_bound`.

The rules themselves (`MetricRule`, `read_metrics`, `upload_norm_bound`) are the parts' words, in
`strategies.parts.reply_rules`.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterable
from logging import DEBUG, WARNING

import numpy as np
from flwr.app import Message, RecordDict
from flwr.common import log

from dpfl.dpcore.privacy.mechanisms import flatten, update_problem
from dpfl.strategies.parts.part import PartView
from dpfl.strategies.parts.reply_rules import MetricRule, read_metrics


def node_problem(rnd, node: int, seen: set[int]) -> str | None:
    """Why a reply from `node` is not read in the round `rnd` (a `DPRound`), whatever it holds: a second reply (`seen`:
    the nodes already read), or a node the round did not sample (`rnd.nodes`; None: every node may reply), else None.
    The SecAgg+ sum's results are checked the same way (`strategies.legacy.secagg.SecureSum`)."""
    if node in seen:
        return "a second reply"
    if rnd.nodes is not None and node not in rnd.nodes:
        return "not sampled this round" if node in rnd.population else "not sampled this round (an unknown node)"
    return None


def note_problem(dp, server_round: int, problem: str) -> None:
    """A failed or rejected reply, or a client figure not aggregated, of the round `dp` has in flight: into its
    diagnostics through the strategy's gate (`ReplyGate.note`)."""
    dp.gate.note(dp.round, server_round, problem)


class ReplyGate:
    """The round loop's reply path, an object the loop holds (`DPRoundLoop.gate`), not a base of it: every train
    reply decoded by the strategy's codec and checked before anything reads it.

    Built with what it reads: the metric rules of the strategy and its parts (`metric_rules`), whether the log may
    name nodes and reasons (`publish_diagnostics`), and the strategy's two questions, whether only privatized
    (marked) updates count (`marked_only()`, distributed noise) and why a well-formed upload is still refused
    (`upload_problem(vector, metrics)`, e.g. above the norm bound). Each call is given the strategy `dp`, whose
    round in flight (`dp.round`) it reads and writes, and whose codec decodes a reply (`dp.codec`)."""

    def __init__(
        self,
        metric_rules: dict[str, MetricRule],
        publish_diagnostics: bool = False,
        marked_only: Callable[[], bool] = lambda: False,
        upload_problem: Callable[[np.ndarray, dict], str | None] = lambda vector, metrics: None,
    ) -> None:
        self.metric_rules, self.publish_diagnostics = dict(metric_rules), publish_diagnostics
        self.marked_only, self.upload_problem = marked_only, upload_problem
        self.all_failed_hinted = False  # ALL_FAILED_HINT is given once a run

    def reply_update(self, dp, content: RecordDict) -> tuple[np.ndarray | None, str | None]:
        """(flat update over the floating-point arrays, None) or (None, why the reply cannot be used). The codec
        role decodes the arrays (`strategies.parts.part.DenseCodec`: the update itself when the reply is marked
        `UPLOAD_UPDATE`, else the client's new weights)."""
        rnd = dp.round
        assert rnd.arrays is not None
        arrays, is_update = dp.codec.decode(PartView(dp), content)
        everything = rnd.everything
        if len(arrays) != len(everything):
            return None, f"expected {len(everything)} arrays, got {len(arrays)}"
        if not is_update and self.marked_only():
            return None, (
                "not privatized: under distributed noise the client adds its noise share; add "
                "dpfl.dp_privatize_mod to the ClientApp's train (a plain weights reply was sent)"
            )
        global_floats = [everything[i] for i in rnd.float_positions]
        floats = [np.asarray(arrays[i]) for i in rnd.float_positions]
        problem = update_problem(floats, [a.shape for a in global_floats])
        if problem is None and [np.shape(a) for a in arrays] != [a.shape for a in everything]:
            problem = "a non-floating-point array has the wrong shape"
        if problem:
            return None, problem
        vector = flatten(floats)
        return (vector if is_update else vector - rnd.global_vector), None

    def accepted(
        self, dp, server_round: int, replies: Iterable[Message]
    ) -> tuple[list[tuple[np.ndarray, dict]], int, int]:
        """(flat update, checked metrics) of every reply that passes the gate, and the counts of failed and rejected
        replies. Nothing in a reply can raise here.

        Who replied is the SuperLink's word (the reply's `src_node_id`), never the client's: a reply from a node this
        round did not sample, or a second reply from one node, is rejected (`node_problem`). The round's
        `accepted_replies` lists each accepted reply."""
        accepted, failures, rejected = [], 0, 0
        rnd = dp.round
        rnd.accepted_replies = []
        seen: set[int] = set()
        for msg in replies:
            node = int(msg.metadata.src_node_id)
            if not msg.has_error() and (problem := node_problem(rnd, node, seen)):
                rejected += 1
                self.note(rnd, server_round, f"rejected a reply of node {node}: {problem}")
                continue
            if msg.has_error():
                failures += 1
                self.note(rnd, server_round, f"node {msg.metadata.src_node_id} failed: {msg.error.reason}")
                continue
            try:
                vector, problem = self.reply_update(dp, msg.content)
                if problem is None:
                    metrics, problem = read_metrics(msg.content, self.metric_rules)
                if problem is None:
                    problem = self.upload_problem(vector, metrics)
            except Exception as exc:  # malformed content of any kind
                problem = f"undecodable reply ({type(exc).__name__}: {exc})"
            if problem:
                rejected += 1
                self.note(rnd, server_round, f"rejected the reply of node {msg.metadata.src_node_id}: {problem}")
                continue
            seen.add(node)
            accepted.append((vector, metrics))
            rnd.accepted_replies.append(msg)
        return accepted, failures, rejected

    def note(self, rnd, server_round: int, problem: str) -> None:
        """A failed or rejected reply: into the round's diagnostics (`rnd.problems`), and into the log only with
        publish_diagnostics (how many replies failed is a count of participants: not covered by epsilon)."""
        rnd.problems.append(problem)
        log(WARNING if self.publish_diagnostics else DEBUG, "Round %d: %s", server_round, problem)

    def warn(self, rnd, record: dict) -> None:
        """One line per round that had failed or rejected replies: how many and why, grouped by reason
        (`round_problems`). The count is a non-private diagnostic, so the line is a warning only with
        publish_diagnostics, or where every reply of the round failed or was rejected (a misconfigured run, not one
        client's data: then also, the first time, a hint at the usual causes); otherwise it is logged at DEBUG."""
        problems = round_problems(rnd.problems, record.get("failed_nodes", []))
        if not problems:
            return
        none_usable = record.get("clients", len(rnd.accepted_nodes)) == 0 and (
            record.get("failures", 0) + record.get("rejected", 0) > 0  # not an empty sample or a halted SecAgg+
        )
        reasons = Counter(NODE_ID.sub("a node", p) for p in problems)
        listed = "; ".join(f"{n} x {reason[:REASON_CHARS]}" for reason, n in reasons.most_common(REASONS))
        more = f"; and {len(reasons) - REASONS} other reasons" if len(reasons) > REASONS else ""
        log(
            WARNING if self.publish_diagnostics or none_usable else DEBUG,
            "Round %s: client replies failed, were rejected or unusable (%d): %s%s",
            record["round"],
            len(problems),
            listed,
            more,
        )
        if none_usable and not self.all_failed_hinted:
            self.all_failed_hinted = True
            log(WARNING, "%s", ALL_FAILED_HINT)


NODE_ID = re.compile(r"\bnode -?\d+\b")
REASONS, REASON_CHARS = 5, 300  # at most this many reasons a round, each this long: a client writes its error text
ALL_FAILED_HINT = (
    "No client reply of the round was usable, so the model moved by noise only. Usual causes: the ClientApp lacks "
    "the mod the server expects (the DP wrapper's dp_privatize_mod under distributed noise or SecAgg+, e.g. "
    "`@app.train(mods=[dp_privatize_mod])` or the legacy client's mods=[secaggplus_mod, dp_privatize_mod]), the "
    "client raises (its error is the reason above), or its replies do not match the model. docs/dropin.md lists "
    "the server and client lines; publish_diagnostics=True logs each reply's reason with its node"
)


def round_problems(problems: list[str], failed_nodes: list[str]) -> list[str]:
    """The round's noted problems, plus the failed nodes (`node <id>: <reason>`) none of them names."""
    named = {m.group(0) for p in problems for m in NODE_ID.finditer(p)}
    extra = []
    for entry in failed_nodes:
        node, _, reason = str(entry).partition(": ")
        if node not in named:
            extra.append(f"{node} failed: {reason}")
    return list(problems) + extra
