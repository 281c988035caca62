"""Every python block in README.md and docs/ runs as pasted, or says what it needs.

The rule (CONTRIBUTING.md, "Document"), read from each block's first line:

- ``# fragment: needs ...``: a fragment, shown for its shape. It is compiled, and every
  name it uses without defining must be named on that line.
- ``# continues the script above``: runs after the blocks before it on the page, in the
  same process (a session: one script shown in parts, with prose between).
- ``# NAME.py``: a file that the page's commands use (the command line page).
- anything else: a script, run as pasted in a fresh process. It sets up its own devices
  (``jax.config.update("jax_num_cpu_devices", 8)``, as the pages say); the test adds
  nothing to the process but meshinit on ``PYTHONPATH``.

What a page shows after a block is checked too: a text block right after it that shows
an exception (``Traceback ...`` or ``module.SomeError: ...``) must be what that block
raises, and a plan table (``mesh 0: ...``) must be printed exactly.
"""

from __future__ import annotations

import builtins
import dataclasses
import importlib.util
import json
import os
import pathlib
import re
import subprocess
import symtable
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = ["README.md"] + sorted(
    p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").rglob("*.md")
)

FRAGMENT = re.compile(r"# fragment: needs (?P<needs>.+)")
CONTINUES = re.compile(r"# continues the script above\b.*")
FILE = re.compile(r"# [\w]+\.py")
# a line that names the exception a block raises: "ValueError: ..." or "a.b.PlanError: ..."
RAISED = re.compile(r"^([\w.]+(?:Error|Exception)):", re.M)


@dataclasses.dataclass(frozen=True)
class Block:
    """One python block of a page, with what the page shows right after it."""

    page: str
    index: int  # among the page's python blocks, from 0
    line: int  # of the opening fence, from 1
    code: str
    raises: str | None  # the exception's class name, when the page shows one raised
    tables: tuple[str, ...]  # plan tables shown before the next python block

    @property
    def first(self) -> str:
        return self.code.split("\n", 1)[0].strip()

    @property
    def kind(self) -> str:
        if FRAGMENT.fullmatch(self.first):
            return "fragment"
        if CONTINUES.fullmatch(self.first):
            return "continues"
        if FILE.fullmatch(self.first):
            return "file"
        return "script"

    @property
    def needs(self) -> str:
        """What a fragment says it needs: its first line, and the comment lines after it."""
        lines = self.code.splitlines()
        match = FRAGMENT.fullmatch(lines[0].strip())
        if match is None:
            return ""
        more = []
        for line in lines[1:]:
            if not line.startswith("# "):
                break
            more.append(line[2:])
        return " ".join([match.group("needs"), *more])

    @property
    def name(self) -> str:
        return f"{self.page} block {self.index} (line {self.line})"


def blocks(page: str, text: str | None = None) -> list[Block]:
    """The page's python blocks in order, each with the text blocks that follow it."""
    text = (ROOT / page).read_text() if text is None else text
    fences = list(re.finditer(r"^```(\w*)\n(.*?)^```", text, re.M | re.S))
    out: list[Block] = []
    for i, fence in enumerate(fences):
        if fence.group(1) != "python":
            continue
        shown = []
        for after in fences[i + 1 :]:
            if after.group(1) == "python":
                break
            if after.group(1) == "text":
                shown.append(after.group(2))
        raised = None
        if i + 1 < len(fences) and fences[i + 1].group(1) == "text":
            body = fences[i + 1].group(2)
            names = RAISED.findall(body)
            if names and (body.startswith("Traceback") or RAISED.match(body)):
                raised = names[-1].rsplit(".", 1)[-1]
        tables = tuple(t for t in shown if t.startswith("mesh 0: "))
        line = text.count("\n", 0, fence.start()) + 1
        out.append(Block(page, len(out), line, fence.group(2), raised, tables))
    return out


