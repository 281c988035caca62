"""A regex map written for loading, read from the parameters' side: the stored tensors
(names and shapes) an export writes, where it has no files to read them from.

tunix keeps, per model family, ``regex -> (key template, (permute, reshape))`` (the
stored tensor transposed, then reshaped, under the key the template makes of the
regex's groups) and a preprocess step over the keyed arrays (Qwen3's experts
stacked, Gemma's q, k and v fused). The load follows it forward from the files'
names and shapes (:mod:`meshinit.tunix`); the export has only the parameters. Here:

- each plan path matched by a template (:func:`entries`) gives the stored name
  written from its regex with the groups it matched (:func:`written`), and its
  shape by the transform undone (:func:`stored_shape`);
- the entries no plan path matches, the preprocess step's inputs, are enumerated
  over their index groups by counts the caller gives (``layers`` by the layer count);
  a shape their transform does not state (an expert's plain transpose) is read off
  the preprocess step's outputs, run by jax on abstract values with a stand-in size
  for each unknown axis (:func:`stored`);
- a ``Tensor``'s ``shape=`` is spelled so that its runs are the stored axes, as the
  export reads a reshape (:func:`respelled`).

Nothing is guessed where the map does not say: a reshape's stored axes are its runs
with the model's width (``width``) alone on one side (as Hugging Face stores a
projection ``(out, in)``), and a reshape that does not split so, a regex that is not
one name, or a shape the outputs do not give, is a problem naming the plan path.
Every name written is checked by the framework's own matcher (``match``) to come
back to its key.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from ..._errors import Problem
from ..layout import parts as _parts
from ..layout.parts import Concat, Pad, Stack, Target, Tensor
from ..layout.reshape import runs as stored_runs
from . import regex_names as _regex
from . import trace as _trace
from .regex_names import Entry, Unwritten

Shapes = Mapping[str, tuple[tuple[int, ...], Any]]


# --------------------------------------------------------------------- shapes


def stored_shape(shape: Sequence[int], transform: Any, width: int) -> tuple[int, ...]:
    """The stored shape that ``transform`` (``(permute, reshape)``, transpose first)
    makes ``shape`` of. A reshape is undone as a merge of its runs: the model's width
    alone, each run of other axes one stored axis (``(d, heads, head_dim)`` of a
    ``(heads * head_dim, d)`` weight), and there must be as many as ``permute`` has
    axes; otherwise :class:`Unwritten` says why."""
    shape = tuple(int(d) for d in shape)
    if transform is None:
        return shape
    permute, reshape = transform
    viewed = shape
    if reshape:
        given = tuple(int(d) for d in reshape)
        known = math.prod(d for d in given if d != -1) or 1
        if tuple(math.prod(shape) // known if d == -1 else d for d in given) != shape:
            raise Unwritten(f"its map reshapes it to {given}, the parameter is {shape}")
        viewed = _merged(shape, width)
        if permute and len(viewed) != len(permute):
            raise Unwritten(
                f"its reshape to {shape} is undone by a merge of its runs beside the width "
                f"{width} into {viewed}, not the {len(permute)} axes its transpose "
                f"{tuple(permute)} has: which stored axes it split is not known"
            )
    if not permute:
        return viewed
    order = tuple(int(a) % len(viewed) for a in permute)
    if len(order) != len(viewed) or sorted(order) != list(range(len(viewed))):
        raise Unwritten(f"its transpose {tuple(permute)} is not an order of {len(viewed)} axes")
    out = [0] * len(viewed)
    for i, a in enumerate(order):  # tunix: stored.transpose(order) is viewed
        out[a] = viewed[i]
    return tuple(out)


def _merged(shape: tuple[int, ...], width: int) -> tuple[int, ...]:
    """``shape`` with each run of axes other than ``width`` merged into one."""
    out: list[int] = []
    run: int | None = None
    for d in shape:
        if d == width:
            if run is not None:
                out.append(run)
                run = None
            out.append(d)
        else:
            run = d if run is None else run * d
    if run is not None:
        out.append(run)
    return tuple(out)


def respelled(target: Target, shapes: Mapping[str, tuple[int, ...]]) -> Target:
    """``target`` with each :class:`Tensor`'s ``shape=`` spelled so that its runs (each
    run of given sizes one axis, each ``-1`` one) are the stored tensor's axes, as the
    export reads a reshape; the load reads both alike. :class:`Unwritten` where no
    spelling with at most one ``-1`` says it."""
    if isinstance(target, Tensor):
        if target.shape is None or target.index is not None or target.name not in shapes:
            return target
        return dataclasses.replace(target, shape=_spelled(target.shape, shapes[target.name]))
    if isinstance(target, Stack | Concat):
        return dataclasses.replace(target, parts=tuple(respelled(p, shapes) for p in target.parts))
    if isinstance(target, Pad):
        return dataclasses.replace(target, part=respelled(target.part, shapes))
    return target


def spelled(
    table: Mapping[str, Target | None], shapes: Mapping[str, tuple[int, ...]], family: str
) -> tuple[dict[str, Target | None], list[Problem]]:
    """Each target of ``table`` :func:`respelled`, or the problem naming its path."""
    out: dict[str, Target | None] = {}
    problems = []
    for path, target in table.items():
        try:
            out[path] = None if target is None else respelled(target, shapes)
        except Unwritten as e:
            problems.append(Problem(path, f"{family}: {e}"))
    return out, problems


def _spelled(given: tuple[int, ...], stored: tuple[int, ...]) -> tuple[int, ...]:
    size = math.prod(stored)
    known = math.prod(d for d in given if d != -1) or 1
    resolved = tuple(size // known if d == -1 else d for d in given)
    runs: list[list[int]] = []  # positions of ``resolved`` making each stored axis
    at = 0
    for axis in stored:
        run: list[int] = []
        product = 1
        while at < len(resolved) and (product < axis or not run or resolved[at] == 1):
            if product * resolved[at] > axis:
                break
            run.append(at)
            product *= resolved[at]
            at += 1
        if product != axis:
            raise Unwritten(f"shape={given} does not split the stored {stored} axis by axis")
        runs.append(run)
    if at != len(resolved):
        raise Unwritten(f"shape={given} does not split the stored {stored} axis by axis")
    singles = [i for i, r in enumerate(runs) if len(r) == 1]
    for minus in [None, *singles]:  # a lone axis as -1, where that separates the runs
        spelled = tuple(
            -1 if minus is not None and i == runs[minus][0] else d for i, d in enumerate(resolved)
        )
        if stored_runs(spelled, resolved) == stored:
            return spelled
    raise Unwritten(
        f"shape={given} of the stored {stored}: no spelling with one -1 has the stored axes "
        f"as its runs"
    )


# ------------------------------------------------------------- the stored tensors


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A stored tensor the export may write: its name, the key tunix's map gives it,
    its stored shape (None where no output gave it), the parameter it was matched
    from (None: an input of the preprocess step) and that parameter's dtype."""

    name: str
    key: str
    shape: tuple[int, ...] | None
    path: str | None
    dtype: Any


