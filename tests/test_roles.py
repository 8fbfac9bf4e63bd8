"""The declared roles (strategies/parts/roles.py): every shipped part has the methods of the roles it claims, and a part
that claims a role without one of them is refused when the wrapper is built, naming the part, the role and the
method."""

from __future__ import annotations

import ast
import inspect
import pkgutil
from importlib import import_module
from pathlib import Path

import pytest
from flwr.serverapp.strategy import FedAvg

import dpfl.strategies as strategies
from dpfl.strategies import DifferentialPrivacy
from dpfl.strategies.loop.options import PrivacyOptions, SamplingOptions
from dpfl.strategies.parts import noise_placement
from dpfl.strategies.parts.mechanism import GaussianMechanism
from dpfl.strategies.parts.part import ROLES, Part
from dpfl.strategies.parts.roles import ROLE_PROTOCOLS, check_roles, role_members


def shipped_parts() -> list[type[Part]]:
    """Every subclass of Part defined in strategies/ (each module imported, subpackages too, so a new part is found);
    every one of them lives in strategies/parts/."""
    for module in pkgutil.walk_packages(strategies.__path__, "dpfl.strategies."):
        import_module(module.name)
    found, todo = [], list(Part.__subclasses__())
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if cls.__module__.startswith("dpfl.strategies."):
            assert cls.__module__.startswith("dpfl.strategies.parts."), f"{cls.__name__} is a part outside parts/"
            found.append(cls)
    return found


def wrapper(part: Part) -> DifferentialPrivacy:
    return DifferentialPrivacy(
        FedAvg(),
        privacy=PrivacyOptions(clipping_norm=1.0, noise_multiplier=1.0),
        sampling=SamplingOptions(sample_rate=0.5),
        parts=[part],
    )


class HalfCodec(Part):
    """Claims the codec role without `decode`."""

    roles = ("codec",)


class HalfMechanism(GaussianMechanism):
    """A Gaussian mechanism that claims selection too, with `select` but not `next_truncation_probability`."""

    roles = ("mechanism", "selection")

    def select(self, dp, server_round, node_ids):
        return None


class Misnamed(Part):
    roles = ("codecs",)


def test_the_roles_are_declared_for_each_role_name():
    assert set(ROLE_PROTOCOLS) == set(ROLES)
    assert role_members(ROLE_PROTOCOLS["codec"]) == (("decode",), ())
    assert role_members(ROLE_PROTOCOLS["selection"])[0] == ("select", "next_truncation_probability")
    mechanism = set(role_members(ROLE_PROTOCOLS["mechanism"])[0])
    assert mechanism == {"make_ledger", "ledger_from_state", "accounted_noise_multiplier", "release"}
    assert role_members(ROLE_PROTOCOLS["noise"])[1] == (
        "name",
        "server_adds_noise",
        "clients_add_noise",
        "noise_in_shares",
    )


def test_every_shipped_part_has_the_methods_of_its_roles():
    parts = shipped_parts()
    names = {cls.__name__ for cls in parts}
    assert {"ClientSampling", "GaussianMechanism", "WaveletMechanism", "DenseCodec", "TopKCodec", "DPFTRL"} <= names
    assert {"CentralNoise", "DistributedNoise", "LocalNoise", "AdaptiveClipping", "AuditCanaries"} <= names
    claimed = {role for cls in parts for role in cls.roles}
    assert claimed == set(ROLES)  # each role is filled by at least one shipped part
    for cls in (cls for cls in parts if not inspect.isabstract(cls)):  # NoisePlacement: the three below
        part = cls.__new__(cls)  # the class's methods and attributes, without its settings
        check_roles(part)
        for role in cls.roles:
            assert isinstance(part, ROLE_PROTOCOLS[role]), (cls.__name__, role)


def test_the_wrappers_own_parts_fill_the_roles_it_calls():
    strategy = wrapper(Part())
    for attribute, role in (("selection", "selection"), ("mechanism", "mechanism"), ("codec", "codec")):
        assert role in getattr(strategy, attribute).roles
        assert isinstance(getattr(strategy, attribute), ROLE_PROTOCOLS[role])
    assert isinstance(strategy.noise, ROLE_PROTOCOLS["noise"]) and strategy.noise.roles == ("noise",)


@pytest.mark.parametrize(
    ("part", "message"),
    [
        (HalfCodec(), r"HalfCodec claims the role 'codec' but has no method decode\(\)"),
        (HalfMechanism(), r"HalfMechanism claims the role 'selection' but has no method next_truncation_probability"),
        (Misnamed(), r"Misnamed claims the role 'codecs'; the roles are selection, mechanism, codec, noise"),
    ],
)
def test_a_part_missing_a_role_method_fails_when_the_wrapper_is_built(part, message):
    with pytest.raises(TypeError, match=message):
        wrapper(part)
    with pytest.raises(TypeError, match=message):
        DifferentialPrivacy.check_settings(clipping_norm=1.0, noise_multiplier=1.0, sample_rate=0.5, parts=[part])
    with pytest.raises(TypeError, match=message):
        wrapper(Part()).add_part(part)


def test_a_part_with_its_roles_methods_is_taken():
    class Codec(HalfCodec):
        def decode(self, dp, content):
            return [], True

    assert wrapper(Codec()).codec.__class__ is Codec


def test_the_noise_placement_is_built_once_by_the_wrapper_and_parts_read_its_class():
    """Parts asked what a placement does by building one from its name; only the wrapper builds one now."""
    callers = []
    for path in sorted(Path(strategies.__path__[0]).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module in (
                "noise_placement",
                "dpfl.strategies.parts.noise_placement",
            ):
                callers += [path.name for alias in node.names if alias.name == "noise_placement"]
    assert callers == ["dp_fedavg.py"]
    for name, cls in noise_placement.PLACEMENTS.items():
        built = noise_placement.noise_placement(name)
        assert type(built) is cls and built.name == name
        for attribute in ("server_adds_noise", "clients_add_noise", "noise_in_shares"):
            assert getattr(cls, attribute) == getattr(built, attribute)
