"""The API pages (docs/api/*.md) as plain Markdown, readable where no docs build runs.

Each ``::: meshinit.name`` directive of a page (mkdocstrings' syntax, which GitHub
shows as an empty page) is kept for the site inside an HTML comment, and followed by
what it documents, written from the installed package: each public name's exact
signature (``inspect.signature``, annotations left out) and its docstring, Google-style
``Args:``, ``Returns:``, ``Raises:`` and ``Attributes:`` as lists, ``Examples:`` as
console blocks. The prose around the directives is the page's own and is kept.

Run ``python docs/_ext/api_pages.py`` after changing a public docstring or signature;
``--check`` lists the stale pages instead (tests/guarantees/test_docs.py runs it). The
site is unchanged: mkdocs.yml loads this file as a hook, which gives mkdocstrings the
directives back and drops the written copy (:func:`on_page_markdown`).
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import pathlib
import re
import sys
import textwrap
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[2]
API = ROOT / "docs" / "api"
SCRIPT = "python docs/_ext/api_pages.py"

# A directive as a page holds it: bare (as first written), or in its comment with the
# written copy after it.
_DIRECTIVE = re.compile(r"^::: (?P<target>[\w.]+)\n(?P<options>(?:    .*\n)*)", re.M)
_BLOCK = re.compile(
    r"^<!-- mkdocstrings \(the site's\); below it, what `[^`]*` writes\n"
    r"(?P<directive>::: (?P<target>[\w.]+)\n(?:    .*\n)*)-->\n"
    r"(?P<written>.*?)^<!-- end of (?P=target) -->\n",
    re.M | re.S,
)
_MEMBERS = re.compile(r"^\s+members: \[(?P<names>[^\]]*)\]\s*$", re.M)
_ROLE = re.compile(r":(?:class|func|meth|attr|data|mod|exc|obj):`(~?)([\w.]+)`")
_SECTION = re.compile(r"^(Args|Returns|Yields|Raises|Attributes|Examples|Notes?|Warnings?):\s*$")
_LISTED = ("Args", "Raises", "Attributes")  # each item "name: what" becomes a list item


# ----------------------------------------------------------------------------- mkdocs


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    """mkdocs hook: each directive back for mkdocstrings, the written copy dropped."""
    return _BLOCK.sub(lambda m: m.group("directive"), markdown)


# ----------------------------------------------------------------------------- pages


def _directives(text: str) -> list[tuple[int, int, str, str]]:
    """``(start, end, target, directive)`` for each directive of a page, kept or bare."""
    found = [
        (m.start(), m.end(), m.group("target"), m.group("directive")) for m in _BLOCK.finditer(text)
    ]
    for m in _DIRECTIVE.finditer(text):
        if not any(start <= m.start() < end for start, end, _, _ in found):
            found.append((m.start(), m.end(), m.group("target"), m.group(0)))
    return sorted(found)


def page(text: str, names: dict[str, str]) -> str:
    """The page ``text`` with each directive's written copy made again."""
    out, done = [], 0
    for start, end, target, directive in _directives(text):
        out.append(text[done:start])
        written = "\n".join(_target(target, directive, _level(text[:start]), names))
        written = re.sub(r"\n{3,}", "\n\n", written).strip("\n")
        out.append(
            f"<!-- mkdocstrings (the site's); below it, what `{SCRIPT}` writes\n{directive}-->\n"
            f"{written}\n\n<!-- end of {target} -->\n"
        )
        done = end
    return "".join(out) + text[done:]


def _level(above: str) -> int:
    """The heading level of what a directive documents: one below the page's last
    heading above it (code blocks and written copies aside), at least 2."""
    above = _BLOCK.sub("", above)
    above = re.sub(r"^```.*?^```", "", above, flags=re.M | re.S)
    headings = re.findall(r"^(#+) ", above, re.M)
    return max(2, len(headings[-1]) + 1) if headings else 2


def _members(target: str, directive: str) -> list[str]:
    """A module directive's members (its ``members:`` option, else ``__all__``)."""
    m = _MEMBERS.search(directive)
    if m:
        return [n.strip() for n in m.group("names").split(",") if n.strip()]
    return list(importlib.import_module(target).__all__)


