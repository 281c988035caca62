"""Every python block in README.md and docs/ runs as pasted, or says what it needs.

The rule (CONTRIBUTING.md, "Document"), read from each block's first line:

- ``# fragment: needs ...``: a fragment, shown for its shape. It is compiled, and every
  name it uses without defining must be named on that line.
- ``# continues the script above``: runs after the blocks before it on the page, in the
  same process (a session: one script shown in parts, with prose between).
- ``# NAME.py``: a file that the page's commands use (the command line page).
- anything else: a script, run as pasted in a fresh process. It sets up its own devices
  (``jax.config.update("jax_num_cpu_devices", 8)``, as the pages say); the test adds
  nothing to the process but meshinit on ``PYTHONPATH``. The README's first script runs
  in a new python process; the others in processes forked from one that has imported
  the packages the pages use and nothing more (:data:`PRELOAD`), which saves the imports'
  time and changes nothing a script can see.

Every fence is read, at any indent: a block inside a list item is dedented first. All of
it runs in the default tier.

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

# a fenced block at any indent (one inside a list item is indented with it); it closes at
# the same indent
FENCE = re.compile(
    r"^(?P<indent>[ \t]*)```(?P<lang>\w*)[ \t]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$",
    re.M | re.S,
)
FENCE_LINE = re.compile(r"^[ \t]*```")
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
    fences = [(f.group("lang"), dedent(f), f) for f in FENCE.finditer(text)]
    out: list[Block] = []
    for i, (lang, code, fence) in enumerate(fences):
        if lang != "python":
            continue
        shown = []
        for after_lang, after, _ in fences[i + 1 :]:
            if after_lang == "python":
                break
            if after_lang == "text":
                shown.append(after)
        raised = None
        # what the block raises is shown right after it, at its own indent (a text block
        # indented in a list below it illustrates the prose around it)
        if (
            i + 1 < len(fences)
            and fences[i + 1][0] == "text"
            and fences[i + 1][2].group("indent") == fence.group("indent")
        ):
            body = fences[i + 1][1]
            names = RAISED.findall(body)
            if names and (body.startswith("Traceback") or RAISED.match(body)):
                raised = names[-1].rsplit(".", 1)[-1]
        tables = tuple(t for t in shown if t.startswith("mesh 0: "))
        line = text.count("\n", 0, fence.start()) + 1
        out.append(Block(page, len(out), line, code, raised, tables))
    return out


def dedent(fence: re.Match) -> str:
    """A fence's body without the fence's own indent (a block inside a list item)."""
    indent = fence.group("indent")
    lines = fence.group("body").splitlines(keepends=True)
    return "".join(line[len(indent) :] if line.startswith(indent) else line for line in lines)


def fence_lines(text: str) -> list[int]:
    """The lines (from 1) of every fence that the page opens or closes, at any indent."""
    return [i for i, line in enumerate(text.splitlines(), 1) if FENCE_LINE.match(line)]


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


INDENTED = """
- a list item, with its example:

    ```python
    # fragment: needs plan
    print(plan)
    ```

- another, with what it prints:

  ```text
  mesh 0: Mesh(x=8)
  ```
"""


def test_a_fence_indented_in_a_list_is_read_dedented():
    (found,) = blocks("sample.md", INDENTED)
    assert (found.kind, found.line, found.code, found.tables) == (
        "fragment",
        4,
        "# fragment: needs plan\nprint(plan)\n",
        ("mesh 0: Mesh(x=8)\n",),
    )


@pytest.mark.parametrize("page", PAGES)
def test_every_fence_on_the_page_is_read(page):
    """No fence escapes the checks: each one the page opens or closes, at any indent,
    belongs to a block that blocks() reads."""
    text = (ROOT / page).read_text()
    read = set()
    for fence in FENCE.finditer(text):
        first = text.count("\n", 0, fence.start()) + 1
        read |= {first, first + fence.group("body").count("\n") + 1}
    unread = [line for line in fence_lines(text) if line not in read]
    assert not unread, f"{page}: fences on lines {unread} are not read as blocks"


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
    "docs/pretrained.md": 2,
    "docs/names.md": 4,
    "docs/remote.md": 1,
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


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in INJECTED}
    return {**env, "PYTHONPATH": str(ROOT)}


def run_script(script: list[Block], tmp_path: pathlib.Path) -> subprocess.CompletedProcess:
    """The script in a new python process, as a reader runs it."""
    payload = tmp_path / "blocks.json"
    payload.write_text(json.dumps([(b.name, b.code, b.raises) for b in script]))
    return subprocess.run(
        [sys.executable, "-c", DRIVER, str(payload)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env=clean_env(),
    )


# What the pages import, in the order a script would. Importing them takes most of a
# short script's time (5-13 s a process here), so the scripts run in processes forked
# from one that has imported these and done nothing else: no backend started (each
# script sets its own devices, or fails as it would for a reader), no config changed, no
# thread running, and each script gets a namespace of its own, so a name it does not
# import is still a NameError. tunix is left out: importing it changes flax's config.
PRELOAD = (
    "numpy",
    "jax",
    "jax.numpy",
    "optax",
    "flax.nnx",
    "flax.linen",
    "equinox",
    "safetensors.numpy",
    "meshinit",
    "meshinit.nnx",
    "meshinit.linen",
    "meshinit.eqx",
    "meshinit.optax",
    "meshinit.safetensors",
)

# The parent: imports PRELOAD, reads every request (an id, the payload, the folder to
# run in, the files for stdout and stderr) up to an empty line, then runs them in that
# order, each in a child of its own, at most WORKERS at a time, and answers each with its
# id and exit status as it ends.
FORKER = """
import atexit, collections, importlib, json, os, signal, sys, threading, traceback
for name in sys.argv[3:]:
    try:
        importlib.import_module(name)
    except ImportError:
        pass
