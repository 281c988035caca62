"""Pretrained weights from safetensors files, read shard by shard into a plan.

:func:`load` maps each planned parameter to a tensor of a (possibly sharded) Hugging
Face style checkpoint, through renames, reshapes and transposes, and reads from the
memory-mapped files only the bytes of the shards this process's devices own. Its
result feeds ``existing=`` of :func:`meshinit.nnx.init` (or ``linen``/``eqx``, or
:func:`meshinit.materialize`), which then makes only what the files lack::

    loaded = meshinit.safetensors.load(meshinit.nnx.plan(factory), files,
                                       names=hf_names, missing="skip")
    model = meshinit.nnx.init(factory, existing=loaded)

The file format is read here (an 8-byte little-endian header length, a JSON header of
``{name: {dtype, shape, data_offsets}}``, then the raw row-major data), because the
per-shard read needs the offsets, which ``safetensors.safe_open`` does not expose.
"""

from __future__ import annotations

import dataclasses
import json
import mmap
import os
import pathlib
import struct
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import ml_dtypes
import numpy as np

from ._errors import PlanError, Problem
from ._plan.plan import Plan, PlanEntry

__all__ = ["Tensor", "load"]

_DTYPES: Mapping[str, Any] = {
    "BOOL": np.bool_,
    "U8": np.uint8,
    "I8": np.int8,
    "U16": np.uint16,
    "I16": np.int16,
    "U32": np.uint32,
    "I32": np.int32,
    "U64": np.uint64,
    "I64": np.int64,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F32": np.float32,
    "F64": np.float64,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
}


@dataclasses.dataclass(frozen=True)
class Tensor:
    """A stored tensor, reshaped then transposed into a parameter.

    The parameter is ``stored.reshape(shape).transpose(permute)``: ``shape`` row-major,
    as numpy reshapes (None keeps the stored shape), then ``permute`` as for
    ``np.transpose`` (None keeps the order).

    Attributes:
      name: the tensor's name in the files (``model.layers.0.mlp.up_proj.weight``).
      shape: the shape to reshape the stored tensor to, or None.
      permute: the axis order after the reshape, or None.

    Examples:
      >>> Tensor("model.layers.0.mlp.up_proj.weight", permute=(1, 0))  # (out, in) -> (in, out)
      Tensor(name='model.layers.0.mlp.up_proj.weight', shape=None, permute=(1, 0))
      >>> heads, head_dim, d_model = 32, 128, 4096
      >>> Tensor("model.layers.0.self_attn.q_proj.weight",
      ...        shape=(heads, head_dim, d_model), permute=(2, 0, 1))
      Tensor(name='model.layers.0.self_attn.q_proj.weight', shape=(32, 128, 4096),
             permute=(2, 0, 1))
    """

    name: str
    shape: tuple[int, ...] | None = dataclasses.field(default=None, kw_only=True)
    permute: tuple[int, ...] | None = dataclasses.field(default=None, kw_only=True)


@dataclasses.dataclass(frozen=True)
class _Stored:
    file: pathlib.Path
    dtype: Any
    shape: tuple[int, ...]
    offset: int  # of the tensor's first byte in the file


def _files(files: Any) -> list[pathlib.Path]:
    if isinstance(files, str | os.PathLike):
        path = pathlib.Path(files)
        if path.is_dir():
            found = sorted(path.glob("*.safetensors"))
            if not found:
                raise FileNotFoundError(f"no *.safetensors file in the directory {path}")
            return found
        return [path]
    if isinstance(files, Sequence) and files:
        return [pathlib.Path(f) for f in files]
    raise TypeError(
        f"files must be a path, a list of paths or a directory of *.safetensors files, "
        f"got {files!r}"
    )


