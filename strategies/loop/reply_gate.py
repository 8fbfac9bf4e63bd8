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

A failed reply (an error) is noted with the client's own exception line (`client_exception`), not the text of the
transport that carried it. Until a round of the run has had a usable reply, a round in which every sampled client
failed stops the run before anything of it is released or charged (`stop_if_every_client_failed`). Rejections on a
model that diverged are reported as divergence, with a hint, not as hostile replies (`ReplyGate.divergence`).

The rules themselves (`MetricRule`, `read_metrics`, `upload_norm_bound`) are the parts' words, in
`strategies.parts.reply_rules`.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable, Iterable
from logging import DEBUG, WARNING

import numpy as np
from flwr.app import Message, RecordDict
from flwr.common import log

from dpfl.dpcore.privacy.mechanisms import flatten, l2_norm, update_problem
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
        self.diverged_hinted = False  # DIVERGED_HINT too
        self.first_model_norm: float | None = None  # ||w|| of the first global model the gate saw (`divergence`)

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
        replies = list(replies)
        seen: set[int] = set()
        failed: list[str] = []  # the failed clients' own exception lines, in order
        rejections: list[str] = []  # why each reply was rejected
        for msg in replies:
            node = int(msg.metadata.src_node_id)
            if not msg.has_error() and (problem := node_problem(rnd, node, seen)):
                rejected += 1
                rejections.append(problem)
                self.note(rnd, server_round, f"rejected a reply of node {node}: {problem}")
                continue
            if msg.has_error():
                failures += 1
                failed.append(client_exception(msg.error.reason))
                self.note(rnd, server_round, f"node {msg.metadata.src_node_id} failed: {failed[-1]}")
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
                rejections.append(problem)
                self.note(rnd, server_round, f"rejected the reply of node {msg.metadata.src_node_id}: {problem}")
                continue
            seen.add(node)
            accepted.append((vector, metrics))
            rnd.accepted_replies.append(msg)
        if not accepted and not rejected:  # every reply an error; a sampled node without one hung or went away
            silent = max(0, len(rnd.nodes) - len(replies)) if rnd.nodes is not None else 0
            stop_if_every_client_failed(dp, server_round, failures + silent, failed)
        rnd.diverged = self.divergence(rnd, len(replies) - failures, rejections)
        return accepted, failures, rejected

    def divergence(self, rnd, read: int, rejections: list[str]) -> str | None:
        """Why the round's rejected replies are a diverged model's rather than hostile ones, or None: the global
        model sent this round holds NaN or Inf, or its norm is above DIVERGED_GROWTH times the first global model's
        the gate saw (where that was > 0); or more than half of the `read` replies (those that were not errors) were
        rejected for non-finite or huge values (`blown_up`). The first model's norm is taken at the gate's first
        round (round 1, or the first after a resume); later norms only in a round with a rejection."""
        if self.first_model_norm is None:
            self.first_model_norm = l2_norm(rnd.global_vector)
        if not rejections:
            return None
        norm, first = l2_norm(rnd.global_vector), self.first_model_norm
        if not math.isfinite(norm):
            return "the global model holds NaN or Inf"
        if math.isfinite(first) and first > 0 and norm > DIVERGED_GROWTH * first:
            return f"the global model's norm is {norm:.3g}, {norm / first:.3g} times the first round's {first:.3g}"
        blown = sum(map(blown_up, rejections))
        if read and blown > read / 2:
            return f"{blown} of {read} replies hold non-finite or huge values"
        return None

    def note(self, rnd, server_round: int, problem: str) -> None:
        """A failed or rejected reply: into the round's diagnostics (`rnd.problems`), and into the log only with
        publish_diagnostics (how many replies failed is a count of participants: not covered by epsilon)."""
        rnd.problems.append(problem)
        log(WARNING if self.publish_diagnostics else DEBUG, "Round %d: %s", server_round, problem)

    def warn(self, rnd, record: dict) -> None:
        """One line per round that had failed or rejected replies: how many and why, grouped by reason
        (`round_problems`). The count is a non-private diagnostic, so the line is a warning only with
        publish_diagnostics, where every reply of the round failed or was rejected, or where the model diverged (a
        misconfigured run, not one client's data: then also, the first time, a hint at the usual causes, or at
        what makes a model diverge); otherwise it is logged at DEBUG."""
        problems = round_problems(rnd.problems, record.get("failed_nodes", []))
        if not problems:
            return
        none_usable = record.get("clients", len(rnd.accepted_nodes)) == 0 and (
            record.get("failures", 0) + record.get("rejected", 0) > 0  # not an empty sample or a halted SecAgg+
        )
        reasons = Counter(NODE_ID.sub("a node", p) for p in problems)
        listed = "; ".join(f"{n} x {reason[:REASON_CHARS]}" for reason, n in reasons.most_common(REASONS))
        more = f"; and {len(reasons) - REASONS} other reasons" if len(reasons) > REASONS else ""
        diverged = f"the global model diverged ({rnd.diverged}), so " if rnd.diverged else ""
        log(
            WARNING if self.publish_diagnostics or none_usable or rnd.diverged else DEBUG,
            "Round %s: %sclient replies failed, were rejected or unusable (%d): %s%s",
            record["round"],
            diverged,
            len(problems),
            listed,
            more,
        )
        if rnd.diverged and not self.diverged_hinted:
            self.diverged_hinted = True
            log(WARNING, "%s", DIVERGED_HINT)
        elif none_usable and not rnd.diverged and not self.all_failed_hinted:
            self.all_failed_hinted = True
            log(WARNING, "%s", ALL_FAILED_HINT)


