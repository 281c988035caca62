"""The measures and goals of benchmarks/fanout.py (issues 58 and 67): the all-gather
bound of its plan on its mesh, each depth's and mode's figures from the workers' loads,
the table of goals, and what ``--quick`` asserts."""

from __future__ import annotations

PROCESSES, LOCAL = 4, 2
MODES = ("False", "None")


def layout(layers: int, d: int, ffn: int, vocab: int) -> dict[str, tuple[tuple, tuple | None]]:
    """Path -> (shape, mesh axes) of the mixed plan."""
    out: dict[str, tuple[tuple, tuple | None]] = {"embed": ((vocab, d), ("data", "tensor"))}
    for i in range(layers):
        out[f"layers.{i}.attn"] = ((d, d), ("data", "tensor"))
        out[f"layers.{i}.up"] = ((d, ffn), (None, "tensor"))
        out[f"layers.{i}.down"] = ((ffn, d), ("tensor", None))
        out[f"layers.{i}.norm"] = ((d,), None)
    return out


def grid(args) -> tuple[int, int]:
    """The mesh's shape: ``--mesh`` (``RxC``), else a row of devices per process."""
    if args.mesh:
        rows, cols = (int(n) for n in args.mesh.split("x"))
        if rows * cols != args.processes * LOCAL:
            raise SystemExit(f"fanout: --mesh {args.mesh} is not {args.processes} x {LOCAL}")
        return rows, cols
    return args.processes, LOCAL


def bound(shapes: dict, mesh: tuple[int, int], itemsize: int) -> tuple[int, int]:
    """(unique bytes, the all-gather lower bound) of the plan on the benchmark's mesh
    (devices in process order, ``LOCAL`` a process): per distinct block of each entry,
    (R - 1) x its bytes, R the processes holding it."""
    import numpy as np

    procs = np.arange(mesh[0] * mesh[1]).reshape(mesh) // LOCAL
    unique = low = 0
    for shape, axes in shapes.values():
        size = int(np.prod(shape)) * itemsize
        unique += size
        used = {a for a in axes or () if a}
        split = [i for i, name in enumerate(("data", "tensor")) if name in used]
        blocks = int(np.prod([mesh[i] for i in split]))
        # a block: a choice of index along the used mesh axes, held by the rest
        moved = np.moveaxis(procs, split, list(range(len(split))))
        for held in moved.reshape(blocks, -1):
            low += (len(set(held.tolist())) - 1) * size // blocks
    return unique, low


def _due(load: dict) -> int | None:
    """The bytes that must cross given who fetched what: bytes_from_peers, summed."""
    return None if None in load["from_peers"] else sum(load["from_peers"])


def summarize(args, loads: list[dict], served: dict, rate: float) -> dict:
    out: dict = {"config": vars(args) | {"local_devices": LOCAL}}
    itemsize = 2 if args.dtype in ("bfloat16", "float16") else 4
    for layers in args.layers:
        unique, low = bound(layout(layers, args.d, args.ffn, args.vocab), grid(args), itemsize)
        for mode in MODES:
            mine = [r for r in loads if r["layers"] == layers and r["mode"] == mode]
            per_rep = []
            for rep in range(args.repeats):
                rows = sorted((r for r in mine if r["rep"] == rep), key=lambda r: r["rank"])
                data = [served.get(r["key"], (0, 0))[0] for r in rows]
                head = sum(served.get(r["key"], (0, 0))[1] for r in rows)
                per_rep.append(
                    {
                        "seconds": max(r["seconds"] for r in rows),
                        "store": sum(data) / unique,
                        "headers": head,
                        "busiest": max(data) / (sum(data) / len(data)) if sum(data) else None,
                        "per_process": data,
                        "peer_sent": sum(r["peer_sent"] for r in rows),
                        "peer_received": sum(r["peer_received"] for r in rows),
                        "from_peers": [r["bytes_from_peers"] for r in rows],
                        "bytes_read": [r["bytes_read"] for r in rows],
                        "compiles": max(r["compiles"] for r in rows),
                        "wrong": [w for r in rows for w in r["wrong"]],
                    }
                )
            first, at = per_rep[0], (unique / rate) if rate else None
            out[f"{layers}/{mode}"] = {
                "unique": unique,
                "bound": low,
                "loads": per_rep,
                "store": max(p["store"] for p in per_rep),
                "busiest": max((p["busiest"] or 0) for p in per_rep),
                "between": first["peer_sent"] / low if low else None,
                "due": first["peer_sent"] / due if (due := _due(first)) else None,
                "time_first": first["seconds"] / at if at else None,
                "time_best": min(p["seconds"] for p in per_rep[1:]) / at
                if at and len(per_rep) > 1
                else None,
                "compiles": first["compiles"],
                "supported": all(r["fan_out_supported"] for r in mine),
                "wrong": [w for p in per_rep for w in p["wrong"]],
            }
    return out


