"""meshinit's CPU benchmark suite: cold init against the anchor recipes, depth scaling,
warm re-init, compile time, per-device and host memory, and planning.

Every measurement runs in a fresh process on 8 simulated CPU devices, persistent
compilation cache off. Cold times are the best of ``--repeats`` processes per case.

Run:
  python benchmarks/suite.py                       # everything; prints the tables
  python benchmarks/suite.py --out docs/performance.md --png docs/cold_vs_depth.png
  python benchmarks/suite.py --layers 8 32 --recipes meshinit jax.jit --repeats 3
  python benchmarks/suite.py --only constructor    # the unchanged constructors' cases
  python benchmarks/suite.py --smoke               # < 60 s, for CI; writes nothing
  python benchmarks/suite.py --only real-size      # 1B f32 and 8B bf16: cold, RSS, floor

The full run (no --recipes, --layers or --only) measures the spec path's cold cases at
every depth and the constructor engine's cases (``--only constructor``: meshinit.nnx
at 8 and 32 layers; at 32 layers nnx.jit, eager-nnx, the spec path, meshinit.nnx:2mesh,
linen.jit, meshinit.linen, meshinit.linen:2mesh, eqx.filter_jit, meshinit.eqx; no warm,
restart, host-memory or planning case).

Exits non-zero if a meshinit case crashes or places an array anywhere but exactly on
its planned sharding (in ``--smoke``: if any case fails).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import recipes
import report
import report_goals
import report_real_size
from harness import run_child

HERE = Path(__file__).resolve().parent


def spawn(case: str, timeout: float, *, cap_bytes: int | None = None, **kwargs: Any) -> dict:
    """Runs ``cases.CASES[case](**kwargs)`` in a fresh process; ``{"error": ...}`` if it fails.

    With ``cap_bytes``, the process is killed once its resident memory passes that many
    bytes, and the result says so (``"killed_for_memory"``): see :func:`harness.run_child`.
    """
    command = [sys.executable, str(HERE / "suite.py"), "--case", json.dumps([case, kwargs])]
    return run_child(command, timeout, cap_bytes)


def _mem_total() -> int:
    """This machine's memory in bytes (24 GB if /proc/meminfo cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            return int(f.readline().split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return 24 * 10**9


def run_case(spec: str) -> None:
    """The child side of :func:`spawn`."""
    import cases

    name, kwargs = json.loads(spec)
    print("RESULT " + json.dumps(cases.CASES[name](**kwargs)), flush=True)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def constructor_cases(hi: int = 32, lo: int = 8) -> list[tuple[str, int]]:
    """The constructor engine's cold cases, (recipe, layers): every recipe of its goals
    at ``hi`` layers, and ``meshinit.nnx`` at ``lo`` too (the depth goal)."""
    return [("meshinit.nnx", lo), *((recipe, hi) for recipe in report_goals.CONSTRUCTOR_CASES)]


def cold_cases(args: argparse.Namespace) -> list[tuple[str, int]]:
    """(recipe, layers) of every cold case, in the order each repeat runs them."""
    if args.only == "constructor":
        return constructor_cases(*((2, 1) if args.smoke else (32, 8)))
    found = [(recipe, layers) for layers in args.layers for recipe in args.recipes]
    if args.with_constructor:
        found += [case for case in constructor_cases() if case not in found]
    return found


