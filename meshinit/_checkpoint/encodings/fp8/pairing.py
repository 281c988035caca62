"""Quantized checkpoints: float8 weights paired with their block scales, before a byte
of data is read.

DeepSeek-V3/R1, Kimi K2 and the Qwen3 FP8 releases store their weights as float8 with
a ``<name>_scale_inv`` (float32, or bfloat16) per block beside each, and say so in
``config.json`` (``quantization_config: {quant_method: "fp8", weight_block_size:
[128, 128]}``). Such a weight planned as a wider float is read dequantized
(:mod:`.decode`): :func:`paired` pairs it with its scale and checks the pair, the
block size (the config's ``weight_block_size``, else 128x128) and the scale's shape
``(ceil(R / b0), ceil(C / b1))``. Cast without its scale, every value would be off by
the scale's factor (about 1000x): a float8 tensor planned wider with no scale is
refused, whatever the config says (a config is no proof: a truncated one, or one a
conversion left behind), unless its :class:`~.parts.Tensor` asks for a plain cast
(``dequantize=False``, which leaves a scale beside it unread); planned as float8
(kept quantized), it is read as stored. The config is read (:mod:`..config`) only
where a float8 tensor is planned wider, and one that cannot be read, or whose
``quantization_config`` is of the wrong kind, is a problem: its block size is never
guessed past it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from ...._errors import Problem, printable
from ...._format import some
from ...layout import blocks as _blocks
from ...layout import host as _host
from ...store.header import READABLE
from ...store.source import Stored
from .. import base as _base
from .. import config as _quant_config
from . import decode as _dequant
from . import geometry as _geometry
from . import joins as _dequant_concat
from . import tiles as _dequant_tiles

SCALES = ("_scale_inv", "_scale")
"""The names a float8 weight's scale is published under, after the weight's own name:
``weight_scale_inv`` (DeepSeek, Kimi, Qwen3 FP8: the value is multiplied, and read
dequantized), and ``weight_scale`` (compressed-tensors' and FBGEMM's FP8: refused)."""

_FLOAT8 = {name for name, dtype in READABLE.items() if name.startswith("F8_")} - {"F8_E8M0"}
"""Stored float8 dtypes of quantized values (E8M0 is a scale's format: exponents only)."""

_SCALE_DTYPES = ("F32", "BF16")
DEFAULT_BLOCK = (128, 128)


@dataclasses.dataclass(frozen=True)
class Quant:
    """How a float8 weight is dequantized: by ``scale``, one per ``block``."""

    scale: Stored
    block: tuple[int, int]


def paired(
    jobs: Sequence[Any],
    stored: Mapping[str, Stored],
    config: Callable[[], tuple[dict[str, Any] | None, str, list[Problem]]],
) -> tuple[list[Any], list[Problem], dict[str, str]]:
    """``jobs`` (``.entry``, ``.node``) with every float8 weight that a job plans as a
    wider float paired with its scale (read dequantized), the problems of those that
    cannot be, and plan path -> what it is dequantized with (the inventory's). The
    checkpoint's ``config()`` is read only if some float8 tensor is planned wider and
    read dequantized: its problems (unreadable, not JSON, a ``quantization_config`` of
    the wrong kind) are then the first problems, and no weight is paired past them (the
    block size would be a guess); a weight without a scale is refused all the same.
    A float8 tensor read through ``Tensor(name, dequantize=False)`` is a plain cast.
    Repeated layers are one problem."""
    rows = []  # (path, tensor, why (a key), file), collapsed over layers
    problems: list[Problem] = []
    out, dequantized = [], {}
    read: list[Any] = []  # [Declared, the config's problems], once read
    for job in jobs:
        planned = np.dtype(job.entry.spec.dtype)
        leaves = _blocks.leaves(job.node)
        held = list(dict.fromkeys(leaf.stored for leaf in leaves))
        asked = {leaf.stored.name for leaf in leaves if leaf.tensor.dequantize}
        float8 = [h for h in held if h.dtype in _FLOAT8 and h.name in asked]
        if not _float(planned) or _is_float8(planned) or not float8:
            out.append(job)  # a plain cast (dequantize=False), or nothing float8
            continue
        if not read:
            settings, where, found = config()
            declared, wrong = _quant_config.declared(settings, where)
            read[:] = [declared, found + wrong]
        declared, unreadable = read
        quants, bad = {}, False
        for weight in float8:
            why, quant = _pair(weight, stored, declared.block)
            if why is not None and not (unreadable and why[0] == "shape"):
                rows.append(
                    (job.entry.path, weight.name, (*why, planned.name), str(weight.file.name))
                )
            elif quant is not None and not unreadable:
                quants[weight.name] = quant
            # else: a block size the config would give: its problems say what to fix first
            bad = bad or quant is None or bool(unreadable)
        if bad or not quants:
            out.append(job)
            continue
        try:
            if len(quants) != len(held):
                others = [printable(h.name) for h in held if h.name not in quants]
                raise _blocks.Refused(
                    f"it reads float8 weights with scales and other tensors "
                    f"({some([repr(n) for n in others], 3)}) together: a dequantized "
                    f"parameter reads only paired float8 weights; plan them apart"
                )
            node = _attached(job.node, quants)
        except _blocks.Refused as refused:
            problems.append(Problem(job.entry.path, refused.message))
            out.append(job)
            continue
        out.append(dataclasses.replace(job, node=node, parts=parts_of(node)))
        dequantized[job.entry.path] = _described(held, quants, planned)
    if not read:
        return out, problems, dequantized
    return out, read[1] + _refusals(rows, read[0]) + problems, dequantized


def scales(jobs: Sequence[Any], stored: Mapping[str, Stored]) -> set[str]:
    """The scale tensors beside the float8 weights that ``jobs`` plan as a wider float
    and read dequantized: read with them, or named by their refusal; never reported
    unused as well. A scale beside a weight read as a plain cast (``dequantize=False``)
    is not read: it is unused unless a plan path claims it."""
    out = set()
    for job in jobs:
        planned = np.dtype(job.entry.spec.dtype)
        if not _float(planned) or _is_float8(planned):
            continue
        for leaf in _blocks.leaves(job.node):
            scale = leaf.stored.name + SCALES[0]
            if leaf.stored.dtype in _FLOAT8 and leaf.tensor.dequantize and scale in stored:
                out.add(scale)
    return out


def paired_scales(tensors: Mapping[str, tuple[Any, str]]) -> set[str]:
    """The names of ``tensors`` (name -> (shape, dtype)) that are a stored float8
    weight's block scale: the loader's, read with the weight, not a map's to place."""
    return {
        name + SCALES[0]
        for name, (_, dtype) in tensors.items()
        if dtype in _FLOAT8 and name + SCALES[0] in tensors
    }


def _pair(
    weight: Stored,
    stored: Mapping[str, Stored],
    configured: tuple[int, int] | None,
) -> tuple[tuple[Any, ...] | None, Quant | None]:
    """The weight's :class:`Quant`, or why not (a hashable key of the refusal)."""
    scale = stored.get(weight.name + SCALES[0])
    if scale is None:
        if weight.name + SCALES[1] in stored:
            return ("other", SCALES[1]), None
        return ("missing",), None
    if scale.dtype not in _SCALE_DTYPES:
        return ("dtype", scale.dtype), None
    if len(weight.shape) != 2:
        return ("rank", weight.shape), None
    block = configured or DEFAULT_BLOCK
    rows, cols = weight.shape
    want = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale.shape) != want:
        fits = _fitting(weight.shape, scale.shape)
        return ("shape", weight.shape, scale.shape, block, configured is not None, fits), None
    return None, Quant(scale, block)


