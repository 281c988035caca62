"""The text ``tpu.py`` prints from its results: the machine, then a markdown table per
part (cold, restart, bits, load, compile per program at two depths) and issue 51's
goals, each met or not.
"""

from __future__ import annotations

from typing import Any

import tpu_bits
from report_tables import md_table

LABELS = {
    "meshinit": "meshinit spec path",
    "meshinit.nnx": "`meshinit.nnx.init`",
    "meshinit.linen": "`meshinit.linen.init`",
    "jax.jit": "`jax.jit(out_shardings=...)`, fused",
    "nnx.jit": "`nnx.jit`",
    "linen.jit": "`jax.jit(model.init, out_shardings=...)`, linen",
    "eager-nnx": "eager nnx",
}
# Each recipe's jitted anchor: the ratio column.
ANCHOR = {
    "meshinit": "jax.jit",
    "meshinit.nnx": "nnx.jit",
    "meshinit.linen": "linen.jit",
    "eager-nnx": "nnx.jit",
}
MESHINIT = ("meshinit", "meshinit.nnx", "meshinit.linen")
# tpu_bits.RECIPES: each recipe of issue 57's cases and its anchor
CASE_RECIPES = {
    "nnx": "`meshinit.nnx.init` vs `nnx.jit`",
    "linen": "`meshinit.linen.init` vs linen's `jax.jit(module.init)`",
    "spec": "spec path vs `jax.jit(init(param_key(...)))`",
}


def _layers(n: int) -> str:
    return f"{n} layer" if n == 1 else f"{n} layers"


def _s(seconds: float | None, digits: int = 2) -> str:
    return "" if seconds is None else f"{seconds:.{digits}f} s"


def _placed(r: dict) -> str:
    return "exact" if not r.get("problems") else f"NOT exact: {'; '.join(r['problems'])[:120]}"


def header(results: dict) -> str:
    env = results["env"]
    v = env["versions"]
    versions = ", ".join(f"{k} {v[k]}" for k in ("jax", "jaxlib", "flax") if v.get(k))
    fsdp, tensor = results["mesh"]
    return (
        f"{env['devices']} x {env['device_kind']} ({env['platform']}); {versions}; "
        f"Python {v['python']}; mesh (fsdp={fsdp}, tensor={tensor}); "
        f"each row a fresh process"
    )


def cold_table(results: dict) -> str:
    cold = results["cold"]
    gb = next((r["nbytes"] / 1e9 for r in cold.values() if "nbytes" in r), 0.0)
    rows = []
    for recipe, r in cold.items():
        if "error" in r:
            rows.append([LABELS[recipe], "failed", r["error"][:150], "", "", "", "", ""])
            continue
        anchor = cold.get(ANCHOR.get(recipe, ""), {})
        ratio = f"{r['seconds'] / anchor['seconds']:.3f}x" if "seconds" in anchor else ""
        rows.append(
            [
                LABELS[recipe],
                _s(r["seconds"]),
                ratio,
                _s(r["compile_s"]),
                str(r["compiles"]),
                _s(r["slowest_s"]),
                _s(r.get("warm_s"), 3),
                _placed(r),
            ]
        )
    title = f"{_layers(results['layers'])}, {gb:.2f} GB"
    head = [title, "cold", "/ jitted", "compile (summed over threads)", "compiles"]
    head += ["slowest compile", "warm re-init", "placement"]
    notes = (
        "/ jitted: meshinit's spec path against the fused jax.jit, `meshinit.nnx.init` and "
        "eager nnx against `nnx.jit`, `meshinit.linen.init` against linen's jax.jit."
    )
    return md_table(head, rows) + "\n\n" + notes


