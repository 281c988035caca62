"""MXFP4 parameters through fan-out (:mod:`meshinit._checkpoint.read.staging`): the
stored bytes of a parameter as an array of their own, its *image*, which fan-out
stages, gathers and places as it does a plain parameter, and the device program that
dequantizes each device's block of it.

A block of an MXFP4 parameter reads the bytes and exponents of the groups it reaches
(:mod:`.pairing`), not a slice of one stored array. Its image has the parameter's
shape with K (axis 1 of transformers' ``X``, ``2B`` values a group) replaced by
``B + 1`` bytes a group: the group's ``B`` bytes of ``X_blocks``, then its exponent
byte of ``X_scales``, laid out as the parameter's values are
(:func:`.program.laid_out`). Where every planned block's span of K is whole groups, a
block of the image holds exactly the stored bytes of the parameter's block: fan-out
stages the image (each stored byte fetched once for the job, :func:`block`), gathers
it between the processes as uint8, and :func:`gathered` unpacks each device's block
and dequantizes it with :func:`.program.decoded`, the load's own arithmetic: the same
bits as without fan-out.

Read by each holder as before (:func:`stage_of` gives None): a parameter whose view
of K, or one of whose planned blocks, starts or ends inside a group, and one whose
staging would split a group between two processes' shares.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from .... import _caches
from ...layout import blocks as _blocks
from ...layout import host as _host
from .. import base as _base
from .program import checked, decoded, laid_out, planned_as, unlaid


def stacked(node: _blocks.Node, ndim: int) -> tuple[_blocks.Leaf, list[int]]:
    """A leaf of ``node`` (all share its view) and the axes of a block that step
    between leaves, outermost first: the order :func:`blocks.reached` reads them in."""
    free, axes = list(range(ndim)), []
    while isinstance(node, _blocks.Joined):
        axes.append(free.pop(node.axis))
        node = node.parts[0]
    assert isinstance(node, _blocks.Leaf)
    return node, axes


def k_axis(node: _blocks.Node, ndim: int) -> int:
    """The parameter's axis that holds K (axis 1 of the stored tensor ``X``)."""
    leaf, across = stacked(node, ndim)
    view = [k for k in range(ndim) if k not in across]
    return view[leaf.order.index(1)]


