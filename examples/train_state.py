"""Train after init: one jitted step over a multi-mesh model and its optimizer state,
then an orbax checkpoint of both, restored onto the exact shardings.

The parameters live on two meshes over the same 8 devices: a (2, 4) ("fsdp",
"tensor") mesh and an (8,) ("data",) mesh. ``meshinit.optax.init`` places adamw's
state like the parameters it mirrors, and ``out_shardings=meshinit.shardings(...)``
keeps every output on its own mesh, exactly. Without out_shardings, jit would put
every output on one mesh. Restoring into ``plan.abstract()`` and
``meshinit.optax.abstract(tx, plan)`` reads every array straight back onto its
sharding. Each run saves the next step number, so it can run any number of times
into the same directory.

Run: python examples/train_state.py [DIR]
     (without DIR, a fresh temporary directory that is removed at exit)
"""

import jax

jax.config.update("jax_num_cpu_devices", 8)

import argparse  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec  # noqa: E402

import meshinit  # noqa: E402
import meshinit.optax  # noqa: E402

D_IN, D_HIDDEN, D_OUT, BATCH = 64, 256, 32, 16


def model_specs() -> dict:
    # Auto axes: one jit may read and write arrays on several meshes when they share
    # the same devices. Explicit meshes reject mixing them ("Mesh for all inputs should
    # be equal"), see docs/train_state.md.
    model = jax.make_mesh((2, 4), ("fsdp", "tensor"), axis_types=(AxisType.Auto,) * 2)
    data = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    lecun = jax.nn.initializers.lecun_normal()
    return {
        "hidden": {
            "w": meshinit.param((D_IN, D_HIDDEN), lecun, mesh=model, axes=("fsdp", "tensor")),
            "b": meshinit.param((D_HIDDEN,), jax.nn.initializers.zeros, mesh=model),
        },
        "head": {"w": meshinit.param((D_HIDDEN, D_OUT), lecun, mesh=data, axes=("data", None))},
    }


def loss(params, x, y):
    h = jnp.tanh(x @ params["hidden"]["w"] + params["hidden"]["b"])
    return jnp.mean((h @ params["head"]["w"] - y) ** 2)


def toy_batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(step)
    x = rng.standard_normal((BATCH, D_IN)).astype(np.float32)
    return x, np.sin(x[:, :D_OUT])


def check(name: str, got, want) -> int:
    """Print each leaf whose sharding is not exactly ``want``'s; return how many."""
    wrong = 0
    flat = jax.tree_util.tree_flatten_with_path(got)[0]
    for (path, leaf), sharding in zip(flat, jax.tree.leaves(want), strict=True):
        if leaf.sharding != sharding:
            wrong += 1
            print(f"  {name}{jax.tree_util.keystr(path)}: WRONG {leaf.sharding}, want {sharding}")
    print(f"{name}: {len(flat) - wrong}/{len(flat)} shardings exact")
    return wrong


def run(directory: pathlib.Path) -> int:
    plan = meshinit.plan(model_specs())
    print(plan, end="\n\n")
    tx = optax.adamw(1e-2, weight_decay=1e-4)
    param_shardings = meshinit.shardings(plan.abstract())
    state_shardings = meshinit.shardings(meshinit.optax.abstract(tx, plan))

    def train_step(params, opt_state, x, y):
        value, grads = jax.value_and_grad(loss)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    step_fn = jax.jit(train_step, out_shardings=(param_shardings, state_shardings, None))
    # The batch goes in placed: its rows split over "fsdp" on the model mesh. Handed in
    # as numpy, its sharding is the compiler's choice, which jax 0.10.2 can fail to
    # express on the mesh it picks (IndivisibleError: shape=[1, 2, 4] is incompatible
    # with mesh_shape=OrderedDict([('data', 8)])).
    model_mesh = param_shardings["hidden"]["w"].mesh
    batch_sharding = NamedSharding(model_mesh, PartitionSpec("fsdp"))

    options = ocp.CheckpointManagerOptions(max_to_keep=2)
    with ocp.CheckpointManager(directory, options=options) as manager:
        step = manager.latest_step()
        if step is None:
            params = meshinit.materialize(plan, jax.random.key(0))
            opt_state = meshinit.optax.init(tx, params)
            print("initialized params and adamw state: no checkpoint in", directory)
            next_step = 0
        else:
            restored = manager.restore(
                step,
                args=ocp.args.StandardRestore(
                    {"params": plan.abstract(), "opt_state": meshinit.optax.abstract(tx, plan)}
                ),
            )
            params, opt_state = restored["params"], restored["opt_state"]
            print(f"restored step {step} from {directory}")
            next_step = step + 1
        wrong = check("params", params, param_shardings)
        wrong += check("opt_state", opt_state, state_shardings)

        params, opt_state, value = step_fn(
            params, opt_state, *jax.device_put(toy_batch(next_step), batch_sharding)
        )
        print(f"train step {next_step}: loss {float(value):.5f}, adam count {opt_state[0].count}")
        wrong += check("params after the step", params, param_shardings)
        wrong += check("opt_state after the step", opt_state, state_shardings)

        # orbax does not write over an existing step (save returns False), hence the
        # next step number.
        saved = {"params": params, "opt_state": opt_state}
        if not manager.save(next_step, args=ocp.args.StandardSave(saved)):
            print(f"step {next_step} was not saved")
            return 1
        manager.wait_until_finished()
        print(f"saved step {next_step}")

        back = manager.restore(
            next_step,
            args=ocp.args.StandardRestore(
                {"params": plan.abstract(), "opt_state": meshinit.optax.abstract(tx, plan)}
            ),
        )
    wrong += check("restored params", back["params"], param_shardings)
    wrong += check("restored opt_state", back["opt_state"], state_shardings)
    differ = [
        jax.tree_util.keystr(path)
        for (path, a), b in zip(
            jax.tree_util.tree_flatten_with_path(saved)[0], jax.tree.leaves(back), strict=True
        )
        if not np.array_equal(np.asarray(a), np.asarray(b))
    ]
    for path in differ:
        print(f"  restored{path}: values DIFFER from the saved ones")
    print(f"restored step {next_step}: {'values equal' if not differ else 'values DIFFER'}")
    print(f"{'all shardings exact' if not wrong else f'{wrong} shardings WRONG'}")
    return 1 if wrong or differ else 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", nargs="?", type=pathlib.Path)
    args = parser.parse_args(argv)
    if args.directory is not None:
        return run(args.directory.resolve())  # orbax wants an absolute path
    with tempfile.TemporaryDirectory(prefix="meshinit-train-") as tmp:
        return run(pathlib.Path(tmp) / "checkpoints")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
