"""Tables, goals, the markdown report and the plot, all from one run's results."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

ANCHORS = ("nnx.jit", "eager-nnx", "jax.jit")

# The constructor engine's cases (at the deep end; meshinit.nnx at the shallow end too,
# for the depth goal) and its goals: (ours, anchor, limit) of the cold times at the deep
# end (32 layers, else the deepest measured).
CONSTRUCTOR_CASES = (
    "nnx.jit",
    "eager-nnx",
    "meshinit",
    "meshinit.nnx",
    "meshinit.nnx:table",  # right after its anchor: side by side
    "meshinit.nnx:2mesh",
    "linen.jit",
    "meshinit.linen",
    "meshinit.linen:table",
    "meshinit.linen:2mesh",
    "eqx.filter_jit",
    "meshinit.eqx",
)
CONSTRUCTOR_GOALS = (
    ("meshinit.nnx", "nnx.jit", 0.10),
    ("meshinit.nnx", "eager-nnx", 0.5),
    ("meshinit.nnx", "meshinit", 2.0),
    ("meshinit.linen", "linen.jit", 0.10),
    ("meshinit.eqx", "eqx.filter_jit", 0.10),
    ("meshinit.nnx:2mesh", "meshinit.nnx", 1.6),
    # a sharding table kept outside the model (placements=) costs what metadata does
    ("meshinit.nnx:table", "meshinit.nnx", 1.05),
    ("meshinit.linen:table", "meshinit.linen", 1.05),
)
# The depth goal: every meshinit recipe measured at both depths compiles as many
# executables at the deep end as at the shallow end, in at most this much compile time
# (the same, within the shared machine's noise) ...
COMPILE_TIME_LIMIT = 1.25
# ... and the spec path's cold time grows per layer at most this much faster than its
# warm time (generating the layer's bytes with nothing to compile).
SLOPE_LIMIT = 1.5
# Ratios shown per depth beside the goals (same depth on both sides); no goal of their own.
CONSTRUCTOR_RATIOS = (
    *((ours, anchor) for ours, anchor, _ in CONSTRUCTOR_GOALS),
    ("meshinit.linen:2mesh", "meshinit.linen"),
)
_NAMES = {"meshinit": "meshinit (spec path)"}


def machine() -> dict[str, Any]:
    """The machine and the versions; starts no jax backend."""

    def version(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    root = Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "load_avg": os.getloadavg(),
        "python": platform.python_version(),
        "jax": version("jax"),
        "jaxlib": version("jaxlib"),
        "flax": version("flax"),
        "meshinit": commit or version("meshinit"),
        "date": datetime.datetime.now().isoformat(timespec="minutes"),
    }


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB" if n < 1e9 else f"{n / 1e9:,.2f} GB"


def _s(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f} s" if x >= 0.1 else f"{x * 1e3:.1f} ms"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _cold(results: dict, recipe: str, layers: int) -> float | None:
    r = results["cold"].get(recipe, {}).get(str(layers), {})
    return r.get("seconds")


def _label(recipe: str, by_layers: dict) -> str:
    """``meshinit (rounds)`` for the default strategy; other recipes as they are."""
    strategy = next((r.get("strategy") for r in by_layers.values() if r.get("strategy")), None)
    return f"{recipe} ({strategy})" if recipe == "meshinit" and strategy else recipe


def _layers(results: dict) -> list[int]:
    return sorted({int(n) for by_layers in results["cold"].values() for n in by_layers})


def _ref(layers: list[int], want: int, pick: Any) -> int | None:
    return want if want in layers else (pick(layers) if layers else None)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def depth_pair(layers: list[int]) -> tuple[int | None, int | None]:
    """The depth goal's (shallow, deep) ends: 8 and 32 layers, else the extremes."""
    return _ref(layers, 8, min), _ref(layers, 32, max)


