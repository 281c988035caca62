"""A regex map's stored names written back: the name a regex of a framework's map
(tunix's ``_get_key_and_transform_mapping``: ``regex -> (key template, transform)``)
matches for given group values, and the keys each template makes, as a regex.

A regex is written as one name where it is literal text (escapes such as ``\\.``),
capturing groups and optional non-capturing groups (left out: tunix's
``(?:language_model\\.)?``). A group the template does not use takes its first
alternative (tunix's Gemma 3 reads ``post_feedforward_layernorm`` and two other
spellings into one key). Anything else (``.*``, a class outside a group) is
:class:`Unwritten`, naming it; so is a name the framework's own matcher does not read
back as the key it was written for (:func:`checked`). Used by :mod:`.inverse`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from typing import Any


class Unwritten(Exception):
    """What keeps a name or a shape from being written; its message says why."""


@dataclasses.dataclass(frozen=True)
class Group:
    """A capturing group of a regex: its number and its own pattern."""

    number: int
    pattern: str


@dataclasses.dataclass(frozen=True)
class Entry:
    """One entry of the map: the regex, its pieces (literal text and groups), the key
    template and the transform; ``keys`` matches the keys the template makes."""

    regex: str
    pieces: tuple[str | Group, ...]
    template: str
    transform: Any
    keys: re.Pattern[str]

    def groups(self) -> dict[int, Group]:
        return {p.number: p for p in self.pieces if isinstance(p, Group)}

    def referenced(self) -> list[int]:
        """The groups the template uses, in order, each once."""
        return list(dict.fromkeys(int(n) for n in re.findall(r"\\(\d+)", self.template)))

    def key(self, values: Mapping[int, str]) -> str:
        return re.sub(r"\\(\d+)", lambda m: values[int(m.group(1))], self.template)


def entries(key_map: Mapping[str, Any], dropped: str) -> tuple[list[Entry], dict[str, str]]:
    """The map's entries whose template does not start with ``dropped`` (the prefix of
    the names the framework drops), each readable from its keys; and the regexes that
    cannot be written as one name, each with why."""
    out, unwritable = [], {}
    for regex, (template, transform) in key_map.items():
        if template.startswith(dropped):
            continue
        try:
            pieces = _pieces(regex)
            keys = _keys(template, {p.number: p for p in pieces if isinstance(p, Group)})
        except Unwritten as e:
            unwritable[regex] = str(e)
            continue
        out.append(Entry(regex, pieces, template, transform, keys))
    return out, unwritable


def _pieces(regex: str, before: int = 0) -> tuple[str | Group, ...]:
    """``regex`` as literal text and capturing groups (``before``: the groups opened
    before it, where it is the inside of a group); an optional non-capturing group is
    left out (the name written without it). Anything else that is not one name
    (``.*``, a class, an alternation outside a group) raises :class:`Unwritten`."""
    out: list[str | Group] = []
    i = 0
    while i < len(regex):
        c = regex[i]
        if c == "\\":
            nxt = regex[i + 1 : i + 2]
            if not nxt or nxt.isalnum():
                raise Unwritten(f"its regex {regex!r} has \\{nxt}, a class, not a name")
            out.append(nxt)
            i += 2
        elif c == "(":
            j = _closing(regex, i)
            inner = regex[i + 1 : j]
            after = regex[j + 1 : j + 2]
            if inner.startswith("?:") and after == "?":
                i = j + 2  # optional: the name without it
                continue
            if inner.startswith("?:") and after not in ("*", "+", "{"):
                out.extend(_pieces(inner[2:], before + _captures(regex[:i])))
            elif inner.startswith("?") or after in ("?", "*", "+", "{"):
                quantified = after if after in ("?", "*", "+", "{") else ""
                raise Unwritten(f"its regex {regex!r} has ({inner}){quantified}, not a name")
            else:
                out.append(Group(before + _captures(regex[:i]) + 1, inner))
            i = j + 1
        elif c in ".*+?[]{}|^$)":
            raise Unwritten(f"its regex {regex!r} has {c!r} outside a group, not a name")
        else:
            out.append(c)
            i += 1
    merged: list[str | Group] = []
    for p in out:  # literal characters joined into text
        if isinstance(p, str) and merged and isinstance(merged[-1], str):
            merged[-1] += p
        else:
            merged.append(p)
    return tuple(merged)


def _closing(regex: str, start: int) -> int:
    depth, i = 0, start
    while i < len(regex):
        c = regex[i]
        if c == "\\":
            i += 2
            continue
        if c == "[":  # a class may hold parentheses
            i = regex.index("]", i + 1) + 1
            continue
        depth += (c == "(") - (c == ")")
        if depth == 0:
            return i
        i += 1
    raise Unwritten(f"its regex {regex!r} has an unclosed group")


def _captures(text: str) -> int:
    """The capturing groups opened in ``text``, the start of a regex."""
    return len(re.findall(r"(?<!\\)\((?!\?)", re.sub(r"\[[^\]]*\]", "", text)))


def _keys(template: str, groups: Mapping[int, Group]) -> re.Pattern[str]:
    """The keys ``template`` makes, as a regex: its ``\\N`` the regex's own groups."""
    parts = re.split(r"\\(\d+)", template)
    out, seen = [], set()
    for i, part in enumerate(parts):
        if i % 2 == 0:
            if "\\" in part:
                raise Unwritten(f"its template {template!r} has an escape other than \\N")
            out.append(re.escape(part))
            continue
        n = int(part)
        if n not in groups:
            raise Unwritten(f"its template {template!r} uses \\{n}, a group its regex lacks")
        out.append(f"(?P=g{n})" if n in seen else f"(?P<g{n}>{groups[n].pattern})")
        seen.add(n)
    return re.compile("".join(out))


def written(entry: Entry, values: Mapping[int, str]) -> str:
    """The stored name ``entry``'s regex matches with ``values`` in its groups; a group
    without a value (one the template does not use) takes its first alternative."""
    out = []
    for p in entry.pieces:
        if isinstance(p, str):
            out.append(p)
            continue
        value = values.get(p.number)
        if value is None:
            first = p.pattern.split("|")[0]
            value = re.sub(r"\\(\W)", r"\1", first)
            if re.fullmatch(r"(?:\\\W|[\w-])+", first) is None or not re.fullmatch(
                p.pattern, value
            ):
                raise Unwritten(
                    f"its regex {entry.regex!r}'s group ({p.pattern}) is not in its template "
                    f"and has no one name to write"
                )
        elif re.fullmatch(p.pattern, value) is None:
            raise Unwritten(f"{value!r} is not ({p.pattern}) of its regex {entry.regex!r}")
        out.append(value)
    return "".join(out)


def checked(
    entry: Entry,
    values: Mapping[int, str],
    key: str,
    key_map: Mapping[str, Any],
    match: Callable[[Mapping[str, Any], str], tuple[str, Any]],
) -> str:
    """The name ``entry`` writes for ``values``, checked by the framework's own matcher
    to come back to ``key`` (and by no other entry)."""
    name = written(entry, values)
    try:
        back, _ = match(key_map, name)
    except ValueError:
        back = None
    if back != key:
        why = "no entry, or several," if back is None else f"{back!r},"
        raise Unwritten(f"its map reads {name} (written for {key}) as {why} not as {key}")
    return name
