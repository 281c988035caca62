"""The package's layout (issues 18, 27, 40): stage packages whose imports form no circle,
take no private names from another module, stay under 500 lines, and reach the
constructor engine only through its entry point."""

import ast
import pathlib
import re

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "meshinit"


def _name(path: pathlib.Path) -> str:
    """``meshinit._engine.run`` for ``meshinit/_engine/run.py``; a package's own name
    for its ``__init__.py``."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(path: pathlib.Path) -> list[tuple[str, str]]:
    """``(module, name)`` for every import of a meshinit module, lazy ones included and
    ``if TYPE_CHECKING:`` blocks excluded (they never run). ``from . import x`` of a
    module is ``(that module, "")``."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(sub)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for sub in ast.walk(node)
    }
    me = _name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if id(node) in typing_only or not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = package.split(".")
            base = base[: len(base) - (node.level - 1)]
            where = ".".join(base + ([node.module] if node.module else []))
        elif node.module and node.module.split(".")[0] == "meshinit":
            where = node.module
        else:
            continue
        for a in node.names:
            if f"{where}.{a.name}" in MODULES:
                found.append((f"{where}.{a.name}", ""))
            elif where in MODULES:
                found.append((where, a.name))
    return found


def test_every_import_is_resolved():
    # the resolver above must see every import between meshinit's modules
    assert ("meshinit._engine.entry", "") in _imports(MODULES["meshinit.nnx"])
    assert ("meshinit._engine.run", "make_arrays") in _imports(MODULES["meshinit._engine.entry"])


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
        f"{m}: from {t} import {n}"
        for m, p in MODULES.items()
        for t, n in _imports(p)
        if n.startswith("_")
    ]
    assert private == []


def test_every_module_stays_under_500_lines():
    long = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > 500}
    assert long == {}


def test_the_engine_is_reached_only_through_its_entry_point():
    # Outside meshinit._engine, a module may import the entry point only; never the
    # engine's trace, cut, host evaluation or run. What the spec path shares with the
    # engine (threefry, jax's internals, the flat program) is the base layer, _jax.
    found = sorted(
        f"{m} imports {t}"
        for m, p in MODULES.items()
        if not m.startswith("meshinit._engine")
        for t, _ in _imports(p)
        if t.startswith("meshinit._engine") and t != "meshinit._engine.entry"
    )
    assert found == []


def test_the_engine_package_imports_nothing_itself():
    # the engine's __init__ is its map: importing the entry point loads only what it needs
    assert _imports(MODULES["meshinit._engine"]) == []


# The import layers of docs/dev/architecture.md, one per stage: a module imports from
# its own layer or a lower one. "pkg.*" is every module of a stage package, its
# __init__ included, so a module added to a stage has that stage's layer by itself.
LAYERS = (
    ("_errors", "_format", "_caches", "_patterns"),
    ("_jax.*",),
    ("_paths", "_spec.*"),
    ("_report.*",),
    ("_plan.*",),
    ("_run.*",),
    ("_engine.*",),
    ("_load.*",),
    ("optax", "safetensors", "maxtext", "tunix", "_adapters.*", "nnx", "linen", "eqx"),
    ("", "_cli.*", "__main__"),
)


def _layer(module: str) -> int | None:
    short = module.removeprefix("meshinit").removeprefix(".")
    for n, names in enumerate(LAYERS):
        for name in names:
            stage = name.removesuffix(".*")
            if short == name or (name.endswith(".*") and short.split(".")[0] == stage):
                return n
    return None


def test_every_module_has_a_layer_and_imports_only_its_own_or_lower_ones():
    assert [m for m in MODULES if _layer(m) is None] == []
    upward = [
        f"{m} (layer {_layer(m)}) imports {t} (layer {_layer(t)})"
        for m, p in MODULES.items()
        for t, _ in _imports(p)
        if _layer(t) > _layer(m)
    ]
    assert upward == []


def test_the_architecture_page_names_every_module_and_only_modules_that_exist():
    page = (PACKAGE.parent / "docs" / "dev" / "architecture.md").read_text()
    table = page.split("## The modules", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(meshinit/[\w/]+\.py)` \|", table, re.M)
    assert sorted({r for r in rows if rows.count(r) > 1}) == [], "modules named twice"
    named = set(rows)
    files = {p.relative_to(PACKAGE.parent).as_posix() for p in PACKAGE.rglob("*.py")}
    assert sorted(named - files) == [], "named on the page, but no such module"
    assert sorted(files - named) == [], "modules the page does not name"
    layers = page.split("## Import layers", 1)[1].split("\n## ", 1)[0]
    for n, names in enumerate(LAYERS):  # the page's layer table is this one
        row = re.search(rf"^\| {n} \| (.*?) \|", layers, re.M)
        assert row, f"layer {n} is not on the page"
        shown = {s.strip("`").replace("`", "") for s in row.group(1).split(", ")}
        want = {name or "meshinit" for name in names}
        assert {s.split(" ")[0] for s in shown} == want, (n, shown, want)
