"""Issue 55 items 2 and 5: a failed round is loud on every path, and a diverged model is reported as divergence.

A round in which every sampled client failed names the first client's own exception (Flower's error reply carries
it inside the transport's text: Ray's traceback in a simulation, `<class ...>:<...>` from a SuperNode); a run whose
leading round fails so stops before that round releases or charges anything, on the Message-API path, the legacy
path and the legacy SecAgg+ path (a half-converted fl-dp-sa: server converted, Flower's fixedclipping_mod left on
the clients). Replies rejected on a model that diverged are reported as divergence, with a hint."""

import numpy as np
import pytest
from flwr.app import ArrayRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.client.mod import fixedclipping_mod, secaggplus_mod
from flwr.clientapp import ClientApp
from flwr.common import ndarrays_to_parameters
from flwr.compat.common import recorddict_compat as compat
from flwr.server import LegacyContext, ServerApp, ServerConfig
from flwr.server.strategy import FedAvg as LegacyFedAvg
from flwr.server.workflow import DefaultWorkflow

from dpfl import DPSecAggPlusWorkflow, LegacyDifferentialPrivacy
from dpfl.strategies import DifferentialPrivacy
from dpfl.strategies.loop.reply_gate import (
    ALL_FAILED_HINT,
    DIVERGED_HINT,
    EveryClientFailed,
    blown_up,
    client_exception,
)
from dpfl.strategies.loop.wrapped import reply_message
from dpfl_tools.inprocess import InProcessGrid
from tests.test_dropin import NODES, SIGMA, C, dp_mod, initial_weights
from tests.test_secagg_dropin import OURS, ROUNDS, fl_dp_sa, train_loss_client_fn

FLOWER_KEY_ERROR = (
    "KeyError: 'The clipping_norm value is not supplied by the DifferentialPrivacyClientSideFixedClipping wrapper at "
    "the server side.'"
)
# Error.reason of that KeyError under `flwr run` in simulation (Flower 1.42, Ray 2.55.1: its ClientAppActor re-raises
# it as ClientAppException, and Ray's RayTaskError carries the worker's traceback), recorded; pid, ip, actor id and
# paths shortened
RAY_REASON = (
    "<class 'ray.exceptions.RayTaskError(ClientAppException)'>:<'\x1b[36mray::ClientAppActor.run()\x1b[39m (pid=14701, "
    "ip=192.0.2.2, actor_id=a1025b10c682407b14eb803101000000, repr=<ClientAppActor object at 0x7f9b3b26c2d0>)\n"
    '  File "/flwr/client/mod/centraldp_mods.py", line 58, in fixedclipping_mod\n'
    "    raise KeyError(\n{line}\n\n"
    "The above exception was the direct cause of the following exception:\n\n"
    "\x1b[36mray::ClientAppActor.run()\x1b[39m (pid=14701, ip=192.0.2.2, actor_id=a1025b10c682407b14eb803101000000, "
    "repr=<ClientAppActor object at 0x7f9b3b26c2d0>)\n"
    "           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^\n"
    '  File "/flwr/simulation/ray_transport/ray_actor.py", line 65, in run\n'
    "    raise ClientAppException(str(ex)) from ex\n"
    "flwr.clientapp.client_app.ClientAppException: \nException ClientAppException occurred. Message: {text}'>"
)


def ray_reason(exc: BaseException) -> str:
    return RAY_REASON.format(line=f"{type(exc).__name__}: {exc}", text=str(exc))


def supernode_reason(exc: BaseException) -> str:
    """As flwr/supernode/runtime/run_clientapp.py writes it."""
    return str(type(exc)) + ":<'" + str(exc) + "'>"


def flower_errors(reason):
    """A mod (outermost) that answers a raising ClientApp as Flower's transport does: an Error with `reason(exc)`."""

    def mod(msg, context, call_next):
        try:
            return call_next(msg, context)
        except Exception as exc:
            return Message(Error(code=1, reason=reason(exc)), reply_to=msg)

    return mod


def test_the_clients_own_exception_line_out_of_the_transports_text():
    key_error = KeyError(FLOWER_KEY_ERROR.split(": ", 1)[1][1:-1])
    assert client_exception(ray_reason(key_error)) == FLOWER_KEY_ERROR
    assert client_exception(supernode_reason(key_error)) == FLOWER_KEY_ERROR
    assert client_exception(supernode_reason(ValueError())) == "ValueError"
    assert (
        client_exception("RuntimeError: node 101 crashed (simulated)") == "RuntimeError: node 101 crashed (simulated)"
    )