def _target(target: str, directive: str, level: int, names: dict[str, str]) -> list[str]:
    obj = _resolve(target)
    if inspect.ismodule(obj):
        lines = _docstring(obj.__doc__ or "", target, names)
        for member in _members(target, directive):
            lines += _object(f"{target}.{member}", getattr(obj, member), level, names)
        return lines
    return _object(target, obj, level, names)


def _resolve(path: str) -> Any:
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            obj = getattr(obj, part)
        return obj
    raise ImportError(path)


# ----------------------------------------------------------------------------- objects


def _object(path: str, obj: Any, level: int, names: dict[str, str]) -> list[str]:
    """One name: its heading, its signature or kind, its docstring, its members."""
    lines = ["", f"{'#' * level} `{path}`", ""]
    if isinstance(obj, property | functools.cached_property):
        lines += ["*property*", ""]
    elif callable(obj):
        signature = _signature(obj)
        if signature is not None:
            lines += [f"`{path}{signature}`", ""]
    elif repr(obj) != path:  # a constant, unless it is shown by its name
        lines += [f"`{path} = {obj!r}`", ""]
    lines += _docstring(_own_doc(obj, path), path, names)
    if inspect.isclass(obj):
        for name, member in _class_members(obj):
            lines += _object(f"{path}.{name}", member, level + 1, names)
    return lines


def _signature(obj: Any) -> str | None:
    """``(a, b=1, *, c=None)``: the exact parameters, without annotations and ``self``;
    None for a class that takes what ``object`` takes (a protocol)."""
    if inspect.isclass(obj) and obj.__init__ is object.__init__ and obj.__new__ is object.__new__:
        return None
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    params = [
        p.replace(annotation=inspect.Parameter.empty, default=_Default(p.default))
        if p.default is not inspect.Parameter.empty
        else p.replace(annotation=inspect.Parameter.empty)
        for p in sig.parameters.values()
    ]
    if params and params[0].name in ("self", "cls"):
        params = params[1:]
    return str(sig.replace(parameters=params, return_annotation=inspect.Signature.empty))


class _Default:
    """A default as the signature shows it: a class by its import path, not its repr."""

    def __init__(self, value: Any):
        self.value = value

    def __repr__(self) -> str:
        if inspect.isclass(self.value):
            return f"{self.value.__module__}.{self.value.__qualname__}"
        return repr(self.value)


def _own_doc(obj: Any, path: str) -> str:
    """The object's own docstring (not inherited, not a dataclass's generated one); for
    a constant, the string after its assignment in meshinit's source."""
    if isinstance(obj, property):
        obj = obj.fget
    elif isinstance(obj, functools.cached_property):
        obj = obj.func
    if inspect.isclass(obj):
        doc = obj.__dict__.get("__doc__") or ""
        return "" if doc.startswith(f"{obj.__name__}(") else doc
    if callable(obj):
        return obj.__doc__ or ""
    return _constant_doc(path.rsplit(".", 1)[1])


def _constant_doc(name: str) -> str:
    for source in sorted((ROOT / "meshinit").rglob("*.py")):
        body = ast.parse(source.read_text()).body
        for node, after in zip(body, body[1:], strict=False):
            targets = node.targets if isinstance(node, ast.Assign) else []
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
                    return str(after.value.value)
    return ""


def _class_members(cls: type) -> list[tuple[str, Any]]:
    """Public methods and properties the class defines, with a docstring, in source
    order (dataclass fields are under its ``Attributes:``)."""
    out = []
    for name, value in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(value, staticmethod | classmethod):
            value = getattr(cls, name)
        kinds = (property, functools.cached_property)
        if not (isinstance(value, kinds) or inspect.isfunction(value) or inspect.ismethod(value)):
            continue
        if _own_doc(value, name):
            out.append((name, value))
    return out


# ----------------------------------------------------------------------------- docstrings


def _docstring(doc: str, path: str, names: dict[str, str]) -> list[str]:
    """A Google-style docstring as Markdown lines."""
    doc = _roles(inspect.cleandoc(doc), path, names)
    lines: list[str] = []
    header, body = None, []
    for line in [*doc.splitlines(), "END:"]:
        m = _SECTION.match(line)
        # a section ends at its next header, or at a line as little indented as it
        ends = header is not None and line.strip() and not line[0].isspace()
        if m or line == "END:" or ends:
            lines += _section(header, body)
            header, body = (m.group(1) if m else None), ([] if m or line == "END:" else [line])
        else:
            body.append(line)
    return lines


