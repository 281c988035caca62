"""The benchmark models and the recipes that initialize them.

A model is a Llama-style stack: ``embed`` (vocab, embed), per layer ``q``, ``k``, ``v``,
``o``, ``gate``, ``up``, ``down`` (lecun_normal) and the norms ``n1``, ``n2`` (ones),
then ``head`` (embed, vocab). Every recipe returns the same tree,
``{"embed": ..., "layers": [{"q": ..., ...}, ...], "head": ...}``, so the placements of
all recipes are checked the same way.

Recipes:
  meshinit   specs + ``meshinit.plan`` + ``meshinit.materialize``.
  nnx.jit    a flax nnx Module built inside ``nnx.jit``, each ``nnx.Param`` annotated
             with ``out_sharding`` and ``mesh``.
  jax.jit    the MaxText recipe: one jit with every parameter as an output and
             ``out_shardings``.
  eager-nnx  the same Module built eagerly; flax's eager sharding places each array.

The recipes resolve logical axes with :func:`mesh_axes`, not with meshinit, so the
anchors do not depend on the library under test.
"""

from __future__ import annotations

import dataclasses
import math
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
RECIPES = (
    "meshinit",
    "meshinit:per_signature",
    "meshinit:fused_group",
    "meshinit+xla-defaults",
    "nnx.jit",
    "jax.jit",
    "eager-nnx",
)


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