# ---------------------------------------------------------------- Message API
M = 4


def model() -> ArrayRecord:
    return ArrayRecord([np.ones((3, 2), np.float32), np.zeros(2, np.float32)])


def client(fails_from: int = 1, update=None) -> ClientApp:
    """A weights client (w + update) that raises Flower's KeyError from round `fails_from` on; Ray's error text."""
    app = ClientApp()

    @app.train(mods=[flower_errors(ray_reason)])
    def train(msg: Message, context: Context) -> Message:
        if int(msg.content["config"]["server-round"]) >= fails_from:
            raise KeyError("clipping_norm")
        arrays = msg.content["arrays"].to_numpy_ndarrays()
        step = update(arrays) if update else [np.full_like(a, 0.01) for a in arrays]
        new = ArrayRecord([a + s for a, s in zip(arrays, step)])
        return Message(RecordDict({"arrays": new, "metrics": MetricRecord({"num-examples": 10})}), reply_to=msg)

    return app


def central(**kw) -> DifferentialPrivacy:
    return DifferentialPrivacy(
        clipping_norm=1.0, noise_multiplier=SIGMA, sample_rate=1.0, min_available_nodes=M, seed=3, **kw
    )


def test_every_client_failing_in_round_1_stops_the_run_naming_the_clients_error(caplog):
    """Before: the warning showed Ray's wrapper text, and the run released and charged noise-only rounds."""
    strategy, grid = central(), InProcessGrid(client(fails_from=1), M, {})
    with caplog.at_level("WARNING", logger="flwr"), pytest.raises(EveryClientFailed) as stopped:
        strategy.start(grid, model(), num_rounds=3)
    message = str(stopped.value)
    assert message.startswith(
        f"Round 1: every sampled client failed ({M} of {M}) and no earlier round had a usable reply, so the run stops "
        "before this round releases or charges anything. The first client's error: KeyError: 'clipping_norm'. "
    )
    assert "ray::" not in message and "ClientAppException" not in message
    assert message in caplog.text  # the log says it too
    assert strategy.record.history == [] and strategy.record.stop_reason == message
    assert strategy.ledger.model.history == [] and strategy.privacy_spent() is None  # nothing released or charged
    assert len(grid.sent) == M  # round 1's train messages only


def test_a_later_round_in_which_every_client_fails_warns_with_the_clients_error_and_is_charged(caplog):
    """After a usable round the run goes on: the round releases noise only (the model moves), is charged, and its
    warning names the client's exception."""
    strategy, grid = central(), InProcessGrid(client(fails_from=2), M, {})
    with caplog.at_level("WARNING", logger="flwr"):
        strategy.start(grid, model(), num_rounds=3)
    assert [r["clients"] for r in strategy.record.history] == [M, 0, 0]
    lines = [r.getMessage() for r in caplog.records if "client replies failed" in r.getMessage()]
    assert lines == [
        f"Round {r}: client replies failed, were rejected or unusable ({M}): {M} x a node failed: KeyError: "
        "'clipping_norm'"
        for r in (2, 3)
    ]
    assert caplog.text.count(ALL_FAILED_HINT) == 1
    # the server noise was released in every round, on the empty sum in rounds 2 and 3
    assert [r["server_noise_std"] for r in strategy.record.history] == pytest.approx([SIGMA * 1.0] * 3)
    assert strategy.ledger.model.history == [(SIGMA, 1.0, 3)]  # three rounds charged (q = 1)


def test_a_round_with_an_empty_poisson_sample_does_not_stop_the_run():
    """No client sampled is no client failed: the round releases noise only, as before."""
    strategy = DifferentialPrivacy(
        clipping_norm=1.0, noise_multiplier=SIGMA, sample_rate=0.01, min_available_nodes=M, seed=3, secure_rng=False
    )
    strategy.start(InProcessGrid(client(fails_from=1), M, {}), model(), num_rounds=1)
    [record] = strategy.record.history
    assert strategy.round.nodes == set() and record["clients"] == 0 and record["failures"] == 0


# ---------------------------------------------------------------- legacy API
def legacy_app(strategy, mods, fit_workflow=None, rounds=ROUNDS) -> None:
    server_app = ServerApp()

    @server_app.main()
    def main(grid, context):
        legacy = LegacyContext(context, config=ServerConfig(num_rounds=rounds), strategy=strategy)
        DefaultWorkflow(fit_workflow=fit_workflow)(grid, legacy)

    grid = InProcessGrid(ClientApp(client_fn=train_loss_client_fn, mods=list(mods)), NODES, {})
    server_app(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}))


