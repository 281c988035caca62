"""meshinit's check of a safetensors file against the ``safetensors`` package's own open.

A file of ``--entries`` one-element F32 tensors (default 200,000, named as an MoE
checkpoint's per-expert scales: an 18 MB header, within the format's 100 MB cap) is
written once; then, in turns, ``--rounds`` times each, in this process:

- ``safe_open``: ``safetensors.safe_open(path, framework="numpy")`` and its ``keys()``,
  the package's own parse and validation;
- ``meshinit``: ``meshinit._checkpoint.store.listing.check(LocalFile(path))``, every check a load
makes before a
  byte of data is read (the header's length and JSON, every entry, the tiling of the
  data section, the package's verdict and names).

The best time of each and their ratio are printed; ``--json`` writes them. Issue 42's
goal: meshinit's check near the package's open (it was 10x and more at this size).

Run: python benchmarks/safetensors_header.py [--entries N] [--rounds R] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import struct
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def write(path: pathlib.Path, entries: int) -> int:
    """The file, written as the format lays it out (names sorted, offsets in order);
    returns the header's length in bytes."""
    header = {}
    for i in range(entries):
        name = f"model.layers.{i // 256}.mlp.experts.{i % 256}.down_proj.scale"
        header[name] = {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        f.write(bytes(4 * entries))
    return len(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--entries", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()

    from safetensors import safe_open

    from meshinit._checkpoint.store import listing as _file
    from meshinit._checkpoint.store.local import LocalFile

    def package(path: pathlib.Path) -> int:
        f = safe_open(str(path), framework="numpy")
        return len(f.keys())

    def meshinit(path: pathlib.Path) -> int:
        checked, problems = _file.check(LocalFile(path))
        assert checked is not None and not problems, problems
        return len(checked.tensors)

    with tempfile.TemporaryDirectory() as d:
        path = pathlib.Path(d) / "many.safetensors"
        length = write(path, args.entries)
        best = {"safe_open": float("inf"), "meshinit": float("inf")}
        for _ in range(args.rounds):
            for name, run in (("safe_open", package), ("meshinit", meshinit)):
                t = time.perf_counter()
                count = run(path)
                best[name] = min(best[name], time.perf_counter() - t)
                assert count == args.entries, (name, count)
    ratio = best["meshinit"] / best["safe_open"]
    print(f"{args.entries} entries, a {length / 1e6:.1f} MB header; best of {args.rounds}")
    print("| recipe | seconds | vs safe_open |")
    print("|---|---|---|")
    for name, seconds in best.items():
        print(f"| {name} | {seconds:.3f} | {seconds / best['safe_open']:.2f}x |")
    if args.json:
        out = {"entries": args.entries, "header_bytes": length, **best, "ratio": ratio}
        pathlib.Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