def leaves(model: Model) -> list[tuple[str, Leaf]]:
    """(dot-joined path, leaf) in ``jax.tree`` flatten order."""
    import jax

    flat, _ = jax.tree_util.tree_flatten_with_path(model.tree())
    return [(".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in p), x) for p, x in flat]


def sharding_of(mesh: Any, leaf: Leaf) -> Any:
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    return NamedSharding(mesh, P(*mesh_axes(leaf.axes)))


# ----------------------------------------------------------------------------- recipes


def meshinit_specs(model: Model, mesh: Any) -> Any:
    import jax

    import meshinit

    with meshinit.defaults(mesh=mesh, rules=RULES, dtype=model.jnp_dtype):
        return jax.tree.map(
            lambda leaf: meshinit.param(leaf.shape, leaf.init(), axes=leaf.axes), model.tree()
        )


def meshinit_init(model: Model, mesh: Any, seed: int = 0) -> Any:
    """Specs, plan and materialize: all of meshinit's cost."""
    import meshinit

    return meshinit.materialize(meshinit.plan(meshinit_specs(model, mesh)), seed)


def fused_jit(model: Model, mesh: Any, key_impl: Any = None) -> Any:
    """MaxText's recipe: ``jax.jit(build, out_shardings=...)``, every parameter an output.

    Returns the jitted function of a key. With ``key_impl``, the key's data is traced
    under that implementation instead (the same values for meshinit's straight-line
    threefry, see :func:`meshinit_key_impl`).
    """
    import jax

    flat, treedef = jax.tree.flatten(model.tree())
    shardings = treedef.unflatten([sharding_of(mesh, leaf) for leaf in flat])
    dtype = model.jnp_dtype

    def build(key):
        if key_impl is not None:
            key = jax.random.wrap_key_data(jax.random.key_data(key), impl=key_impl)
        keys = jax.random.split(key, len(flat))
        return treedef.unflatten(
            [leaf.init()(k, leaf.shape, dtype) for k, leaf in zip(keys, flat, strict=True)]
        )

    return jax.jit(build, out_shardings=shardings)


def nnx_module(model: Model, mesh: Any) -> type:
    """A flax nnx Module class whose ``__init__(rngs)`` builds ``model``'s parameters."""
    from flax import nnx

    dtype = model.jnp_dtype

    def param(rngs: nnx.Rngs, leaf: Leaf) -> nnx.Param:
        value = leaf.init()(rngs.params(), leaf.shape, dtype)
        return nnx.Param(value, out_sharding=mesh_axes(leaf.axes), mesh=mesh)

    class Layer(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            for name, leaf in model.layer().items():
                setattr(self, name, param(rngs, leaf))

    class Transformer(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            tree = model.tree()
            self.embed = param(rngs, tree["embed"])
            self.layers = nnx.List([Layer(rngs) for _ in range(model.layers)])
            self.head = param(rngs, tree["head"])

    return Transformer


def nnx_arrays(model: Model, module: Any) -> dict[str, Any]:
    """The module's parameter arrays in the common tree shape."""
    return {
        "embed": module.embed[...],
        "layers": [{n: getattr(layer, n)[...] for n in model.layer()} for layer in module.layers],
        "head": module.head[...],
    }


def nnx_jit_init(model: Model, mesh: Any) -> Any:
    import jax
    from flax import nnx

    Transformer = nnx_module(model, mesh)

    @nnx.jit
    def create():
        return Transformer(nnx.Rngs(0))

    # Explicit-axes shardings inside a jit need the mesh in context.
    with jax.set_mesh(mesh):
        module = create()
    return nnx_arrays(model, module)


def eager_nnx_init(model: Model, mesh: Any) -> Any:
    from flax import nnx

    assert nnx.using_eager_sharding(), "flax's eager sharding is off"
    module = nnx_module(model, mesh)(nnx.Rngs(0))
    return nnx_arrays(model, module)


def run(recipe: str, model: Model, mesh: Any, seed: int = 0) -> Any:
    """Initializes ``model`` with ``recipe``; the arrays may still be in flight."""
    import jax

    if recipe.split(":")[0].split("+")[0] == "meshinit":
        return meshinit_init(model, mesh, seed)
    if recipe == "jax.jit":
        return fused_jit(model, mesh)(jax.random.key(seed))
    if recipe == "nnx.jit":
        return nnx_jit_init(model, mesh)
    if recipe == "eager-nnx":
        return eager_nnx_init(model, mesh)
    raise ValueError(f"unknown recipe {recipe!r}; known: {', '.join(RECIPES)}")


def preload(recipe: str) -> None:
    """Imports what ``recipe`` needs, so that no clock pays for imports."""
    import jax  # noqa: F401

    if recipe.startswith("meshinit"):
        import meshinit._materialize  # noqa: F401
    elif "nnx" in recipe:
        from flax import nnx  # noqa: F401


_MESHINIT_OPTIONS: dict[str, Any] | None = None


def meshinit_options() -> dict[str, Any]:
    """meshinit's own CPU compiler options (as shipped, whatever a recipe set since)."""
    import meshinit._materialize as materialize

    global _MESHINIT_OPTIONS
    if _MESHINIT_OPTIONS is None:
        _MESHINIT_OPTIONS = dict(materialize.CPU_COMPILER_OPTIONS)
    return dict(_MESHINIT_OPTIONS)


def meshinit_key_impl() -> Any:
    """The key implementation meshinit traces its CPU programs with: jax's threefry2x32
    with a straight-line hash (the same bits)."""
    from meshinit import _threefry

    return _threefry.STRAIGHT_LINE


def use_strategy(recipe: str) -> str:
    """Sets meshinit's strategy for ``meshinit[:<name>][+xla-defaults]``.

    ``meshinit`` is the default strategy, ``meshinit:<name>`` another one; with
    ``+xla-defaults`` meshinit compiles with XLA's default options instead of its own
    CPU compiler options (executables are cached per options, so recipes can alternate
    in one process). Returns the strategy's name.
    """
    import meshinit._materialize as materialize

    options = meshinit_options()
    base, _, flag = recipe.partition("+")
    if flag not in ("", "xla-defaults"):
        raise ValueError(f"unknown meshinit recipe flag {flag!r} in {recipe!r}")
    name = base.partition(":")[2] or materialize.DEFAULT_STRATEGY
    if name not in materialize.STRATEGIES:
        known = ", ".join(materialize.STRATEGIES)
        raise ValueError(f"meshinit has no strategy {name!r}; known: {known}")
    materialize.DEFAULT_STRATEGY = name
    materialize.CPU_COMPILER_OPTIONS.clear()
    if flag != "xla-defaults":
        materialize.CPU_COMPILER_OPTIONS.update(options)
    return name


# ----------------------------------------------------------------------------- checks


def _normalized(spec: Any, ndim: int) -> tuple[tuple[str, ...] | None, ...]:
    out = []
    for entry in (*spec, *[None] * (ndim - len(spec))):
        names = (entry,) if isinstance(entry, str) else tuple(entry or ())
        out.append(names or None)
    return tuple(out)


def placement_problems(model: Model, mesh: Any, arrays: Any, limit: int = 5) -> list[str]:
    """Where ``arrays`` differ from the exact planned placement (empty if none).

    Checks each array's shape, dtype, mesh (devices, names, axis types), PartitionSpec,
    and the index and shape of every addressable shard.
    """
    import jax
    from jax.sharding import NamedSharding

    problems: list[str] = []
    got = jax.tree.leaves(arrays)
    want = leaves(model)
    if len(got) != len(want):
        return [f"{len(got)} arrays for {len(want)} parameters"]
    for (path, leaf), array in zip(want, got, strict=True):
        expected = sharding_of(mesh, leaf)
        s = getattr(array, "sharding", None)
        if not isinstance(array, jax.Array):
            problems.append(f"{path}: a {type(array).__name__}, not a jax.Array")
        elif array.shape != leaf.shape or array.dtype != model.jnp_dtype:
            problems.append(f"{path}: {array.dtype}{array.shape}, want {leaf.shape}")
        elif not isinstance(s, NamedSharding) or s.mesh != mesh:
            problems.append(f"{path}: placed by {s}, want {expected}")
        elif _normalized(s.spec, leaf.ndim) != _normalized(expected.spec, leaf.ndim):
            problems.append(f"{path}: {s.spec}, want {expected.spec}")
        else:
            indices = expected.devices_indices_map(leaf.shape)
            shard_shape = expected.shard_shape(leaf.shape)
            for shard in array.addressable_shards:
                if shard.index != indices[shard.device] or shard.data.shape != shard_shape:
                    problems.append(f"{path}: shard on {shard.device} is {shard.index}")
                    break
    if len(problems) > limit:
        problems = [*problems[:limit], f"and {len(problems) - limit} more"]
    return problems


def value_problems(arrays: Any, seed: int, model: Model) -> list[str]:
    """meshinit's value contract: ``init(param_key(seed, path), shape, dtype)`` within 2 ulp."""
    import jax
    import numpy as np

    import meshinit

    problems = []
    for (path, leaf), array in zip(leaves(model), jax.tree.leaves(arrays), strict=True):
        key = meshinit.param_key(seed, path)
        ref = jax.jit(lambda k, leaf=leaf: leaf.init()(k, leaf.shape, model.jnp_dtype))(key)
        try:
            np.testing.assert_array_max_ulp(np.asarray(array), np.asarray(ref), maxulp=2)
        except AssertionError as e:
            problems.append(f"{path}: values differ from the contract: {str(e)[:200]}")
    return problems
