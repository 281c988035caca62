"""Llama-3-8B-shaped init on NVIDIA GPUs: meshinit (its spec path, and an unchanged nnx
Module through ``meshinit.nnx.init``) against the fused jax.jit recipe.

The model: 32 layers, d=4096, ffn=14336, vocab=128256, 32 query heads and 8 kv heads of
128, bf16 (16 GB). The mesh is (fsdp=1, tensor=n) over all local GPUs (or ``--devices
1``), with the CPU suite's rules. One process, persistent compilation cache off; a tiny
jit and a tiny random draw run first, so that neither recipe pays for the backend's
lazy start-up.

- cold: from after ``jax.devices()`` returned until every array is ready; meshinit
  includes building the specs and the plan, jax.jit its compile. Run once each,
  meshinit first; each result is deleted before the next.
- cold, unchanged nnx: ``meshinit.nnx.init`` of an ordinary nnx Module with the same
  shapes (each ``nnx.Param`` annotated with ``out_sharding`` and ``mesh``; the CPU
  suite's ``meshinit.nnx`` recipe). Run last, after meshinit's cache is emptied
  (``meshinit.clear_cache()``), so it compiles everything it runs.
- warm: re-init with a new key, best of ``--repeats``: meshinit's ``materialize`` of
  the same plan, and the compiled fused executable called again.

Run: python benchmarks/gpu.py [--devices 1] [--repeats 3]
     python benchmarks/gpu.py --cpu-check   # the same code on CPU with a tiny model

Without a GPU it prints a message and exits with status 0.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import checks
import recipes
import recipes_nnx
from harness import CompileClock, best_of, delete_arrays, warm_up_backend
from models import Model


def measure(model: Model, devices: list[Any], repeats: int) -> dict[str, Any]:
    import jax
    import numpy as np

    import meshinit

    clock = CompileClock()
    mesh = jax.make_mesh((1, len(devices)), ("fsdp", "tensor"), devices=devices)
    warm_up_backend()
    clock.reset()
    r: dict[str, Any] = {}

    start = time.perf_counter()
    plan = meshinit.plan(recipes.meshinit_specs(model, mesh))
    out = jax.block_until_ready(meshinit.materialize(plan, 0))
    r["meshinit_cold"] = time.perf_counter() - start
    r["meshinit_compile"], r["meshinit_compiles"] = clock.seconds, clock.count
    r["meshinit_problems"] = checks.placement_problems(model, mesh, out)
    delete_arrays(out)

    clock.reset()
    start = time.perf_counter()
    fused = recipes.fused_jit(model, mesh).lower(jax.random.key(0)).compile()
    out = jax.block_until_ready(fused(jax.random.key(0)))
    r["fused_cold"] = time.perf_counter() - start
    r["fused_compile"], r["fused_compiles"] = clock.seconds, clock.count
    r["fused_problems"] = checks.placement_problems(model, mesh, out)
    delete_arrays(out)

    seeds = iter(range(1, 10**6))
    clock.reset()
    r["meshinit_warm"] = best_of(lambda: meshinit.materialize(plan, next(seeds)), repeats)
    r["meshinit_warm_compiles"] = clock.count
    keys = jax.block_until_ready([jax.random.key(s) for s in range(1, repeats + 1)])
    key_iter = iter(keys)
    r["fused_warm"] = best_of(lambda: fused(next(key_iter)), repeats)

    meshinit.clear_cache()  # the spec path's executables are not the engine's to reuse
    clock.reset()
    start = time.perf_counter()
    out = jax.block_until_ready(recipes_nnx.meshinit_nnx_init(model, mesh))
    r["nnx_cold"] = time.perf_counter() - start
    r["nnx_compile"], r["nnx_compiles"] = clock.seconds, clock.count
    r["nnx_problems"] = checks.placement_problems(model, mesh, out, recipe="meshinit.nnx")
    delete_arrays(out)
    r["nbytes"] = model.nbytes
    r["mesh"] = dict(zip(mesh.axis_names, np.shape(mesh.devices), strict=True))
    return r


def table(r: dict[str, Any], device: str) -> str:
    gb = r["nbytes"] / 1e9
    rows = [
        ("meshinit cold (specs + plan + materialize)", r["meshinit_cold"], r["meshinit_compile"]),
        ("meshinit.nnx.init cold (unchanged nnx Module)", r["nnx_cold"], r["nnx_compile"]),
        ("jax.jit fused cold (compile + run)", r["fused_cold"], r["fused_compile"]),
        ("meshinit warm re-init (new key)", r["meshinit_warm"], None),
        ("jax.jit fused warm re-init (new key)", r["fused_warm"], None),
    ]
    lines = [
        f"{device}; mesh {r['mesh']}; {gb:.2f} GB of parameters",
        "",
        "| case | time | XLA compile | GB/s |",
        "|---|---|---|---|",
    ]
    for name, t, c in rows:
        compiled = "" if c is None else f"{c:.2f} s"
        lines.append(f"| {name} | {t:.3f} s | {compiled} | {gb / t:.2f} |")
    lines += [
        "",
        f"cold: meshinit / jax.jit = {r['meshinit_cold'] / r['fused_cold']:.3f}",
        f"cold: meshinit.nnx.init / jax.jit = {r['nnx_cold'] / r['fused_cold']:.3f}",
        f"warm throughput: jax.jit time / meshinit time = "
        f"{r['fused_warm'] / r['meshinit_warm']:.3f}",
        f"compilations: meshinit cold {r['meshinit_compiles']}, re-init "
        f"{r['meshinit_warm_compiles']}; meshinit.nnx.init {r['nnx_compiles']}; "
        f"jax.jit {r['fused_compiles']}",
    ]
    for who in ("meshinit", "nnx", "fused"):
        if r[f"{who}_problems"]:
            lines.append(f"{who} placements NOT exact: {r[f'{who}_problems']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--devices", default="all", help="'all' local GPUs, or a number")
    ap.add_argument("--repeats", type=int, default=3, help="warm re-inits (best of)")
    ap.add_argument("--cpu-check", action="store_true", help="tiny model on CPU; tests the script")
    args = ap.parse_args(argv)

    import jax

    jax.config.update("jax_enable_compilation_cache", False)
    if args.cpu_check:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", 8)
    devices = jax.devices()
    platform = devices[0].platform
    if platform != "gpu" and not args.cpu_check:
        print(f"no GPU: jax.devices()[0].platform is {platform!r}; nothing measured.")
        return 0
    if args.devices != "all":
        devices = devices[: int(args.devices)]
    model = Model.cpu(2) if args.cpu_check else Model.llama3_8b()
    start = time.perf_counter()
    r = measure(model, devices, args.repeats)
    device = f"{len(devices)} x {devices[0].device_kind}, jax {jax.__version__}"
    print(table(r, device))
    print(f"(the whole measurement took {time.perf_counter() - start:.0f} s)")
    return 1 if r["meshinit_problems"] or r["nnx_problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
