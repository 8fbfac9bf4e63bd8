"""The layers of docs/architecture.md hold in the code, and the project stands on its own.

- the neutral core (dpcore.privacy, dpcore.task) imports no strategy, client or app module;
- no module under clients/ imports a server strategy, and no strategy imports a client;
- the tooling (dpfl_tools) may import everything, and no app module imports it (only tests and benchmarks do);
- the app package (fl_app) holds only the apps, their settings and what a run writes: at most FL_APP_MAX_LINES;
- no module outside the registry (fl_app/algorithms.py) names an algorithm (so none branches on one), but for
  the `algorithm` key's declared default in fl_app/settings.py;
- no file of the project points outside the repository;
- no two modules import each other, directly or through others (lazy and TYPE_CHECKING imports included: a
  circle of knowledge all the same), and no import points back up a layer (those included too);
- the public namespace `dpfl` imports only strategies, clients and the core, and nothing of the product imports it;
- the import graph drawn in docs/architecture.md is the code's current one;
- the FAB that `flwr run` builds holds every app module and no tooling, docs, benchmarks or tests.
"""

import ast
import re
import subprocess
import zipfile
from pathlib import Path

import pytest

from dpfl.fl_app import PROJECT_PACKAGES
from dpfl.fl_app.algorithms import ALGORITHMS
from dpfl_tools.import_graph import ROOT, import_cycles, import_edges, layer_of, mermaid, project_modules
from dpfl_tools.processes import BIN

EDGES = import_edges()


def test_the_graph_sees_the_known_imports():
    assert ("strategies.dp_fedavg", "strategies.loop.round_loop", False) in EDGES
    assert ("clients.base", "dpcore.privacy.mechanisms", False) in EDGES
    assert ("fl_app.builders", "clients.dpsgd", True) in EDGES  # lazy: only DP-SGD needs Opacus
    assert len(EDGES) > 60


FORBIDDEN = {  # importer layer -> the layers it must not import
    "neutral core": ("strategy parts", "round loop", "server strategies", "clients", "app wiring", "tooling"),
    "strategy parts": ("round loop", "server strategies", "clients", "app wiring", "tooling"),
    "round loop": ("server strategies", "clients", "app wiring", "tooling"),
    "clients": ("strategy parts", "round loop", "server strategies", "app wiring", "tooling"),
    "server strategies": ("clients", "app wiring", "tooling"),
    "app wiring": ("tooling",),
}


def arrows_back_up(edges) -> list[tuple[str, str]]:
    """Imports (lazy and TYPE_CHECKING ones included) from a layer of a module it must not import."""
    return [(a, b) for a, b, _ in edges if layer_of(b) in FORBIDDEN.get(layer_of(a), ())]


@pytest.mark.parametrize("importer_layer", FORBIDDEN)
def test_layers_import_only_downwards(importer_layer):
    bad = [(a, b) for a, b in arrows_back_up(EDGES) if layer_of(a) == importer_layer]
    assert bad == [], f"{importer_layer} must not import {FORBIDDEN[importer_layer]}: {bad}"


def test_no_app_module_imports_the_tooling():
    """The FAB does not ship dpfl_tools, so no module of dpcore, strategies, clients or fl_app imports it (lazy
    imports included: an opt-in patch is loaded by name, fl_app.speed_patches); and the tooling is drawn."""
    app = [(a, b) for a, b, _ in EDGES if a.split(".")[0] in PROJECT_PACKAGES and b.split(".")[0] == "dpfl_tools"]
    assert app == []
    assert ("dpfl_tools.launch", "dpfl_tools.plan", False) in EDGES  # the graph sees the tooling's own imports


FL_APP_MAX_LINES = 3200  # the apps, settings and registry, and what a run writes (the tooling is in dpfl_tools)


MAX_FILE_LINES, MAX_CLASS_METHODS = 500, 25  # a file and a class a reader takes in; split by job beyond


def test_no_source_file_or_class_outgrows_a_reader():
    files = [p for package in (*PROJECT_PACKAGES, "dpfl_tools", "dpfl") for p in (ROOT / package).rglob("*.py")]
    long_files = {str(p.relative_to(ROOT)): n for p in files if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES}
    assert long_files == {}
    big_classes = {
        f"{p.relative_to(ROOT)}:{node.name}": len(methods)
        for p in files
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.ClassDef)
        and len(methods := [f for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))])
        > MAX_CLASS_METHODS
    }
    assert big_classes == {}


