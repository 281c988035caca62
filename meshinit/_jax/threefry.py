"""Every piece of threefry2x32 code meshinit has, shared by the host and the programs.

- :func:`threefry_rounds` is jax's Threefry-2x32 hash (20 rounds) on uint32 arrays,
  numpy or traced jax alike, and :func:`threefry_ints` the same on Python ints: the
  host evaluation (:mod:`meshinit._engine.host_eval`) hashes keys and counters with
  them, and :func:`fold_digests` derives the per-parameter keys from path digests
  (:mod:`meshinit._paths`) on the host for every strategy.
- :data:`STRAIGHT_LINE` is a key implementation for the programs meshinit compiles for
  CPU meshes. On CPU, jax lowers the hash as a rolled loop of 5 steps of 4 rounds (a
  while loop in the compiled program): each step writes the whole counter array back
  to memory, and nothing fuses across the loop, so the hash, the conversion to floats
  and the initializer's arithmetic run as separate passes over the parameter. On GPU
  and TPU, jax emits the 20 rounds straight-line. :data:`STRAIGHT_LINE` is jax's own
  threefry2x32 implementation (its key data, seed, ``split``, ``fold_in`` and
  ``random_bits``, so the same counters and the same bits) with each hash emitted
  straight-line by :func:`threefry2x32`; XLA then fuses counters, hash and arithmetic
  into one loop per parameter. On the 32-layer CPU reference this made both the
  compile and the run of meshinit's programs faster (see benchmarks/README.md). Its
  keys never leave the programs, and its values are those of jax's threefry2x32 keys,
  bit for bit, which the tests check against jax's own hash and initializers.
- :data:`PROGRAM_KEY_IMPL` is :data:`STRAIGHT_LINE` with each hash's two output words
  behind an optimization barrier: the key implementation of meshinit's CPU programs,
  built as ``jax.jit`` builds an initializer (its bits; see its docstring).
- :func:`is_threefry` says whether a key implementation is jax's threefry2x32.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.random import define_prng_impl, threefry2x32_p, threefry_prng_impl

from . import jaxpr as _jaxpr

# The only key implementation whose values are independent of sharding, and only while
# ``jax_threefry_partitionable`` is on (jax's default since 0.5).
SHARDING_INVARIANT_IMPL = "threefry2x32"


def is_threefry(impl: Any) -> bool:
    """Whether ``impl`` (a jax key implementation) is jax's threefry2x32."""
    return getattr(impl, "name", None) == SHARDING_INVARIANT_IMPL


_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))


def threefry_rounds(k1: Any, k2: Any, x1: Any, x2: Any) -> tuple[Any, Any]:
    """jax's Threefry-2x32 hash (20 rounds), elementwise over uint32 arrays (numpy or jax)."""
    ks = (k1, k2, k1 ^ k2 ^ np.uint32(0x1BD11BDA))
    x = [x1 + ks[0], x2 + ks[1]]
    for block in range(5):
        for r in _ROTATIONS[block % 2]:
            x[0] = x[0] + x[1]
            x[1] = (x[1] << np.uint32(r)) | (x[1] >> np.uint32(32 - r))
            x[1] = x[0] ^ x[1]
        x[0] = x[0] + ks[(block + 1) % 3]
        x[1] = x[1] + ks[(block + 2) % 3] + np.uint32(block + 1)
    return x[0], x[1]


_MASK = 0xFFFFFFFF


def threefry_ints(k1: int, k2: int, x1: int, x2: int) -> tuple[int, int]:
    """jax's Threefry-2x32 hash of one counter pair, on Python ints (uint32 values).

    The rounds of :func:`threefry_rounds`, masked to 32 bits by hand
    (a test compares the two).
    """
    ks = (k1, k2, k1 ^ k2 ^ 0x1BD11BDA)
    a, b = (x1 + k1) & _MASK, (x2 + k2) & _MASK
    for block in range(5):
        for r in _ROTATIONS[block % 2]:
            a = (a + b) & _MASK
            b = ((b << r) & _MASK) | (b >> (32 - r))
            b ^= a
        a = (a + ks[(block + 1) % 3]) & _MASK
        b = (b + ks[(block + 2) % 3] + block + 1) & _MASK
    return a, b