def image(job: Any) -> Any:
    """The job's entry as its image (uint8, K as ``B + 1`` bytes a group, sharded as
    planned), or None where a planned block or the view cuts a group."""
    entry, node = job.entry, job.node
    shape = entry.spec.shape
    leaf, _ = stacked(node, len(shape))
    group, width = leaf.quant.group, leaf.quant.blocks.shape[3] + 1
    axis = k_axis(node, len(shape))
    whole = (leaf.index or (slice(None),) * 3)[1]
    start, stop, _ = whole.indices(leaf.stored.shape[1])
    if start % group or (stop - start) % group:
        return None
    for index in entry.sharding.devices_indices_map(shape).values():
        cut = _host.resolved(index, shape)[axis]
        if cut.start % group or cut.stop % group:
            return None
    packed = (*shape[:axis], shape[axis] // group * width, *shape[axis + 1 :])
    spec = dataclasses.replace(entry.spec, shape=packed, dtype=np.dtype(np.uint8))
    return dataclasses.replace(entry, spec=spec)


def stage_of(job: Any, stage: Callable[[Any, Any], Any]) -> Any:
    """The staging of the job's image (``stage``: fan-out's, of an entry and its
    node), or None where the parameter is read by each holder: its :func:`image` is
    None, nothing is shared, or a share would end inside a group."""
    entry = image(job)
    made = None if entry is None else stage(entry, job.node)
    if made is None:
        return None
    leaf, _ = stacked(job.node, len(job.entry.spec.shape))
    width, axis = leaf.quant.blocks.shape[3] + 1, k_axis(job.node, len(entry.spec.shape))
    for index in made.sharding.devices_indices_map(made.shape).values():
        cut = made.real(_host.resolved(index, made.shape))[0][axis]
        if cut.start % width or cut.stop % width:
            return None
    return made


def block(parts: Any, index: tuple[slice, ...]) -> np.ndarray:
    """The image's block at ``index`` (``parts``: the parameter's
    :class:`~.pairing.MxParts`): the stored bytes and exponents of the groups it
    holds, each read once, checked as the load checks them, laid out as the image."""
    entry, node = parts.job.entry, parts.job.node
    sizes = tuple(max(0, s.stop - s.start) for s in index)
    if not math.prod(sizes):
        return np.zeros(sizes, np.uint8)
    ndim = len(sizes)
    leaf, across = stacked(node, ndim)
    group, b = leaf.quant.group, leaf.quant.blocks.shape[3]
    axis = k_axis(node, ndim)
    g0, g1 = index[axis].start // (b + 1), -(-index[axis].stop // (b + 1))
    at = (*index[:axis], slice(g0 * group, g1 * group), *index[axis + 1 :])
    reached = _blocks.reached(node, at)
    (e0, ne, es), (k0, nk, _), (r0, nr, rs) = parts._picked(at)
    first, groups = k0 // group, nk // group
    cut = (slice(e0, e0 + ne * es, es), slice(r0, r0 + nr * rs, rs), slice(first, first + groups))
    both = np.empty((len(reached), ne, nr, groups, b + 1), np.uint8)
    for k, (part, _) in enumerate(reached):  # copied once, out of the files' pages
        both[k, ..., :b] = parts._tensor(part.quant.blocks)[cut]
        both[k, ..., b] = parts._tensor(part.quant.scales)[cut]
    parts._counted[0] += both.nbytes
    parts._tally[0] += both.nbytes
    planned = np.dtype(entry.spec.dtype)
    work = np.dtype(leaf.tensor.compute_dtype or planned)
    checked(both[..., :b], both[..., b], (work, planned), entry.path, reached)
    outer = tuple(sizes[k] for k in across)
    inner = tuple(
        groups * (b + 1) if k == axis else sizes[k] for k in range(ndim) if k not in across
    )
    laid = laid_out(both.reshape(*both.shape[:3], -1), leaf.order, across, outer, inner)
    low = index[axis].start - g0 * (b + 1)
    kept = (slice(None),) * axis + (slice(low, low + sizes[axis]),)
    return np.ascontiguousarray(laid[kept])


def gathered(parts: Any, shape: Any, sharding: Any, shards: list[jax.Array]) -> _host.Gathered:
    """The staged image (``shards`` on ``sharding``, of ``shape``) to gather, and what
    dequantizes it once gathered onto the planned sharding: one program over every
    device's block (a callable: :mod:`meshinit._checkpoint.read.ahead`)."""
    job = parts.job
    entry, node = job.entry, job.node
    staged = jax.make_array_from_single_device_arrays(shape, sharding, shards, dtype=np.uint8)
    leaf, across = stacked(node, len(entry.spec.shape))
    planned = np.dtype(entry.spec.dtype)
    work = np.dtype(leaf.tensor.compute_dtype or planned)
    key = (leaf.order, tuple(across), k_axis(node, len(across) + 3), leaf.quant.blocks.shape[3])

    def then(got: jax.Array) -> Any:
        mesh, spec = entry.sharding.mesh, entry.sharding.spec
        run = program(key, work, planned, mesh, spec)

        def finish() -> jax.Array:  # on a worker thread (.ahead)
            made = _base.run(run, mesh, got)
            return planned_as(made, entry.spec.shape, entry.sharding)

        return finish

    return _host.Gathered(staged, then, image(job))


@_caches.memo(256)
def program(key: tuple[Any, ...], work: Any, planned: Any, mesh: Any, spec: Any) -> Any:
    """The compiled dequantization of a gathered image over the mesh: each device's
    block unpacked to its bytes and exponents, then decoded and laid out as the load
    without fan-out does it."""
    order, across, axis, b = key

    def dequantized(got: Any) -> Any:
        outer = tuple(got.shape[k] for k in across)
        values = unlaid(got, order, across, math.prod(outer))  # [L, E, R, G * (B + 1)]
        values = values.reshape(*values.shape[:3], -1, b + 1)
        values = decoded(values[..., :b], values[..., b], work, planned)
        inner = [got.shape[k] for k in range(got.ndim) if k not in across]
        inner[[k for k in range(got.ndim) if k not in across].index(axis)] = values.shape[-1]
        return laid_out(values, order, across, outer, tuple(inner))

    mapped = jax.shard_map(dequantized, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)
    return jax.jit(mapped)
