"""The `device` run-config key and the tensor layout: resolution, refusals, the clients and the server on it.

On the CPU (CI): `auto` resolves to the CPU, CUDA is refused when torch sees none (and an index out of range
when it sees some, with torch's answers faked), a client told device='cpu' trains exactly as before, and
channels_last changes the update only by rounding. On a machine with CUDA the last tests train a round
there.
"""

import copy

import numpy as np
import pytest
import torch
from flwr.app import Context, RecordDict

from dpfl.clients.base import TrainingClient
from dpfl.clients.dpsgd import DPSGDClient, torch_generator
from dpfl.clients.personalized import ContextHeadStore, DP2FedSAMClient
from dpfl.clients.sam import SAMClient
from dpfl.dpcore.privacy import protocol as keys
from dpfl.dpcore.privacy.mechanisms import flatten, make_rng
from dpfl.dpcore.task.device import (
    CHANNELS_LAST_MODELS,
    device_problem,
    is_placed,
    place_model,
    resolve_device,
    use_channels_last,
)
from dpfl.dpcore.task.models import build_model, split_state_keys
from dpfl.dpcore.task.partitions import load_partition
from dpfl.dpcore.task.torch_helpers import get_weights
from dpfl.fl_app.client_app import build_client
from dpfl.fl_app.config import ConfigError, validate

torch.set_num_threads(1)
CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="torch sees no CUDA device here (no GPU was available)")
no_cuda = pytest.mark.skipif(CUDA, reason="this machine has CUDA: the refusal of an absent CUDA cannot be shown")
ROUND = {keys.SERVER_ROUND: 1}


@pytest.fixture(scope="module")
def partition():
    return load_partition("mnist-embedded", 3, 50, "iid", seed=42)


def model():
    return build_model("cnn-mnist", (1, 28, 28), 10, seed=42)


# ---------------------------------------------------------------- resolution and refusals
@pytest.mark.parametrize("value", ["gpu", "CUDA", "cuda:", "cuda:-1", "cuda:1x", "cpu:0", " auto", "", "mps"])
def test_malformed_devices_are_refused_with_the_allowed_values(value):
    assert device_problem(value) == "must be one of: auto, cpu, cuda, cuda:N"
    with pytest.raises(ConfigError) as err:
        validate({"device": value})
    assert "'device'" in str(err.value) and repr(value) in str(err.value)
    assert "auto, cpu, cuda, cuda:N" in str(err.value)
    with pytest.raises(ValueError, match="device="):
        resolve_device(value)


def test_auto_and_cpu_resolve_here():
    assert device_problem("auto") is None and device_problem("cpu") is None
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cuda" if CUDA else "cpu")
    assert validate({}).training.device == "auto" and validate({"device": "cpu"}).training.device == "cpu"


@no_cuda
def test_cuda_is_refused_at_start_when_torch_sees_none():
    for value in ("cuda", "cuda:0"):
        assert "no CUDA device" in device_problem(value)
        with pytest.raises(ConfigError) as err:
            validate({"device": value})
        message = str(err.value)
        assert "'device'" in message and repr(value) in message and "'auto' or 'cpu'" in message
    assert resolve_device("auto") == torch.device("cpu")


def test_cuda_index_out_of_range_is_refused(monkeypatch):
    """With torch's answers faked to two CUDA devices: cuda, cuda:0, cuda:1 pass, cuda:2 does not."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert [device_problem(v) for v in ("cuda", "cuda:0", "cuda:1")] == [None, None, None]
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_device("auto") == torch.device("cuda")
    assert device_problem("cuda:2") == ("CUDA device 2 is out of range: torch sees 2 CUDA device(s), cuda:0 to cuda:1")
    with pytest.raises(ConfigError, match=r"'device' = 'cuda:7': CUDA device 7 is out of range"):
        validate({"device": "cuda:7"})


def test_channels_last_only_for_measured_models_on_the_cpu():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert {"cnn-mnist", "cnn-emnist"} <= CHANNELS_LAST_MODELS and "mlp" not in CHANNELS_LAST_MODELS
    assert use_channels_last("cnn-mnist", cpu) and not use_channels_last("cnn-mnist", cuda)
    assert not use_channels_last("mlp", cpu)


def test_a_placed_model_is_returned_without_a_walk_and_any_other_is_moved(monkeypatch):
    """place_model skips Module.to's walk over the modules only where it would change nothing."""
    walks = []
    apply = torch.nn.Module._apply
    monkeypatch.setattr(torch.nn.Module, "_apply", lambda self, *a, **k: walks.append(self) or apply(self, *a, **k))
    cpu, m = torch.device("cpu"), model()
    assert is_placed(m, cpu) and not is_placed(m, cpu, channels_last=True)
    assert place_model(m, cpu) is m and walks == []
    assert place_model(m, cpu, channels_last=True) is m and walks  # laid out anew
    assert m.features[0].weight.is_contiguous(memory_format=torch.channels_last) and is_placed(m, cpu, True)
    walks.clear()
    assert place_model(m, cpu, channels_last=True) is m and walks == []
    m.register_buffer("elsewhere", torch.zeros(2, device="meta"))
    assert not is_placed(m, cpu)  # one tensor off the device: Module.to moves it
    if CUDA:
        on_cuda = place_model(model(), torch.device("cuda"))
        assert is_placed(on_cuda, torch.device("cuda")) and is_placed(on_cuda, torch.device("cuda", 0))
        assert not is_placed(on_cuda, cpu)