def stored(
    key_map: Mapping[str, Any],
    planned: Shapes,
    *,
    width: int,
    counts: Mapping[str, int],
    preprocess: Callable[[], Callable[[dict[str, Any]], Any] | None],
    match: Callable[[Mapping[str, Any], str], tuple[str, Any]],
    dropped: str,
    family: str,
) -> tuple[list[Candidate], list[Problem]]:
    """The stored tensors of ``planned`` (plan path -> shape and dtype, RNG state left
    out) by ``key_map``: one per plan path a template matches, and the inputs of the
    preprocess step (``preprocess()`` makes a fresh one, or None) enumerated by
    ``counts`` (``{"layers": 2}``: a ``layers\\.([0-9]+)`` group of an entry no path
    matches takes 0 and 1), shapes read off the step's outputs. Some of those
    inputs may feed no parameter (the caller drops them after following the step);
    every plan path the map does not reach, and each entry it cannot write, is a
    problem naming the path."""
    found, unwritable = _regex.entries(key_map, dropped)
    problems: list[Problem] = []
    made: list[Candidate] = []
    left: list[str] = []
    matched: set[str] = set()
    for path, (shape, dtype) in planned.items():
        hit = next(
            ((e, key, m) for key in (path, f"{path}.value") for e in found
             if (m := e.keys.fullmatch(key))),
            None,
        )  # fmt: skip
        if hit is None:
            left.append(path)
            continue
        entry, key, m = hit
        matched.add(entry.regex)
        values = {int(g[1:]): v for g, v in m.groupdict().items()}
        try:
            name = _regex.checked(entry, values, key, key_map, match)
            made.append(
                Candidate(name, key, stored_shape(shape, entry.transform, width), path, dtype)
            )
        except Unwritten as e:
            problems.append(Problem(path, f"{family}: {e}"))
    if not left:
        return made, problems
    step = preprocess()
    if step is None:
        return made, problems + [_unreached(p, family, unwritable, False) for p in left]
    inputs, skipped = _inputs(found, matched, key_map, match, width, counts)
    why = {**unwritable, **skipped}
    solved, found_problems = _solve(step, made, inputs, planned, left, width, family, why)
    return made + solved, problems + found_problems


