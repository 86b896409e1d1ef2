"""The package's dependency graph, read from the source: no import cycle among module-level
imports inside services/ddtree, and the engine and the models import no service package (the
verify service's composition root, ddtree.verify.peers, wires the remote peers)."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "services" / "ddtree"
SERVICES = ("ddtree.drafter", "ddtree.treebuild", "ddtree.verify", "ddtree.http", "ddtree.up", "ddtree.cli",
            "ddtree.demo", "ddtree.rpc.server")


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path, *, top_only: bool) -> set[str]:
    """The package modules `name` imports: at module level (top_only; TYPE_CHECKING blocks left
    out), or anywhere in the file. `from pkg import sub` counts as importing pkg.sub alone."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    if top_only:
        nodes = []
        for node in tree.body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            nodes += node.body + node.orelse if isinstance(node, (ast.If, ast.Try)) else [node]
    else:
        nodes = list(ast.walk(tree))
    out = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            subs = {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES}
            out.update(subs or {base})
            if len(subs) < len(node.names):
                out.add(base)
    return {m for m in out if m in MODULES and m != name}


def test_no_import_cycle_among_module_level_imports():
    graph = {name: _imports(name, path, top_only=True) for name, path in MODULES.items()}
    state, path, cycles = {}, [], []

    def visit(node):
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, cycles


def _within(module: str, packages) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_the_engine_and_the_models_import_no_service_package():
    inner = [m for m in MODULES if _within(m, ("ddtree.engine", "ddtree.models", "ddtree.tree"))]
    offending = {m: sorted(i for i in _imports(m, MODULES[m], top_only=False) if _within(i, SERVICES))
                 for m in inner}
    assert not {m: i for m, i in offending.items() if i}
