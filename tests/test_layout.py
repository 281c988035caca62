"""The package's layout (issue 18): imports form no circle and take no private names."""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "meshinit"
MODULES = {p.stem: p for p in PACKAGE.glob("*.py")}


def _imports(path: pathlib.Path) -> list[tuple[str, str]]:
    """``(module, name)`` for every import of a sibling, lazy ones included and
    ``if TYPE_CHECKING:`` blocks excluded (they never run)."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(sub)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for sub in ast.walk(node)
    }
    found = []
    for node in ast.walk(tree):
        if id(node) in typing_only or not isinstance(node, ast.ImportFrom) or node.level != 1:
            continue
        if node.module:
            found += [(node.module.split(".")[0], a.name) for a in node.names]
        else:
            found += [(a.name, "") for a in node.names]
    return [(m, n) for m, n in found if m in MODULES]


def test_imports_between_modules_form_no_circle():
    edges = {m: {t for t, _ in _imports(p) if t != m} for m, p in MODULES.items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(edges[m]):
            if state.get(t) == 1:
                cycles.append([*stack[stack.index(t) :], t])
            elif t not in state:
                visit(t, stack)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m, [])
    assert cycles == []


def test_no_module_imports_another_module_s_private_names():
    private = [
        f"{m}: from .{t} import {n}"
        for m, p in MODULES.items()
        for t, n in _imports(p)
        if n.startswith("_")
    ]
    assert private == []


def test_every_module_stays_under_500_lines():
    long = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > 500}
    assert long == {}