def measure(args: argparse.Namespace) -> dict:
    keys = ("smoke", "only", "layers", "recipes", "repeats", "width")
    keys += ("warm_layers", "warm_repeats", "restart_layers")
    keys += ("mem_recipes", "mem_layers", "mem_width", "plan_specs")
    results: dict[str, Any] = {
        "config": {k: getattr(args, k) for k in keys} | {"cold_cases": cold_cases(args)},
        "machine": report.machine(),
        "cold": {},
        "host_memory": {},
        "planning": {},
    }
    # Repeats are the outer loop, so slow drifts in the machine's load hit every case.
    runs: dict[tuple[str, int], list[dict]] = {}
    for repeat in range(args.repeats):
        for recipe, layers in cold_cases(args):
            r = spawn(
                "cold",
                args.timeout,
                recipe=recipe,
                layers=layers,
                width=args.width,
                check_values=args.smoke and recipes.is_spec_path(recipe),
            )
            runs.setdefault((recipe, layers), []).append(r)
            shown = r["error"] if "error" in r else f"{r['seconds']:.2f} s"
            log(f"cold {recipe:24s} layers={layers:3d} run {repeat + 1}: {shown}")
    for (recipe, layers), rs in runs.items():
        ok = [r for r in rs if "error" not in r]
        best = min(ok, key=lambda r: r["seconds"]) if ok else rs[-1]
        best = best | {
            "runs": [r.get("seconds") for r in rs],
            "errors": [r["error"] for r in rs if "error" in r],
            "problems": next((r["problems"] for r in ok if r["problems"]), []),
        }
        results["cold"].setdefault(recipe, {})[str(layers)] = best
    if args.only == "constructor" or args.with_constructor:
        log("planning by a placements= table ...")
        size = {"variables": 200} if args.smoke else {}
        results["planning_table"] = spawn("planning_table", args.timeout, **size)
    if args.only == "constructor":
        return results

    meshinit_recipes = [r for r in args.recipes if recipes.is_spec_path(r)] or ["meshinit"]
    if args.warm_layers:
        log(f"warm re-init at {args.warm_layers} layers ...")
        results["warm"] = spawn(
            "warm",
            args.timeout,
            layers=args.warm_layers,
            meshinit_recipes=meshinit_recipes,
            repeats=args.warm_repeats,
            width=args.width,
        )
    depths = sorted(set(args.layers))
    if args.warm_layers and len(depths) > 1:
        log(f"warm re-init of the spec path at {depths} layers (the depth goal) ...")
        results["warm_depth"] = spawn(
            "warm_depth", args.timeout, depths=depths, repeats=args.warm_repeats, width=args.width
        )
    if args.restart_layers:
        log(f"restarts with the persistent compilation cache at {args.restart_layers} layers ...")
        with tempfile.TemporaryDirectory(prefix="meshinit-cache-") as cache_dir:
            runs = [
                spawn(
                    "restart",
                    args.timeout,
                    layers=args.restart_layers,
                    cache_dir=cache_dir,
                    width=args.width,
                )
                for _ in range(3)
            ]
        reads = [r for r in runs[1:] if "error" not in r]
        results["restart"] = {
            "layers": args.restart_layers,
            "fill": runs[0],
            "read": min(reads, key=lambda r: r["seconds"]) if reads else runs[-1],
        }
    for recipe in args.mem_recipes:
        log(f"host memory {recipe} ({args.mem_layers} layers, width {args.mem_width}) ...")
        results["host_memory"][recipe] = spawn(
            "host_memory", args.timeout, recipe=recipe, layers=args.mem_layers, width=args.mem_width
        )
    log("planning ...")
    results["planning"] = {
        "specs": spawn("planning", args.timeout, kind="specs", specs=args.plan_specs),
        "405b": spawn("planning", args.timeout, kind="405b"),
    }
    return results


REAL_SIZE_RECIPES = {  # what each real size measures by default
    "1b": recipes.RECIPES,
    "8b": ("meshinit", "meshinit.nnx", "meshinit.linen", "meshinit.eqx", "eager-nnx"),
    "tiny": ("meshinit", "meshinit.nnx", "eager-nnx"),
}


