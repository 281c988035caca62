"""meshinit's own XLA options on CPU: only those the installed jaxlib knows, and quietly."""

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
