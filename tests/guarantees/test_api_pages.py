"""The API pages (docs/api/*.md) hold each public name's signature and docstring as
plain Markdown, written by docs/_ext/api_pages.py from the installed package: a
reader on GitHub sees them without a docs build, and they never go stale."""

import importlib.util
import inspect
import pathlib
import re

import meshinit
import meshinit.eqx
import meshinit.nnx

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("api_pages", ROOT / "docs" / "_ext" / "api_pages.py")
assert _spec is not None and _spec.loader is not None
api_pages = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(api_pages)

MODULES = {  # page -> the module whose __all__ it documents
    "nnx.md": "nnx",
    "eqx.md": "eqx",
    "linen.md": "linen",
    "optax.md": "optax",
    "safetensors.md": "safetensors",
    "maxtext.md": "maxtext",
    "tunix.md": "tunix",
}


def test_the_api_pages_are_what_the_script_writes_from_the_docstrings():
    stale = [p.name for p, (now, new) in api_pages.written().items() if now != new]
    assert not stale, f"docs/api/{stale} are stale: run python docs/_ext/api_pages.py"
    # ruff would reformat the docstrings' examples there: it leaves exactly these alone
    import tomllib

    ruff = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]["format"]
    written = [p.relative_to(ROOT).as_posix() for p, (now, _) in api_pages.written().items()]
    written = [p for p in written if "<!-- mkdocstrings" in (ROOT / p).read_text()]
    assert sorted(ruff["exclude"]) == sorted(written), "pyproject.toml [tool.ruff.format]"


def _headings(page: str) -> list[str]:
    return re.findall(r"^#+ `([\w.]+)`$", (ROOT / "docs" / "api" / page).read_text(), re.M)


def test_every_public_name_has_its_heading_and_exact_signature_on_its_page():
    for page, module_name in MODULES.items():
        module = getattr(meshinit, module_name)
        headings = _headings(page)
        text = (ROOT / "docs" / "api" / page).read_text()
        for name in module.__all__:
            path = f"meshinit.{module_name}.{name}"
            assert path in headings, f"docs/api/{page} has no heading for {path}"
            obj = getattr(module, name)
            if inspect.isfunction(obj):
                sig = inspect.signature(obj)
                bare = sig.replace(
                    parameters=[
                        p.replace(annotation=inspect.Parameter.empty)
                        for p in sig.parameters.values()
                    ],
                    return_annotation=inspect.Signature.empty,
                )
                # a class default by its import path (wrt=flax.nnx.variablelib.Param)
                shown = re.sub(r"<class '([\w.]+)'>", r"\1", str(bare))
                assert f"`{path}{shown}`" in text, f"docs/api/{page}: {path}{shown}"
    top = _headings("index.md")
    missing = [
        n for n in ("plan", "materialize", "Plan", "PlanError") if f"meshinit.{n}" not in top
    ]
    assert not missing, f"docs/api/index.md has no heading for {missing}"
    # the contract's names, as a reader pastes them
    assert (
        "`meshinit.safetensors.save(arrays, dest, *, names=None, dtype=None, quantize=None, "
        "modules_to_not_convert=None, max_shard_size=None, config=None, storage_options=None, "
        "max_inflight_bytes=None, overwrite=False, progress=False)`"
    ) in (ROOT / "docs" / "api" / "safetensors.md").read_text()
    assert "`meshinit.Plan.to_json(indent=2)`" in (ROOT / "docs" / "api" / "index.md").read_text()


def test_the_site_gets_the_directives_back_and_the_script_writes_the_same_from_them():
    """mkdocs' hook hands mkdocstrings each page as it was before the script ran (bare
    ``:::`` directives, no written copy); writing from that gives the page again."""
    pages = {p.name: p.read_text() for p in sorted((ROOT / "docs" / "api").glob("*.md"))}
    names = api_pages._names(pages)
    for name, text in pages.items():
        site = api_pages.on_page_markdown(text)
        assert "<!-- mkdocstrings" not in site and "<!-- end of" not in site, name
        assert len(re.findall(r"^::: meshinit", site, re.M)) == text.count("\n::: meshinit"), name
        assert not re.search(r"^#+ `meshinit\.", site, re.M), f"{name}: a written heading is left"
        assert api_pages.page(site, names) == text, name
    assert "api_pages.py" in (ROOT / "mkdocs.yml").read_text().split("hooks:", 1)[1][:80]


def documented(x, *, rules=None, sep="/"):
    """Resolves ``x``, as :func:`meshinit.plan` does.

    Args:
      x: a number,
        over two lines.
      rules (tuple): the rules.
      sep: a separator.

    Returns:
      ``x``, resolved.

    Raises:
      PlanError: all at once.
      TypeError, ValueError: at once.

    Atomic: a paragraph after a section ends it.

    Examples:
      >>> documented(1)
      1
    """
    return x


def test_a_google_style_docstring_becomes_lists_and_a_console_block():
    names = {"meshinit.plan": "index.md#meshinitplan"}
    lines = api_pages._object("mod.documented", documented, 2, names)
    assert "\n".join(lines).strip() == "\n".join(
        [
            "## `mod.documented`",
            "",
            "`mod.documented(x, *, rules=None, sep='/')`",
            "",
            "Resolves ``x``, as [`meshinit.plan`](index.md#meshinitplan) does.",
            "",
            "**Args:**",
            "",
            "- `x`: a number,",
            "  over two lines.",
            "- `rules` (tuple): the rules.",
            "- `sep`: a separator.",
            "",
            "**Returns:**",
            "",
            "- ``x``, resolved.",
            "",
            "**Raises:**",
            "",
            "- `PlanError`: all at once.",
            "- `TypeError`, `ValueError`: at once.",
            "",
            "Atomic: a paragraph after a section ends it.",
            "",
            "**Examples:**",
            "",
            "```pycon",
            ">>> documented(1)",
            "1",
            "```",
        ]
    )


def test_a_class_default_is_shown_by_its_import_path_and_self_is_left_out():
    class Holder:
        def method(self, wrt=dict, n=1):
            """Does nothing."""

    assert api_pages._signature(Holder.method) == "(wrt=builtins.dict, n=1)"
    assert api_pages._signature(type("Bare", (), {})) is None  # takes nothing of its own
