"""Issue 57's value cases for ``tpu.py``'s bits part: one parameter each, made by each of
meshinit's three recipes (:data:`RECIPES`) and by that recipe's jitted anchor, on the
mesh jax makes by default (Explicit axes) and on its all-Auto twin, tiled (the
platform's tiles) and whole (``meshinit.options(tile_bytes=0)``): per case, the
elements that differ and the largest distance in ulp against the anchor on the same
mesh (:func:`cases`).

- ``nnx``: ``meshinit.nnx.init`` of a Module whose ``nnx.Param`` holds the case's value,
  against ``nnx.jit`` of the same constructor (both under ``jax.set_mesh``);
- ``linen``: ``meshinit.linen.init`` of a Module whose ``self.param("w",
  nn.with_partitioning(make, axes, mesh=m), shape, dtype)`` calls the case's ``make``,
  against ``jax.jit(module.init, out_shardings=nn.get_sharding(...))`` as
  ``recipes_linen.linen_jit_init`` runs it (no mesh context);
- ``spec``: ``meshinit.param(shape, make, axes=..., mesh=m, dtype=...)`` planned and
  materialized with a key, against ``jax.jit(lambda k: make(param_key(k, path), shape,
  dtype), out_shardings=entry.sharding)`` under ``jax.set_mesh``.

The cases are section 2's table (normal(0.02) in bf16 and in f32 1-D, variance
scaling, a normal times a constant, a tanh·exp chain, a pow/atan2/rem chain, an iota
plus a normal, gamma), section 1's two tiled patterns (a bf16 normal times a small
f32 vector rounded to bf16, by columns and by rows), and issue 67's: the attack's
``|n|**2.5 + atan2(n, 0.3) + remainder(10 n, 3)`` over a normal (f32 (4099, 300), tiled
(192, 300) x 22, and bf16) and a float32 0-d ``normal(0.02)``. With ``cpu_check`` the shapes are
small, on the 8 simulated CPU devices. ``TPU_BITS_CASES`` (names joined by ``|``, each a
part of a case's name) runs only the cases it names; ``TPU_BITS_LOG`` names a file each
case's result is appended to as it comes (the child's own output is read only when it
ends), so a call cut short by its limit still shows what it reached.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

# meshinit's recipes, each against its jitted anchor (the module's docstring)
RECIPES = ("nnx", "linen", "spec")
# name: (TPU shape, CPU shape, dtype, make(key, shape, dtype))
Make = Callable[[Any, tuple[int, ...], Any], Any]


def _cases() -> dict[str, tuple[tuple[int, ...], tuple[int, ...], str, Make]]:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    normal = jax.random.normal
    bf16 = jnp.bfloat16

    def scaled(k, s, d):
        return nnx.initializers.normal(0.02)(k, s, d)

    def variance(k, s, d):
        init = nnx.initializers.variance_scaling(1.0, "fan_in", "normal", in_axis=1, out_axis=0)
        return init(k, s, d)

    def times_exp(k, s, d):
        return normal(k, s, d) * jnp.exp(jnp.float32(0.3)).astype(d)

    def times_cols(k, s, d):
        cols = (jnp.arange(s[-1], dtype=jnp.float32) / s[-1] + 1.0).astype(d)
        return normal(k, s, d) * cols

    def tanh_exp(k, s, d):
        a = normal(k, s, jnp.float32)
        return (jnp.tanh(a * 1.5) * jnp.exp(a * 0.25) - 0.1).astype(d)

    def pow_atan2_rem(k, s, d):
        a = jax.random.uniform(k, s, jnp.float32, 0.1, 2.0)
        return (jnp.power(a, 1.7) + jnp.arctan2(a, 0.7) + jnp.remainder(a * 3.1, 1.3)).astype(d)

    def chain_pow_atan2_rem(k, s, d):  # issue 67: the attack's chain, over a normal
        n = normal(k, s, jnp.float32)
        return (jnp.abs(n) ** 2.5 + jnp.arctan2(n, 0.3) + jnp.remainder(10 * n, 3)).astype(d)

    def iota_normal(k, s, d):
        return (jax.lax.broadcasted_iota(d, s, 1) * 0.001 + normal(k, s, d)).astype(d)

    def gamma(k, s, d):
        return jax.random.gamma(k, 2.0, s, d)

    def exp_cols(k, s, d):  # section 1: by columns
        small = jnp.exp(normal(jax.random.fold_in(k, 7), (s[-1],), jnp.float32)).astype(bf16)
        return normal(k, s, bf16) * small

    def log1p_rows(k, s, d):  # section 1: by rows
        small = jnp.log1p(jnp.arange(s[0]) * 1.0).astype(bf16).reshape(s[0], 1)
        return normal(k, s, bf16) * small

    big, cpu = (5003, 1031), (96, 40)
    return {
        "normal(0.02) bf16": (big, cpu, "bfloat16", scaled),
        "normal(0.02) f32 1-D": ((10007,), (1001,), "float32", scaled),
        "variance_scaling normal bf16": (big, cpu, "bfloat16", variance),
        "normal*exp(f32 0.3) f32": (big, cpu, "float32", times_exp),
        "normal*const(cols) bf16": (big, cpu, "bfloat16", times_cols),
        "tanh-exp chain f32": (big, cpu, "float32", tanh_exp),
        "pow-atan2-rem chain bf16": (big, cpu, "bfloat16", pow_atan2_rem),
        # issue 67: on Explicit, tiles of (192, 300) differed from whole in 891,008
        # elements (f32) and 40,094 (bf16); the scalar was 8 ulp off nnx.jit
        "chain_pow_atan2_rem f32": ((4099, 300), cpu, "float32", chain_pow_atan2_rem),
        "chain_pow_atan2_rem bf16": (big, cpu, "bfloat16", chain_pow_atan2_rem),
        "normal(0.02) f32 scalar": ((), (), "float32", scaled),
        "normal(0.02) f32 (1,)": ((1,), (1,), "float32", scaled),  # jit folds it too
        "iota*0.001+normal bf16": ((256, 20000), (16, 400), "bfloat16", iota_normal),
        "gamma f32": ((1230, 1000), (96, 40), "float32", gamma),
        "normal*exp(normal cols) bf16": (big, cpu, "bfloat16", exp_cols),
        "normal*log1p(rows) bf16": (big, cpu, "bfloat16", log1p_rows),
    }


def _axes(shape: tuple[int, ...], mesh: Any) -> tuple[str | None, ...]:
    """Rows on fsdp and columns on tensor where the mesh's axes divide them."""
    names = ("fsdp", "tensor")[: len(shape)]
    return tuple(n if shape[i] % mesh.shape[n] == 0 else None for i, n in enumerate(names))


