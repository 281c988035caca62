"""Measurements, each meant to run in a fresh process (``suite.py`` spawns them).

Every case sets up 8 simulated CPU devices with the persistent compilation cache off,
creates the (fsdp=2, tensor=4) mesh, and only then starts its clock. Each returns a
JSON-serializable dict.
"""

from __future__ import annotations

import gc
import time
from typing import Any

import recipes
from recipes import Model


def setup_cpu() -> Any:
    """8 CPU devices, no persistent compilation cache; returns the reference mesh."""
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    jax.config.update("jax_enable_compilation_cache", False)
    shape, names = recipes.CPU_MESH
    return jax.make_mesh(shape, names)


class CompileClock:
    """Sums XLA backend compile time and counts compilations (a jax.monitoring listener)."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self) -> None:
        import jax

        self.seconds = 0.0
        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._listen)

    def _listen(self, event: str, duration: float, **_: Any) -> None:
        if event == self.EVENT:
            self.seconds += duration
            self.count += 1

    def reset(self) -> None:
        self.seconds, self.count = 0.0, 0


def _timed(recipe: str, model: Model, mesh: Any, seed: int = 0) -> tuple[Any, dict]:
    """``recipe``'s init, timed until every array is ready, with its compiles counted."""
    import jax

    clock = CompileClock()
    start = time.perf_counter()
    with recipes.options_for(recipe):
        out = recipes.run(recipe, model, mesh, seed)
        jax.block_until_ready(out)
    seconds = time.perf_counter() - start
    return out, {"seconds": seconds, "compile_s": clock.seconds, "compiles": clock.count}


def _delete(tree: Any) -> None:
    import jax

    for array in jax.tree.leaves(tree):
        array.delete()


