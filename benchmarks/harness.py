"""What every measured process shares: the setup (8 simulated CPU devices, the
persistent compilation cache off, the reference mesh), the compile clock, one timed
init of a recipe, and deleting its arrays.
"""

from __future__ import annotations

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


class CompileClock:
    """Sums XLA backend compile time and counts compilations (jax.monitoring listeners).

    jax reports its compile event for a program read back from the persistent
    compilation cache too (the event times the compile step, the read included), so a
    cache hit is counted apart (``hits``), and ``count`` is the programs XLA compiled.
    """

    EVENT = "/jax/core/compile/backend_compile_duration"
    HIT = "/jax/compilation_cache/cache_hits"

    def __init__(self) -> None:
        import jax

        self.seconds = 0.0
        self.steps = 0
        self.hits = 0
        jax.monitoring.register_event_duration_secs_listener(self._listen)
        jax.monitoring.register_event_listener(self._hit)

    def _listen(self, event: str, duration: float, **_: Any) -> None:
        if event == self.EVENT:
            self.seconds += duration
            self.steps += 1

    def _hit(self, event: str, **_: Any) -> None:
        if event == self.HIT:
            self.hits += 1

    @property
    def count(self) -> int:
        return self.steps - self.hits

    def reset(self) -> None:
        self.seconds, self.steps, self.hits = 0.0, 0, 0


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


def delete_arrays(tree: Any) -> None:
    import jax

    for array in jax.tree.leaves(tree):
        array.delete()
