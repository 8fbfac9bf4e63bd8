"""Each simulated client's GPU share: the launcher's default, the shares Ray cannot give, and the
`--federation-config` Flower reads (dpfl_tools.simulation_resources)."""

import pytest
import torch

no_cuda = pytest.mark.skipif(
    torch.cuda.is_available(), reason="this machine has CUDA: the refusal of a GPU share without a GPU cannot be shown"
)


def test_default_gpu_share_splits_the_gpus_between_the_clients_that_run_at_once():
    from dpfl_tools.simulation_resources import default_gpus_per_client

    assert default_gpus_per_client(10_000, gpus=1, cpus=16) == 1 / 16
    assert default_gpus_per_client(3, gpus=1, cpus=16) == 1 / 3
    assert default_gpus_per_client(10_000, gpus=2, cpus=16) == 1 / 8
    assert default_gpus_per_client(1, gpus=2, cpus=16) == 1.0
    assert default_gpus_per_client(50, gpus=0, cpus=2) == 0.0
    assert default_gpus_per_client(10_000, gpus=1, cpus=16, cpus_per_client=4) == 1 / 4


def test_gpu_shares_ray_cannot_give_are_refused():
    from dpfl_tools.simulation_resources import gpu_share_problem

    assert gpu_share_problem(0.25, 1) is None and gpu_share_problem(0.0, 0) is None and gpu_share_problem(2, 2) is None
    assert "no GPU is visible" in gpu_share_problem(0.5, 0)
    assert "must be >= 0" in gpu_share_problem(-1.0, 1)
    assert "whole GPUs" in gpu_share_problem(1.5, 2)
    assert "more than the 1 GPU(s)" in gpu_share_problem(2.0, 1)


def test_the_federation_config_is_what_flower_reads():
    from flwr.common.config import parse_config_args
    from flwr.supercore.utils import simulation_config_from_json

    from dpfl_tools.simulation_resources import federation_config, run_device

    assert federation_config(50) == "num-supernodes=50 client-resources-num-cpus=1"
    assert federation_config(50, cpus_per_client=2) == "num-supernodes=50 client-resources-num-cpus=2"
    text = federation_config(10_000, 1 / 16)
    parsed = simulation_config_from_json({k.replace("-", "_"): v for k, v in parse_config_args([text]).items()})
    assert (parsed.num_supernodes, parsed.client_resources_num_cpus) == (10_000, 1)
    assert parsed.client_resources_num_gpus == pytest.approx(0.0625)
    assert run_device("num-rounds=2 device='cpu'") == "cpu" and run_device("") == "auto"


@no_cuda
def test_the_launcher_asks_for_no_gpu_here_and_refuses_a_share_before_starting_anything(capsys):
    from dpfl_tools.launch import main
    from dpfl_tools.simulation_resources import gpus_per_client

    assert gpus_per_client(None, 50, "") == 0.0 and gpus_per_client(None, 50, "device='cuda'") == 0.0
    with pytest.raises(SystemExit, match="--gpus-per-client 0.5: no GPU is visible here"):
        main(["--gpus-per-client", "0.5", "--clients", "4"])


def test_with_a_gpu_the_launcher_shares_it_unless_the_run_is_on_the_cpu(monkeypatch):
    """torch's answer faked to one GPU on 16 cores."""
    import dpfl_tools.simulation_resources as resources

    monkeypatch.setattr(resources, "visible_gpus", lambda: 1)
    monkeypatch.setattr(resources.os, "cpu_count", lambda: 16)
    assert resources.gpus_per_client(None, 10_000, "num-rounds=3") == 1 / 16
    assert resources.gpus_per_client(None, 4, "") == 1 / 4
    assert resources.gpus_per_client(None, 10_000, "device='cpu'") == 0.0
    assert resources.gpus_per_client(0.25, 10_000, "device='cpu'") == 0.25  # asked for: given
    with pytest.raises(SystemExit, match="whole GPUs"):
        resources.gpus_per_client(1.5, 10, "")