if threading.active_count() != 1:
    sys.exit(f"cannot fork safely: threads {threading.enumerate()} run after the imports")
driver, workers = compile(sys.argv[1], "<driver>", "exec"), int(sys.argv[2])
queue = collections.deque()
for line in sys.stdin:
    if not line.strip():
        break
    queue.append(json.loads(line))
running = {}
while queue or running:
    while queue and len(running) < workers:
        id, payload, cwd, out, err = queue.popleft()
        pid = os.fork()
        if pid:
            running[pid] = id
            continue
        code = 1
        try:
            os.chdir(cwd)
            write = os.O_WRONLY | os.O_CREAT
            for fd, path, mode in ((0, os.devnull, os.O_RDONLY), (1, out, write), (2, err, write)):
                os.dup2(os.open(path, mode), fd)
            sys.stdin = open(0, closefd=False)
            sys.argv = ["-c", payload]
            signal.alarm(600)
            try:
                exec(driver, {"__name__": "__main__"})
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
                if not isinstance(e.code, int) and e.code is not None:
                    print(e.code, file=sys.stderr)
            except BaseException:
                traceback.print_exc()
            atexit._run_exitfuncs()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    pid, status = os.wait()
    print(running.pop(pid), os.waitstatus_to_exitcode(status), flush=True)
"""

# Two at a time: a script's compiles and jax's start are mostly one thread, and CI and
# the README's test command run on 2 cores.
WORKERS = 2


class Forker:
    """The scripts of this test session, started at once in the forked processes, at
    most WORKERS at a time; ``result`` waits for one."""

    def __init__(self, folder: pathlib.Path, runs: list[tuple[str, list[Block]]]):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", FORKER, DRIVER, str(WORKERS), *PRELOAD],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=folder,
            env=clean_env(),
        )
        self.folders: dict[str, pathlib.Path] = {}
        for id, script in runs:
            self.folders[id] = where = folder / f"run{len(self.folders)}"
            where.mkdir()
            payload, out, err = (where / n for n in ("blocks.json", "stdout", "stderr"))
            payload.write_text(json.dumps([(b.name, b.code, b.raises) for b in script]))
            request = [id, str(payload), str(where), str(out), str(err)]
            self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        self.done: dict[str, int] = {}

    def result(self, id: str) -> subprocess.CompletedProcess:
        while id not in self.done:
            line = self.proc.stdout.readline()
            assert line, "the forking process died (its imports failed?)"
            ended, status = line.rsplit(" ", 1)
            self.done[ended] = int(status)
        where = self.folders[id]
        out, err = ((where / n).read_text() for n in ("stdout", "stderr"))
        return subprocess.CompletedProcess(id, self.done[id], out, err)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def _script_id(page: str, index: int) -> str:
    return f"{page}-{index}"


@pytest.fixture(scope="module")
def forker(request, tmp_path_factory):
    """Starts every script that this session selected (``-k`` included), in test order."""
    runs = []
    for item in request.session.items:
        params = getattr(item, "callspec", None)
        if item.originalname == "test_every_script_runs_as_pasted" and params is not None:
            page, index = params.params["page"], params.params["index"]
            if not absent_imports(scripts(page)[index]):  # else the test skips
                runs.append((_script_id(page, index), scripts(page)[index]))
    forker = Forker(tmp_path_factory.mktemp("forker"), runs)
    yield forker
    forker.close()


def absent_imports(script: list[Block]) -> list[str]:
    imports = {
        m.split(".")[0]
        for b in script
        for m in re.findall(r"^(?:from|import) ([\w.]+)", b.code, re.M)
    }
    return sorted(m for m in imports if importlib.util.find_spec(m) is None)


def check_runs(script: list[Block], tmp_path: pathlib.Path, run=run_script) -> None:
    absent = absent_imports(script)
    if absent:
        pytest.skip(f"{script[0].name} imports {absent}, not installed here (CI installs them)")
    r = run(script, tmp_path)
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


# the README's first script runs above, in a process of its own
@pytest.mark.parametrize(
    "page,index",
    [
        (page, i)
        for page in PAGES
        for i in range(len(scripts(page)))
        if (page, i) != ("README.md", 0)
    ],
)
def test_every_script_runs_as_pasted(page, index, tmp_path, forker):
    check_runs(
        scripts(page)[index], tmp_path, run=lambda *_: forker.result(_script_id(page, index))
    )