@dataclasses.dataclass(frozen=True)
class _Input:
    """An input of the preprocess step: a stored tensor no plan path names."""

    name: str
    key: str
    viewed: tuple[int, ...] | None  # its shape after the transform, where stated
    rank: int  # of that shape
    kind: tuple[str, tuple[str, ...]]  # the inputs of one stand-in shape
    transform: Any


def _inputs(
    found: Sequence[Entry],
    matched: set[str],
    key_map: Mapping[str, Any],
    match: Callable[[Mapping[str, Any], str], tuple[str, Any]],
    width: int,
    counts: Mapping[str, int],
) -> tuple[list[_Input], dict[str, str]]:
    """Every name the entries no plan path matches write, their index groups over
    ``counts``; and the entries skipped, each with why."""
    out, skipped = [], {}
    for entry in found:
        if entry.regex in matched:
            continue
        try:
            choices = [_choices(entry, n, counts) for n in entry.referenced()]
        except Unwritten as e:
            skipped[entry.regex] = str(e)
            continue
        permute, reshape = entry.transform or (None, None)
        for combo in itertools.product(*choices):
            values = dict(zip(entry.referenced(), combo, strict=True))
            try:
                key = entry.key(values)
                name = _regex.checked(entry, values, key, key_map, match)
            except Unwritten as e:
                skipped[entry.regex] = str(e)
                break
            viewed: tuple[int, ...] | None = None
            if reshape and -1 not in reshape:
                viewed = tuple(int(d) for d in reshape)
                try:
                    stored_shape(viewed, entry.transform, width)
                except Unwritten as e:
                    skipped[entry.regex] = str(e)
                    break
            elif not permute or reshape:
                skipped[entry.regex] = "its shape is stated neither by a reshape nor by a plan path"
                break
            rank = len(viewed) if viewed is not None else len(permute or ())
            kind = (entry.regex, tuple(v for n, v in values.items() if not v.isdigit()))
            out.append(_Input(name, key, viewed, rank, kind, entry.transform))
    return out, skipped


def _choices(entry: Entry, n: int, counts: Mapping[str, int]) -> list[str]:
    """The values of group ``n`` of an entry no plan path matches: an index after a
    counted word (``layers\\.([0-9]+)``), or each of its alternatives."""
    group = entry.groups()[n]
    at = entry.pieces.index(group)
    before = entry.pieces[at - 1] if at else ""
    word = before.rstrip(".").rsplit(".", 1)[-1] if isinstance(before, str) else ""
    if word in counts and re.fullmatch(group.pattern, "0"):
        return [str(i) for i in range(counts[word] or 0)]
    alternatives = group.pattern.split("|")
    if all(re.fullmatch(r"[\w-]+", a) for a in alternatives):
        return alternatives
    raise Unwritten(
        f"its group ({group.pattern}) after {word!r} is neither an index of "
        f"{', '.join(sorted(counts))} nor alternatives to write each of"
    )


