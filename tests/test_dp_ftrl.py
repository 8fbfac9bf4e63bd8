"""DP-FTRL (issue 27, item 4; Kairouz et al., arXiv 2103.00039): the binary tree's prefix-sum noise (its std is
sigma C sqrt(nodes summed), and prefix sums share their nodes), the participation rule (ineligible nodes are not
sent a message and their replies are refused), epsilon against dp-accounting used directly, the FTRL model with
momentum, refused settings, and an in-process run of the app that learns."""

import logging
import math
from dataclasses import replace
from types import SimpleNamespace

import dp_accounting
import numpy as np
import pytest
from dp_accounting import pld, rdp
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg

from dpfl.clients.identity import answer_client_id
from dpfl.dpcore.privacy.accountants import epsilon_of, tree_gaussian_multiplier
from dpfl.dpcore.privacy.ledger import TreeAggregationLedger
from dpfl.dpcore.privacy.mechanisms import make_rng
from dpfl.dpcore.privacy.settings import SettingError
from dpfl.dpcore.privacy.tree_aggregation import TreeNoise, nodes_in_prefix, tree_depth
from dpfl.fl_app.client_app import app as client_app
from dpfl.fl_app.config import ConfigError, validate
from dpfl.fl_app.results import read_metrics
from dpfl.fl_app.server_app import run_federated
from dpfl.strategies import DifferentialPrivacy
from dpfl.strategies.loop.wrapped import reply_message
from dpfl.strategies.parts.dp_ftrl import DPFTRL
from dpfl_tools.inprocess import InProcessGrid

logging.getLogger("absl").setLevel(logging.ERROR)


def rel_tolerance(n: int, sds: float = 6.0) -> float:
    """The relative error of a sample std of n normals that is exceeded with negligible probability."""
    return sds / math.sqrt(2 * n)


def test_each_prefix_sums_popcount_nodes_of_std_sigma_c_and_shares_them_with_later_prefixes():
    dim, std = 100_000, 1.5
    tree = TreeNoise(dim, std, lambda t: make_rng(0, 1, t, secure=True))
    prefixes = [tree.next_prefix_noise().astype(np.float64) for _ in range(16)]
    for t, z in enumerate(prefixes, start=1):
        assert z.std() == pytest.approx(std * math.sqrt(nodes_in_prefix(t)), rel=rel_tolerance(dim))
        assert len(tree.nodes) <= tree_depth(16)
    assert [nodes_in_prefix(t) for t in (1, 2, 3, 4, 7, 8, 15, 16)] == [1, 1, 2, 1, 3, 1, 4, 1]
    z = dict(enumerate(prefixes, start=1))
    # Z_5 = node[1,4] + node[5]: Z_5 - Z_4 is one fresh node, independent of Z_4; Z_7 - Z_6 likewise
    for a, b in ((4, 5), (6, 7)):
        assert (z[b] - z[a]).std() == pytest.approx(std, rel=rel_tolerance(dim))
        assert np.corrcoef(z[a], z[b] - z[a])[0, 1] == pytest.approx(0.0, abs=6 / math.sqrt(dim))
    # Z_4 and Z_6 share node [1,4]: covariance std^2 (one node) out of variances std^2 and 2 std^2
    assert np.cov(z[4], z[6])[0, 1] == pytest.approx(std**2, rel=0.03)
    # one leaf enters at most one released node per level: ceil(log2(T + 1))
    assert [tree_depth(t) for t in (1, 2, 3, 4, 7, 8, 100)] == [1, 2, 2, 3, 3, 4, 7]


def unchanged_weights_client() -> ClientApp:
    """A client whose update is zero (it sends back the weights it got): the model moves by the noise alone. It
    answers the server's identity query (DP-FTRL keeps its records by client id)."""
    app = ClientApp()
    app.query("client_id")(answer_client_id)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        return Message(
            RecordDict({"arrays": msg.content["arrays"], "metrics": MetricRecord({"num-examples": 1})}), reply_to=msg
        )

    return app


def trains(msg: Message) -> bool:
    """A train message (the grid also carries the identity queries)."""
    return msg.metadata.message_type == "train"