def test_legacy_wrapper_with_flowers_client_mod_stops_at_round_1_naming_the_keyerror(caplog):
    """LegacyDifferentialPrivacy on the server, Flower's fixedclipping_mod left on the clients (a SuperNode's error
    text): the ServerApp raises, nothing is charged."""
    strategy = LegacyDifferentialPrivacy(
        LegacyFedAvg(initial_parameters=ndarrays_to_parameters(initial_weights())), SIGMA, C, NODES, delta=1e-3
    )
    with caplog.at_level("WARNING", logger="flwr"), pytest.raises(EveryClientFailed, match="KeyError") as stopped:
        legacy_app(strategy, [flower_errors(supernode_reason), fixedclipping_mod])
    assert f"every sampled client failed ({NODES} of {NODES})" in str(stopped.value)
    assert f"The first client's error: {FLOWER_KEY_ERROR}." in str(stopped.value)
    assert strategy.record.history == [] and strategy.ledger.model.history == []


def half_converted_mod(fails_from: int):
    """The client's DP mod: Flower's fixedclipping_mod (as fl-dp-sa has it) from round `fails_from` on, before it
    the project's dp_privatize_mod."""

    def mod(msg, context, call_next):
        config = compat.recorddict_to_fitins(msg.content, keep_input=True).config
        chosen = fixedclipping_mod if int(config["server-round"]) >= fails_from else dp_mod
        return chosen(msg, context, call_next)

    return mod


def half_converted_fl_dp_sa(fails_from: int):
    """Flower's fl-dp-sa with its server converted (SecAggPlusDifferentialPrivacy, DPSecAggPlusWorkflow) and the
    clients' Flower mods left, raising in SecAgg+'s masked-vector stage (Ray's error text): (strategy, history)."""
    built = []

    def ours(*args, **kw):
        built.append(OURS(*args, **kw))
        return built[-1]

    mods = [flower_errors(ray_reason), secaggplus_mod, half_converted_mod(fails_from)]
    grid = InProcessGrid(ClientApp(client_fn=train_loss_client_fn, mods=mods), NODES, {})
    try:
        _, history, _ = fl_dp_sa(ours, DPSecAggPlusWorkflow, fixedclipping_mod, grid=grid)
    except EveryClientFailed:
        return built[0], None
    return built[0], history


def test_half_converted_fl_dp_sa_stops_at_round_1_naming_the_clients_keyerror(caplog):
    """Before: SecAgg+ halted silently each round, and the server printed normal rounds and growing epsilons."""
    with caplog.at_level("INFO", logger="flwr"):
        strategy, history = half_converted_fl_dp_sa(fails_from=1)
    assert history is None  # the ServerApp raised
    assert strategy.record.stop_reason.startswith("Round 1: every sampled client failed (5 of 5)")
    assert f"The first client's error: {FLOWER_KEY_ERROR}." in strategy.record.stop_reason
    assert strategy.record.stop_reason in caplog.text
    assert strategy.record.history == [] and strategy.ledger.model.history == []
    assert "epsilon=" not in caplog.text


def test_half_converted_fl_dp_sa_failing_after_round_1_warns_and_charges_the_noise_only_release(caplog):
    """Round 1 trained (the project's mod), round 2's clients all raise: SecAgg+ halts, the round releases the model
    plus the full noise and is charged as a normal round; its warning names the client's KeyError."""
    with caplog.at_level("WARNING", logger="flwr"):
        strategy, history = half_converted_fl_dp_sa(fails_from=2)
    assert history is not None
    assert [(r["clients"], r["failures"]) for r in strategy.record.history] == [(5, 0), (0, 5)]
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Round 2: client replies failed")]
    assert f"5 x a node failed: {FLOWER_KEY_ERROR}" in line
    # both rounds charged, as in the run where every client trains (test_secagg_dropin checks those events'
    # epsilon against dp-accounting): fixed-size sampling of 5 of NODES, the Gaussian at sigma / 2 (replace-one)
    assert strategy.ledger.fixed_rounds == [(SIGMA / 2, NODES, 5, ROUNDS)]
    assert strategy.ledger.model.history == [(SIGMA / 2, 1.0, ROUNDS)]