# ---------------------------------------------------------------- the clients get it from the run config
def node_context(**run_config) -> Context:
    return Context(
        run_id=1,
        node_id=1,
        node_config={"partition-id": 2, "num-partitions": 20},
        state=RecordDict(),
        run_config=run_config,
    )


def test_clients_train_on_the_configured_device_and_layout():
    sam = build_client(node_context(device="cpu"))
    assert sam.device == torch.device("cpu") and sam.channels_last
    assert sam.model.features[0].weight.is_contiguous(memory_format=torch.channels_last)
    auto_mlp = build_client(node_context(model="mlp"))
    assert auto_mlp.device == resolve_device("auto") and not auto_mlp.channels_last
    dpsgd = build_client(node_context(**{"algorithm": "ali-dpfl", "target-epsilon": 2.0, "device": "cpu"}))
    assert isinstance(dpsgd, DPSGDClient) and not dpsgd.channels_last  # Opacus' ew: plain layout only
    assert dpsgd.model.features[0].weight.is_contiguous()


def test_dpsgd_client_refuses_channels_last_even_when_asked(partition):
    train, test = partition
    client = DPSGDClient(
        model(),
        train,
        test,
        state=RecordDict(),
        sample_rate=0.1,
        noise_multiplier=1.0,
        clipping_norm=1.0,
        target_epsilon=5.0,
        delta=1e-5,
        channels_last=True,
        seed=1,
        secure_rng=False,
    )
    assert not client.channels_last and client.model.features[0].weight.is_contiguous()
    update, _, metrics = client.fit(get_weights(client.model), {**ROUND, keys.LOCAL_STEPS: 2})
    assert metrics[keys.LOCAL_STEPS] == 2 and np.isfinite(flatten(update)).all()


# ---------------------------------------------------------------- device='cpu' trains as before
def fit_update(client, weights, config=ROUND) -> np.ndarray:
    upload, _, _ = client.fit([w.copy() for w in weights], dict(config))
    return flatten(upload)


def test_cpu_client_trains_exactly_as_before(partition):
    """device='cpu' (plain layout) gives bit for bit the update of a client built without a device, and that
    of torch.optim.SGD stepping a CPU model on the client's own minibatches."""
    train, test = partition
    kwargs = dict(
        local_steps=6, batch_size=8, lr=0.05, momentum=0.5, weight_decay=5e-4, seed=1, partition_id=3, secure_rng=False
    )
    weights = get_weights(model())
    explicit = fit_update(TrainingClient(model(), train, test, device="cpu", **kwargs), weights)
    default = fit_update(TrainingClient(model(), train, test, **kwargs), weights)
    reference = model()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.5, weight_decay=5e-4, foreach=False)
    loss_fn = torch.nn.CrossEntropyLoss()
    for x, y in TrainingClient(model(), train, test, **kwargs).batches(6, make_rng(1, 4, 1, 3)):
        optimizer.zero_grad()
        loss_fn(reference(x), y).backward()
        optimizer.step()
    expected = flatten(get_weights(reference)) - flatten(weights)
    assert np.abs(explicit).max() > 1e-3  # it trained
    assert np.array_equal(explicit, default) and np.array_equal(explicit, expected)


def test_privatized_cpu_upload_is_unchanged(partition):
    train, test = partition
    kwargs = dict(local_steps=3, batch_size=8, seed=1, secure_rng=False, rho=0.05)
    config = {**ROUND, keys.PRIVATIZE: True, keys.CLIPPING_NORM: 0.5, keys.NOISE_STD: 0.1}
    weights = get_weights(model())
    a = fit_update(SAMClient(model(), train, test, device="cpu", **kwargs), weights, config)
    b = fit_update(SAMClient(model(), train, test, **kwargs), weights, config)
    assert np.array_equal(a, b) and a.dtype == np.float32


