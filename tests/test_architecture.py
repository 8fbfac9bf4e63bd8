"""The layers of docs/architecture.md hold in the code, and the project stands on its own.

- the neutral core (dpcore.privacy, dpcore.task) imports no strategy, client or app module;
- no module under clients/ imports a server strategy, and no strategy imports a client;
- no module outside the registry (fl_app/algorithms.py) names an algorithm (so none branches on one);
- no file of the project points outside the repository;
- no two modules import each other, directly or through others (lazy imports included);
- the public namespace `dpfl` imports only strategies, clients and the core, and nothing of the product imports it;
- the import graph drawn in docs/architecture.md is the code's current one;
- the FAB that `flwr run` builds holds every project module and no docs, benchmarks or tests.
"""

import ast
import re
import subprocess
import zipfile
from pathlib import Path

import pytest

from fl_app.algorithms import ALGORITHMS
from fl_app.import_graph import ROOT, import_cycles, import_edges, layer_of, mermaid, project_modules
from fl_app.local_deployment import BIN

EDGES = import_edges()


def test_the_graph_sees_the_known_imports():
    assert ("strategies.dp_fedavg", "strategies.round_loop", False) in EDGES
    assert ("clients.base", "dpcore.privacy.mechanisms", False) in EDGES
    assert ("fl_app.algorithms", "clients.dpsgd", True) in EDGES  # lazy: only DP-SGD needs Opacus
    assert len(EDGES) > 60


@pytest.mark.parametrize(
    "importer_layer,forbidden",
    [
        ("neutral core", ("server strategies", "clients", "app wiring")),
        ("clients", ("server strategies", "app wiring")),
        ("server strategies", ("clients", "app wiring")),
    ],
)
def test_layers_import_only_downwards(importer_layer, forbidden):
    bad = [(a, b) for a, b, _ in EDGES if layer_of(a) == importer_layer and layer_of(b) in forbidden]
    assert bad == [], f"{importer_layer} must not import {forbidden}: {bad}"


PUBLIC_API_IMPORTS = {"strategies", "clients", "dpcore", "importlib"}


def imported_modules(path: Path) -> set[str]:
    """Every module an `import` or `from ... import` of the file names (lazy imports included)."""
    return {
        alias.name if isinstance(node, ast.Import) else node.module or ""
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    }


def test_the_public_api_layer_sits_on_top_and_nothing_imports_it():
    """`dpfl` re-exports strategies, clients and the core (its lazy names too); no module of the product
    imports it, so it stays a namespace for users and never a knot in the graph."""
    import dpfl

    modules = {m for path in (ROOT / "dpfl").rglob("*.py") for m in imported_modules(path)}
    modules |= set(dpfl._TORCH_NAMES.values())
    assert {m.split(".")[0] for m in modules} <= PUBLIC_API_IMPORTS, modules
    assert [
        name
        for name, path in project_modules().items()
        if any(m.split(".")[0] == "dpfl" for m in imported_modules(path))
    ] == []


def test_the_public_api_check_sees_an_import_of_dpfl(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from dpfl import DPFedAvg\n    import dpfl.x\n")
    assert imported_modules(module) == {"dpfl", "dpfl.x"}


def test_no_import_cycles():
    assert import_cycles(EDGES) == []


def test_an_import_cycle_would_be_caught():
    edges = [("a", "b", False), ("b", "c", True), ("c", "a", False), ("c", "d", False), ("d", "e", False)]
    assert import_cycles(edges) == [["a", "b", "c"]]
    assert import_cycles([("a", "b", False), ("b", "a", True)]) == [["a", "b"]]


RAW_CONFIG_READERS = {"fl_app.config", "fl_app.launch", "fl_app.simulation_resources", "fl_app.report"}  # start-up


def test_after_start_up_no_module_reads_a_run_config_key_from_a_dict():
    """Validation turns the run config into typed Settings; the code after it reads their fields
    (settings.privacy.noise_multiplier), never cfg["noise-multiplier"]. Only the start-up modules (validation,
    the launcher and the registry's `reference_overrides` of its override dicts) and the report (which reads
    saved config.json files) see run configs as dicts. (Node configs and the ledger's own state record share
    some key names: not run configs.)"""
    from fl_app.config import SPEC

    start_up_functions = {"reference_overrides"}
    not_run_configs = ("node", "state")

    def config_reads(path: Path) -> list[str]:
        tree = ast.parse(path.read_text())
        skipped = {
            id(n)
            for f in ast.walk(tree)
            if isinstance(f, ast.FunctionDef) and f.name in start_up_functions
            for n in ast.walk(f)
        }
        reads = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Subscript):
                target, key = node.value, node.slice
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
                target, key = node.func.value, node.args[0] if node.args else None
            else:
                continue
            if (
                isinstance(key, ast.Constant)
                and key.value in SPEC
                and id(node) not in skipped
                and not any(word in ast.unparse(target) for word in not_run_configs)
            ):
                reads.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
        return reads

    assert [
        r for name, path in project_modules().items() if name not in RAW_CONFIG_READERS for r in config_reads(path)
    ] == []


