"""Griffe extension: Sphinx roles in meshinit's docstrings become API reference links.

meshinit's docstrings refer to each other the way jax's and equinox's do, with roles
such as ``:class:`Problem```, ``:func:`meshinit.plan``` or ``:meth:`device_bytes```.
mkdocstrings reads Markdown, where those render as stray colons (and, at the start of a
``Returns:`` item, as a bogus type). This extension rewrites each role before the
docstrings are parsed:

- into a cross-reference, ``[`Problem`][meshinit.Problem]``, when the name resolves
  (from the object's class, its module, or the top-level package) to an object the
  API reference renders under its public name;
- into plain code, ``Problem``, otherwise (private helpers), so that a strict build
  never meets a link it cannot resolve.

``~`` keeps the last component of the name as the link text, as in Sphinx.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:class|func|meth|attr|data|mod|exc|obj):`(~?)([\w.]+)`")


def _walk(obj: griffe.Object):
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from _walk(member)


class SphinxRoles(griffe.Extension):
    """Rewrites Sphinx roles into mkdocstrings cross-references, once the package is loaded."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        public = self._public_names(pkg)
        for obj in _walk(pkg):
            if obj.docstring is None or ":`" not in obj.docstring.value:
                continue
            obj.docstring.value = _ROLE.sub(
                lambda m, obj=obj: self._replace(m, obj, pkg, public), obj.docstring.value
            )

    @staticmethod
    def _public_names(pkg: griffe.Module) -> dict[str, str]:
        """Canonical path -> the public path the API reference renders it under.

        Only objects with a docstring count: mkdocstrings skips the others.
        """
        public: dict[str, str] = {}

        def add(obj: griffe.Object, name: str) -> None:
            if not obj.docstring:
                return
            public[obj.path] = name
            if obj.is_class:
                for member_name, member in obj.members.items():
                    if not member_name.startswith("_") and not member.is_alias:
                        if member.docstring:
                            public[member.path] = f"{name}.{member_name}"

        for name, member in pkg.members.items():
            if name.startswith("_"):
                continue
            if member.is_alias:
                try:
                    target = member.final_target
                except (griffe.AliasResolutionError, griffe.CyclicAliasError):
                    continue
                add(target, f"{pkg.path}.{name}")
            elif member.is_module:  # the adapters: meshinit.nnx, meshinit.eqx
                exported = [str(n) for n in (member.exports or ())]
                for export in exported:
                    if export in member.members and not member.members[export].is_alias:
                        add(member.members[export], f"{member.path}.{export}")
        return public

    @staticmethod
    def _replace(match: re.Match, obj: griffe.Object, pkg: griffe.Module, public: dict) -> str:
        tilde, target = match.groups()
        text = target.rsplit(".", 1)[-1] if tilde else target
        scopes = [obj.path]
        parent = obj.parent
        while parent is not None:
            scopes.append(parent.path)
            parent = parent.parent
        candidates = [f"{scope}.{target}" for scope in scopes] + [target]
        for candidate in candidates:
            if candidate in public:
                return f"[`{text}`][{public[candidate]}]"
            # A public name given directly (meshinit.plan), or through another alias.
            if candidate.startswith(f"{pkg.path}.") and candidate in public.values():
                return f"[`{text}`][{candidate}]"
            resolved = _resolve(pkg, candidate)
            if resolved in public:
                return f"[`{text}`][{public[resolved]}]"
        return f"`{text}`"


def _resolve(pkg: griffe.Module, path: str) -> str | None:
    """The canonical path of ``path`` inside ``pkg``, following aliases; None if absent."""
    parts = path.split(".")
    if parts[0] != pkg.name:
        return None
    obj: Any = pkg
    try:
        for part in parts[1:]:
            obj = obj.members[part]
            if obj.is_alias:
                obj = obj.final_target
    except (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError):
        return None
    return obj.path
