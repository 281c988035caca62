"""Compiling meshinit's programs: its own XLA options on CPU (only those the installed jaxlib
knows, and quietly), parallel compiles, and jax's persistent compilation cache (every
program written where one is configured, read back by a restarted process)."""

import json
import os
import subprocess
import sys
import textwrap
import threading

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
import pytest
from helpers import (
    assert_exact,
    break_compiles_on,
    flat_values,
    lecun,
    reference,
    run_python,
    same_bits,
    submesh,
    two_stage_plan,
)
from jax.sharding import Mesh

import meshinit
from meshinit._run import compile as _compile
from meshinit._run import options as _options

SHIPPED = tuple(_options.CPU_COMPILER_OPTIONS.items())


def cpu_mesh() -> Mesh:
    return Mesh(np.asarray(jax.devices("cpu")[:1]), ("x",))


def compile_error(options: dict) -> str | None:
    """What this jaxlib says when a tiny program compiles with ``options`` (None: it
    compiled)."""
    lowered = _compile.lower(cpu_mesh(), lambda: jnp.zeros((4,), jnp.float32), None, ())
    try:
        lowered.compile(options)
    except Exception as e:
        return str(e)
    return None


def test_every_default_option_is_one_this_jaxlib_knows():
    passed = _compile.compiler_options(cpu_mesh()) or {}
    assert passed == dict(_options.cpu_options_for(jaxlib.__version__, SHIPPED)), (
        "meshinit passes other CPU options than its choice in _options.py"
    )
    for name, value in passed.items():
        assert compile_error({name: value}) is None, (
            f"jaxlib {jaxlib.__version__} rejects meshinit's default option {name}={value!r}: "
            "add it to meshinit._run.options.CPU_OPTIONS_RETIRED_IN"
        )
    assert compile_error(passed) is None


def test_every_option_left_out_is_one_this_jaxlib_rejects():
    # The table of retired options must not drop an option this jaxlib still has.
    passed = _compile.compiler_options(cpu_mesh()) or {}
    for name, value in SHIPPED:
        if name in passed:
            continue
        said = compile_error({name: value})
        assert said is not None and f"No such compile option: '{name}'" in said, (
            f"jaxlib {jaxlib.__version__} knows {name}, but meshinit leaves it out: "
            "fix its version in meshinit._run.options.CPU_OPTIONS_RETIRED_IN"
        )


@pytest.mark.parametrize(
    ("version", "expected"),
    [
        ("0.10.2", {"xla_cpu_use_fusion_emitters": False}),
        ("0.11.0", {"xla_cpu_use_fusion_emitters": False}),
        ("0.11.1", {}),
        ("0.11.1.dev20260101", {}),
        ("0.11.2", {}),
        ("0.12.0.1", {}),
    ],
)
def test_options_are_decided_per_jaxlib_version(version, expected):
    # checked by compiling with each option on each of these jaxlibs
    assert dict(_options.cpu_options_for(version, SHIPPED)) == expected


def test_a_version_that_is_not_one_says_so():
    with pytest.raises(ValueError, match=r"not a release version: 'main'"):
        _options.release("main")


TINY_INIT = textwrap.dedent(
    """
    import logging
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    logging.basicConfig(level=logging.INFO)  # meshinit's and jax's INFO records too
    import meshinit
    from meshinit._run import compile as _compile

    mesh = jax.make_mesh((2, 4), ("a", "b"))
    lecun = jax.nn.initializers.lecun_normal()
    stage = jax.make_mesh((2, 2), ("a", "b"), devices=jax.devices()[4:])
    plan = meshinit.plan(
        {
            "w": meshinit.param((16, 32), lecun, axes=("a", "b"), mesh=mesh),
            "v": meshinit.param((8, 8), lecun, axes=("a", "b"), mesh=stage),
        }
    )
    meshinit.materialize(plan, 0)  # two groups: compiles in threads
    one = meshinit.plan({"u": meshinit.param((8, 4), lecun, axes=("a", None), mesh=mesh)})
    meshinit.materialize(one, 1)  # a lone compile
    print("UNKNOWN", sorted(_compile.unknown_options))
    """
)


