"""The real-size run (``suite.py --only real-size``) in the report: its table, its
section of ``docs/performance.md`` (between markers that a later run replaces) and its
plot of cold time against parameter bytes.
"""

from __future__ import annotations

from report_tables import fmt_mb, fmt_s, md_table


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
                    fmt_s(r["seconds"]),
                    "" if floor is None else f"{r['seconds'] / floor:.2f}",
                    f"{r['increase'] / r['nbytes']:.3f}",
                    f"{r['compiles']} ({fmt_s(r['compile_s'])})",
                ]
            )
        head = f"**{size}**" + ("" if nbytes is None else f": {fmt_mb(nbytes)} of parameters")
        head += "" if floor is None else f"; floor {fmt_s(floor)} (a second materialize, new key)"
        header = ["recipe", "cold", "/ floor", "peak RSS increase / bytes", "compiles (time)"]
        out.append(head + "\n\n" + md_table(header, rows))
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
