"""Flower's own kinds of app with our wrapper swapped in, under `flwr run` (a SuperLink of the test's own):
a quickstart-pytorch style app (named state dict, BatchNorm's integer counter), unchanged under central noise
and with one mod line under distributed noise, around FedAvg and FedAdam."""

import functools
import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch

from dpfl_tools.plan import format_run_config
from dpfl_tools.processes import BIN
from tests.independent_accountant import dp_accounting_epsilons
from tests.quickstart_app.quickstart.task import Net

APP = Path(__file__).parent / "quickstart_app"
NODES, ROUNDS, SIGMA, DELTA = 4, 8, 0.05, 1e-3  # small sigma: 4 clients must learn in 8 rounds (0.83-0.91 at 0.05)

pytestmark = pytest.mark.slow


def flwr_run(env: dict, app: Path, out: Path, **config) -> dict:
    """`flwr run <app>` with the run config; the ServerApp's results file."""
    values = {"results-file": str(out), "num-server-rounds": ROUNDS, "noise-multiplier": SIGMA, **config}
    run_config = format_run_config(values)
    subprocess.run(
        [
            str(BIN / "flwr"),
            "run",
            str(app),
            "--stream",
            "--run-config",
            run_config,
            "--federation-config",
            f"num-supernodes={NODES} client-resources-num-cpus=1",
        ],
        env=env,
        check=True,
        timeout=300,
        capture_output=True,
        text=True,
    )
    assert out.exists(), f"the ServerApp wrote no results to {out}"
    return json.loads(out.read_text())


def app_copy(tmp_path: Path, clientapp: str) -> Path:
    """The quickstart app with `clientapp` as its ClientApp component."""
    app = tmp_path / "app"
    shutil.copytree(APP, app, ignore=shutil.ignore_patterns("__pycache__"))
    pyproject = app / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace("quickstart.client_app:app", clientapp))
    return app


@functools.lru_cache
def expected_epsilons(sigma: float, rounds: int, delta: float) -> tuple[float, float]:
    """dp-accounting's (PLD, RDP) epsilon of `rounds` Gaussian releases (q = 1), computed once per module."""
    return dp_accounting_epsilons(sigma, 1.0, rounds, delta)


def check_result(result: dict, out: Path) -> None:
    state_dict = torch.load(out.with_suffix(".pt"))
    model = Net()
    model.load_state_dict(state_dict)  # by name, strict: every key of the model, nothing else
    assert result["keys"] == list(Net().state_dict())
    assert result["dtypes"]["bn.num_batches_tracked"] == "torch.int64"
    assert result["num_batches_tracked"] == 0  # not floating point: comes back as the server sent it
    assert result["accuracy"] > 0.5, result  # 10 classes: chance is 0.1
    pld_eps, rdp_eps = expected_epsilons(SIGMA, ROUNDS, DELTA)  # the ledger prints one of the two
    assert 0.99 * pld_eps <= result["epsilon"] <= 1.01 * rdp_eps, (result["epsilon"], pld_eps, rdp_eps)


def test_quickstart_app_with_the_wrapper_around_fedavg_unchanged_client(superlink, tmp_path):
    out = tmp_path / "fedavg.json"
    check_result(
        flwr_run(
            superlink,
            app_copy(tmp_path, "quickstart.client_app:app"),
            out,
            strategy="fedavg",
            **{"noise-placement": "central"},
        ),
        out,
    )


def test_quickstart_app_with_the_wrapper_around_fedadam_and_the_mod(superlink, tmp_path):
    out = tmp_path / "fedadam.json"
    check_result(
        flwr_run(
            superlink,
            app_copy(tmp_path, "quickstart.client_app:app_with_mod"),
            out,
            strategy="fedadam",
            **{"noise-placement": "distributed"},
        ),
        out,
    )


