"""The docs site: it builds strictly, every public name is documented, every page is in
the nav, and the command line page's sessions print what it shows. The pages' python
blocks run in ``test_doc_blocks.py``."""

import ast
import dataclasses
import functools
import importlib.util
import inspect
import os
import pathlib
import re
import subprocess
import sys

import pytest

import meshinit
import meshinit.eqx
import meshinit.nnx

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

# Google-style section headers that griffe (mkdocstrings' parser) renders as sections.
# "Example:" (singular) is not one of them: griffe makes it an admonition, and the
# ``>>>`` lines inside turn into block quotes. Write "Examples:".
EXAMPLES = re.compile(r"^\s*Examples:\s*$", re.M)


# ----------------------------------------------------------------------------- build


@pytest.mark.slow  # a subprocess build; the pages, nav and names are checked fast below
def test_mkdocs_build_strict_passes_and_renders_every_public_name(tmp_path):
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("mkdocs is not installed: pip install -e '.[docs]' (CI installs it)")
    site = tmp_path / "site"
    r = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml")]
        + ["-d", str(site)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert r.returncode == 0, f"mkdocs build --strict failed:\n{r.stdout}\n{r.stderr}"
    assert "WARNING" not in r.stderr, r.stderr
    # mkdocstrings gives each rendered object an anchor named by its full path; a name
    # missing here is missing from the API reference.
    html = "".join(p.read_text() for p in (site / "api").rglob("*.html"))
    missing = [name for name in _reference_names() if f'id="{name}"' not in html]
    assert not missing, f"not in the API reference: {missing}"


def _reference_names() -> list[str]:
    names = [f"meshinit.{n}" for n in _top_level_names()]
    names += [f"meshinit.nnx.{n}" for n in meshinit.nnx.__all__]
    names += [f"meshinit.eqx.{n}" for n in meshinit.eqx.__all__]
    names += [f"meshinit.{m}.{n}" for m in ADAPTERS for n in _adapter(m).__all__]
    for cls in CLASSES:
        names += [f"meshinit.{cls.__name__}.{n}" for n in _public_members(cls)]
    return names


# ----------------------------------------------------------------------------- names


def _top_level_names() -> list[str]:
    """The names ``meshinit/__init__.py`` re-exports, without a leading underscore."""
    tree = ast.parse((ROOT / "meshinit" / "__init__.py").read_text())
    names = []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            names += [a.asname or a.name for a in node.names]
    return [n for n in names if not n.startswith("_")]


CLASSES = (meshinit.Plan, meshinit.PlanEntry, meshinit.MeshGroup, meshinit.ParamSpec)


def _public_members(cls: type) -> list[str]:
    """Public methods and properties defined by ``cls`` itself (not dataclass fields)."""
    kinds = (property, functools.cached_property)
    return [
        name
        for name, value in vars(cls).items()
        if not name.startswith("_") and (isinstance(value, kinds) or inspect.isfunction(value))
    ]


# the public modules documented from their __all__ besides nnx and eqx (imported lazily;
# meshinit.tunix imports tunix only inside its functions)
ADAPTERS = ("optax", "linen", "safetensors", "maxtext", "tunix")


def _adapter(name: str):
    return getattr(meshinit, name)  # lazily imported adapter modules


def _documented_objects() -> list[tuple[str, object]]:
    objects = [(f"meshinit.{n}", getattr(meshinit, n)) for n in _top_level_names()]
    objects += [(f"meshinit.nnx.{n}", getattr(meshinit.nnx, n)) for n in meshinit.nnx.__all__]
    objects += [(f"meshinit.eqx.{n}", getattr(meshinit.eqx, n)) for n in meshinit.eqx.__all__]
    for m in ADAPTERS:
        objects += [(f"meshinit.{m}.{n}", getattr(_adapter(m), n)) for n in _adapter(m).__all__]
    for cls in CLASSES:
        objects += [(f"meshinit.{cls.__name__}.{n}", vars(cls)[n]) for n in _public_members(cls)]
    return objects


def test_the_public_surface_is_what_the_docs_cover():
    """Guards the lists below: a new public name shows up here and in the API pages."""
    assert "plan" in _top_level_names() and "materialize" in _top_level_names()
    assert sorted(meshinit.nnx.__all__) == ["abstract", "init", "materialize", "optimizer", "plan"]
    assert sorted(meshinit.eqx.__all__) == ["init", "materialize", "plan"]
    assert sorted(meshinit.optax.__all__) == ["abstract", "init"]
    assert sorted(meshinit.linen.__all__) == ["init", "plan"]
    assert meshinit.maxtext.__all__ == ["names", "rules"]
    assert sorted(meshinit.safetensors.__all__) == [
        "Checkpoint",
        "Concat",
        "Export",
        "Fill",
        "FrameworkMap",
        "Inventory",
        "Pad",
        "Stack",
        "Tensor",
        "inventory",
        "load",
        "save",
    ]
    assert meshinit.tunix.__all__ == ["names"]
    assert "bytes_per_device" in _public_members(meshinit.Plan)
    assert "shard_dims" in _public_members(meshinit.PlanEntry)
    assert "replicated_bytes" in _public_members(meshinit.MeshGroup)
    assert "nbytes" in _public_members(meshinit.ParamSpec)
    assert not any(n.startswith("_") for n in _top_level_names())


# ----------------------------------------------------------------------------- docstrings


def _section(doc: str, header: str) -> str | None:
    """The indented body under ``header:`` in a Google-style docstring, or None."""
    m = re.search(rf"^([ \t]*){header}:[ \t]*\n((?:\1[ \t]+\S.*\n|[ \t]*\n)*)", doc + "\n", re.M)
    return m.group(2) if m else None


def _parameters(fn) -> list[inspect.Parameter]:
    sig = inspect.signature(fn)
    return [p for name, p in sig.parameters.items() if name not in ("self", "cls")]


def _returns_something(fn) -> bool:
    annotation = inspect.signature(fn).return_annotation
    if annotation is inspect.Signature.empty:
        return False
    # A generator-based context manager (``with meshinit.defaults(...):``) yields None.
    return str(annotation) not in ("None", "Iterator[None]", "<class 'NoneType'>")


def _own_doc(obj) -> str:
    """``obj``'s own docstring: not inherited, and not a dataclass's generated one."""
    if isinstance(obj, property):
        obj = obj.fget
    elif isinstance(obj, functools.cached_property):
        obj = obj.func
    doc = obj.__dict__.get("__doc__") if isinstance(obj, type) else obj.__doc__
    if doc and isinstance(obj, type) and doc.startswith(f"{obj.__name__}("):
        return ""  # dataclasses write "Name(field: type, ...)" when there is no docstring
    return inspect.cleandoc(doc or "")


def _constant_has_docstring(name: str) -> bool:
    """Whether ``name = ...`` in meshinit's source is followed by a string literal."""
    for source in (ROOT / "meshinit").rglob("*.py"):
        body = ast.parse(source.read_text()).body
        for node, after in zip(body, body[1:], strict=False):
            targets = node.targets if isinstance(node, ast.Assign) else []
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
    return False


def _lists(section: str, name: str) -> bool:
    """Whether a Google-style section lists ``name`` as ``name:`` or ``name (type):``."""
    return re.search(rf"^[ \t]+{re.escape(name)}( \(.*\))?:", section, re.M) is not None


def _args_problems(qualname: str, doc: str, fn) -> list[str]:
    args = _section(doc, "Args")
    params = _parameters(fn)
    if params and args is None:
        return [f"{qualname}: has parameters but no Args: section"]
    stars = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
    return [
        f"{qualname}: parameter {p.name!r} not under Args:"
        for p in params
        if not _lists(args, stars.get(p.kind, "") + p.name)
    ]


def _problems(qualname: str, obj) -> list[str]:
    if not (callable(obj) or isinstance(obj, property | functools.cached_property)):
        ok = _constant_has_docstring(qualname.rsplit(".", 1)[1])
        return [] if ok else [f"{qualname}: no docstring after its assignment"]
    doc = _own_doc(obj)
    if not doc:
        return [f"{qualname}: no docstring"]
    if isinstance(obj, property | functools.cached_property):
        return []  # a property reads like an attribute: its docstring says what it is
    problems = []
    if dataclasses.is_dataclass(obj):
        # Fields go under Attributes:, not Args: (the dataclass writes __init__).
        attributes = _section(doc, "Attributes") or ""
        for field in dataclasses.fields(obj):
            if not _lists(attributes, field.name):
                problems.append(f"{qualname}: field {field.name!r} not under Attributes:")
    elif isinstance(obj, type):
        if "__init__" in vars(obj):  # its own __init__: documented in the class docstring
            problems += _args_problems(qualname, doc, obj.__init__)
    else:
        problems += _args_problems(qualname, doc, obj)
        if _returns_something(obj) and _section(doc, "Returns") is None:
            problems.append(f"{qualname}: returns a value but has no Returns: section")
    if not EXAMPLES.search(doc):
        problems.append(f"{qualname}: no Examples: section")
    elif ">>>" not in doc.split("Examples:", 1)[1]:
        problems.append(f"{qualname}: its Examples: section has no >>> line")
    return problems


def test_every_public_name_has_a_google_style_docstring_with_an_example():
    """Functions: Args (each parameter), Returns (when they return), Examples.
    Classes: Attributes (each dataclass field), Examples. Properties: a docstring.
    Constants: a docstring string after the assignment."""
    problems = [p for name, obj in _documented_objects() for p in _problems(name, obj)]
    assert not problems, "docstrings to fix:\n" + "\n".join(problems)


def test_the_docstring_checker_catches_what_it_should():
    def undocumented(x):
        return x

    def documented(x: int) -> int:
        """Adds one.

        Args:
          x: a number.

        Returns:
          ``x + 1``.

        Examples:
          >>> documented(1)
          2
        """
        return x + 1

    def no_example(x: int) -> int:
        """Adds one.

        Args:
          x: a number.

        Returns:
          ``x + 1``.

        Example:
          >>> no_example(1)
        """
        return x + 1

    def missing_arg(x: int, *, y: int = 0) -> None:
        """Does nothing.

        Args:
          x: a number.

        Examples:
          >>> missing_arg(1)
        """

    assert _problems("undocumented", undocumented) == ["undocumented: no docstring"]
    assert _problems("documented", documented) == []
    assert _problems("no_example", no_example) == ["no_example: no Examples: section"]
    assert _problems("missing_arg", missing_arg) == ["missing_arg: parameter 'y' not under Args:"]

    @dataclasses.dataclass
    class Point:
        x: int

    @dataclasses.dataclass
    class HalfDocumented:
        """A point.

        Attributes:
          x: across.

        Examples:
          >>> HalfDocumented(1, 2)
        """

        x: int
        y: int

    class Error(ValueError):
        """An error.

        Examples:
          >>> raise Error("bad")
        """

        def __init__(self, message: str):
            super().__init__(message)

    assert _problems("Point", Point) == ["Point: no docstring"]
    assert _problems("HalfDocumented", HalfDocumented) == [
        "HalfDocumented: field 'y' not under Attributes:"
    ]
    assert _problems("Error", Error) == ["Error: has parameters but no Args: section"]


# ----------------------------------------------------------------------------- nav


def _nav_pages() -> list[str]:
    """The .md paths listed under ``nav:`` in mkdocs.yml, in order."""
    text = (ROOT / "mkdocs.yml").read_text()
    nav = re.search(r"^nav:\n((?:[ \t]+.*\n|\n)*)", text, re.M)
    assert nav, "mkdocs.yml has no nav"
    return re.findall(r":\s*([\w./-]+\.md)\s*$", nav.group(1), re.M)


def test_every_nav_page_exists_and_every_page_is_in_the_nav():
    nav = _nav_pages()
    assert nav[0] == "index.md", "the home page comes first"
    assert len(nav) == len(set(nav)), f"pages listed twice: {nav}"
    missing = [p for p in nav if not (DOCS / p).is_file()]
    assert not missing, f"in the nav but not in docs/: {missing}"
    pages = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    orphans = [p for p in pages if p not in nav]
    assert not orphans, f"in docs/ but not in the nav: {orphans}"


# ----------------------------------------------------------------------------- pages


def test_the_readme_requirements_name_every_extra():
    """Each extra of pyproject.toml is named in the README's requirements, with what it
    brings (issue 42: ``safetensors`` was missing, though the loader needs it)."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Requirements", 1)[1].split("\n## ", 1)[0]
    missing = [name for name in extras if f"`{name}`" not in section]
    assert not missing, f"README's requirements do not name the extras {missing}"
    assert "pip install -e '.[safetensors]'" in section


USER_PAGES = sorted(
    p.relative_to(ROOT).as_posix() for p in DOCS.rglob("*.md") if p.parent.name != "api"
)


@pytest.mark.parametrize("page", USER_PAGES)
def test_every_page_says_what_it_is_for_in_its_first_lines(page):
    """Under its title, before any heading, list or block, a page says in prose who
    reads it and what it answers."""
    text = (ROOT / page).read_text()
    title, _, rest = text.partition("\n")
    assert title.startswith("# "), f"{page}: the first line is not a title: {title!r}"
    first = rest.strip().split("\n\n", 1)[0]
    assert not re.match(r"```|[#|>]|- |\d+\. ", first) and len(first.split()) >= 15, (
        f"{page}: the first lines under the title should say, in a sentence or two, who "
        f"reads the page and what it answers; they are {first[:200]!r}"
    )


def _pyproject() -> dict:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


# the pages a user installs from; the changelog keeps history as it was, and docs/api/
# shows the modules' docstrings, whose messages name an extra as the package's
# (`pip install 'meshinit[nnx]'`), whatever the install
INSTALL_PAGES = ["README.md", "CONTRIBUTING.md"] + sorted(
    p.relative_to(ROOT).as_posix()
    for p in DOCS.rglob("*.md")
    if p.name != "changelog.md" and p.parent.name != "api"
)
# a shell word: quoted, or up to the next space or backtick
WORD = re.compile(r"'[^']*'|\"[^\"]*\"|[^\s`'\"]+")


def install_problems(page: str, text: str, extras: set[str]) -> list[str]:
    """What a page's ``pip install`` lines get wrong against pyproject.toml and the README:
    meshinit comes from the clone (``pip install -e '.[nnx]'``), an argument with extras is
    quoted (zsh reads brackets as a pattern), and each extra exists."""
    problems = []
    for match in re.finditer(r"pip3? install\b([^`\n]*)", text):
        line = text.count("\n", 0, match.start()) + 1
        start = text.rfind("\n", 0, match.start()) + 1
        if (
            text[start : match.start()].count("`") % 2
            and text[match.end() : match.end() + 1] == "\n"
        ):
            problems.append(
                f"{page}:{line}: the install command breaks across lines; keep it on one"
            )
        for word in WORD.findall(match.group(1)):
            if word in ("&&", "|", ";") or word.startswith("#"):
                break
            if word.startswith("-"):
                continue
            bare = word.strip("'\"")
            name, _, rest = bare.partition("[")
            if rest and bare == word:
                problems.append(f"{page}:{line}: {word} is unquoted; write '{word}'")
            if name.lower() == "meshinit":
                problems.append(
                    f"{page}:{line}: {word} installs meshinit from a registry; the README "
                    f"installs it from a clone: pip install -e '.[{rest.rstrip(']')}]'"
                )
            if name in (".", "meshinit") and rest:
                unknown = sorted(set(rest.rstrip("]").split(",")) - extras)
                if unknown:
                    problems.append(
                        f"{page}:{line}: {word} names extras {unknown} that pyproject.toml "
                        f"lacks; it has {sorted(extras)}"
                    )
    return problems


def runtime_problems(page: str, text: str, dependencies: list[str]) -> list[str]:
    """The page's "Runtime: ..." sentence names pyproject's dependencies, no more, no less,
    with pyproject's bounds."""
    found = re.search(r"Runtime: (.*?)\.(?:\s|$)", text, re.S)
    if found is None:
        return [f"{page}: no 'Runtime: ...' sentence naming the runtime dependencies"]
    quoted = re.findall(r"`([^`]+)`", found.group(1))
    names = {q for q in quoted if re.fullmatch(r"[A-Za-z][\w.-]*", q)}
    bounds = [q for q in quoted if q not in names]
    wanted = {re.split(r"[<>=!~;\[ ]", d, maxsplit=1)[0] for d in dependencies}
    problems = []
    if names != wanted:
        problems.append(
            f"{page}: the runtime named is {sorted(names)}; pyproject's is {sorted(wanted)}"
        )
    for bound in bounds:
        if not any(bound in d for d in dependencies):
            problems.append(f"{page}: the bound {bound} is in none of pyproject's {dependencies}")
    return problems


def test_install_lines_agree_with_pyproject_and_the_readme():
    project = _pyproject()
    extras = set(project["optional-dependencies"])
    problems = []
    for page in INSTALL_PAGES:
        problems += install_problems(page, (ROOT / page).read_text(), extras)
    for page in ("README.md", "docs/getting-started.md"):
        problems += runtime_problems(page, (ROOT / page).read_text(), project["dependencies"])
    assert not problems, "\n".join(problems)


def test_the_install_checker_catches_what_the_issue_found():
    extras = {"nnx", "safetensors"}
    found = install_problems(
        "p.md",
        "flax with `pip install meshinit[nnx]`.\n"
        "```bash\npip install -e '.[nnx,torch]' && pytest\n```\n"
        "and `pip install -e '.[nnx]' 'moto[server]'`, `pip install -e .`\n"
        "the extra (`pip install -e\n'.[nnx]'`)\n",
        extras,
    )
    assert found == [
        "p.md:1: meshinit[nnx] is unquoted; write 'meshinit[nnx]'",
        "p.md:1: meshinit[nnx] installs meshinit from a registry; the README installs it "
        "from a clone: pip install -e '.[nnx]'",
        "p.md:3: '.[nnx,torch]' names extras ['torch'] that pyproject.toml lacks; it has "
        "['nnx', 'safetensors']",
        "p.md:6: the install command breaks across lines; keep it on one",
    ]
    deps = ["jax>=0.10.2,<0.13", "numpy>=1.26", "tqdm>=4.60"]
    assert runtime_problems("p.md", "Runtime: `jax` (`>=0.10.2,<0.13`) and `numpy`.", deps) == [
        "p.md: the runtime named is ['jax', 'numpy']; pyproject's is ['jax', 'numpy', 'tqdm']"
    ]
    assert runtime_problems("p.md", "Runtime: `jax` (`>=0.9`), `numpy` and `tqdm`.\n", deps) == [
        f"p.md: the bound >=0.9 is in none of pyproject's {deps}"
    ]


def _cli_sessions() -> tuple[dict[str, str], list[tuple[str, str]]]:
    """The command line page's files (python blocks headed ``# NAME.py``) and its
    sessions (text blocks starting with ``$ meshinit ...``, then the output shown)."""
    text = (DOCS / "api" / "cli.md").read_text()
    blocks = re.findall(r"^```(\w*)\n(.*?)^```", text, re.M | re.S)
    files = {}
    for lang, code in blocks:
        first = code.splitlines()[0]
        if lang == "python" and re.fullmatch(r"# [\w]+\.py", first):
            files[first[2:]] = code
    sessions = []
    for lang, code in blocks:
        if lang == "text" and code.startswith("$ meshinit "):
            command, _, output = code.partition("\n")
            sessions.append((command[2:], output))
    return files, sessions


def test_the_command_line_page_has_sessions():
    files, sessions = _cli_sessions()
    assert "myspecs.py" in files and len(sessions) >= 2


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(_cli_sessions()[1])))
def test_command_line_sessions_print_what_the_page_shows(index, tmp_path):
    files, sessions = _cli_sessions()
    for name, code in files.items():
        (tmp_path / name).write_text(code)
    command, shown = sessions[index]
    r = subprocess.run(
        [sys.executable, "-m", *command.split()],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    printed = r.stdout + r.stderr
    assert printed.strip() == shown.strip(), f"$ {command}\nprinted:\n{printed}\nshown:\n{shown}"


def test_no_public_signature_names_a_private_name():
    # The API pages render signatures as written: `_plan.Plan` or `_MeshAxes` there
    # would point readers at internals.
    bad = []
    for name, obj in _documented_objects():
        fn = obj.fget if isinstance(obj, property) else obj
        if not callable(fn) or isinstance(fn, type):
            continue
        try:
            signature = str(inspect.signature(fn))
        except (TypeError, ValueError):
            continue
        if re.search(r"(?<![\w.])_[A-Za-z]|\._[A-Za-z]", signature):
            bad.append(f"{name}{signature}")
    assert not bad, "\n".join(bad)