def _depth_goals(table: _Goals, results: dict, recipes: list[str]) -> None:
    """Compiles flat in depth for each of ``recipes`` measured at both ends."""
    lo, hi = depth_pair(_layers(results))
    if lo == hi:
        return
    for recipe in recipes:
        by_layers = results["cold"].get(recipe, {})
        a, b = by_layers.get(str(lo), {}), by_layers.get(str(hi), {})
        if "compiles" not in a or "compiles" not in b:
            continue
        table.rows.append(
            [
                f"compiles, {recipe}, {lo} and {hi} layers",
                f"{a['compiles']} and {b['compiles']}",
                "equal",
                "met" if a["compiles"] == b["compiles"] else "NOT met",
            ]
        )
        what = f"compile time, {recipe}, {hi} / {lo} layers"
        table.add(what, _ratio(b.get("compile_s"), a.get("compile_s")), "<=", COMPILE_TIME_LIMIT)


def _fit(points: dict[int, float]) -> float | None:
    """The least-squares slope of ``{depth: seconds}``, over two depths or more."""
    if len(points) < 2:
        return None
    xs, ys = list(points), list(points.values())
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in points.items()) / sum((x - mx) ** 2 for x in xs)


def slopes(results: dict, recipe: str = "meshinit") -> tuple[float | None, float | None]:
    """Seconds per layer, the least-squares slope over every measured depth: ``recipe``'s
    cold time, and the spec path's warm re-init (``warm_depth``). Two points would do in
    a quiet room; on a shared machine, one noisy process at one end moves a slope made of
    two points by more than the whole difference between 8 and 32 layers."""
    warm = results.get("warm_depth", {}).get("warm", {})
    cold = {n: t for n in _layers(results) if (t := _cold(results, recipe, n))}
    return _fit(cold), _fit({int(n): t for n, t in warm.items() if t})


class _Goals:
    """Rows of the goals table: what, measured, goal, met."""

    CHECKS = {"<=": float.__le__, "<": float.__lt__, ">=": float.__ge__}

    def __init__(self) -> None:
        self.rows: list[list[str]] = []

    def add(self, what: str, value: float | None, op: str, limit: float, fmt: str = ".3f"):
        if value is None:
            self.rows.append([what, "n/a", f"{op} {limit}", "n/a"])
        else:
            met = "met" if self.CHECKS[op](float(value), limit) else "NOT met"
            self.rows.append([what, format(value, fmt), f"{op} {limit}", met])


def _constructor_run(results: dict) -> bool:
    return results.get("config", {}).get("only") == "constructor"


def goals(results: dict) -> list[list[str]]:
    """Rows: what, measured, goal, met. The spec path's goals (unless only the
    constructor cases ran), then the constructor engine's (if any of its recipes ran)."""
    rows = [] if _constructor_run(results) else _spec_goals(results)
    if _constructor_run(results) or any(r in results["cold"] for r, *_ in CONSTRUCTOR_GOALS):
        rows += constructor_goals(results)
    return rows


def constructor_goals(results: dict) -> list[list[str]]:
    """The constructor engine's goals: each ratio of two cold cases (best of processes)."""
    table = _Goals()
    layers = _layers(results)
    hi = _ref(layers, 32, max)
    for ours, anchor, limit in CONSTRUCTOR_GOALS:
        value = _ratio(_cold(results, ours, hi), _cold(results, anchor, hi))
        table.add(f"cold {ours} / {_NAMES.get(anchor, anchor)}, {hi} layers", value, "<=", limit)
    ours = dict.fromkeys(r for r, *_ in CONSTRUCTOR_GOALS if r.startswith("meshinit"))
    _depth_goals(table, results, list(ours))
    p = results.get("planning_table") or {}
    what = f"{p.get('variables', 2000):,} variables against a {p.get('entries', 50)}-entry table"
    table.add(f"read {what} (placements=), first call (s)", p.get("table_first"), "<=", 0.1)
    return table.rows