def _solve(
    step: Callable[[dict[str, Any]], Any],
    direct: Sequence[Candidate],
    inputs: Sequence[_Input],
    planned: Shapes,
    left: Sequence[str],
    width: int,
    family: str,
    why: Mapping[str, str],
) -> tuple[list[Candidate], list[Problem]]:
    """The inputs' shapes read off the step's outputs: jax runs it on abstract values,
    each axis an input's transform does not state a stand-in size of its kind
    (larger than any real one), which the output of a plan path then names."""
    dims = [d for shape, _ in planned.values() for d in shape] + [1]
    base = 10 ** (len(str(max(dims))) + 3)
    sizes: dict[tuple[Any, int], int] = {}
    structs: dict[str, Any] = {}
    for c in direct:  # keyed as tunix keys it: the parameter's own shape and dtype
        shape, dtype = planned[c.path or ""]
        structs[c.key] = jax.ShapeDtypeStruct(tuple(shape), dtype)
    for i in inputs:
        shape = i.viewed or tuple(
            sizes.setdefault((i.kind, a), base + len(sizes) + 1) for a in range(i.rank)
        )
        structs[i.key] = jax.ShapeDtypeStruct(shape, np.float32)
    try:
        outputs = jax.eval_shape(step, structs)
    except Exception as e:  # noqa: BLE001 - the framework's own code, on these shapes
        failed = f"its preprocess step failed on the parameters' shapes ({type(e).__name__}: {e})"
        return [], [Problem(p, f"{family}: {failed}") for p in left]
    named = {v: k for k, v in sizes.items()}
    value: dict[tuple[Any, int], int] = {}
    problems = []
    for path in left:
        key = next((k for k in (path, f"{path}.value") if k in outputs), None)
        if key is None or not hasattr(outputs[key], "shape"):
            problems.append(_unreached(path, family, why, True))
            continue
        made, want = tuple(outputs[key].shape), tuple(planned[path][0])
        wrong = len(made) != len(want)
        for got, size in zip(made, want, strict=False):
            if got in named:
                wrong |= value.setdefault(named[got], size) != size
            else:
                wrong |= got != size and got < base
        if wrong or any(got >= base and got not in named for got in made):
            said = "(" + ", ".join("?" if d >= base else str(d) for d in made) + ")"
            problems.append(
                Problem(
                    path,
                    f"{family}: its preprocess step makes it {said} of its inputs, the "
                    f"parameter is {want}: its stored shapes are not read off the parameter",
                )
            )
    out = []
    for i in inputs:
        viewed = i.viewed
        if viewed is None:
            got = [value.get((i.kind, a)) for a in range(i.rank)]
            if None in got:
                continue  # no parameter's output gave it: it feeds none
            viewed = tuple(d for d in got if d is not None)
        shape = stored_shape(viewed, i.transform, width)  # stated ones were checked
        out.append(Candidate(i.name, i.key, shape, None, None))
    return out, problems


def _unreached(path: str, family: str, why: Mapping[str, str], step: bool) -> Problem:
    notes = "; ".join(f"{r!r}: {w}" for r, w in sorted(why.items()))
    how = ", nor its preprocess step from the entries written" if step else ""
    return Problem(
        path,
        f"{family}: no entry of its map writes it (no template makes this path{how}); "
        f"export it with a table of your own, or leave it out of the arrays"
        + (f"; entries not written: {notes}" if notes else ""),
    )


def fed(
    made: Sequence[Candidate],
    planned: Shapes,
    follow: Callable[[Mapping[str, tuple[int, ...]]], Mapping[str, _trace.Sym]],
) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """The tensors of ``made`` that feed a parameter, each with its stored shape and
    the dtype of the parameter it feeds. ``follow`` keys stored shapes as the load
    does (the transform, then the preprocess step, on stand-ins); an input of the
    step that it passes on under a key the plan lacks (a dense model's MoE router,
    enumerated from an entry no path matched) is left out. Inputs read by no key at
    all (a parameter the step computes, refused when its table is built) stay."""
    dtypes = {c.name: np.dtype(c.dtype) for c in made if c.dtype is not None}
    shapes = {c.name: c.shape for c in made if c.shape is not None}
    unfed: set[str] = set()
    if len(dtypes) < len(shapes):
        try:
            keyed = follow(shapes)
        except Exception:  # noqa: BLE001 - the framework's own code: its table names it
            keyed = {}
        feeding: set[str] = set()
        for key, sym in keyed.items():
            path = key.removesuffix(".value") if key.removesuffix(".value") in planned else key
            read = _read(sym)
            if path in planned:
                feeding.update(read)
                for name in read:
                    dtypes.setdefault(name, np.dtype(planned[path][1]))
            else:
                unfed.update(read)
        unfed -= feeding
    float32 = np.dtype(np.float32)
    return {n: (s, dtypes.get(n, float32)) for n, s in shapes.items() if n not in unfed}


def _read(sym: _trace.Sym) -> list[str]:
    try:
        return [t.name for t in _parts.leaves(_trace.target(sym))]
    except _trace.Inexpressible:
        return []