def _mem_available() -> int | None:
    """The kernel's estimate of the memory a new process can take, in bytes."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def measure_real_size(args: argparse.Namespace) -> dict:
    """``--only real-size``: each size's recipes cold, best of ``--repeats`` fresh
    processes, each killed once it passes ``--memory-cap-gb`` of resident memory."""
    cap = int(args.memory_cap_gb * 1e9)
    results: dict[str, Any] = {
        "config": {"sizes": args.sizes, "repeats": args.repeats, "memory_cap": cap},
        "machine": report.machine(),
        "real_size": {},
    }
    import cases_memory

    available = _mem_available()
    largest = max(cases_memory.REAL_SIZES[size]().nbytes for size in args.sizes)
    if available:  # cf. cases_memory.prefault; a killed prefault only means less was touched
        touch = max(0, min(cap, available - (1 << 30), 2 * largest))
        results["prefault"] = spawn("prefault", args.timeout, cap_bytes=cap, nbytes=touch)
        log(f"touched {touch / 1e9:.1f} GB of fresh memory first: {results['prefault']}")
    for size in args.sizes:
        chosen = args.recipes if args.recipes_given else REAL_SIZE_RECIPES[size]
        runs: dict[str, list[dict]] = {}
        for repeat in range(args.repeats):
            for recipe in chosen:
                if any(r.get("killed_for_memory") for r in runs.get(recipe, [])):
                    continue  # it will not fit the second time either
                r = spawn("real_size", args.timeout, cap_bytes=cap, recipe=recipe, size=size)
                runs.setdefault(recipe, []).append(r)
                shown = r["error"] if "error" in r else f"{r['seconds']:.2f} s"
                log(f"real size {size} {recipe:24s} run {repeat + 1}: {shown}")
        for recipe, rs in runs.items():
            ok = [r for r in rs if "error" not in r]
            best = min(ok, key=lambda r: r["seconds"]) if ok else rs[-1]
            floors = [r["floor"] for r in ok if "floor" in r]
            if floors:
                best = best | {"floor": min(floors)}
            best = best | {
                "runs": [r.get("seconds") for r in rs],
                "errors": [r["error"] for r in rs if "error" in r],
            }
            results["real_size"].setdefault(size, {})[recipe] = best
    return results


def failures(results: dict, strict: bool) -> list[str]:
    """meshinit's crashes and inexact placements; with ``strict``, any case's crash."""
    cases = [
        (f"cold {recipe} at {layers} layers", recipe, r)
        for recipe, by_layers in results.get("cold", {}).items()
        for layers, r in by_layers.items()
    ]
    cases.append(("warm re-init", "meshinit", results.get("warm", {})))
    cases.append(("warm re-init at each depth", "meshinit", results.get("warm_depth", {})))
    for which, r in results.get("restart", {}).items():
        if isinstance(r, dict):
            cases.append((f"restart ({which} the cache)", "meshinit", r))
    cases += [(f"host memory {k}", k, r) for k, r in results.get("host_memory", {}).items()]
    cases += [(f"planning {k}", "meshinit", r) for k, r in results.get("planning", {}).items()]
    cases += [
        (f"real size {size} {recipe}", recipe, r)
        for size, by_recipe in results.get("real_size", {}).items()
        for recipe, r in by_recipe.items()
    ]
    found = []
    for name, recipe, r in cases:
        ours = recipe.startswith("meshinit")
        errors = r.get("errors") or ([r["error"]] if "error" in r else [])
        if errors and (ours or strict):
            found.append(f"{name}: {errors[0]}")
        elif r.get("problems") and ours:
            found.append(f"{name}: not placed exactly: {r['problems']}")
    return found


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny and quick, for CI; writes nothing")
    ap.add_argument(
        "--only",
        choices=["constructor", "real-size"],
        help="constructor: only the constructor engine's cold cases (see above); "
        "real-size: the real-size run (--sizes)",
    )
    ap.add_argument(
        "--sizes",
        nargs="+",
        choices=["1b", "8b", "tiny"],
        default=["1b", "8b"],
        help="real-size run: 1b (Model.cpu(16, 8), f32) and 8b (Llama-3-8B shapes, bf16)",
    )
    ap.add_argument(
        "--memory-cap-gb",
        type=float,
        default=0.85 * _mem_total() / 1e9,
        help="real-size run: a process past this resident memory is killed and recorded "
        "as killed for memory (default: 85%% of this machine's memory)",
    )
    ap.add_argument("--layers", type=int, nargs="+", help="default: 8 16 32 64")
    ap.add_argument("--recipes", nargs="+", help=f"default: {' '.join(recipes.SPEC_RECIPES)}")
    ap.add_argument("--repeats", type=int, default=2, help="processes per cold case (best of)")
    ap.add_argument("--width", type=int, default=1, help="width multiplier of the cold cases")
    ap.add_argument("--warm-layers", type=int, default=32, help="0 skips the warm case")
    ap.add_argument("--warm-repeats", type=int, default=15)
    ap.add_argument(
        "--restart-layers", type=int, default=32, help="0 skips the persistent-cache case"
    )
    ap.add_argument("--mem-recipes", nargs="*", default=["meshinit", "eager-nnx"])
    ap.add_argument("--mem-layers", type=int, default=18)
    ap.add_argument("--mem-width", type=int, default=4, help="18 layers x4: 1.13 GB of f32")
    ap.add_argument("--plan-specs", type=int, default=10_000)
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per process")
    ap.add_argument("--out", help="write this markdown report (e.g. docs/performance.md)")
    ap.add_argument("--png", help="write the cold-vs-depth plot (e.g. docs/cold_vs_depth.png)")
    ap.add_argument("--json", help="write the raw results")
    ap.add_argument("--from-json", help="measure nothing: report the results in this file")
    ap.add_argument("--case", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.recipes_given = bool(args.recipes)
    if args.only == "constructor" and (args.layers or args.recipes):
        ap.error("--only constructor chooses the cases itself: leave out --layers and --recipes")
    # The full run (no cases chosen) includes the constructor engine's cases.
    args.with_constructor = not (args.layers or args.recipes or args.smoke)
    args.layers = args.layers or [8, 16, 32, 64]
    args.recipes = args.recipes or list(recipes.SPEC_RECIPES)
    unknown = [r for r in args.recipes if r not in recipes.RECIPES]
    unknown += [r for r in args.mem_recipes if r not in recipes.RECIPES]
    if unknown:
        ap.error(f"unknown recipes {unknown}; known: {', '.join(recipes.RECIPES)}")
    if args.smoke:  # with --only constructor: its cases at 2 and 1 layers
        args.layers, args.recipes, args.repeats, args.width = [2], ["meshinit", "jax.jit"], 1, 1
        args.warm_layers, args.warm_repeats, args.mem_recipes = 2, 3, []
        args.restart_layers = 0
        args.plan_specs = 1000
        if args.out or args.png or args.json:
            log("--smoke writes nothing: ignoring --out, --png and --json")
            args.out = args.png = args.json = None
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.case:
        run_case(args.case)
        return 0
    real = args.only == "real-size"
    if args.from_json:
        results = json.loads(Path(args.from_json).read_text())
    else:
        start = time.perf_counter()
        results = measure_real_size(args) if real else measure(args)
        results["wall_s"] = time.perf_counter() - start
        results["command"] = "python benchmarks/suite.py " + " ".join(sys.argv[1:])
    print(report_real_size.real_size_table(results) if real else report.text(results))
    if args.json and not args.from_json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    png = None
    if args.png:
        message = (report_real_size.real_size_plot if real else report.plot)(results, args.png)
        print(message)
        if message.startswith("wrote") and args.out:
            png = os.path.relpath(args.png, Path(args.out).parent)
    if args.out and real:  # the page keeps everything else: only its real-size section
        page = Path(args.out).read_text() if Path(args.out).exists() else ""
        section = report_real_size.real_size_section(results, png)
        Path(args.out).write_text(report_real_size.with_real_size(page, section))
        print(f"wrote the real-size section of {args.out}")
    elif args.out:  # a real-size section the page had is kept
        page = report.markdown(results, png)
        kept = (
            report_real_size.real_size_of(Path(args.out).read_text())
            if Path(args.out).exists()
            else None
        )
        Path(args.out).write_text(
            page if kept is None else report_real_size.with_real_size(page, kept)
        )
        print(f"wrote {args.out}")
    found = failures(results, strict=args.smoke)
    for line in found:
        print(f"FAILED: {line}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
