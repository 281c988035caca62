"""The benchmark models and where their arrays go, resolved without meshinit.

A model is a Llama-style stack: ``embed`` (vocab, embed), per layer ``q``, ``k``, ``v``,
``o``, ``gate``, ``up``, ``down`` (lecun_normal) and the norms ``n1``, ``n2`` (ones),
then ``head`` (embed, vocab): :class:`Model`, its parameters :class:`Leaf`. Where each
goes: :data:`RULES` (logical axes -> mesh axes, :func:`mesh_axes`, :func:`sharding_of`)
on the (fsdp=2, tensor=4) reference mesh :data:`CPU_MESH`; the two-stage split over two
disjoint meshes (:func:`stage_meshes`, ``meshes=``); and the same placement as a table
kept outside the model (:func:`table`, ``placements=``). The recipes (``recipes.py``)
and the checks (``checks.py``) share these, so the anchors do not depend on the library
under test.

Importing this module puts this checkout's meshinit first on ``sys.path``.
"""

from __future__ import annotations

import dataclasses
import math
import re
import sys
from pathlib import Path
from typing import Any

# Measure this checkout of meshinit, whatever is installed.
_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

RULES = (
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv", "tensor"),
    ("mlp", "tensor"),
)
CPU_MESH = ((2, 4), ("fsdp", "tensor"))


