"""``benchmarks/export.py``'s tables: each case's runs summed up (the slowest process's
time, peak RSS, the store's bytes per process), issue 66's goals and whether each is
met, and the per-case details."""

from __future__ import annotations

import argparse

from export import MiB
from export_model import model_bytes


def summarize(a, found: dict) -> dict:
    """Per depth and case, per repeat: the slowest process's time, peak RSS, bytes."""
    out = {}
    for layers in a.layers:
        model = model_bytes(argparse.Namespace(**{**vars(a), "layers": layers}))
        for case in a.cases:
            got = found.get(f"{layers}/{case}")
            if got is None:
                continue
            reps = []
            for rep in range(a.repeats):
                runs = [w["runs"][rep] for w in got["workers"]]
                row = {
                    "seconds": max(r["seconds"] for r in runs),
                    "rss": [r["rss"]["peak"] for r in runs],
                    "rss_base": [r["rss"]["base"] for r in runs],
                    "peer_sent": sum(r["peer_sent"] for r in runs),
                    "compiles": max(r["compiles"]["count"] for r in runs),
                    "compile_s": max(r["compiles"]["seconds"] for r in runs),
                    "programs": max(r["programs"] for r in runs),
                    "wrong": [w for r in runs for w in r.get("wrong", [])],
                    "parts": {k: v for k, v in runs[0].items() if k in PARTS},
                }
                if case.endswith("/s3"):
                    st = got["store"][rep]
                    held = sum(st["objects"].values())
                    index = sum(v for k, v in st["objects"].items() if k.endswith(".json"))
                    sent = [st["clients"].get(r["key"], [0, 0, 0])[0] for r in runs]
                    row |= {"held": held, "index": index, "received": sent,
                            "requests": [st["clients"].get(r["key"], [0, 0, 0])[1] for r in runs],
                            "errors": sum(v[2] for v in st["clients"].values())}  # fmt: skip
                if case.startswith("meshinit"):
                    row["bytes_by_process"] = runs[0]["bytes_by_process"]
                reps.append(row)
            out[f"{layers}/{case}"] = {"model": model, "reps": reps}
    return out


PARTS = ("gather", "save_file", "upload", "fsync_after", "done", "files")


def goals(a, s: dict) -> list[list[str]]:
    """Rows: measure, goal, value, met?"""
    rows = []

    def row(what, goal, value, ok):
        oks = ok if isinstance(ok, list) else [ok]
        if None in oks:
            said = "n/a"
        elif all(oks) or not any(oks):
            said = "met" if oks[0] else "NOT met"
        else:
            said = ", ".join(("met" if k else "NOT met") + f" ({i})" for i, k in enumerate(oks))
        rows.append([what, goal, value, said])

    rate = a.bandwidth_mib * MiB
    budget = a.inflight_mib * MiB
    for n in a.layers:
        m = s.get(f"{n}/meshinit/s3")
        if m:
            r = m["reps"][0]
            ratio = sum(r["received"]) / r["held"]
            row(f"{n} layers: bytes the store received / bytes it holds", "<= 1.02",
                f"{ratio:.4f} ({sum(r['received']) / MiB:.1f} / {r['held'] / MiB:.1f} MiB)",
                ratio <= 1.02)  # fmt: skip
            mean = sum(r["received"]) / len(r["received"])
            top = max(r["received"])
            less = max(x - (r["index"] if i == 0 else 0) for i, x in enumerate(r["received"]))
            row(f"{n} layers: bytes sent, busiest process / mean", "<= 1.10 (+ the index)",
                f"{top / mean:.3f} ({less / mean:.3f} without the index); "
                + ", ".join(f"{x / MiB:.1f}" for x in r["received"]) + " MiB",
                less / mean <= 1.10)  # fmt: skip
            if rate:  # each repeat: (0) the first export, compiles included
                at = r["held"] / rate
                got = [x["seconds"] / at for x in m["reps"]]
                row(f"{n} layers: time at the cap / (file bytes / cap)", "<= 1.3",
                    " / ".join(f"{g:.2f} ({x['seconds']:.2f} s)" for g, x in
                               zip(got, m["reps"], strict=True)) + f"; file bytes / cap {at:.2f} s",
                    [g <= 1.3 for g in got])  # fmt: skip
        for store in ("local", "s3"):
            m, g = s.get(f"{n}/meshinit/{store}"), s.get(f"{n}/gather/{store}")
            if m and g:
                pairs = [
                    (x["seconds"], y["seconds"]) for x, y in zip(m["reps"], g["reps"], strict=True)
                ]
                row(f"{n} layers, {store}: time, meshinit / gather to process 0", "<= 0.35",
                    " / ".join(f"{x / y:.2f} ({x:.2f} s / {y:.2f} s)" for x, y in pairs),
                    [x / y <= 0.35 for x, y in pairs])  # fmt: skip
        for case in ("meshinit/local", "meshinit/s3"):
            if m := s.get(f"{n}/{case}"):
                peak = max(m["reps"][0]["rss"])
                row(f"{n} layers ({m['model'] / MiB:.0f} MiB), {case}: peak RSS increase, "
                    "largest process", f"<= {budget / MiB:.0f} + 256 MiB",
                    f"{peak / MiB:.0f} MiB (" + ", ".join(
                        f"{p / MiB:.0f}" for p in m["reps"][0]["rss"]) + ")",
                    peak <= budget + 256 * MiB)  # fmt: skip
    counts = [s[f"{n}/meshinit/local"]["reps"][0] for n in a.layers if f"{n}/meshinit/local" in s]
    if len(counts) == len(a.layers) and len(counts) > 1:
        programs = [c["programs"] for c in counts]
        row(f"compiles at {' and '.join(map(str, a.layers))} layers: export programs "
            "(backend compiles)", "equal",
            " and ".join(f"{c['programs']} ({c['compiles']})" for c in counts),
            len(set(programs)) == 1)  # fmt: skip
    return rows


def details(a, s: dict) -> list[list[str]]:
    """Rows: depth, case, time, peak RSS per process, socket bytes between processes,
    compiles, and the gather route's parts (process 0)."""
    rows = []
    for key, v in s.items():
        for i, r in enumerate(v["reps"]):
            parts = ", ".join(f"{k} {x:.2f} s" for k, x in r["parts"].items() if k in PARTS[:5])
            rows.append([
                key.replace("/", " ", 1), str(i), f"{r['seconds']:.2f} s",
                " / ".join(f"{x / MiB:.0f}" for x in r["rss"]),
                f"{r['peer_sent'] / v['model']:.2f}x",
                f"{r['programs']} ({r['compiles']}, {r['compile_s']:.2f} s)", parts or "",
            ])  # fmt: skip
    return rows


def table(head: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(out + ["| " + " | ".join(r) + " |" for r in rows])
