"""The flax #5127 model, three parameters on three meshes, placed exactly.

Under ``nnx.jit`` this model comes out with GSPMDShardings on the wrong mesh (or fails
on current jax). meshinit plans each parameter to its own mesh and compiles per mesh.

Run: python examples/multi_mesh.py
"""

import jax

jax.config.update("jax_num_cpu_devices", 8)

import meshinit  # noqa: E402


def main() -> None:
    mesh1 = jax.make_mesh((2, 4), ("a", "b"))
    mesh2 = jax.make_mesh((2, 2, 2), ("x", "y", "z"))
    mesh3 = jax.make_mesh((8,), ("c",))
    ones = jax.nn.initializers.ones
    specs = {
        "small_linear1": meshinit.param(
            (16, 16), ones, axes=("A", "B"), mesh=mesh1, rules=(("A", "a"), ("B", "b"))
        ),
        "small_linear2": meshinit.param(
            (16, 16, 16),
            ones,
            axes=("X", "Y", "Z"),
            mesh=mesh2,
            rules=(("X", "x"), ("Y", "y"), ("Z", "z")),
        ),
        "small_linear3": meshinit.param(
            (16, 16), ones, axes=("C", None), mesh=mesh3, rules=(("C", "c"),)
        ),
    }
    plan = meshinit.plan(specs)
    print(plan, end="\n\n")
    # The context mesh, unrelated to all three: it does not get in the way.
    with jax.set_mesh(jax.make_mesh((4, 2), ("data", "context"))):
        params = meshinit.materialize(plan, jax.random.key(0))
    for entry in plan.entries:
        sharding = params[entry.path].sharding
        assert sharding == entry.sharding and sharding.mesh is entry.sharding.mesh
        print(f"{entry.path}: {sharding}")


if __name__ == "__main__":
    main()