def test_the_run_config_read_check_can_fail(tmp_path, monkeypatch):
    """A module reading cfg["noise-multiplier"] after start-up is found."""
    import fl_app.import_graph

    module = tmp_path / "fl_app" / "late_reader.py"
    module.parent.mkdir()
    module.write_text("def f(cfg):\n    return cfg['noise-multiplier'] * 2\n")
    monkeypatch.setattr(fl_app.import_graph, "ROOT", tmp_path)
    with pytest.raises(AssertionError, match="late_reader.py:2"):
        test_after_start_up_no_module_reads_a_run_config_key_from_a_dict()


def string_constants(path: Path) -> list[tuple[int, str]]:
    return [
        (n.lineno, n.value)
        for n in ast.walk(ast.parse(path.read_text()))
        if isinstance(n, ast.Constant) and isinstance(n.value, str)
    ]


def test_only_the_registry_names_algorithms():
    names = set(ALGORITHMS)
    found = [
        f"{name}:{line}: {value!r}"
        for name, path in project_modules().items()
        if name != "fl_app.algorithms"
        for line, value in string_constants(path)
        if value in names
    ]
    assert found == [], "branch on the registry's records instead of algorithm names: " + "; ".join(found)


def test_a_new_name_in_a_module_would_be_caught(tmp_path):
    """The check above can fail: a module comparing cfg['algorithm'] with a name is found."""
    module = tmp_path / "bad.py"
    module.write_text("def f(cfg):\n    return cfg['algorithm'] == 'ali-dpfl'\n")
    assert (2, "ali-dpfl") in string_constants(module)


OUTSIDE = [
    r"\.\./shared",
    "/wor" + "k/",
    "ALGORITHMS" + r"\.md",
    "DESIGN" + r"\.md",
    r"\b(ali-dpfl|dp-fedsam|dp2-fedsam|dp2-fedsam-conference|dp-fedavg-wavelet)\.txt\b",
]


def test_no_file_points_outside_the_repository():
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    hits = []
    for name in files:
        path = ROOT / name
        if path.suffix not in (".py", ".md", ".toml", ".txt", ".cfg", "") or not path.is_file():
            continue
        text = path.read_text(errors="replace")
        hits += [f"{name}: {m.group(0)}" for pattern in OUTSIDE for m in re.finditer(pattern, text)]
    assert hits == [], hits


def test_benchmarks_run_as_modules_without_path_hacks():
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        text = path.read_text()
        assert "sys.path" not in text and "from tests" not in text and "import tests" not in text, path.name


def test_architecture_doc_draws_the_current_graph():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    assert f"```mermaid\n{mermaid()}\n```" in doc, "regenerate it: python -m fl_app.import_graph --write"


def test_the_fab_holds_every_project_module_and_nothing_else_of_ours(tmp_path):
    """`fab-include` in pyproject.toml: what every node installs and every ClientApp task unpacks."""
    subprocess.run([str(BIN / "flwr"), "build", "--app", str(ROOT)], cwd=tmp_path, check=True, capture_output=True)
    (fab,) = tmp_path.glob("*.fab")
    names = set(zipfile.ZipFile(fab).namelist())
    modules = {str(path.relative_to(ROOT)) for path in project_modules().values()}
    assert modules - names == set()
    assert {"pyproject.toml", "LICENSE"} <= names
    assert [n for n in names if n.split("/")[0] in ("docs", "benchmarks", "tests") or n == "README.md"] == []