def _section(header: str | None, body: list[str]) -> list[str]:
    text = textwrap.dedent("\n".join(body)).strip("\n")
    if not text:
        return []
    if header is None:
        return [re.sub(r"::$", ":", line) for line in text.splitlines()] + [""]
    if header == "Examples":
        return [f"**{header}:**", "", *_examples(text), ""]
    if header in _LISTED:
        return [f"**{header}:**", "", *_items(text), ""]
    if header in ("Returns", "Yields"):  # one value, over lines: one item
        first, *rest = text.splitlines()
        return [f"**{header}:**", "", f"- {first}", *(f"  {r}" if r else "" for r in rest), ""]
    return [f"**{header}:**", "", *text.splitlines(), ""]


_ITEM = re.compile(r"(?P<names>[\w.*]+(?:, [\w.*]+)*)(?: \((?P<kind>[^)]*)\))?:(?P<rest>.*)")


def _items(text: str) -> list[str]:
    """``name: what`` items (``A, B: what`` for several; continued on more indented
    lines) as a Markdown list."""
    out: list[str] = []
    for line in text.splitlines():
        item = _ITEM.fullmatch(line) if line and not line[0].isspace() else None
        if item:
            shown = ", ".join(f"`{n}`" for n in item.group("names").split(", "))
            if item.group("kind"):
                shown += f" ({item.group('kind')})"
            out.append(f"- {shown}:{item.group('rest')}".rstrip())
        else:
            out.append(f"  {line.strip()}" if line.strip() else "")
    return out


def _examples(text: str) -> list[str]:
    """Doctest lines (and their output) as ``pycon`` blocks, prose between as is."""
    out: list[str] = []
    code = False
    for line in text.splitlines():
        if line.startswith(">>>") and not code:
            out += ["```pycon"]
            code = True
        elif code and not line.strip():
            out += ["```", ""]
            code = False
            continue
        out.append(line)
    return out + (["```"] if code else [])


def _roles(doc: str, path: str, names: dict[str, str]) -> str:
    """Sphinx roles as code, linked where the name is on an API page."""

    def replace(m: re.Match) -> str:
        tilde, target = m.groups()
        text = target.rsplit(".", 1)[-1] if tilde else target
        scopes = [path.rsplit(".", k)[0] for k in range(path.count(".") + 1)]
        for candidate in [*(f"{s}.{target}" for s in scopes), target]:
            if candidate in names:
                return f"[`{text}`]({names[candidate]})"
        return f"`{text}`"

    return _ROLE.sub(replace, doc)


# ----------------------------------------------------------------------------- links


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lowercased, punctuation but ``-_`` dropped."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def _names(pages: dict[str, str]) -> dict[str, str]:
    """Each documented name -> the link to its heading, from each page's directives."""
    names: dict[str, str] = {}

    def add(file: str, path: str, obj: Any) -> None:
        names[path] = f"{file}#{_anchor(path)}"
        if inspect.isclass(obj):
            for member, _ in _class_members(obj):
                names[f"{path}.{member}"] = f"{file}#{_anchor(f'{path}.{member}')}"

    for file, text in pages.items():
        for _, _, target, directive in _directives(text):
            obj = _resolve(target)
            if inspect.ismodule(obj):
                for member in _members(target, directive):
                    add(file, f"{target}.{member}", getattr(obj, member))
            else:
                add(file, target, obj)
    return names


def written() -> dict[pathlib.Path, tuple[str, str]]:
    """Each API page: ``(as it is, as this script writes it)``."""
    pages = {p.name: p.read_text() for p in sorted(API.glob("*.md"))}
    names = _names(pages)
    return {API / name: (text, page(text, names)) for name, text in pages.items()}


def main(argv: list[str]) -> int:
    pages = written()
    stale = [path for path, (now, new) in pages.items() if now != new]
    for path in stale:
        if "--check" in argv:
            print(f"{path.relative_to(ROOT)} is stale: run {SCRIPT}")
        else:
            path.write_text(pages[path][1])
            print(f"wrote {path.relative_to(ROOT)}")
    return 1 if stale and "--check" in argv else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # the meshinit of this checkout, not another install
    sys.exit(main(sys.argv[1:]))
