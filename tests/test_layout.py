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
ALLOWED_LATE = {("train.py", "cli")}


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


# ---------------------------------------------------------------------------------------------
# Budgets (issue 30): small modules, short functions, short module docstrings, so that each
# file keeps one concern and reads in one sitting. Measured from the source with `ast`.

MODULE_LINES = 600  # a library module: every .py at the root and in packages
LONG_MODULE_LINES = 700  # the named design-dense exceptions below, at most two
FUNCTION_LINES = 60  # a function or method, from its def line to its last (docstring included)
DOCSTRING_LINES = 20  # a module docstring's text
TOOL_DIRS = ("scripts", "benchmarks")  # function and docstring budgets, not the module one
LONG_MODULES = {
    "train.py": "the story of a run on one screen per part: main and the Trainer (fit, "
    "train_step, resume, evaluate, save, stop)",
}
# Known offences, each with its reason (empty: every budget holds). Keys: a module's path, a
# function's `path::qualified.name`, a module docstring's `path::__doc__`. An entry that is
# within budget again fails the tests below too, so the list can only shrink.
OVER_BUDGET: dict[str, str] = {}


def library_files() -> list[Path]:
    """Every .py at the root and in packages, not tests/ or the tools' folders."""
    files = set(project_modules().values())
    return sorted(p for p in files if p.relative_to(REPO).parts[0] not in TOOL_DIRS)


def budgeted_files() -> list[Path]:
    """The library and the tools (scripts/, benchmarks/): what the function and docstring
    budgets cover."""
    tools = {p for folder in TOOL_DIRS for p in (REPO / folder).rglob("*.py")}
    return sorted(set(library_files()) | tools)


def rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def function_lengths(tree: ast.Module) -> dict[str, int]:
    """Lines of every function and method, nested ones too, by qualified name."""
    lengths: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    lengths[name] = child.end_lineno - child.lineno + 1
                visit(child, f"{name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return lengths


def module_offences() -> dict[str, str]:
    """Library modules over their line budget: path -> what."""
    found = {}
    for path in library_files():
        limit = LONG_MODULE_LINES if rel(path) in LONG_MODULES else MODULE_LINES
        if (n := len(path.read_text().splitlines())) > limit:
            found[rel(path)] = f"{n} lines, budget {limit}"
    return found


def function_offences() -> dict[str, str]:
    """Functions and methods over FUNCTION_LINES: `path::name` -> what."""
    found = {}
    for path in budgeted_files():
        tree = ast.parse(path.read_text(), filename=str(path))
        for name, n in function_lengths(tree).items():
            if n > FUNCTION_LINES:
                found[f"{rel(path)}::{name}"] = f"{n} lines, budget {FUNCTION_LINES}"
    return found


def docstring_offences() -> dict[str, str]:
    """Module docstrings over DOCSTRING_LINES: `path::__doc__` -> what."""
    found = {}
    for path in budgeted_files():
        doc = ast.get_docstring(ast.parse(path.read_text(), filename=str(path))) or ""
        if (n := len(doc.splitlines())) > DOCSTRING_LINES:
            found[f"{rel(path)}::__doc__"] = (
                f"{n} lines, budget {DOCSTRING_LINES}: move the design notes to docs/, link them"
            )
    return found


def kind(key: str) -> str:
    if key.endswith("::__doc__"):
        return "docstring"
    return "function" if "::" in key else "module"


def budget_problems(found: dict[str, str], of_kind: str) -> list[str]:
    """Offences not listed in OVER_BUDGET, and OVER_BUDGET entries of this kind that are
    within budget now."""
    listed = {key for key in OVER_BUDGET if kind(key) == of_kind}
    return [f"{key}: {found[key]}" for key in sorted(found.keys() - listed)] + [
        f"{key}: within budget now, remove it from OVER_BUDGET"
        for key in sorted(listed - found.keys())
    ]


def test_no_library_module_is_over_600_lines() -> None:
    """At most two named design-dense modules may take up to 700; a named one must need it."""
    problems = budget_problems(module_offences(), "module")
    assert len(LONG_MODULES) <= 2, f"at most two long modules, not {sorted(LONG_MODULES)}"
    for name in sorted(LONG_MODULES):
        path = REPO / name
        if not path.is_file() or len(path.read_text().splitlines()) <= MODULE_LINES:
            problems.append(f"{name}: within {MODULE_LINES} lines now, remove it from LONG_MODULES")
    assert not problems, "modules over budget (issue 30):\n" + "\n".join(problems)


def test_no_function_is_over_60_lines() -> None:
    problems = budget_problems(function_offences(), "function")
    assert not problems, "functions over budget (issue 30):\n" + "\n".join(problems)


def test_no_module_docstring_is_over_20_lines() -> None:
    problems = budget_problems(docstring_offences(), "docstring")
    assert not problems, "module docstrings over budget (issue 30):\n" + "\n".join(problems)


def test_the_budget_checks_can_fail(tmp_path: Path, monkeypatch) -> None:
    """Each budget check finds what is over it, spares what is at it, and reports a listed
    exception that is no longer needed."""

    def write(name: str, text: str) -> None:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)

    def function(name: str, num_lines: int, indent: str = "") -> str:
        return f"{indent}def {name}() -> None:\n" + f"{indent}    x = 1\n" * (num_lines - 1)

    def docstring(num_lines: int) -> str:
        return '"""' + "\n".join(f"line {i}" for i in range(num_lines)) + '\n"""\n'

    this = __import__(__name__)
    monkeypatch.setattr(this, "REPO", tmp_path)
    monkeypatch.setattr(this, "LONG_MODULES", {"pkg/dense.py": "design", "fine.py": "no need"})
    listed = {"pkg/within.py": "pending", "fine.py": "pending", "fine.py::short": "pending"}
    monkeypatch.setattr(this, "OVER_BUDGET", listed)
    write("big.py", "x = 1\n" * 601)
    write("fine.py", docstring(20) + function("short", 60) + "x = 1\n" * 400)
    write("pkg/__init__.py", "")
    write("pkg/dense.py", "x = 1\n" * 701)
    write("pkg/within.py", "x = 1\n" * 700)  # not a named long module: over, but listed
    write("scripts/tool.py", "class K:\n" + function("method", 61, "    ") + "x = 1\n" * 700)
    write(
        "benchmarks/run.py",
        docstring(21) + "def outer() -> None:\n" + function("inner", 61, "    "),
    )
    write("tests/test_x.py", docstring(30) + function("test_long", 100) + "x = 1\n" * 700)
    assert module_offences() == {
        "big.py": "601 lines, budget 600",
        "pkg/dense.py": "701 lines, budget 700",
        "pkg/within.py": "700 lines, budget 600",
    }
    assert function_offences() == {
        "benchmarks/run.py::outer": "62 lines, budget 60",
        "benchmarks/run.py::outer.inner": "61 lines, budget 60",
        "scripts/tool.py::K.method": "61 lines, budget 60",
    }
    assert list(docstring_offences()) == ["benchmarks/run.py::__doc__"]
    for check, expected in (
        (
            test_no_library_module_is_over_600_lines,
            [
                "big.py: 601",
                "pkg/dense.py: 701",
                "fine.py: within budget now",
                "fine.py: within 600",
            ],
        ),
        (
            test_no_function_is_over_60_lines,
            ["scripts/tool.py::K.method: 61", "fine.py::short: within budget now"],
        ),
        (test_no_module_docstring_is_over_20_lines, ["benchmarks/run.py::__doc__: 21 lines"]),
    ):
        try:
            check()
        except AssertionError as err:
            assert all(text in str(err) for text in expected), (expected, str(err))
            assert "pkg/within.py" not in str(err)
        else:
            raise AssertionError(f"{check.__name__} passed over budget")
    monkeypatch.setattr(this, "LONG_MODULES", dict.fromkeys("abc", "design"))
    try:
        test_no_library_module_is_over_600_lines()
    except AssertionError as err:
        assert "at most two long modules" in str(err)
    else:
        raise AssertionError("three long modules were allowed")


def test_every_package_is_in_the_container_build_context() -> None:
    """.dockerignore is an allow-list (everything is left out, then each path let in): a new
    package missing from it builds an image whose train.py fails on its import (the container
    tests saw 'No module named' for optim/, objective/ and modes/ when they were added)."""
    allowed = {
        line[1:].strip("/")
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.startswith("!")
    }
    packages = {path.parent.name for path in REPO.glob("*/__init__.py")}
    packages -= {"tests"}
    assert packages - allowed == set(), "add them to .dockerignore as !name/"
