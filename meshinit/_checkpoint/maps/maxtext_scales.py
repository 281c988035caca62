"""MaxText's float8 models kept quantized (qwen3.5-FP8: a ``kernel`` and its
``kernel_scale``): each scale that MaxText's map reads from a ``weight_scale_inv``,
checked against its kernel before a byte is read.

MaxText sizes a ``kernel_scale`` from its kernel: each dimension divided by
``weight_block_size`` and rounded down, one under the block kept whole (its
``linears.py`` and ``moe.py``); its dequantization gives kernel element ``x`` the scale
at ``x // (kernel / scale)`` on each axis. The files' ``weight_scale_inv`` has one
scale per ``b0 x b1`` block of the weight, rounded up. Where a dimension is not a
multiple of the block the two disagree: MaxText's hook then fails or makes another
shape, or, where the shapes fit by chance, gives kernel elements another block's
scale. :func:`problems` names each such scale (its path, both shapes, why, the fix).
MaxText's own hooks run here on block numbers (``np.arange``), never on data.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..encodings import config as _quant_config

SCALE_INV = "_scale_inv"


def problems(
    mapping: Mapping[Any, Any],
    hooks: Mapping[Any, Any],
    planned: Mapping[str, tuple[int, ...]],
    tensors: Mapping[str, tuple[tuple[int, ...], str]],
    files: Mapping[str, Any],
    config: Any,
    tensor_handling: Any,
) -> tuple[dict[str, str], str | None]:
    """MaxText key -> why its scale cannot be read kept quantized, for every key of
    ``mapping`` that reads ``weight_scale_inv`` tensors; and, where config.json's
    ``quantization_config`` gives another block than MaxText's ``weight_block_size``,
    that, or what is wrong with its kind (the whole map is then refused). ``planned``
    is MaxText key -> planned shape, ``tensors`` the stored ones, ``files`` the
    checkpoint's config (a dict)."""
    ours = _block(getattr(config, "weight_block_size", None))
    scaled = [
        (key, sources, names)
        for key, sources in mapping.items()
        if not isinstance(key, tuple) and key in planned
        for names in [_names(_first(sources))]
        if names and all(isinstance(n, str) and n.endswith(SCALE_INV) for n in names)
    ]
    if ours is None or not scaled:  # per-tensor scales (no blocks), or no scale read
        return {}, None
    said, wrong = _quant_config.declared(files, "config.json")
    if wrong:  # a quantization_config of the wrong kind: its block size is not guessed
        return {}, "; ".join(p.message for p in wrong)
    given = said.block
    theirs = given or ours
    declared = (
        f"config.json's weight_block_size {list(theirs)}"
        if given
        else f"MaxText's weight_block_size {ours[0]} (config.json declares none)"
    )
    if theirs != ours:
        return {}, (
            f"config.json's quantization_config says weight_block_size={list(theirs)}, "
            f"MaxText's config weight_block_size={config.weight_block_size}: "
            f"MaxText would size and split these files' scales for blocks of {ours[0]}; "
            f"configure MaxText with weight_block_size: {theirs[0]}"
        )
    out: dict[str, str] = {}
    memo: dict[Any, Any] = {}  # layers and experts of one shape: compared once
    for key, sources, names in scaled:
        kernel = _kernel_key(key)
        weights = tuple(n[: -len(SCALE_INV)] for n in names)
        if kernel not in planned or any(n not in tensors for n in names + weights):
            continue  # a tensor the files lack: named as absent where it is read
        scale_slice = _sliced(key, sources, planned[key], config, tensor_handling)
        kernel_slice = _sliced(
            kernel, mapping.get(kernel), planned[kernel], config, tensor_handling
        )
        depth = tensor_handling.nesting_depth(sources) if isinstance(sources, list) else 0
        per = ["", " of each " + ("layer" if config.scan_layers else "expert")][min(depth, 1)]
        per = " of each expert and layer" if depth > 1 else per
        why = _checked(
            names, weights, hooks.get(key), hooks.get(kernel), scale_slice, kernel_slice,
            tensors, theirs, per, memo, declared,
        )  # fmt: skip
        if why is not None:
            out[key] = why
    return out, None


