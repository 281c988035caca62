"""The benchmark models and the recipes that initialize them.

A model is a Llama-style stack: ``embed`` (vocab, embed), per layer ``q``, ``k``, ``v``,
``o``, ``gate``, ``up``, ``down`` (lecun_normal) and the norms ``n1``, ``n2`` (ones),
then ``head`` (embed, vocab). Every recipe returns the same tree,
``{"embed": ..., "layers": [{"q": ..., ...}, ...], "head": ...}``, so the placements of
all recipes are checked the same way.

Recipes on specs (meshinit's own declarations) and their anchors:
  meshinit   specs + ``meshinit.plan`` + ``meshinit.materialize``.
  nnx.jit    a flax nnx Module built inside ``nnx.jit``, each ``nnx.Param`` annotated
             with ``out_sharding`` and ``mesh``.
  jax.jit    the MaxText recipe: one jit with every parameter as an output and
             ``out_shardings``.
  eager-nnx  the same Module built eagerly; flax's eager sharding places each array.

Unchanged constructors (meshinit's constructor engine) and their anchors, the same
stack written as ordinary framework code:
  meshinit.nnx         ``meshinit.nnx.init`` of the ``nnx.jit`` recipe's Module.
  meshinit.nnx:2mesh   the same Module split over two disjoint stage meshes with
                       ``meshes=`` (see :func:`stage_meshes`).
  linen.jit            a linen Module (``nn.with_logical_partitioning`` params) by flax's
                       recipe: ``jax.jit(model.init, out_shardings=...)``.
  meshinit.linen       ``meshinit.linen.init`` of that Module.
  meshinit.linen:2mesh the same, split over the two stage meshes with ``meshes=``.
  eqx.filter_jit       an equinox stack of ``eqx.nn.Linear`` built in ``eqx.filter_jit``,
                       placed by ``eqx.filter_shard`` inside.
  meshinit.eqx         ``meshinit.eqx.init`` of that constructor with regex placements.

The recipes resolve logical axes with :func:`mesh_axes`, not with meshinit, so the
anchors do not depend on the library under test. Equinox stores a Linear's weight as
(out, in), so its leaves are checked against the transposed layout (:func:`expected`).
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
SPEC_RECIPES = (
    "meshinit",
    "meshinit:per_signature",
    "meshinit+xla-defaults",
    "nnx.jit",
    "jax.jit",
    "eager-nnx",
)
CONSTRUCTOR_RECIPES = (
    "meshinit.nnx",
    "meshinit.nnx:2mesh",
    "meshinit.nnx:table",
    "linen.jit",
    "meshinit.linen",
    "meshinit.linen:2mesh",
    "meshinit.linen:table",
    "eqx.filter_jit",
    "meshinit.eqx",
)
RECIPES = SPEC_RECIPES + CONSTRUCTOR_RECIPES


def is_spec_path(recipe: str) -> bool:
    """``meshinit``, ``meshinit:<strategy>``, ``meshinit+xla-defaults``: specs + plan."""
    return recipe.split(":")[0].split("+")[0] == "meshinit"


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


def nnx_module(model: Model, mesh: Any, annotated: bool = True) -> type:
    """A flax nnx Module class whose ``__init__(rngs)`` builds ``model``'s parameters;
    ``annotated=False`` leaves out their sharding metadata (a table places them)."""
    from flax import nnx

    dtype = model.jnp_dtype

    def param(rngs: nnx.Rngs, leaf: Leaf) -> nnx.Param:
        value = leaf.init()(rngs.params(), leaf.shape, dtype)
        if not annotated:
            return nnx.Param(value)
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


# ------------------------------------------------------- unchanged constructors


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


def meshinit_nnx_init(
    model: Model, mesh: Any, two_stages: bool = False, by_table: bool = False
) -> Any:
    """``meshinit.nnx.init`` of the ``nnx.jit`` recipe's Module, its code unchanged;
    ``by_table``: the same Module without sharding metadata, placed by :func:`table`."""
    from flax import nnx

    import meshinit.nnx

    Transformer = nnx_module(model, mesh, annotated=not by_table)
    meshes = stage_patterns(model, mesh) if two_stages else None
    placed = {"placements": table(model), "mesh": mesh} if by_table else {}
    module = meshinit.nnx.init(lambda: Transformer(nnx.Rngs(0)), meshes=meshes, **placed)
    return nnx_arrays(model, module)


def linen_module(model: Model, annotated: bool = True) -> Any:
    """A linen Module (an instance) that declares ``model``'s params as linen code does.

    Params are ``self.param(name, nn.with_logical_partitioning(init, axes), shape,
    dtype)``, named ``params.embed``, ``params.layers_<i>.<name>``, ``params.head``; its
    ``__call__`` looks up the embedding of int tokens.
    """
    import flax.linen as nn

    dtype = model.jnp_dtype

    def param(module: nn.Module, name: str, leaf: Leaf) -> Any:
        init = nn.with_logical_partitioning(leaf.init(), leaf.axes) if annotated else leaf.init()
        return module.param(name, init, leaf.shape, dtype)

    class Layer(nn.Module):
        @nn.compact
        def __call__(self, x: Any) -> Any:
            for name, leaf in model.layer().items():
                param(self, name, leaf)
            return x

    class Transformer(nn.Module):
        @nn.compact
        def __call__(self, tokens: Any) -> Any:
            tree = model.tree()
            x = param(self, "embed", tree["embed"])[tokens]
            for i in range(model.layers):
                x = Layer(name=f"layers_{i}")(x)
            param(self, "head", tree["head"])
            return x

    return Transformer()


def linen_tokens() -> Any:
    """The example input of :func:`linen_module`'s ``init``."""
    import numpy as np

    return np.zeros((1, 4), np.int32)