def _index(files: list[pathlib.Path]) -> dict[str, _Stored]:
    """Every tensor of ``files`` by name, from their headers."""
    index: dict[str, _Stored] = {}
    for file in files:
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if name in index:
                raise ValueError(
                    f"the tensor {name!r} is in both {index[name].file} and {file}: one "
                    f"checkpoint's files hold each tensor once"
                )
            dtype = _DTYPES.get(info["dtype"], info["dtype"])
            start = info["data_offsets"][0]
            index[name] = _Stored(file, dtype, tuple(info["shape"]), 8 + length + start)
    return index


def _target(entry: PlanEntry, names: Callable[[str], Any] | None) -> Tensor | None:
    found = entry.path if names is None else names(entry.path)
    if found is None or isinstance(found, Tensor):
        return found
    if isinstance(found, str):
        return Tensor(found)
    raise TypeError(
        f"names({entry.path!r}) returned {type(found).__name__}; it must return a tensor "
        f"name, a meshinit.safetensors.Tensor, or None for a path not in the files"
    )


def _transformed(stored: _Stored, tensor: Tensor) -> tuple[tuple[int, ...] | None, str | None]:
    """The shape ``tensor``'s transforms give the stored tensor, or why they cannot."""
    shape = stored.shape
    if tensor.shape is not None:
        if int(np.prod(tensor.shape)) != int(np.prod(shape)):
            return None, f"cannot be reshaped from {shape} to {tuple(tensor.shape)}"
        shape = tuple(tensor.shape)
    if tensor.permute is not None:
        if sorted(tensor.permute) != list(range(len(shape))):
            return None, f"permute={tuple(tensor.permute)} is not an order of {len(shape)} axes"
        shape = tuple(shape[i] for i in tensor.permute)
    return shape, None


def _reader(stored: _Stored, tensor: Tensor, dtype: Any) -> Callable[[Any], np.ndarray]:
    """``index -> the parameter's block there``, read from the memory-mapped file: a
    reshape and a transpose are views, so only the block's bytes are touched. After
    each read the mapping's pages are released (``MADV_DONTNEED``; they stay in the
    page cache), so the file's bytes never count in this process's memory."""
    itemsize = np.dtype(stored.dtype).itemsize
    count = int(np.prod(stored.shape))
    start = stored.offset - stored.offset % mmap.ALLOCATIONGRANULARITY
    with open(stored.file, "rb") as f:
        mapped = mmap.mmap(
            f.fileno(),
            stored.offset - start + count * itemsize,
            access=mmap.ACCESS_READ,
            offset=start,
        )
    flat = np.frombuffer(mapped, stored.dtype, count, stored.offset - start)
    view = flat.reshape(stored.shape if tensor.shape is None else tensor.shape)
    if tensor.permute is not None:
        view = view.transpose(tensor.permute)

    def read(index: Any) -> np.ndarray:
        block = np.array(view[index], dtype=dtype)  # a copy: the mapping is not kept
        if hasattr(mapped, "madvise"):
            mapped.madvise(mmap.MADV_DONTNEED)
        return block

    return read


