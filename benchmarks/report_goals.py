"""The goals of a run and what they compare: the recipes and ratios of the constructor
engine's cases, the depth goal (compiles flat in depth, the cold slope per layer
against the warm one), and :func:`goals`, the rows of the goals table; with the
accessors of the cold results that the tables share (:func:`cold_seconds`,
:func:`layers_of`).
"""

from __future__ import annotations

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
ANCHOR_NAMES = {"meshinit": "meshinit (spec path)"}


def cold_seconds(results: dict, recipe: str, layers: int) -> float | None:
    r = results["cold"].get(recipe, {}).get(str(layers), {})
    return r.get("seconds")


def layers_of(results: dict) -> list[int]:
    return sorted({int(n) for by_layers in results["cold"].values() for n in by_layers})


def _ref(layers: list[int], want: int, pick: Any) -> int | None:
    return want if want in layers else (pick(layers) if layers else None)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def depth_pair(layers: list[int]) -> tuple[int | None, int | None]:
    """The depth goal's (shallow, deep) ends: 8 and 32 layers, else the extremes."""
    return _ref(layers, 8, min), _ref(layers, 32, max)


def depths_text(results: dict) -> str:
    """The depths the slopes are fitted over, as "8, 16, 32, 64 layers"."""
    return ", ".join(map(str, layers_of(results))) + " layers"


def _depth_goals(table: _Goals, results: dict, recipes: list[str]) -> None:
    """Compiles flat in depth for each of ``recipes`` measured at both ends."""
    lo, hi = depth_pair(layers_of(results))
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
    cold = {n: t for n in layers_of(results) if (t := cold_seconds(results, recipe, n))}
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


def constructor_run(results: dict) -> bool:
    return results.get("config", {}).get("only") == "constructor"


def goals(results: dict) -> list[list[str]]:
    """Rows: what, measured, goal, met. The spec path's goals (unless only the
    constructor cases ran), then the constructor engine's (if any of its recipes ran)."""
    rows = [] if constructor_run(results) else _spec_goals(results)
    if constructor_run(results) or any(r in results["cold"] for r, *_ in CONSTRUCTOR_GOALS):
        rows += constructor_goals(results)
    return rows


def constructor_goals(results: dict) -> list[list[str]]:
    """The constructor engine's goals: each ratio of two cold cases (best of processes)."""
    table = _Goals()
    layers = layers_of(results)
    hi = _ref(layers, 32, max)
    for ours, anchor, limit in CONSTRUCTOR_GOALS:
        value = _ratio(cold_seconds(results, ours, hi), cold_seconds(results, anchor, hi))
        table.add(
            f"cold {ours} / {ANCHOR_NAMES.get(anchor, anchor)}, {hi} layers", value, "<=", limit
        )
    ours = dict.fromkeys(r for r, *_ in CONSTRUCTOR_GOALS if r.startswith("meshinit"))
    _depth_goals(table, results, list(ours))
    p = results.get("planning_table") or {}
    what = f"{p.get('variables', 2000):,} variables against a {p.get('entries', 50)}-entry table"
    table.add(f"read {what} (placements=), first call (s)", p.get("table_first"), "<=", 0.1)
    return table.rows


def _spec_goals(results: dict) -> list[list[str]]:
    table = _Goals()
    add = table.add
    layers = layers_of(results)
    ref = _ref(layers, 32, max)
    for anchor, limit in (("nnx.jit", 0.1), ("eager-nnx", 0.5)):
        value = _ratio(cold_seconds(results, "meshinit", ref), cold_seconds(results, anchor, ref))
        add(f"cold meshinit / {anchor}, {ref} layers", value, "<=", limit)
    spec_recipes = [r for r in results["cold"] if r.startswith("meshinit") and "." not in r]
    _depth_goals(table, results, spec_recipes)
    cold, warm = slopes(results)
    what = f"per layer, {depths_text(results)}: meshinit's cold slope / its warm slope"
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
