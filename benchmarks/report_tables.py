"""The tables of one run, as markdown (the terminal prints the same text): cold init
against depth (best of processes, ratios, every process, compile time, the slopes per
layer), warm re-init and per-device memory, host memory, restarts and planning; with
the cells they are made of (:func:`fmt_s`, :func:`fmt_mb`, :func:`md_table`).
"""

from __future__ import annotations

from report_goals import (
    ANCHOR_NAMES,
    ANCHORS,
    CONSTRUCTOR_RATIOS,
    SLOPE_LIMIT,
    cold_seconds,
    depths_text,
    layers_of,
    slopes,
)


def fmt_mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB" if n < 1e9 else f"{n / 1e9:,.2f} GB"


def fmt_s(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f} s" if x >= 0.1 else f"{x * 1e3:.1f} ms"


def md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def recipe_label(recipe: str, by_layers: dict) -> str:
    """``meshinit (rounds)`` for the default strategy; other recipes as they are."""
    strategy = next((r.get("strategy") for r in by_layers.values() if r.get("strategy")), None)
    return f"{recipe} ({strategy})" if recipe == "meshinit" and strategy else recipe


def cold_tables(results: dict) -> str:
    layers = layers_of(results)
    header = ["recipe", *[f"{n} layers" for n in layers]]
    time_rows, spread_rows, compile_rows = [], [], []
    for recipe, by_layers in results["cold"].items():
        label = recipe_label(recipe, by_layers)
        cells = [_cold_cells(by_layers.get(str(n))) for n in layers]
        for rows, column in zip(
            (time_rows, spread_rows, compile_rows), zip(*cells, strict=True), strict=True
        ):
            rows.append([label, *column])
    pairs = [("meshinit", anchor) for anchor in ANCHORS]
    pairs += [pair for pair in CONSTRUCTOR_RATIOS if pair not in pairs]
    ratio_rows = []
    for ours, anchor in pairs:
        if ours in results["cold"] and anchor in results["cold"]:
            row = [f"{ours} / {ANCHOR_NAMES.get(anchor, anchor)}"]
            for n in layers:
                a, b = cold_seconds(results, ours, n), cold_seconds(results, anchor, n)
                row.append(f"{a / b:.3f}" if a and b else "")
            ratio_rows.append(row)
    out = "Cold init, best of the processes:\n\n" + md_table(header, time_rows)
    if ratio_rows:
        out += "\n\nRatios of the cold times:\n\n" + md_table(["ratio", *header[1:]], ratio_rows)
    out += (
        "\n\nEvery process of each case, fastest first (the same code each time: the spread "
        "is the shared machine's noise):\n\n" + md_table(header, spread_rows)
    )
    out += (
        "\n\nXLA backend compile time in the fastest process, summed over compiles "
        "(number of compilations):\n\n"
    )
    return out + md_table(header, compile_rows) + _slope_text(results)


def _slope_text(results: dict) -> str:
    """The depth goal's slopes: what each meshinit recipe's cold time adds per layer,
    against what generating a layer costs (the spec path's warm re-init)."""
    _, warm = slopes(results)
    if warm is None:
        return ""
    rows = []
    for recipe in results["cold"]:
        cold, _ = slopes(results, recipe)
        if recipe.startswith("meshinit") and cold is not None:
            rows.append([recipe, f"{cold * 1e3:.2f} ms", f"{cold / warm:.2f}"])
    return (
        f"\n\nPer layer, the least-squares slope over {depths_text(results)}: each meshinit "
        f"recipe's cold time (best of the processes), against the spec path's warm re-init, "
        f"{warm * 1e3:.2f} ms per layer (nothing to compile: generating the layer's bytes; "
        f"the depth goal holds the spec path to {SLOPE_LIMIT}x):\n\n"
        + md_table(["recipe", "cold, per layer", "/ warm"], rows)
        + (f"\n\n{note}" if (note := results["warm_depth"].get("note")) else "")
    )


def _cold_cells(r: dict | None) -> tuple[str, str, str]:
    """One cold case's cells: best time, every process's time, compile time."""
    if r is None:
        return "", "", ""
    if "error" in r:
        return "failed", "failed", "failed"
    exact = "" if not r["problems"] else " (NOT exact)"
    return (
        fmt_s(r["seconds"]) + exact,
        _spread(r.get("runs") or [r["seconds"]]),
        f"{fmt_s(r['compile_s'])} ({r['compiles']})",
    )


def _spread(runs: list[float | None]) -> str:
    """``1.42, 1.56, 1.70 s``: every process's time, fastest first; failed ones last."""
    done = sorted(x for x in runs if x is not None)
    failed = len(runs) - len(done)
    text = ", ".join(f"{x:.2f}" for x in done) + " s" if done else ""
    return text + (f" ({failed} failed)" if failed else "")


