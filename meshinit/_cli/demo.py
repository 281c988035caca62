"""``meshinit demo``: a small Llama-like model over five meshes of simulated CPU devices,
two of them disjoint pipeline stages, planned, materialized and checked."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # jax is imported lazily, inside the functions
    from jax.sharding import Mesh


def _demo_specs(devices: Sequence) -> tuple[dict, Mesh]:
    """A small Llama-like model spread over five meshes, two of them disjoint stages."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    import meshinit

    n = len(devices)
    half = n // 2
    lecun = jax.nn.initializers.lecun_normal
    ones = jax.nn.initializers.ones
    rules = (
        ("vocab", "tensor"),
        ("embed", "fsdp"),
        ("heads", "tensor"),
        ("mlp", "tensor"),
        ("expert", "expert"),
        ("norm", None),
    )
    main = jax.make_mesh((2, half), ("fsdp", "tensor"), devices=devices)  # Explicit axes
    moe = Mesh(np.array(devices).reshape(2, 2, n // 4), ("expert", "fsdp", "tensor"))  # Auto
    flat = jax.make_mesh((n,), ("tensor",), devices=devices)
    stages = [
        jax.make_mesh((2, half // 2), ("fsdp", "tensor"), devices=devices[i::2]) for i in range(2)
    ]  # interleaved, disjoint device sets

    def block(mesh):
        with meshinit.defaults(mesh=mesh, rules=rules):
            return {
                "attn": {
                    "q": meshinit.param((256, 256), lecun(), axes=("embed", "heads")),
                    "o": meshinit.param((256, 256), lecun(), axes=("heads", "embed")),
                },
                "mlp": {
                    "up": meshinit.param((256, 1024), lecun(), axes=("embed", "mlp")),
                    "down": meshinit.param((1024, 256), lecun(), axes=("mlp", "embed")),
                },
                "norm": meshinit.param((256,), ones, axes=("norm",)),
            }

    with meshinit.defaults(mesh=main, rules=rules):
        specs = {
            "embed": meshinit.param((4096, 256), lecun(), axes=("vocab", "embed")),
            "stages": [block(s) for s in stages],
            "moe": {
                "experts": meshinit.param(
                    (2, 256, 512), lecun(), mesh=moe, axes=("expert", "embed", "mlp")
                )
            },
            "head": meshinit.param(
                (256, 4096), lecun(), mesh=flat, axes=(None, "tensor"), rules=meshinit.MESH_AXES
            ),
        }
    context = jax.make_mesh((n,), ("data",), devices=devices)
    return specs, context


def demo(devices: int, png: str | None = None) -> int:
    if devices < 4 or devices % 4:
        print(f"meshinit demo: --devices must be a multiple of 4, got {devices}", file=sys.stderr)
        return 2
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", devices)
    import jax.numpy as jnp
    import numpy as np

    import meshinit

    specs, context = _demo_specs(jax.devices())
    plan = meshinit.plan(specs)
    print(plan)
    if png:  # the stages interleave over the devices: the devices figure shows how
        from . import png as _png

        print(f"\nwrote {' and '.join(_png.write(plan, png))}")
    print(
        f"\nmaterializing {len(plan.entries)} params in {len(plan.groups)} mesh groups, "
        f"under an unrelated jax.set_mesh({dict(context.shape)}) ..."
    )
    with jax.set_mesh(context):
        params = meshinit.materialize(plan, jax.random.key(0))
    arrays = jax.tree_util.tree_leaves(params)
    meshes = [g.mesh for g in plan.groups]
    rows = [("path", "planned", "actual sharding", "verdict")]
    exact = 0
    for entry, array in zip(plan.entries, arrays, strict=True):
        s = array.sharding
        ok = s == entry.sharding and s.mesh is entry.sharding.mesh
        exact += ok
        rows.append(
            (
                entry.path,
                _short(entry.sharding, meshes),
                _short(s, meshes),
                "exact" if ok else "WRONG",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    print()
    for r in rows:
        print("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    first = plan.entries[0]
    ref = jax.jit(lambda k: first.spec.init(k, first.spec.shape, first.spec.dtype))(
        meshinit.param_key(jax.random.key(0), first.path)
    )
    same = bool(jnp.array_equal(ref, arrays[0]))
    print(f"\nvalue contract: {first.path} == init(param_key(key, {first.path!r}), ...): {same}")
    verdict = exact == len(arrays) and same
    print(
        f"{exact}/{len(arrays)} placements exact"
        + ("" if verdict else "; FAILED")
        + f" ({np.dtype(arrays[0].dtype).name} on "
        f"{len(jax.devices())} simulated CPU devices)"
    )
    return 0 if verdict else 1


def _short(sharding, meshes) -> str:
    """``mesh 3 P('fsdp', 'tensor')``; the mesh is named by its index in the plan."""
    from .._format import describe_mesh

    if not hasattr(sharding, "mesh"):
        return type(sharding).__name__
    label = next(
        (f"mesh {i}" for i, m in enumerate(meshes) if m is sharding.mesh),
        describe_mesh(sharding.mesh),
    )
    return f"{label} {str(sharding.spec).removeprefix('PartitionSpec')}"