def fold_digests(key_data: np.ndarray, digests: np.ndarray) -> np.ndarray:
    """Host twin of :func:`fold_digest` for many digests at once: threefry key data.

    ``fold_digests(key_data, d)[i]`` equals
    ``key_data(fold_digest(wrap_key_data(key_data), d[i, 0], d[i, 1]))``, bit for bit.
    Deriving the per-parameter keys here keeps two scalar threefry loops per signature
    out of every compiled program (a third of its XLA compile time on CPU).

    Args:
      key_data: uint32[2], threefry key data.
      digests: uint32[n, 2], (high, low) path digests.

    Returns:
      uint32[n, 2], one key's data per digest.
    """
    digests = np.asarray(digests, dtype=np.uint32).reshape(-1, 2)
    zero = np.zeros(len(digests), np.uint32)
    k1 = np.full(len(digests), key_data[0], np.uint32)
    k2 = np.full(len(digests), key_data[1], np.uint32)
    with np.errstate(over="ignore"):
        for column in (0, 1):  # jax.random.fold_in(key, d) hashes the count (0, d)
            k1, k2 = threefry_rounds(k1, k2, zero, digests[:, column])
    return np.stack([k1, k2], axis=1)


def threefry2x32(k1: Any, k2: Any, x1: Any, x2: Any) -> tuple[jax.Array, jax.Array]:
    """The Threefry-2x32 hash with 20 rounds, as straight-line elementwise uint32 ops.

    Computes what jax's ``threefry2x32`` primitive computes: the key ``(k1, k2)``
    hashes the counters ``(x1, x2)``; all four broadcast together. The rounds are
    :func:`threefry_rounds`, which works on traced jax arrays alike.
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


def _straight_key(key_data: Any) -> Any:
    return jax.random.wrap_key_data(key_data, impl=STRAIGHT_LINE)


def _hash_apart(node: Any, ins: list[Any]) -> Sequence[Any]:
    if node.primitive is threefry2x32_p:
        return jax.lax.optimization_barrier(threefry2x32(*ins))
    return _jaxpr.bind_as_traced(node, ins)


def _bits_apart(key_data: Any, bit_width: int, shape: tuple[int, ...]) -> Any:
    """jax's threefry2x32 random bits, each hash straight-line, its two output words
    behind an optimization barrier."""
    struct = jax.ShapeDtypeStruct(np.shape(key_data), key_data.dtype)
    closed = jax.make_jaxpr(lambda k: threefry_prng_impl.random_bits(k, bit_width, shape))(struct)
    (bits,) = _jaxpr.run(closed, [key_data], _hash_apart)
    return bits


PROGRAM_KEY_IMPL = define_prng_impl(
    key_shape=(2,),
    seed=lambda seed: jax.random.key_data(jax.random.key(seed, impl=STRAIGHT_LINE)),
    split=lambda k, shape: jax.random.key_data(jax.random.split(_straight_key(k), shape)),
    random_bits=_bits_apart,
    fold_in=lambda k, d: jax.random.key_data(jax.random.fold_in(_straight_key(k), d)),
    name="threefry2x32 (straight-line hash, its words apart, meshinit)",
    tag="fry",
)
"""The key implementation of meshinit's programs on CPU: jax's threefry2x32, the same
bits, with each hash of random bits emitted straight-line (as
:data:`STRAIGHT_LINE` does, which XLA compiles and runs faster than jax's
rolled loop: benchmarks/README.md, "Measurements behind the code's choices") and its
two output words behind an optimization barrier. So the initializer's float math is
one loop of its own over the two words, as in the program ``jax.jit`` builds, whose
rolled hash is a while loop: XLA's CPU code splits and vectorizes that loop by its
cost, and fused into the hash, or fed one word, it rounded ``erf_inv`` otherwise
(jaxlib 0.12.0.1 on this Xeon: ``lecun_normal`` of a (4096, 4) matrix on
``P("fsdp", None)``, 666 of 16,384 elements up to 3 ulp off ``jax.jit``'s with the same
out_shardings; a (1024, 4) one, 7 elements off ``nnx.jit``'s)."""