GOALS = (  # (measure, key, goal); the first four are structural: --quick asserts them
    ("data bytes served by the store / unique", "store", 1.02),
    ("bytes fetched: busiest process / mean", "busiest", 1.10),
    ("bytes between processes / due (bytes_from_peers)", "due", 1.05),
    ("bytes between processes / all-gather bound", "between", 1.05),
    ("load time at the cap / (unique / cap), first", "time_first", 1.3),
    ("load time at the cap / (unique / cap), repeat", "time_best", 1.3),
)


def goals(found: dict, layers: list[int]) -> list[list[str]]:
    """Rows: measure, goal, fan_out=None, fan_out=False, met? (fan_out=None's)."""
    rows = []
    for n in layers:
        on, off = found[f"{n}/None"], found[f"{n}/False"]
        for what, key, limit in GOALS:
            v, cells = on[key], ["n/a" if x is None else f"{x:.3f}" for x in (on[key], off[key])]
            met = "n/a" if v is None or not on["supported"] else "met" if v <= limit else "NOT met"
            rows.append([f"{what}, {n} layers", f"<= {limit:.2f}", *cells, met])
    added = [found[f"{n}/None"]["compiles"] - found[f"{n}/False"]["compiles"] for n in layers]
    same = "met" if len(set(added)) == 1 else "NOT met"
    depths = " and ".join(map(str, layers))
    counts = " and ".join(map(str, added))
    rows.append([f"compiles added by fan-out, {depths} layers", "equal", counts, "0", same])
    return rows


def check_quick(found: dict, layers: list[int], rowwise: bool) -> list[str]:
    """The structural goals --quick asserts: what is wrong, or nothing."""
    wrong = [w for k, v in found.items() if k != "config" for w in v["wrong"]]
    for n in layers:
        off, on = found[f"{n}/False"], found[f"{n}/None"]
        if off["loads"][0]["peer_sent"] > 0.05 * off["bound"]:  # the agreement only
            wrong.append(f"{n} layers, fan_out=False: processes exchanged data")
        if not on["supported"]:
            wrong.append("this meshinit's safetensors.load has no fan_out")
            continue
        # the all-gather bound leaves out what a moved axis exchanges (a process's
        # blocks split along columns across processes): asserted where none moves
        structural = GOALS[:4] if rowwise else GOALS[:3]
        wrong += [
            f"{n} layers, fan_out=None: {what} {on[key]} > {limit}"
            for what, key, limit in structural
            if on[key] is None or on[key] > limit
        ]
        if None in on["loads"][0]["from_peers"]:
            wrong.append(f"{n} layers: bytes_from_peers not recorded")
    added = {found[f"{n}/None"]["compiles"] - found[f"{n}/False"]["compiles"] for n in layers}
    if len(added) != 1:
        wrong.append(f"compiles added by fan-out differ with depth: {sorted(added)}")
    return wrong