def restart_table(results: dict) -> str:
    restart = results["restart"]
    zero = results.get("cache_threshold_zero")
    threshold = "0 (`--cache-threshold-zero`)" if zero else "jax's default"
    rows = []
    if "error" in restart.get("fill", {}):
        rows.append(["filling the cache", "failed", restart["fill"]["error"][:150], "", "", ""])
    for recipe in MESHINIT:
        r = restart.get(recipe)
        if r is None:
            continue
        if "error" in r:
            rows.append([LABELS[recipe], "failed", r["error"][:150], "", "", ""])
            continue
        cold = results.get("cold", {}).get(recipe, {})
        ratio = f"{r['seconds'] / cold['seconds']:.3f}x" if "seconds" in cold else ""
        read = _s(r["cache_read_s"])
        rows.append([LABELS[recipe], _s(r["seconds"]), ratio, str(r["compiles"]), read, _placed(r)])
    head = ["restart, a fresh process", "cold", "/ cold without the cache", "compiles"]
    head += ["reading the cache", "placement"]
    intro = (
        f"jax's persistent compilation cache in a temporary folder, its minimum compile "
        f"time {threshold}; one process filled it with all three recipes first."
    )
    return intro + "\n\n" + md_table(head, rows)


def bits_table(results: dict) -> str:
    b = results["bits"]
    if "error" in b:
        return f"bits: failed: {b['error']}"
    rows = []
    for name, d in b.items():
        if not isinstance(d, dict) or name == "cases":
            continue
        dtype, ours, _, theirs = name.split(" ")
        rows.append(
            [
                f"{LABELS[ours]} vs {LABELS[theirs]}",
                dtype,
                f"{d['elements']:,}",
                f"{d['differ']:,} ({d['differ'] / d['elements']:.1%})",
                str(d["max_ulp"]),
            ]
        )
    title = f"values, the {b['layers']}-layer stack ({b['nbytes'] / 1e9:.2f} GB in f32)"
    # each part only where it ran (--bits-dtypes or --bits-recipes with none leave it out)
    tables = [md_table([title, "dtype", "elements", "differ", "max ulp"], rows)] if rows else []
    tables += [cases_table(b["cases"])] if b.get("cases") else []
    return "\n\n".join(tables)


def cases_table(cases: dict) -> str:
    """Issue 57's cases (``tpu_bits.py``): each of meshinit's recipes against its jitted
    anchor on the same mesh, per mesh kind and tiling."""
    rows = []
    for name, d in cases.items():
        kind, tiling, recipe, case = tpu_bits.parts(name, d)
        if "error" in d:
            rows.append([case, CASE_RECIPES[recipe], kind, tiling, "failed", d["error"][:150], ""])
            continue
        share = f"{d['differ']:,} of {d['elements']:,}"
        same = "==" if d.get("equal_sharding") else "yes" if d.get("same_sharding") else "no"
        rows.append([case, CASE_RECIPES[recipe], kind, tiling, share, str(d["max_ulp"]), same])
    head = ["issue 57's case", "recipe vs its anchor, same mesh", "mesh", "tiles", "differ"]
    return md_table([*head, "max ulp", "same sharding"], rows)


def load_table(results: dict) -> str:
    load = results["load"]
    if "error" in load:
        return f"load: failed: {load['error']}"
    names = {
        "meshinit": "`meshinit.safetensors.load`",
        "device_put": "`jax.device_put` of each memory-mapped tensor",
        "in_ram": "`jax.device_put` of the same tensors already in memory (the floor)",
        "safe_open": "`safe_open` (numpy), then `jax.device_put`",
        "orbax": "orbax v1's safetensors layout",
    }
    floor = load.get("device_put", {}).get("best_s")
    in_ram = load.get("in_ram", {}).get("best_s")
    rows = []
    for key, label in names.items():
        r = load.get(key, {"error": "not run"})
        if "error" in r:
            rows.append([label, r["error"][:150], "", "", ""])
            continue
        ratio = f"{r['best_s'] / floor:.3f}x" if floor else ""
        of_floor = f"{r['best_s'] / in_ram:.3f}x" if in_ram else ""
        rows.append([label, _s(r["best_s"], 3), _s(r["first_s"], 3), ratio, of_floor])
    n = load["nbytes"]
    size = f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"
    same = load.get("meshinit_vs_device_put", {"differ": "not compared"})
    exact = "equal" if not same["differ"] else f"{same['differ']} elements DIFFER"
    title = f"{size} of bf16 safetensors into device memory"
    tail = f"meshinit's arrays and device_put's: {exact}; placement: {_placed(load)}."
    heads = [title, "best", "first", "/ device_put", "/ in memory"]
    return md_table(heads, rows) + "\n\n" + tail


