"""``export.py --tpu``: 2 GiB of bf16 from one chip's HBM to a local folder,
``meshinit.safetensors.save`` against ``jax.device_get`` + ``safetensors.numpy.save_file``
(the issue measured the second at 5.79 s on a v5e: device-to-host alone 1.44 s, the
write alone 1.36 s).

The arrays: ``--arrays`` (16) of ``(rows, 8192)`` bf16 making ``--mib`` (2048) MiB,
drawn on the device by one jitted ``jax.random.normal``, placed ``P()`` on the chip's
``(1, 1)`` mesh, named as HF's layers (``model.layers.<i>.mlp.up_proj.weight``).

Each route runs in a fresh process (``export.py --tpu --child ROUTE ...``), one at a
time (a chip serves one process); the parent never opens the chip. Routes:

- ``meshinit``: ``meshinit.safetensors.save(arrays, folder)`` (its default
  ``max_inflight_bytes``, 1 GiB; its files are fsynced); then, untimed in the route's
  figure, a second export in the same process to another folder (``again``: its
  program already compiled);
- ``anchor``: ``jax.device_get`` of every array, then ``save_file`` of one
  ``model.safetensors`` (not fsynced: the fsync that follows is timed apart);
- ``device_get`` and ``write``: the anchor's two halves alone (``write`` times
  ``save_file`` of arrays already on the host).

``--repeats`` rounds of meshinit and the anchor in turn, then each half once; the
median of each route. Each process reports its time (from the arrays ready on the
device until the call returns), its compiles (``jax.monitoring``), its peak RSS
increase (export.Peak), and the folder's file system; meshinit's files are checked
against the arrays (the first and the last, read back with ``safe_open``) outside the
timing, and every folder is removed after its process.

``--cpu-check``: the same on the CPU (``JAX_PLATFORMS=cpu``, 64 MiB, 2 rounds); it
exits 1 if a route fails or meshinit's files differ. Without a TPU it says so and
exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import export

HERE = Path(__file__).resolve().parent
MiB = 1 << 20
COLS = 8192
ROUTES = ("meshinit", "anchor", "device_get", "write")
ISSUE = {"anchor": 5.79, "device_get": 1.44, "write": 1.36}


def file_system(path: str) -> str:
    """The type of the mount that holds ``path`` (/proc/mounts, longest prefix)."""
    best, kind = "", "?"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                fields = line.split()
                if path.startswith(fields[1]) and len(fields[1]) > len(best):
                    best, kind = fields[1], f"{fields[2]} ({fields[0]} on {fields[1]})"
    except OSError:
        pass
    return kind


def child(route: str, out: str, mib: int, arrays: int, base: str) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    rows = mib * MiB // arrays // 2 // COLS
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "tensor"))
    draw = jax.jit(
        lambda k: jax.random.normal(k, (rows, COLS), jnp.bfloat16),
        out_shardings=NamedSharding(mesh, P()),
    )
    keys = jax.random.split(jax.random.key(0), arrays)
    given = {f"model.layers.{i}.mlp.up_proj.weight": draw(keys[i]) for i in range(arrays)}
    jax.block_until_ready(list(given.values()))
    compiles = {"count": 0, "seconds": 0.0}

    def count(event, seconds, **kwargs):
        if event == export.EVENT:
            compiles["count"] += 1
            compiles["seconds"] += seconds

    jax.monitoring.register_event_duration_secs_listener(count)
    folder = tempfile.mkdtemp(dir=base, prefix=f"export-{route}-")
    file = os.path.join(folder, "model.safetensors")
    result: dict = {"route": route, "bytes": sum(a.nbytes for a in given.values())}
    result["device"] = f"{jax.devices()[0].platform}: {jax.devices()[0].device_kind}"
    result["file_system"] = file_system(folder)
    try:
        from safetensors.numpy import save_file

        import meshinit  # imported before the clock starts, as a user's program has it

        host = None
        if route == "write":
            host = jax.device_get(given)
        peak = export.Peak()
        start = time.perf_counter()
        if route == "meshinit":
            report = meshinit.safetensors.save(given, folder)
            result["files"] = list(report.files)
        elif route == "anchor":
            host = jax.device_get(given)
            result["device_get"] = time.perf_counter() - start
            save_file(host, file, metadata={"format": "pt"})
        elif route == "device_get":
            host = jax.device_get(given)
        elif route == "write":
            save_file(host, file, metadata={"format": "pt"})
        elif route == "timeline":
            result["timeline"] = timeline(given, base)
        result["seconds"] = time.perf_counter() - start
        result["rss"] = peak.stop()
        result["compiles"] = dict(compiles)
        if route in ("anchor", "write"):
            at = time.perf_counter()
            fd = os.open(file, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
            result["fsync_after"] = time.perf_counter() - at
        if route == "meshinit":
            result["wrong"] = check(given, folder)
            again = tempfile.mkdtemp(dir=base, prefix="export-again-")
            try:
                at = time.perf_counter()
                meshinit.safetensors.save(given, again)
                result["again"] = time.perf_counter() - at
            finally:
                shutil.rmtree(again, ignore_errors=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    Path(out).write_text(json.dumps(result))


def timeline(given: dict, base: str) -> dict:
    """Where meshinit's time and host memory go: its writer's steps (a tensor handed
    over, the writer waiting for one, each write, the fsync) and VmRSS every 10 ms,
    timed from the call, after a first export that compiled; at the default budget,
    256 MiB and 4 GiB. First, whether this kernel gives freed memory back to VmRSS
    (2 GiB of numpy made, touched and dropped)."""
    import threading

    import numpy as np

    import meshinit
    from meshinit._checkpoint.store import sink_local
    from meshinit._checkpoint.write import writer

    out: dict = {}
    before = export.rss("VmRSS")
    x = np.ones(2 << 30, np.uint8)
    held = export.rss("VmRSS")
    del x
    out["control"] = {"before": before, "held": held, "after": export.rss("VmRSS")}
    events: list = []
    clock = {"t0": 0.0}

    def now() -> float:
        return time.perf_counter() - clock["t0"]

    def logged(kind, fn, label=lambda *a: ""):
        def wrapped(*args, **kwargs):
            at = now()
            try:
                return fn(*args, **kwargs)
            finally:
                events.append([kind, label(*args), round(at, 4), round(now(), 4)])

        return wrapped

    writer.Writer.hand = logged("hand", writer.Writer.hand, lambda s, n, a: n[-22:])
    writer.Writer._take = logged("take", writer.Writer._take, lambda s, n: n[-22:])
    writer.Writer.wait_room = logged("wait_room", writer.Writer.wait_room)
    sink_local.FileUpload._send = logged(
        "write", sink_local.FileUpload._send, lambda s, v: v.nbytes
    )
    sink_local.FileUpload._finish = logged("fsync", sink_local.FileUpload._finish)
    warm = tempfile.mkdtemp(dir=base)
    meshinit.safetensors.save(given, warm)
    shutil.rmtree(warm)
    for budget in (None, 256 * MiB, 4096 * MiB):
        events.clear()
        samples: list = []
        stop = threading.Event()

        def sample(samples=samples, stop=stop):
            while not stop.wait(0.01):
                samples.append([round(now(), 3), export.rss("VmRSS")])

        folder = tempfile.mkdtemp(dir=base)
        base_rss = export.rss("VmRSS")
        thread = threading.Thread(target=sample, daemon=True)
        clock["t0"] = time.perf_counter()
        thread.start()
        meshinit.safetensors.save(given, folder, max_inflight_bytes=budget)
        total = now()
        stop.set()
        thread.join()
        shutil.rmtree(folder)
        out[str(budget)] = {
            "seconds": total,
            "base_rss": base_rss,
            "events": list(events),
            "rss": samples[:: max(1, len(samples) // 300)],
        }
    return out


def check(given: dict, folder: str) -> list[str]:
    import numpy as np
    from safetensors import safe_open

    names = list(given)
    wrong = []
    with safe_open(os.path.join(folder, "model.safetensors"), "flax") as f:
        for name in (names[0], names[-1]):
            got, want = np.asarray(f.get_tensor(name)), np.asarray(given[name])
            if got.shape != want.shape or got.tobytes() != want.tobytes():
                wrong.append(f"{name}: the file's tensor differs from the array")
    return wrong


def run(route: str, a, env: dict) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "out.json")
        cmd = [sys.executable, str(HERE / "export.py"), "--tpu", "--child", route, out]
        cmd += [f"--mib={a.mib}", f"--arrays={a.arrays}", f"--folder={a.folder}"]
        print(f"{time.strftime('%X')} {route}", flush=True)
        started = time.perf_counter()
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.timeout)
        if done.returncode or not os.path.exists(out):
            return {"route": route, "failed": f"exit {done.returncode}: {done.stderr[-3000:]}"}
        got = json.loads(Path(out).read_text())
        got["process"] = time.perf_counter() - started
        return got


def probe(env: dict) -> str:
    code = "import jax; d = jax.devices()[0]; print(d.platform, d.device_kind, sep='|')"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else f"failed|{done.stderr[-500:]}"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="export.py --tpu")
    ap.add_argument("--mib", type=int, default=2048)
    ap.add_argument("--arrays", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--folder", default=tempfile.gettempdir())
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--cpu-check", action="store_true")
    ap.add_argument("--timeline", action="store_true", help="and meshinit's steps, timed")
    ap.add_argument("--json")
    ap.add_argument("--child", nargs=2)
    a = ap.parse_args(argv)
    if a.child:
        child(a.child[0], a.child[1], a.mib, a.arrays, a.folder)
        return 0
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), str(HERE.parent)]))
    if a.cpu_check:
        env["JAX_PLATFORMS"] = "cpu"
        a.mib, a.repeats = 64, 2
    found = probe(env)
    platform = found.split("|")[0]
    if platform != "tpu" and not a.cpu_check:
        print(f"export.py --tpu: no TPU here ({found}); nothing measured")
        return 0
    results = []
    for _ in range(a.repeats):
        results += [run("meshinit", a, env), run("anchor", a, env)]
    results += [run("device_get", a, env), run("write", a, env)]
    if a.timeline:
        results.append(run("timeline", a, env))
    failed = [r for r in results if "failed" in r]
    wrong = [w for r in results for w in r.get("wrong", [])]
    print(report(a, results, found))
    if a.json:
        Path(a.json).write_text(json.dumps({"results": results, "device": found}, indent=1))
    for r in failed:
        print(f"{r['route']} FAILED: {r['failed']}")
    if wrong:
        print("WRONG: " + "; ".join(wrong))
    return 1 if failed or wrong else 0


def report(a, results: list[dict], device: str) -> str:
    ok = [r for r in results if "failed" not in r]
    by = {route: [r for r in ok if r["route"] == route] for route in ROUTES}
    lines_after = timeline_lines(next((r for r in ok if r["route"] == "timeline"), None))
    median = {k: statistics.median(r["seconds"] for r in v) for k, v in by.items() if v}
    any_ok = ok[0] if ok else {}
    lines = [
        f"{device.replace('|', ': ')}; {a.mib} MiB of bf16 in {a.arrays} arrays, to "
        f"{any_ok.get('file_system', '?')}; median of {a.repeats} fresh processes "
        "(the halves: one each)",
        "",
        "| route | seconds (each process) | median | the issue's | peak RSS increase (MiB) "
        "| compiles (s) |",
        "|---|---|---|---|---|---|",
    ]
    for route in ROUTES:
        if not by[route]:
            continue
        each = ", ".join(f"{r['seconds']:.2f}" for r in by[route])
        rss = ", ".join(f"{r['rss']['peak'] / MiB:.0f}" for r in by[route])
        comp = ", ".join(
            f"{r['compiles']['count']} ({r['compiles']['seconds']:.2f})" for r in by[route]
        )
        issue = f"{ISSUE[route]:.2f} s" if route in ISSUE else ""
        lines.append(f"| {route} | {each} | {median[route]:.2f} s | {issue} | {rss} | {comp} |")
    if "meshinit" in median and "anchor" in median:
        ratio = median["meshinit"] / median["anchor"]
        met = "met" if ratio <= 0.35 else "NOT met"
        lines += [
            "",
            f"meshinit / (device_get + save_file), medians: {ratio:.2f} (goal <= 0.35: {met})",
        ]
        fs = [r["fsync_after"] for r in by["anchor"] if "fsync_after" in r]
        if fs:
            lines.append(f"the anchor's fsync after save_file (not in its time): "
                         f"{', '.join(f'{x:.2f}' for x in fs)} s")  # fmt: skip
        again = [r["again"] for r in by["meshinit"] if "again" in r]
        if again:
            lines.append(
                "meshinit again in the same process (compiled): "
                + ", ".join(f"{x:.2f}" for x in again)
                + f" s; median / the anchor's: {statistics.median(again) / median['anchor']:.2f}"
            )
        parts = [r["device_get"] for r in by["anchor"] if "device_get" in r]
        if parts:
            lines.append(
                f"the anchor's device_get within it: {', '.join(f'{x:.2f}' for x in parts)} s"
            )
    return "\n".join(lines + lines_after)


def timeline_lines(found: dict | None) -> list[str]:
    """The timeline's summary: per budget, the time, the writer's waits, the writes'
    time, the fsync, and VmRSS's peak over the call's start."""
    if not found:
        return []
    t = found["timeline"]
    c = t["control"]
    lines = [
        "",
        f"VmRSS control: {c['before'] / MiB:.0f} MiB, {c['held'] / MiB:.0f} with 2 GiB "
        f"touched, {c['after'] / MiB:.0f} after it is dropped",
    ]
    for budget, v in t.items():
        if budget == "control":
            continue
        ev = v["events"]

        def spent(kind, ev=ev):
            return sum(e[3] - e[2] for e in ev if e[0] == kind)

        peak = max((r for _, r in v["rss"]), default=v["base_rss"]) - v["base_rss"]
        # the first write of a tensor's bytes (not the file's header)
        first = min((e[2] for e in ev if e[0] == "write" and e[1] >= MiB), default=0.0)
        lines.append(
            f"max_inflight_bytes {budget}: {v['seconds']:.2f} s; writer waiting for tensors "
            f"{spent('take'):.2f} s, writing {spent('write'):.2f} s (first write at "
            f"{first:.2f} s), fsync {spent('fsync'):.2f} s; main thread waiting for room "
            f"{spent('wait_room'):.2f} s; VmRSS peak +{peak / MiB:.0f} MiB"
        )
    return lines