def _checked(
    names: tuple[str, ...],
    weights: tuple[str, ...],
    scale_hook: Any,
    kernel_hook: Any,
    scale_slice: tuple[int, ...],
    kernel_slice: tuple[int, ...],
    tensors: Mapping[str, tuple[tuple[int, ...], str]],
    block: tuple[int, int],
    per: str,
    memo: dict[Any, Any],
    declared: str,
) -> str | None:
    """Why MaxText's scale of shape ``scale_slice`` (``per`` layer or expert, where
    stacked) cannot hold the files' ``names``, or None; the element-wise comparison
    is kept in ``memo`` for the next layer or expert of the same shapes."""
    b0, b1 = block
    shapes = [tuple(tensors[n][0]) for n in names]
    # block numbers as small as they fit: the kernel's copy of them is the largest array
    kind = np.int16 if sum(math.prod(s) for s in shapes) < 2**15 else np.int32
    ids, start = [], 0
    for name, weight, shape in zip(names, weights, shapes, strict=True):
        w = tuple(tensors[weight][0])
        covering = (-(-w[0] // b0), -(-w[1] // b1)) if len(w) == 2 else None
        if shape != covering:
            return (
                f"the files' {name!r} is {shape}, but one scale per {b0}x{b1} block of its "
                f"weight {w} is {covering}: the files are quantized in other blocks than "
                f"{declared}; give config.json's quantization_config the files' "
                f"weight_block_size, and MaxText's config the same"
            )
        ids.append(np.arange(start, start + math.prod(shape), dtype=kind).reshape(shape))
        start += math.prod(shape)
    shown = names[0] if len(names) == 1 else names
    made, failed = _hooked(scale_hook, ids, scale_slice)
    if made is None or made.shape != scale_slice:
        how = f"cannot make it ({failed})" if made is None else f"makes {made.shape} of it"
        return (
            f"MaxText holds this scale as {scale_slice}{per}: its kernel {kernel_slice} in "
            f"blocks of {b0}, each dimension divided by {b0} and rounded down, one under "
            f"{b0} kept whole; the files' {shown!r} has one scale per {b0}x{b1} block of "
            f"its weight, rounded up ({', '.join(str(tuple(i.shape)) for i in ids)}), and "
            f"MaxText's hook {_name(scale_hook)} {how}. The two sizes disagree where a "
            f"dimension is not a multiple of the block (MaxText's own to_maxtext refuses "
            f"these files too); load these files into a model whose quantized dimensions "
            f"are multiples of {b0}, or with a weight_block_size that divides them"
        )
    signature = (
        id(scale_hook), id(kernel_hook), scale_slice, kernel_slice,
        tuple(i.shape for i in ids), tuple(tuple(tensors[w][0]) for w in weights),
    )  # fmt: skip
    if signature not in memo:
        memo[signature] = _compared(ids, weights, made, kernel_hook, kernel_slice, tensors, block)
    found = memo[signature]
    if found is None:
        return None
    if found == "indivisible":
        return (
            f"MaxText's dequantization needs each kernel dimension {kernel_slice} a "
            f"multiple of the scale's {scale_slice}{per}; load these files into a model "
            f"whose quantized dimensions are multiples of {b0}"
        )
    x, given, wanted, count = found
    return (
        f"MaxText's dequantization would give kernel element {x}{per} the scale of "
        f"block {_where(given, ids, names)}, but its weight lies in block "
        f"{_where(wanted, ids, names)} ({count} of {math.prod(kernel_slice)} elements): "
        f"the scale {scale_slice} and the files' blocks of {b0}x{b1} fit by size only. "
        f"Load these files into a model whose quantized dimensions are multiples of {b0}"
    )


def _compared(
    ids: list[np.ndarray],
    weights: tuple[str, ...],
    made: np.ndarray,
    kernel_hook: Any,
    kernel_slice: tuple[int, ...],
    tensors: Mapping[str, tuple[tuple[int, ...], str]],
    block: tuple[int, int],
) -> Any:
    """None where MaxText's scale ``made`` (block numbers) gives every kernel element
    the scale of the block its weight lies in; else ``"indivisible"`` or the first
    element that it does not, the block it is given, its own, and how many differ."""
    b0, b1 = block
    blocks = []  # the block each weight element lies in, moved as MaxText moves the kernel
    for i, weight in zip(ids, weights, strict=True):
        rows, cols = tensors[weight][0]
        blocks.append(i[(np.arange(rows) // b0)[:, None], (np.arange(cols) // b1)[None, :]])
    wanted, _ = _hooked(kernel_hook, blocks, kernel_slice)
    if wanted is None or wanted.shape != kernel_slice:
        return None  # the kernel's own path says what is wrong with it
    if any(k % s for k, s in zip(kernel_slice, made.shape, strict=True)):
        return "indivisible"
    # each kernel axis as (scale cell, position in it), against the cell's scale
    cells = tuple(d for k, s in zip(kernel_slice, made.shape, strict=True) for d in (s, k // s))
    wrong = wanted.reshape(cells) != made.reshape(tuple(d for s in made.shape for d in (s, 1)))
    count = int(np.count_nonzero(wrong))
    if not count:
        return None
    at = np.unravel_index(int(np.argmax(wrong)), cells)  # the first, in (cell, position)s
    x = tuple(int(at[2 * a] * cells[2 * a + 1] + at[2 * a + 1]) for a in range(len(kernel_slice)))
    return x, int(made[tuple(int(c) for c in at[::2])]), int(wanted[x]), count


def _hooked(hook: Any, ids: list[np.ndarray], shape: tuple[int, ...]) -> tuple[Any, str]:
    """MaxText's hook (or list of them) run on ``ids``, as its ``apply_hook_fns`` runs
    it: the result (None where it raises) and what it raised."""
    x: Any = tuple(ids) if len(ids) > 1 else ids[0]
    try:
        for h in hook if isinstance(hook, list) else [hook]:
            if h is not None:
                x = h(x, shape)
        return np.asarray(x), ""
    except Exception as e:  # noqa: BLE001 - MaxText's hook refuses the shapes: named
        return None, f"{type(e).__name__}: {str(e)[:160]}"


def _where(block: int, ids: list[np.ndarray], names: tuple[str, ...]) -> str:
    """A block number of :func:`_checked`'s ``ids`` as the files name it."""
    for i, name in zip(ids, names, strict=True):
        found = np.argwhere(i == block)
        if len(found):
            return f"{tuple(int(v) for v in found[0])} of {name!r}"
    return str(block)


def _block(raw: Any) -> tuple[int, int] | None:
    """``weight_block_size`` (an int, a list of one or two, or None) as (b0, b1)."""
    if raw is None:
        return None
    if isinstance(raw, list | tuple):
        if not raw:
            return None
        return (int(raw[0]), int(raw[1] if len(raw) > 1 else raw[0]))
    return (int(raw), int(raw))


def _first(sources: Any) -> Any:
    while isinstance(sources, list):
        sources = sources[0] if sources else None
    return sources


def _names(first: Any) -> tuple[Any, ...]:
    if first is None:
        return ()
    return tuple(first) if isinstance(first, tuple) else (first,)


def _kernel_key(key: str) -> str:
    """The MaxText key of the kernel a scale key scales (``...-kernel_scale`` of
    ``...-kernel``, the routed experts' ``...-wi_0_scale`` of ``...-wi_0``)."""
    return key.removesuffix("_scale")


def _sliced(
    key: str, sources: Any, shape: tuple[int, ...], config: Any, tensor_handling: Any
) -> tuple[int, ...]:
    """The shape one of MaxText's lists of HF keys gives of ``shape``: less the axes
    it stacks, as :class:`meshinit.maxtext`'s stacking (and MaxText's) removes them."""
    if not isinstance(sources, list):
        return tuple(shape)
    depth = tensor_handling.nesting_depth(sources)
    if depth == 1:
        psa = config.param_scan_axis
        axis = psa if config.scan_layers and len(shape) > psa else 0
        return tuple(shape[:axis]) + tuple(shape[axis + 1 :])
    axes = tuple(tensor_handling.stacked_axes(key, config, depth))
    return tuple(tensor_handling.slice_shape(tuple(shape), axes))


def _name(hook: Any) -> str:
    hooks = hook if isinstance(hook, list) else [hook]
    return ", ".join(getattr(h, "__name__", repr(h)) for h in hooks if h) or "(none)"