def warm_tables(results: dict) -> str:
    warm = results.get("warm")
    if not warm:
        return ""
    if "error" in warm:
        return f"Warm re-init: failed: {warm['error']}"
    fused = warm["fused"]
    rows = []

    def median(w: dict) -> str:
        return fmt_s(w["warm_median"]) if "warm_median" in w else ""

    for name, w in warm["meshinit"].items():
        rows.append(
            [
                recipe_label(name, {"": w}),
                fmt_s(w["first"]),
                fmt_s(w["warm"]),
                median(w),
                str(w["compiles"]),
                f"{fused['warm'] / w['warm']:.2f}",
            ]
        )
    rows.append(
        ["jax.jit fused", fmt_s(fused["first"]), fmt_s(fused["warm"]), median(fused), "", "1.00"]
    )
    alike = warm.get("fused_alike")
    if alike:
        options = ", ".join(f"{k}={v}" for k, v in alike["options"].items()) or "defaults"
        hashed = " and its straight-line threefry hash" if alike.get("straight_line_hash") else ""
        rows.append(
            [
                f"jax.jit fused, compiled with meshinit's options ({options}){hashed}",
                "",
                fmt_s(alike["warm"]),
                median(alike),
                "",
                f"{fused['warm'] / alike['warm']:.2f}",
            ]
        )
    header = [
        "recipe",
        "first (compile + run)",
        "re-init, new key (best)",
        "median",
        "compiles",
        "fused / this",
    ]
    out = md_table(header, rows)
    mem_rows = []
    for name, w in warm["meshinit"].items():
        m = w.get("memory")
        if m is None:
            mem_rows.append([name, w.get("memory_error", "n/a"), "", "", "", ""])
            continue
        peak = m["peak"]
        largest = m["largest_call_output"] + m["largest_call_temp"]
        mem_rows.append(
            [
                f"{recipe_label(name, {'': w})}, {m['executables']} executables",
                fmt_mb(m["share"]),
                f"{fmt_mb(largest)} ({largest / m['share']:.3f})",
                fmt_mb(m["max_temp"]),
                fmt_mb(peak),
                f"{peak / m['share']:.3f}",
            ]
        )
    share = next((w["memory"]["share"] for w in warm["meshinit"].values() if "memory" in w), None)
    if share:
        peak = fused["output"] + fused["temp"]
        mem_rows.append(
            [
                "jax.jit fused, 1 executable",
                fmt_mb(share),
                f"{fmt_mb(peak)} ({peak / share:.3f})",
                fmt_mb(fused["temp"]),
                fmt_mb(peak),
                f"{peak / share:.3f}",
            ]
        )
    header = [
        "recipe",
        "share / device",
        "largest call: out + temp (/ share)",
        "max temp",
        "peak over the run",
        "peak / share",
    ]
    return out + "\n\nPer-device memory from `memory_analysis()`:\n\n" + md_table(header, mem_rows)


def host_table(results: dict) -> str:
    rows = []
    for recipe, r in results.get("host_memory", {}).items():
        if "error" in r:
            rows.append([recipe, "failed", r["error"][:120], "", ""])
            continue
        exact = "" if not r["problems"] else " (NOT exact)"
        rows.append(
            [
                recipe + exact,
                fmt_mb(r["nbytes"]),
                fmt_mb(r["increase"]),
                f"{r['increase'] / r['nbytes']:.3f}",
                fmt_s(r["seconds"]),
            ]
        )
    if not rows:
        return ""
    header = ["recipe", "parameters", "peak RSS increase", "increase / parameters", "cold time"]
    return md_table(header, rows)


def restart_table(results: dict) -> str:
    restart = results.get("restart")
    if not restart:
        return ""
    layers = restart["layers"]
    cold = results["cold"].get("meshinit", {}).get(str(layers))
    rows = []
    if cold and "error" not in cold:
        rows.append(
            ["cache off (the cold case above)", fmt_s(cold["seconds"]), fmt_s(cold["compile_s"])]
        )
    for which, label in (("fill", "first process: fills the cache"), ("read", "restart: reads it")):
        r = restart[which]
        if "error" in r:
            rows.append([label, "failed", r["error"][:120]])
        else:
            exact = "" if not r["problems"] else " (NOT exact)"
            rows.append([label + exact, fmt_s(r["seconds"]), fmt_s(r["compile_s"])])
    header = [f"meshinit, {layers} layers", "cold time", "XLA compile time"]
    return (
        "With jax's persistent compilation cache configured (`jax_compilation_cache_dir`, "
        "jax's other settings at their defaults), meshinit writes every program it compiles "
        "to it, whatever its compile time, so a restarted job loads them from the cache. "
        "Each row is a fresh process; the restart row is the best of two.\n\n"
        + md_table(header, rows)
    )


def planning_table(results: dict) -> str:
    rows = []
    for kind, p in results.get("planning", {}).items():
        if "error" in p:
            rows.append([kind, "failed", p["error"][:120], "", ""])
            continue
        name = "CPU reference stack" if kind == "specs" else "Llama-3-405B, bf16, (16, 16, 8)"
        rows.append(
            [
                f"{name}: {p['specs']:,} specs, {p['params'] / 1e9:,.1f} B params",
                fmt_s(p["build_specs"]),
                fmt_s(p["first"]),
                fmt_s(p["best"]),
            ]
        )
    header = ["model", "building the specs", "plan, first call", "plan, best of 3 more"]
    return md_table(header, rows) if rows else ""