def _spec_goals(results: dict) -> list[list[str]]:
    table = _Goals()
    add = table.add
    layers = _layers(results)
    ref = _ref(layers, 32, max)
    for anchor, limit in (("nnx.jit", 0.1), ("eager-nnx", 0.5)):
        value = _ratio(_cold(results, "meshinit", ref), _cold(results, anchor, ref))
        add(f"cold meshinit / {anchor}, {ref} layers", value, "<=", limit)
    spec_recipes = [r for r in results["cold"] if r.startswith("meshinit") and "." not in r]
    _depth_goals(table, results, spec_recipes)
    cold, warm = slopes(results)
    what = f"per layer, {_depths(results)}: meshinit's cold slope / its warm slope"
    add(what, _ratio(cold, warm) if warm and warm > 0 else None, "<=", SLOPE_LIMIT)

    warm = results.get("warm", {})
    default = warm.get("meshinit", {}).get("meshinit", {})
    value = _ratio(warm.get("fused", {}).get("warm"), default.get("warm"))
    add("warm re-init throughput: fused jit time / meshinit time", value, ">=", 0.6)
    m = default.get("memory") or {}
    share = m.get("share")
    add(
        "per device: peak over the run order (made so far + call's out + temp) / share",
        _ratio(m.get("peak"), share),
        "<=",
        1.1,
    )
    host = results["host_memory"].get("meshinit", {})
    value = _ratio(host.get("increase"), host.get("nbytes"))
    add("host peak RSS increase / parameter bytes", value, "<=", 1.25)
    for kind, limit in (("specs", 0.5), ("405b", 1.0)):
        p = results["planning"].get(kind, {})
        what = f"plan {p['specs']:,} specs" if "specs" in p else "plan the specs"
        what = "plan Llama-3-405B" if kind == "405b" else what
        add(f"{what}, first call (s)", p.get("first"), "<", limit)
    return table.rows


def _cold_tables(results: dict) -> str:
    layers = _layers(results)
    header = ["recipe", *[f"{n} layers" for n in layers]]
    time_rows, spread_rows, compile_rows = [], [], []
    for recipe, by_layers in results["cold"].items():
        label = _label(recipe, by_layers)
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
            row = [f"{ours} / {_NAMES.get(anchor, anchor)}"]
            for n in layers:
                a, b = _cold(results, ours, n), _cold(results, anchor, n)
                row.append(f"{a / b:.3f}" if a and b else "")
            ratio_rows.append(row)
    out = "Cold init, best of the processes:\n\n" + _table(header, time_rows)
    if ratio_rows:
        out += "\n\nRatios of the cold times:\n\n" + _table(["ratio", *header[1:]], ratio_rows)
    out += (
        "\n\nEvery process of each case, fastest first (the same code each time: the spread "
        "is the shared machine's noise):\n\n" + _table(header, spread_rows)
    )
    out += (
        "\n\nXLA backend compile time in the fastest process, summed over compiles "
        "(number of compilations):\n\n"
    )
    return out + _table(header, compile_rows) + _slope_text(results)


def _depths(results: dict) -> str:
    """The depths the slopes are fitted over, as "8, 16, 32, 64 layers"."""
    return ", ".join(map(str, _layers(results))) + " layers"


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
        f"\n\nPer layer, the least-squares slope over {_depths(results)}: each meshinit "
        f"recipe's cold time (best of the processes), against the spec path's warm re-init, "
        f"{warm * 1e3:.2f} ms per layer (nothing to compile: generating the layer's bytes; "
        f"the depth goal holds the spec path to {SLOPE_LIMIT}x):\n\n"
        + _table(["recipe", "cold, per layer", "/ warm"], rows)
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
        _s(r["seconds"]) + exact,
        _spread(r.get("runs") or [r["seconds"]]),
        f"{_s(r['compile_s'])} ({r['compiles']})",
    )


def _spread(runs: list[float | None]) -> str:
    """``1.42, 1.56, 1.70 s``: every process's time, fastest first; failed ones last."""
    done = sorted(x for x in runs if x is not None)
    failed = len(runs) - len(done)
    text = ", ".join(f"{x:.2f}" for x in done) + " s" if done else ""
    return text + (f" ({failed} failed)" if failed else "")


