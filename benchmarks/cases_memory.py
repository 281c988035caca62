"""The host-memory measurements, each meant to run in a fresh process (``suite.py``
spawns them through ``cases.CASES``): the peak RSS of one cold init
(:func:`host_memory`), the real-size run (:func:`real_size`, :data:`REAL_SIZES`), and
touching fresh memory first (:func:`prefault`).
"""

from __future__ import annotations

import gc
import time

import checks
import recipes
from harness import delete_arrays, setup_cpu, timed_init
from models import Model


def prefault(nbytes: int) -> dict:
    """Touches ``nbytes`` of fresh memory once, then frees it. On a virtual machine the
    first touch of a guest page since boot can cost far more than any later one (this
    machine: about 3 s per GB, against well under 1 s once touched), so the first recipe
    of a real-size run would pay for every page the machine never used. This makes every
    recipe start from memory the machine has touched before."""
    import numpy as np

    start = time.perf_counter()
    chunk, held = 1 << 28, []
    for _ in range(nbytes // chunk):
        held.append(np.ones(chunk // 8))
    return {"bytes": len(held) * chunk, "seconds": time.perf_counter() - start}


def _rss_now() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmRSS")


def _rss_peak() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmHWM")


def host_memory(recipe: str, layers: int, width: int) -> dict:
    """Peak host RSS increase over the pre-init baseline during one cold init.

    On Linux the high-water mark is reset right before the clock starts (writing 5 to
    /proc/self/clear_refs), so the peak is that of the init alone. Otherwise the
    baseline is ``ru_maxrss`` before, an underestimate only if something earlier in
    the process peaked higher than the init.
    """
    import resource

    import jax

    mesh = setup_cpu()
    model = Model.cpu(layers, width)
    recipes.preload(recipe)
    jax.block_until_ready(jax.numpy.zeros(8))  # start the backend before the baseline
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        baseline, method = _rss_now(), "VmHWM after reset - VmRSS before"
    except OSError:
        baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        method = "ru_maxrss after - ru_maxrss before"
    start = time.perf_counter()
    with recipes.options_for(recipe):
        out = recipes.run(recipe, model, mesh)
        jax.block_until_ready(out)
    seconds = time.perf_counter() - start
    if method.startswith("VmHWM"):
        peak = _rss_peak()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "seconds": seconds,
        "increase": peak - baseline,
        "nbytes": model.nbytes,
        "method": method,
        "problems": checks.placement_problems(model, mesh, out, recipe=recipe),
    }


REAL_SIZES = {
    "1b": lambda: Model.cpu(16, 8),  # 0.99 B parameters, f32: 3.96 GB
    "8b": Model.llama3_8b,  # Llama-3-8B's shapes, bf16: 16.06 GB
    "tiny": lambda: Model.cpu(2, 1),  # the same code path in seconds, for the tests
}


def real_size(recipe: str, size: str) -> dict:
    """One cold init of a real-size model (:data:`REAL_SIZES`): its time, its peak host
    RSS increase (as :func:`host_memory`), and, for the spec path, the floor.

    The floor is what generating the bytes costs once nothing is left to compile: the
    first arrays are deleted, then the same plan is made again with a new key, so the
    compiled programs are cached but fresh memory must be touched again.
    """
    import jax

    mesh = setup_cpu()
    model = REAL_SIZES[size]()
    recipes.preload(recipe)
    jax.block_until_ready(jax.numpy.zeros(8))  # start the backend before the baseline
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM: the peak is this init's
    baseline = _rss_now()
    out, timed = timed_init(recipe, model, mesh)
    result = {
        **timed,
        "increase": _rss_peak() - baseline,
        "nbytes": model.nbytes,
        "params": model.num_params,
        "problems": checks.placement_problems(model, mesh, out, recipe=recipe),
    }
    if recipes.is_spec_path(recipe):
        delete_arrays(out)
        del out
        gc.collect()
        _, again = timed_init(recipe, model, mesh, seed=1)
        result["floor"] = again["seconds"]
    return result
