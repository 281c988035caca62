"""What one stored tensor of an export is made of: the parameters it reads and the
traced function that makes it from them on the devices (:class:`Recipe`).

``names=`` read in reverse (:mod:`.reverse`) gives recipes, and so does a framework's
saving hooks (``meshinit.maxtext.names``). The driver (:mod:`.save`) compiles one
program per :meth:`Recipe.signature`: recipes that differ only in their dynamic
indices (the layer of a scanned parameter) share it, so the compiles do not grow with
the depth of the model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

Build = Callable[[tuple[jax.Array, ...], tuple[Any, ...]], jax.Array]
"""A recipe's traced function; its value also hashable, compared by value."""


@dataclasses.dataclass(frozen=True)
class Recipe:
    """One stored tensor of an export.

    Attributes:
      name: its name in the files (``model.layers.0.mlp.up_proj.weight``).
      shape: its stored shape.
      dtype: its stored dtype before ``dtype=`` and ``quantize=`` (numpy's, bfloat16
        through ml_dtypes).
      paths: the parameters it reads, by plan path, in the order ``build`` takes them.
      at: its dynamic indices (``(layer,)`` of a scanned parameter), passed to
        ``build`` as int32 scalars at run time: not part of the program.
      build: ``build(arrays, at) -> jax.Array`` of ``shape``, traced under ``jax.jit``:
        ``arrays`` the parameters of ``paths`` (the whole arrays), ``at`` the indices.
        Hashable and compared by value: equal builds of equal inputs share a program.
      origin: how messages name what it was made from (``"layers.up.kernel[3]"``).
    """

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    paths: tuple[str, ...]
    at: tuple[int, ...]
    build: Build
    origin: str = ""

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