def mesh_axes(axes: tuple[str, ...]) -> tuple[str | None, ...]:
    """Logical axes -> mesh axes with :data:`RULES` (each logical name has one rule)."""
    table = dict(RULES)
    resolved = tuple(table[a] for a in axes)
    named = [a for a in resolved if a is not None]
    assert len(named) == len(set(named)), f"{axes} uses a mesh axis twice"
    return resolved


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One parameter: its shape and logical axes. Norms (1-D) are ones, else lecun."""

    shape: tuple[int, ...]
    axes: tuple[str, ...]

    def init(self) -> Any:
        import jax

        if len(self.shape) == 1:
            return jax.nn.initializers.ones
        return jax.nn.initializers.lecun_normal()

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)


@dataclasses.dataclass(frozen=True)
class Model:
    """A Llama-style stack: sizes of the embedding, attention and MLP, and the depth."""

    layers: int
    d: int = 256
    q: int = 256  # query heads * head_dim
    kv: int = 64  # kv heads * head_dim
    ffn: int = 1024
    vocab: int = 4096
    dtype: str = "float32"

    @classmethod
    def cpu(cls, layers: int, width: int = 1) -> Model:
        """The CPU reference model, its layers ``width`` times wider (vocab unchanged)."""
        return cls(layers, d=256 * width, q=256 * width, kv=64 * width, ffn=1024 * width)

    @classmethod
    def llama3_8b(cls) -> Model:
        return cls(32, d=4096, q=32 * 128, kv=8 * 128, ffn=14336, vocab=128256, dtype="bfloat16")

    @classmethod
    def llama3_405b(cls) -> Model:
        return cls(126, d=16384, q=128 * 128, kv=8 * 128, ffn=53248, vocab=128256, dtype="bfloat16")

    def layer(self) -> dict[str, Leaf]:
        d, f = self.d, self.ffn
        return {
            "q": Leaf((d, self.q), ("embed", "heads")),
            "k": Leaf((d, self.kv), ("embed", "kv")),
            "v": Leaf((d, self.kv), ("embed", "kv")),
            "o": Leaf((self.q, d), ("heads", "embed")),
            "gate": Leaf((d, f), ("embed", "mlp")),
            "up": Leaf((d, f), ("embed", "mlp")),
            "down": Leaf((f, d), ("mlp", "embed")),
            "n1": Leaf((d,), ("embed",)),
            "n2": Leaf((d,), ("embed",)),
        }

    def tree(self) -> dict[str, Any]:
        """The model as a tree of :class:`Leaf` (a plain leaf to ``jax.tree``)."""
        return {
            "embed": Leaf((self.vocab, self.d), ("vocab", "embed")),
            "layers": [self.layer() for _ in range(self.layers)],
            "head": Leaf((self.d, self.vocab), ("embed", "vocab")),
        }

    @property
    def num_params(self) -> int:
        per_layer = sum(leaf.size for leaf in self.layer().values())
        return 2 * self.vocab * self.d + self.layers * per_layer

    @property
    def num_specs(self) -> int:
        return 2 + 9 * self.layers

    @property
    def nbytes(self) -> int:
        import numpy as np

        return self.num_params * np.dtype(self.jnp_dtype).itemsize

    @property
    def jnp_dtype(self) -> Any:
        import jax.numpy as jnp

        return jnp.dtype(self.dtype)


def path_str(keypath: Any) -> str:
    """A ``jax.tree_util`` key path, dot-joined: ``layers.0.q`` (dict keys, indices, fields)."""
    parts = (getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in keypath)
    return ".".join(map(str, parts))


def leaves(model: Model) -> list[tuple[str, Leaf]]:
    """(dot-joined path, leaf) in ``jax.tree`` flatten order."""
    import jax

    flat, _ = jax.tree_util.tree_flatten_with_path(model.tree())
    return [(path_str(p), x) for p, x in flat]


def sharding_of(mesh: Any, leaf: Leaf) -> Any:
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    return NamedSharding(mesh, P(*mesh_axes(leaf.axes)))


# ---------------------------------------------------- where the constructors' arrays go


def stage_meshes(mesh: Any) -> tuple[Any, Any]:
    """Two disjoint (fsdp=2, tensor=2) meshes: devices 0-3 and 4-7, ``mesh``'s axis types.

    The axis names are ``mesh``'s, so the Module's own ``out_sharding`` metadata still
    resolves on either stage.
    """
    import jax

    devices = list(mesh.devices.flat)
    half = len(devices) // 2
    types = tuple(mesh.axis_types)
    return tuple(
        jax.make_mesh((2, half // 2), mesh.axis_names, axis_types=types, devices=part)
        for part in (devices[:half], devices[half:])
    )


def stage_split(model: Model) -> int:
    """Layers ``0 .. stage_split - 1`` (and ``embed``) go on stage 0, the rest and ``head``
    on stage 1."""
    return (model.layers + 1) // 2


def stage_of(model: Model, mesh: Any) -> Any:
    """The mesh of each dot-joined path in the two-stage split of ``model``."""
    first, second = stage_meshes(mesh)
    split = stage_split(model)

    def of(path: str) -> Any:
        head, _, rest = path.partition(".")
        if head == "embed" or (head == "layers" and int(rest.partition(".")[0]) < split):
            return first
        return second

    return of


def stage_patterns(model: Model, mesh: Any, prefix: str = "", layer: str = "layers.") -> list:
    """``meshes=`` for the two-stage split: ordered (regex, mesh), first match wins.

    Paths are nnx's (``embed``, ``layers.3.q``) by default; linen's with
    ``prefix="params."`` and ``layer="layers_"`` (``params.layers_3.q``).
    """
    first, second = stage_meshes(mesh)
    layers = "|".join(str(i) for i in range(stage_split(model)))
    start = re.escape(prefix)
    return [
        (rf"{start}embed", first),
        (rf"{start}{re.escape(layer)}(?:{layers})\..*", first),
        (r".*", second),
    ]


def table(
    model: Model, prefix: str = "", layer: str = r"layers\.\d+\.", logical: bool = False
) -> list:
    """``placements=`` that place ``model`` as its annotations do: one entry per
    parameter name (``embed``, ``head``, ``layers.<i>.<name>``), its axes a
    PartitionSpec of mesh axes, or (``logical``) the logical names."""
    from jax.sharding import PartitionSpec as P

    start = re.escape(prefix)
    tree = model.tree()

    def axes(leaf: Leaf) -> Any:
        return tuple(leaf.axes) if logical else P(*mesh_axes(leaf.axes))

    entries = [(rf"{start}{name}", axes(tree[name])) for name in ("embed", "head")]
    entries += [(rf"{start}{layer}{name}", axes(leaf)) for name, leaf in model.layer().items()]
    return entries