def _warm_tables(results: dict) -> str:
    warm = results.get("warm")
    if not warm:
        return ""
    if "error" in warm:
        return f"Warm re-init: failed: {warm['error']}"
    fused = warm["fused"]
    rows = []

    def median(w: dict) -> str:
        return _s(w["warm_median"]) if "warm_median" in w else ""

    for name, w in warm["meshinit"].items():
        rows.append(
            [
                _label(name, {"": w}),
                _s(w["first"]),
                _s(w["warm"]),
                median(w),
                str(w["compiles"]),
                f"{fused['warm'] / w['warm']:.2f}",
            ]
        )
    rows.append(["jax.jit fused", _s(fused["first"]), _s(fused["warm"]), median(fused), "", "1.00"])
    alike = warm.get("fused_alike")
    if alike:
        options = ", ".join(f"{k}={v}" for k, v in alike["options"].items()) or "defaults"
        hashed = " and its straight-line threefry hash" if alike.get("straight_line_hash") else ""
        rows.append(
            [
                f"jax.jit fused, compiled with meshinit's options ({options}){hashed}",
                "",
                _s(alike["warm"]),
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
    out = _table(header, rows)
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
                f"{_label(name, {'': w})}, {m['executables']} executables",
                _mb(m["share"]),
                f"{_mb(largest)} ({largest / m['share']:.3f})",
                _mb(m["max_temp"]),
                _mb(peak),
                f"{peak / m['share']:.3f}",
            ]
        )
    share = next((w["memory"]["share"] for w in warm["meshinit"].values() if "memory" in w), None)
    if share:
        peak = fused["output"] + fused["temp"]
        mem_rows.append(
            [
                "jax.jit fused, 1 executable",
                _mb(share),
                f"{_mb(peak)} ({peak / share:.3f})",
                _mb(fused["temp"]),
                _mb(peak),
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
    return out + "\n\nPer-device memory from `memory_analysis()`:\n\n" + _table(header, mem_rows)


def _host_table(results: dict) -> str:
    rows = []
    for recipe, r in results.get("host_memory", {}).items():
        if "error" in r:
            rows.append([recipe, "failed", r["error"][:120], "", ""])
            continue
        exact = "" if not r["problems"] else " (NOT exact)"
        rows.append(
            [
                recipe + exact,
                _mb(r["nbytes"]),
                _mb(r["increase"]),
                f"{r['increase'] / r['nbytes']:.3f}",
                _s(r["seconds"]),
            ]
        )
    if not rows:
        return ""
    header = ["recipe", "parameters", "peak RSS increase", "increase / parameters", "cold time"]
    return _table(header, rows)


def real_size_table(results: dict) -> str:
    """The real-size run (``suite.py --only real-size``): per size, each recipe's cold
    time against the floor, its peak RSS increase against the parameter bytes, or how
    it failed (killed for memory, over its time)."""
    out = []
    for size, by_recipe in results.get("real_size", {}).items():
        floors = [r["floor"] for r in by_recipe.values() if r.get("floor")]
        floor = min(floors) if floors else None
        nbytes = next((r["nbytes"] for r in by_recipe.values() if "nbytes" in r), None)
        rows = []
        for recipe, r in by_recipe.items():
            if "error" in r:
                rows.append([recipe, r["error"][:100], "", "", ""])
                continue
            exact = "" if not r["problems"] else " (NOT exact)"
            rows.append(
                [
                    recipe + exact,
                    _s(r["seconds"]),
                    "" if floor is None else f"{r['seconds'] / floor:.2f}",
                    f"{r['increase'] / r['nbytes']:.3f}",
                    f"{r['compiles']} ({_s(r['compile_s'])})",
                ]
            )
        head = f"**{size}**" + ("" if nbytes is None else f": {_mb(nbytes)} of parameters")
        head += "" if floor is None else f"; floor {_s(floor)} (a second materialize, new key)"
        header = ["recipe", "cold", "/ floor", "peak RSS increase / bytes", "compiles (time)"]
        out.append(head + "\n\n" + _table(header, rows))
    return "\n\n".join(out)


REAL_SIZE_BEGIN = "<!-- real-size: written by suite.py --only real-size --out -->"
REAL_SIZE_END = "<!-- /real-size -->"


def real_size_section(results: dict, png: str | None) -> str:
    """The real-size run as a markdown section, between markers that a later run
    replaces (:func:`with_real_size`)."""
    m, cfg = results["machine"], results["config"]
    lines = [
        REAL_SIZE_BEGIN,
        "## Real sizes",
        "",
        "`python benchmarks/suite.py --only real-size`: each recipe's cold init of a "
        "real-size model, "
        + (
            f"best of {cfg['repeats']} fresh processes"
            if cfg["repeats"] > 1
            else "one fresh process, one run"
        )
        + ", against the floor (a second `materialize` of the spec path's plan with a "
        "new key, after the first arrays are deleted: nothing to compile, fresh memory to "
        "touch). The floor is the spec path's initializers' (truncated normals); a "
        "recipe whose framework draws cheaper ones (equinox's `Linear` draws uniforms) "
        "can come in under it. Peak RSS is the init's own (VmHWM reset before it). A "
        "process past "
        f"{cfg['memory_cap'] / 1e9:.1f} GB of resident memory is killed and recorded so. "
        f"{m['cpu_count']} CPUs, Python {m['python']}, jax {m['jax']}, flax {m['flax']}; "
        f"{m['date']}.",
        "",
        real_size_table(results),
    ]
    if png:
        lines += ["", f"![cold init time against parameter bytes]({png})"]
    return "\n".join([*lines, REAL_SIZE_END])


def real_size_of(page: str) -> str | None:
    """The real-size section of ``page`` (markers included), or None."""
    if REAL_SIZE_BEGIN not in page or REAL_SIZE_END not in page:
        return None
    body = page.split(REAL_SIZE_BEGIN, 1)[1].split(REAL_SIZE_END, 1)[0]
    return REAL_SIZE_BEGIN + body + REAL_SIZE_END


def with_real_size(page: str, section: str) -> str:
    """``page`` with its real-size section replaced by ``section`` (appended if none)."""
    if REAL_SIZE_BEGIN in page and REAL_SIZE_END in page:
        head, rest = page.split(REAL_SIZE_BEGIN, 1)
        return head + section + rest.split(REAL_SIZE_END, 1)[1]
    return page.rstrip("\n") + "\n\n" + section + "\n"


def real_size_plot(results: dict, path: str) -> str:
    """Cold time against parameter bytes, one line per recipe; returns what happened."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot (pip install matplotlib)"
    lines: dict[str, list[tuple[float, float]]] = {}
    floors: list[tuple[float, float]] = []
    for by_recipe in results.get("real_size", {}).values():
        for recipe, r in by_recipe.items():
            if "error" not in r:
                lines.setdefault(recipe, []).append((r["nbytes"] / 1e9, r["seconds"]))
            if r.get("floor"):
                floors.append((r["nbytes"] / 1e9, r["floor"]))
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for recipe, points in sorted(lines.items()):
        xs, ys = zip(*sorted(points), strict=True)
        ax.plot(xs, ys, marker="o", label=recipe)
    if floors:
        best = {}
        for x, y in floors:
            best[x] = min(y, best.get(x, y))
        xs, ys = zip(*sorted(best.items()), strict=True)
        ax.plot(xs, ys, "k--", marker="x", label="floor")
    ax.set_xlabel("parameter bytes (GB)")
    ax.set_ylabel("cold init (s)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"wrote {path}"


def _restart_table(results: dict) -> str:
    restart = results.get("restart")
    if not restart:
        return ""
    layers = restart["layers"]
    cold = results["cold"].get("meshinit", {}).get(str(layers))
    rows = []
    if cold and "error" not in cold:
        rows.append(["cache off (the cold case above)", _s(cold["seconds"]), _s(cold["compile_s"])])
    for which, label in (("fill", "first process: fills the cache"), ("read", "restart: reads it")):
        r = restart[which]
        if "error" in r:
            rows.append([label, "failed", r["error"][:120]])
        else:
            exact = "" if not r["problems"] else " (NOT exact)"
            rows.append([label + exact, _s(r["seconds"]), _s(r["compile_s"])])
    header = [f"meshinit, {layers} layers", "cold time", "XLA compile time"]
    return (
        "Opt-in: jax's persistent compilation cache (`jax_compilation_cache_dir`, with "
        "`jax_persistent_cache_min_compile_time_secs=0`); meshinit's executables go "
        "through jax's compile path, so a restarted job loads them from the cache. Each "
        "row is a fresh process; the restart row is the best of two.\n\n" + _table(header, rows)
    )


def _planning_table(results: dict) -> str:
    rows = []
    for kind, p in results.get("planning", {}).items():
        if "error" in p:
            rows.append([kind, "failed", p["error"][:120], "", ""])
            continue
        name = "CPU reference stack" if kind == "specs" else "Llama-3-405B, bf16, (16, 16, 8)"
        rows.append(
            [
                f"{name}: {p['specs']:,} specs, {p['params'] / 1e9:,.1f} B params",
                _s(p["build_specs"]),
                _s(p["first"]),
                _s(p["best"]),
            ]
        )
    header = ["model", "building the specs", "plan, first call", "plan, best of 3 more"]
    return _table(header, rows) if rows else ""


GPU = """\
Not measured yet: no GPU has been lent to the sessions that built meshinit (the
workplace's device tool reported none for the performance issue), so the GPU goals
(Llama-3-8B shapes in bf16 on an H200: cold in at most 3 s, warm re-init at least 0.8x
the fused jit) are open. `benchmarks/gpu.py` is ready for it: `python
benchmarks/gpu.py` on a GPU machine compares meshinit with the fused `jax.jit` recipe
on those shapes in one process (well under 5 minutes) and prints a table to record
here. `python benchmarks/gpu.py --cpu-check` runs the same code on 8 simulated CPU
devices with a tiny model, and the test suite runs it. On GPU meshinit keeps XLA's
default compiler options."""


def _sections(results: dict) -> list[tuple[str, str]]:
    return [
        ("Goals", _table(["measure", "value", "goal", ""], goals(results))),
        ("Cold init vs depth", _cold_tables(results)),
        ("Warm re-init and per-device memory", _warm_tables(results)),
        ("Host memory", _host_table(results)),
        ("Restarts", _restart_table(results)),
        ("Planning", _planning_table(results)),
        ("GPU", "" if _constructor_run(results) else GPU),
    ]


def notes(results: dict) -> list[str]:
    """Anything unexpected in this run, as measured."""
    found = []
    for recipe, by_layers in results["cold"].items():
        for n, r in by_layers.items():
            if "error" in r:
                found.append(f"`{recipe}` at {n} layers failed: {r['error']}")
            elif r["problems"]:
                found.append(f"`{recipe}` at {n} layers is not placed exactly: {r['problems']}")
            if r.get("errors") and "error" not in r:
                found.append(
                    f"`{recipe}` at {n} layers: {len(r['errors'])} of {len(r['runs'])} "
                    f"processes failed: {r['errors'][0]}"
                )
    for name, w in results.get("warm", {}).get("meshinit", {}).items():
        if w["compiles"]:
            found.append(f"{_label(name, {'': w})} compiled {w['compiles']} times on re-init")
    return found


def text(results: dict) -> str:
    m = results["machine"]
    out = [
        f"{m['platform']}, {m['cpu_count']} CPUs ({m['cpu']}), jax {m['jax']}, "
        f"flax {m['flax']}, meshinit {m['meshinit']}, load {m['load_avg'][0]:.2f}"
    ]
    if results["config"].get("smoke"):
        out.append("--smoke: tiny sizes; the goals are meant for the full suite's sizes")
    out += [f"\n## {title}\n\n{body}" for title, body in _sections(results) if body]
    out += [f"note: {n}" for n in notes(results)]
    return "\n".join(out)


METHOD = """\
The CPU reference model is a Llama-style stack in f32: `embed` (4096, 256), per layer
`q` (256, 256), `k` and `v` (256, 64), `o` (256, 256), `gate` and `up` (256, 1024),
`down` (1024, 256) (all lecun_normal), the norms `n1`, `n2` (256,) (ones), and `head`
(256, 4096). It is placed on a (fsdp=2, tensor=4) mesh of 8 simulated CPU devices
(`jax_num_cpu_devices=8`) with the rules `vocab, heads, kv, mlp -> tensor` and
`embed -> fsdp`.

Recipes, all producing the same tree of arrays:

- `meshinit`: build the specs, `meshinit.plan`, `meshinit.materialize` (the default
  strategy); `meshinit:<name>` selects another strategy with
  `meshinit.options(strategy=<name>)`, and `meshinit+xla-defaults` is the default
  strategy compiled with XLA's default options instead of meshinit's CPU compiler
  options (`meshinit.options(compiler_options={})`): it measures what that choice
  trades between cold and warm time.
- `nnx.jit`: a flax nnx Module whose `__init__` makes each parameter as
  `nnx.Param(init(rngs.params(), shape), out_sharding=<mesh axes>, mesh=mesh)`,
  constructed inside `nnx.jit` under `jax.set_mesh(mesh)`.
- `jax.jit`: MaxText's recipe, one `jax.jit(build, out_shardings=...)` with every
  parameter as an output.
- `eager-nnx`: the same Module constructed eagerly; flax's eager sharding (on by
  default) places each array.

Unchanged constructors (meshinit's constructor engine), the same stack written as
ordinary framework code, against the framework's own sharded-init recipe:

- `meshinit.nnx`: `meshinit.nnx.init(lambda: Transformer(nnx.Rngs(0)))` of the
  `nnx.jit` recipe's Module, unchanged.
- `meshinit.nnx:2mesh`: the same with `meshes=`, split over two disjoint
  (fsdp=2, tensor=2) stage meshes: `embed` and the first half of the layers on
  devices 0-3, the rest and `head` on devices 4-7; each array is checked against its
  stage's mesh.
- `meshinit.nnx:table`: the same Module without sharding metadata (`nnx.Param(init(...))`),
  placed by a table kept outside it: `meshinit.nnx.init(..., placements=table,
  mesh=mesh)`, one `(regex, PartitionSpec)` entry per parameter name
  (`layers\\.\\d+\\.q`, ...). `meshinit.linen:table` is the linen Module without its
  `nn.with_logical_partitioning` boxes, placed by the same table in logical names
  (`rules=rules`). The goal: the same speed as the annotated model.
- `linen.jit`: a linen Module whose params are `self.param(name,
  nn.with_logical_partitioning(init, axes), shape, dtype)`, initialized by flax's
  recipe: `jax.eval_shape(module.init, ...)`, `nn.get_partition_spec`,
  `nn.logical_to_mesh_sharding(..., mesh, rules)`, then `jax.jit(module.init,
  out_shardings=...)`. It runs without a mesh context: on the reference mesh's
  Explicit axes, the boxes' `with_sharding_constraint` would be an assertion.
- `meshinit.linen`: `meshinit.linen.init(module, key, tokens, mesh=mesh,
  rules=rules)` of that Module; `meshinit.linen:2mesh` adds `meshes=` with the
  two-stage split.
- `eqx.filter_jit`: an equinox stack (`eqx.nn.Embedding`, `eqx.nn.Linear` without
  bias, whose weights are (out, in), ones for the norms) built by
  `eqx.filter_jit` of its constructor, every array placed inside: `eqx.filter_shard`
  on Auto axes, `jax.sharding.reshard` on Explicit ones (jax rejects
  `with_sharding_constraint`, which `filter_shard` is, there).
- `meshinit.eqx`: `meshinit.eqx.init(factory, key, placements, mesh=mesh,
  rules=rules)` of that constructor, with one regex per parameter name.

Cold cases: each in a fresh process, persistent compilation cache off; the clock starts
after imports and mesh creation and stops when `jax.block_until_ready` returns on every
array; it includes building specs, plan and module. The best of the processes is
shown. After the clock stops, every array's mesh, PartitionSpec and shards are checked
against the exact expected placement (resolved without meshinit). Compile time is the
sum of `/jax/core/compile/backend_compile_duration` events (a `jax.monitoring`
listener) in that process; meshinit compiles its executables in parallel threads (one
per core), so its sum can exceed the time the compiles took.

Warm re-init: in one process, meshinit's `materialize` of the same plan with a new
key, against the fused jit recipe's already compiled executable called with a new key
(keys made beforehand). The calls are interleaved, one of each recipe per new key, so
a change in the machine's load hits all of them alike; each gets the best of its
calls, and the median is shown too. The throughput ratio is fused time / meshinit
time. A second fused jit is built the way meshinit builds its CPU programs: traced
with meshinit's straight-line threefry hash (jax's threefry2x32 bits, without jax's
rolled CPU loop) and compiled with meshinit's CPU compiler options (XLA backend
optimization level 1, classic emitters), and timed the same way. It runs meshinit's
kernels in one launch, so meshinit's time against it is what meshinit's launches
cost, and its time against the first is what the hash and the options change.

Per-device memory: `memory_analysis()` of meshinit's compiled executables (per device,
SPMD). Replaying meshinit's run order, each call's peak is the parameters made so far
plus that call's outputs and temporaries; the goal compares the largest such peak with
the device's share of all parameters. (meshinit runs the calls that make the most
bytes first, so any temporaries come while little else is allocated.) The fused jit
recipe's single executable is shown for comparison.

