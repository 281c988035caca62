"""meshinit's own XLA options on CPU: only those the installed jaxlib knows, and quietly."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
import pytest
from jax.sharding import Mesh

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
