"""Float8 block-scaled weights for an export, made on the devices: the reverse of
:mod:`.decode`, in DeepSeek's published format (DeepSeek-V3/R1, Kimi K2, the Qwen3 FP8
releases).

A weight ``W`` of shape ``(..., R, C)`` is stored as ``W`` in ``float8_e4m3fn`` and
``W_scale_inv`` in float32, one scale per ``128 x 128`` block (the last blocks ragged),
so that ``float32(w[i, j]) * scale_inv[i // 128, j // 128]`` (DeepSeek's
``weight_dequant``, what :mod:`.decode` computes) gives the weight back within float8's
rounding. :func:`quantize` makes the pair with the bits of DeepGEMM's
``per_block_cast_to_fp8``, inside the export's ``jax.jit``, from a global array sharded
in any way. :func:`converted` says which stored tensors are quantized,
:func:`not_converted` what ``config.json`` lists as left unquantized, and
:func:`quantization_config` the ``quantization_config`` that declares it all.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = (128, 128)
"""The block each scale covers: rows, columns (``weight_block_size``)."""

FP8_MAX = 448.0
"""float8_e4m3fn's largest finite value: a block's largest magnitude maps onto it."""

AMAX_FLOOR = 1e-4
"""The smallest block amax DeepGEMM divides by (``.clamp(1e-4)``): an all-zero block
gets the scale ``1e-4 / 448`` and zeros."""

_INV_MAX = np.float32(1) / np.float32(FP8_MAX)
"""``1 / 448`` rounded to float32. DeepGEMM's ``x_amax / 448.0`` runs on CUDA, where
PyTorch divides by a host scalar as ``a * (1 / b)`` (``BinaryDivTrueKernel.cu``):
the scale is ``amax * float32(1 / 448)``, which differs from ``amax / 448`` by an ulp in
about half the blocks."""


def quantize(x: jax.Array, block: tuple[int, int] = BLOCK) -> tuple[jax.Array, jax.Array]:
    """``x`` as float8 weights and their block scales, with the bits of DeepGEMM's
    ``per_block_cast_to_fp8`` (its ``test_core.py`` as first published: commit a6d97a1).

    ``x`` is padded with zeros to whole blocks; each block's ``amax`` is its largest
    magnitude in float32, at least ``1e-4``; ``w = float8_e4m3fn(x * (448 / amax))``,
    rounded to nearest even, the product taken in float32 (``x`` promoted first, as
    PyTorch promotes ``bfloat16 * float32``; float64 stays float64); ``scale_inv =
    amax / 448``. The two divisions are taken as PyTorch takes them on the GPU:
    ``448.0 / amax`` as ``(1 / amax) * 448`` (``Tensor.__rtruediv__`` is
    ``reciprocal() * other``) and ``amax / 448.0`` as ``amax * float32(1 / 448)``;
    ``1 / amax`` rounded as IEEE division rounds it on every backend
    (:func:`reciprocal`).

    Traceable under ``jax.jit``, on a global array sharded in any way: a block's amax
    is taken over the whole block wherever the shards cut it. On an Explicit mesh the
    last two axes keep their sharding where every shard holds whole blocks, and are
    gathered for the computation where one does not (``w`` is then placed back as ``x``
    was); on an Auto mesh the partitioner decides.

    A block whose amax reaches ``2**126`` takes a float32 subnormal reciprocal, which
    XLA flushes to zero (its weights become zeros, where the GPU keeps them); no
    trained weight is near.

    Args:
      x: float array of shape ``(..., R, C)``: a 2-D weight, or per-expert weights
        stacked as ``(E, R, C)``.
      block: the rows and columns each scale covers.

    Returns:
      ``(w, scale_inv)``: ``w`` float8_e4m3fn of ``x``'s shape, ``scale_inv`` float32
      of shape ``(..., ceil(R / block[0]), ceil(C / block[1]))``.

    Raises:
      TypeError: ``x`` is not a float array.
      ValueError: ``x`` has fewer than two axes, or ``block`` is not two positive ints.

    Example:
      >>> w, s = jax.jit(quantize)(jnp.ones((200, 300), jnp.bfloat16))
      >>> w.dtype, s.shape
      (dtype(float8_e4m3fn), (2, 3))
    """
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"quantize: x is {x.dtype}, not a float array; pass the weight's values")
    if x.ndim < 2:
        raise ValueError(
            f"quantize: x has shape {x.shape}: block scales cover (..., rows, columns); "
            f"a 1-D tensor is stored unquantized"
        )
    if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
        raise ValueError(f"quantize: block is {block!r}, not two positive ints (rows, columns)")
    b0, b1 = block
    *lead, rows, cols = x.shape
    nr, nc = -(-rows // b0), -(-cols // b1)
    wide = jnp.promote_types(x.dtype, jnp.float32)
    spec, kept, place = _layout(x, ((rows, b0), (cols, b1)))
    if kept != spec:  # a shard cuts a block: gather that axis for the computation
        x = jax.sharding.reshard(x, place(kept))
    x = x.astype(wide)
    if (nr * b0, nc * b1) != (rows, cols):
        x = jnp.pad(x, [(0, 0)] * len(lead) + [(0, nr * b0 - rows), (0, nc * b1 - cols)])
    grid = None if kept is None else (*kept[:-1], None, kept[-1], None)
    tiles = _reshaped(x, (*lead, nr, b0, nc, b1), place, grid)
    amax = jnp.max(jnp.abs(tiles).astype(jnp.float32), axis=(-3, -1), keepdims=True)
    amax = jnp.maximum(amax, jnp.float32(AMAX_FLOOR))
    factor = reciprocal(amax) * jnp.float32(FP8_MAX)
    w = (tiles * factor.astype(wide)).astype(jnp.float8_e4m3fn)
    w = _reshaped(w, (*lead, nr * b0, nc * b1), place, kept)[..., :rows, :cols]
    scale = _reshaped(amax * _INV_MAX, (*lead, nr, nc), place, kept)
    if kept != spec:
        w = jax.sharding.reshard(w, place(spec))
    return w, scale


def reciprocal(a: jax.Array) -> jax.Array:
    """``1 / a`` for float32 ``a``, rounded to nearest as IEEE division rounds it (as
    CPUs and CUDA's ``1.0f / a`` do), on any backend: a TPU's division is off by an ulp
    in about a fifth of cases, which moves float8 roundings. The significands are
    divided in int32 (25 quotient bits, the last one rounds: a reciprocal is never a
    tie) and the exponent put back exactly; an ``a`` whose reciprocal is not a normal
    float32 (``|a| >= 2**126``), a subnormal ``a``, an infinity or a NaN takes the
    backend's division."""
    bits = jax.lax.bitcast_convert_type(a, jnp.int32)
    exponent = (bits >> 23) & 0xFF
    divisor = (bits & 0x7FFFFF) | 0x800000  # the significand, in [2**23, 2**24)
    # floor(2**48 / divisor), bit by bit: 2**24 // divisor is 2 for a power of two, else 1
    quotient = jnp.where(divisor == 0x800000, 2, 1).astype(jnp.int32)
    rest = (1 << 24) - quotient * divisor
    for _ in range(24):
        rest = rest * 2
        bit = (rest >= divisor).astype(jnp.int32)
        rest = rest - bit * divisor
        quotient = quotient * 2 + bit
    significand = ((quotient + 1) >> 1).astype(jnp.float32)  # 2**47 / divisor, rounded
    power = jax.lax.bitcast_convert_type((254 - exponent) << 23, jnp.float32)  # 2**(127-e)
    exact = significand * jnp.float32(2.0**-24) * power
    normal = (exponent >= 1) & (exponent <= 252)
    return jnp.where(normal, jnp.copysign(exact, a), jnp.float32(1) / a)


def _layout(x: jax.Array, axes: tuple[tuple[int, int], tuple[int, int]]) -> tuple[Any, Any, Any]:
    """``x``'s Explicit sharding per axis, that sharding with each of the last two axes
    unsharded where a shard would cut a block, and what places an array by such a
    spec; both specs are None where no axis of ``x`` is Explicit (an Auto mesh, or
    none: the partitioner places everything)."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    entries = tuple(getattr(sharding, "spec", ()) or ())
    spec = entries + (None,) * (x.ndim - len(entries))
    if mesh is None or all(e is None for e in spec):
        return None, None, None
    kept = list(spec)
    for k, (n, b) in zip((-2, -1), axes, strict=True):
        if spec[k] is not None and n % (_count(mesh, spec[k]) * b):
            kept[k] = None

    def place(entries: Sequence[Any]) -> jax.sharding.NamedSharding:
        return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*entries))

    return spec, tuple(kept), place


def _count(mesh: Any, entry: Any) -> int:
    names = (entry,) if isinstance(entry, str) else tuple(entry)
    return math.prod(mesh.shape[n] for n in names)


def _reshaped(x: jax.Array, shape: tuple[int, ...], place: Any, spec: Any) -> jax.Array:
    """``x`` reshaped, placed by ``spec`` on an Explicit mesh (where a reshape must say
    where its result lives), as the partitioner likes elsewhere."""
    if place is None:
        return x.reshape(shape)
    return jax.lax.reshape(x, shape, out_sharding=place(spec))


# What is never quantized, as transformers matches modules_to_not_convert
# (quantizers_utils.should_convert_module: an entry matches a module whose name it
# matches as a regex from the start, or that ends with it). Generic, for any depth and
# family, where Qwen's FP8 releases list modules by name, per layer: the config.json of
# Qwen3-30B-A3B-Thinking-2507-FP8 and of Qwen3-Coder-480B-A35B-Instruct-FP8 lists
# "lm_head", then for each N "model.layers.N.input_layernorm", "model.layers.N.mlp.gate"
# and "model.layers.N.post_attention_layernorm"; Qwen3-Next-80B-A3B-Instruct-FP8's adds
# "mlp.shared_expert_gate", "self_attn.q_norm"/"k_norm" and its linear_attn parameters
# (none lists model.embed_tokens, stored unquantized all the same, nor model.norm).
# :func:`not_converted` computes such names for a model.
MODULES_TO_NOT_CONVERT: tuple[str, ...] = (
    "lm_head",  # the output head
    r".*embed",  # embed_tokens, embed, word_embeddings, patch_embed
    r"(.*\.)?(wte|wpe)$",  # GPT-2's token and position embeddings
    r".*norm",  # input_layernorm, post_attention_layernorm, q_norm, k_norm, norm
    r"(.*\.)?(gate|shared_expert_gate)$",  # MoE routers: mlp.gate, block_sparse_moe.gate
    r".*router",  # gpt-oss's mlp.router, Llama 4's feed_forward.router
)


def converted(name: str, shape: tuple[int, ...], modules_to_not_convert: Sequence[str]) -> bool:
    """Whether the stored tensor ``name`` of ``shape`` is quantized on export: a 2-D
    weight, or per-expert weights stacked 3-D, named ``<module>.weight`` (as HF FP8
    releases store them, each with ``<module>.weight_scale_inv``), whose module is
    matched neither by :data:`MODULES_TO_NOT_CONVERT` (the output head, embeddings,
    norms, MoE routers: never quantized) nor by ``modules_to_not_convert``. Biases,
    1-D tensors and other parameters never are.

    Entries match as transformers matches ``modules_to_not_convert``: a module is
    skipped when an entry matches its name as a regex from the start, or its name ends
    with the entry (``"lm_head"``, ``"model.layers.3.mlp.gate"``, ``"mlp.gate"``,
    ``"model.layers.*.self_attn"``).

    Args:
      name: the stored tensor's name (``model.layers.0.mlp.down_proj.weight``).
      shape: its stored shape.
      modules_to_not_convert: module names or patterns to leave unquantized as well.

    Raises:
      ValueError: an entry is not a valid regex.

    Example:
      >>> converted("model.layers.0.mlp.down_proj.weight", (2048, 768), ())
      True
      >>> converted("model.layers.0.mlp.gate.weight", (128, 2048), ())
      False
    """
    if len(shape) not in (2, 3) or not name.endswith(".weight"):
        return False
    module = _module(name)
    return not _matched(module, MODULES_TO_NOT_CONVERT) and not _matched(
        module, modules_to_not_convert
    )


def not_converted(
    names: Iterable[str],
    shapes: Mapping[str, tuple[int, ...]],
    modules_to_not_convert: Sequence[str] | None,
) -> list[str]:
    """What an export's ``config.json`` lists as ``modules_to_not_convert``.

    Given a list, exactly it. Given None, the module of every tensor of two or more
    axes that :func:`converted` leaves unquantized (``lm_head``, ``model.embed_tokens``,
    each ``model.layers.N.mlp.gate``...), by name, as Qwen's FP8 releases list them
    (in natural order: ``lm_head``, then layer 0, 1, ..., 10), so that readers that
    match names exactly (vLLM) skip them too. A tensor's module is its name less
    ``.weight`` (less its last part for another parameter: a fused ``experts`` module).

    Args:
      names: the stored tensors of the export.
      shapes: each one's stored shape.
      modules_to_not_convert: the list to write, or None for the default rule's.

    Raises:
      ValueError: a listed name would, as transformers matches it, also leave a
        quantized module unquantized (``x.gate`` matches ``x.gate_proj`` as a regex);
        pass ``modules_to_not_convert`` to say what to list.

    Example:
      >>> shapes = {"lm_head.weight": (8, 4), "model.norm.weight": (4,),
      ...           "model.layers.0.mlp.up_proj.weight": (8, 4)}
      >>> not_converted(shapes, shapes, None)
      ['lm_head']
    """
    if modules_to_not_convert is not None:
        return list(modules_to_not_convert)
    kept: set[str] = set()
    quantized: set[str] = set()
    for name in names:
        shape = tuple(shapes[name])
        if converted(name, shape, ()):
            quantized.add(_module(name))
        elif len(shape) >= 2:
            kept.add(_module(name))
    listed = sorted(kept - quantized, key=_natural)
    clashes = sorted(m for m in quantized if _matched(m, listed))
    if clashes:
        by = {m: next(e for e in listed if _matched(m, [e])) for m in clashes}
        shown = "; ".join(f"{e!r} matches {m!r}" for m, e in list(by.items())[:3])
        raise ValueError(
            f"modules_to_not_convert: listing the unquantized modules by name would also "
            f"leave quantized ones unquantized where transformers reads the list ({shown}); "
            f"pass modules_to_not_convert to say what config.json lists"
        )
    return listed


def quantization_config(
    modules_to_not_convert: Sequence[str], block: tuple[int, int] = BLOCK
) -> dict[str, Any]:
    """The ``quantization_config`` of ``config.json`` for an FP8 export, as DeepSeek's
    and Qwen's FP8 releases state it (what transformers' ``FineGrainedFP8Config`` and
    vLLM's ``Fp8Config`` read).

    Example:
      >>> quantization_config(["lm_head"])["weight_block_size"]
      [128, 128]
    """
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [block[0], block[1]],
        "modules_to_not_convert": list(modules_to_not_convert),
    }


def _module(name: str) -> str:
    """The module a stored tensor belongs to: ``a.b`` for ``a.b.weight`` or ``a.b.c``."""
    return name.rsplit(".", 1)[0] if "." in name else name


def _matched(module: str, entries: Iterable[str]) -> bool:
    """transformers' ``should_convert_module``, negated: its third test (``entry\\.``
    as a regex from the start) is implied by the regex test."""
    for entry in entries:
        try:
            if re.match(entry, module) or module.endswith(entry):
                return True
        except re.error as error:
            raise ValueError(
                f"modules_to_not_convert: {entry!r} is not a valid regex ({error}); "
                f"transformers matches each entry as one: escape it (re.escape)"
            ) from None
    return False


def _natural(name: str) -> list[Any]:
    """A sort key that orders digit runs as numbers (layer 2 before layer 10)."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]
