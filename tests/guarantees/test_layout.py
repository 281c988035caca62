"""The package's layout: stages whose imports form a graph that never runs back up and no
circle of files, no private names taken from another module, modules under 500 lines, the
engine reached only through its entry point, a test tree that mirrors the package, and
CI's split of the stack-neutral slow tests between its two stacks."""

import ast
import functools
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "meshinit"
TESTS = ROOT / "tests"


def _name(path: pathlib.Path) -> str:
    """``meshinit._engine.run`` for ``meshinit/_engine/run.py``; a package's own name
    for its ``__init__.py``."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(path: pathlib.Path, typing_too: bool = False) -> list[tuple[str, str]]:
    """``(module, name)`` for every import of a meshinit module, lazy ones included and
    ``if TYPE_CHECKING:`` blocks excluded (they never run) unless ``typing_too``.
    ``from . import x`` of a module is ``(that module, "")``."""
    return list(_imports_of(path, typing_too))


@functools.cache
def _imports_of(path: pathlib.Path, typing_too: bool) -> tuple[tuple[str, str], ...]:
    # Parsed once a run: ten tests of this module read every module's imports (the
    # read-flow check four times, once per planted arrow), and the files do not change
    # while the tests run.
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
        if (id(node) in typing_only and not typing_too) or not isinstance(node, ast.ImportFrom):
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
    return tuple(found)


def test_every_import_is_resolved():
    # the resolver above must see every import between meshinit's modules
    assert ("meshinit._engine.entry", "") in _imports(MODULES["meshinit._adapters.prepared"])
    assert ("meshinit._engine.run", "make_arrays") in _imports(MODULES["meshinit._engine.entry"])


def test_imports_between_modules_form_no_circle():
    # typing-only imports count: two files that name each other's types are one thing
    edges = {m: {t for t, _ in _imports(p, True) if t != m} for m, p in MODULES.items()}
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


# The stages of docs/dev/architecture.md as a graph: each stage, the modules it holds
# ("pkg.*" is every module of a stage package, its __init__ included, so a module added
# to a stage is in it by itself) and the stages it may import. The loader and the engine
# sit side by side: both build on the run stage, neither imports the other.
STAGES = {
    "shared": (("_errors", "_format", "_typos", "_caches", "_patterns"), ()),
    "base": (("_jax.*",), ("shared",)),
    "declare": (("_paths", "_spec.*"), ("shared", "base")),
    "report": (("_report.*",), ("shared",)),
    "plan": (("_plan.*",), ("shared", "base", "declare", "report")),
    "run": (("_run.*",), ("shared", "base", "declare", "plan")),
    "engine": (("_engine.*",), ("shared", "base", "declare", "plan", "run")),
    "load": (("_checkpoint.*",), ("shared", "base", "declare", "plan", "run")),
    "adapt": (
        ("optax", "safetensors", "maxtext", "tunix", "_adapters.*", "nnx", "linen", "eqx"),
        ("shared", "base", "declare", "plan", "run", "engine", "load"),
    ),
    "command line": (
        ("", "_cli.*", "__main__"),
        ("shared", "base", "declare", "report", "plan", "run", "engine", "load", "adapt"),
    ),
}


def _stage(module: str) -> str | None:
    short = module.removeprefix("meshinit").removeprefix(".")
    for stage, (names, _) in STAGES.items():
        for name in names:
            package = name.removesuffix(".*")
            if short == name or (name.endswith(".*") and short.split(".")[0] == package):
                return stage
    return None


def test_the_stages_form_a_graph_without_a_circle():
    order: list[str] = []
    for _ in STAGES:  # a stage is placed once every stage it imports is
        order += [
            s for s, (_, below) in STAGES.items() if s not in order and set(below) <= set(order)
        ]
    assert sorted(order) == sorted(STAGES), f"stages in a circle: {set(STAGES) - set(order)}"


def test_every_module_is_in_a_stage_and_imports_only_the_stages_below_it():
    # typing-only imports count too: a stage that names another's types depends on it
    assert [m for m in MODULES if _stage(m) is None] == []
    upward = [
        f"{m} ({_stage(m)}) imports {t} ({_stage(t)})"
        for m, p in MODULES.items()
        for t, _ in _imports(p, typing_too=True)
        if _stage(t) != _stage(m) and _stage(t) not in STAGES[_stage(m)][1]
    ]
    assert upward == []


# ------------------------------------------------------------- the tests mirror the tree

# Modules without a test file of their name, each with its reason. Every package's
# __init__.py is a map that only imports, and is exempt as such.
UNTESTED_BY_NAME = {
    "meshinit/__main__.py": "one line that runs the command line: tests/_cli/test_cli.py "
    "runs `python -m meshinit`",
    "meshinit/maxtext.py": "needs MaxText (Python 3.12): tests/clients/test_maxtext_names.py "
    "runs it against MaxText itself, in CI's MaxText venv",
    "meshinit/tunix.py": "needs google-tunix (Python 3.12): tests/clients/test_tunix_names.py "
    "runs it against tunix itself, in CI's tunix venv",
}

# Test files at the top of a stage's directory that test no module of that name.
NOT_A_MODULE_TEST = {
    "tests/test_storage_servers.py": "tests the suite's own storage servers "
    "(tests/storage_servers.py), which the remote-loading tests stand on",
}


def _test_file(module: pathlib.Path) -> str:
    """``tests/_checkpoint/store/test_fetch.py`` for ``meshinit/_checkpoint/store/fetch.py``;
    ``tests/test_caches.py`` for ``meshinit/_caches.py``."""
    rel = module.relative_to(PACKAGE)
    return (pathlib.Path("tests", *rel.parts[:-1]) / f"test_{rel.stem.lstrip('_')}.py").as_posix()


def test_every_module_has_a_test_file_of_its_name_with_tests_in_it():
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if path.name == "__init__.py" or rel in UNTESTED_BY_NAME:
            continue
        test = ROOT / _test_file(path)
        if not test.is_file() or not re.search(r"^(async )?def test_", test.read_text(), re.M):
            missing.append(f"{rel}: no tests in {_test_file(path)}")
    assert missing == []
    for rel in UNTESTED_BY_NAME:  # an exemption outlives no module
        assert (ROOT / rel).is_file(), f"{rel} is exempt but no longer exists"


def test_every_module_test_file_mirrors_a_module():
    # outside guarantees/, clients/ and fuzz/, a test file is named for the module it tests
    mirrors = {_test_file(p) for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"}
    by_name = {"guarantees", "clients", "fuzz"}
    stray = sorted(
        rel
        for p in TESTS.rglob("test_*.py")
        if (rel := p.relative_to(ROOT).as_posix()) not in mirrors
        and p.relative_to(TESTS).parts[0] not in by_name
        and rel not in NOT_A_MODULE_TEST
    )
    assert stray == []
    for directory in {p.parent for p in TESTS.rglob("test_*.py")} - {TESTS}:
        assert (directory / "__init__.py").is_file(), f"{directory} is no package"


def test_the_shared_test_helpers_are_defined_once():
    # tests/helpers.py defines what tests share; no test module defines one of its names
    # again (a name means one thing across the suite)
    shared = {
        n.name if not isinstance(n, ast.Assign) else n.targets[0].id
        for n in ast.parse((TESTS / "helpers.py").read_text()).body
        if isinstance(n, ast.FunctionDef | ast.ClassDef)
        or (isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name))
    }
    again = sorted(
        f"{p.relative_to(ROOT)}: {name}"
        for p in TESTS.rglob("*.py")
        if p.name != "helpers.py"
        for n in ast.parse(p.read_text()).body
        for name in (
            [n.name]
            if isinstance(n, ast.FunctionDef | ast.ClassDef)
            else [t.id for t in getattr(n, "targets", []) if isinstance(t, ast.Name)]
        )
        if name in shared
    )
    assert again == []


def test_every_test_file_the_docs_name_exists_with_the_tests_named():
    texts = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / ".ci" / "run"]
    texts += [*(ROOT / "docs").rglob("*.md"), *(ROOT / "benchmarks").glob("*.py")]
    texts += [*(ROOT / "examples").rglob("*.py"), *TESTS.rglob("*.py")]
    texts = [t for t in texts if t != pathlib.Path(__file__)]  # its examples are patterns
    wrong = []
    for text in texts:
        for path, name in re.findall(r"(tests/[\w/]+\.py)(?:::(\w+))?", text.read_text()):
            where = ROOT / path
            if not where.is_file():
                wrong.append(f"{text.relative_to(ROOT)}: {path} does not exist")
            elif name and not re.search(rf"^(async )?def {name}\b", where.read_text(), re.M):
                wrong.append(f"{text.relative_to(ROOT)}: {path} has no {name}")
    assert not wrong, "\n".join(wrong)


def test_the_architecture_page_names_every_module_and_only_modules_that_exist():
    page = (PACKAGE.parent / "docs" / "dev" / "architecture.md").read_text()
    table = page.split("## The modules", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(meshinit/[\w/]+\.py)` \|", table, re.M)
    assert sorted({r for r in rows if rows.count(r) > 1}) == [], "modules named twice"
    named = set(rows)
    files = {p.relative_to(PACKAGE.parent).as_posix() for p in PACKAGE.rglob("*.py")}
    assert sorted(named - files) == [], "named on the page, but no such module"
    assert sorted(files - named) == [], "modules the page does not name"
    stages = page.split("## Stages and imports", 1)[1].split("\n## ", 1)[0]
    for stage, (names, below) in STAGES.items():  # the page's stage table is this one
        row = re.search(rf"^\| {stage} \| (.*?) \| (.*?) \|$", stages, re.M)
        assert row, f"stage {stage} is not on the page"
        shown = {s.replace("`", "").split(" ")[0] for s in row.group(1).split(", ")}
        assert shown == {name or "meshinit" for name in names}, (stage, shown)
        imports = {s.strip() for s in row.group(2).split(", ")} - {"jax", "numpy"}
        assert imports == set(below), (stage, imports, below)


# ---- the checkpoint stage: folders
# meshinit/_checkpoint is cut by concern (issue 65), each folder importing only the
# folders before it: where bytes live, how a path maps to stored tensors, how bytes
# encode values, framework names, then the load flow. The framework maps never reach
# the store: they see a checkpoint through its config and its tensors' headers.
CHECKPOINT_FOLDERS = ("store", "layout", "encodings", "maps", "read", "write")
CHECKPOINT_NEVER = {("maps", "store"), ("write", "read")}


def _checkpoint_folder(module: str) -> str | None:
    parts = module.split(".")
    if parts[:2] != ["meshinit", "_checkpoint"] or len(parts) < 3:
        return None
    return parts[2] if parts[2] in CHECKPOINT_FOLDERS else None


def checkpoint_arrows(imports: dict[str, list[str]]) -> list[str]:
    """Each import (module -> the modules it imports) that runs back up the checkpoint
    stage's folders, or that the stage rules out."""
    wrong = []
    for module, targets in imports.items():
        mine = _checkpoint_folder(module)
        for target in targets:
            theirs = _checkpoint_folder(target)
            if mine is None or theirs is None or theirs == mine:
                continue
            up = CHECKPOINT_FOLDERS.index(theirs) > CHECKPOINT_FOLDERS.index(mine)
            if up or (mine, theirs) in CHECKPOINT_NEVER:
                wrong.append(f"{module} ({mine}) imports {target} ({theirs})")
    return wrong


