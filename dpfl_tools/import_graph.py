"""The project's import graph, read from the code with `ast` (nothing is imported or run).

    python -m dpfl_tools.import_graph            # Mermaid diagram of module imports
    python -m dpfl_tools.import_graph --write    # ... written into docs/architecture.md

`import_edges()` lists (importer, imported, lazy) for every import of a project module by
another; `lazy` marks imports inside a function (made only when that code runs) and imports under
`if TYPE_CHECKING:` (for annotations, never run). Both are knowledge of the imported module all the
same, so they count for the layer rules and the import cycles.
tests/test_architecture.py checks the layer rules on these edges and that the diagram in
docs/architecture.md is the current one.
"""

from __future__ import annotations

import ast
from pathlib import Path

from dpfl.fl_app import PROJECT_PACKAGES
from dpfl_tools import ROOT

GRAPH_PACKAGES = (*PROJECT_PACKAGES, "dpfl_tools")  # the app's packages (what the FAB ships) and the tooling

LAYERS = {  # subgraph title -> module prefixes, from the bottom layer up
    "neutral core": ("dpcore",),
    "strategy parts": ("strategies.parts",),  # the ground of strategies/: the part protocol, roles, every part
    "round loop": ("strategies.loop",),
    "server strategies": ("strategies",),  # the algorithms on the loop, sample-level, legacy
    "clients": ("clients",),
    "app wiring": ("fl_app",),
    "tooling": ("dpfl_tools",),
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules(packages: tuple[str, ...] = GRAPH_PACKAGES) -> dict[str, Path]:
    """Module name -> file of every module of `packages` (default: the app's and the tooling's)."""
    return {module_name(p): p for package in packages for p in sorted((ROOT / package).rglob("*.py"))}


def _in_repository(name: str) -> str:
    """`dpfl.strategies.x` (the installed name every import uses) -> `strategies.x` (the repository's folder)."""
    inner = name.removeprefix("dpfl.")
    return inner if inner != name and inner.split(".")[0] in PROJECT_PACKAGES else name


def _resolve(importer: str, node: ast.ImportFrom | ast.Import, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [_in_repository(alias.name) for alias in node.names]
    if node.level:  # relative: from .x import y
        base = importer.split(".") if is_package else importer.split(".")[:-1]
        base = base[: len(base) - node.level + 1]
        prefix = ".".join(base + ([node.module] if node.module else []))
    else:
        prefix = _in_repository(node.module or "")
    return [prefix] + [f"{prefix}.{alias.name}" for alias in node.names]


def _is_type_checking_block(node: ast.AST) -> bool:
    """`if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`)."""
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def import_edges() -> list[tuple[str, str, bool]]:
    """(importer, imported project module, lazy) for every import between project modules (lazy: inside a
    function, or under `if TYPE_CHECKING:`)."""
    modules = project_modules()
    edges = set()
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        lazy_nodes = {id(n) for f in functions for n in ast.walk(f)}
        typing_only = {id(n) for block in ast.walk(tree) if _is_type_checking_block(block) for n in ast.walk(block)}
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in _resolve(name, node, path.name == "__init__.py"):
                if target in modules and target != name:
                    edges.add((name, target, id(node) in lazy_nodes or id(node) in typing_only))
    # an import that is made both eagerly and lazily counts as eager
    eager = {(a, b) for a, b, lazy in edges if not lazy}
    return sorted(e for e in edges if not (e[2] and (e[0], e[1]) in eager))


def import_cycles(edges: list[tuple[str, str, bool]]) -> list[list[str]]:
    """Groups of modules that import each other, directly or through others (lazy and TYPE_CHECKING imports
    count): Tarjan's strongly connected components with more than one module, each sorted."""
    graph: dict[str, list[str]] = {}
    for a, b, _ in edges:
        graph.setdefault(a, []).append(b)
        graph.setdefault(b, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = stack[stack.index(v) :]
            del stack[stack.index(v) :]
            if len(group) > 1:
                cycles.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(cycles)


def layer_of(module: str) -> str:
    for layer, prefixes in LAYERS.items():
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return layer
    raise ValueError(f"module {module} is in no layer")


def mermaid() -> str:
    """The import graph as a Mermaid flowchart, one subgraph per layer (dashed: lazy or TYPE_CHECKING imports)."""
    modules = [
        m
        for m in project_modules()
        if not m.endswith("__init__") and m not in GRAPH_PACKAGES and m not in ("dpcore.privacy", "dpcore.task")
    ]
    node_id = {m: m.replace(".", "_") for m in modules}
    lines = ["flowchart BT"]
    for layer in LAYERS:
        lines.append(f'  subgraph {layer.replace(" ", "_")}["{layer}"]')
        lines += [f'    {node_id[m]}["{m}"]' for m in modules if layer_of(m) == layer]
        lines.append("  end")
    for a, b, lazy in import_edges():
        if a in node_id and b in node_id:
            lines.append(f"  {node_id[a]} {'-.->' if lazy else '-->'} {node_id[b]}")
    return "\n".join(lines)


def write_into(doc: Path) -> None:
    """Replace the ```mermaid block of `doc` with the current graph."""
    text = doc.read_text()
    start = text.index("```mermaid\n") + len("```mermaid\n")
    end = text.index("\n```", start)
    doc.write_text(text[:start] + mermaid() + text[end:])


if __name__ == "__main__":
    import sys

    if "--write" in sys.argv:
        write_into(ROOT / "docs" / "architecture.md")
    else:
        print(mermaid())