def test_the_released_model_carries_the_tree_noise_of_the_nodes_summed_across_epochs():
    """w_t - w_0 = eta Z_t / m: std eta sigma C sqrt(nodes) / m, with a completed epoch's total carried over."""
    nodes, dim, sigma, clip, eta, epoch_rounds = 8, 100_000, 2.0, 0.1, 0.5, 3
    strategy = DifferentialPrivacy(
        FedAvg(fraction_evaluate=0.0),
        clipping_norm=clip,
        noise_multiplier=sigma,
        sample_rate=0.25,
        noise_placement="central",
        server_learning_rate=eta,
        min_available_nodes=nodes,
        ftrl=DPFTRL(epoch_rounds=epoch_rounds),
    )
    start = ArrayRecord({"w": Array(np.zeros(dim, np.float32))})
    grid = InProcessGrid(unchanged_weights_client(), nodes, {})
    models = []
    strategy.run = replace(
        strategy.run, on_checkpoint=lambda state, arrays: models.append(arrays["w"].numpy().astype(np.float64))
    )
    strategy.start(grid, start, num_rounds=7)
    m = strategy.mechanism.clients_per_round  # the DPFTRL part fills the mechanism role
    assert m == 2
    # rounds 1-3: tree 1 at steps 1, 2, 3; rounds 4-6: Z of tree 1 at step 3 (2 nodes) + tree 2; round 7: + tree 3
    expected_nodes = [1, 1, 2, 2 + 1, 2 + 1, 2 + 2, 2 + 2 + 1]
    for model, count in zip(models, expected_nodes):
        assert model.std() == pytest.approx(eta * sigma * clip * math.sqrt(count) / m, rel=rel_tolerance(dim))
    assert strategy.ledger.trees == [[sigma, 3], [sigma, 3], [sigma, 1]]


def test_a_node_takes_part_at_most_once_per_epoch_and_ineligible_replies_are_refused():
    nodes, epoch_rounds = 10, 4
    strategy = DifferentialPrivacy(
        clipping_norm=1.0,
        noise_multiplier=1.0,
        sample_rate=0.3,
        noise_placement="central",
        min_available_nodes=nodes,
        ftrl=DPFTRL(epoch_rounds=epoch_rounds),
    )
    grid = InProcessGrid(unchanged_weights_client(), nodes, {})
    strategy.start(grid, ArrayRecord({"w": Array(np.zeros(4, np.float32))}), num_rounds=8)
    sent = [(int(m.content["config"]["server-round"]), m.metadata.dst_node_id) for m in grid.sent if trains(m)]
    # m = round(0.3 * 10) = 3 per round while 3 are eligible: 3, 3, 3, then the 1 left, per epoch of 4 rounds
    per_round = [sum(1 for r, _ in sent if r == rnd) for rnd in range(1, 9)]
    assert per_round == [3, 3, 3, 1, 3, 3, 3, 1]
    for epoch in (0, 1):
        in_epoch = [node for r, node in sent if (r - 1) // epoch_rounds == epoch]
        assert sorted(in_epoch) == sorted(set(in_epoch)) == list(range(100, 100 + nodes))  # each exactly once

    # round 9 (epoch 2): replies from a node not sent this round's message, and a second reply, are refused
    arrays = ArrayRecord({"w": Array(np.zeros(4, np.float32))})
    messages = list(strategy.configure_train(9, arrays, ConfigRecord(), grid))
    chosen = [m.metadata.dst_node_id for m in messages]
    outsider = next(n for n in grid.get_node_ids() if n not in chosen)
    update = RecordDict(
        {"arrays": ArrayRecord({"w": Array(np.ones(4, np.float32))}), "metrics": MetricRecord({"num-examples": 1})}
    )
    replies = [reply_message(chosen[0], update), reply_message(chosen[0], update), reply_message(outsider, update)]
    _, metrics = strategy.aggregate_train(9, replies)
    assert metrics["clients"] == 1 and metrics["rejected"] == 2
    problems = strategy.round.problems
    assert any(f"rejected a reply of node {chosen[0]}: a second reply" in p for p in problems)
    assert any(f"rejected a reply of node {outsider}: not sampled this round" in p for p in problems)
    # round 10 (same epoch): the nodes of round 9 are not asked again
    again = [m.metadata.dst_node_id for m in strategy.configure_train(10, arrays, ConfigRecord(), grid)]
    assert not set(again) & set(chosen)


def dp_accounting_tree_epsilons(sigma: float, trees: list[int], delta: float) -> tuple[float, float]:
    """(RDP epsilon of the tree events, PLD epsilon of the equivalent Gaussian), with dp-accounting directly."""
    acc = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_SPECIAL)
    for steps in trees:
        acc.compose(dp_accounting.SingleEpochTreeAggregationDpEvent(sigma, steps))
    depth = sum(math.ceil(math.log2(steps + 1)) for steps in trees)
    exact = pld.PLDAccountant(value_discretization_interval=1e-4)
    exact.compose(dp_accounting.GaussianDpEvent(sigma / math.sqrt(depth)))
    return acc.get_epsilon(delta), exact.get_epsilon(delta)