def linen_arrays(model: Model, variables: Any) -> dict[str, Any]:
    """The linen variables' param arrays (unboxed) in the common tree shape."""
    import flax.linen as nn

    params = nn.unbox(variables)["params"]
    return {
        "embed": params["embed"],
        "layers": [
            {n: params[f"layers_{i}"][n] for n in model.layer()} for i in range(model.layers)
        ],
        "head": params["head"],
    }


def linen_jit_init(model: Model, mesh: Any) -> Any:
    """flax's recipe: ``jax.eval_shape`` of ``module.init``, ``nn.get_partition_spec``,
    ``nn.logical_to_mesh_sharding``, then ``jax.jit(module.init, out_shardings=...)``.

    No mesh context: on Explicit axes the boxes' ``with_sharding_constraint`` would be
    an assertion (the arrays are made replicated and placed by the out_shardings).
    """
    import flax.linen as nn
    import jax

    module = linen_module(model)
    tokens = linen_tokens()
    key = jax.random.key(0)
    with nn.logical_axis_rules(RULES):
        abstract = jax.eval_shape(module.init, key, tokens)
        shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, RULES)
        variables = jax.jit(module.init, out_shardings=shardings)(key, tokens)
    return linen_arrays(model, variables)


def meshinit_linen_init(
    model: Model, mesh: Any, two_stages: bool = False, by_table: bool = False
) -> Any:
    """``meshinit.linen.init`` of :func:`linen_module`; ``two_stages`` splits it as
    ``meshinit.nnx:2mesh`` does, with ``meshes=``; ``by_table``: the Module without
    annotations, placed by :func:`table` (its logical names, through the rules)."""
    import jax

    import meshinit.linen

    module = linen_module(model, annotated=not by_table)
    staged: dict[str, Any] = {}
    if two_stages:
        staged["meshes"] = stage_patterns(model, mesh, prefix="params.", layer="layers_")
    if by_table:
        staged["placements"] = table(model, "params.", r"layers_\d+\.", logical=True)
    variables = meshinit.linen.init(
        module, jax.random.key(0), linen_tokens(), mesh=mesh, rules=RULES, **staged
    )
    return linen_arrays(model, variables)


