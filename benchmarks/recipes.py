"""The recipes that initialize the benchmark models (``models.py``), by name.

Every recipe returns the same tree,
``{"embed": ..., "layers": [{"q": ..., ...}, ...], "head": ...}``, so the placements of
all recipes are checked the same way (``checks.py``). This module names them
(:data:`RECIPES`), runs one by name (:func:`run`), imports what one needs
(:func:`preload`) and sets meshinit's options for it (:func:`options_for`); it owns the
spec path and MaxText's recipe. The framework recipes live in ``recipes_nnx.py``,
``recipes_linen.py`` and ``recipes_eqx.py``.

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
                       ``meshes=`` (see ``models.stage_meshes``).
  linen.jit            a linen Module (``nn.with_logical_partitioning`` params) by flax's
                       recipe: ``jax.jit(model.init, out_shardings=...)``.
  meshinit.linen       ``meshinit.linen.init`` of that Module.
  meshinit.linen:2mesh the same, split over the two stage meshes with ``meshes=``.
  eqx.filter_jit       an equinox stack of ``eqx.nn.Linear`` built in ``eqx.filter_jit``,
                       placed by ``eqx.filter_shard`` inside.
  meshinit.eqx         ``meshinit.eqx.init`` of that constructor with regex placements.

The recipes resolve logical axes with ``models.mesh_axes``, not with meshinit, so the
anchors do not depend on the library under test. Equinox stores a Linear's weight as
(out, in), so its leaves are checked against the transposed layout
(``checks.expected``).
"""

from __future__ import annotations

from typing import Any

from models import RULES, Model, sharding_of
from recipes_eqx import eqx_jit_init, meshinit_eqx_init
from recipes_linen import linen_jit_init, meshinit_linen_init
from recipes_nnx import eager_nnx_init, meshinit_nnx_init, nnx_jit_init

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


# --------------------------------------------------- the spec path and MaxText's recipe


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


# ----------------------------------------------------------------- every recipe by name

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