def methods_and_attributes(cls: type) -> tuple[set[str], set[str]]:
    """Over the project classes of `cls`'s MRO: the methods and properties (`__init__` included, other dunders not)
    and the attributes (class-level values, and every `self.x = ...` in their source)."""
    import inspect
    import textwrap

    methods, attributes = set(), set()
    for klass in [k for k in cls.__mro__ if k.__module__.startswith("dpfl.")]:
        for name, value in vars(klass).items():
            if (name.startswith("__") and name != "__init__") or name == "_abc_impl":  # ABCMeta's cache, not ours
                continue
            callable_ = callable(value) or isinstance(value, (property, staticmethod, classmethod))
            (methods if callable_ else attributes).add(name)
        for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(klass)))):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and getattr(node.value, "id", "") == "self"
            ):
                attributes.add(node.attr)
    return methods, attributes


# What the wrapper and ALIDPFL hold over their whole MRO, as (methods, attributes): ceilings that only go down,
# under issue 41's target of (30, 15). The loop holds its reply gate, run record, population and options as objects;
# ALIDPFL its schedule of local steps and its mirror of the clients' spending.
MRO_TARGET = (30, 15)
MRO_CEILINGS = {"DifferentialPrivacy": (30, 14), "ALIDPFL": (26, 15)}


def test_the_wrapper_and_alidpfl_stay_under_their_method_and_attribute_ceilings():
    from dpfl import ALIDPFL, DifferentialPrivacy
    from dpfl.strategies.loop.reply_gate import ReplyGate

    for cls in (DifferentialPrivacy, ALIDPFL):
        methods, attributes = methods_and_attributes(cls)
        most_methods, most_attributes = MRO_CEILINGS[cls.__name__]
        assert most_methods <= MRO_TARGET[0] and most_attributes <= MRO_TARGET[1]
        assert len(methods) <= most_methods and len(attributes) <= most_attributes, (cls.__name__, methods, attributes)
        assert ReplyGate not in cls.__mro__ and {"accepted", "reply_update", "warn"}.isdisjoint(methods)


def test_the_app_package_holds_only_what_the_fab_needs():
    lines = {path.name: len(path.read_text().splitlines()) for path in sorted((ROOT / "fl_app").glob("*.py"))}
    assert sum(lines.values()) <= FL_APP_MAX_LINES, lines
    assert "launch.py" not in lines and "report.py" not in lines and "pull_backoff.py" not in lines


PUBLIC_API_IMPORTS = {"strategies", "clients", "dpcore"}


def imported_modules(path: Path) -> set[str]:
    """Every module an `import` or `from ... import` of the file names (lazy imports included)."""
    return {
        alias.name if isinstance(node, ast.Import) else node.module or ""
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    }


def test_the_public_api_layer_sits_on_top_and_nothing_imports_it():
    """`dpfl`'s names come from strategies, clients and the core (`dpfl.strategies`, ...: its lazy tables, and it
    imports nothing else of the project); no module of the product imports `dpfl`'s names, only its packages, so
    it stays a namespace for users and never a knot in the graph."""
    import dpfl

    homes = {*dpfl._HOMES.values(), *dpfl._TORCH_HOMES.values()}
    assert {m.split(".")[1] for m in homes} <= PUBLIC_API_IMPORTS and all(m.startswith("dpfl.") for m in homes)
    assert {m.split(".")[0] for m in imported_modules(ROOT / "dpfl" / "__init__.py")} == {"os", "importlib"}
    assert [
        name
        for name, path in project_modules().items()
        if any(m == "dpfl" or (m.startswith("dpfl.") and not app_module(m)) for m in imported_modules(path))
    ] == []


def app_module(name: str) -> bool:
    """`dpfl.strategies.x` and the like: a module of one of the app's packages under its installed name."""
    return name.split(".")[1] in PROJECT_PACKAGES


def test_every_import_of_the_apps_packages_is_under_dpfl():
    """Installed, the app's packages exist only as `dpfl.strategies`, `dpfl.clients`, `dpfl.dpcore`, `dpfl.fl_app`
    (pyproject's package-dir): an import of a bare `strategies` or `clients` would meet a user's own module of that
    name (the issue of an app that has one). Checked in every file of the repository, tests and benchmarks too."""
    bare = {
        f"{path.relative_to(ROOT)}: {m}"
        for path in ROOT.rglob("*.py")
        if not any(part.startswith(".") for part in path.relative_to(ROOT).parts) and "foreign_app" not in path.parts
        for m in imported_modules(path)
        if m.split(".")[0] in PROJECT_PACKAGES
    }
    assert bare == set()