@pytest.mark.slow
def test_a_default_init_says_nothing_about_compiler_options():
    # XLA's own logging at its defaults (no TF_CPP_* set), on the CPU backend
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TF_CPP_", "XLA_", "JAX_"))}
    env["JAX_PLATFORMS"] = "cpu"
    done = subprocess.run(
        [sys.executable, "-c", TINY_INIT],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "UNKNOWN []" in done.stdout, (
        f"a compile rejected one of meshinit's default options: {done.stdout}\n{done.stderr}"
    )
    names = [name for name, _ in SHIPPED]
    noise = [
        line
        for line in done.stderr.splitlines()
        if "compile option" in line or "XLA option" in line or any(n in line for n in names)
    ]
    assert noise == [], "\n".join(noise)


@pytest.fixture
def compile_threads(monkeypatch):
    """The names of the threads that ran each XLA compile of a ``Lowered``."""
    names = []
    real = jax.stages.Lowered.compile

    def compile(self, *args, **kwargs):
        names.append(threading.current_thread().name)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(jax.stages.Lowered, "compile", compile)
    monkeypatch.setattr(_compile, "compile_threads", lambda: 2)
    return names


def test_uncached_executables_compile_in_parallel_threads_once_each(
    compile_threads, count_compiles
):
    plan = two_stage_plan()  # 2 meshes: one rounds executable each
    meshinit.clear_cache()
    with count_compiles() as cold:
        out = meshinit.materialize(plan, 0)
    assert cold.count == len(compile_threads) == 2
    assert all(name.startswith("meshinit-compile") for name in compile_threads)
    assert not any(t.name.startswith("meshinit-compile") for t in threading.enumerate())
    by_path = assert_exact(plan, out)
    for e in plan.entries:
        want = reference(e.spec, jax.random.key(0), e.path, e.sharding)
        same_bits(by_path[e.path], want, e.path)
    with count_compiles() as warm:
        meshinit.materialize(plan, 1)
    assert warm.count == 0


def test_a_compile_failing_in_a_thread_names_its_group_and_leaves_nothing(
    compile_threads, monkeypatch, new_arrays
):
    plan = two_stage_plan()
    meshinit.clear_cache()
    real = break_compiles_on(monkeypatch, plan.groups[1].mesh)
    with new_arrays() as made, pytest.raises(Exception, match="xla_no_such_option_here") as e:
        meshinit.materialize(plan, 0)
    assert made == []
    notes = "\n".join(e.value.__notes__)
    assert "while compiling for the mesh" in notes and "s1.w" in notes and "s0.w" not in notes
    assert not any(t.name.startswith("meshinit-compile") for t in threading.enumerate())
    monkeypatch.setattr(_compile, "compiler_options", real)
    assert_exact(plan, meshinit.materialize(plan, 0))  # nothing broken was cached


def test_a_lowering_failure_waits_for_the_compiles_already_running(
    compile_threads, monkeypatch, new_arrays
):
    plan = two_stage_plan()
    meshinit.clear_cache()
    real = _compile.lower

    def lower(mesh, *args):
        if mesh is plan.groups[1].mesh:
            raise KeyboardInterrupt  # e.g. Ctrl-C while tracing the second group
        return real(mesh, *args)

    monkeypatch.setattr(_compile, "lower", lower)
    with new_arrays() as made, pytest.raises(KeyboardInterrupt):
        meshinit.materialize(plan, 0)
    assert made == []
    # the first group's compile had started; it finished before materialize returned
    assert len(compile_threads) == 1
    assert not any(t.name.startswith("meshinit-compile") for t in threading.enumerate())


def test_an_option_this_jaxlib_lacks_is_dropped_not_fatal(monkeypatch, caplog):
    # an option meshinit's table of retired options does not know this jaxlib lacks
    expected = _compile.default_cpu_options()
    shipped = {**_compile.CPU_COMPILER_OPTIONS, "xla_meshinit_no_such_option": 1}
    monkeypatch.setattr(_compile, "CPU_COMPILER_OPTIONS", shipped)
    mesh = submesh(range(4), (2, 2), ("x", "y"))
    lone = meshinit.plan({"w": meshinit.param((48, 16), lecun(), axes=("x", "y"), mesh=mesh)})
    for plan in (two_stage_plan(), lone):  # compiles in threads, then a lone compile
        meshinit.clear_cache()
        monkeypatch.setattr(_compile, "unknown_options", set())
        caplog.clear()
        with caplog.at_level("INFO", logger="meshinit"):
            assert_exact(plan, meshinit.materialize(plan, 0))
        assert _compile.unknown_options == {"xla_meshinit_no_such_option"}
        said = [r for r in caplog.records if "xla_meshinit_no_such_option" in r.getMessage()]
        assert len(said) == 1
    assert _compile.compiler_options(mesh) == (expected or None)  # None: XLA's defaults


def test_meshinit_compiler_options_change_no_value():
    # The options trade compile time for run time; values must not move (XLA's level 0
    # does move the bits of lecun_normal, which is why meshinit does not use it).
    init = jax.nn.initializers
    mesh = jax.make_mesh((2, 4), ("a", "b"))
    inits = [
        init.lecun_normal(),
        init.truncated_normal(0.02),
        init.uniform(),
        init.orthogonal(),
        init.he_normal(),
        init.variance_scaling(2.0, "fan_avg", "uniform"),
    ]
    plan = meshinit.plan(
        {
            f"p{i}": meshinit.param((64, 128), f, axes=("a", "b"), mesh=mesh)
            for i, f in enumerate(inits)
        }
    )
    shipped = _compile.default_cpu_options()  # those this jaxlib knows
    if not shipped:
        pytest.skip("this jaxlib compiles with XLA's defaults: nothing to compare them with")
    ours = flat_values(meshinit.materialize(plan, 3))
    with meshinit.options(compiler_options={}):
        xla_defaults = flat_values(meshinit.materialize(plan, 3))
    for path, value in ours.items():
        assert np.array_equal(value, xla_defaults[path]), path


def test_options_travel_as_data_into_the_parallel_compiles(monkeypatch):
    plan = two_stage_plan()  # two groups: their compiles run in threads
    seen = []
    real = _compile.compiler_options

    def spy(mesh):
        seen.append((threading.current_thread().name, real(mesh)))
        return real(mesh)

    monkeypatch.setattr(_compile, "compiler_options", spy)
    meshinit.clear_cache()
    chosen = {"xla_backend_optimization_level": 2}  # an option every supported jaxlib has
    with meshinit.options(compiler_options=chosen):
        assert_exact(plan, meshinit.materialize(plan, 0))
    threads = [name for name, _ in seen if name.startswith("meshinit-compile")]
    assert threads and all(options == chosen for _, options in seen)
    seen.clear()
    meshinit.materialize(plan, 0)  # other options: other executables, compiled again
    defaults = _compile.default_cpu_options() or None  # None: XLA's own
    assert seen and all(options == defaults for _, options in seen)


def test_an_option_the_caller_names_is_never_dropped():
    mesh = submesh(range(4), (2, 2), ("x", "y"))
    plan = meshinit.plan({"w": meshinit.param((48, 16), lecun(), axes=("x", "y"), mesh=mesh)})
    meshinit.clear_cache()
    with (
        meshinit.options(compiler_options={"xla_meshinit_no_such_option": 1}),
        pytest.raises(Exception, match="xla_meshinit_no_such_option"),
    ):
        meshinit.materialize(plan, 0)
    assert "xla_meshinit_no_such_option" not in _compile.unknown_options


# ------------------------------------------------- jax's persistent compilation cache

# One process of the restart tests: argv[1] the cache directory ("" for none; "off:DIR"
# for DIR with jax_enable_compilation_cache=False), then the parts to run, in order.
# It prints one RESULT line: per part, XLA compile requests, persistent-cache hits and
# writes, the new cache entries and a digest of the values it made.
RESTART = textwrap.dedent(
    """
    import collections, hashlib, json, os, sys
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    where = sys.argv[1]
    if where.startswith("off:"):
        jax.config.update("jax_enable_compilation_cache", False)
        where = where[4:]
    if where:
        jax.config.update("jax_compilation_cache_dir", where)
    import jax.numpy as jnp
    import numpy as np
    import meshinit

    if {"nnx", "linen"} & set(sys.argv[2:]):  # flax only where a part uses it
        from flax import linen as nn
        from flax import nnx

    events = collections.Counter()
    jax.monitoring.register_event_listener(lambda e, **k: events.update([e]))
    jax.monitoring.register_event_duration_secs_listener(lambda e, d, **k: events.update([e]))
    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"))
    stage = jax.make_mesh((2, 2), ("fsdp", "tensor"), devices=jax.devices()[4:])
    lecun = jax.nn.initializers.lecun_normal()
    key = jax.random.key(0)  # the user's own eager compiles, before any part counts

    def spec_path():  # two mesh groups: their programs compile in meshinit's threads
        def layer(m):
            return {
                "w": meshinit.param((16, 32), lecun, axes=("fsdp", "tensor"), mesh=m),
                "b": meshinit.param((32,), jax.nn.initializers.zeros, axes=("tensor",), mesh=m),
            }
        out = meshinit.materialize(meshinit.plan({"a": layer(mesh), "s": layer(stage)}), 0)
        return {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(out)}

    def nnx_init():
        class Block(nnx.Module):
            def __init__(self, rngs):
                part = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("fsdp", "tensor"))
                self.up = nnx.Linear(16, 32, kernel_init=part, rngs=rngs)
                self.norm = nnx.LayerNorm(32, rngs=rngs)

        class Stack(nnx.Module):
            def __init__(self, rngs):
                self.layers = nnx.List([Block(rngs) for _ in range(2)])

        with jax.set_mesh(mesh):
            model = meshinit.nnx.init(lambda: Stack(nnx.Rngs(0)))
        return {str(p): v.get_value() for p, v in nnx.to_flat_state(nnx.state(model))}

    def linen_init():
        class Mlp(nn.Module):
            @nn.compact
            def __call__(self, x):
                part = nn.with_partitioning(nn.initializers.lecun_normal(), ("fsdp", "tensor"))
                return nn.Dense(16, kernel_init=part)(nn.Dense(32, kernel_init=part)(x))

        x = np.ones((2, 16), np.float32)
        out = meshinit.linen.init(Mlp(), key, x, mesh=mesh, default="replicated")
        return {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(out)}

    def other_options():  # the spec path again, with other XLA options
        with meshinit.options(compiler_options={"xla_backend_optimization_level": 2}):
            return spec_path()

    def fp8_load():  # a float8 checkpoint with block scales, dequantized on the devices
        import ml_dtypes, tempfile
        from safetensors.numpy import save_file

        folder = tempfile.mkdtemp()
        rng = np.random.default_rng(0)
        w = (rng.standard_normal((256, 384)) * 40).astype(ml_dtypes.float8_e4m3fn)
        s = rng.uniform(1e-4, 1e-2, (2, 3)).astype(np.float32)
        save_file({"w": w, "w_scale_inv": s}, os.path.join(folder, "model.safetensors"))
        config = {"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e4m3"}
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump({"quantization_config": config}, f)
        zeros, axes = jax.nn.initializers.zeros, ("fsdp", "tensor")
        w = meshinit.param((256, 384), zeros, dtype=jnp.bfloat16, axes=axes, mesh=mesh)
        return meshinit.safetensors.load(meshinit.plan({"w": w}), folder)

    def export():  # a sharded array written as safetensors
        import tempfile
        from jax.sharding import NamedSharding, PartitionSpec

        x = np.arange(512, dtype=np.float32).reshape(16, 32)
        x = jax.device_put(x, NamedSharding(mesh, PartitionSpec("fsdp", "tensor")))
        out = os.path.join(tempfile.mkdtemp(), "out")
        meshinit.safetensors.save({"x": x}, out, names={"x": "x"})
        from safetensors.numpy import load_file
        return load_file(os.path.join(out, "model.safetensors"))

    def user_jit():  # the user's own jit of a program compiled in far under 1 s
        return {"y": jax.jit(lambda x: x * 3 + 1)(np.ones(4, np.float32))}

    parts = dict(spec=spec_path, nnx=nnx_init, linen=linen_init, options=other_options,
                 user=user_jit, fp8=fp8_load, export=export)
    entries = lambda: set(os.listdir(where)) if where and os.path.isdir(where) else set()
    result = {}
    for name in sys.argv[2:]:
        before, had = dict(events), entries()
        values = parts[name]()
        digest = hashlib.sha256()
        for path in sorted(values):
            a = np.asarray(values[path])
            digest.update(f"{path} {a.dtype} {a.shape}".encode() + a.tobytes())
        new = lambda e: events[e] - before.get(e, 0)
        result[name] = {
            "compiles": new("/jax/core/compile/backend_compile_duration"),
            "hits": new("/jax/compilation_cache/cache_hits"),
            "writes": new("/jax/compilation_cache/cache_misses"),
            "entries": len(entries() - had),
            "digest": digest.hexdigest(),
        }
    print("RESULT", json.dumps(result))
    """
)


def restart(cache: str, *parts: str) -> dict:
    """:data:`RESTART` in a fresh process, in an environment that configures no cache."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_FLAGS"))}
    env["JAX_PLATFORMS"] = "cpu"
    done = run_python("-c", RESTART, cache, *parts, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, done.stdout + done.stderr[-4000:]
    return json.loads(line[-1][len("RESULT ") :])


INITS = ("spec", "nnx", "linen")
CHECKPOINTS = ("fp8", "export")  # a load's dequantization, an export's programs


@pytest.fixture(scope="module")
def restarted(tmp_path_factory):
    """Two processes on one cache directory: the first fills it, the second restarts."""
    cache = str(tmp_path_factory.mktemp("jax-cache"))
    first = restart(cache, *INITS, *CHECKPOINTS, "user")
    second = restart(cache, *INITS, *CHECKPOINTS, "options")
    return first, second


@pytest.mark.parametrize("part", INITS + CHECKPOINTS)
def test_a_restarted_process_reads_every_program_back_and_makes_the_same_bits(restarted, part):
    first, second = restarted
    made, again = first[part], second[part]
    assert made["compiles"] > 0 and made["hits"] == 0
    assert made["writes"] == made["compiles"] == made["entries"], (
        f"{part}: the first process compiled {made['compiles']} programs (each in far under "
        f"jax's 1 s threshold) but wrote {made['writes']} to the persistent cache"
    )
    assert again["hits"] == again["compiles"] == made["compiles"], (
        f"{part}: the restart compiled {again['compiles'] - again['hits']} of "
        f"{again['compiles']} programs instead of reading them from the cache"
    )
    assert again["writes"] == 0 and again["entries"] == 0
    assert again["digest"] == made["digest"], f"{part}: the restart made other values"


def test_the_user_s_own_jit_keeps_jax_s_threshold(restarted):
    first, _ = restarted
    assert first["user"]["compiles"] >= 1
    assert first["user"]["writes"] == first["user"]["entries"] == 0, (
        "a sub-second program of the user's own was written to the persistent cache: "
        "meshinit's lower thresholds leaked out of its own compiles"
    )


def test_other_compiler_options_miss_the_cache(restarted):
    first, second = restarted
    other = second["options"]
    assert other["hits"] == 0, "a program compiled with other XLA options was read back"
    assert other["compiles"] == other["writes"] == first["spec"]["compiles"]


@pytest.mark.parametrize("cache", ["", "off"])
def test_without_a_configured_cache_nothing_is_written(tmp_path, cache):
    # The spec path alone: every compile of meshinit's (the constructor engine's too)
    # decides what jax's cache keeps in one place, _compile.compile_lowered, and the
    # restart tests above see the nnx and linen programs written through it where a
    # cache is configured. Without nnx the process imports no flax.
    where = "" if cache == "" else f"off:{tmp_path}"
    spec = restart(where, "spec")["spec"]
    assert spec["compiles"] > 0
    assert spec["hits"] == spec["writes"] == spec["entries"] == 0
    assert list(tmp_path.iterdir()) == [], "jax_enable_compilation_cache=False was ignored"


@pytest.mark.parametrize(
    "flag, other",
    [
        ("jax_threefry_partitionable", None),  # None: the flag's other boolean
        ("jax_default_prng_impl", "rbg"),
        ("jax_enable_x64", None),
        ("jax_default_matmul_precision", "highest"),
    ],
)
def test_every_flag_that_changes_values_changes_the_program_jax_s_cache_key_hashes(flag, other):
    # jax's persistent cache keys a program on its StableHLO (less debug info), so a
    # flag of value_config() that left the program as it is would let a restart read
    # back bits made under the other setting.
    mesh = cpu_mesh()

    def program(key, x):
        return jax.random.normal(key, (8, 8)) + x @ x * 0.5

    def text():  # the key as jax.random.key makes it under the current settings
        args = (jax.random.key_data(jax.random.key(0)), np.ones((8, 8), np.float32))
        lowered = _compile.lower(
            mesh, lambda k, x: program(jax.random.wrap_key_data(k), x), None, args
        )
        return lowered.as_text()

    before, value = text(), getattr(jax.config, flag)
    try:
        jax.config.update(flag, (not value) if other is None else other)
        after = text()
    finally:
        jax.config.update(flag, value)
    assert after != before, f"{flag} changes values but not the compiled program"