def depth_table(results: dict) -> str:
    depth = results["depth"]
    lo, hi = depth["layers"], results["layers"]
    rows = []
    for recipe in MESHINIT:
        cells = [LABELS[recipe]]
        for r in (depth.get(recipe, {}), results.get("cold", {}).get(recipe, {})):
            if "error" in r:
                cells.append("failed")
            else:
                cells.append(f"{_s(r.get('slowest_s'))} ({r.get('compiles', '?')} programs)")
        rows.append(cells)
    head = ["slowest single compile", _layers(lo), _layers(hi)]
    return md_table(head, rows)


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def goals(results: dict) -> list[str]:
    """Issue 51's goals, each with the numbers it compares (only those measured)."""
    lines = []
    cold = results.get("cold", {})
    for recipe in MESHINIT:
        r, anchor = cold.get(recipe, {}), cold.get(ANCHOR[recipe], {})
        if "seconds" in r and "seconds" in anchor:
            ratio = r["seconds"] / anchor["seconds"]
            ok = r["seconds"] <= 3 and ratio <= 0.05
            lines.append(
                f"cold {LABELS[recipe]} <= 3 s and <= 0.05x: {r['seconds']:.2f} s, "
                f"{ratio:.3f}x: {_met(ok)}"
            )
    slowest = [
        r["slowest_s"]
        for part in (cold, results.get("depth", {}))
        for name, r in part.items()
        if name in MESHINIT and "slowest_s" in r
    ]
    if slowest:
        lines.append(f"slowest program <= 2 s: {max(slowest):.2f} s: {_met(max(slowest) <= 2)}")
    if "warm_s" in cold.get("meshinit", {}):
        warm = cold["meshinit"]["warm_s"]
        lines.append(f"warm re-init <= 0.15 s: {warm:.3f} s: {_met(warm <= 0.15)}")
    for recipe, r in results.get("restart", {}).items():
        if recipe in MESHINIT and "seconds" in r:
            ok = r["seconds"] <= 1 and r["compiles"] == 0
            lines.append(
                f"restart {LABELS[recipe]} <= 1 s, no compile: {r['seconds']:.2f} s, "
                f"{r['compiles']} compiles: {_met(ok)}"
            )
    load = results.get("load", {})
    if "best_s" in load.get("meshinit", {}) and "best_s" in load.get("device_put", {}):
        ratio = load["meshinit"]["best_s"] / load["device_put"]["best_s"]
        lines.append(f"load <= 0.8x device_put: {ratio:.3f}x: {_met(ratio <= 0.8)}")
    for name, d in results.get("bits", {}).items():
        if isinstance(d, dict) and "eager" not in name and name != "cases":
            lines.append(f"bits {name}: {d['differ']} differ: {_met(d['differ'] == 0)}")
    cases = results.get("bits", {}).get("cases", {})
    if cases:
        for recipe, label in CASE_RECIPES.items():
            mine = [d for n, d in cases.items() if tpu_bits.parts(n, d)[2] == recipe]
            if mine:
                equal = sum(1 for d in mine if d.get("differ", 1) == 0)
                lines.append(f"issue 57 cases, {label}: {equal} of {len(mine)} equal")
    return lines


def report(results: dict) -> str:
    parts = [header(results)]
    tables: dict[str, Any] = {
        "cold": cold_table,
        "restart": restart_table,
        "bits": bits_table,
        "load": load_table,
        "depth": depth_table,
    }
    parts += [table(results) for part, table in tables.items() if part in results]
    if found := goals(results):
        where = "" if results["env"]["platform"] == "tpu" else " (set for a TPU v5e chip)"
        parts.append(f"issue 51's goals{where}:\n" + "\n".join(f"- {line}" for line in found))
    return "\n\n".join(parts)
