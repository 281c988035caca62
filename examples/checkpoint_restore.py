"""Restore or initialize, then save: the checkpoint pipeline, runnable any number of times.

plan -> restore the latest step into ``plan.abstract()`` if there is one, else
``meshinit.materialize`` -> save as the next step. The restore target carries the
planned shardings, so orbax reads every array straight onto its planned mesh, even
when the checkpoint was written from another layout (try ``--mesh 4x2`` on a second
run).

Run: python examples/checkpoint_restore.py [DIR] [--mesh 2x4|4x2]
     (without DIR, a fresh temporary directory that is removed at exit)
"""

import jax

jax.config.update("jax_num_cpu_devices", 8)

import argparse  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

import orbax.checkpoint as ocp  # noqa: E402

import meshinit  # noqa: E402

RULES = (("layers", None), ("vocab", "tensor"), ("embed", "fsdp"), ("mlp", "tensor"))
LAYERS, VOCAB, D, H = 4, 256, 64, 256


def model_specs(mesh: jax.sharding.Mesh) -> dict:
    lecun = jax.nn.initializers.lecun_normal()
    with meshinit.defaults(mesh=mesh, rules=RULES):
        return {
            "embed": meshinit.param((VOCAB, D), lecun, axes=("vocab", "embed")),
            "blocks": {
                "up": meshinit.stacked(
                    LAYERS, meshinit.param((D, H), lecun, axes=("embed", "mlp"))
                ),
                "down": meshinit.stacked(
                    LAYERS, meshinit.param((H, D), lecun, axes=("mlp", "embed"))
                ),
            },
            "norm": meshinit.param((D,), jax.nn.initializers.ones),  # replicated
        }


def run(directory: pathlib.Path, mesh_shape: tuple[int, int]) -> int:
    plan = meshinit.plan(model_specs(jax.make_mesh(mesh_shape, ("fsdp", "tensor"))))
    print(plan, end="\n\n")
    options = ocp.CheckpointManagerOptions(max_to_keep=2)
    with ocp.CheckpointManager(directory, options=options) as manager:
        step = manager.latest_step()
        if step is None:
            params = meshinit.materialize(plan, jax.random.key(0))
            print("initialized: no checkpoint in", directory)
            next_step = 0
        else:
            # Allocates only the restored arrays, each on its planned sharding.
            params = manager.restore(step, args=ocp.args.StandardRestore(plan.abstract()))
            print(f"restored step {step} from {directory}")
            next_step = step + 1

        leaves = jax.tree_util.tree_leaves(params)
        wrong = 0
        for entry in plan.entries:
            sharding = leaves[entry.leaf_index].sharding
            ok = sharding == entry.sharding
            wrong += not ok
            placed = f"{entry.path:12} {dict(sharding.mesh.shape)} {sharding.spec}"
            print(placed if ok else f"{placed}  WRONG, planned {entry.sharding}")

        # orbax does not write over an existing step (save returns False), hence the
        # next step number.
        if not manager.save(next_step, args=ocp.args.StandardSave(params)):
            print(f"step {next_step} was not saved")
            return 1
        manager.wait_until_finished()
    print(f"saved step {next_step}; {len(plan.entries) - wrong}/{len(plan.entries)} exact")
    return 1 if wrong else 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", nargs="?", type=pathlib.Path)
    parser.add_argument("--mesh", choices=["2x4", "4x2"], default="2x4")
    args = parser.parse_args(argv)
    mesh_shape = tuple(int(n) for n in args.mesh.split("x"))
    if args.directory is not None:
        return run(args.directory.resolve(), mesh_shape)  # orbax wants an absolute path
    with tempfile.TemporaryDirectory(prefix="meshinit-ckpt-") as tmp:
        return run(pathlib.Path(tmp) / "checkpoints", mesh_shape)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