@pytest.mark.parametrize("sigma, epoch_rounds, rounds", [(1.0, 10, 50), (2.0, 100, 100), (0.8, 7, 30), (4.0, 1, 20)])
def test_epsilon_against_dp_accounting(sigma, epoch_rounds, rounds):
    delta = 1e-5
    ledger = TreeAggregationLedger(delta, "pld", epoch_rounds)
    for _ in range(rounds):
        ledger.record_round(sigma)
    trees = [min(epoch_rounds, rounds - start) for start in range(0, rounds, epoch_rounds)]
    assert ledger.trees == [[sigma, n] for n in trees]
    rdp_eps, gaussian_eps = dp_accounting_tree_epsilons(sigma, trees, delta)
    assert ledger.rdp_epsilon() == pytest.approx(rdp_eps, rel=1e-9)
    assert ledger.epsilon() == pytest.approx(min(rdp_eps, gaussian_eps), rel=0.01)
    assert ledger.epsilon() >= gaussian_eps * (1 - 1e-3)  # the pessimistic PLD never below the exact figure
    assert tree_gaussian_multiplier([tuple(t) for t in ledger.trees]) == pytest.approx(
        sigma / math.sqrt(sum(t.bit_length() for t in trees))
    )
    # the RDP ledger's epsilon: the same two bounds, the Gaussian one by Opacus' RDP
    rdp_ledger = TreeAggregationLedger.from_state_dict({**ledger.state_dict(), "accountant": "rdp"})
    assert rdp_ledger.epsilon() <= rdp_eps * (1 + 1e-9)
    assert rdp_ledger.epsilon() >= gaussian_eps


def test_single_participation_is_one_tree_and_cheaper_than_no_amplification_dp_fedavg():
    """b >= T: one SingleEpochTreeAggregationDpEvent(sigma, T) (depth 7 for 100 rounds) against DP-FedAvg's 100
    Gaussian releases at sigma without amplification (what is honest when sampling is not uniform)."""
    sigma, rounds, delta = 2.0, 100, 1e-5
    ledger = TreeAggregationLedger(delta, "pld", rounds)
    for _ in range(rounds):
        ledger.record_round(sigma)
    no_amplification = pld.PLDAccountant(value_discretization_interval=1e-4)
    no_amplification.compose(dp_accounting.GaussianDpEvent(sigma), rounds)
    assert ledger.trees == [[sigma, rounds]]
    assert ledger.epsilon() < no_amplification.get_epsilon(delta) / 3
    # b = 1 (every node may take part in every round): a tree of one leaf per round is DP-FedAvg without
    # amplification exactly
    every_round = TreeAggregationLedger(delta, "pld", 1)
    for _ in range(rounds):
        every_round.record_round(sigma)
    assert every_round.epsilon() == pytest.approx(no_amplification.get_epsilon(delta), rel=0.01)
    assert every_round.epsilon() == epsilon_of([(sigma, 1.0, rounds)], delta)


def test_the_ftrl_model_and_its_momentum_form():
    """Without noise (only here, on the part itself) the model is w_0 + eta sum_t u / m, or with momentum gamma
    w_0 + eta sum_t v_t / m, v_t = gamma v_{t-1} + u_t."""
    u, eta, m, gamma = np.array([1.0, -2.0], np.float32), 0.5, 4, 0.9
    for momentum in (0.0, gamma):
        part = DPFTRL(epoch_rounds=3, momentum=momentum)
        strategy = SimpleNamespace(
            population=SimpleNamespace(sample_rate=0.5, num_clients=8),
            privacy=SimpleNamespace(accountant="pld", noise_multiplier=0.0, clipping_norm=1.0),
            run=SimpleNamespace(seed=0, secure_rng=True, server_learning_rate=eta),
        )
        strategy.ledger = part.make_ledger(strategy, 1e-5)
        w0, v, total = np.array([3.0, 3.0], np.float32), 0.0, 0.0
        for rnd in range(1, 8):
            new, _ = part.release(strategy, rnd, [u / 2, u / 2], w0 + 123, 2)  # the current model is not used: w_0 is
            strategy.ledger.record_round(part.accounted_noise_multiplier(strategy))  # what the wrapper charges
            v = momentum * v + u
            total = total + v
            np.testing.assert_allclose(new, w0 + 123 + eta * total / m, rtol=1e-5)
        assert strategy.ledger.trees == [[0.0, 3], [0.0, 3], [0.0, 1]]