def scripts(page: str) -> list[list[Block]]:
    """The page's scripts: each a script block and the blocks that continue it."""
    out: list[list[Block]] = []
    for block in blocks(page):
        if block.kind == "script":
            out.append([block])
        elif block.kind == "continues" and out:
            out[-1].append(block)
    return out


def undefined_names(code: str) -> set[str]:
    """Names the code reads but never defines (imports, assignments, defs, builtins)."""
    top = symtable.symtable(code, "<block>", "exec")
    defined = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()}
    defined |= set(dir(builtins)) | {"__file__", "__name__"}
    used: set[str] = set()

    def walk(table: symtable.SymbolTable) -> None:
        for symbol in table.get_symbols():
            if not symbol.is_referenced():
                continue
            if table is top or symbol.is_global():
                used.add(symbol.get_name())
        for child in table.get_children():
            walk(child)

    walk(top)
    return used - defined


def page_problems(page: str) -> list[str]:
    """What breaks the rule on one page, without running anything."""
    problems = []
    seen_script = False
    for block in blocks(page):
        try:
            compile(block.code, block.name, "exec")
        except SyntaxError as e:
            problems.append(f"{block.name}: does not compile: {e}")
            continue
        if block.kind == "script":
            seen_script = True
        elif block.kind == "continues" and not seen_script:
            problems.append(f"{block.name}: continues a script, but no script comes before it")
        elif block.kind == "fragment":
            needs = block.needs
            unnamed = sorted(
                n for n in undefined_names(block.code) if not re.search(rf"\b{n}\b", needs)
            )
            if unnamed:
                problems.append(
                    f"{block.name}: a fragment that uses {', '.join(unnamed)} without naming "
                    f"them in its '# fragment: needs ...' line"
                )
    for script in scripts(page):
        code = "\n".join(b.code for b in script)
        missing = sorted(undefined_names(code))
        if missing:
            problems.append(
                f"{script[0].name}: uses {', '.join(missing)}, which no block of the script "
                f"defines; define them, or start the block with '# fragment: needs "
                f"{', '.join(missing)}'"
            )
    return problems


# ----------------------------------------------------------------------------- fast


@pytest.mark.parametrize("page", PAGES)
def test_every_block_compiles_and_runs_or_names_what_it_needs(page):
    problems = page_problems(page)
    assert not problems, "\n".join(problems)


def test_the_rule_catches_what_the_issue_found():
    """The checker's own anchors: the blocks issue 57 found broken, as they were."""
    flax_unimported = (
        "from flax import nnx\n"
        "with jax.set_mesh(mesh), flax.linen.logical_axis_rules(RULES):\n"
        "    model = 1\n"
    )
    assert undefined_names(flax_unimported) == {"jax", "mesh", "flax", "RULES"}
    stage_names = "h = jax.jit(forward0)(x)\ndef f(p):\n    return loss1(p, y) + len(p)\n"
    assert undefined_names(stage_names) == {"jax", "forward0", "x", "loss1", "y"}
    defined = "import jax\nfrom a import b as c\nx = 1\ndef f():\n    return [c(i) for i in x]\n"
    assert undefined_names(defined) == set()


SAMPLE = """
```python
import jax
f(1)
```

```text
Traceback (most recent call last):
  ...
meshinit._errors.PlanError: 1 problem found while planning:
```

```python
# continues the script above
print(plan)
```

```text
mesh 0: Mesh(x=8)
```

```python
# fragment: needs a plan
plan.summary()
```
"""


def test_a_page_is_read_into_blocks_with_what_it_shows():
    found = blocks("sample.md", SAMPLE)
    assert [(b.kind, b.line, b.raises, b.tables) for b in found] == [
        ("script", 2, "PlanError", ()),
        ("continues", 13, None, ("mesh 0: Mesh(x=8)\n",)),
        ("fragment", 22, None, ()),
    ]
    assert found[2].needs == "a plan"


