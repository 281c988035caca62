"""``names=`` built at load time by a framework's own checkpoint map.

MaxText and tunix each keep a map from Hugging Face names to their models' parameters
(``meshinit.maxtext.names``, ``meshinit.tunix.names``). Such a map depends on the
checkpoint: its ``config.json`` (the layer count, the experts, the vocabulary) and
its tensors' shapes. A :class:`FrameworkMap` is the ``names=`` value that stands for
one: :func:`meshinit.safetensors.load` and :func:`~meshinit.safetensors.inventory`
give it the checkpoint (:class:`Checkpoint`) once every file is checked and before a
byte of data is read, and it gives back the table (plan path -> target or None) the
load then reads as any ``names=`` Mapping. It never sees data: whatever the map asks
that a table cannot express is a problem, and a problem anywhere refuses the whole
map (it is never half-applied).
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..._errors import Problem
from ..layout.parts import Target
from ..layout.recipe import Recipe


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """What a :class:`FrameworkMap` is given to build its table from; no data.

    Attributes:
      config: the checkpoint's ``config.json`` (parsed), or None where its folder has
        none.
      where: where ``config.json`` was looked for (a path or URL), for messages.
      tensors: stored tensor name -> ``(shape, dtype)``, the dtype as the file names it
        (``"BF16"``, ``"F32"``), over every file of the checkpoint.
      planned: plan path -> ``(shape, dtype)`` of the parameter it plans.

    Examples:
      >>> given = meshinit.safetensors.Checkpoint(
      ...     {"num_hidden_layers": 2}, "ckpt/config.json",
      ...     {"blk.0.weight": ((16, 8), "F32")}, {"layers.0.w": ((8, 16), np.float32)})
      >>> given.config["num_hidden_layers"], given.tensors["blk.0.weight"][0]
      (2, (16, 8))
    """

    config: Mapping[str, Any] | None
    where: str
    tensors: Mapping[str, tuple[tuple[int, ...], str]]
    planned: Mapping[str, tuple[tuple[int, ...], np.dtype]]


class FrameworkMap(abc.ABC):
    """A ``names=`` value built from a framework's own checkpoint map at load time
    (``meshinit.maxtext.names(config)``, ``meshinit.tunix.names(model_config)``).

    A subclass says how messages name it (:attr:`family`) and builds the table
    (:meth:`table`) from the :class:`Checkpoint`; :func:`meshinit.safetensors.load`
    calls it once the files are checked, before reading.

    Examples:
      >>> class Layers(meshinit.safetensors.FrameworkMap):
      ...     family = "a toy map"
      ...     def table(self, checkpoint):
      ...         n = checkpoint.config["num_hidden_layers"]
      ...         return {f"layers.{i}.w": meshinit.safetensors.Tensor(
      ...             f"blk.{i}.weight", permute=(1, 0)) for i in range(n)}, []
      >>> table, problems = Layers().table(meshinit.safetensors.Checkpoint(
      ...     {"num_hidden_layers": 1}, "", {}, {}))
      >>> table["layers.0.w"].name, problems
      ('blk.0.weight', [])
    """

    needs_config: bool = True
    """Whether :meth:`table` needs the checkpoint's ``config.json``: a load whose
    files have none beside them is then refused, naming where it looked."""

    @property
    @abc.abstractmethod
    def family(self) -> str:
        """How messages name the map: ``"MaxText 0.2.5's map of qwen3-8b"``."""

    @abc.abstractmethod
    def table(self, checkpoint: Checkpoint) -> tuple[Mapping[str, Target | None], list[Problem]]:
        """Each plan path's target (None: not in the files by design), and every
        problem: a plan path the map does not know, a hook it cannot express, a
        ``config.json`` it cannot read. With any problem the table is not used."""

    def saving(
        self,
        planned: Mapping[str, tuple[tuple[int, ...], np.dtype]],
        config: Mapping[str, Any] | None,
    ) -> tuple[list[Recipe], list[Problem]] | None:
        """The stored tensors of an export (:func:`meshinit.safetensors.save`) made by
        the framework's own saving side, or the problems that refuse it; None (the
        default): the export reads :meth:`table` in reverse, with ``config`` as the
        checkpoint's config and no stored tensors known.

        Args:
          planned: plan path -> ``(shape, dtype)`` of each array given to the export.
          config: the export's ``config=`` as a dict, or None.
        """
        return None


class MissingKey(KeyError):
    """A key of ``config.json`` that a framework's map reads and the file lacks
    (raised by :class:`ConfigView`); its one argument is the key."""

    @property
    def key(self) -> Any:
        return self.args[0]


class ConfigView(dict):
    """A checkpoint's config as a framework's map reads it: a plain dict (nested
    dicts too), except that a key it lacks raises :class:`MissingKey`, which names it,
    rather than a ``KeyError`` that could come from anywhere in the map's code."""

    def __init__(self, data: Mapping[str, Any]):
        super().__init__({k: _viewed(v) for k, v in data.items()})

    def __missing__(self, key: Any) -> Any:
        raise MissingKey(key)


def _viewed(value: Any) -> Any:
    if isinstance(value, Mapping):
        return ConfigView(value)
    if isinstance(value, list):
        return [_viewed(v) for v in value]
    return value


def built(
    names: FrameworkMap,
    config: Mapping[str, Any] | None,
    where: str,
    tensors: Mapping[str, tuple[tuple[int, ...], str]],
    planned: Mapping[str, tuple[tuple[int, ...], np.dtype]],
) -> tuple[dict[str, Target | None], list[Problem]]:
    """``names``'s table for the checkpoint, every plan path in it (a path it leaves
    out is a problem, never a silent lookup under its own name), or its problems."""
    if names.needs_config and config is None:
        looked = f" (looked for {where})" if where else ""
        fix = "put the model's config.json beside its .safetensors files"
        return {}, [Problem(where or "files", f"{names.family} needs config.json{looked}; {fix}")]
    table, problems = names.table(Checkpoint(config, where, tensors, planned))
    if problems:
        return {}, list(problems)
    left = [p for p in planned if p not in table]
    problems = [Problem(p, f"{names.family} gives it no target (nor None)") for p in left]
    return ({} if problems else dict(table)), problems
