"""What every measured process shares: the setup (8 simulated CPU devices, the
persistent compilation cache off, the reference mesh), the backend's warm-up, the
compile clock, one timed init of a recipe, the best of repeated calls, and deleting
its arrays; and, for the parent, running one measured process (:func:`run_child`).
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import threading
import time
from typing import Any

import recipes
from models import CPU_MESH, Model


def setup_cpu() -> Any:
    """8 CPU devices, no persistent compilation cache; returns the reference mesh."""
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    jax.config.update("jax_enable_compilation_cache", False)
    shape, names = CPU_MESH
    return jax.make_mesh(shape, names)


def warm_up_backend() -> None:
    """A tiny jit and a tiny random draw: the backend's lazy start-up (first compile,
    first kernels) is then nobody's cost."""
    import jax

    jax.block_until_ready(jax.jit(lambda k: jax.random.normal(k, (8,)))(jax.random.key(1)))


class CompileClock:
    """Sums XLA backend compile time and counts compilations (jax.monitoring listeners).

    jax reports its compile event for a program read back from the persistent
    compilation cache too (the event times the compile step, the read included), so a
    cache hit is counted apart (``hits``), and ``count`` is the programs XLA compiled;
    ``programs`` holds the duration of each of those (``slowest`` is its largest). jax
    reports a hit and its duration from the same thread, so compiles running in
    parallel threads are told apart.
    """

    EVENT = "/jax/core/compile/backend_compile_duration"
    HIT = "/jax/compilation_cache/cache_hits"

    def __init__(self) -> None:
        import jax

        self._hit = threading.local()
        self.reset()
        jax.monitoring.register_event_duration_secs_listener(self._listen)
        jax.monitoring.register_event_listener(self._listen_hit)

    def _listen_hit(self, event: str, **_: Any) -> None:
        if event == self.HIT:
            self._hit.pending = True

    def _listen(self, event: str, duration: float, **_: Any) -> None:
        if event == self.EVENT:
            self.seconds += duration
            self.steps += 1
            if getattr(self._hit, "pending", False):
                self._hit.pending = False
                self.hits += 1
            else:
                self.programs.append(duration)

    def reset(self) -> None:
        self.seconds, self.steps, self.hits = 0.0, 0, 0
        self.programs: list[float] = []

    @property
    def count(self) -> int:
        """Programs compiled, not read from the persistent cache."""
        return len(self.programs)

    compiles = count

    @property
    def slowest(self) -> float:
        """The longest single compile, in seconds (0 if none)."""
        return max(self.programs, default=0.0)


def timed_init(recipe: str, model: Model, mesh: Any, seed: int = 0) -> tuple[Any, dict]:
    """``recipe``'s init, timed until every array is ready, with its compiles counted."""
    import jax

    clock = CompileClock()
    start = time.perf_counter()
    with recipes.options_for(recipe):
        out = recipes.run(recipe, model, mesh, seed)
        jax.block_until_ready(out)
    seconds = time.perf_counter() - start
    timed = {"seconds": seconds, "compile_s": clock.seconds, "compiles": clock.count}
    return out, {**timed, "cache_hits": clock.hits}


def best_of(fn: Any, repeats: int) -> float:
    """The fastest of ``repeats`` calls of ``fn``, each until its arrays are ready; each
    result is deleted before the next call."""
    import jax

    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
        delete_arrays(out)
    return min(times)


def delete_arrays(tree: Any) -> None:
    import jax

    for array in jax.tree.leaves(tree):
        array.delete()


def run_child(
    command: list[str], timeout: float, cap_bytes: int | None = None, env: Any = None
) -> dict:
    """Runs ``command`` in a fresh process and returns the JSON of its last stdout line
    that starts with ``RESULT ``, or ``{"error": ...}`` (its exit status and the end of
    its stderr) if it fails or prints none.

    Killed after ``timeout`` seconds; with ``cap_bytes``, killed once its resident
    memory passes that many bytes, and the result says so (``"killed_for_memory"``):
    a recipe that would take the machine's memory is recorded, not left to the
    kernel's OOM killer.
    """
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        child = subprocess.Popen(command, stdout=out, stderr=err, text=True, env=env)
        start, peak, killed = time.perf_counter(), 0, None
        while child.poll() is None:
            if time.perf_counter() - start > timeout:
                killed = f"timed out after {timeout:.0f} s"
            elif cap_bytes is not None:
                peak = max(peak, rss_of(child.pid))
                if peak > cap_bytes:
                    over = f"resident {peak / 1e9:.2f} GB > {cap_bytes / 1e9:.2f} GB"
                    killed = f"killed for memory: {over}"
            if killed:
                child.kill()
                child.wait()
                result: dict[str, Any] = {"error": killed}
                if killed.startswith("killed for memory"):
                    result["killed_for_memory"] = True
                return result
            time.sleep(0.05)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    for line in reversed(stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line.removeprefix("RESULT "))
    tail = [line for line in stderr.splitlines() if line.strip()][-3:]
    return {"error": f"exit {child.returncode}: " + " | ".join(tail)[-600:]}


def rss_of(pid: int) -> int:
    """A process's resident bytes now (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