@pytest.mark.parametrize(
    "first,kind",
    [
        ("# fragment: needs specs", "fragment"),
        ("# continues the script above", "continues"),
        ("# continues the script above: the stages, one jit each", "continues"),
        ("# myspecs.py", "file"),
        ("import jax", "script"),
    ],
)
def test_a_blocks_first_line_gives_its_kind(first, kind):
    assert Block("p.md", 0, 1, first + "\nx = 1\n", None, ()).kind == kind


def test_every_page_with_python_runs_some_of_it():
    """A page cannot turn every block into a fragment: these pages run what they show."""
    runs = {page: len(scripts(page)) for page in PAGES}
    too_few = {page: runs[page] for page, least in RUNNABLE.items() if runs[page] < least}
    assert not too_few, f"pages with fewer scripts than before: {too_few} (want {RUNNABLE})"


# The pages' scripts, at least (a script and its continuations count once).
RUNNABLE = {
    "README.md": 1,
    "docs/getting-started.md": 2,
    "docs/capacity.md": 1,
    "docs/faq.md": 2,
    "docs/migrating.md": 10,
    "docs/train_state.md": 4,
    "docs/nnx.md": 5,
    "docs/linen.md": 5,
    "docs/equinox.md": 2,
    "docs/placements.md": 3,
    "docs/checkpoints.md": 3,
    "docs/pretrained.md": 7,
    "docs/export.md": 1,
}


# ----------------------------------------------------------------------------- running

# Runs the blocks in one namespace, in order, as a pasted script would; a block whose
# page shows an exception must raise exactly that, and the next block goes on.
DRIVER = """
import json, sys, traceback
ns = {"__name__": "__main__"}
for name, code, raises in json.load(open(sys.argv[1])):
    try:
        exec(compile(code, name, "exec"), ns)
    except BaseException as e:
        if raises is None or type(e).__name__ != raises:
            raise
        traceback.print_exc()
        print(f"{name}: raised {raises}, as the page shows", file=sys.stderr)
        continue
    if raises is not None:
        sys.exit(f"{name}: the page shows {raises} raised, but the block ran")
"""

# the ways the test's own process may have been given devices: a page's script sets
# them itself, or it fails as it would for a reader
INJECTED = ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")


def run_script(script: list[Block], tmp_path: pathlib.Path) -> subprocess.CompletedProcess:
    payload = tmp_path / "blocks.json"
    payload.write_text(json.dumps([(b.name, b.code, b.raises) for b in script]))
    env = {k: v for k, v in os.environ.items() if k not in INJECTED}
    return subprocess.run(
        [sys.executable, "-c", DRIVER, str(payload)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={**env, "PYTHONPATH": str(ROOT)},
    )


def check_runs(script: list[Block], tmp_path: pathlib.Path) -> None:
    imports = {
        m.split(".")[0]
        for b in script
        for m in re.findall(r"^(?:from|import) ([\w.]+)", b.code, re.M)
    }
    absent = sorted(m for m in imports if importlib.util.find_spec(m) is None)
    if absent:
        pytest.skip(f"{script[0].name} imports {absent}, not installed here (CI installs them)")
    r = run_script(script, tmp_path)
    code = "\n".join(b.code for b in script)
    assert r.returncode == 0, f"{script[0].name} failed:\n{code}\n{r.stdout}\n{r.stderr}"
    for block in script:
        for table in block.tables:
            assert table in r.stdout, (
                f"{block.name}: the page shows\n{table}\nit printed\n{r.stdout}"
            )


def test_the_readme_first_block_runs_as_pasted(tmp_path):
    """The front door: the README's first python block, on a machine of one CPU device."""
    first = scripts("README.md")[0]
    assert first[0].index == 0, "the README's first python block is a script"
    check_runs(first, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize(
    "page,index", [(page, i) for page in PAGES for i in range(len(scripts(page)))]
)
def test_every_script_runs_as_pasted(page, index, tmp_path):
    check_runs(scripts(page)[index], tmp_path)
