"""The selection role: who is sent a round's train message (docs/algorithms.md §0).

`ClientSampling` is the round loop's own selection, Poisson (each node with probability q) or fixed-size (exactly
m = round(q M)), seeded per round. DP-FTRL's participation rule (`strategies.parts.dp_ftrl.DPFTRL`) fills the same role.
A selection returns a `Selection`: the nodes, and what the ledger must know about how they were drawn.

A selection whose records are per client (DP-FTRL's participation rule; ALI-DPFL's ledgers, through its
`ClientSampling`) holds a `ClientIdentities`: the client id of each node, asked of the node
(`protocol.CLIENT_ID_QUERY`), so that a SuperNode restarted under a new node id keeps its client's record
(docs/privacy.md, "Whose record"). The round loop asks the selection's `identify` which connected nodes it may pick
(`identified_nodes`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from logging import DEBUG, INFO, WARNING

import numpy as np
from flwr.app import Message, RecordDict
from flwr.common import log

from dpfl.dpcore.privacy import protocol as keys
from dpfl.dpcore.privacy.mechanisms import TRUNCATION_PROBABILITY, make_rng, noise_share_count, truncation_probability
from dpfl.dpcore.privacy.modes import SAMPLING_FORMS, ClientSamplingMode
from dpfl.strategies.parts.part import Part


@dataclass(frozen=True)
class Selection:
    """The nodes a round sends its train message to.

    truncation_probability : P(this round's Poisson sample was truncated to n_s), reserved out of delta.
    sampled_from : (N, m) for fixed-size sampling, m of N nodes (the ledger's sampling-without-replacement bound).
    """

    nodes: list[int]
    truncation_probability: float = 0.0
    sampled_from: tuple[int, int] | None = None


class ClientSampling(Part):
    """Poisson or fixed-size sampling of the connected nodes (`client_sampling`)."""

    roles = ("selection",)
    sampling_form = SAMPLING_FORMS[ClientSamplingMode.POISSON]  # what the ledger charges (dpcore.privacy.modes)

    def __init__(self, client_sampling: str = ClientSamplingMode.POISSON, identities=None) -> None:
        self.sampling_form = SAMPLING_FORMS[client_sampling]
        self.identities: ClientIdentities | None = identities  # a strategy with per-client records (ALI-DPFL)

    def identify(self, dp, grid, server_round: int, node_ids: list[int]) -> list[int]:
        """The nodes this selection may pick: all, or with `identities`, those that hold a client id."""
        if self.identities is None:
            return node_ids
        return self.identities.resolve(grid, server_round, node_ids, round_note(dp, server_round))

    def select(self, dp, server_round: int, node_ids: list[int]) -> Selection:
        """Poisson (each with prob. q) or fixed-size (exactly m) sampling, seeded per round; a Poisson sample larger
        than n_s keeps a uniform n_s of it (probability <= 1e-12: n_s is re-derived for the round's population,
        `covering_noise_shares`; the ledger reserves the round's probability out of delta)."""
        rng = make_rng(dp.run.seed, 1, server_round, secure=dp.run.secure_rng)
        nodes = sorted(node_ids)
        if self.sampling_form.fixed_size:
            k = min(len(nodes), int(dp.population.expected_clients))
            if k < dp.population.expected_clients:
                log(
                    WARNING,
                    "Round %d: %d nodes connected, fewer than the m = %d a round samples: all %d are sampled "
                    "(charged as %d of %d; the noise is topped up to m shares)",
                    server_round,
                    len(nodes),
                    int(dp.population.expected_clients),
                    k,
                    k,
                    len(nodes),
                )
            return Selection(pick(rng, nodes, k), 0.0, (len(nodes), k))
        truncation = truncation_probability(len(nodes), dp.population.sample_rate, dp.population.noise_shares)
        sampled = [n for n, u in zip(nodes, rng.random(len(nodes))) if u < dp.population.sample_rate]
        if len(sampled) > dp.population.noise_shares:
            sampled = pick(rng, sampled, dp.population.noise_shares)
        return Selection(sampled, truncation)

    def next_truncation_probability(self, dp) -> float:
        """What the budget check assumes the next round reserves out of delta."""
        return 0.0 if self.sampling_form.fixed_size else max(TRUNCATION_PROBABILITY, dp.round.truncation_probability)


def covering_noise_shares(dp, population: int) -> int:
    """n_s for a round of `population` nodes. Poisson sampling: re-derived for the round's N
    (`noise_share_count(N, q)`: P(Binomial(N, q) >= n_s) <= 1e-12), so the noise shares cover the sample the round
    may draw whether the population grew or shrank; each client's share std sigma C / sqrt(n_s), the server's
    top-up and the ledger's truncation reserve follow it (logged when it changes). Fixed-size sampling keeps
    n_s = m (a smaller population's sample is topped up)."""
    if dp.population.client_sampling != ClientSamplingMode.POISSON:
        return dp.population.noise_shares
    shares = noise_share_count(population, dp.population.sample_rate, "poisson")
    if shares != dp.population.noise_shares:
        log(
            INFO,
            "Population %d nodes: n_s re-derived for it, %d -> %d noise shares (each client's noise std "
            "sigma C / sqrt(n_s))",
            population,
            dp.population.noise_shares,
            shares,
        )
    return shares


def pick(rng: np.random.Generator, node_ids: list[int], k: int) -> list[int]:
    """k of the node ids uniformly without replacement, sorted. Indices are drawn, not the ids: numpy would
    hold Flower's 64-bit node ids as floats and return ids of nodes that do not exist."""
    return sorted(node_ids[i] for i in rng.choice(len(node_ids), size=k, replace=False))


def round_note(dp, server_round: int) -> Callable[[str], None]:
    """How a selection notes a node it leaves out of the round: into the round's diagnostics (`dp.round.problems`),
    and into the log as a warning only with publish_diagnostics (who is connected is not covered by epsilon), as
    the reply gate notes a failed reply."""

    def note(problem: str) -> None:
        dp.round.problems.append(problem)
        log(WARNING if dp.run.publish_diagnostics else DEBUG, "Round %d: %s", server_round, problem)

    return note


def identified_nodes(dp, grid, server_round: int) -> list[int]:
    """The connected nodes the round's selection may pick: all of them, or, where the selection keys its records by
    client (it has `identify`: `ClientIdentities`), those that hold a client id this round."""
    nodes = [int(n) for n in grid.get_node_ids()]
    identify = getattr(dp.selection, "identify", None)
    return nodes if identify is None else identify(dp, grid, server_round, nodes)


QUERY_TIMEOUT = 60.0  # seconds the server waits for the nodes' answers to the identity query
# before round 1 the nodes start their first ClientApp (in a simulation under load, Ray's actors too: over 60 s was
# seen in CI), so the first ask waits this long; an exchange ends as soon as every node asked has answered
FIRST_QUERY_TIMEOUT = 600.0
KEYS_TO_SET = (
    f"node config '{keys.CLIENT_ID}' (or '{keys.PARTITION_ID}'), e.g. flower-supernode --node-config "
    f'"{keys.CLIENT_ID}=7"'
)
HANDLER = (
    f"a ClientApp of one's own answers it with app.query('{keys.CLIENT_ID_ACTION}')(answer_client_id) "
    "(from dpfl import answer_client_id)"
)


class ClientIdentities:
    """Which client each node is (node id -> client id), for records that must outlive a node id: a SuperNode that
    restarts registers under a new node id, and its client's participation record or ledger must carry over.

    Each node the server has not seen is asked once (a message of type `protocol.CLIENT_ID_QUERY`, answered by
    `clients.identity.answer_client_id` from the node config's `client-id`, else its `partition-id`). An answer is
    the node's own claim: a client id that is not an integer in [0, 2^53) is refused, and a client id that a
    connected node claimed first is refused to every later claimant while that node stays connected (a restarted
    node takes its client over once the SuperLink drops the old node id). A node refused, or without a client id,
    is left out of the round's selection, noted in the round's diagnostics (`round_note`); one that did not answer
    (an error reply, or none within QUERY_TIMEOUT; before round 1, FIRST_QUERY_TIMEOUT) is asked again the next
    round.

    The first round refuses to start where a node answered without a client id, or where no node answered one,
    naming the node-config key to set. `required = False` (ALI-DPFL): a run in which no node answers one (a
    ClientApp of one's own) keys its records by node id instead, with one warning that a restart starts a new
    record.
    """

    def __init__(self, required: bool = True) -> None:
        self.required = required
        self.claims: dict[int, int] = {}  # node id -> the client id it answered, in the order the answers came
        self.without: dict[int, str] = {}  # node id -> why it has no client id
        self.by_node_id = False  # no node answered one (required = False): records keyed by node id
        self.started = False

    def client_of(self, node: int) -> int:
        """The client id the records of `node` are kept under: its node id where they are kept by node id, or where
        no node was ever asked (a strategy driven without its selection's `identify`, as a test may)."""
        return int(node) if self.by_node_id or not self.started else self.claims[int(node)]

    def resolve(
        self, grid, server_round: int, node_ids: list[int], note: Callable[[str], None] | None = None
    ) -> list[int]:
        """The nodes of `node_ids` that hold a client id this round (sorted), the new ones asked first; each node left
        out is told to `note` (default: the log, at DEBUG)."""
        nodes = sorted({int(n) for n in node_ids})
        if self.by_node_id:
            return nodes
        new = [n for n in nodes if n not in self.claims and n not in self.without]
        unanswered = self.ask(grid, new, server_round) if new else {}
        if not self.started:
            self.start(nodes, unanswered)
            if self.by_node_id:
                return nodes
        holder: dict[int, int] = {}  # client id -> the connected node that claimed it first
        live = set(nodes)
        for node, client in self.claims.items():
            if node in live:
                holder.setdefault(client, node)
        held = set(holder.values())
        for node in nodes:
            if node in held:
                continue
            if node in self.claims:
                client = self.claims[node]
                why = f"client id {client} is held by node {holder[client]}, which claimed it first and is connected"
            else:
                why = self.without.get(node) or unanswered.get(node) or "it did not answer"
            (note or (lambda problem: log(DEBUG, "Round %d: %s", server_round, problem)))(
                f"node {node} is not sampled: {why}"
            )
        return sorted(held)

    def ask(self, grid, nodes: list[int], server_round: int) -> dict[int, str]:
        """Ask `nodes` their client id (in the round's group, as Flower's strategies send their messages): claims and
        refusals recorded; {node: why} of those that did not answer."""
        messages = [
            Message(RecordDict(), dst_node_id=n, message_type=keys.CLIENT_ID_QUERY, group_id=str(server_round))
            for n in nodes
        ]
        timeout = QUERY_TIMEOUT if self.started else FIRST_QUERY_TIMEOUT
        replies = list(grid.send_and_receive(messages, timeout=timeout))
        sent_to = {m.metadata.message_id: m.metadata.dst_node_id for m in messages if m.metadata.message_id}
        unanswered = {n: f"no answer to the identity query within {timeout:g} s" for n in nodes}
        for reply in replies:
            node = int(sent_to.get(reply.metadata.reply_to_message_id, reply.metadata.src_node_id))
            if node not in unanswered:
                continue  # not asked, or a second reply
            if reply.has_error():
                unanswered[node] = f"its identity query failed ({reply.error.reason})"
                continue
            del unanswered[node]
            record = reply.content.config_records.get(keys.CLIENT_IDENTITY)
            value = None if record is None else record.get(keys.CLIENT_ID)
            if record is None:
                self.without[node] = f"its reply to the identity query has no '{keys.CLIENT_IDENTITY}' record"
            elif value is None:
                self.without[node] = f"its node config names no client: set {KEYS_TO_SET}"
            elif not isinstance(value, int) or isinstance(value, bool):
                self.without[node] = f"its client id {value!r} is not an integer"
            elif not 0 <= value < keys.MAX_CLIENT_ID:
                self.without[node] = f"its client id {value} is outside [0, 2^53)"
            else:
                self.claims[node] = value
        return unanswered

    def start(self, nodes: list[int], unanswered: dict[int, str]) -> None:
        """The first round's rule (class docstring): refuse, key by node id, or go on."""
        self.started = True
        offered = [n for n in nodes if n in self.claims]
        without = [f"node {n}: {self.without[n]}" for n in nodes if n in self.without]
        if without and (offered or self.required):
            raise ValueError(
                f"{len(without)} of {len(nodes)} nodes offer no client id ({'; '.join(without[:5])}"
                f"{'; ...' if len(without) > 5 else ''}): the per-client records (DP-FTRL's participation limits, "
                f"ALI-DPFL's ledgers) are kept by client id, so that a restarted SuperNode keeps its record; set "
                f"{KEYS_TO_SET} on every SuperNode"
            )
        if offered:
            return
        if self.required:
            reasons = "; ".join(f"node {n}: {why}" for n, why in list(unanswered.items())[:3])
            raise ValueError(
                f"no node answered the identity query ({reasons}): DP-FTRL keeps each client's participation record "
                "by its client id, and refuses to start where it cannot tell a restarted SuperNode (a new node id) "
                f"from a new client; {HANDLER}, with {KEYS_TO_SET}"
            )
        self.by_node_id = True
        log(
            WARNING,
            "No node answered the identity query (the first: %s): the per-client records are kept by node id, and a "
            "SuperNode that restarts (a new node id) starts a new record, which the printed epsilon does not cover; %s",
            next(iter(unanswered.values()), "no node connected"),
            HANDLER,
        )

    def state_dict(self) -> dict:
        """Whether the records are kept by node id (the claims are asked again after a resume)."""
        return {"by_node_id": self.by_node_id}

    def load_state_dict(self, state: dict) -> None:
        self.by_node_id = bool(state.get("by_node_id", False))
        self.started = self.by_node_id
