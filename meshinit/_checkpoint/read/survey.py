"""What a load reads, found before it reads anything: every file checked, every plan
path resolved to its parts (:mod:`.layout`) against the stored tensors, every stored
tensor accounted for. :func:`survey` is the first half of
:func:`meshinit.safetensors.load` and all of :func:`~meshinit.safetensors.inventory`."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import pathlib
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from ..._errors import Problem, printable
from ..._format import some
from ..._plan.plan import Plan
from ..._typos import closest
from ..encodings import keys as _keys
from ..encodings import registry as _registry
from ..layout import host as _host
from ..layout import resolve as _layout
from ..layout.parts import Concat, Fill, Pad, Stack, Tensor
from ..maps import framework as _framework
from ..maps import names as _names
from ..maps import unused as _unused
from ..store import listing as _file
from ..store.header import READABLE
from ..store.source import Source, Stored


@dataclasses.dataclass(frozen=True)
class Inventory:
    """What a load reads, skips and leaves: every plan path and every stored tensor
    accounted for, as :func:`inventory` finds them without reading any data.

    Attributes:
      files: the files checked, in the order read (paths; URLs of remote objects).
      loaded: plan path -> the target it is read from: a :class:`Tensor` (name and
        transforms), a :class:`Stack` or :class:`Concat` of parts, a :class:`Fill` or
        a :class:`Pad`.
      skipped: plan paths that ``names=`` maps to None: not in the files by design.
      missing: plan path -> the tensor name it wants, which no file holds.
      unused: the stored tensors that no load reads, sorted: those no plan path
        claims, and those that only ``missing`` paths would read (a load with
        ``missing="skip"`` leaves such a path out, and reads none of its parts).
      reads: plan path -> the stored tensors it reads, in order (one, or every part's;
        none for a :class:`Fill`).
      table: where ``names=`` is a framework's own map (``meshinit.maxtext.names``,
        ``meshinit.tunix.names``), the table it built for these files: every plan
        path -> its target, or None; ``str()`` prints it. None for a ``names=`` given
        as a table.
      dequantized: plan path -> how its float8 weights are read dequantized: the
        stored dtype, the scale tensor (its dtype and block) and the planned dtype.

    Examples:
      >>> from safetensors.numpy import save_file
      >>> save_file({"embed": np.zeros((256, 64), np.float32),
      ...            "layers.0.up": np.zeros((64, 256), np.float32),
      ...            "lm_head": np.zeros((64, 256), np.float32)}, "ckpt.safetensors")
      >>> found = meshinit.safetensors.inventory(plan, "ckpt.safetensors", names={"head": None})
      >>> found.skipped, found.missing, found.unused
      (('head',), {'layers.1.up': 'layers.1.up'}, ('lm_head',))
    """

    files: tuple[pathlib.Path | str, ...]
    loaded: Mapping[str, Tensor | Stack | Concat | Fill | Pad]
    skipped: tuple[str, ...]
    missing: Mapping[str, str]
    unused: tuple[str, ...]
    reads: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    table: Mapping[str, Tensor | Stack | Concat | Fill | Pad | None] | None = None
    dequantized: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __str__(self) -> str:
        def line(what: str, items: list[str]) -> str:
            return f"{what}: {len(items)}" + (f" {some(items, 5)}" if items else "")

        n = len(self.files)
        return "\n".join(
            [
                f"{n} file{'s' * (n != 1)}: {len(self.loaded)} plan paths loaded",
                line("skipped (names= gives None)", [repr(printable(p)) for p in self.skipped]),
                line(
                    "missing (no file holds them)",
                    [f"{printable(p)} <- {printable(t)!r}" for p, t in self.missing.items()],
                ),
                line(
                    "unused (no plan path claims them)", [repr(printable(t)) for t in self.unused]
                ),
                line(
                    "dequantized (float8 x block scales; MXFP4)",
                    [f"{printable(p)} <- {d}" for p, d in self.dequantized.items()],
                ),
                *([] if self.table is None else ["table (built by the framework's map):"]),
                *(f"  {printable(p)} <- {t!r}" for p, t in (self.table or {}).items()),
            ]
        )


def _kind(dtype: Any) -> str:
    for kind in (np.bool_, np.integer, np.complexfloating, np.floating):
        if jax.dtypes.issubdtype(dtype, kind):
            return kind.__name__
    return str(dtype)


def _why_not(stored: Stored, planned: np.dtype) -> str | None:
    """Why the stored dtype cannot be read into ``planned``, or None."""
    for encoding in _registry.ENCODINGS:  # a virtual tensor (MXFP4's): its encoding says
        if encoding.virtual is not None and stored.dtype == encoding.virtual.dtype:
            return encoding.virtual.why_not(planned)
    if stored.dtype not in READABLE:
        return f"has dtype {stored.dtype}, which meshinit does not read; convert the file"
    have = _kind(READABLE[stored.dtype])
    if have != _kind(planned):
        return (
            f"is {stored.dtype}, planned {planned.name}: meshinit casts within a kind "
            f"(floats to floats, ints to ints), never across; plan the stored kind, or "
            f"convert the file"
        )
    return None


@dataclasses.dataclass(frozen=True)
class Survey:
    """What :func:`survey` found: the inventory, the reads, the checked files, every
    problem (bad files, a bad map, parts that do not fit) and, apart, the problems of
    paths whose tensors no file holds (``absent``), and the stored tensors that only
    such paths would read (``stranded``: tensor -> those paths), which are unused."""

    inventory: Inventory
    jobs: list[_host.Job]
    checked: dict[Source, _file.Checked]
    problems: list[Problem]
    absent: list[Problem]
    stranded: dict[str, list[str]]


def survey(plan: Plan, files: Any, names: Any, what: str, options: Any = None) -> Survey:
    """Every file checked, every plan path resolved to its parts (:class:`_Survey`)."""
    if not isinstance(plan, Plan):
        raise TypeError(f"{what} takes a Plan (meshinit.nnx.plan(factory), ...), got {plan!r}")
    if options is not None and not isinstance(options, Mapping):
        raise TypeError(f"storage_options must be a mapping or None, got {options!r}")
    listed = _file.listing(files, options)
    sources = listed.sources
    problems: list[Problem] = list(listed.problems)
    checked: dict[Source, _file.Checked] = {}
    for source in sources:
        c, found = _file.check(source)
        problems += found
        if c is not None:
            checked[source] = c
    problems += _file.read_index(listed, checked.values())
    bad_files = bool(problems)
    index: dict[str, Stored] = {}
    for c in checked.values():
        for name, held in c.tensors.items():
            if name in index:
                problems.append(
                    Problem(
                        str(held.file),
                        f"tensor {name!r} is also in {index[name].file}: one checkpoint's "
                        f"files hold each tensor once",
                    )
                )
            else:
                index[name] = held
    # the tensors encodings offer that no file stores as such (gpt-oss's X_blocks and
    # X_scales as the tensor X transformers makes of them)
    offers = [encoding.offer(index) for encoding in _registry.ENCODINGS]
    virtual = {name: held for offered in offers for name, held in offered.tensors.items()}
    tensors = {**index, **virtual}
    unformed = {name: why for offered in offers for name, why in offered.unpaired.items()}
    table: dict[str, _names.Target | None] | None = None
    # config.json, read once where something consults it (a framework's map, a float8 or
    # MXFP4 tensor planned wider): one that cannot be read is a problem of each, named once
    reader = functools.cache(functools.partial(_file.read_config, listed))
    if isinstance(names, _framework.FrameworkMap):  # the framework's map, built for these files
        config, where, found = reader()
        problems += found
        if not found:
            # a virtual tensor as its encoding says its values are (MXFP4's: bfloat16)
            shown = {e.virtual.dtype: e.virtual.seen_as for e in _registry.ENCODINGS if e.virtual}
            stored = {
                n: (h.shape, shown[h.dtype] if n in virtual else h.dtype)
                for n, h in tensors.items()
            }
            wanted = {e.path: (e.spec.shape, e.spec.dtype) for e in plan.entries}
            table, found = _framework.built(names, config, where, stored, wanted)
            problems += found
        # with a problem, nothing is resolved: its problems say what to fix first
        names = table = table if table and not found else {e.path: None for e in plan.entries}
    targets, found, notes = _names.targets([e.path for e in plan.entries], names, what)
    problems += found
    loaded: dict[str, _names.Target] = {}
    reads: dict[str, tuple[str, ...]] = {}
    skipped: list[str] = []
    missing: dict[str, str] = {}
    absent: list[Problem] = []
    names_held: list[str] = []  # sorted, for the hints of absent tensors
    jobs: list[_host.Job] = []
    for entry in plan.entries:
        target = targets[entry.path]
        if target is None:
            skipped.append(entry.path)
            continue
        # A typed key is read as its key data, and wrapped once placed (_keys).
        key = _keys.is_key(entry.spec.dtype)
        read_as = _keys.data_entry(entry) if key else entry
        try:
            if key:
                why_not = functools.partial(_keys.why_not, entry=entry)
            else:
                why_not = functools.partial(_why_not, planned=entry.spec.dtype)
            node = _layout.resolve(target, tensors, why_not, read_as.spec.shape, read_as.spec.dtype)
            if node.result != read_as.spec.shape:
                planned = _keys.described(entry) if key else str(entry.spec.shape)
                raise _layout.Refused(
                    f"{_describe(node)} gives shape {node.result}, planned {planned}"
                )
            if _layout.merging(node):
                cut = _layout.check(node, _blocks(read_as))
                if cut is not None:
                    raise _layout.Refused(cut)
        except _layout.Refused as refused:
            if refused.missing:
                missing[entry.path] = refused.missing[0][1]
                names_held = names_held or sorted(index)
                gone = _unformed(entry.path, refused.missing, unformed) or _absent(
                    entry.path, refused.missing, names_held, len(absent) < 20
                )
                absent.append(_names.linked(gone, notes))
            else:
                problems.append(Problem(entry.path, refused.message))
            continue
        loaded[entry.path] = target
        reads[entry.path] = tuple(dict.fromkeys(leaf.stored.name for leaf in _layout.leaves(node)))
        jobs.append(_host.Job(read_as, node))
    # each encoding pairs what it reads (a float8 weight planned wider: with its scale,
    # dequantized, never without), in the registry's order
    found, dequantized = [], {}
    for encoding, offered in zip(_registry.ENCODINGS, offers, strict=True):
        jobs, more, described = encoding.pair(jobs, index, offered, reader)
        found += more
        dequantized.update(described)
    seen = set(problems)
    problems += [p for p in dict.fromkeys(found) if p not in seen]  # the config's once
    # what a load reads none of: no path claims it, or only missing paths would
    scales = {name for encoding in _registry.ENCODINGS for name in encoding.claimed(jobs, index)}
    behind = {name: held for offered in offers for name, held in offered.behind.items()}
    unused, stranded = _unused.find(targets, missing, index, scales, behind)
    inventory = Inventory(
        files=tuple(source.shown for source in sources),
        loaded=loaded,
        skipped=tuple(skipped),
        missing={} if bad_files else missing,  # a file that failed holds unknown names
        unused=unused,
        reads=reads,
        table=table,
        dequantized=dequantized,
    )
    if bad_files:
        absent, stranded = [], {}
    return Survey(inventory, jobs, checked, problems, absent, stranded)


def _blocks(entry: Any) -> list[tuple[slice, ...]]:
    """Every distinct block of the entry's sharding, on any process (the plan divides
    each sharded dimension evenly), concrete or abstract mesh alike."""
    per_dim = [
        [slice(i, i + s) for i in range(0, n, s)] if s else [slice(0, 0)]
        for n, s in zip(entry.spec.shape, entry.shard_shape, strict=True)
    ]
    return list(itertools.product(*per_dim))


def _describe(node: _layout.Node) -> str:
    """How a shape message names what was read: the tensor, or the joined parts."""
    if isinstance(node, _layout.Leaf):
        held = node.stored
        where = f"in {held.file.name}, stored {held.dtype} {held.shape},"
        return f"tensor {printable(held.name)!r} {where}"
    return _layout.describe(node)


def _unformed(
    path: str, parts: list[tuple[str, str]], unformed: Mapping[str, str]
) -> Problem | None:
    """The problem of a path whose missing tensors an encoding would make of stored
    ones that form no pair (MXFP4's ``X`` of ``X_blocks`` and ``X_scales``): why, for
    the first three; None where none of them is such a tensor."""
    told = [(label, name) for label, name in parts if name in unformed]
    if not told:
        return None
    shown = [
        f"{label}tensor {printable(name)!r} is not in the files, and {unformed[name]}"
        for label, name in told[:3]
    ]
    more = len(parts) - len(shown)
    rest = f" ({more} more of its tensors are not in the files either)" if more else ""
    return Problem(path, " | ".join(shown) + rest)


def _absent(path: str, parts: list[tuple[str, str]], stored: list[str], hint: bool) -> Problem:
    """The problem of a path whose tensor (or some of its parts' tensors) no file holds;
    with ``hint``, the closest stored name of each of the first three."""
    fix = '(names= maps the path to None, or missing="skip" leaves it to the init)'
    guesses = [
        closest(name, stored) if hint and k < 3 else None for k, (_, name) in enumerate(parts)
    ]
    if len(parts) == 1 and not parts[0][0]:
        guess = f"; did you mean {guesses[0]!r}?" if guesses[0] else ""
        return Problem(path, f"tensor {parts[0][1]!r} is not in the files{guess} {fix}")
    shown = [
        f"{label}tensor {name!r}" + (f" (did you mean {close!r}?)" if close else "")
        for (label, name), close in zip(parts, guesses, strict=True)
    ]
    more = f" and {len(parts) - 5} more" if len(parts) > 5 else ""
    verb = "is" if len(parts) == 1 else "are"
    return Problem(path, f"{', '.join(shown[:5])}{more} {verb} not in the files {fix}")