Host memory: a cold init of the reference stack made wider, in a fresh process; the
peak RSS high-water mark is reset right before the clock starts
(`/proc/self/clear_refs`), and the increase is the peak (`VmHWM`) minus the RSS at the
start. All 8 simulated devices share the host's memory.

Planning: `meshinit.plan` of a tree of specs, the first call in a fresh process (which
includes one abstract evaluation per distinct initializer and shape), and the best of
three more calls. Building the specs is timed separately."""


def markdown(results: dict, png: str | None) -> str:
    m, cfg = results["machine"], results["config"]
    lines = [
        "# Performance",
        "",
        "Measured by `benchmarks/suite.py`; every number below comes from one run:",
        "",
        "```",
        results["command"],
        "```",
        "",
        f"- Machine: {m['platform']}, {m['cpu_count']} CPUs ({m['cpu']}); load average "
        f"{m['load_avg'][0]:.2f} at the start (a shared machine: expect noise).",
        f"- Python {m['python']}, jax {m['jax']}, jaxlib {m['jaxlib']}, flax {m['flax']}, "
        f"meshinit at `{m['meshinit']}`; {m['date']}; the suite took "
        f"{results['wall_s'] / 60:.1f} min.",
        f"- Cold cases: best of {cfg['repeats']} processes; width x{cfg['width']}. "
        + (
            "Only the constructor engine's cases ran."
            if _constructor_run(results)
            else f"Warm: {cfg['warm_layers']} layers, best of {cfg['warm_repeats']} calls. "
            f"Host memory: {cfg['mem_layers']} layers, width x{cfg['mem_width']}."
        ),
        "",
        "## Method",
        "",
        METHOD,
    ]
    for title, body in _sections(results):
        if body:
            lines += ["", f"## {title}", "", body]
        if title == "Cold init vs depth" and png:
            lines += ["", f"![cold init time vs depth]({png})"]
    found = notes(results)
    if found:
        lines += ["", "## Notes from this run", ""] + [f"- {n}" for n in found]
    return "\n".join(lines) + "\n"


def plot(results: dict, path: str) -> str:
    """Writes the cold-time-vs-depth plot; returns what happened."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib import ticker
    except ImportError:
        return "matplotlib is not installed: no plot (pip install matplotlib)"
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for recipe, by_layers in results["cold"].items():
        points = sorted((int(n), r["seconds"]) for n, r in by_layers.items() if "seconds" in r)
        if points:
            ax.plot(*zip(*points, strict=True), marker="o", label=_label(recipe, by_layers))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(ticker.FormatStrFormatter("%g"))
    ax.tick_params(axis="y", which="minor", labelsize="x-small")
    layers = _layers(results)
    ax.set_xticks(layers, [str(n) for n in layers])
    ax.set_xlabel("layers")
    ax.set_ylabel("cold init time (s), best of processes")
    ax.set_title("Cold init on 8 simulated CPU devices")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"wrote {path}"