@pytest.mark.parametrize(
    "settings, match",
    [
        (dict(noise_placement="distributed"), "noise_placement"),
        (dict(noise_placement="central", secure_aggregation=True), "secure_aggregation"),
        (dict(noise_placement="central", target_epsilon=5.0, target_epsilon_mode="calibrate"), "target_epsilon_mode"),
        (dict(noise_placement="central", audit_canaries=4), "audit_canaries"),
    ],
)
def test_settings_it_cannot_honour_are_refused(settings, match):
    with pytest.raises(SettingError, match=match):
        DifferentialPrivacy(clipping_norm=1.0, noise_multiplier=1.0, sample_rate=0.5, ftrl=DPFTRL(), **settings)


def test_the_run_config_route_refuses_what_it_cannot_honour(tmp_path):
    base = {"algorithm": "dp-ftrl", "results-dir": str(tmp_path)}
    for extra, match in (
        (dict(resume=True), "resume"),
        ({"server-strategy": "fedadam"}, "server-strategy"),
        ({"noise-placement": "local"}, "noise-placement"),
        ({"client-sampling": "fixed"}, "client-sampling"),
        ({"ftrl-momentum": 1.0}, "ftrl-momentum"),
    ):
        with pytest.raises(ConfigError, match=match):
            validate({**base, **extra})
    with pytest.raises(ConfigError, match="ftrl-epoch-rounds.*dp-ftrl"):
        validate({"algorithm": "dp-fedavg", "ftrl-epoch-rounds": 3})


def test_the_app_learns_under_dp_ftrl_and_prints_the_ledgers_epsilon(tmp_path):
    clients, rounds = 20, 10
    cfg = validate(
        {
            "dataset": "digits",
            "model": "mlp",
            "partitioner": "iid",
            "local-steps": 5,
            "batch-size": 16,
            "num-rounds": rounds,
            "sample-rate": 0.25,
            "min-nodes": clients,
            "algorithm": "dp-ftrl",
            "noise-multiplier": 0.6,  # the default 1.0 ended at or below 0.3 in 2 of 200 runs (noise from OS entropy)
            "results-dir": str(tmp_path),
        }
    )
    summary = run_federated(InProcessGrid(client_app, clients, cfg), cfg)
    rounds_published = read_metrics(tmp_path)
    assert len(rounds_published) == rounds
    assert summary["ftrl"]["clients_per_round"] == 5 and summary["ftrl"]["epoch_rounds"] == 4  # 20 // 5
    assert summary["final_accuracy"] > 0.3  # chance: 0.1; 150 runs: 0.77 +- 0.05, lowest 0.61
    rdp_eps, gaussian_eps = dp_accounting_tree_epsilons(cfg.privacy.noise_multiplier, [4, 4, 2], summary["delta"])
    assert summary["epsilon"] == pytest.approx(min(rdp_eps, gaussian_eps), rel=0.01)
    assert summary["ledger"]["rdp_tree_epsilon"] == pytest.approx(rdp_eps, rel=1e-9)
    assert rounds_published[-1]["epsilon"] == summary["epsilon"]


def test_the_superlinks_64_bit_node_ids_are_kept_exactly():
    """flwr's node ids go up to 2^64 - 1; numpy would round them through float64."""
    part = DPFTRL(epoch_rounds=2)
    strategy = SimpleNamespace(
        population=SimpleNamespace(sample_rate=0.5, num_clients=4),
        privacy=SimpleNamespace(accountant="pld"),
        run=SimpleNamespace(seed=0, secure_rng=True),
    )
    part.make_ledger(strategy, 1e-5)
    ids = [2**64 - 1, 2**63 + 12345, 9876543210987654321, 17]
    part.identities.claims, part.identities.started = {n: i for i, n in enumerate(ids)}, True  # clients 0-3
    first = part.select(strategy, 1, ids).nodes
    second = part.select(strategy, 2, ids).nodes
    assert len(first) == len(second) == 2 and sorted(first + second) == sorted(ids)
    assert all(type(n) is int for n in first + second)  # exact ids, which the reply gate matches replies against


