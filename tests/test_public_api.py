"""`import dpfl` gives the public API, cheaply, and the README and docs import only from it (and Flower, torch,
numpy): a user never meets the project's generic package names (strategies, clients, dpcore)."""

import ast
import inspect
import re
import subprocess
import sys
import textwrap
from importlib import import_module
from pathlib import Path

import pytest

import dpfl

ROOT = Path(__file__).resolve().parents[1]
DOC_IMPORTS = {"dpfl", "flwr", "torch", "numpy"}
PUBLIC = {  # issue 33: what `import dpfl` must give
    "DifferentialPrivacy",
    "DPFedAvg",
    "LegacyDPFedAvg",
    "LegacyDifferentialPrivacy",
    "DPSecAggPlusWorkflow",
    "SecAggPlusDPFedAvg",
    "SecAggPlusDifferentialPrivacy",
    "ALIDPFL",
    "AdaptiveClipping",
    "DPFTRL",
    "dp_privatize_mod",
    "clip_bit_mod",
    "make_local_dp_mod",
    "TrainingClient",
    "ClientLevelLedger",
    "SampleLevelLedgers",
    "PrivacyLedger",
    # issue 41 item 6: what docs/architecture.md's "Adding a part" uses (the roles and parts: below)
    "PrivacyOptions",
    "SamplingOptions",
    "RunOptions",
    "DPSGDOptions",
    "ServerData",
    "Part",
    "AfterRound",
    "NoisePlacementMode",
    "ClientSamplingMode",
    "TargetEpsilonMode",
    "PrivacyUnit",
}


def reexports() -> dict[str, str]:
    """name -> home module: dpfl/__init__.py's lazy tables."""
    return dpfl._HOMES | dpfl._TORCH_HOMES


def test_dpfl_gives_the_public_api():
    assert PUBLIC <= set(dpfl.__all__)
    assert len(dpfl.__all__) == len(set(dpfl.__all__))


def test_dpfl_gives_the_role_protocols_and_every_shipped_part():
    from dpfl.strategies.parts.roles import ROLE_PROTOCOLS
    from tests.test_roles import shipped_parts

    concrete = {cls.__name__ for cls in shipped_parts() if not inspect.isabstract(cls)}
    assert {"TopKCodec", "CentralNoise", "GaussianMechanism"} <= concrete
    assert {p.__name__ for p in ROLE_PROTOCOLS.values()} | concrete <= set(dpfl.__all__)


@pytest.mark.parametrize("name", dpfl.__all__)
def test_each_name_is_its_home_modules_object(name):
    homes = reexports()
    assert getattr(dpfl, name) is getattr(import_module(homes[name]), name)


def test_every_reexport_is_listed_and_an_unknown_name_is_an_error():
    assert set(reexports()) == set(dpfl.__all__)
    with pytest.raises(AttributeError, match="no attribute 'DPFedAvgg'"):
        dpfl.DPFedAvgg  # noqa: B018


def test_import_dpfl_loads_neither_torch_nor_opacus():
    code = "import sys, dpfl; print(sorted(m for m in ('torch', 'opacus') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def python_blocks(text: str) -> list[str]:
    """The fenced ```python blocks of a Markdown text (indented ones, inside a list, dedented)."""
    return [
        textwrap.dedent(m.group(2)) for m in re.finditer(r"^( *)```python\n(.*?)^\1```", text, re.MULTILINE | re.DOTALL)
    ]


def imports_of(code: str) -> list[tuple[str, list[str]]]:
    """(module, names) of every import in a code block."""
    found = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.module or "", [alias.name for alias in node.names]))
    return found


def doc_imports() -> list[tuple[str, str, list[str]]]:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return [
        (doc.name, module, names)
        for doc in docs
        for block in python_blocks(doc.read_text())
        for module, names in imports_of(block)
    ]


def test_readme_and_docs_import_only_dpfl_flower_torch_numpy():
    found = doc_imports()
    assert ("README.md", "dpfl", ["DifferentialPrivacy"]) in found
    assert [(doc, module) for doc, module, _ in found if module.split(".")[0] not in DOC_IMPORTS] == []
    assert [(doc, module) for doc, module, _ in found if module.startswith("dpfl.")] == []  # the names, not homes
    assert [(doc, n) for doc, module, names in found if module == "dpfl" for n in names if n not in dpfl.__all__] == []


def test_the_docs_import_check_sees_a_project_import():
    text = "text\n\n  ```python\n  from dpfl.strategies.legacy.adapter import LegacyDPFedAvg\n  import dpfl.clients.mods\n  ```\n"
    assert [imports_of(b) for b in python_blocks(text)] == [
        [("dpfl.strategies.legacy.adapter", ["LegacyDPFedAvg"]), ("dpfl.clients.mods", [])]
    ]
