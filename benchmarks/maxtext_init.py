"""MaxText's own models: MaxText's init against meshinit's, cold, in fresh processes.

For MaxText's NNX ``Transformer`` and its linen wrapper, scanned and unrolled, at
``--layers`` decoder layers of a small config (emb 256, 4 heads of 64, mlp 1024, vocab
1024; MaxText's base.yml otherwise) on MaxText's own mesh (fsdp=4, tensor=2) of 8
simulated CPU devices, with MaxText's own logical axis rules:

- ``maxtext``: MaxText's own init. NNX: ``create_nnx_abstract_model`` then
  ``create_nnx_sharded_model``, the path of ``from_pretrained``. linen:
  ``init_initial_state`` jitted onto ``nn.logical_to_mesh_sharding`` of its annotations,
  the recipe MaxText's linen trainer used.
- ``meshinit``: ``meshinit.nnx.init(factory, rules=...)`` with MaxText's own factory
  (``get_nnx_create_model_fn``), or ``meshinit.linen.init(model, keys, *inputs,
  mesh=..., rules=...)`` with the inputs and keys ``init_initial_state`` uses.

Each time runs from after the config and the mesh are made until every array is ready;
jax's persistent compilation cache is off. Best of ``--repeats`` processes.

MaxText needs Python 3.12 and jax >= 0.11.1 (``pip install 'maxtext[tpu]==0.2.5'`` in
a venv of its own). Where it is not installed, this prints a note and exits 0.

Run: python benchmarks/maxtext_init.py [--layers 2 8 32] [--repeats 2] [--only nnx|linen]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SIZE = {  # a small model: big enough that a layer's bytes count, small enough for CPU
    "base_emb_dim": 256,
    "base_num_query_heads": 4,
    "base_num_kv_heads": 4,
    "head_dim": 64,
    "base_mlp_dim": 1024,
    "vocab_size": 1024,
    "max_target_length": 64,
    "per_device_batch_size": 1,
}


def config_for(scan: bool, layers: int):
    from maxtext.configs import pyconfig
    from maxtext.utils.globals import MAXTEXT_CONFIGS_DIR

    return pyconfig.initialize(
        ["", os.path.join(MAXTEXT_CONFIGS_DIR, "base.yml")],
        **SIZE,
        base_num_decoder_layers=layers,
        scan_layers=scan,
        ici_fsdp_parallelism=4,
        ici_tensor_parallelism=2,
        dcn_data_parallelism=1,
        hardware="cpu",
        enable_checkpointing=False,
        dataset_type="synthetic",
        skip_jax_distributed_system=True,
        jax_cache_dir="",  # base.yml turns jax's persistent cache on: cold means cold
        log_config=False,
    )


def case(framework: str, scan: bool, layers: int, recipe: str) -> dict:
    """One cold init in this process."""
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import flax.linen as nn
    import numpy as np
    from maxtext.utils import maxtext_utils, maxtext_utils_nnx, model_creation_utils

    import meshinit

    config = config_for(scan, layers)
    jax.config.update("jax_enable_compilation_cache", False)
    mesh = maxtext_utils.get_mesh_from_config(config)
    rules = config.logical_axis_rules
    start = time.perf_counter()
    if framework == "nnx":
        if recipe == "maxtext":
            create, abstract = model_creation_utils.create_nnx_abstract_model(config, mesh)
            model = maxtext_utils_nnx.create_nnx_sharded_model(abstract, create, mesh=mesh)
        else:
            factory = model_creation_utils.get_nnx_create_model_fn(config, mesh)
            with jax.set_mesh(mesh):
                model = meshinit.nnx.init(factory, rules=rules)
        from flax import nnx

        out = jax.tree.leaves(nnx.state(model))
    else:
        model = model_creation_utils.from_config(config, mesh=mesh)
        key = jax.random.PRNGKey(config.init_weights_seed)
        if recipe == "maxtext":

            def init_variables():
                return maxtext_utils.init_initial_state(model, None, config, False, key).params

            with nn.logical_axis_rules(rules):
                abstract = jax.eval_shape(init_variables)
            shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, rules)
            with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
                out = jax.jit(init_variables, out_shardings=shardings)()
        else:
            params, dropout, aqt = jax.random.split(key, 3)
            tokens = np.ones((config.micro_batch_size_to_train_on, config.max_target_length), "i4")
            out = meshinit.linen.init(
                model,
                {"params": params, "dropout": dropout, "aqt": aqt},
                tokens,
                tokens,
                mesh=mesh,
                rules=rules,
                encoder_images=None,
                encoder_audios=None,
            )
        out = jax.tree.leaves(out)
    jax.block_until_ready(out)
    seconds = time.perf_counter() - start
    nbytes = sum(getattr(a, "nbytes", 0) for a in out)
    return {"seconds": seconds, "nbytes": nbytes}


def spawn(*args: str, timeout: float) -> dict:
    command = [sys.executable, __file__, "--case", *args]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}  # this checkout
    try:
        r = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    for line in reversed(r.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line.removeprefix("RESULT "))
    tail = [line for line in r.stderr.splitlines() if line.strip()][-2:]
    return {"error": f"exit {r.returncode}: " + " | ".join(tail)[-400:]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 8, 32])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--only", choices=["nnx", "linen"])
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--case", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:
        framework, scan, layers, recipe = args.case
        print("RESULT " + json.dumps(case(framework, scan == "scanned", int(layers), recipe)))
        return 0
    if importlib.util.find_spec("maxtext") is None:
        print(
            "benchmarks/maxtext_init.py: skipped: maxtext is not installed here (it needs "
            "Python 3.12: pip install 'maxtext[tpu]==0.2.5' in a venv of its own)"
        )
        return 0
    frameworks = [args.only] if args.only else ["nnx", "linen"]
    rows, failed = [], []
    for framework in frameworks:
        for scan in ("unrolled", "scanned"):
            for layers in args.layers:
                best: dict[str, dict] = {}
                for _ in range(args.repeats):  # the recipes take turns
                    for recipe in ("maxtext", "meshinit"):
                        r = spawn(framework, scan, str(layers), recipe, timeout=args.timeout)
                        shown = r.get("error") or f"{r['seconds']:.2f} s"
                        print(f"{framework} {scan} {layers} {recipe}: {shown}", file=sys.stderr)
                        if "error" in r:
                            failed.append(f"{framework} {scan} {layers} {recipe}: {r['error']}")
                        elif recipe not in best or r["seconds"] < best[recipe]["seconds"]:
                            best[recipe] = r
                theirs, ours = best.get("maxtext"), best.get("meshinit")
                ratio = f"{ours['seconds'] / theirs['seconds']:.3f}" if theirs and ours else ""
                cell = {k: f"{r['seconds']:.2f} s" for k, r in best.items()}
                rows.append(
                    f"| {framework} | {scan} | {layers} | {cell.get('maxtext', 'failed')} | "
                    f"{cell.get('meshinit', 'failed')} | {ratio} |"
                )
    print("| model | layers are | layers | MaxText's init | meshinit | meshinit / MaxText |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
    for line in failed:
        print(f"FAILED: {line}", file=sys.stderr)
    return 1 if any("meshinit:" in f for f in failed) else 0


if __name__ == "__main__":
    sys.exit(main())