def test_the_budget_stop_uses_the_tree_ledger():
    """target_epsilon (stop): the run ends before the round whose tree step would pass it."""
    sigma, epoch_rounds, delta = 2.0, 8, 1e-5
    ledger = TreeAggregationLedger(delta, "pld", epoch_rounds)
    epsilons = []
    for _ in range(8):
        ledger.record_round(sigma)
        epsilons.append(ledger.epsilon())
    assert epsilons[2] == epsilons[1] < epsilons[3]  # depth 2 for steps 2 and 3, 3 from step 4
    strategy = DifferentialPrivacy(
        clipping_norm=1.0,
        noise_multiplier=sigma,
        sample_rate=0.25,
        delta=delta,
        noise_placement="central",
        min_available_nodes=8,
        target_epsilon=epsilons[2],
        ftrl=DPFTRL(epoch_rounds=epoch_rounds),
    )
    strategy.start(
        InProcessGrid(unchanged_weights_client(), 8, {}),
        ArrayRecord({"w": Array(np.zeros(4, np.float32))}),
        num_rounds=8,
    )
    assert strategy.record.completed_rounds == 3 and "target epsilon" in strategy.record.stop_reason
    assert strategy.privacy_metrics()["epsilon"] == epsilons[2]


# ---------------------------------------------------------------- whose record: the client's, not the node id's (issue 55)
def restart(grid: InProcessGrid, node: int, new_node: int) -> None:
    """The SuperNode of `node` restarts: it registers under `new_node` with the same node config and a fresh
    Context (as stock flower-supernode does)."""
    old = grid.contexts.pop(node)
    grid.contexts[new_node] = Context(
        run_id=old.run_id, node_id=new_node, node_config=old.node_config, state=RecordDict(), run_config=old.run_config
    )


def ftrl_strategy(nodes: int, sample_rate: float, epoch_rounds: int) -> DifferentialPrivacy:
    return DifferentialPrivacy(
        FedAvg(fraction_evaluate=0.0),
        clipping_norm=1.0,
        noise_multiplier=1.0,
        sample_rate=sample_rate,
        noise_placement="central",
        min_available_nodes=nodes,
        ftrl=DPFTRL(epoch_rounds=epoch_rounds),
    )


def test_a_restarted_supernode_keeps_its_clients_participation_record():
    """Both nodes take part in round 1 of a 2-round epoch, then restart under new node ids. Before: the new node ids
    were fresh records and both trained again in round 2 (each client twice in one epoch). Now round 2 asks the new
    nodes who they are, finds clients 0 and 1 already in the epoch, and sends no train message; round 3 (epoch 2)
    takes both again."""
    strategy, grid = ftrl_strategy(2, 1.0, 2), InProcessGrid(unchanged_weights_client(), 2, {})
    arrays = ArrayRecord({"w": Array(np.zeros(4, np.float32))})
    assert [m.metadata.dst_node_id for m in strategy.configure_train(1, arrays, ConfigRecord(), grid)] == [100, 101]
    restart(grid, 100, 9_000_000_001)
    restart(grid, 101, 2**63 + 5)
    assert list(strategy.configure_train(2, arrays, ConfigRecord(), grid)) == []
    assert strategy.mechanism.last_epoch == {0: 0, 1: 0}  # client id -> its last epoch
    third = [m.metadata.dst_node_id for m in strategy.configure_train(3, arrays, ConfigRecord(), grid)]
    assert third == [9_000_000_001, 2**63 + 5] and strategy.mechanism.last_epoch == {0: 1, 1: 1}
    queries = [m.metadata.dst_node_id for m in grid.sent if m.metadata.message_type == "query.client_id"]
    assert queries == [100, 101, 9_000_000_001, 2**63 + 5]  # each node id asked once