def _explicit(mesh: Any) -> bool:
    from jax.sharding import AxisType

    return all(t == AxisType.Explicit for t in mesh.axis_types)


def meshes(mesh: Any) -> dict[str, Any]:
    """``mesh`` as jax makes it (Explicit axes) and its all-Auto twin."""
    from jax.sharding import AxisType, Mesh

    kinds = (AxisType.Explicit,) * len(mesh.axis_names)
    explicit = Mesh(mesh.devices, mesh.axis_names, axis_types=kinds)
    return {"explicit": explicit, "auto": Mesh(mesh.devices, mesh.axis_names)}


def _one(recipe: str, make: Make, shape: tuple[int, ...], dtype: Any, axes: tuple, m: Any):
    """``(made, want)``: two functions of a tiling's context, meshinit's recipe and its
    jitted anchor, each returning the one array."""
    import jax
    import jax.numpy as jnp

    import meshinit

    dtype = jnp.dtype(dtype)
    if recipe == "nnx":
        from flax import nnx

        import meshinit.nnx

        class One(nnx.Module):
            def __init__(self, rngs: Any) -> None:
                self.w = nnx.Param(make(rngs.params(), shape, dtype), out_sharding=axes)

        def factory() -> Any:
            return One(nnx.Rngs(0))

        def made() -> Any:
            with jax.set_mesh(m):
                return meshinit.nnx.init(factory).w.get_value()

        def want() -> Any:
            with jax.set_mesh(m):
                return nnx.jit(factory)().w.get_value()

        return made, want
    if recipe == "linen":
        import flax.linen as nn

        import meshinit.linen

        # A box's own mesh makes linen's unbox a with_sharding_constraint, which jax
        # refuses on Explicit axes (so does meshinit, with a PlanError that says so): on
        # the Explicit mesh the box names the axes only, and the mesh is the recipes'.
        boxed = None if _explicit(m) else m

        class Linen(nn.Module):
            @nn.compact
            def __call__(self) -> None:
                self.param("w", nn.with_partitioning(make, axes, mesh=boxed), shape, dtype)

        module = Linen()

        def made() -> Any:
            variables = meshinit.linen.init(module, jax.random.key(0), mesh=m)
            return nn.unbox(variables)["params"]["w"]

        def want() -> Any:
            # benchmarks/recipes_linen.py's linen_jit_init: no mesh context; the box's
            # own mesh places the value (nn.get_sharding reads it)
            key = jax.random.key(0)
            abstract = jax.eval_shape(module.init, key)
            out = jax.jit(module.init, out_shardings=nn.get_sharding(abstract, m))(key)
            return nn.unbox(out)["params"]["w"]

        return made, want
    # the spec path: one ParamSpec, planned and materialized with a key; the anchor is
    # init(param_key(key, path), shape, dtype) jitted onto the planned sharding
    spec = {"w": meshinit.param(shape, make, axes=axes, mesh=m, dtype=dtype)}
    planned = meshinit.plan(spec)
    (entry,) = planned.entries

    def made() -> Any:  # in the anchor's context: on Explicit axes it changes the bits
        with jax.set_mesh(m):
            return meshinit.materialize(planned, 0)["w"]

    def want() -> Any:
        with jax.set_mesh(m):
            fn = jax.jit(
                lambda k: make(meshinit.param_key(k, entry.path), shape, dtype),
                out_shardings=entry.sharding,
            )
            return fn(jax.random.key(0))

    return made, want


