"""The parts of ``names=`` of :func:`meshinit.safetensors.load`: what fills one plan
path. :class:`Tensor` (a slice, a reshape, a transpose, a scale and an offset of one
stored tensor), :class:`Stack` and :class:`Concat` (several parts, as ``np.stack`` and
``np.concatenate`` join them, then reshaped and transposed), :class:`Fill` (a
constant, read from nowhere) and :class:`Pad` (a part padded with a constant), nested
as the layout needs. Each checks its fields as it is made (TypeError, ValueError);
:mod:`.layout` checks them against the stored tensors."""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Sequence
from typing import Any

import ml_dtypes  # noqa: F401 - np.dtype('bfloat16') by name
import numpy as np

from .part_fields import Index, ints, is_int, number, sizes, slices


@dataclasses.dataclass(frozen=True)
class Tensor:
    """A stored tensor, sliced, reshaped, transposed, scaled and offset into a parameter
    (or a part of one, in a :class:`Stack`, :class:`Concat` or :class:`Pad`).

    The parameter is ``stored[index].reshape(shape).transpose(permute)``, as numpy does
    them: ``index`` a basic slice (``np.s_[:4096]``, ``np.s_[:, 512:1024]``,
    ``np.s_[..., ::2]``: slices with a positive step, one per leading axis, at most one
    ``Ellipsis`` for the axes between; None for the whole tensor), so that one fused
    stored tensor (``qkv_proj``, ``gate_up_proj``) feeds several parameters, or every
    other column of one (``np.s_[:, 1::2]``) feeds one; ``shape`` row-major, with at
    most one ``-1`` for the size the others leave (None keeps the shape); then
    ``permute`` as for ``np.transpose``, negative axes counting from the end (None
    keeps the order). All three are views of the memory-mapped file: only the bytes
    of each shard are read (of a slice with a step, its elements; a remote object's
    small gaps between them may be fetched through, within ``max_inflight_bytes``). A
    slice that the reshape could not view without a copy is refused before anything
    is read.

    ``out_shape`` reshapes the transposed view once more, and may only merge axes
    that are side by side (``(d, heads, head_dim // 2, 2)`` to ``(d, heads,
    head_dim)``): MaxText's interleaved rotary layout is Hugging Face's halves,
    ``Tensor(name, shape=(heads, 2, head_dim // 2, -1), permute=(3, 0, 2, 1),
    out_shape=(d, heads, head_dim))``. Each block is read from the view and merged
    alone; a sharding whose blocks cut a merged axis other than along its outer
    axis is refused before anything is read.

    ``scale`` multiplies the values as MaxText's hooks do (its query scale ``1 /
    sqrt(head_dim)``) in their dtype ``compute_dtype`` (None: the planned dtype; MaxText's
    direct loader on bfloat16 files: bfloat16): the stored values cast to it, then
    ``(x.astype(np.float32) * np.float32(scale)).astype(x.dtype)`` (float64 stays
    float64), then cast to the planned dtype. ``offset`` adds a constant after the
    scale, rounded on its own: ``(x.astype(np.float32) + np.float32(offset))
    .astype(x.dtype)``, ``x + 1.0`` on a bfloat16 array (Gemma's norm scales, stored as
    ``scale - 1``). A value that overflows is a :class:`~meshinit.PlanError`.
    Floating-point tensors only, for both.

    A map written for tunix or MaxText transposes first, then reshapes. For a split
    of a torch ``(out, in)`` weight the two agree once the reshape is moved first:
    tunix's ``permute=(1, 0)`` then ``reshape=(d, heads, head_dim)`` of a
    ``(heads * head_dim, d)`` weight is ``Tensor(name, shape=(heads, head_dim, -1),
    permute=(2, 0, 1))``.

    In a rule table of ``names=``, ``name`` may use the groups of the rule's regex
    (``\\1``, ``\\g<layer>``), as :meth:`re.Match.expand` does.

    A float8 tensor (``F8_E4M3``, ``F8_E5M2``) planned as a wider float is read
    dequantized, with the ``<name>_scale_inv`` beside it (DeepSeek-V3's block scales),
    and refused where there is none, whatever config.json says: cast alone, a
    quantized weight's values are off by their block's scale. ``dequantize=False``
    says the float8 values are the weights themselves: they are cast to the planned
    dtype as stored, and a ``<name>_scale_inv`` beside them is not applied (nor read:
    it is then reported unused like any tensor no plan path claims, unless one does).

    Attributes:
      name: the tensor's name in the files (``model.layers.0.mlp.up_proj.weight``).
      shape: the shape to reshape the stored tensor (or its slice) to, or None.
      permute: the axis order after the reshape, or None.
      index: the slice of the stored tensor taken first, or None.
      scale: a Python float the values are multiplied by, or None.
      out_shape: the shape the transposed view is reshaped to last, merging axes
        that the transpose left side by side, or None.
      offset: a Python float added to the values (after ``scale``), or None.
      compute_dtype: the floating dtype of the scale and offset, or None (planned).
      dequantize: whether a float8 tensor planned as a wider float is read with its
        block scales (True, the default; refused without them), or cast as stored
        (False). Other tensors ignore it, except an MXFP4 pair (gpt-oss's ``_blocks``
        and ``_scales``), which has no plain cast: False is refused there.

    Raises:
      TypeError: a field of the wrong kind: ``index`` not basic slices with positive
        steps, ``scale`` or ``offset`` not a number, ``dequantize`` not a bool.
      ValueError: a shape with a negative size (or two ``-1``), a scale or offset that
        is not finite.

    Examples:
      >>> Tensor("model.layers.0.mlp.up_proj.weight", permute=(1, 0))  # (out, in) -> (in, out)
      Tensor(name='model.layers.0.mlp.up_proj.weight', shape=None, permute=(1, 0),
             index=None, scale=None, out_shape=None, offset=None)
      >>> heads, head_dim = 32, 128
      >>> Tensor("model.layers.0.self_attn.q_proj.weight",
      ...        shape=(heads, head_dim, -1), permute=(-1, 0, 1)).shape
      (32, 128, -1)
      >>> Tensor("model.layers.0.mlp.gate_up_proj.weight", index=np.s_[:14336]).index  # gate half
      (slice(None, 14336, None),)
      >>> Tensor("model.layers.0.mlp.up_proj.weight", index=np.s_[..., 1::2]).index  # odd columns
      (Ellipsis, slice(1, None, 2))
      >>> Tensor("model.norm.weight", offset=1.0).offset  # Gemma's norm: stored as scale - 1
      1.0
      >>> Tensor("lm_head.weight", dequantize=False)  # float8 values, cast as stored
      Tensor(name='lm_head.weight', shape=None, permute=None, index=None, scale=None,
             out_shape=None, offset=None, dequantize=False)
    """

    name: str
    shape: tuple[int, ...] | None = dataclasses.field(default=None, kw_only=True)
    permute: tuple[int, ...] | None = dataclasses.field(default=None, kw_only=True)
    index: Index | None = dataclasses.field(default=None, kw_only=True)
    scale: float | None = dataclasses.field(default=None, kw_only=True)
    out_shape: tuple[int, ...] | None = dataclasses.field(default=None, kw_only=True)
    offset: float | None = dataclasses.field(default=None, kw_only=True)
    compute_dtype: Any = dataclasses.field(default=None, kw_only=True, repr=False)
    dequantize: bool = dataclasses.field(default=True, kw_only=True, repr=False)

    def __repr__(self) -> str:  # compute_dtype and dequantize only where given: most tables'
        shown = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self) if f.repr]
        given = "" if self.compute_dtype is None else f", compute_dtype={self.compute_dtype.name!r}"
        given += "" if self.dequantize else ", dequantize=False"
        return f"Tensor({', '.join(shown)}{given})"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise TypeError(f"Tensor name must be a str, got {self.name!r}")
        if not isinstance(self.dequantize, bool):
            raise TypeError(
                f"Tensor dequantize must be a bool (False: cast float8 values as stored, "
                f"without scales), got {self.dequantize!r}"
            )
        if self.compute_dtype is not None:
            dtype = np.dtype(self.compute_dtype)  # TypeError for what is no dtype
            if "float" not in dtype.name:
                raise TypeError(f"Tensor compute_dtype must be a floating dtype, got {dtype}")
            object.__setattr__(self, "compute_dtype", dtype)
        shape, permute = ints(self.shape, "shape"), ints(self.permute, "permute")
        object.__setattr__(self, "index", slices(self.index))
        for what in ("scale", "offset"):
            value = getattr(self, what)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(f"Tensor {what} must be a Python float, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"Tensor {what} must be finite, got {value!r}")
            object.__setattr__(self, what, float(value))
        if shape is not None:
            if sum(d == -1 for d in shape) > 1 or any(d < -1 for d in shape):
                raise ValueError(
                    f"Tensor shape {shape}: sizes are non-negative, with at most one -1 "
                    f"(inferred, as numpy's reshape)"
                )
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "permute", permute)
        object.__setattr__(self, "out_shape", sizes(self.out_shape, "out_shape", "Tensor"))

    def sliced(self, stored: tuple[int, ...]) -> tuple[slice, ...]:
        """``index`` over every axis of a stored tensor of shape ``stored`` (its
        Ellipsis, or the axes it leaves out at the end, as whole slices), each slice's
        bounds resolved as numpy resolves them (a step of 1 as None); ValueError where
        numpy would refuse it."""
        index = self.index or ()
        given = [s for s in index if isinstance(s, slice)]
        if len(given) > len(stored):
            raise ValueError(f"index has {len(given)} slices for {len(stored)} axes")
        whole = (slice(None),) * (len(stored) - len(given))
        at = index.index(Ellipsis) if Ellipsis in index else len(index)
        padded = [*index[:at], *whole, *index[at + 1 :]]
        out = []
        for s, n in zip(padded, stored, strict=True):
            assert isinstance(s, slice)
            start, stop, step = s.indices(n)
            out.append(slice(start, stop) if step == 1 else slice(start, stop, step))
        return tuple(out)

    def transformed(self, stored: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The shape of the reshape (its ``-1`` resolved) and the transpose's axis order
        (negative axes resolved), for a stored tensor (after ``index``) of shape
        ``stored``; ValueError saying why where numpy would refuse them."""
        size = math.prod(stored)
        shape = stored
        if self.shape is not None:
            known = math.prod(d for d in self.shape if d != -1)
            if -1 in self.shape:
                if known == 0 or size % known:
                    raise ValueError(f"cannot be reshaped from {stored} to {self.shape}")
                shape = tuple(size // known if d == -1 else d for d in self.shape)
            elif known != size:
                raise ValueError(f"cannot be reshaped from {stored} to {self.shape}")
            else:
                shape = self.shape
        n = len(shape)
        if self.permute is None:
            return shape, tuple(range(n))
        order = tuple(a + n if a < 0 else a for a in self.permute)
        if sorted(order) != list(range(n)):
            raise ValueError(f"permute={self.permute} is not an order of {n} axes")
        return shape, order


def length(s: slice) -> int:
    """The length of a slice whose bounds are resolved (:meth:`Tensor.sliced`)."""
    return len(range(s.start, s.stop, s.step or 1))


def _part(part: Any, kind: str, i: int | None = None) -> Target:
    """A part of a Stack, a Concat (``parts[i]``) or a Pad (``part``), names read as
    Tensors. A Fill or a Pad without a shape takes the planned shape, which only a whole
    target has: refused here."""
    where = f"{kind} part" if i is None else f"{kind} parts[{i}]"
    if isinstance(part, str):
        return Tensor(part)
    if isinstance(part, Fill | Pad) and part.shape is None:
        what = type(part).__name__
        raise ValueError(
            f"{where} is a {what} with shape=None, which takes the planned shape and so "
            f"only fills a whole path; give the {what} its shape"
        )
    if isinstance(part, Tensor | Stack | Concat | Fill | Pad):
        return part
    raise TypeError(
        f"{where} must be a tensor name, a Tensor, a Stack, a Concat, a Fill or a Pad, got "
        f"{type(part).__name__}"
    )


def _joined(self: Joined) -> None:
    kind = type(self).__name__
    parts = self.parts
    if isinstance(parts, str | bytes) or not isinstance(parts, Sequence) or not parts:
        raise TypeError(f"{kind} parts must be a non-empty sequence of parts, got {parts!r}")
    if isinstance(self.axis, bool) or not is_int(self.axis):
        raise TypeError(f"{kind} axis must be an int, got {self.axis!r}")
    object.__setattr__(self, "parts", tuple(_part(p, kind, i) for i, p in enumerate(parts)))
    object.__setattr__(self, "axis", operator.index(self.axis))
    object.__setattr__(self, "out_shape", sizes(self.out_shape, "out_shape", kind))
    object.__setattr__(self, "permute", ints(self.permute, "permute", kind))


@dataclasses.dataclass(frozen=True)
class Joined:
    """What :class:`Stack` and :class:`Concat` share: parts joined along ``axis``, then
    merged to ``out_shape`` and transposed by ``permute``; each checked as it is made."""

    parts: tuple[Target, ...]
    axis: int
    out_shape: tuple[int, ...] | None = dataclasses.field(default=None, kw_only=True)
    permute: tuple[int, ...] | None = dataclasses.field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        _joined(self)


@dataclasses.dataclass(frozen=True)
class Stack(Joined):
    """Parts stacked along a new axis into one parameter, as ``np.stack`` does: every
    layer's stored tensor in the layer axis of a scanned model.

    Each part is a tensor name, a :class:`Tensor`, a :class:`Fill`, a :class:`Pad` or a
    nested :class:`Stack` or :class:`Concat`, and all must give the same shape.
    ``axis`` counts as in ``np.stack`` (negative from the end of the result). Each
    device reads only its own shard of each part it holds: a device whose shard spans
    layers 0-3 of a 16-layer stack reads its block of those four stored tensors, and
    nothing of the others.

    ``out_shape`` then reshapes the stacked result, merging axes that are side by
    side only (as :class:`Tensor`'s ``out_shape`` merges its transposed view), and
    ``permute`` transposes that, as ``np.transpose``: ``np.stack(parts, axis)
    .reshape(out_shape).transpose(permute)``. A sharding whose blocks cut a merged
    axis other than along its outer axis is refused before anything is read.

    In a rule table, the parts' names may use the groups of the rule's regex.

    Attributes:
      parts: the parts, in order (names are read as ``Tensor(name)``).
      axis: the new axis.
      out_shape: the shape the stacked parts are reshaped to, or None.
      permute: the axis order after ``out_shape``, or None.

    Raises:
      TypeError: no parts, a part of the wrong kind, an axis that is not an int.
      ValueError: a part that takes the planned shape (a Fill or a Pad with
        ``shape=None``), a negative size in ``out_shape``.

    Examples:
      >>> n = 4  # MaxText's scanned query kernel: [embed, layers, heads, head_dim]
      >>> Stack([Tensor(f"model.layers.{i}.self_attn.q_proj.weight",
      ...               shape=(8, 64, -1), permute=(2, 0, 1)) for i in range(n)], axis=1).axis
      1
      >>> Stack(["a", "b"], axis=0, out_shape=(2 * 64, 32), permute=(1, 0)).permute
      (1, 0)
    """


@dataclasses.dataclass(frozen=True)
class Concat(Joined):
    """Parts concatenated along an existing axis into one parameter, as
    ``np.concatenate`` does: k and v into a fused ``kv_einsum``, gate and up into
    ``gating_einsum``.

    Each part is a tensor name, a :class:`Tensor`, a :class:`Fill`, a :class:`Pad` or a
    nested :class:`Stack` or :class:`Concat`; the parts agree on every axis but
    ``axis`` (negative from the end). Each device reads only the parts, and the bytes
    of each, that its shard holds.

    ``out_shape`` then reshapes the joined result, merging axes that are side by side
    only, and ``permute`` transposes that: ``np.concatenate(parts, axis)
    .reshape(out_shape).transpose(permute)``. Qwen3.5's MaxText hook
    ``np.concatenate([q, k, v, z], axis=1).reshape(-1, d).T`` of four ``(d, h, n)``
    parts is ``Concat([q, k, v, z], axis=1, out_shape=(d * h_all, n),
    permute=(1, 0))``, with ``h_all`` the sum of their ``h``. A block must be a
    rectangle of the joined parts: a sharding whose blocks cut a merged axis other
    than along its outer axis is refused before anything is read.

    Attributes:
      parts: the parts, in order (names are read as ``Tensor(name)``).
      axis: the axis they are joined along.
      out_shape: the shape the joined parts are reshaped to, or None.
      permute: the axis order after ``out_shape``, or None.

    Raises:
      TypeError: no parts, a part of the wrong kind, an axis that is not an int.
      ValueError: a part that takes the planned shape (a Fill or a Pad with
        ``shape=None``), a negative size in ``out_shape``.

    Examples:
      >>> Concat(["model.layers.0.mlp.gate_proj.weight",
      ...         "model.layers.0.mlp.up_proj.weight"], axis=0).parts[1].name
      'model.layers.0.mlp.up_proj.weight'
      >>> Concat(["q", "k", "v", "z"], axis=1, out_shape=(4096, 128), permute=(1, 0)).out_shape
      (4096, 128)
    """


@dataclasses.dataclass(frozen=True)
class Fill:
    """A part full of one value, read from no file: a parameter (or part of one) that
    the checkpoint lacks and that has a known constant value (a bias of zeros, a norm
    scale of ones, the empty experts of a padded layer).

    ``value`` is cast to the planned dtype; a value that the dtype cannot hold (one
    that overflows it, a fraction or an out-of-range int for an integer dtype) is a
    :class:`~meshinit.PlanError` before anything is read. ``shape=None`` takes the
    planned shape: only where the Fill is the whole target of a path (a part of a
    :class:`Stack`, :class:`Concat` or :class:`Pad` gives its shape). A Fill reads no
    bytes, and :func:`~meshinit.safetensors.inventory` names no tensor for it.

    Attributes:
      value: a Python float, int or bool (a numpy scalar is taken as its ``.item()``).
      shape: the part's shape, or None for the planned one.

    Raises:
      TypeError: a value that is not a number, a shape that is not ints.
      ValueError: a negative size.

    Examples:
      >>> Fill(0.0)  # the whole parameter: zeros of the planned shape
      Fill(value=0.0, shape=None)
      >>> Stack(["model.layers.0.mlp.bias", Fill(0.0, (4096,))], axis=0).parts[1].shape
      (4096,)
    """

    value: bool | int | float
    shape: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "value", number(self.value, "Fill"))
        object.__setattr__(self, "shape", sizes(self.shape, "shape", "Fill"))


@dataclasses.dataclass(frozen=True)
class Pad:
    """A part placed at the origin of a larger shape, the rest filled with ``value``:
    ``np.pad(part, [(0, s - n) for s, n in zip(shape, part.shape)],
    constant_values=value)``. A vocabulary padded to a multiple of the devices, the
    heads of a model widened for tensor parallelism.

    ``part`` is a tensor name, a :class:`Tensor`, a :class:`Stack`, a :class:`Concat`,
    a :class:`Fill` or another Pad (with a shape). ``shape=None`` takes the planned
    shape: only where the Pad is the whole target of a path. A shape of another rank
    than the part's, or smaller on any axis, is a :class:`~meshinit.PlanError` naming
    the part before anything is read. The padding is read from nowhere: a device whose
    block lies wholly in it reads nothing, and one whose block overlaps the part reads
    only the part's bytes in its block. ``value`` is cast to the planned dtype as a
    :class:`Fill`'s is.

    In a rule table, the part's names may use the groups of the rule's regex.

    Attributes:
      part: what is padded (a name is read as ``Tensor(name)``).
      shape: the padded shape, or None for the planned one.
      value: the padding's value (zeros by default).

    Raises:
      TypeError: a part, shape or value of the wrong kind.
      ValueError: a part that takes the planned shape (a Fill or a Pad with
        ``shape=None``), a negative size.

    Examples:
      >>> Pad("model.embed_tokens.weight")  # to the planned shape, zeros
      Pad(part=Tensor(name='model.embed_tokens.weight', shape=None, permute=None,
          index=None, scale=None, out_shape=None, offset=None), shape=None, value=0)
      >>> Pad(Tensor("lm_head.weight", permute=(1, 0)), (4096, 32768)).shape
      (4096, 32768)
    """

    part: Target
    shape: tuple[int, ...] | None = None
    value: bool | int | float = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "part", _part(self.part, "Pad"))
        object.__setattr__(self, "shape", sizes(self.shape, "shape", "Pad"))
        object.__setattr__(self, "value", number(self.value, "Pad"))


Target = Tensor | Stack | Concat | Fill | Pad
"""What fills one plan path: a stored tensor, parts of several, or a constant."""

PARTS = (Tensor, Stack, Concat, Fill, Pad)
"""Each kind of :data:`Target`, for ``isinstance``."""


def leaves(target: Target) -> list[Tensor]:
    """Every :class:`Tensor` of ``target``, in order (a :class:`Fill` has none)."""
    if isinstance(target, Tensor):
        return [target]
    if isinstance(target, Fill):
        return []
    if isinstance(target, Pad):
        return leaves(target.part)
    return [t for part in target.parts for t in leaves(part)]