def eqx_factory(model: Model) -> Any:
    """``factory(key) -> module``: the stack as equinox code, ``eqx.nn.Linear`` without
    bias for each matrix (weights (out, in)), ``eqx.nn.Embedding``, and ones for the norms.
    """
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    dtype = model.jnp_dtype
    matrices = [n for n, leaf in model.layer().items() if leaf.ndim == 2]

    class Layer(eqx.Module):
        q: eqx.nn.Linear
        k: eqx.nn.Linear
        v: eqx.nn.Linear
        o: eqx.nn.Linear
        gate: eqx.nn.Linear
        up: eqx.nn.Linear
        down: eqx.nn.Linear
        n1: jax.Array
        n2: jax.Array

        def __init__(self, key: Any):
            keys = jax.random.split(key, len(matrices))
            for name, k in zip(matrices, keys, strict=True):
                fan_in, fan_out = model.layer()[name].shape
                setattr(self, name, eqx.nn.Linear(fan_in, fan_out, False, dtype, key=k))
            self.n1 = jnp.ones((model.d,), dtype)
            self.n2 = jnp.ones((model.d,), dtype)

    class Transformer(eqx.Module):
        embed: eqx.nn.Embedding
        layers: list[Layer]
        head: eqx.nn.Linear

        def __init__(self, key: Any):
            keys = jax.random.split(key, model.layers + 2)
            self.embed = eqx.nn.Embedding(model.vocab, model.d, dtype=dtype, key=keys[0])
            self.layers = [Layer(k) for k in keys[1:-1]]
            self.head = eqx.nn.Linear(model.d, model.vocab, False, dtype, key=keys[-1])

    return Transformer


def eqx_layout(path: str, leaf: Leaf) -> Leaf:
    """The leaf as the equinox stack stores it: a Linear's weight is (out, in)."""
    if leaf.ndim == 2 and path != "embed":
        return Leaf(leaf.shape[::-1], leaf.axes[::-1])
    return leaf


def eqx_placements(model: Model) -> list[tuple[str, tuple[str, ...]]]:
    """``meshinit.eqx.init``'s placements: (regex over pytree paths, logical axes)."""
    tree = model.tree()
    out = [(r"embed\.weight", tree["embed"].axes)]
    for name, leaf in model.layer().items():
        if leaf.ndim == 2:
            out.append((rf"layers\.\d+\.{name}\.weight", eqx_layout(name, leaf).axes))
        else:
            out.append((rf"layers\.\d+\.{name}", leaf.axes))
    out.append((r"head\.weight", eqx_layout("head", tree["head"]).axes))
    return out


def eqx_arrays(model: Model, module: Any) -> dict[str, Any]:
    """The stack's arrays in the common tree shape, as stored (see :func:`eqx_layout`)."""
    return {
        "embed": module.embed.weight,
        "layers": [
            {
                n: getattr(layer, n).weight if leaf.ndim == 2 else getattr(layer, n)
                for n, leaf in model.layer().items()
            }
            for layer in module.layers
        ],
        "head": module.head.weight,
    }


