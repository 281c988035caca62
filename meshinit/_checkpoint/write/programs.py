"""The programs of an export: each stored tensor made on the devices by its recipe's
build, then cast or FP8-encoded, gathered onto every process of its parameters
(:func:`gathered`); one compiled program per signature (:func:`program`), so that
every layer of a scanned parameter shares one; and the order the writers need them
in, cut into batches (:func:`batches`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from ... import _caches
from ..._run import compile as _compile
from ..encodings.fp8 import encode as _fp8
from ..layout.recipe import Recipe
from . import files as _files

programs = _caches.lru("export programs", 256)


@dataclasses.dataclass(frozen=True)
class Out:
    """A stored tensor made by a recipe's program: which output, and its file."""

    stored: _files.Stored
    output: int  # 0: the tensor; 1: an FP8 weight's scale_inv


@dataclasses.dataclass
class Work:
    recipe: Recipe
    sources: tuple[jax.Array, ...]
    devices: tuple[Any, ...]  # the device order of its parameters
    outs: list[Out]
    cast: str | None
    fp8: bool


def order(x: jax.Array) -> tuple[Any, ...]:
    return tuple(x.sharding._device_assignment)  # the order jit compiles for


def auto(x: jax.Array) -> jax.Array:
    """``x`` on a twin of its mesh whose axes are all Auto (same devices, indices and
    buffers: no copy), so that the recipes' reshapes and transposes compile as on an
    Auto mesh whatever the parameter's mesh says."""
    s = x.sharding
    if not isinstance(s, NamedSharding) or not isinstance(s.mesh, Mesh):
        return x
    if all(t == AxisType.Auto for t in s.mesh.axis_types):
        return x
    mesh = Mesh(
        s.mesh.devices, s.mesh.axis_names, axis_types=(AxisType.Auto,) * len(s.mesh.axis_names)
    )
    twin = NamedSharding(mesh, s.spec, memory_kind=s.memory_kind)
    return jax.make_array_from_single_device_arrays(
        x.shape, twin, [shard.data for shard in x.addressable_shards]
    )


def gathered(devices: tuple[Any, ...], shape: tuple[int, ...]) -> NamedSharding:
    """Where a stored tensor is made: whole on every process of its parameters, split by
    rows over each process's devices where they divide it (each shard then a run of
    whole rows, written as it is), else whole on each device."""
    procs = [d.process_index for d in devices]
    groups = [procs[i] for i in range(len(procs)) if i == 0 or procs[i] != procs[i - 1]]
    n = len(groups)
    k = len(devices) // n
    auto = (AxisType.Auto, AxisType.Auto)
    if (
        len(set(groups)) == n
        and len(devices) == n * k
        and all(procs[i * k : (i + 1) * k] == [groups[i]] * k for i in range(n))
    ):
        mesh = Mesh(np.array(devices, dtype=object).reshape(n, k), ("p", "d"), axis_types=auto)
        split = bool(shape) and shape[0] % k == 0
        return NamedSharding(mesh, PartitionSpec("d") if split else PartitionSpec())
    mesh = Mesh(np.array(devices, dtype=object).reshape(1, -1), ("p", "d"), axis_types=auto)
    return NamedSharding(mesh, PartitionSpec())


@dataclasses.dataclass(frozen=True)
class Make:
    """A program's function: the recipe's build, then the cast or the FP8 encoding."""

    build: Any
    cast: str | None
    fp8: bool

    def __call__(self, arrays: tuple[jax.Array, ...], at: tuple[Any, ...]) -> tuple[jax.Array, ...]:
        x = self.build(arrays, at)
        if self.fp8:  # and whether every value is finite: a NaN or an inf would spread
            w, scale = _fp8.quantize(x)  # over its block through the block's amax
            return w, scale, jnp.isfinite(x).all()
        if self.cast is not None and jnp.issubdtype(x.dtype, jnp.floating):
            x = x.astype(self.cast)
        return (x,)


def program(work: Work, inputs: tuple[jax.Array, ...]) -> Any:
    make = Make(work.recipe.build, work.cast if not work.fp8 else None, work.fp8)
    outs = tuple(gathered(work.devices, o.stored.shape) for o in work.outs)
    if work.fp8:
        outs = (*outs, gathered(work.devices, ()))
    at = tuple(jax.ShapeDtypeStruct((), jnp.int32) for _ in work.recipe.at)
    key = (make, tuple((a.shape, str(a.dtype), a.sharding) for a in inputs), outs, len(at))
    full = _compile.full_key(key)
    compiled = programs.get(full)
    if compiled is None:
        lowered = jax.jit(make, out_shardings=outs).lower(inputs, at)
        # as every compile of meshinit's: the platform's options, and kept in jax's
        # persistent compilation cache where one is set (a restarted export reads it)
        compiled = _compile.compile_lowered(lowered, cast(Mesh, outs[0].mesh))
        programs.put(full, compiled)
    return compiled


def batches(works: Sequence[Work], plan: _files.Files, budget: int) -> list[list[Work]]:
    """The works in the order the writers need them (every writer's stream front to
    back at once), cut into batches of at most ``budget`` gathered bytes."""
    place: dict[str, int] = {}
    for writer in {f.writer for f in plan.files}:
        at = 0
        for f in plan.files:
            if f.writer != writer:
                continue
            for t, offset in zip(f.tensors, f.offsets, strict=True):
                place[t.name] = at + offset
            at += f.size
    order = sorted(works, key=lambda w: min(place[o.stored.name] for o in w.outs))
    batches: list[list[Work]] = []
    size = 0
    for w in order:
        n = sum(o.stored.nbytes for o in w.outs)
        if not batches or size + n > budget:
            batches.append([])
            size = 0
        batches[-1].append(w)
        size += n
    return batches