# ---------------------------------------------------------------- divergence (item 5)
def test_replies_rejected_on_a_diverged_model_are_reported_as_divergence_with_a_hint(caplog):
    """An honest client on a blown-up model sends NaN: the round's line says the model diverged and the hint
    names the remedy, once; not the misconfiguration hint."""

    def nan_update(arrays):
        return [np.full_like(a, np.nan) for a in arrays]

    strategy = central()
    with caplog.at_level("WARNING", logger="flwr"):
        strategy.start(InProcessGrid(client(fails_from=99, update=nan_update), M, {}), model(), num_rounds=2)
    lines = [r.getMessage() for r in caplog.records if "client replies failed" in r.getMessage()]
    assert lines == [
        f"Round {r}: the global model diverged ({M} of {M} replies hold non-finite or huge values), so client "
        f"replies failed, were rejected or unusable ({M}): {M} x rejected the reply of a node: array 0 contains NaN "
        "or Inf (as float32)"
        for r in (1, 2)
    ]
    assert caplog.text.count(DIVERGED_HINT) == 1 and ALL_FAILED_HINT not in caplog.text
    assert "too few clients a round for this noise" in DIVERGED_HINT


def test_a_global_model_grown_far_beyond_the_first_is_divergence_and_one_hostile_reply_is_not(caplog):
    """One NaN reply of four on a sound model is not divergence (a DEBUG line as before); the same rejection on a
    model whose norm grew above 100 times round 1's is."""
    strategy = central(publish_diagnostics=True)
    strategy.setup_population(M)
    gate = strategy.gate
    for rnd, scale in ((1, 1.0), (2, 1e3)):
        arrays = ArrayRecord([np.ones((3, 2), np.float32) * scale, np.zeros(2, np.float32)])
        strategy.begin_round(arrays)
        strategy.round.nodes = {100, 101, 102, 103}
        nan = ArrayRecord([np.full((3, 2), np.nan, np.float32), np.zeros(2, np.float32)])
        replies = [
            reply_message(node, RecordDict({"arrays": nan if node == 100 else arrays, "metrics": MetricRecord({})}))
            for node in sorted(strategy.round.nodes)
        ]
        accepted, _, rejected = gate.accepted(strategy, rnd, replies)
        assert (len(accepted), rejected) == (M - 1, 1)
        assert strategy.round.diverged == (
            None if rnd == 1 else "the global model's norm is 2.45e+03, 1e+03 times the first round's 2.45"
        )
    assert blown_up("metric 'update-norm' = 1.2448030727133162e+16 is outside [0.0, 1000000000000000.0]")
    assert not blown_up("metric 'num-examples' = -1 is outside [1, 2147483647]")
    assert not blown_up("upload norm 12.5 above the bound 3.2 of an honest noisy update")


# ---------------------------------------------------------------- under flwr run (slow tier)
@pytest.mark.slow  # one short `flwr run` in simulation (3 SuperNodes, about 50 s on 2 cores)
def test_half_converted_fl_dp_sa_under_flwr_run_stops_naming_the_keyerror(superlink, tmp_path):
    """Flower's fl-dp-sa with only its server lines converted (tests/flower_apps/fl_dp_sa; benchmarks.flower_apps'
    import lines for the server): before, three normal rounds and growing epsilons were printed while every client
    raised. Now the ServerApp stops in round 1 naming the client's KeyError and writes no model; Flower 1.42 prints
    the app's exit code (700) and `flwr run` itself exits 0 (it does not pass the app's exit on)."""
    import dataclasses
    import subprocess

    from benchmarks.flower_apps import FL_DP_SA, make_variant
    from dpfl_tools.plan import format_run_config
    from dpfl_tools.processes import command

    server_lines = {k: v for k, v in FL_DP_SA.lines.items() if "client.mod" not in k}
    app = make_variant(dataclasses.replace(FL_DP_SA, lines=server_lines), tmp_path / "half")
    model = tmp_path / "final.pt"
    config = {"num-server-rounds": 2, "num-sampled-clients": 3, "num-shares": 3, "reconstruction-threshold": 2}
    run = subprocess.run(
        [
            command("flwr"),
            "run",
            str(app),
            "--stream",
            "--run-config",
            format_run_config({**config, "final-model": str(model)}),
        ]
        + ["--federation-config", "num-supernodes=3 client-resources-num-cpus=1"],
        env={**superlink, "PYTHONUNBUFFERED": "1"},
        capture_output=True,
        text=True,
        timeout=400,
    )
    log = run.stdout + run.stderr
    (tmp_path / "log.txt").write_text(log)
    stopped = "EveryClientFailed: Round 1: every sampled client failed (3 of 3) and no earlier round had a usable reply"
    assert stopped in log and f"The first client's error: {FLOWER_KEY_ERROR}." in log, log[-3000:]
    assert "epsilon=" not in log and not model.exists()
    assert run.returncode != 0 or "Exit Code: 700" in log
