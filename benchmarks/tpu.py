"""issue 51's table on one TPU: cold init by meshinit and by the frameworks' own recipes,
each recipe in a fresh process, and the restart, the bits, the load and the compile per
program that its goals name.

The model: the Llama-3-8B-shaped stack in bf16 (d=4096, ffn=14336, vocab=128256, 32
query and 8 kv heads of 128) at ``--layers`` layers (16: 9.08 GB), on the mesh (fsdp=1,
tensor=1) of one chip (``--mesh``). Parts (``--parts``, all by default):

- ``cold``: one fresh process per recipe: the spec path (``meshinit.plan`` +
  ``materialize``), ``meshinit.nnx.init`` and ``meshinit.linen.init`` of unchanged
  Modules, the fused ``jax.jit(out_shardings=...)``, ``nnx.jit`` of the constructor,
  ``jax.jit(model.init, out_shardings=...)`` (linen) and eager nnx. Cold: from after the
  backend's start until every array is ready. Compile: XLA's backend compile time summed
  over threads, the number of programs, the slowest one (``harness.CompileClock``). Warm
  re-init (new key, best of ``--repeats``) for the spec path and the fused jit. Every
  array's placement is checked (``checks.placement_problems``).
- ``restart``: jax's persistent compilation cache in a temporary folder; one process
  fills it (spec path, ``meshinit.nnx.init``, ``meshinit.linen.init``), then a fresh
  process per recipe is timed, with what it compiled (the goal: nothing). jax's own
  threshold of compile time is kept unless ``--cache-threshold-zero``.
- ``bits``: at ``--bits-layers`` layers of the same width, in f32 and bf16:
  ``meshinit.nnx.init`` against ``nnx.jit`` and eager nnx, ``meshinit.linen.init``
  against ``jax.jit(model.init)``: elements that differ, and the largest distance in ulp
  (``--bits-dtypes`` with no dtype leaves this out); then issue 57's cases
  (``tpu_bits.py``) for each recipe of ``--bits-recipes`` (``meshinit.nnx.init``,
  ``meshinit.linen.init``, the spec path; all by default, none leaves them out) on the
  Explicit mesh and its Auto twin, tiled and whole, each against its jitted anchor on
  the same mesh (``nnx.jit``, linen's ``jax.jit(module.init)``, ``jax.jit`` of
  ``init(param_key(key, path), ...)``).
- ``load``: ``--load-mib`` of bf16 safetensors (written once to a temporary folder, page
  cache warm) into device memory: ``meshinit.safetensors.load`` against
  ``jax.device_put`` of each memory-mapped tensor, ``safe_open`` (numpy) then
  ``device_put``, and orbax v1's safetensors layout where orbax is importable.
- ``depth``: meshinit's three recipes at ``--depth-layers`` layers: the slowest
  program's compile time there and at ``--layers`` (the goal: at most 2 s at both).

What a bare TPU machine needs on ``PYTHONPATH``: this checkout's root (``models.py``
puts it first on ``sys.path`` itself), and the packages ``import meshinit`` (jax,
numpy), ``meshinit.nnx`` and ``meshinit.linen`` (flax, with its optax, msgpack, rich,
treescope, pyyaml and etils), and ``meshinit.safetensors``'s load (safetensors) import;
orbax-checkpoint only for its anchor, tqdm only if a progress bar is shown. Nothing
here imports equinox or opens a socket.

Each part's processes run one at a time (``--jobs``, 2 with ``--cpu-check``; a TPU
serves one process). The parent never starts the TPU itself.

Run: python benchmarks/tpu.py [--layers 16] [--parts cold restart bits load depth]
         [--json results.json] [--cache-threshold-zero] [--timeout 400]
     python benchmarks/tpu.py --parts cold --json a.json     # a whole run at 16 layers
     python benchmarks/tpu.py --parts restart bits load depth --json b.json  # is ~12 min:
     python benchmarks/tpu.py --merge a.json b.json          # two device calls, one table
     python benchmarks/tpu.py --parts bits --bits-dtypes --bits-recipes linen spec
                                                # some of the cases only (merged with b's)
     python benchmarks/tpu.py --cpu-check   # every part on CPU, tiny model; asserts

It exits 1 if a process failed, a placement was not exact, a re-init or a restart
compiled, or meshinit's values differ from the jitted recipe's. Without a TPU (and
without ``--cpu-check``) it prints a message and exits with status 0.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import tpu_bits
import tpu_cases
import tpu_report
from harness import run_child

HERE = Path(__file__).resolve().parent
PARTS = ("cold", "restart", "bits", "load", "depth")
MESHINIT_ROWS = ("meshinit", "meshinit.nnx", "meshinit.linen")


def child(name: str, args: argparse.Namespace, **kwargs: Any) -> dict:
    """``tpu_cases.CHILDREN[name](**kwargs)`` in a fresh process (this script with
    ``--child``), with ``--timeout``; ``{"error": ...}`` if it fails."""
    command = [sys.executable, str(HERE / "tpu.py"), "--child", name, json.dumps(kwargs)]
    start = time.perf_counter()
    result = run_child(command, args.timeout)
    result["process_s"] = time.perf_counter() - start  # start-up and imports included
    return result


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def measure(args: argparse.Namespace, env: dict) -> dict:
    """Every part of ``args.parts``: its processes, ``args.jobs`` at a time (the restart's
    after the process that fills the cache); the results by part."""
    base = {"cpu_check": args.cpu_check, "mesh": args.mesh}
    results: dict[str, Any] = {"env": env, "layers": args.layers, "mesh": args.mesh}
    results["cache_threshold_zero"] = args.cache_threshold_zero
    parts = set(args.parts) - ({"depth"} if not args.depth_layers else set())
    # (part, row, what the process runs, its arguments); the second list waits for the first
    first: list[tuple[str, str, str, dict]] = []
    then: list[tuple[str, str, str, dict]] = []
    with contextlib.ExitStack() as folders:
        if "cold" in parts:
            cold = {**base, "layers": args.layers, "repeats": args.repeats}
            first += [("cold", r, "cold", {**cold, "recipe": r}) for r in tpu_cases.ROWS]
        if "restart" in parts:
            cache = folders.enter_context(tempfile.TemporaryDirectory(prefix="meshinit-cache-"))
            cached = {**base, "layers": args.layers, "cache_dir": cache}
            cached["threshold_zero"] = args.cache_threshold_zero
            first.append(("restart", "fill", "fill", {**cached, "names": list(MESHINIT_ROWS)}))
            then += [("restart", r, "cold", {**cached, "recipe": r}) for r in MESHINIT_ROWS]
        if "bits" in parts:
            bits = {**base, "layers": args.bits_layers, "dtypes": args.bits_dtypes}
            bits["case_recipes"] = args.bits_recipes
            first.append(("bits", "", "bits", bits))
        if "load" in parts:
            folder = folders.enter_context(tempfile.TemporaryDirectory(prefix="meshinit-load-"))
            log(f"writing {args.load_mib} MiB of bf16 safetensors ...")
            tpu_cases.write_checkpoint(Path(folder), args.load_mib)
            load = {**base, "directory": folder, "mib": args.load_mib, "repeats": args.repeats}
            first.append(("load", "", "load", load))
        if "depth" in parts:
            results["depth"] = {"layers": args.depth_layers}
            depth = {**base, "layers": args.depth_layers}
            first += [("depth", r, "cold", {**depth, "recipe": r}) for r in MESHINIT_ROWS]
        for tasks in (first, then):
            with ThreadPoolExecutor(args.jobs) as pool:
                done = pool.map(lambda task: _run(task, args), tasks)
                for (part, row, _, _), result in zip(tasks, done, strict=True):
                    if row:
                        results.setdefault(part, {})[row] = result
                    else:
                        results[part] = result
    return results


def _run(task: tuple[str, str, str, dict], args: argparse.Namespace) -> dict:
    part, row, name, kwargs = task
    size = f" at {kwargs['layers']} layers" if "layers" in kwargs else ""
    log(f"{part}: {row or name}{size} ...")
    return child(name, args, **kwargs)


def failures(results: dict, cpu_check: bool) -> list[str]:
    """What did not hold: a process that failed, a placement that is not exact, a
    re-init or a restart that compiled, and (in ``--cpu-check``, or on any platform
    where it is stated) meshinit's values against the jitted recipes'."""
    found = []

    def ran(where: str, r: dict) -> bool:
        if "error" in r:
            found.append(f"{where}: {r['error']}")
            return False
        if r.get("problems"):
            found.append(f"{where}: placements not exact: {r['problems']}")
        return True

    for recipe, r in results.get("cold", {}).items():
        if ran(f"cold {recipe}", r) and r.get("warm_compiles"):
            found.append(f"cold {recipe}: the warm re-init compiled {r['warm_compiles']} programs")
    for recipe, r in results.get("restart", {}).items():
        if recipe == "fill":
            if "error" in r:
                found.append(f"restart, filling the cache: {r['error']}")
        elif ran(f"restart {recipe}", r) and r["compiles"]:
            hint = "" if results.get("cache_threshold_zero") else " (--cache-threshold-zero?)"
            found.append(f"restart {recipe}: compiled {r['compiles']} programs{hint}")
    for recipe, r in results.get("depth", {}).items():
        if recipe != "layers":
            ran(f"depth {recipe}", r)
    if "bits" in results and ran("bits", results["bits"]):
        platform = results.get("env", {}).get("platform", "")
        for name, d in results["bits"].items():
            if name == "cases":
                found += tpu_bits.failures(d, platform)
            elif isinstance(d, dict) and "eager" not in name and d["differ"]:
                found.append(
                    f"bits {name}: {d['differ']} elements differ, up to {d['max_ulp']} ulp"
                )
    if "load" in results and ran("load", results["load"]):
        load = results["load"]
        for name in ("meshinit", "device_put"):  # the anchors after these are optional
            if "error" in load.get(name, {"error": "did not run"}):
                found.append(f"load {name}: {load.get(name, {}).get('error', 'did not run')}")
        if load.get("meshinit_vs_device_put", {}).get("differ"):
            found.append("load: meshinit's arrays differ from device_put's")
    if cpu_check:
        parts = [p for p in PARTS if p not in results]
        found += [f"part {p} did not run" for p in parts]
    return found


def merge(results: dict, more: dict) -> dict:
    """``results`` with ``more``'s parts; two bits parts (of one model, split by
    ``--bits-recipes`` over two calls) become one, with the cases of both."""
    bits = {**results.get("bits", {}), **more.get("bits", {})}
    cases = {**results.get("bits", {}).get("cases", {}), **more.get("bits", {}).get("cases", {})}
    merged = {**results, **more}
    if "bits" in results and "bits" in more:
        merged["bits"] = {**bits, "cases": cases} if cases else bits
    return merged


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--layers", type=int, default=None, help="depth of the table (16; CPU 1)")
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    ap.add_argument("--mesh", type=int, nargs=2, default=None, help="fsdp tensor (1 1; CPU 2 4)")
    ap.add_argument("--repeats", type=int, default=3, help="warm re-inits and loads (best of)")
    ap.add_argument("--bits-layers", type=int, default=1, help="depth of the bits' model")
    ap.add_argument("--depth-layers", type=int, default=None, help="(4; CPU 2); 0 skips")
    ap.add_argument("--bits-dtypes", nargs="*", choices=tpu_cases.DTYPES, default=None,
                    help="the stack's (float32 bfloat16; CPU float32); none: no stack")  # fmt: skip
    ap.add_argument("--bits-recipes", nargs="*", choices=tpu_bits.RECIPES,
                    default=list(tpu_bits.RECIPES),
                    help="issue 57's cases for these recipes (all); none: no cases")  # fmt: skip
    ap.add_argument("--load-mib", type=int, default=None, help="checkpoint size (2048; CPU 2)")
    ap.add_argument("--cache-threshold-zero", action="store_true",
                    help="restart: jax_persistent_cache_min_compile_time_secs=0")  # fmt: skip
    ap.add_argument("--jobs", type=int, default=None,
                    help="processes at once (1; CPU 2): a TPU serves one process")  # fmt: skip
    ap.add_argument("--timeout", type=float, default=400, help="seconds per process")
    ap.add_argument("--json", help="write every number here")
    ap.add_argument("--merge", nargs="+", help="print one table from these --json files")
    ap.add_argument("--cpu-check", action="store_true", help="tiny model on CPU; asserts")
    ap.add_argument("--child", nargs=2, metavar=("NAME", "JSON"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.child:
        name, kwargs = args.child
        print("RESULT " + json.dumps(tpu_cases.CHILDREN[name](**json.loads(kwargs))), flush=True)
        return 0
    if args.merge:
        results: dict[str, Any] = {}
        for path in args.merge:
            results = merge(results, json.loads(Path(path).read_text()))
        print(tpu_report.report(results))
        for line in failures(results, cpu_check=False):
            print(f"FAILED: {line}")
        return 0
    cpu = args.cpu_check
    args.layers = args.layers or (1 if cpu else 16)
    args.mesh = args.mesh or ([2, 4] if cpu else [1, 1])
    args.depth_layers = (2 if cpu else 4) if args.depth_layers is None else args.depth_layers
    if args.bits_dtypes is None:
        args.bits_dtypes = ["float32"] if cpu else list(tpu_cases.DTYPES)
    args.load_mib = args.load_mib or (2 if cpu else 2048)
    # The parent never starts a TPU itself: the chip serves one process at a time.
    env = tpu_cases.probe(True) if cpu else child("probe", args, cpu_check=False)
    if "error" in env:
        print(f"could not start jax: {env['error']}")
        return 1
    if env["platform"] != "tpu" and not cpu:
        print(f"no TPU: jax.devices()[0].platform is {env['platform']!r}; nothing measured.")
        return 0
    args.jobs = args.jobs or (2 if cpu else 1)
    if args.jobs > 1 and env["platform"] == "tpu":
        print(f"--jobs {args.jobs}: a TPU chip serves one process at a time; use --jobs 1")
        return 2
    start = time.perf_counter()
    results = measure(args, env)
    results["wall_s"] = time.perf_counter() - start
    print(tpu_report.report(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    found = failures(results, cpu)
    for line in found:
        print(f"FAILED: {line}")
    print(f"(the whole measurement took {results['wall_s']:.0f} s)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