class EveryClientFailed(RuntimeError):
    """Every sampled client failed in a round before any reply of the run was usable: the run stops
    (`stop_if_every_client_failed`)."""


def stop_if_every_client_failed(dp, server_round: int, failed: int, reasons: list[str]) -> None:
    """Stop the run, before the round releases or charges anything, when all of the round's sampled clients
    (`dp.round.nodes`; none known: the `failed` themselves) failed, `failed` of them (an error reply, or none at
    all), and no earlier round of the run had a usable reply (a record with clients > 0): a leading round in which
    every client fails is a misconfigured run (a ClientApp that raises on the server's message), not a
    client's bad luck. Later, such a round releases noise only, is charged, and gets a warning
    (`ReplyGate.warn`). Raises EveryClientFailed naming the first client's own exception (`reasons`, in order)."""
    sampled = len(dp.round.nodes) if dp.round.nodes is not None else failed
    if not failed or failed < sampled or any(int(r.get("clients", 0)) > 0 for r in dp.record.history):
        return
    message = (
        f"Round {server_round}: every sampled client failed ({failed} of {sampled}) and no earlier round had a usable "
        f"reply, so the run stops before this round releases or charges anything. The first client's error: "
        f"{reasons[0] if reasons else NO_REPLY}. {EVERY_CLIENT_FAILED_HINT}"
    )
    dp.record.stop_reason = message
    log(WARNING, "%s", message)
    raise EveryClientFailed(message)


NO_REPLY = "no reply before round-timeout"
NODE_ID = re.compile(r"\bnode -?\d+\b")
REASONS, REASON_CHARS = 5, 300  # at most this many reasons a round, each this long: a client writes its error text
ALL_FAILED_HINT = (
    "No client reply of the round was usable, so the model moved by noise only. Usual causes: the ClientApp lacks "
    "the mod the server expects (the DP wrapper's dp_privatize_mod under distributed noise or SecAgg+, e.g. "
    "`@app.train(mods=[dp_privatize_mod])` or the legacy client's mods=[secaggplus_mod, dp_privatize_mod]), the "
    "client raises (its error is the reason above), or its replies do not match the model. docs/dropin.md lists "
    "the server and client lines; publish_diagnostics=True logs each reply's reason with its node"
)


EVERY_CLIENT_FAILED_HINT = (
    "Usual causes: the ClientApp raises on the server's train message, e.g. Flower's fixedclipping_mod without "
    "Flower's DifferentialPrivacyClientSideFixedClipping on the server (KeyError: clipping_norm): with dpfl's "
    "server wrapper the clients use dpfl.dp_privatize_mod (docs/dropin.md lists the server and client lines)"
)
DIVERGED_GROWTH = 100.0  # a global model whose norm grew above this many times the first one's has diverged
DIVERGED_HINT = (
    "The global model diverged, and the replies rejected on it are honest clients' updates, not hostile ones: too "
    "few clients a round for this noise (the noise on the average update is about sigma*C*sqrt(d)/m). Raise "
    "sample-rate or the number of clients, or lower noise-multiplier or lr"
)
FLOWER_REASON = re.compile(r"<class '(?P<type>[^']*)'>:<'(?P<text>.*)'>", re.DOTALL)
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")
BLOWN_UP = re.compile(r"NaN or Inf|is not finite|= (?P<value>\S+) is outside \[\S+, (?P<high>[^\]]+)\]")


def client_exception(reason: str) -> str:
    """The client's own exception line in a failed reply's `Error.reason`. Flower's SuperNode writes
    "<class 'KeyError'>:<'<str of the exception>'>", its Ray simulation "<class 'ray.exceptions.RayTaskError(
    ClientAppException)'>:<'<Ray's traceback>'>", in which the first exception line after a frame (Python prints
    the cause first) is the client's own, e.g. "KeyError: 'The clipping_norm value is not supplied ...'". Any other
    reason (this project's grids, the SuperLink's own) as it is."""
    text = ANSI_ESCAPE.sub("", str(reason)).strip()
    match = FLOWER_REASON.fullmatch(text)
    if match is None:
        return text
    lines = match["text"].splitlines()
    for before, line in zip(lines, lines[1:]):
        if before.startswith(" ") and line[:1] not in ("", " ") and not line.startswith(("The above", "During")):
            return line  # the first line at column 0 after a frame: an exception line
    return f"{match['type']}: {match['text']}" if match["text"] else match["type"]


def blown_up(problem: str) -> bool:
    """Whether a rejection names non-finite values, or a metric above its range (e.g. an update norm above 1e15)."""
    match = BLOWN_UP.search(problem)
    if match is None:
        return False
    if match["value"] is None:
        return True
    try:
        return float(match["value"]) > float(match["high"])
    except ValueError:
        return False


def round_problems(problems: list[str], failed_nodes: list[str]) -> list[str]:
    """The round's noted problems, plus the failed nodes (`node <id>: <reason>`) none of them names, and the
    failures that name no node (a legacy workflow's: `a node failed: <reason>`)."""
    named = {m.group(0) for p in problems for m in NODE_ID.finditer(p)}
    extra = []
    for entry in map(str, failed_nodes):
        node, _, reason = entry.partition(": ")
        if NODE_ID.fullmatch(node) is None:
            extra.append(f"a node failed: {entry}")
        elif node not in named:
            extra.append(f"{node} failed: {reason}")
    return list(problems) + extra
