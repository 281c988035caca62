"""A large array made by a loop over tiles, with exactly the whole array's bits.

XLA's TPU compile time grows with an array's size: one ``jax.jit`` of ``lecun_normal``
compiles in about 1 s at (4096, 1024) and 6 to 12 s at a vocabulary's (128256, 4096)
on a v5e, so one embedding sets a whole model's cold start. A program whose loop body
makes a tile of fixed size compiles in the same time whatever the array's size.

The tiles give the whole array's bits because of how jax draws them. Under
``jax_threefry_partitionable`` (jax's default), element ``i`` (row-major) of
``random_bits(key, shape)`` is the threefry hash of the key and the counter ``i``
(jax's ``_threefry_random_bits_partitionable``), and what an initializer does after the
bits (a uniform's shift and bitcast, ``erf_inv``, a scale) is elementwise. So each
device makes its own block (``shard_map``: no communication, nothing whole on one
device), a tile at a time (``fori_loop``), every value of the tile from its element's
global index: counters, iotas and slices of small operands offset by the tile's place.

:func:`tiling` decides, for one slice of a traced program (the equations that make one
array), whether it can be made so: every large value in it must have the output's
shape, be made by ``random_bits`` of a threefry key, ``iota``, ``broadcast_in_dim`` of
a small value or an elementwise primitive (:func:`meshinit._jax.compat.elementwise`)
and be read by nothing but the slice's other tile values, and a value made before the
loop must be provably the whole program's (:func:`_same_as_whole`). Anything else (a
reshape, a reduction, a matmul, control flow, an rbg key, a small float vector computed
first, a memory kind other than the device's) is made whole. :func:`evaluate` makes
it. tests/_jax/test_tiles.py checks every initializer, tiled and whole, bit for bit.
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from . import compat as _compat
from . import explicit as _explicit
from . import jaxpr as _jaxpr
from . import threefry as _threefry
from .jaxpr import Lit

# The size of one tile, per platform and by the widest element (bytes) of the values a
# tile makes, from measurements on a TPU v5e (benchmarks/README.md, "Tiles"). Compile
# time there grows with a tile's elements, far more steeply for 32-bit values: a
# (128256, 4096) lecun_normal compiled in 12.2 s whole in bf16 and in 1.1 s in tiles of
# 2 to 8 MiB; in f32, 18 s whole, 15 s in tiles of 4 MiB, 3.3 s of 1 MiB and 1.0 s of
# 256 KiB. CPU compile time does not grow with size (0.15 to 0.21 s from (1024, 4096)
# to (32768, 4096) f32, where tiles added 0.2 s), and no GPU was measured: both make
# every array whole.
TILE_BYTES: Mapping[str, Mapping[int, int]] = types.MappingProxyType(
    {"tpu": types.MappingProxyType({1: 4 << 20, 2: 4 << 20, 4: 256 << 10, 8: 256 << 10})}
)

_ROW_GROUP = 32
_COUNTER_LIMIT = 2**32  # counters as one uint32 word (jax's high word is then zero)
_KINDS = (None, "device")  # the memory kinds a tile loop writes


@dataclasses.dataclass(frozen=True)
class Tiling:
    """How one slice's output is made tile by tile (:func:`tiling`).

    Attributes:
      inner: the equations (indices into the program's nodes) made once per tile, in
        order; ``outer`` those made once, before the loop.
      reads: the values the inner equations read and do not make; ``sliced[i]``: read
        ``i`` has the output's shape and enters split as the output is (a large
        captured constant), else it enters whole (a key, a scalar, a small array).
      out: the slice's output value.
      sharding: the output's sharding (on the mesh the program is traced under).
      local: the shape of one device's block; ``tile``: the shape of one tile, whole
        along every axis after ``axis``, ``tile[axis]`` rows of it, one element of
        every axis before it; ``count``: tiles per block.
    """

    inner: tuple[int, ...]
    outer: tuple[int, ...]
    reads: tuple[int, ...]
    sliced: tuple[bool, ...]
    out: int
    sharding: NamedSharding
    local: tuple[int, ...]
    tile: tuple[int, ...]
    axis: int
    count: int


Tiles = int | str | None  # bytes; a platform, whose TILE_BYTES apply; None: no tiles


def tile_bytes_for(tiles: Tiles, itemsize: int) -> int | None:
    """The most bytes of one tile whose widest element has ``itemsize`` bytes: ``tiles``
    itself if it is a size, the platform's :data:`TILE_BYTES` if it names one; None:
    the array is made whole."""
    if isinstance(tiles, str):
        sizes = TILE_BYTES.get(tiles, {})
        return sizes.get(min((k for k in sizes if k >= itemsize), default=max(sizes, default=0)))
    return tiles or None


def tiling(
    prog: _jaxpr.Program,
    nodes: Sequence[int],
    out: int | Lit,
    sharding: NamedSharding,
    tiles: Tiles,
) -> Tiling | None:
    """How ``out`` (made by ``prog.nodes[i]`` for ``i`` in ``nodes``) is made in tiles
    (:func:`tile_bytes_for` ``tiles``), or None: made whole (see the module's docstring)."""
    if isinstance(out, Lit) or tiles is None or not _compat.value_config()[0]:
        return None  # without partitionable threefry, bits depend on the whole shape
    shape = tuple(prog.avals[out].shape)
    if not shape or math.prod(shape) >= _COUNTER_LIMIT or sharding.memory_kind not in _KINDS:
        return None
    local = _block_shape(shape, sharding)
    if local is None:
        return None
    # small operands and values: at most a tile of any width, and at least one element
    limit = max(tile_bytes_for(tiles, 8) or 0, 8)
    inner: list[int] = []
    outer: list[int] = []
    made: set[int] = set()
    itemsize = 1
    for i in nodes:
        node = prog.nodes[i]
        outs = [n for n in node.outs if n >= 0]
        if len(node.outs) == 1 and outs and tuple(prog.avals[outs[0]].shape) == shape:
            if node.control or not _tileable(prog, node, shape, made, limit):
                return None
            inner.append(i)
            made.add(outs[0])
            itemsize = max(itemsize, np.dtype(prog.avals[outs[0]].dtype).itemsize)
        elif any(_nbytes(prog.avals[n]) > limit for n in outs):
            return None  # a large value of another shape: a reshape, a transpose ...
        else:
            outer.append(i)
    if out not in made or any(
        x in made for i in outer for x in prog.nodes[i].ins if not isinstance(x, Lit)
    ):
        return None  # the output is not made in tiles, or a tile value is read whole
    reads = sorted(
        {x for i in inner for x in prog.nodes[i].ins if not isinstance(x, Lit) and x not in made}
    )
    if not _same_as_whole(prog, frozenset(outer), reads):
        return None  # a value made before the loop might not be the whole program's
    tile_bytes = tile_bytes_for(tiles, itemsize)
    if not tile_bytes or math.prod(local) * itemsize <= tile_bytes:
        return None  # one tile would be the whole block
    axis, rows = _tile_axis(local, itemsize, tile_bytes)
    keyed = [len(prog.avals[_key_of(prog.nodes[i])].shape) for i in inner if _bits(prog.nodes[i])]
    if any(k > axis for k in keyed):
        return None  # a tile would span several keys of a batch of keys
    tile = (1,) * axis + (rows,) + local[axis + 1 :]
    count = math.prod(local[:axis]) * -(-local[axis] // rows)
    if count >= 2**31:
        return None  # more tiles than the loop's int32 index counts
    sliced = tuple(tuple(prog.avals[n].shape) == shape for n in reads)
    return Tiling(
        tuple(inner), tuple(outer), tuple(reads), sliced, out, sharding, local, tile, axis, count
    )


_MOVES = ("broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose", "copy")


def _same_as_whole(prog: _jaxpr.Program, outer: frozenset[int], reads: Sequence[int]) -> bool:
    """Whether each of ``reads`` that an ``outer`` equation makes (before the loop) is
    provably what the whole program computes. It need not be: the whole program fuses
    a small operand into the large array's code, the tiled one stores it, and XLA's
    float code differs (TPU's excess precision keeps a fused bf16 value in f32, a stored
    one is rounded: ``normal(k, s, bf16) * exp(small).astype(bf16)``, 2 ulp in a fifth
    of the elements; on CPU a small f32 vector's division or ``sin``, up to 3 ulp). So,
    conservatively, only these cross: the slice's inputs and literals; keys, integers,
    booleans computed from such values; an exact float ``iota``; data movement of such
    values; a float scalar of literal scalars, which XLA folds alike in both (variance
    scaling's ``sqrt(variance) / 0.8796...``: exact on a TPU v5e). Any other float
    (arithmetic, a transcendental, a convert) and anything a loop makes: whole."""
    seen: dict[tuple[int, bool], bool] = {}

    def check(x: int | Lit, literal: bool) -> bool:  # literal: made from literals only
        i = None if isinstance(x, Lit) else prog.producer.get(x)
        if i not in outer:
            return isinstance(x, Lit) or not literal  # a literal, or the slice's input
        assert not isinstance(x, Lit) and i is not None
        if (x, literal) not in seen:
            seen[(x, literal)] = not prog.nodes[i].control and made(x, prog.nodes[i], literal)
        return seen[(x, literal)]

    def made(x: int, node: _jaxpr.Node, literal: bool) -> bool:
        ins = [y for y in node.ins if not isinstance(y, Lit)]
        aval, name = prog.avals[x], node.primitive.name
        one = math.prod(aval.shape) == 1  # a scalar of literal scalars: folded alike
        if literal or (one and all(check(y, True) for y in ins)):
            return one and all(check(y, True) for y in ins)
        if not jax.dtypes.issubdtype(aval.dtype, np.inexact):
            return all(check(y, False) for y in ins)  # keys, integers, booleans
        if name == "iota":
            return _exact_iota(aval.dtype, aval.shape[node.params["dimension"]])
        moves = name in _MOVES or _jaxpr.is_identity(node)  # placement, or data movement
        return moves and all(check(y, False) for y in ins)

    return all(check(x, False) for x in reads)


def _nbytes(aval: Any) -> int:
    key = jax.dtypes.issubdtype(aval.dtype, jax.dtypes.extended)  # a key: its data's 8 bytes
    return math.prod(aval.shape) * (8 if key else np.dtype(aval.dtype).itemsize)


def _block_shape(shape: tuple[int, ...], sharding: NamedSharding) -> tuple[int, ...] | None:
    """One device's block of ``shape`` under ``sharding``; None if a dimension does not
    divide evenly."""
    spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
    local = []
    for size, axes in zip(shape, spec, strict=True):
        n = math.prod(sharding.mesh.shape[a] for a in _axes(axes))
        if size % n:
            return None
        local.append(size // n)
    return tuple(local)


def _axes(entry: Any) -> tuple[str, ...]:
    return () if entry is None else tuple(entry) if isinstance(entry, tuple | list) else (entry,)


def _tile_axis(local: tuple[int, ...], itemsize: int, tile_bytes: int) -> tuple[int, int]:
    """The first axis whose trailing block fits a tile, and how many of its rows do; a
    tile is never less than one element (``tile_bytes`` below an element's size)."""
    fits = [a for a in range(len(local)) if math.prod(local[a + 1 :]) * itemsize <= tile_bytes]
    axis = fits[0] if fits else len(local) - 1
    rows = min(local[axis], max(1, tile_bytes // (math.prod(local[axis + 1 :]) * itemsize)))
    # whole groups of 32 rows where there are as many: TPU tiles its arrays' last two
    # axes in (8, 128) blocks (and packs narrower types into them)
    return axis, rows - rows % _ROW_GROUP if _ROW_GROUP < rows < local[axis] else rows


def _exact_iota(dtype: Any, size: int) -> bool:
    """Whether an iota of ``size`` in ``dtype`` has the same bits however it is computed
    (a float one: while every index is an integer of the type), with int32 offsets."""
    if jax.dtypes.issubdtype(dtype, np.integer):
        return size < 2**31
    return jax.dtypes.issubdtype(dtype, np.floating) and size <= 2 ** (
        jax.dtypes.finfo(dtype).nmant + 1
    )


def _bits(node: _jaxpr.Node) -> bool:
    return node.primitive is _compat.prim("random_bits")


def _iota(node: _jaxpr.Node) -> bool:
    return node.primitive is _compat.prim("iota")


def _broadcast(node: _jaxpr.Node) -> bool:
    return node.primitive is _compat.prim("broadcast_in_dim")


def _key_of(node: _jaxpr.Node) -> int:
    key = node.ins[0]
    assert not isinstance(key, Lit)
    return key


def _counter_based(impl: Any) -> bool:
    """Whether a key implementation draws element ``i``'s bits from counter ``i``:
    jax's threefry2x32, and meshinit's straight-line twins of it."""
    return impl is _compat.THREEFRY_IMPL or any(
        impl is _compat.impl_of(ours)
        for ours in (_threefry.STRAIGHT_LINE, _threefry.PROGRAM_KEY_IMPL)
    )


def _tileable(
    prog: _jaxpr.Program, node: _jaxpr.Node, shape: tuple[int, ...], made: set[int], limit: int
) -> bool:
    if _bits(node):
        key = node.ins[0]
        if isinstance(key, Lit):
            return False
        impl = _compat.impl_of(prog.avals[key].dtype)
        k = len(prog.avals[key].shape)
        return (
            _counter_based(impl)
            and node.params["bit_width"] in (8, 16, 32)
            and tuple(node.params["shape"]) == shape[k:]
        )
    if _iota(node):
        return _exact_iota(np.dtype(node.params["dtype"]), shape[node.params["dimension"]])
    if _broadcast(node):
        x = node.ins[0]
        if isinstance(x, Lit):
            return np.ndim(x.value) == 0
        return x not in made and _nbytes(prog.avals[x]) <= limit
    moved = _jaxpr.is_identity(node) and len(node.ins) == 1
    if not (_compat.elementwise(node.primitive) or moved):
        return False
    for x in node.ins:
        if isinstance(x, Lit):
            if np.ndim(x.value) != 0:
                return False
            continue
        have = tuple(prog.avals[x].shape)
        if x in made or have == shape:
            continue  # a tile's value, or an operand that enters split as the output is
        ok = len(have) == len(shape) and all(h in (1, s) for h, s in zip(have, shape, strict=True))
        if (have and not ok) or _nbytes(prog.avals[x]) > limit:
            return False
    return True


# ------------------------------------------------------------------------ making


def evaluate(
    prog: _jaxpr.Program,
    t: Tiling,
    env: dict[int, Any],
    bind: Callable[[_jaxpr.Node, list[Any]], Sequence[Any]],
    *,
    straight: bool,
    barrier: bool,
    explicit: bool = False,
) -> jax.Array:
    """The output of ``t``, made tile by tile.

    ``env`` holds the slice's inputs; the outer equations are evaluated with ``bind``
    (as the whole slice would be), the inner ones per tile. ``straight``: hash with
    :func:`meshinit._jax.threefry.threefry2x32` (CPU) rather than jax's primitive;
    ``barrier``: each hash's two words behind an optimization barrier, as
    :data:`meshinit._jax.threefry.PROGRAM_KEY_IMPL` makes them in the whole slice's
    program (so the float math after them is a loop of its own). ``explicit``: each
    tile's equation constrained as jit constrains it under an Explicit mesh
    (:func:`meshinit._jax.explicit.bind_in_manual`).
    """
    _jaxpr.run_nodes(prog, t.outer, env, bind)
    args, specs = [], []
    for n, sliced in zip(t.reads, t.sliced, strict=True):
        x = env[n]
        if jax.dtypes.issubdtype(prog.avals[n].dtype, jax.dtypes.extended):
            x = jax.random.key_data(x)
        args.append(x)
        specs.append(t.sharding.spec if sliced else PartitionSpec())
    out_aval = prog.avals[t.out]
    mesh = t.sharding.mesh

    def block(*values: Any) -> jax.Array:
        offsets = _block_offsets(t)
        given = dict(zip(t.reads, values, strict=True))

        def step(i: Any, buf: jax.Array) -> jax.Array:
            starts, placed = _tile_starts(t, i)
            where = [s + o for s, o in zip(starts, offsets, strict=True)]
            tile: dict[int, Any] = {}

            def read(x: int | Lit, sliced: bool) -> Any:
                if isinstance(x, Lit):
                    return x.value
                if x in tile:
                    return tile[x]
                return _fit(given[x], starts if sliced else where, t.tile)

            for k in t.inner:
                node = prog.nodes[k]
                if _bits(node):
                    key_data = given[_key_of(node)]
                    value = _tile_bits(node, key_data, where, t, straight, barrier)
                elif _iota(node):
                    value = _tile_iota(node, where, t.tile)
                elif _broadcast(node):
                    value = _tile_broadcast(node, read(node.ins[0], False), where, t.tile)
                elif _jaxpr.is_identity(node) and not _compat.elementwise(node.primitive):
                    value = read(node.ins[0], _sliced(t, node.ins[0]))
                else:
                    ins = [read(x, _sliced(t, x)) for x in node.ins]
                    params = {k: None if k == "sharding" else v for k, v in node.params.items()}
                    if explicit:
                        value = _explicit.bind_in_manual(node, ins, params)
                    else:
                        (value,) = _compat.bind(node.primitive, ins, params)
                tile[node.outs[0]] = value
            return jax.lax.dynamic_update_slice(buf, tile[t.out], placed)

        # every element is written by a tile: allocated, not zero-filled (CPU: zeros)
        buf = jax.lax.empty(t.local, out_aval.dtype)
        return jax.lax.fori_loop(0, t.count, step, buf)

    if not mesh.axis_names:
        return block(*args)  # a mesh of no axes: one block, nothing to go manual over
    made = jax.shard_map(
        block, mesh=mesh, in_specs=tuple(specs), out_specs=t.sharding.spec, check_vma=False
    )
    return made(*args)


def _sliced(t: Tiling, x: int | Lit) -> bool:
    return not isinstance(x, Lit) and x in t.reads and t.sliced[t.reads.index(x)]


def _block_offsets(t: Tiling) -> list[Any]:
    """Where this device's block starts in the whole array, per axis (traced)."""
    mesh = t.sharding.mesh
    spec = tuple(t.sharding.spec) + (None,) * (len(t.local) - len(t.sharding.spec))
    offsets: list[Any] = []
    for size, entry in zip(t.local, spec, strict=True):
        index: Any = np.int32(0)
        for a in _axes(entry):  # major to minor
            index = index * np.int32(mesh.shape[a]) + jax.lax.axis_index(a).astype(np.int32)
        offsets.append(index * np.int32(size))
    return offsets


def _tile_starts(t: Tiling, i: Any) -> tuple[list[Any], list[Any]]:
    """Where tile ``i`` starts in the block, per axis (traced): the block's row-major
    order over the axes before ``t.axis``, then runs of ``t.tile[t.axis]`` rows, the
    last moved back to end at the block's end (rows made twice, alike); and where it is
    written: its run unmoved, which ``dynamic_update_slice`` clamps to the same place.
    XLA writes a tile in place (not by a copy) only where it sees a multiple of the
    rows: no clamp, and lax's div and rem (i >= 0), not jnp's floor ones (selects)."""
    rows = t.tile[t.axis]
    runs = np.int32(-(-t.local[t.axis] // rows))
    outer, run = (jax.lax.div(i, runs), jax.lax.rem(i, runs)) if t.axis else (i, i)
    starts: list[Any] = []
    for size in reversed(t.local[: t.axis]):
        starts.append(jax.lax.rem(outer, np.int32(size)))
        outer = jax.lax.div(outer, np.int32(size))
    starts.reverse()
    placed = run * np.int32(rows)
    moved = jnp.minimum(placed, np.int32(t.local[t.axis] - rows))
    rest = [np.int32(0)] * (len(t.local) - t.axis - 1)
    return [*starts, moved if t.local[t.axis] % rows else placed, *rest], [*starts, placed, *rest]


def _fit(x: Any, starts: Sequence[Any], tile: tuple[int, ...]) -> Any:
    """The part of operand ``x`` (a scalar, or the output's rank with size-1 axes
    broadcast) that a tile at ``starts`` reads."""
    if np.ndim(x) == 0:
        return x
    sizes = [1 if have == 1 else want for have, want in zip(np.shape(x), tile, strict=True)]
    at = [np.int32(0) if have == 1 else s for have, s in zip(np.shape(x), starts, strict=True)]
    return jax.lax.dynamic_slice(x, at, sizes)


def _tile_bits(
    node: _jaxpr.Node,
    key_data: Any,
    where: Sequence[Any],
    t: Tiling,
    straight: bool,
    barrier: bool,
) -> Any:
    """``random_bits`` of the tile at ``where``: its elements' counters hashed with
    their key, as jax's partitionable threefry does for the whole array."""
    k = key_data.ndim - 1  # a batch of keys: leading axes of the output
    if k:
        key_data = jax.lax.dynamic_slice(key_data, [*where[:k], np.int32(0)], (1,) * k + (2,))
        key_data = key_data.reshape(2)
    inner = tuple(node.params["shape"])
    strides = [math.prod(inner[d + 1 :]) for d in range(len(inner))]
    counts: Any = jnp.zeros(t.tile, np.uint32)
    for d, stride in enumerate(strides):
        index = jax.lax.broadcasted_iota(np.uint32, t.tile, k + d) + where[k + d].astype(np.uint32)
        counts = counts + index * np.uint32(stride)
    high = jnp.zeros(t.tile, np.uint32)
    k1, k2 = key_data[0], key_data[1]
    if straight:
        bits1, bits2 = _threefry.threefry2x32(k1, k2, high, counts)
    else:
        bits1, bits2 = _compat.THREEFRY2X32.bind(k1, k2, high, counts)
    if barrier:
        bits1, bits2 = jax.lax.optimization_barrier((bits1, bits2))
    bits = bits1 ^ bits2
    width = node.params["bit_width"]
    return bits if width == 32 else bits.astype(np.dtype(f"uint{width}"))


def _tile_iota(node: _jaxpr.Node, where: Sequence[Any], tile: tuple[int, ...]) -> Any:
    d = node.params["dimension"]
    index = jax.lax.broadcasted_iota(np.int32, tile, d) + where[d]
    return index.astype(node.params["dtype"])


def _tile_broadcast(node: _jaxpr.Node, x: Any, where: Sequence[Any], tile: tuple[int, ...]) -> Any:
    dims = tuple(node.params["broadcast_dimensions"])
    shape = np.shape(x)
    sizes = [1 if shape[j] == 1 else tile[d] for j, d in enumerate(dims)]
    at = [np.int32(0) if shape[j] == 1 else where[d] for j, d in enumerate(dims)]
    if shape:
        x = jax.lax.dynamic_slice(x, at, sizes)
    return jax.lax.broadcast_in_dim(x, tile, dims)