def test_dp_ftrl_refuses_to_start_where_nodes_offer_no_client_id():
    """A ClientApp that does not answer the identity query, and a node config without client-id or partition-id:
    refused before any train message, naming the node-config key (and the handler to register)."""
    foreign = ClientApp()

    @foreign.train()
    def train(msg: Message, context: Context) -> Message:  # pragma: no cover - never reached
        raise AssertionError("trained")

    grid = InProcessGrid(foreign, 3, {})
    with pytest.raises(ValueError) as refused:
        ftrl_strategy(3, 1.0, 2).start(grid, ArrayRecord({"w": Array(np.zeros(4, np.float32))}), num_rounds=1)
    assert str(refused.value).startswith(
        "no node answered the identity query (node 100: its identity query failed (ValueError: No query function "
        "registered with name 'client_id'); node 101: "
    )
    assert (
        "DP-FTRL keeps each client's participation record by its client id, and refuses to start where it cannot tell "
        "a restarted SuperNode (a new node id) from a new client; a ClientApp of one's own answers it with "
        "app.query('client_id')(answer_client_id) (from dpfl import answer_client_id), with node config 'client-id' "
        "(or 'partition-id'), e.g. flower-supernode --node-config \"client-id=7\"" in str(refused.value)
    )
    assert all(m.metadata.message_type == "query.client_id" for m in grid.sent)

    grid = InProcessGrid(unchanged_weights_client(), 3, {})
    grid.contexts[101].node_config.clear()
    with pytest.raises(ValueError) as refused:
        ftrl_strategy(3, 1.0, 2).start(grid, ArrayRecord({"w": Array(np.zeros(4, np.float32))}), num_rounds=1)
    assert str(refused.value).startswith(
        "1 of 3 nodes offer no client id (node 101: its node config names no client: set node config 'client-id' "
        "(or 'partition-id')"
    )
    assert not [m for m in grid.sent if trains(m)]


@pytest.mark.parametrize(
    ("claim", "why"),
    [
        (0, "client id 0 is held by node 100, which claimed it first and is connected"),
        ("seven", "its client id 'seven' is not an integer"),
        (True, "its client id True is not an integer"),
        (-1, "its client id -1 is outside [0, 2^53)"),
        (2**53, f"its client id {2**53} is outside [0, 2^53)"),
    ],
)
def test_a_node_claiming_a_taken_or_absurd_client_id_is_not_sampled(claim, why, caplog):
    """Node 102's node config claims `claim` (client-id beats partition-id). A client id a connected node claimed
    first, or one that is not an integer in [0, 2^53), keeps node 102 out of every round, noted in the round's
    diagnostics; the others train. (At round 1 an absurd id refuses the run: here the claim comes from a node that
    joins at round 2.) Which node is connected is not covered by epsilon: the log line is at DEBUG unless
    publish_diagnostics."""
    strategy, grid = ftrl_strategy(2, 1.0, 1), InProcessGrid(unchanged_weights_client(), 3, {})
    joining = grid.contexts.pop(102)
    arrays = ArrayRecord({"w": Array(np.zeros(4, np.float32))})
    assert len(list(strategy.configure_train(1, arrays, ConfigRecord(), grid))) == 2
    grid.contexts[102] = joining
    joining.node_config["client-id"] = claim
    with caplog.at_level(logging.DEBUG, logger="flwr"):
        for rnd in (2, 3):
            sent = [m.metadata.dst_node_id for m in strategy.configure_train(rnd, arrays, ConfigRecord(), grid)]
            assert sent == [100, 101] and strategy.round.problems == [f"node 102 is not sampled: {why}"]
    assert [(r.levelno, r.getMessage()) for r in caplog.records if "not sampled" in r.getMessage()] == [
        (logging.DEBUG, f"Round {rnd}: node 102 is not sampled: {why}") for rnd in (2, 3)
    ]


def test_flowers_legacy_workflow_which_asks_no_client_id_is_refused():
    """LegacyDPFedAvg selects from Flower's client manager without the identity query: DP-FTRL refuses its round 1
    rather than keep participation by node id (before: by node id, silently)."""
    from flwr.common import ndarrays_to_parameters

    from dpfl import LegacyDPFedAvg

    start = ndarrays_to_parameters([np.zeros(3, np.float32)])
    legacy = LegacyDPFedAvg(ftrl_strategy(2, 0.5, 2), initial_parameters=start, num_rounds=2)
    proxies = {str(n): SimpleNamespace(node_id=n) for n in (100, 101)}
    manager = SimpleNamespace(num_available=lambda: 2, all=lambda: proxies, wait_for=lambda n, timeout=0: True)
    with pytest.raises(RuntimeError, match=r"this path selects without asking \(Flower's legacy workflow"):
        legacy.configure_fit(1, start, manager)