def eqx_jit_init(model: Model, mesh: Any) -> Any:
    """How equinox users shard at init: ``eqx.filter_jit`` of the constructor, with
    ``eqx.filter_shard`` on every array inside (equinox's parallelism example), or
    ``jax.sharding.reshard`` where the mesh's axes are Explicit."""
    import equinox as eqx
    import jax

    factory = eqx_factory(model)
    key = jax.random.key(0)
    layouts = {path: eqx_layout(path, leaf) for path, leaf in leaves(model)}
    # A shardings tree of the module's structure: the weight of ``layers.0.q`` (a
    # Linear) is the model's ``layers.0.q``.
    shardings = jax.tree_util.tree_map_with_path(
        lambda p, _: sharding_of(mesh, layouts[path_str(p).removesuffix(".weight")]),
        eqx.filter_eval_shape(factory, key),
    )

    explicit = jax.sharding.AxisType.Explicit in tuple(mesh.axis_types)

    @eqx.filter_jit
    def create(key: Any) -> Any:
        module = factory(key)
        if not explicit:
            return eqx.filter_shard(module, shardings)
        # filter_shard is with_sharding_constraint, which jax rejects on Explicit axes
        # ("use reshard"): the same, through reshard.
        arrays, static = eqx.partition(module, eqx.is_array)
        return eqx.combine(jax.sharding.reshard(arrays, shardings), static)

    with jax.set_mesh(mesh):  # Explicit shardings inside a jit need the mesh in context
        module = create(key)
    return eqx_arrays(model, module)


def meshinit_eqx_init(model: Model, mesh: Any) -> Any:
    import jax

    import meshinit.eqx

    module = meshinit.eqx.init(
        eqx_factory(model), jax.random.key(0), eqx_placements(model), mesh=mesh, rules=RULES
    )
    return eqx_arrays(model, module)


_RUN = {
    "nnx.jit": nnx_jit_init,
    "eager-nnx": eager_nnx_init,
    "meshinit.nnx": meshinit_nnx_init,
    "meshinit.nnx:2mesh": lambda model, mesh: meshinit_nnx_init(model, mesh, two_stages=True),
    "meshinit.nnx:table": lambda model, mesh: meshinit_nnx_init(model, mesh, by_table=True),
    "linen.jit": linen_jit_init,
    "meshinit.linen": meshinit_linen_init,
    "meshinit.linen:2mesh": lambda model, mesh: meshinit_linen_init(model, mesh, two_stages=True),
    "meshinit.linen:table": lambda model, mesh: meshinit_linen_init(model, mesh, by_table=True),
    "eqx.filter_jit": eqx_jit_init,
    "meshinit.eqx": meshinit_eqx_init,
}


def run(recipe: str, model: Model, mesh: Any, seed: int = 0) -> Any:
    """Initializes ``model`` with ``recipe``; the arrays may still be in flight.

    ``seed`` is the spec path's and ``jax.jit``'s; the constructors use their own
    (``nnx.Rngs(0)``, ``jax.random.key(0)``).
    """
    import jax

    if is_spec_path(recipe):
        return meshinit_init(model, mesh, seed)
    if recipe == "jax.jit":
        return fused_jit(model, mesh)(jax.random.key(seed))
    if recipe in _RUN:
        return _RUN[recipe](model, mesh)
    raise ValueError(f"unknown recipe {recipe!r}; known: {', '.join(RECIPES)}")


def preload(recipe: str) -> None:
    """Imports what ``recipe`` needs, so that no clock pays for imports."""
    import jax  # noqa: F401

    if recipe.startswith("meshinit"):
        import meshinit._run.materialize  # noqa: F401
    if "nnx" in recipe:
        from flax import nnx  # noqa: F401
    if "linen" in recipe:
        import flax.linen  # noqa: F401
    if "eqx" in recipe:
        import equinox  # noqa: F401
    if recipe.startswith("meshinit."):  # the adapter: meshinit.nnx, .linen, .eqx
        import importlib

        importlib.import_module(recipe.partition(":")[0])


def meshinit_options() -> dict[str, Any]:
    """meshinit's own CPU compiler options, as it passes them to the installed jaxlib."""
    from meshinit._run import compile as _compile

    return _compile.default_cpu_options()


def meshinit_key_impl() -> Any:
    """The key implementation meshinit traces its CPU programs with: jax's threefry2x32
    with a straight-line hash (the same bits)."""
    from meshinit._jax import threefry as _threefry

    return _threefry.STRAIGHT_LINE