def test_the_checkpoint_stage_s_folders_import_only_the_folders_before_them():
    assert {p.name for p in (PACKAGE / "_checkpoint").iterdir() if p.is_dir()} - {
        "__pycache__"
    } == set(CHECKPOINT_FOLDERS)
    imports = {m: [t for t, _ in _imports(p, typing_too=True)] for m, p in MODULES.items()}
    assert checkpoint_arrows(imports) == []


@pytest.mark.parametrize(
    ("module", "target"),
    [
        ("meshinit._checkpoint.store.fetch", "meshinit._checkpoint.layout.blocks"),  # as it was
        ("meshinit._checkpoint.encodings.fp8.decode", "meshinit._checkpoint.read.loop"),  # was
        ("meshinit._checkpoint.maps.unused", "meshinit._checkpoint.store.source"),  # was
        ("meshinit._checkpoint.read.load", "meshinit._checkpoint.write.files"),
        ("meshinit._checkpoint.write.save", "meshinit._checkpoint.read.staging"),  # a sibling
    ],
)
def test_a_planted_arrow_back_up_the_checkpoint_stage_is_found(module, target):
    assert checkpoint_arrows({module: [target]}) == [
        f"{module} ({module.split('.')[2]}) imports {target} ({target.split('.')[2]})"
    ]


