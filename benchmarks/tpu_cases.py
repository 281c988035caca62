"""The measured processes of ``tpu.py``, each run in a fresh process (``tpu.py --child``)
and returning a JSON-serializable dict: the device and versions (:func:`probe`), one
recipe's cold init (:func:`cold`; with jax's persistent compilation cache for the
restart), filling that cache (:func:`fill`), the bits of meshinit against the jitted
recipes and eager (:func:`bits`), and the load of a safetensors checkpoint into device
memory (:func:`load`, the files from :func:`write_checkpoint`).

Every process first sets up its devices (:func:`setup`: the persistent cache off unless
a cache folder is given, the mesh, the backend's lazy start-up done), and only then
starts a clock. Only meshinit's public API is used.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from pathlib import Path
from typing import Any

import checks
import recipes
import tpu_bits
from harness import CompileClock, best_of, delete_arrays, warm_up_backend
from models import Model

# The rows of the table, by recipe name (recipes.py), in the order they run.
ROWS = (
    "meshinit",
    "meshinit.nnx",
    "meshinit.linen",
    "jax.jit",
    "nnx.jit",
    "linen.jit",
    "eager-nnx",
)
# The comparisons of values: (framework, meshinit's recipe, the others).
BITS = (
    ("nnx", "meshinit.nnx", ("nnx.jit", "eager-nnx")),
    ("linen", "meshinit.linen", ("linen.jit",)),
)
DTYPES = ("float32", "bfloat16")
TENSOR_COLS = 16384  # the load's tensors: (rows, 16384) bf16, at most 128 MiB each


def model_for(cpu_check: bool, layers: int, dtype: str = "bfloat16") -> Model:
    """Llama-3-8B's shapes at ``layers`` layers; with ``cpu_check`` the CPU reference stack's."""
    model = Model.cpu(layers) if cpu_check else Model.llama3_8b()
    return dataclasses.replace(model, layers=layers, dtype=dtype)


def setup(
    cpu_check: bool,
    mesh_shape: list[int],
    cache_dir: str | None = None,
    threshold_zero: bool = False,
) -> Any:
    """The devices and the (fsdp, tensor) mesh, with the backend started; returns the mesh.

    With ``cache_dir``, jax's persistent compilation cache is on in that folder, with
    jax's own threshold of compile time unless ``threshold_zero``; otherwise it is off.
    """
    import jax

    if cpu_check:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", 8)
    if cache_dir is None:
        jax.config.update("jax_enable_compilation_cache", False)
    else:
        jax.config.update("jax_enable_compilation_cache", True)
        jax.config.update("jax_compilation_cache_dir", cache_dir)
        if threshold_zero:
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    devices = jax.devices()[: math.prod(mesh_shape)]
    mesh = jax.make_mesh(tuple(mesh_shape), ("fsdp", "tensor"), devices=devices)
    warm_up_backend()
    return mesh


def probe(cpu_check: bool) -> dict:
    """The platform, the devices and the versions this machine runs."""
    import platform
    from importlib import metadata

    import jax

    if cpu_check:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", 8)
    devices = jax.devices()
    versions = {"python": platform.python_version(), "jax": jax.__version__}
    for package in ("jaxlib", "flax", "safetensors", "orbax-checkpoint"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return {
        "platform": devices[0].platform,
        "device_kind": devices[0].device_kind,
        "devices": len(devices),
        "versions": versions,
    }


def _timed(clock: CompileClock, start: float, out: Any) -> dict:
    """Seconds since ``start`` until ``out`` is ready, and what ``clock`` saw since its reset."""
    import jax

    jax.block_until_ready(out)
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "compile_s": sum(clock.programs),
        "compiles": clock.compiles,
        "slowest_s": clock.slowest,
        "programs": sorted(clock.programs, reverse=True),
        "cache_hits": clock.hits,
        "cache_read_s": clock.seconds - sum(clock.programs),
    }


def cold(
    recipe: str,
    layers: int,
    cpu_check: bool,
    mesh: list[int],
    repeats: int = 0,
    cache_dir: str | None = None,
    threshold_zero: bool = False,
) -> dict:
    """One cold init by ``recipe``, timed from after the backend's start until every
    array is ready (meshinit: specs or Module, plan, compile, run); its compiles, the
    slowest, and its placement problems. For the spec path and the fused jit, then the
    best of ``repeats`` warm re-inits with new keys (the cold arrays deleted first)."""
    import jax

    mesh_ = setup(cpu_check, mesh, cache_dir, threshold_zero)
    model = model_for(cpu_check, layers)
    recipes.preload(recipe)
    iter_keys = iter(jax.block_until_ready([jax.random.key(s) for s in range(1, repeats + 1)]))
    seeds = iter(range(1, repeats + 1))
    clock = CompileClock()
    start = time.perf_counter()
    if recipe == "meshinit":
        import meshinit

        plan = meshinit.plan(recipes.meshinit_specs(model, mesh_))
        out = meshinit.materialize(plan, 0)
        again = lambda: meshinit.materialize(plan, next(seeds))  # noqa: E731
    elif recipe == "jax.jit":
        fused = recipes.fused_jit(model, mesh_)
        out = fused(jax.random.key(0))
        again = lambda: fused(next(iter_keys))  # noqa: E731
    else:
        out = recipes.run(recipe, model, mesh_)
        again = None
    result = _timed(clock, start, out)
    result["problems"] = checks.placement_problems(model, mesh_, out, recipe=recipe)
    result["nbytes"] = model.nbytes
    delete_arrays(out)
    if again is not None and repeats:
        clock.reset()
        result["warm_s"] = best_of(again, repeats)
        result["warm_compiles"] = clock.compiles
    return result


def fill(
    names: list[str],
    layers: int,
    cpu_check: bool,
    mesh: list[int],
    cache_dir: str,
    threshold_zero: bool = False,
) -> dict:
    """Fills jax's persistent cache in ``cache_dir``: each recipe of ``names`` inits, one
    after the other, every in-memory cache emptied in between, so each compiles all it
    runs."""
    import jax

    import meshinit

    mesh_ = setup(cpu_check, mesh, cache_dir, threshold_zero)
    model = model_for(cpu_check, layers)
    found = {}
    clock = CompileClock()
    for recipe in names:
        recipes.preload(recipe)
        meshinit.clear_cache()
        jax.clear_caches()
        clock.reset()
        start = time.perf_counter()
        out = recipes.run(recipe, model, mesh_)
        found[recipe] = _timed(clock, start, out)
        delete_arrays(out)
    return found


@functools.cache
def _comparer() -> Any:
    """One jitted comparison of two arrays (compiled once per shape and dtype): how many
    elements differ, and the largest distance in ulp."""
    import jax
    import jax.numpy as jnp

    def ordered(x: Any) -> Any:  # the float's bits as an int that counts ulps from 0
        wide = x.dtype.itemsize == 4
        bits = jax.lax.bitcast_convert_type(x, jnp.int32 if wide else jnp.int16)
        bits = bits.astype(jnp.int32)
        magnitude = bits & (0x7FFFFFFF if wide else 0x7FFF)
        return jnp.where(bits < 0, -magnitude, magnitude)

    def compare(x: Any, y: Any) -> Any:
        ox, oy = (jax.lax.bitcast_convert_type(ordered(v), jnp.uint32) for v in (x, y))
        distance = jnp.where(ordered(x) >= ordered(y), ox - oy, oy - ox)  # exact in uint32
        return jnp.sum(x != y, dtype=jnp.int32), jnp.max(distance)

    return jax.jit(compare)


def differences(a: Any, b: Any) -> dict:
    """Elements of two trees of arrays, how many differ, and the largest distance in
    units in the last place (ulp), computed on the devices."""
    import jax

    elements = differ = max_ulp = 0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        count, ulp = _comparer()(x, y)
        elements += x.size
        differ += int(count)
        max_ulp = max(max_ulp, int(ulp))
    return {"elements": elements, "differ": differ, "max_ulp": max_ulp}


def bits(
    layers: int,
    dtypes: list[str],
    cpu_check: bool,
    mesh: list[int],
    case_recipes: list[str] = list(tpu_bits.RECIPES),  # noqa: B006 - never mutated
) -> dict:
    """meshinit's values against the jitted recipe's and eager's (:data:`BITS`), in each
    of ``dtypes``: meshinit's arrays are kept while each other recipe runs, and
    every result is deleted once compared; then issue 57's cases for ``case_recipes``
    (``tpu_bits.cases``), if any."""
    mesh_ = setup(cpu_check, mesh)
    found: dict[str, Any] = {}
    for dtype in dtypes:
        model = model_for(cpu_check, layers, dtype)
        for _, ours, others in BITS:
            recipes.preload(ours)
            reference = recipes.run(ours, model, mesh_)
            for other in others:
                recipes.preload(other)
                theirs = recipes.run(other, model, mesh_)
                found[f"{dtype} {ours} vs {other}"] = differences(reference, theirs)
                delete_arrays(theirs)
            delete_arrays(reference)
    if case_recipes:
        found["cases"] = tpu_bits.cases(cpu_check, mesh_, differences, case_recipes)
    return {"layers": layers, "nbytes": model_for(cpu_check, layers, "float32").nbytes, **found}


def load_layout(mib: int) -> list[tuple[str, tuple[int, int]]]:
    """The checkpoint's tensors: at least 4, each (rows, :data:`TENSOR_COLS`) bf16 and at
    most 128 MiB, ``mib`` MiB in all."""
    count = max(4, -(-mib // 128))
    rows = mib * (1 << 20) // (count * TENSOR_COLS * 2)
    return [(f"t{i}", (rows, TENSOR_COLS)) for i in range(count)]


def write_checkpoint(directory: Path, mib: int) -> int:
    """Writes :func:`load_layout`'s tensors (finite bf16 values, 4 a file) and reads every
    file once, so the page cache is warm; returns their bytes."""
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    layout = load_layout(mib)
    for f in range(0, len(layout), 4):
        chunk = {}
        for name, shape in layout[f : f + 4]:
            raw = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16) & 0xBFFF  # |x| < 2
            chunk[name] = raw.view(ml_dtypes.bfloat16)
        save_file(chunk, str(directory / f"model-{f // 4:05d}.safetensors"))
    for path in sorted(directory.glob("*.safetensors")):
        with open(path, "rb") as stream:
            while stream.read(1 << 24):
                pass
    return sum(2 * rows * cols for _, (rows, cols) in layout)


def load(directory: str, mib: int, cpu_check: bool, mesh: list[int], repeats: int) -> dict:
    """The checkpoint into device memory on ``P('fsdp', 'tensor')``: meshinit's load,
    ``jax.device_put`` of each memory-mapped tensor, ``device_put`` of the same tensors
    already in memory (``in_ram``: the host-to-device floor), ``safe_open`` (numpy) then
    ``jax.device_put``, and orbax v1's safetensors layout if orbax is importable. The
    loaders take turns for ``repeats`` + 1 rounds; the best after the first round, and
    the first. meshinit's arrays are compared with ``device_put``'s, bit for bit."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from safetensors import safe_open
    from safetensors_load import mapped

    import meshinit
    from meshinit import safetensors as st

    mesh_ = setup(cpu_check, mesh)
    sharding = NamedSharding(mesh_, P("fsdp", "tensor"))
    layout = dict(load_layout(mib))
    bf16 = jnp.bfloat16
    zeros = jax.nn.initializers.zeros
    specs = {
        name: meshinit.param(shape, zeros, axes=("fsdp", "tensor"), mesh=mesh_, dtype=bf16)
        for name, shape in layout.items()
    }
    plan = meshinit.plan(specs)

    def opened() -> dict:
        out = {}
        for path in sorted(Path(directory).glob("*.safetensors")):
            with safe_open(str(path), framework="numpy") as f:
                out.update({k: jax.device_put(f.get_tensor(k), sharding) for k in f.keys()})
        return out

    # the floor: the same bytes already in this process's memory (read once, here,
    # untimed), each tensor copied to the devices by device_put: no file, no page cache
    in_ram = {k: np.array(v) for k, v in mapped(directory).items()}
    loaders = {
        "meshinit": lambda: st.load(plan, directory),
        "device_put": lambda: {
            k: jax.device_put(v, sharding) for k, v in mapped(directory).items()
        },
        "in_ram": lambda: {k: jax.device_put(v, sharding) for k, v in in_ram.items()},
        "safe_open": opened,
    }
    found: dict[str, Any] = {"nbytes": sum(2 * math.prod(s) for s in layout.values())}
    try:
        import orbax.checkpoint.experimental.v1 as ocp

        abstract = {k: jax.ShapeDtypeStruct(s, bf16, sharding=sharding) for k, s in layout.items()}

        def orbax() -> Any:
            with ocp.Context(checkpoint_layout="safetensors"):
                return ocp.load(directory, abstract)

        loaders["orbax"] = orbax
    except Exception as e:  # an optional anchor: absent, or not this version's API
        found["orbax"] = {"error": f"not importable: {type(e).__name__}: {e}"[:300]}
    times: dict[str, list[float]] = {name: [] for name in loaders}
    for round_ in range(repeats + 1):
        for name, loader in loaders.items():
            if name in found:  # failed before
                continue
            try:
                start = time.perf_counter()
                out = jax.block_until_ready(loader())
                times[name].append(time.perf_counter() - start)
            except Exception as e:  # an anchor that fails is recorded, not fatal
                found[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
                continue
            if name == "meshinit" and round_ == 0:
                exact = loaders["device_put"]()
                found["meshinit_vs_device_put"] = differences(out, exact)
                misplaced = [
                    k for k, v in out.items() if not v.sharding.is_equivalent_to(sharding, 2)
                ]
                found["problems"] = [f"{k}: placed by {out[k].sharding}" for k in misplaced]
                delete_arrays(exact)
            delete_arrays(out)
    for name, seconds in times.items():
        if name not in found and seconds:
            found[name] = {"first_s": seconds[0], "best_s": min(seconds[1:] or seconds)}
    return found


CHILDREN = {"probe": probe, "cold": cold, "fill": fill, "bits": bits, "load": load}
