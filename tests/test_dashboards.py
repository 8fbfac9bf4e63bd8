"""TensorBoard events of a real run, read back with tensorboard's EventAccumulator, against metrics.jsonl
(and diagnostics.jsonl, which appear under nonprivate/ only when a run publishes them)."""

import logging
import math

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dpfl.fl_app.client_app import app as client_app
from dpfl.fl_app.config import validate
from dpfl.fl_app.dashboards import NONPRIVATE_PREFIX, NOT_A_GUARANTEE, TAGS, WandbWriter, scalars, write_tensorboard
from dpfl.fl_app.results import read_diagnostics, read_metrics
from dpfl.fl_app.server_app import run_federated
from dpfl_tools.inprocess import InProcessGrid

SMALL = {
    "dataset": "digits",
    "model": "mlp",
    "partitioner": "iid",
    "local-steps": 2,
    "num-rounds": 3,
    "sample-rate": 1.0,
}


def events(run_dir) -> EventAccumulator:
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def check_against_metrics(run_dir, expected_tags):
    acc = events(run_dir)
    rows = read_metrics(run_dir)
    assert set(expected_tags) <= set(acc.Tags()["scalars"])
    for tag in expected_tags:
        if tag.startswith(NONPRIVATE_PREFIX):
            key, rows = tag[len(NONPRIVATE_PREFIX) :], read_diagnostics(run_dir)
        else:  # a figure its rounds mark as no guarantee has the tag with NOT_A_GUARANTEE
            key, rows = (
                next(k for k, t in TAGS.items() if t == tag.removesuffix(NOT_A_GUARANTEE)),
                read_metrics(run_dir),
            )
        logged = {e.step: e.value for e in acc.Scalars(tag)}
        written = {r["round"]: r[key] for r in rows if r.get(key) is not None}
        assert logged.keys() == written.keys()
        for step, value in written.items():
            assert logged[step] == pytest.approx(value, rel=1e-6)
    return acc


def test_a_run_writes_tensorboard_scalars_equal_to_its_metrics_and_no_diagnostics(tmp_path):
    cfg = validate({**SMALL, "results-dir": str(tmp_path / "run")})
    run_federated(InProcessGrid(client_app, 4, cfg), cfg)
    acc = check_against_metrics(
        tmp_path / "run",
        ["eval/accuracy", "eval/loss", "privacy/epsilon", "privacy/epsilon_against_server" + NOT_A_GUARANTEE],
    )
    assert not [t for t in acc.Tags()["scalars"] if t.startswith(NONPRIVATE_PREFIX)]  # published: ledger only
    assert read_diagnostics(tmp_path / "run")[0]["clients"] == 4  # the diagnostics stay in their own file


def test_published_diagnostics_appear_under_nonprivate_with_a_note(tmp_path):
    cfg = validate({**SMALL, "publish-diagnostics": True, "results-dir": str(tmp_path / "run")})
    run_federated(InProcessGrid(client_app, 4, cfg), cfg)
    acc = check_against_metrics(
        tmp_path / "run",
        ["privacy/epsilon", "nonprivate/clipped_fraction", "nonprivate/update_norm_mean", "nonprivate/clients"],
    )
    assert any("diagnostics" in t for t in acc.Tags()["tensors"])  # the note that nonprivate/ is not private


def test_ali_dpfl_per_client_epsilon_and_tau(tmp_path):
    cfg = validate(
        {
            **SMALL,
            "algorithm": "ali-dpfl",
            "target-epsilon": 4.0,
            "batch-sample-rate": 0.2,
            "adaptive": False,
            "results-dir": str(tmp_path / "ali"),
        }
    )
    run_federated(InProcessGrid(client_app, 3, cfg), cfg)
    acc = check_against_metrics(tmp_path / "ali", ["ali_dpfl/tau", "privacy/epsilon"])
    rows = read_metrics(tmp_path / "ali")
    for client, eps in rows[-1]["epsilon_per_client"].items():
        assert acc.Scalars(f"privacy/epsilon_client/{client}")[-1].value == pytest.approx(eps, rel=1e-6)


def test_older_run_folders_are_converted(tmp_path):
    cfg = validate({**SMALL, "tensorboard": False, "results-dir": str(tmp_path / "old")})
    run_federated(InProcessGrid(client_app, 4, cfg), cfg)
    assert not list((tmp_path / "old").glob("events.out.tfevents.*"))
    write_tensorboard(tmp_path / "old")
    check_against_metrics(tmp_path / "old", ["eval/accuracy", "privacy/epsilon"])