def _fitting(shape: tuple[int, ...], scale: tuple[int, ...]) -> tuple[int, int] | None:
    """A power-of-two block (16 to 1024) for which ``scale`` covers ``shape``, or None."""
    if len(scale) != 2:
        return None
    sizes = [1 << k for k in range(4, 11)]
    found = [
        next((b for b in sizes if -(-n // b) == s), None) for n, s in zip(shape, scale, strict=True)
    ]
    return None if None in found else (found[0], found[1])  # type: ignore[return-value]


def _attached(node: _blocks.Node, quants: Mapping[str, Quant]) -> _blocks.Node:
    """``node`` with each leaf's :class:`Quant`; :class:`~.blocks.Refused` where it is
    not dequantized through it: an out_shape (merged axes) inside a join or pad, a
    scale= or offset=, a view that mixes rows and columns, parts whose views step
    differently or whose stored dtypes differ. A weight, or a Stack of equal ones, is read by
    :class:`~.dequant.QuantParts`; a Concat, a Pad, a Fill, a permute, a merge or
    unequal Stack parts by :class:`~.joins.TileParts`."""
    made = _each(node, quants)
    if _uniform(made):
        return made
    leaves = _blocks.leaves(made)
    what = f"{made.label}{_kind(made)} of float8 weights read dequantized"
    dtypes = sorted({leaf.stored.dtype for leaf in leaves})
    works = {leaf.tensor.compute_dtype for leaf in leaves}
    why = _dequant_tiles.steps(_dequant_tiles.unmerged(made)[0])
    if len(dtypes) > 1:
        why = f"its weights are stored as {' and '.join(dtypes)}"
    elif len(works) > 1:
        why = "its parts set different compute dtypes"
    if isinstance(why, str):
        raise _blocks.Refused(f"{what}: {why}; {_FIX}")
    return made


def parts_of(node: _blocks.Node) -> type:
    """The :class:`~.read.Parts` that read a dequantized ``node`` (:func:`_attached`'s)."""
    return _dequant.QuantParts if _uniform(node) else _dequant_concat.TileParts


def _kind(node: _blocks.Node) -> str:
    if isinstance(node, _blocks.Joined):
        return node.kind
    return "a Pad" if isinstance(node, _blocks.Padded) else "a part"


def _each(node: _blocks.Node, quants: Mapping[str, Quant], root: bool = True) -> _blocks.Node:
    """``node`` with each leaf's :class:`Quant`, or why a part refuses it: a merge
    (``out_shape``) is dequantized where it merges the whole parameter's axes only."""
    if isinstance(node, _blocks.Leaf):
        held, tensor = node.stored, node.tensor
        if not tensor.dequantize:  # the same stored tensor read dequantized elsewhere
            raise _blocks.Refused(
                f"{node.label}tensor {printable(held.name)!r} is read as a plain cast "
                f"(dequantize=False) where other parts read it dequantized: one parameter "
                f"reads its float8 weights one way; give every part the same dequantize="
            )
        what = f"{node.label}tensor {printable(held.name)!r} (float8, dequantized)"
        found = _geometry.geometry(node)
        why = None
        if node.groups is not None and not root:
            why = f"out_shape={tensor.out_shape} inside a Stack, Concat or Pad"
        elif tensor.scale is not None or tensor.offset is not None:
            why = "a scale= or offset="
        elif isinstance(found, str):
            why = f"this view: {found}"
        if why is not None:
            raise _blocks.Refused(f"{what} is not read dequantized through {why} yet; {_FIX}")
        return dataclasses.replace(node, quant=quants[held.name])
    if isinstance(node, _blocks.Const):
        return node
    if isinstance(node, _blocks.Padded):
        return dataclasses.replace(node, part=_each(node.part, quants, False))
    if node.groups is not None and not root:
        raise _blocks.Refused(
            f"{node.label}{node.kind} with out_shape= inside a Stack, Concat or Pad over "
            f"float8 weights read dequantized is not supported yet; {_FIX}"
        )
    return dataclasses.replace(node, parts=tuple(_each(p, quants, False) for p in node.parts))


def _uniform(node: _blocks.Node) -> bool:
    """Whether ``node`` is a weight, or a Stack of equal ones (:mod:`.decode`'s)."""
    if isinstance(node, _blocks.Leaf):
        return node.groups is None
    if not isinstance(node, _blocks.Joined) or not node.stacked or node.order is not None:
        return False
    if node.groups is not None:
        return False
    return all(_uniform(p) for p in node.parts) and len({_key(p) for p in node.parts}) == 1


_FIX = (
    "plan the parameter as float8 to load the stored values (and its scale as a "
    "parameter of its own), or convert the checkpoint to the planned dtype first"
)


def _key(node: _blocks.Node) -> Any:
    """What a Stack's parts must share to be dequantized as one block."""
    if isinstance(node, _blocks.Leaf):
        q = node.quant
        held = node.stored
        index = tuple((s.start, s.stop, s.step) for s in node.index)  # hashable before 3.12
        views = (held.dtype, held.shape, index, node.shape, node.order)
        return (*views, q.block, q.scale.shape, q.scale.dtype, node.tensor.compute_dtype)
    assert isinstance(node, _blocks.Joined)
    return (node.axis, len(node.parts), _key(node.parts[0]))


def _described(held: list[Stored], quants: Mapping[str, Quant], planned: np.dtype) -> str:
    first = quants[held[0].name]
    more = f" and {len(held) - 1} more" if len(held) > 1 else ""
    b0, b1 = first.block
    return (
        f"{held[0].dtype} x {printable(first.scale.name)!r}{more} ({first.scale.dtype}, "
        f"{b0}x{b1} blocks) -> {planned.name}"
    )


def _refusals(rows: list[tuple[str, str, Any, str]], declared: Any) -> list[Problem]:
    where, shown = declared.where, declared.shown
    said = "" if shown is None else f"; {where} says {declared.field} {shown}"
    out = []
    for path, tensor, key, files in _base.collapsed(rows):
        kind, planned = key[0], key[-1]
        name = f"tensor {printable(tensor)!r} in {files}"
        if kind == "missing":
            why = (
                f"{name} is float8, planned {planned}, with no scale beside it "
                f"({printable(tensor + SCALES[0])!r} is in no file){said}: cast without "
                f"its scale, a quantized weight has every value off by its block's scale, "
                f"and no config proves a weight unquantized; put the scale's file beside "
                f"it, plan the parameter as float8 to load the stored values, or convert "
                f"the checkpoint to {planned} first; where the float8 values are the "
                f"weights themselves, ask for a plain cast: "
                f"Tensor({printable(tensor)!r}, dequantize=False)"
            )
        elif kind == "other":
            why = (
                f"{name} is float8 with a {printable(tensor + key[1])!r} beside it, planned "
                f"{planned}: only DeepSeek-style block scales ('{SCALES[0]}') are read "
                f"dequantized; {_FIX}"
            )
        elif kind == "dtype":
            why = (
                f"{name} is float8, planned {planned}, and its scale "
                f"{printable(tensor + SCALES[0])!r} is {key[1]}: block scales are read from "
                f"F32 or BF16; {_FIX}"
            )
        elif kind == "rank":
            why = (
                f"{name} is float8 of shape {key[1]}, planned {planned}: block-scaled "
                f"weights are read dequantized where they are 2-D; {_FIX}"
            )
        else:
            _, shape, scale, block, from_config, fits = key[:6]
            want = tuple(-(-n // b) for n, b in zip(shape, block, strict=True))
            if from_config:
                source = f"{where}'s {declared.field}.weight_block_size"
            elif declared.settings is None:
                found = where or "config.json"
                source = f"the default, as no quantization_config is found in {found}"
            else:
                source = f"the default, as {where}'s {declared.field} has no weight_block_size"
            other = ""
            if fits is not None and from_config:
                other = (
                    f"; the shapes fit a block of {fits} instead: the config and the "
                    f"shapes disagree"
                )
            elif fits is not None:
                other = (
                    f"; the shapes fit a block of {fits}: state it as "
                    f"quantization_config.weight_block_size in config.json"
                )
            why = (
                f"{name} is float8 {shape}, planned {planned}, and its scale "
                f"{printable(tensor + SCALES[0])!r} has shape {scale}, not (ceil({shape[0]}/"
                f"{block[0]}), ceil({shape[1]}/{block[1]})) = {want} for the block {block} "
                f"({source}){other}; fix the scale or the block size"
            )
        out.append(Problem(path, why))
    return out


def _float(dtype: np.dtype) -> bool:
    return bool(jax.dtypes.issubdtype(dtype, np.floating))


def _is_float8(dtype: np.dtype) -> bool:
    return _float(dtype) and dtype.itemsize == 1


def _paired_jobs(
    jobs: list[_host.Job],
    stored: Mapping[str, Stored],
    offered: _base.Offered,
    config: _base.Config,
) -> _base.Paired:
    return paired(jobs, stored, config)  # a float8 weight is a stored tensor: none virtual


ENCODING = _base.Encoding(name="fp8", pair=_paired_jobs, claimed=scales)
"""float8 weights with block scales, as the registry lists them."""
