"""Every test session decodes and partitions into its own cache folder (dpcore.task.data_cache.cache_dir); the
test modules that `flwr run` apps share one SuperLink fixture; the deployment tests make theirs per test."""

import atexit
import os
import shutil
import tempfile

import pytest

if "DPFL_CACHE_DIR" not in os.environ:
    os.environ["DPFL_CACHE_DIR"] = tempfile.mkdtemp(prefix="dpfl-test-cache-")
    atexit.register(shutil.rmtree, os.environ["DPFL_CACHE_DIR"], ignore_errors=True)


@pytest.fixture(scope="module")
def superlink(tmp_path_factory):
    """A simulation SuperLink of the test module's own (free ports, private FLWR_HOME, this checkout's code),
    ended by PID; the environment for `flwr run`."""
    from dpfl_tools.superlink import own_simulation_superlink

    with own_simulation_superlink(tmp_path_factory.mktemp("flwr-home")) as env:
        yield env


@pytest.fixture
def deployment(tmp_path):
    """Makes Deployments (dpfl_tools.local_deployment: flower-superlink and flower-supernode processes on loopback)
    under the test's tmp folder; each is closed (its processes ended by PID) when the test ends, also on failure."""
    from dpfl_tools.local_deployment import Deployment

    made = []

    def make(**kwargs) -> Deployment:
        made.append(Deployment(tmp_path, **kwargs))
        return made[-1]

    yield make
    for d in made:
        d.close()