def test_plain_flwr_run_of_this_app_refuses_a_federation_smaller_than_min_nodes(superlink, tmp_path):
    """`flwr run .` with 2 SuperNodes (Flower's default federation size) and min-nodes = 3: refused at once (tens of
    seconds: Flower's start, 121 s seen in CI's slow tier with 4 processes on 2 cores), naming the key and the number
    to set, instead of waiting node-wait-timeout (600 s) for nodes a simulation never gets."""
    root = Path(__file__).resolve().parents[1]
    start = time.monotonic()
    out = subprocess.run(
        [
            str(BIN / "flwr"),
            "run",
            str(root),
            "--stream",
            "--run-config",
            f"min-nodes=3 num-rounds=1 results-dir='{tmp_path / 'run'}'",
            "--federation-config",
            "num-supernodes=2 client-resources-num-cpus=1",
        ],
        env=superlink,
        timeout=500,
        capture_output=True,
        text=True,
    )
    assert time.monotonic() - start < 400  # not node-wait-timeout's 600 s
    text = out.stdout + out.stderr
    assert "run-config key 'min-nodes' = 3, but the simulation has 2 SuperNodes" in text, text[-3000:]
    assert "num-supernodes=3" in text


def run_legacy_app(superlink, tmp_path: Path, **config) -> tuple[dict, str]:
    """`flwr run` of tests/legacy_app with the run config; (its results file, the printed log)."""
    out = tmp_path / "legacy.json"
    app = tmp_path / "legacy"
    shutil.copytree(Path(__file__).parent / "legacy_app", app, ignore=shutil.ignore_patterns("__pycache__"))
    values = {"results-file": str(out), **config}
    run = subprocess.run(
        [
            str(BIN / "flwr"),
            "run",
            str(app),
            "--stream",
            "--run-config",
            " ".join(f"{k}={v!r}" for k, v in values.items()),
            "--federation-config",
            f"num-supernodes={NODES} client-resources-num-cpus=1",
        ],
        env=superlink,
        timeout=300,
        capture_output=True,
        text=True,
    )
    assert out.exists(), (run.stdout + run.stderr)[-3000:]
    return json.loads(out.read_text()), run.stdout + run.stderr


def test_legacy_numpyclient_app_with_the_legacy_adapter_under_flwr_run(superlink, tmp_path):
    """A legacy app (NumPyClient + mod, ServerApp(server_fn=...) with LegacyDPFedAvg) under `flwr run`: its own
    evaluate metrics, aggregated by its own function, reach Flower's History; the fit metrics Flower's History
    holds (and its [SUMMARY] prints) are the ledger's only; the model learns; epsilon is dp-accounting's."""
    result, printed = run_legacy_app(superlink, tmp_path)
    accuracy = result["metrics_distributed"]["mean_accuracy"]
    assert [r for r, _ in accuracy] == list(range(1, 7)) and accuracy[-1][1] > 0.6, accuracy
    assert set(result["metrics_distributed_fit"]) <= {"epsilon", "delta", "epsilon_against_server"}
    pld_eps, rdp_eps = expected_epsilons(0.3, 6, 1e-3)
    assert 0.99 * pld_eps <= result["epsilon"] <= 1.01 * rdp_eps, (result["epsilon"], pld_eps, rdp_eps)
    assert "update_norm" not in printed and "clipped_fraction" not in printed


@pytest.mark.parametrize("strategy", ["fedadam", "fedprox"])
def test_legacy_fedadam_and_fedprox_wrapped_in_flowers_signature_under_flwr_run(superlink, tmp_path, strategy):
    """The app's own FedAdam / FedProx in `LegacyDifferentialPrivacy(strategy, sigma, C, m)`: its evaluate
    metrics reach Flower's History, the model learns, every round prints the ledger's epsilon. m = M = 4: fixed-size
    sampling of all nodes, charged under the replace-one relation (sensitivity 2C): the Gaussian at sigma / 2."""
    result, printed = run_legacy_app(superlink, tmp_path, strategy=strategy)
    accuracy = result["metrics_distributed"]["mean_accuracy"]
    assert [r for r, _ in accuracy] == list(range(1, 7)) and accuracy[-1][1] > 0.6, accuracy
    pld_eps, rdp_eps = expected_epsilons(0.3 / 2, 6, 1e-3)
    assert 0.99 * pld_eps <= result["epsilon"] <= 1.01 * rdp_eps, (result["epsilon"], pld_eps, rdp_eps)
    assert len(re.findall(r"Round \d/6: .*epsilon=", printed)) == 6, printed[-3000:]
    assert "[SUMMARY]" in printed