def _log(line: str) -> None:
    """``line`` appended to the file ``TPU_BITS_LOG`` names, if any."""
    if path := os.environ.get("TPU_BITS_LOG"):
        with open(path, "a") as f:
            print(line, file=f)


def cases(
    cpu_check: bool,
    mesh: Any,
    differences: Callable[[Any, Any], dict],
    recipes: Sequence[str] = RECIPES,
) -> dict:
    """Per ``"<mesh kind> <tiled|whole> <recipe> <case>"``: ``differences`` of
    meshinit's ``recipe`` (:data:`RECIPES`) against its jitted anchor on that mesh, with
    the parts of the name as ``kind``, ``tiling``, ``recipe`` and ``case``; every array
    deleted once compared. With ``cpu_check``, whole only (CPU tiles are larger than
    its shapes). A case that fails is ``{"error": ...}`` under ``"<mesh kind> <recipe>
    <case>"`` (with its ``kind``, ``recipe`` and ``case``)."""
    import meshinit

    found: dict[str, Any] = {}
    # on CPU the platform's tiles are larger than these arrays: tiled is whole there
    tilings = (("whole", 0),) if cpu_check else (("tiled", None), ("whole", 0))
    only = [part for part in os.environ.get("TPU_BITS_CASES", "").split("|") if part]
    for name, (tpu_shape, cpu_shape, dtype, make) in _cases().items():
        if only and not any(part in name for part in only):
            continue
        shape = cpu_shape if cpu_check else tpu_shape
        for kind, m in meshes(mesh).items():
            for recipe in recipes:
                parts = {"kind": kind, "recipe": recipe, "case": name}
                try:
                    made_fn, want_fn = _one(recipe, make, shape, dtype, _axes(shape, m), m)
                    want = want_fn()
                    for tiling, tile_bytes in tilings:
                        with meshinit.options(tile_bytes=tile_bytes):
                            made = made_fn()
                        d = differences(made, want)
                        # the same placement; == also compares the spelling (P(None,) and
                        # P() place a 1-D array alike)
                        d["same_sharding"] = made.sharding.is_equivalent_to(
                            want.sharding, made.ndim
                        )
                        d["equal_sharding"] = made.sharding == want.sharding
                        d["shardings"] = [str(made.sharding.spec), str(want.sharding.spec)]
                        found[f"{kind} {tiling} {recipe} {name}"] = {**d, **parts, "tiling": tiling}
                        _log(f"{kind} {tiling} {recipe} {name}: {d}")
                        made.delete()
                    want.delete()
                except Exception as e:  # noqa: BLE001 - reported per case, the others still run
                    error = f"{type(e).__name__}: {e}"[:300]
                    found[f"{kind} {recipe} {name}"] = {"error": error, **parts}
                    _log(f"{kind} {recipe} {name}: {error}")
                meshinit.clear_cache()
    return found


# What differs on purpose, by (platform, mesh kind, recipe, case), measured and stated in
# docs/concepts.md ("The value contract"): reported, not failures.
KNOWN: dict[tuple[str, str, str, str], str] = {
    ("cpu", "auto", "nnx", "gamma f32"): (
        "jax 0.10.2: meshinit inlines jax's _gamma call, so its rejection loop's c is "
        "a constant XLA folds with sqrt(2); in jit it is computed at run time "
        "(306 of 3,840 elements, 8 ulp)"
    ),
    # linen's two recipes run without a mesh context (recipes_linen.linen_jit_init), so
    # on the Explicit mesh too they compute as on Auto, where nnx's gamma differs
    ("cpu", "auto", "linen", "gamma f32"): (
        "jax 0.10.2: as nnx's gamma on Auto, meshinit.linen.init's engine inlines jax's "
        "_gamma call (280 of 3,840 elements, 7 ulp)"
    ),
    ("cpu", "explicit", "linen", "gamma f32"): (
        "jax 0.10.2: as on Auto (no mesh context in linen's recipes): 280 of 3,840 elements, 7 ulp"
    ),
}


def parts(name: str, d: dict) -> tuple[str, str, str, str]:
    """A result's (mesh kind, tiling, recipe, case); results written before the linen and
    spec recipes (``"<kind> <tiling> <case>"``, nnx only) read as nnx's."""
    if "case" in d:
        return d["kind"], d.get("tiling", ""), d["recipe"], d["case"]
    if "error" in d:
        kind, case = name.split(" ", 1)
        return kind, "", "nnx", case
    kind, tiling, case = name.split(" ", 2)
    return kind, tiling, "nnx", case


def failures(found: dict, platform: str) -> list[str]:
    """The cases that failed or differ from their anchor (less :data:`KNOWN`), or whose
    sharding is not the anchor's."""
    out = []
    for name, d in found.items():
        if "error" in d:
            out.append(f"bits case {name}: {d['error']}")
            continue
        kind, _, recipe, case = parts(name, d)
        if d["differ"] and (platform, kind, recipe, case) not in KNOWN:
            off = f"{d['differ']} of {d['elements']} differ, {d['max_ulp']} ulp"
            out.append(f"bits case {name}: {off}")
        if not d["same_sharding"]:
            out.append(f"bits case {name}: not the anchor's sharding")
    return out
