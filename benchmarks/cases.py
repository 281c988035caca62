"""The measurements of time, each meant to run in a fresh process (``suite.py`` spawns
them): cold and restarted init, warm re-init with per-device memory, warm re-init at
each depth, planning; and :data:`CASES`, every case by name, the memory cases of
``cases_memory.py`` included.

Every case sets up 8 simulated CPU devices with the persistent compilation cache off,
creates the (fsdp=2, tensor=4) mesh, and only then starts its clock
(``harness.py``). Each returns a JSON-serializable dict.
"""

from __future__ import annotations

import time
from typing import Any

import checks
import recipes
from cases_memory import host_memory, prefault, real_size
from harness import CompileClock, delete_arrays, setup_cpu, timed_init
from models import Model


def cold(
    recipe: str,
    layers: int,
    width: int = 1,
    check_values: bool = False,
    cache_dir: str | None = None,
) -> dict:
    """One cold init: from after imports and mesh creation until every array is ready.

    The placement check is ``recipe``'s (:func:`checks.expected`); the value contract
    (``check_values``) is the spec path's, so it is checked for those recipes only.

    With ``cache_dir``, jax's persistent compilation cache is on, in that directory,
    with jax's thresholds at their defaults, as a user configures it: meshinit writes
    its own programs whatever their compile time.
    """
    import jax

    mesh = setup_cpu()
    if cache_dir is not None:
        jax.config.update("jax_compilation_cache_dir", cache_dir)
        jax.config.update("jax_enable_compilation_cache", True)
    model = Model.cpu(layers, width)
    recipes.preload(recipe)
    strategy = recipes.strategy_of(recipe) if recipes.is_spec_path(recipe) else None
    out, timed = timed_init(recipe, model, mesh)
    result = {
        **timed,
        "strategy": strategy,
        "nbytes": model.nbytes,
        "problems": checks.placement_problems(model, mesh, out, recipe=recipe),
    }
    if check_values and strategy is not None:
        result["problems"] += checks.value_problems(out, 0, model)
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
            delete_arrays(meshinit.materialize(plan, 0))
        result["meshinit"][recipe] = {"strategy": strategy, "first": time.perf_counter() - start}
    for recipe in meshinit_recipes:  # clear_cache above dropped the earlier recipes'
        with recipes.options_for(recipe):
            delete_arrays(meshinit.materialize(plans[recipe], 0))

    start = time.perf_counter()  # like meshinit's first call: trace, compile, run
    lowered = recipes.fused_jit(model, mesh).lower(jax.random.key(0))
    fused = lowered.compile()
    delete_arrays(jax.block_until_ready(fused(jax.random.key(0))))
    fused_first = time.perf_counter() - start
    options = recipes.meshinit_options()
    alike = recipes.fused_jit(model, mesh, key_impl=recipes.meshinit_key_impl())
    fused_alike = alike.lower(jax.random.key(0)).compile(options or None)
    delete_arrays(jax.block_until_ready(fused_alike(jax.random.key(0))))

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
            delete_arrays(out)
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
        delete_arrays(jax.block_until_ready(meshinit.materialize(plan, 0)))
    clock = CompileClock()
    times: dict[int, list[float]] = {n: [] for n in depths}
    for seed in range(1, repeats + 1):
        for n, plan in plans.items():
            start = time.perf_counter()
            out = jax.block_until_ready(meshinit.materialize(plan, seed))
            times[n].append(time.perf_counter() - start)
            delete_arrays(out)
    return {
        "warm": {str(n): min(ts) for n, ts in times.items()},
        "nbytes": {str(n): plan.nbytes for n, plan in plans.items()},
        "compiles": clock.count,  # during the timed re-inits: must be 0
        "repeats": repeats,
    }


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
    from meshinit._adapters.placement import read as _placements

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