# ---------------------------------------------------------------- channels_last: same update, same wire format
def same_round(make_client, weights, config=ROUND) -> tuple[list[np.ndarray], list[np.ndarray]]:
    plain, _, _ = make_client(False).fit([w.copy() for w in weights], dict(config))
    last, _, _ = make_client(True).fit([w.copy() for w in weights], dict(config))
    return plain, last


@pytest.mark.parametrize("kind", ["sgd", "sam", "dp2-fedsam"])
def test_channels_last_gives_the_same_update_in_the_same_arrays(partition, kind):
    train, test = partition
    kwargs = dict(local_steps=5, batch_size=16, seed=1, secure_rng=False)
    net = model()
    body_keys, head_keys = split_state_keys(net)
    weights = get_weights(net)

    def make(channels_last: bool):
        if kind == "sgd":
            return TrainingClient(model(), train, test, channels_last=channels_last, **kwargs)
        if kind == "sam":
            return SAMClient(model(), train, test, channels_last=channels_last, rho=0.05, **kwargs)
        return DP2FedSAMClient(
            model(),
            train,
            test,
            channels_last=channels_last,
            rho=0.05,
            head_keys=head_keys,
            head_store=ContextHeadStore(RecordDict()),
            head_steps=2,
            **kwargs,
        )

    if kind == "dp2-fedsam":
        state = net.state_dict()
        weights = [state[k].numpy().copy() for k in body_keys]
    plain, last = same_round(make, weights)
    assert [a.shape for a in last] == [a.shape for a in plain] == [w.shape for w in weights]
    assert all(a.dtype == np.float32 and a.flags.c_contiguous for a in last)
    assert np.abs(flatten(plain)).max() > 1e-3
    np.testing.assert_allclose(flatten(last), flatten(plain), rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- torch noise generators
def test_secure_torch_generators_ignore_the_run_seed():
    """DP-SGD's noise generator (on the training device): with secure-rng two generators for the same run seed,
    round and client draw different noise; without it, the same."""
    device = resolve_device("auto")

    def draw(secure: bool) -> torch.Tensor:
        generator = torch_generator(42, 5, 1, 0, secure=secure, device=device)
        return torch.normal(0.0, 1.0, (1000,), generator=generator, device=device)

    assert not torch.equal(draw(True), draw(True))
    assert torch.equal(draw(False), draw(False))
    assert torch_generator(42, 5, 1, 0, device=device).device.type == device.type


# ---------------------------------------------------------------- on CUDA (skipped without it)
@needs_cuda
def test_a_round_on_cuda_returns_cpu_float32_and_learns(tmp_path):
    from dpfl.fl_app.client_app import app as client_app
    from dpfl.fl_app.server_app import run_federated
    from dpfl_tools.inprocess import InProcessGrid

    cfg = validate(
        {
            "device": "cuda",
            "partitioner": "iid",
            "num-rounds": 3,
            "sample-rate": 1.0,
            "noise-multiplier": 0.0,
            "clipping-norm": 0.0,
            "local-steps": 20,
            "results-dir": str(tmp_path / "run"),
        }
    )
    summary = run_federated(InProcessGrid(client_app, 5, cfg), cfg)
    assert summary["final_accuracy"] > 0.3  # chance: 0.1
    client = build_client(node_context(device="cuda", partitioner="iid"))
    assert next(client.model.parameters()).is_cuda
    upload, _, _ = client.fit(get_weights(model()), dict(ROUND))
    assert all(isinstance(a, np.ndarray) and a.dtype == np.float32 for a in upload)


@needs_cuda
def test_dpsgd_on_cuda_draws_noise_there(partition):
    train, test = partition
    client = DPSGDClient(
        copy.deepcopy(model()),
        train,
        test,
        state=RecordDict(),
        sample_rate=0.1,
        noise_multiplier=1.0,
        clipping_norm=1.0,
        target_epsilon=5.0,
        delta=1e-5,
        device="cuda",
    )
    update, _, metrics = client.fit(get_weights(model()), {**ROUND, keys.LOCAL_STEPS: 3})
    assert metrics[keys.LOCAL_STEPS] == 3 and all(a.dtype == np.float32 for a in update)
    assert np.isfinite(flatten(update)).all() and np.abs(flatten(update)).max() > 0