def test_non_finite_values_are_not_logged():
    assert scalars({"round": 1, "epsilon": math.inf, "accuracy": 0.5, "failed_nodes": ["x"]}) == {"eval/accuracy": 0.5}


# ---------------------------------------------------------------------------- Weights & Biases (offline)
def wandb_history(run_dir) -> dict[int, dict]:
    """{step: {key: value}} logged into the run's offline W&B file, read back from the file itself.

    wandb 0.31 has no Python reader of its `.wandb` files any more (its Go core writes them), so this reads the
    format: a 7-byte header (":W&B", magic, version), then LevelDB log records in 32 KiB blocks (7-byte header:
    CRC, length, type FULL=1 / FIRST=2 / MIDDLE=3 / LAST=4), each record one of wandb's own protobuf `Record`s.
    """
    import json as json_lib
    import struct

    from wandb.proto import wandb_internal_pb2

    files = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    data, block = files[0].read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, pending, history = 7, b"", {}
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                items = {
                    item.key or "/".join(item.nested_key): json_lib.loads(item.value_json)
                    for item in record.history.item
                }  # a key with "/" is stored as its parts
                history[int(record.history.step.num)] = {k: v for k, v in items.items() if not k.startswith("_")}
    return history


def wandb_or_skip():
    return pytest.importorskip("wandb", reason="wandb is not installed: pip install -e '.[wandb]' (or '.[test]')")


def check_wandb_against_files(run_dir, publish_diagnostics: bool) -> dict[int, dict]:
    history = wandb_history(run_dir)
    published = read_metrics(run_dir)
    diagnostics = {r["round"]: r for r in read_diagnostics(run_dir)}
    assert sorted(history) == [r["round"] for r in published]
    for record in published:
        expected = scalars(record)
        if publish_diagnostics:
            expected.update(
                {
                    NONPRIVATE_PREFIX + k: v
                    for k, v in diagnostics[record["round"]].items()
                    if k != "round" and isinstance(v, (int, float)) and not isinstance(v, bool)
                }
            )
        assert history[record["round"]] == pytest.approx(expected, rel=1e-12)
    return history


@pytest.mark.slow  # a run with wandb's offline service: about 5 s
def test_wandb_offline_run_logs_what_metrics_jsonl_holds_and_nothing_else(tmp_path):
    wandb_or_skip()
    cfg = validate({**SMALL, "wandb": True, "tensorboard": False, "results-dir": str(tmp_path / "run")})
    run_federated(InProcessGrid(client_app, 4, cfg), cfg)
    history = check_wandb_against_files(tmp_path / "run", publish_diagnostics=False)
    assert {"eval/accuracy", "privacy/epsilon"} <= set(history[3])
    assert not [k for step in history.values() for k in step if k.startswith(NONPRIVATE_PREFIX)]


def test_wandb_shows_diagnostics_only_when_the_run_publishes_them(tmp_path):
    wandb_or_skip()
    cfg = validate({**SMALL, "wandb": True, "publish-diagnostics": True, "results-dir": str(tmp_path / "run")})
    run_federated(InProcessGrid(client_app, 4, cfg), cfg)
    history = check_wandb_against_files(tmp_path / "run", publish_diagnostics=True)
    assert history[1]["nonprivate/clients"] == 4


def test_the_log_says_where_the_wandb_run_is(tmp_path, caplog):
    """Offline: the run's folder, which exists, and the `wandb sync` command that uploads it."""
    wandb_or_skip()
    caplog.set_level(logging.INFO, logger="flwr")
    writer = WandbWriter(tmp_path / "run", validate({**SMALL, "wandb": True}))
    writer.on_finish({})
    (folder,) = (tmp_path / "run" / "wandb").glob("offline-run-*")
    assert f"W&B run run (offline) in {folder}; upload it with: wandb sync {folder}" in caplog.messages


def test_wandb_without_the_package_fails_before_training(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    cfg = validate({**SMALL, "wandb": True, "results-dir": str(tmp_path / "run")})
    with pytest.raises(RuntimeError, match="pip install 'dpfl\\[wandb\\]'"):
        run_federated(InProcessGrid(client_app, 4, cfg), cfg)
    assert read_metrics(tmp_path / "run") == [] and not (tmp_path / "run" / "status.json").exists()


@pytest.mark.slow
def test_a_client_app_never_imports_wandb():
    import subprocess
    import sys

    code = "import sys, fl_app.client_app, fl_app.server_app, clients.dpsgd; print('wandb' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert done.stdout.split()[-1] == "False"