# ---- the checkpoint stage: the read flow


def _read_flow_violations(imports: dict[str, list[str]]) -> list[str]:
    """``module imports target`` for each import that runs against the read flow: a module
    of meshinit._checkpoint outside read/ importing read/ (nothing below the flow
    imports it; the adapters above the stage may), and read/'s finish step (ahead)
    importing its reshard step (the loop hands one to the next)."""
    flow = "meshinit._checkpoint.read"
    return sorted(
        f"{m} imports {t}"
        for m, targets in imports.items()
        for t in targets
        if (t.startswith(f"{flow}.") or t == flow)
        and (
            (m.startswith("meshinit._checkpoint") and not m.startswith(f"{flow}.") and m != flow)
            or (m == f"{flow}.ahead" and t == f"{flow}.reshard")
        )
    )


@pytest.mark.parametrize(
    "planted",
    [
        None,
        ("meshinit._checkpoint.layout.host", "meshinit._checkpoint.read.staging"),
        ("meshinit._checkpoint.encodings.fp8.decode", "meshinit._checkpoint.read.loop"),
        ("meshinit._checkpoint.read.ahead", "meshinit._checkpoint.read.reshard"),
    ],
)
def test_nothing_below_the_read_flow_imports_it_and_it_hands_forward(planted):
    # typing-only imports count: a type named from the flow is a dependency on it
    imports = {m: [t for t, _ in _imports(p, typing_too=True)] for m, p in MODULES.items()}
    # the adapters above the stage import the flow: no violation
    assert "meshinit._checkpoint.read.load" in imports["meshinit.safetensors"]
    if planted is None:
        assert _read_flow_violations(imports) == []
    else:  # the same check, over the package's imports with one violation planted
        imports[planted[0]] = [*imports[planted[0]], planted[1]]
        assert _read_flow_violations(imports) == [f"{planted[0]} imports {planted[1]}"]