def cold(
    recipe: str,
    layers: int,
    width: int = 1,
    check_values: bool = False,
    cache_dir: str | None = None,
) -> dict:
    """One cold init: from after imports and mesh creation until every array is ready.

    The placement check is ``recipe``'s (:func:`recipes.expected`); the value contract
    (``check_values``) is the spec path's, so it is checked for those recipes only.

    With ``cache_dir``, jax's persistent compilation cache is on, in that directory.
    """
    import jax

    mesh = setup_cpu()
    if cache_dir is not None:
        jax.config.update("jax_compilation_cache_dir", cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
        jax.config.update("jax_enable_compilation_cache", True)
    model = Model.cpu(layers, width)
    recipes.preload(recipe)
    strategy = recipes.strategy_of(recipe) if recipes.is_spec_path(recipe) else None
    out, timed = _timed(recipe, model, mesh)
    result = {
        **timed,
        "strategy": strategy,
        "nbytes": model.nbytes,
        "problems": recipes.placement_problems(model, mesh, out, recipe=recipe),
    }
    if check_values and strategy is not None:
        result["problems"] += recipes.value_problems(out, 0, model)
    return result


def restart(layers: int, cache_dir: str, width: int = 1) -> dict:
    """A cold meshinit init with jax's persistent compilation cache on, in ``cache_dir``.

    The first process in a fresh directory fills the cache; the next ones read it, as a
    restarted job would. Timed like :func:`cold`.
    """
    return cold("meshinit", layers, width, cache_dir=cache_dir)


def _device_memory(plan: Any, strategy: str) -> dict:
    """Per-device bytes of meshinit's executables against the device's parameter share.

    ``share`` is one device's share of all parameters. Each call's outputs and
    temporaries come from the compiled ``memory_analysis()`` (per device for SPMD
    programs). While a call runs, a device holds at most every parameter made so far
    (part of ``share``) plus that call's temporaries, so ``share + max temp`` bounds
    the peak.
    """
    import meshinit._run.strategies as strategies
    from meshinit import _paths

    _, impl = _paths.host_key(0)
    chosen = strategies.STRATEGIES[strategy]
    calls = []
    peak = allocated = 0
    for group in plan.groups:
        executables = chosen.executables(group, strategies.program_key_impl(group, impl))
        for exe, count in zip(executables, _call_counts(chosen, group), strict=True):
            stats = exe.memory_analysis()
            out, temp = stats.output_size_in_bytes, stats.temp_size_in_bytes
            calls.append((out, temp))
            for _ in range(count):  # replay the run order: made so far + this call
                peak = max(peak, allocated + out + temp)
                allocated += out
    share = sum(group.device_bytes for group in plan.groups)
    largest = max(calls, key=sum)
    return {
        "share": share,
        "peak": peak,
        "largest_call_output": largest[0],
        "largest_call_temp": largest[1],
        "max_temp": max(temp for _, temp in calls),
        "executables": len(calls),
    }


def _call_counts(strategy: Any, group: Any) -> list[int]:
    """How many times each of ``strategy.executables(group)`` is called, in run order."""
    import meshinit._run.strategies as strategies

    if isinstance(strategy, strategies.Rounds):
        return [len(group.batches[bucket[0]]) for bucket in strategy._buckets(group)]
    if isinstance(strategy, strategies.PerSignature):
        return [len(batch) for batch in group.batches]
    return [1]


def warm(layers: int, meshinit_recipes: list[str], repeats: int, width: int = 1) -> dict:
    """Re-init with a new key: meshinit's ``materialize`` of an already materialized plan
    vs a call of the compiled fused jit. ``meshinit_recipes``: (``meshinit``,
    ``meshinit:<strategy>``).

    The calls are interleaved (for each new key: every meshinit recipe, then the fused
    jit), so a change in the machine's load hits every recipe alike; each gets the best
    of ``repeats`` calls. The fused jit is timed twice: with jax's hash and XLA's
    defaults (the anchor of the goal), and built as meshinit builds its CPU programs
    (its straight-line threefry hash and its compiler options): the same kernels in one
    launch, which separates the cost of meshinit's extra launches from the rest.

    Also returns the per-device memory of each strategy's executables and of the fused
    jit's executable.
    """
    import jax

    import meshinit

    mesh = setup_cpu()
    model = Model.cpu(layers, width)
    clock = CompileClock()
    result: dict[str, Any] = {"nbytes": model.nbytes, "meshinit": {}, "repeats": repeats}
    plans = {}
    for recipe in meshinit_recipes:
        strategy = recipes.strategy_of(recipe)
        meshinit.clear_cache()
        start = time.perf_counter()
        plans[recipe] = plan = meshinit.plan(recipes.meshinit_specs(model, mesh))
        with recipes.options_for(recipe):
            _delete(meshinit.materialize(plan, 0))
        result["meshinit"][recipe] = {"strategy": strategy, "first": time.perf_counter() - start}
    for recipe in meshinit_recipes:  # clear_cache above dropped the earlier recipes'
        with recipes.options_for(recipe):
            _delete(meshinit.materialize(plans[recipe], 0))

    start = time.perf_counter()  # like meshinit's first call: trace, compile, run
    lowered = recipes.fused_jit(model, mesh).lower(jax.random.key(0))
    fused = lowered.compile()
    _delete(jax.block_until_ready(fused(jax.random.key(0))))
    fused_first = time.perf_counter() - start
    options = recipes.meshinit_options()
    alike = recipes.fused_jit(model, mesh, key_impl=recipes.meshinit_key_impl())
    fused_alike = alike.lower(jax.random.key(0)).compile(options or None)
    _delete(jax.block_until_ready(fused_alike(jax.random.key(0))))

    def meshinit_call(recipe: str) -> Any:
        def call(seed: int) -> Any:
            with recipes.options_for(recipe):
                return meshinit.materialize(plans[recipe], seed)

        return call

    keys = jax.block_until_ready([jax.random.key(seed) for seed in range(1, repeats + 1)])
    calls = {recipe: meshinit_call(recipe) for recipe in meshinit_recipes}
    calls["fused"] = lambda seed: fused(keys[seed - 1])
    calls["fused_alike"] = lambda seed: fused_alike(keys[seed - 1])
    times: dict[str, list[float]] = {name: [] for name in calls}
    clock.reset()
    for seed in range(1, repeats + 1):
        for name, call in calls.items():
            start = time.perf_counter()
            out = jax.block_until_ready(call(seed))
            times[name].append(time.perf_counter() - start)
            _delete(out)
    compiles = clock.count  # during the timed re-inits, of every recipe: must be 0
    for recipe in meshinit_recipes:
        entry = result["meshinit"][recipe]
        entry["warm"] = min(times[recipe])
        entry["warm_median"] = sorted(times[recipe])[len(times[recipe]) // 2]
        entry["compiles"] = compiles
        try:
            with recipes.options_for(recipe):  # its compiler options: the cached executables
                entry["memory"] = _device_memory(plans[recipe], entry["strategy"])
        except Exception as e:  # the strategy API is internal and may change
            entry["memory_error"] = f"{type(e).__name__}: {e}"

    stats = fused.memory_analysis()
    result["fused"] = {
        "first": fused_first,
        "warm": min(times["fused"]),
        "warm_median": sorted(times["fused"])[repeats // 2],
        "output": stats.output_size_in_bytes,
        "temp": stats.temp_size_in_bytes,
    }
    result["fused_alike"] = {
        "options": options,
        "straight_line_hash": True,
        "warm": min(times["fused_alike"]),
        "warm_median": sorted(times["fused_alike"])[repeats // 2],
    }
    return result


def warm_depth(depths: list[int], repeats: int, width: int = 1) -> dict:
    """The spec path's warm re-init (new key, nothing to compile) at each of ``depths``,
    in one process: the cost of generating each depth's bytes, for the depth goal's warm
    slope per layer. Each depth's plan is materialized once first (compiled), then the
    re-inits are interleaved across depths, one of each per new key, best of
    ``repeats``."""
    import jax

    import meshinit

    mesh = setup_cpu()
    plans = {n: meshinit.plan(recipes.meshinit_specs(Model.cpu(n, width), mesh)) for n in depths}
    for plan in plans.values():
        _delete(jax.block_until_ready(meshinit.materialize(plan, 0)))
    clock = CompileClock()
    times: dict[int, list[float]] = {n: [] for n in depths}
    for seed in range(1, repeats + 1):
        for n, plan in plans.items():
            start = time.perf_counter()
            out = jax.block_until_ready(meshinit.materialize(plan, seed))
            times[n].append(time.perf_counter() - start)
            _delete(out)
    return {
        "warm": {str(n): min(ts) for n, ts in times.items()},
        "nbytes": {str(n): plan.nbytes for n, plan in plans.items()},
        "compiles": clock.count,  # during the timed re-inits: must be 0
        "repeats": repeats,
    }


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
        "problems": recipes.placement_problems(model, mesh, out, recipe=recipe),
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
    out, timed = _timed(recipe, model, mesh)
    result = {
        **timed,
        "increase": _rss_peak() - baseline,
        "nbytes": model.nbytes,
        "params": model.num_params,
        "problems": recipes.placement_problems(model, mesh, out, recipe=recipe),
    }
    if recipes.is_spec_path(recipe):
        _delete(out)
        del out
        gc.collect()
        _, again = _timed(recipe, model, mesh, seed=1)
        result["floor"] = again["seconds"]
    return result


def planning(kind: str, specs: int = 10_000) -> dict:
    """Time of ``meshinit.plan``: the first call in the process, and the best of 3 more.

    ``kind="specs"``: the CPU reference model deep enough for ``specs`` specs, on the
    8-device mesh. ``kind="405b"``: Llama-3-405B's shapes in bf16 on
    ``AbstractMesh((16, 16, 8), ("data", "fsdp", "tensor"))``.
    """
    import meshinit

    if kind == "405b":
        from jax.sharding import AbstractMesh

        mesh = AbstractMesh((16, 16, 8), ("data", "fsdp", "tensor"))
        model = Model.llama3_405b()
    else:
        mesh = setup_cpu()
        model = Model.cpu(-(-(specs - 2) // 9))
    start = time.perf_counter()
    tree = recipes.meshinit_specs(model, mesh)
    build = time.perf_counter() - start
    times = []
    for _ in range(4):
        start = time.perf_counter()
        plan = meshinit.plan(tree)
        times.append(time.perf_counter() - start)
    return {
        "specs": len(plan.entries),
        "build_specs": build,
        "first": times[0],
        "best": min(times[1:]),
        "nbytes": plan.nbytes,
        "params": model.num_params,
    }


def planning_table(variables: int = 2_000, entries: int = 50) -> dict:
    """What a ``placements=`` table costs ``meshinit.nnx.plan``: ``variables`` Params
    without sharding metadata (250 layers of 8) against a table of ``entries``, every
    path tried against the entries that match nothing first (the worst order).

    ``table``: reading the table (parsing it, each path's first match, the check for
    entries that match nothing), first call and best of 3 more. ``plan_table`` and
    ``plan_metadata``: the whole ``nnx.plan`` (tracing the factory included) of the
    Module placed by the table, and of the same Module annotated in code, best of 3.
    """
    import warnings

    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import PartitionSpec as P

    import meshinit.nnx
    from meshinit._adapters import placements as _placements

    mesh = setup_cpu()
    names = [f"w{i}" for i in range(8)]
    layers = -(-variables // len(names))

    class Layer(nnx.Module):
        def __init__(self, annotated: bool):
            meta = {"out_sharding": ("fsdp", "tensor")} if annotated else {}
            for n in names:
                setattr(self, n, nnx.Param(jnp.zeros((8, 8)), **meta))

    class Stack(nnx.Module):
        def __init__(self, annotated: bool):
            self.layers = nnx.List([Layer(annotated) for _ in range(layers)])

    decoys = [(rf"layers\.\d+\.unused{i}", P("tensor")) for i in range(entries - len(names))]
    table = decoys + [(rf"layers\.\d+\.{n}", P("fsdp", "tensor")) for n in names]
    paths = [f"layers.{i}.{n}" for i in range(layers) for n in names]

    def read() -> float:
        start = time.perf_counter()
        parsed, _ = _placements.parse(table)
        for path in paths:
            parsed.match(path)
        parsed.idle(paths)
        return time.perf_counter() - start

    reads = [read() for _ in range(4)]
    plans: dict[str, list[float]] = {"plan_table": [], "plan_metadata": []}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", meshinit.UnusedPatternWarning)  # the decoys
        for _ in range(3):
            for key, kwargs in (
                ("plan_table", {"placements": table}),
                ("plan_metadata", {}),
            ):
                annotated = not kwargs
                start = time.perf_counter()
                plan = meshinit.nnx.plan(lambda a=annotated: Stack(a), mesh=mesh, **kwargs)
                plans[key].append(time.perf_counter() - start)
    return {
        "variables": len(plan.entries),
        "entries": len(table),
        "table_first": reads[0],
        "table": min(reads[1:]),
        **{k: min(v) for k, v in plans.items()},
    }


CASES = {
    "cold": cold,
    "restart": restart,
    "warm": warm,
    "warm_depth": warm_depth,
    "host_memory": host_memory,
    "planning": planning,
    "planning_table": planning_table,
    "real_size": real_size,
    "prefault": prefault,
}
