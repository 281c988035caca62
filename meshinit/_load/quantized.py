"""Quantized checkpoints that a load refuses, before a byte of data is read.

DeepSeek-V3/R1, Kimi K2 and the Qwen3 FP8 releases store their weights as float8 with
a float32 ``<name>_scale_inv`` per 128x128 block beside each, and say so in
``config.json`` (``quantization_config: {quant_method: "fp8", weight_block_size:
[128, 128]}``). Cast to a wider float without its scale, such a weight is off by the
scale's factor in nearly every element (about 1000x): silently wrong. Until quantized
checkpoints are read dequantized, a float8 tensor planned as another kind of float is
refused where a scale lies beside it or the checkpoint's config declares a
quantization; planned as float8 (kept quantized), it is read as stored.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from .._errors import Problem, printable
from .._format import index_ranges, some
from . import blocks as _blocks
from .header import READABLE
from .source import Stored

SCALES = ("_scale_inv", "_scale")
"""The names a float8 weight's scale is published under, after the weight's own name:
``weight_scale_inv`` (DeepSeek, Kimi, Qwen3 FP8: the value is multiplied), and
``weight_scale`` (compressed-tensors' and FBGEMM's FP8)."""

_FLOAT8 = {name for name, dtype in READABLE.items() if name.startswith("F8_")} - {"F8_E8M0"}
"""Stored float8 dtypes of quantized values (E8M0 is a scale's format: exponents only)."""


def problems(
    jobs: Sequence[Any],
    stored: Mapping[str, Stored],
    config: Callable[[], tuple[dict[str, Any] | None, str, list[Problem]]],
) -> list[Problem]:
    """The refusal of every float8 tensor that a job (``.entry``, ``.node``) would cast
    to a wider float without its scale: one with a scale beside it in ``stored``, or
    any where the checkpoint's ``config()`` (read only if some float8 tensor is planned
    wider) states a ``quantization_config``. Repeated layers are one problem."""
    found = []  # (path, tensor, scale suffix or None, planned dtype)
    for job in jobs:
        planned = np.dtype(job.entry.spec.dtype)
        if not _float(planned) or _is_float8(planned):
            continue
        for leaf in dict.fromkeys(leaf.stored for leaf in _blocks.leaves(job.node)):
            if leaf.dtype in _FLOAT8:
                scale = next((s for s in SCALES if leaf.name + s in stored), None)
                found.append((job.entry.path, leaf, scale, planned))
    if not found:
        return []
    settings, where, _ = config()  # an unreadable config.json: only the scales decide
    declared = _declared(settings)
    if declared is None:
        found = [f for f in found if f[2] is not None]
    said = "" if declared is None else f"; {where} says quantization_config {declared}"
    rows = [
        (
            path,
            leaf.name,
            (scale, leaf.dtype, planned.name),
            str(leaf.file.name),
        )
        for path, leaf, scale, planned in found
    ]
    out = []
    for path, tensor, (scale, dtype, planned), files in _collapsed(rows):
        if scale is not None:
            why = f"with its scale {printable(tensor + scale)!r} beside it"
        else:
            why = f"with no scale beside it ({printable(tensor + SCALES[0])!r} is in no file)"
        float8 = READABLE[dtype].name
        out.append(
            Problem(
                path,
                f"tensor {printable(tensor)!r} in {files} is {dtype}, {why}{said}, planned "
                f"{planned}: loading FP8 checkpoints dequantized is not supported yet, and "
                f"cast without its scale every value would be off by the scale's factor; "
                f"plan the parameter as {float8} to load the stored values as they are "
                f"(and its scale as a parameter of its own), or convert the checkpoint "
                f"to {planned} first",
            )
        )
    return out


def _float(dtype: np.dtype) -> bool:
    return bool(jax.dtypes.issubdtype(dtype, np.floating))


def _is_float8(dtype: np.dtype) -> bool:
    return _float(dtype) and dtype.itemsize == 1


def _declared(settings: dict[str, Any] | None) -> str | None:
    """The config's ``quantization_config`` (or a nested config's, as a multimodal
    model's ``text_config`` holds it) as JSON, or None where it states none."""
    if not isinstance(settings, dict):
        return None
    nested = [v for v in settings.values() if isinstance(v, dict)]
    for part in (settings, *nested):
        quantization = part.get("quantization_config")
        if quantization:
            return json.dumps(quantization, sort_keys=True, default=str)[:300]
    return None


_INT = re.compile(r"(?<![^.])(0|[1-9][0-9]*)(?![^.])")  # a dot-separated integer component


def _collapsed(
    rows: list[tuple[str, str, Any, str]],
) -> list[tuple[str, str, Any, str]]:
    """``(path, tensor, key, file)`` rows, those that differ only in the integer
    components of the path and the tensor's name (and the file) as one row each,
    ``layers.{0..60}.mlp.up``, where exactly the product of the integers shown is
    there; else each row as it is. Components that vary alike (the layer number of a
    path and of its tensor) vary together."""
    groups: dict[Any, list[tuple[str, str, Any, str]]] = {}
    for row in rows:
        path, tensor, key, _ = row
        groups.setdefault((_INT.sub("#", path), _INT.sub("#", tensor), key), []).append(row)
    out = []
    for (_, _, key), members in groups.items():
        points = [
            tuple(int(x) for x in (*_INT.findall(path), *_INT.findall(tensor)))
            for path, tensor, _, _ in members
        ]
        columns = list(zip(*points, strict=True)) if points[0] else []
        distinct = list(dict.fromkeys(columns))
        product = 1
        for column in distinct:
            product *= len(set(column))
        files = list(dict.fromkeys(f for *_, f in members))
        if len(members) == 1 or product != len(set(points)) or len(set(points)) != len(points):
            out += [(p, t, k, f) for p, t, k, f in members]
            continue
        shown = [index_ranges(set(column)) for column in columns]
        path, tensor = _filled(members[0][0], shown), _filled(members[0][1], shown)
        where = files[0] if len(files) == 1 else f"{len(files)} files ({some(files, 2)})"
        out.append((path, tensor, key, where))
    return out


def _filled(name: str, shown: list[str]) -> str:
    """``name`` with its integer components replaced by the next of ``shown`` (taken)."""
    parts = _INT.split(name)
    for k in range(1, len(parts), 2):
        parts[k] = shown.pop(0)
    return "".join(parts)
