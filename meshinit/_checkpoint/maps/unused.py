"""The stored tensors that no load reads, and how the loader names them.

A stored tensor is unused when no plan path claims it, or when only paths that lack
another of their parts would read it: ``missing="skip"`` leaves such a path out, and
reads none of its parts (the other layers of a :class:`~meshinit.safetensors.Stack`
whose last layer is absent). :func:`find` tells the two apart; :func:`problems` and
:func:`warning` say of each why nothing reads it, and the fix.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from ..._errors import Problem, printable
from ..._format import some
from ..layout.parts import Target, leaves


def find(
    targets: Mapping[str, Target | None],
    missing: Mapping[str, str],
    held: Mapping[str, object],
    scales: Collection[str] = (),
    parts: Mapping[str, tuple[str, ...]] | None = None,
) -> tuple[tuple[str, ...], dict[str, list[str]]]:
    """The stored tensors (``held``'s names) that no load reads, sorted, and of them
    those that only ``missing`` paths would read (tensor -> those paths, "stranded").
    ``scales`` are read with the float8 weights they dequantize: claimed. ``parts``
    names the stored tensors a virtual one is read from (an MXFP4 tensor's).

    A path refused for another reason (a shape that does not fit) fails the load
    anyway: its tensors count as claimed, and are not named twice."""
    parts = parts or {}
    claimed = {
        name
        for path, target in targets.items()
        if target is not None and path not in missing
        for t in leaves(target)
        for name in parts.get(t.name, (t.name,))
    } | set(scales)
    stranded: dict[str, list[str]] = {}
    for path in missing:
        target = targets[path]
        assert target is not None  # a path that names= maps to None is skipped, not missing
        for name in dict.fromkeys(n for t in leaves(target) for n in parts.get(t.name, (t.name,))):
            if name in held and name not in claimed:
                stranded.setdefault(name, []).append(path)
    return tuple(sorted(set(held) - claimed)), stranded


def problems(
    names: tuple[str, ...],
    stranded: Mapping[str, list[str]],
    missing: Mapping[str, str],
    files: Mapping[str, str],
) -> list[Problem]:
    """``unused="error"``'s problem for each of ``names``, naming its file (``files``:
    each stored tensor's file, as messages name it)."""
    return [Problem(files[n], f"tensor {n!r}: {_why(n, stranded, missing)}") for n in names]


def warning(
    what: str, names: tuple[str, ...], stranded: Mapping[str, list[str]], missing: Mapping[str, str]
) -> str:
    """``unused="warn"``'s message: every one of ``names``, and the skipped paths some
    of them belong to."""
    n = len(names)
    of = [t for t in names if t in stranded]
    are = "is a part" if len(of) == 1 else "are parts"
    note = (
        f" Of these, {some([repr(t) for t in of], 5)} {are} of {_skipped(of, stranded, missing)}."
    )
    return (
        f"{what}: {n} tensor{'s' * (n != 1)} of the checkpoint went unused (no plan path "
        f"claims them): {', '.join(map(repr, names))}.{note if of else ''} Map them with "
        f'names=, or pass unused="ignore" if they are not part of this model'
    )


def _why(name: str, stranded: Mapping[str, list[str]], missing: Mapping[str, str]) -> str:
    if name not in stranded:
        return 'no plan path claims it; map a path to it with names=, or pass unused="ignore"'
    return (
        f"nothing reads it: it is a part of {_skipped([name], stranded, missing)}; add the "
        f'missing part to the files, or pass unused="ignore"'
    )


def _skipped(
    names: list[str], stranded: Mapping[str, list[str]], missing: Mapping[str, str]
) -> str:
    """The skipped paths that would read ``names``, each with the tensor it lacks."""
    paths = list(dict.fromkeys(p for n in names for p in stranded[n]))
    shown = some([f"{printable(p)!r} (which lacks {printable(missing[p])!r})" for p in paths], 3)
    return f'{shown}, skipped (missing="skip") for a part not in the files'