# ---- the checkpoint stage: encodings

# Each encoding is a sibling: a module of encodings/<a>/ (or encodings/<a>.py) imports no
# module of another encoding <b>. What they share is not an encoding: base (the protocol
# and the shared machinery), registry (which names them all, for the flow), config (the
# quantization_config reader) and the folder's __init__.
ENCODINGS = "meshinit._checkpoint.encodings"
ENCODINGS_SHARED = {"base", "registry", "config"}


def _encoding(module: str) -> str | None:
    """``fp8`` for ``meshinit._checkpoint.encodings.fp8.decode``, ``keys`` for
    ``...encodings.keys``; None for a shared module or one outside the folder."""
    if not module.startswith(ENCODINGS + "."):
        return None
    first = module.removeprefix(ENCODINGS + ".").split(".")[0]
    return None if first in ENCODINGS_SHARED else first


def _encodings_crossed(edges: list[tuple[str, str]]) -> list[str]:
    """Each import (module, imported) from one encoding's module into another's."""
    return sorted(
        f"{m} ({a}) imports {t} ({b})"
        for m, t in edges
        if (a := _encoding(m)) and (b := _encoding(t)) and a != b
    )


def _edges() -> list[tuple[str, str]]:
    # typing-only imports count: an encoding that names another's types leans on it
    return [(m, t) for m, p in MODULES.items() for t, _ in _imports(p, typing_too=True)]


def test_no_encoding_imports_another_encoding():
    edges = _edges()
    assert {_encoding(m) for m in MODULES} >= {"fp8", "mxfp4", "keys"}  # the check sees them
    assert _encodings_crossed(edges) == []
    # planted: what mxfp4 did before base held what it shares. The same check over the
    # real imports plus that one names it; the registry importing fp8 stays allowed.
    planted = (
        "meshinit._checkpoint.encodings.mxfp4.pairing",
        "meshinit._checkpoint.encodings.fp8.pairing",
    )
    assert ("meshinit._checkpoint.encodings.registry", planted[1]) in edges
    assert _encodings_crossed([*edges, planted]) == [
        "meshinit._checkpoint.encodings.mxfp4.pairing (mxfp4) imports "
        "meshinit._checkpoint.encodings.fp8.pairing (fp8)"
    ]


class _Item:
    """What the tiers' hook reads of a collected test: its node id and its slow mark."""

    def __init__(self, nodeid: str, slow: bool):
        self.nodeid, self.slow = nodeid, slow

    def get_closest_marker(self, name: str):
        return object() if name == "slow" and self.slow else None


def test_cis_slow_parts_run_each_stack_neutral_slow_test_on_exactly_one_stack(monkeypatch):
    import types

    import conftest
    from helpers import STACK_NEUTRAL

    neutral = sorted(STACK_NEUTRAL)
    items = [
        _Item(f"{m}::test_{i}[{c}]", slow)
        for m in neutral
        for i in range(9)
        for c in "ab"
        for slow in (True, False)
    ]
    items += [_Item(f"tests/test_nnx.py::test_{i}", True) for i in range(9)]  # both stacks
    kept = []
    for k in (1, 2):
        gone: list = []
        config = types.SimpleNamespace(
            option=types.SimpleNamespace(markexpr="", file_or_dir=["tests"]),
            hook=types.SimpleNamespace(
                pytest_deselected=lambda items, gone=gone: gone.extend(items)
            ),
        )
        monkeypatch.setattr(conftest, "TIER", "all")
        monkeypatch.setattr(conftest, "SLOW_PART", (k, 2))
        part = list(items)
        conftest.pytest_collection_modifyitems(config, part)
        assert gone and all(i.slow and i.nodeid.split("::")[0] in STACK_NEUTRAL for i in gone)
        assert {id(i) for i in gone} | {id(i) for i in part} == {id(i) for i in items}
        kept.append({id(i) for i in part})
    split = {id(i) for i in items if i.slow and i.nodeid.split("::")[0] in STACK_NEUTRAL}
    assert kept[0] & kept[1] == {id(i) for i in items} - split  # the rest on both stacks
    assert kept[0] | kept[1] == {id(i) for i in items}  # and each split test on one
    # MESHINIT_SLOW_PART unset (a developer's MESHINIT_TESTS=all): nothing is split
    monkeypatch.setattr(conftest, "SLOW_PART", (1, 1))
    part = list(items)
    conftest.pytest_collection_modifyitems(config, part)
    assert len(part) == len(items)