def load(
    plan: Plan,
    files: Any,
    *,
    names: Callable[[str], Any] | None = None,
    missing: str = "error",
) -> dict[str, jax.Array]:
    """Reads the plan's parameters from safetensors files onto their planned shardings.

    Each process reads, from memory-mapped files, only the blocks its own devices'
    shards hold (``jax.make_array_from_callback``), so it works under
    ``jax.distributed`` and a host never holds a full copy of a sharded parameter.

    Args:
      plan: the plan to fill, from :func:`meshinit.plan` or an adapter's ``plan``
        (``meshinit.nnx.plan(factory)``); its meshes must be concrete.
      files: a ``.safetensors`` path, a list of them, or a directory holding the
        ``*.safetensors`` files of a sharded checkpoint.
      names: ``names(path)`` gives, for each plan path, the tensor's name in the
        files, a :class:`Tensor` (a name with a reshape and a transpose), or None for
        a path the files do not hold. Default: the plan path itself.
      missing: ``"error"`` (default): a named tensor absent from the files is an
        error. ``"skip"``: such paths are left out of the result, for ``existing=``
        and an init to make.

    Returns:
      Plan path -> ``jax.Array`` on the entry's sharding, cast to its dtype
      (``astype``), for every path that a tensor fills.

    Raises:
      PlanError: every tensor that is missing (with ``missing="error"``), whose
        shape after the transforms is not the planned one, or whose dtype is unknown,
        each naming the path, the tensor and both shapes; and a plan on abstract
        meshes. Raised before anything is read.
      TypeError: ``files``, ``names`` or ``missing`` are of the wrong kind.

    Examples:
      >>> def hf_names(path):  # nnx path -> Hugging Face name, (out, in) -> (in, out)
      ...     layer, rest = re.fullmatch(r"layers\\.(\\d+)\\.(.*)", path).groups()
      ...     return Tensor(f"model.layers.{layer}.{HF[rest]}.weight", permute=(1, 0))
      >>> loaded = meshinit.safetensors.load(
      ...     plan, "ckpt/", names=hf_names, missing="skip")  # doctest: +SKIP

      (The load needs a downloaded Hugging Face checkpoint in ``ckpt/``: not run in the tests.)
    """
    if missing not in ("error", "skip"):
        raise TypeError(f'missing must be "error" or "skip", got {missing!r}')
    index = _index(_files(files))
    problems: list[Problem] = []
    jobs: list[tuple[PlanEntry, _Stored, Tensor]] = []
    for entry in plan.entries:
        tensor = _target(entry, names)
        if tensor is None:
            continue
        if isinstance(entry.mesh, jax.sharding.AbstractMesh):
            problems.append(
                Problem(entry.path, "is planned on an AbstractMesh: load needs devices")
            )
            continue
        stored = index.get(tensor.name)
        if stored is None:
            if missing == "error":
                problems.append(Problem(entry.path, f"tensor {tensor.name!r} is not in the files"))
            continue
        if isinstance(stored.dtype, str):
            problems.append(
                Problem(entry.path, f"tensor {tensor.name!r} has dtype {stored.dtype}, unknown")
            )
            continue
        shape, why = _transformed(stored, tensor)
        if why is None and shape != entry.spec.shape:
            why = f"gives shape {shape}, planned {entry.spec.shape}"
        if why is not None:
            problems.append(
                Problem(entry.path, f"tensor {tensor.name!r}, stored {stored.shape}, {why}")
            )
            continue
        jobs.append((entry, stored, tensor))
    if problems:
        raise PlanError(problems, header="meshinit.safetensors.load:")
    out: dict[str, jax.Array] = {}
    try:
        for entry, stored, tensor in jobs:
            out[entry.path] = _array(entry, _reader(stored, tensor, entry.spec.dtype))
    except BaseException:
        for array in out.values():  # nothing half-loaded outlives a failed read
            array.delete()
        raise
    return out


def _array(entry: PlanEntry, read: Callable[[Any], np.ndarray]) -> jax.Array:
    """The entry's array, one block at a time: each distinct block of this process's
    devices is read once, put on each device that holds it, and dropped, so the host
    holds one block beside the arrays (``jax.make_array_from_callback`` keeps every
    block of the array until all are read)."""
    sharding, shape = entry.sharding, entry.spec.shape
    holders: dict[tuple[tuple[Any, Any, Any], ...], tuple[Any, list[Any]]] = {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        assert index is not None  # a NamedSharding gives every addressable device an index
        key = tuple((s.start, s.stop, s.step) for s in index)  # slices hash from 3.12 only
        holders.setdefault(key, (index, []))[1].append(device)
    shards = []
    for index, devices in holders.values():
        block = read(index)
        for device in devices:
            where = jax.sharding.SingleDeviceSharding(device, memory_kind=sharding.memory_kind)
            shards.append(jax.device_put(block, where))
        del block
    # dtype: a process whose devices hold none of it passes no shards to tell it
    return jax.make_array_from_single_device_arrays(shape, sharding, shards, dtype=entry.spec.dtype)
