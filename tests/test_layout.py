"""The project's modules import each other in one direction: no cycle, and no project module
imported inside a function or a TYPE_CHECKING block (a lazy import is how a cycle hides).
The graph is read from the source with `ast`, so a test fails on the commit that adds an edge.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Imports deliberately made late, each for a reason that is not a cycle: train.py parses the
# command line before torch loads (a bad flag fails in a fraction of a second). The scripts
# (scripts/ray_train.py among them) are entry points, not modules: none is read here.
ALLOWED_LATE = {("train.py", "config"), ("train.py", "exitcodes")}


def project_modules() -> dict[str, Path]:
    modules = {p.stem: p for p in REPO.glob("*.py")}
    for init in REPO.glob("*/__init__.py"):
        package = init.parent
        if package.name in ("tests", "scripts"):
            continue
        modules[package.name] = init
        for p in package.glob("*.py"):
            if p.name != "__init__.py":
                modules[f"{package.name}.{p.stem}"] = p
    return modules


def imported(node: ast.AST, modules: dict[str, Path]) -> list[str]:
    """Project modules named by one import statement (`from ckpt import storage` names
    ckpt.storage; `from config import X` names config)."""
    names: list[str] = []
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return [n for n in names if n in modules]


def top_level_nodes(tree: ast.Module) -> list[ast.AST]:
    """Statements that run at import: the module body, into plain if/try blocks (not
    `if TYPE_CHECKING` and not `if __name__ == "__main__"`), never into a def or class body."""
    out: list[ast.AST] = []
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        out.append(node)
        if isinstance(node, ast.If):
            test = ast.unparse(node.test)
            if "TYPE_CHECKING" in test or "__name__" in test:
                continue
            stack.extend(node.body + node.orelse)
        elif isinstance(node, ast.Try):
            stack.extend(node.body + node.orelse + node.finalbody)
            for handler in node.handlers:
                stack.extend(handler.body)
    return out


def graph() -> tuple[dict[str, set[str]], list[str]]:
    modules = project_modules()
    edges: dict[str, set[str]] = {name: set() for name in modules}
    late: list[str] = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        eager = {id(n) for n in top_level_nodes(tree)}
        for node in ast.walk(tree):
            targets = [t for t in imported(node, modules) if t != name]
            if not targets:
                continue
            if id(node) in eager:
                edges[name].update(targets)
            else:
                rel = str(path.relative_to(REPO))
                late += [
                    f"{rel}:{node.lineno} imports {t}"
                    for t in targets
                    if (rel, t) not in ALLOWED_LATE
                ]
    return edges, late


def test_no_project_module_is_imported_late() -> None:
    _, late = graph()
    assert not late, "imports inside a function or a TYPE_CHECKING block:\n" + "\n".join(late)


def test_the_import_graph_has_no_cycle() -> None:
    edges, _ = graph()
    state: dict[str, int] = {}  # 1 = on the path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = 2
        path.pop()
        return None

    for start in sorted(edges):
        if start not in state and (cycle := visit(start)):
            raise AssertionError("import cycle: " + " -> ".join(cycle))


def test_the_checker_sees_a_cycle_and_a_late_import(tmp_path: Path, monkeypatch) -> None:
    """The checks above can fail: a two-module cycle and a function-level import are found."""
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def f():\n    import a\n")
    monkeypatch.setattr(__import__(__name__), "REPO", tmp_path)
    edges, late = graph()
    assert edges == {"a": {"b"}, "b": set()}
    assert late == ["b.py:2 imports a"]
    (tmp_path / "b.py").write_text("import a\n")
    try:
        test_the_import_graph_has_no_cycle()
    except AssertionError as err:
        assert "a -> b -> a" in str(err)
    else:
        raise AssertionError("the cycle a -> b -> a was not found")