def strategy_of(recipe: str) -> str:
    """The strategy of ``meshinit[:<name>][+xla-defaults]``: ``<name>``, or rounds."""
    from meshinit._run import options as _options

    base, _, flag = recipe.partition("+")
    if flag not in ("", "xla-defaults"):
        raise ValueError(f"unknown meshinit recipe flag {flag!r} in {recipe!r}")
    name = base.partition(":")[2] or _options.STRATEGY_NAMES[0]
    if name not in _options.STRATEGY_NAMES:
        known = ", ".join(_options.STRATEGY_NAMES)
        raise ValueError(f"meshinit has no strategy {name!r}; known: {known}")
    return name


def options_for(recipe: str) -> Any:
    """``meshinit.options(...)`` for ``meshinit[:<name>][+xla-defaults]``: a context.

    ``meshinit`` is the default strategy, ``meshinit:<name>`` another one; with
    ``+xla-defaults`` meshinit compiles with XLA's default options instead of its own
    CPU compiler options (executables are cached per options, so recipes can alternate
    in one process). Any other recipe gets meshinit's defaults.
    """
    import meshinit

    if not is_spec_path(recipe):
        return meshinit.options()
    xla_defaults = recipe.partition("+")[2] == "xla-defaults"
    return meshinit.options(
        strategy=strategy_of(recipe), compiler_options={} if xla_defaults else None
    )


# ----------------------------------------------------------------------------- checks


def _normalized(spec: Any, ndim: int) -> tuple[tuple[str, ...] | None, ...]:
    out = []
    for entry in (*spec, *[None] * (ndim - len(spec))):
        names = (entry,) if isinstance(entry, str) else tuple(entry or ())
        out.append(names or None)
    return tuple(out)


def expected(model: Model, mesh: Any, recipe: str = "meshinit") -> list[tuple[str, Leaf, Any]]:
    """(path, leaf as the recipe stores it, exact sharding) in ``jax.tree`` flatten order.

    For ``meshinit.nnx:2mesh`` each path's mesh is its stage's (:func:`stage_of`); for
    the equinox recipes a Linear's weight is (out, in) (:func:`eqx_layout`).
    """
    mesh_of = stage_of(model, mesh) if recipe.endswith(":2mesh") else (lambda path: mesh)
    layout = eqx_layout if "eqx" in recipe else (lambda path, leaf: leaf)
    out = []
    for path, leaf in leaves(model):
        stored = layout(path, leaf)
        out.append((path, stored, sharding_of(mesh_of(path), stored)))
    return out


def placement_problems(
    model: Model, mesh: Any, arrays: Any, limit: int = 5, recipe: str = "meshinit"
) -> list[str]:
    """Where ``arrays`` differ from the exact planned placement (empty if none).

    Checks each array's shape, dtype, mesh (devices, names, axis types), PartitionSpec,
    and the index and shape of every addressable shard, against :func:`expected` for
    ``recipe``.
    """
    import jax
    from jax.sharding import NamedSharding

    problems: list[str] = []
    got = jax.tree.leaves(arrays)
    want = expected(model, mesh, recipe)
    if len(got) != len(want):
        return [f"{len(got)} arrays for {len(want)} parameters"]
    for (path, leaf, sharding), array in zip(want, got, strict=True):
        s = getattr(array, "sharding", None)
        if not isinstance(array, jax.Array):
            problems.append(f"{path}: a {type(array).__name__}, not a jax.Array")
        elif array.shape != leaf.shape or array.dtype != model.jnp_dtype:
            problems.append(f"{path}: {array.dtype}{array.shape}, want {leaf.shape}")
        elif not isinstance(s, NamedSharding) or s.mesh != sharding.mesh:
            problems.append(f"{path}: placed by {s}, want {sharding}")
        elif _normalized(s.spec, leaf.ndim) != _normalized(sharding.spec, leaf.ndim):
            problems.append(f"{path}: {s.spec}, want {sharding.spec}")
        else:
            indices = sharding.devices_indices_map(leaf.shape)
            shard_shape = sharding.shard_shape(leaf.shape)
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