def test_the_public_api_check_sees_an_import_of_dpfl(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from dpfl import DPFedAvg\n    import dpfl.x\n")
    assert imported_modules(module) == {"dpfl", "dpfl.x"}


def test_no_import_cycles():
    assert import_cycles(EDGES) == []


def test_type_checking_imports_count_for_cycles_and_layers(tmp_path, monkeypatch):
    """An import under `if TYPE_CHECKING:` is an edge: two modules that know each other only through one are a
    circle, and a core module that names an app type under it points back up."""
    import dpfl_tools.import_graph

    for package, name, text in (
        ("fl_app", "registry", "from dpfl.fl_app.knobs import Knobs\n"),
        (
            "fl_app",
            "knobs",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from dpfl.fl_app.registry import R\n",
        ),
        ("dpcore", "core", "import typing\nif typing.TYPE_CHECKING:\n    from dpfl.fl_app.knobs import Knobs\n"),
    ):
        (tmp_path / package).mkdir(exist_ok=True)
        (tmp_path / package / f"{name}.py").write_text(text)
    monkeypatch.setattr(dpfl_tools.import_graph, "ROOT", tmp_path)
    edges = import_edges()
    assert ("fl_app.knobs", "fl_app.registry", True) in edges
    assert import_cycles(edges) == [["fl_app.knobs", "fl_app.registry"]]
    assert arrows_back_up(edges) == [("dpcore.core", "fl_app.knobs")]


def test_the_settings_know_nothing_of_the_registry():
    """fl_app.settings (the declarations) is below the registry: the registry reads Settings, never the other
    way round, not even for annotations."""
    assert [b for a, b, _ in EDGES if a == "fl_app.settings" and b.startswith("fl_app.")] == ["fl_app.run_config_keys"]
    assert ("fl_app.algorithms", "fl_app.settings", False) in EDGES


def test_an_import_cycle_would_be_caught():
    edges = [("a", "b", False), ("b", "c", True), ("c", "a", False), ("c", "d", False), ("d", "e", False)]
    assert import_cycles(edges) == [["a", "b", "c"]]
    assert import_cycles([("a", "b", False), ("b", "a", True)]) == [["a", "b"]]


RAW_CONFIG_READERS = {
    "dpfl_tools.plan",
    "fl_app.config",
    "dpfl_tools.launch",
    "dpfl_tools.simulation_resources",
    "dpfl_tools.report",
}  # start-up


def test_after_start_up_no_module_reads_a_run_config_key_from_a_dict():
    """Validation turns the run config into typed Settings; the code after it reads their fields
    (settings.privacy.noise_multiplier), never cfg["noise-multiplier"]. Only the start-up modules (validation,
    the launcher and the registry's `reference_overrides` of its override dicts) and the report (which reads
    saved config.json files) see run configs as dicts. (Node configs and the ledger's own state record share
    some key names: not run configs.)"""
    from dpfl.fl_app.config import SPEC

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
    import dpfl_tools.import_graph

    module = tmp_path / "fl_app" / "late_reader.py"
    module.parent.mkdir()
    module.write_text("def f(cfg):\n    return cfg['noise-multiplier'] * 2\n")
    monkeypatch.setattr(dpfl_tools.import_graph, "ROOT", tmp_path)
    with pytest.raises(AssertionError, match="late_reader.py:2"):
        test_after_start_up_no_module_reads_a_run_config_key_from_a_dict()


def string_constants(path: Path) -> list[tuple[int, str]]:
    return [
        (n.lineno, n.value)
        for n in ast.walk(ast.parse(path.read_text()))
        if isinstance(n, ast.Constant) and isinstance(n.value, str)
    ]


def test_only_the_registry_names_algorithms():
    """...but for the `algorithm` key's declared default (fl_app.settings.DEFAULT_ALGORITHM, one of the registry's
    names: validation checks it like any value)."""
    from dpfl.fl_app.settings import DEFAULT_ALGORITHM

    names = set(ALGORITHMS)
    assert DEFAULT_ALGORITHM in names
    found = [
        f"{name}:{line}: {value!r}"
        for name, path in project_modules().items()
        if name != "fl_app.algorithms"
        for line, value in string_constants(path)
        if value in names and (name, value) != ("fl_app.settings", DEFAULT_ALGORITHM)
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
    assert f"```mermaid\n{mermaid()}\n```" in doc, "regenerate it: python -m dpfl_tools.import_graph --write"


@pytest.mark.slow  # builds the FAB with `flwr build`: about 11 s
def test_the_fab_holds_every_project_module_and_nothing_else_of_ours(tmp_path):
    """`fab-include` in pyproject.toml: what every node installs and every ClientApp task unpacks."""
    subprocess.run([str(BIN / "flwr"), "build", "--app", str(ROOT)], cwd=tmp_path, check=True, capture_output=True)
    (fab,) = tmp_path.glob("*.fab")
    names = set(zipfile.ZipFile(fab).namelist())
    modules = {str(path.relative_to(ROOT)) for path in project_modules(PROJECT_PACKAGES).values()}
    assert modules - names == set()
    assert {"pyproject.toml", "LICENSE"} <= names
    assert [n for n in names if n.startswith("dpfl_tools/")] == []  # the tooling is not shipped
    assert [n for n in names if n.split("/")[0] in ("docs", "benchmarks", "tests") or n == "README.md"] == []
