"""What a checkpoint's ``config.json`` says of its quantization, checked before it is
believed.

A quantized checkpoint says so in ``quantization_config``, at the top level or, for a
multimodal model, in a nested config (``text_config.quantization_config``):
``{quant_method: "fp8", weight_block_size: [128, 128]}`` (DeepSeek-V3, Qwen3-FP8),
``{quant_method: "mxfp4"}`` (gpt-oss). :mod:`.fp8.pairing` reads its block size,
:mod:`.mxfp4.pairing` its method, and MaxText's scale check (:mod:`...maps.maxtext_scales`) both.
:func:`declared` is the one reading of it for all three: a ``quantization_config``
that is not an object, a ``quant_method`` that is not a string, a
``weight_block_size`` that is not a positive whole number or a list of one or two of
them (``64.0`` is 64: some JSON writers write whole numbers so), is a problem naming
the file, the field and what is wrong with it, never a field read as absent (the block size
silently the default, the method silently none); so is a ``quantization_config`` at
the top level and one nested that state different block sizes: neither is picked.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from ..._errors import Problem

FIELD = "quantization_config"
_EXAMPLE = '{"quant_method": "fp8", "weight_block_size": [128, 128]}'


@dataclasses.dataclass(frozen=True)
class Declared:
    """The first non-empty ``quantization_config`` of a config (the top level's, else
    a nested config's), where it was found, and what it says.

    Attributes:
      where: the config.json's path or URL ("" where there is none).
      field: the field it was found in (``"text_config.quantization_config"``), or
        "" where the config states none.
      settings: its contents, or None where the config states none.
    """

    where: str = ""
    field: str = ""
    settings: Mapping[str, Any] | None = None

    @property
    def method(self) -> str | None:
        """Its ``quant_method``, or None."""
        method = (self.settings or {}).get("quant_method")
        return method if isinstance(method, str) else None

    @property
    def block(self) -> tuple[int, int] | None:
        """Its ``weight_block_size`` as ``(b0, b1)`` (an int ``b``, or a list of one,
        as ``(b, b)``), or None where it states none."""
        sizes = _sizes((self.settings or {}).get("weight_block_size"))
        return None if isinstance(sizes, str) or not sizes else (sizes[0], sizes[-1])

    @property
    def shown(self) -> str | None:
        """It as JSON (at most 300 characters) for messages, or None."""
        if self.settings is None:
            return None
        return json.dumps(self.settings, sort_keys=True, default=str)[:300]


def declared(config: Mapping[str, Any] | None, where: str) -> tuple[Declared, list[Problem]]:
    """What ``config`` (a parsed config.json, or None) declares of its quantization,
    and a problem (at ``where``, the file) for each ``quantization_config`` field, and
    each of its ``quant_method`` and ``weight_block_size``, that is of the wrong kind."""
    if not isinstance(config, Mapping):
        return Declared(where), []
    parts = [("", config)]
    parts += [(f"{k}.", v) for k, v in config.items() if isinstance(v, Mapping)]
    found, problems = Declared(where), []
    for prefix, part in parts:
        settings = part.get(FIELD)
        if settings is None:
            continue
        field = prefix + FIELD
        if not isinstance(settings, Mapping):
            problems.append(
                Problem(
                    where,
                    f"{field} holds the JSON {_kind(settings)} {_short(settings)}, not an "
                    f"object: meshinit reads a checkpoint's quantization from its "
                    f"quant_method and weight_block_size; write it as an object "
                    f"({_EXAMPLE}), or remove it where the checkpoint is not quantized",
                )
            )
            continue
        method = settings.get("quant_method")
        if method is not None and not isinstance(method, str):
            problems.append(
                Problem(
                    where,
                    f"{field}.quant_method holds the JSON {_kind(method)} {_short(method)}, "
                    f'not a string: write it as the method\'s name ("fp8", "mxfp4")',
                )
            )
        size = settings.get("weight_block_size")
        wrong = None if size is None else _sizes(size)
        if isinstance(wrong, str):
            problems.append(
                Problem(
                    where,
                    f"{field}.weight_block_size holds the JSON {_kind(size)} {_short(size)}, "
                    f"not a block size ({wrong}): write it as a list of two positive "
                    f"integers, the rows and columns each scale covers ([128, 128]), or "
                    f"remove it for the default 128x128",
                )
            )
        if settings and found.settings is None:
            found = Declared(where, field, settings)
        elif settings and isinstance(wrong, tuple) and found.settings is not None:
            first = _sizes(found.settings.get("weight_block_size"))
            if isinstance(first, tuple) and _square(first) != _square(wrong):
                problems.append(
                    Problem(
                        where,
                        f"{found.field}.weight_block_size is {_stated(first)} and "
                        f"{field}.weight_block_size {_stated(wrong)}: meshinit reads the "
                        f"first, and never picks a block size between two; state one "
                        f"weight_block_size, the same in both, or remove one",
                    )
                )
    return found, problems


def _square(sizes: tuple[int, ...]) -> tuple[int, ...]:
    return sizes if len(sizes) != 1 else (sizes[0], sizes[0])


def _stated(sizes: tuple[int, ...]) -> str:
    return "absent" if not sizes else str(list(_square(sizes)))


def _sizes(raw: Any) -> tuple[int, ...] | str:
    """``raw`` as a block size: a positive whole number, or a list of one or two (a
    whole number written as a float, ``64.0``, as some JSON writers emit it, is that
    number); else what is wrong with it. None states none: ``()``."""
    if raw is None:
        return ()
    sizes = list(raw) if isinstance(raw, list | tuple) else [raw]
    if isinstance(raw, str | Mapping) or not 1 <= len(sizes) <= 2:
        return (
            f"a {_kind(raw)}" if not isinstance(raw, list | tuple)
            else f"{len(sizes)} numbers, where a block has one or two"
        )  # fmt: skip
    out = []
    for b in sizes:
        if isinstance(b, bool) or not isinstance(b, int | float):
            return f"{_short(b)} is a JSON {_kind(b)}, not a number"
        if not (b == b and abs(b) != float("inf")) or int(b) != b:
            return f"{_short(b)} is not a whole number"
        if b <= 0:
            return f"{_short(b)} is not positive"
        out.append(int(b))
    return tuple(out)


def _kind(value: Any) -> str:
    """The JSON name of a parsed value's kind."""
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list | tuple):
        return "array"
    return "object" if isinstance(value, Mapping) else type(value).__name__


def _short(value: Any) -> str:
    shown = json.dumps(value, default=str)
    return shown if len(shown) <= 80 else shown[:77] + "..."
