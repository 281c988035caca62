"""A threefry2x32 key implementation whose hash XLA can fuse, for CPU programs.

On CPU, jax lowers the Threefry-2x32 hash as a rolled loop of 5 steps of 4 rounds (a
while loop in the compiled program), which keeps the program small. Each step writes
the whole counter array back to memory, and nothing fuses across the loop: the hash,
the conversion to floats and the initializer's arithmetic run as separate passes over
the parameter. On GPU and TPU, jax emits the 20 rounds straight-line.

:data:`STRAIGHT_LINE` is jax's own threefry2x32 implementation (its key data, seed,
``split``, ``fold_in`` and ``random_bits``, so the same counters and the same bits)
with one change: each hash inside them is emitted straight-line, by
:func:`threefry2x32`. XLA then fuses counters, hash and arithmetic into one loop per
parameter. On the 32-layer CPU reference this made both the compile and the run of
meshinit's programs faster (see benchmarks/README.md).

meshinit uses it for the programs it compiles for CPU meshes; its keys never leave
them. Values are those of jax's threefry2x32 keys, bit for bit, which the tests check
against jax's own hash and initializers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.random import define_prng_impl, threefry2x32_p, threefry_prng_impl

from . import _jaxpr
from ._paths import threefry_rounds


def threefry2x32(k1: Any, k2: Any, x1: Any, x2: Any) -> tuple[jax.Array, jax.Array]:
    """The Threefry-2x32 hash with 20 rounds, as straight-line elementwise uint32 ops.

    Computes what jax's ``threefry2x32`` primitive computes: the key ``(k1, k2)``
    hashes the counters ``(x1, x2)``; all four broadcast together. The rounds are
    :mod:`meshinit._paths`' host hash, which works on traced jax arrays alike.
    """
    shape = np.broadcast_shapes(*(np.shape(a) for a in (k1, k2, x1, x2)))
    k1, k2 = jnp.asarray(k1, np.uint32), jnp.asarray(k2, np.uint32)
    return threefry_rounds(k1, k2, jnp.broadcast_to(x1, shape), jnp.broadcast_to(x2, shape))


def _bind(node: Any, ins: list[Any]) -> Sequence[Any]:
    """Each threefry2x32 hash as :func:`threefry2x32`; every other equation as traced."""
    if node.primitive is threefry2x32_p:
        return threefry2x32(*ins)
    return _jaxpr.bind_as_traced(node, ins)


def _straight_line(fun: Callable[..., Any], *args: Any) -> Any:
    """``fun(*args)`` (one array out), with every threefry hash in it straight-line."""
    closed = jax.make_jaxpr(fun)(*(jax.ShapeDtypeStruct(np.shape(a), a.dtype) for a in args))
    (out,) = _jaxpr.run(closed, args, _bind)  # nested jit calls inlined: all hashes
    return out


def _split(key: Any, shape: tuple[int, ...]) -> Any:
    return _straight_line(lambda k: threefry_prng_impl.split(k, shape), key)


def _fold_in(key: Any, data: Any) -> Any:
    return _straight_line(threefry_prng_impl.fold_in, key, data)


def _random_bits(key: Any, bit_width: int, shape: tuple[int, ...]) -> Any:
    return _straight_line(lambda k: threefry_prng_impl.random_bits(k, bit_width, shape), key)


STRAIGHT_LINE = define_prng_impl(
    key_shape=threefry_prng_impl.key_shape,
    seed=threefry_prng_impl.seed,
    split=_split,
    random_bits=_random_bits,
    fold_in=_fold_in,
    name="threefry2x32 (straight-line hash, meshinit)",
    tag="fry",
)
