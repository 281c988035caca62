"""The frameworks are optional: ``import meshinit`` imports none of flax, equinox and
optax and starts no backend, each adapter imports its framework only when first used,
and an adapter whose framework is missing names the extra to install.

Each check needs a fresh interpreter. They share two (one with the frameworks
installed, one with them hidden) rather than one each: a fresh interpreter that
imports jax and meshinit costs seconds, and these checks were eight of them."""

import textwrap

from helpers import CPU_ONLY, run_python

PRESENT = textwrap.dedent(
    """
    import sys
    import meshinit, jax

    def loaded(*names):
        return sorted(m for m in sys.modules if m.split(".")[0] in names)

    FRAMEWORKS = ("flax", "equinox", "optax")
    assert not loaded(*FRAMEWORKS), f"import meshinit imported {loaded(*FRAMEWORKS)}"
    # Planning on an AbstractMesh, and an empty plan, start no backend and import no
    # framework: devices can still be set after them (multi-host users call
    # jax.distributed.initialize at this point).
    m = jax.sharding.AbstractMesh((16, 16), ("fsdp", "tensor"))
    p = meshinit.plan({"w": meshinit.param((4096, 4096), jax.nn.initializers.lecun_normal(),
                                           axes=("fsdp", "tensor"), mesh=m)})
    assert p.entries[0].device_bytes == 4096 * 4096 * 4 // 256
    assert meshinit.plan({"lr": 3e-4}).entries == ()
    assert not loaded(*FRAMEWORKS), f"planning imported {loaded(*FRAMEWORKS)}"
    jax.config.update("jax_num_cpu_devices", 3)
    assert len(jax.devices()) == 3, jax.devices()
    # each adapter imports its own framework when first used
    meshinit.optax
    assert "optax" in sys.modules, "meshinit.optax did not import optax"
    meshinit.linen
    assert "flax.linen" in sys.modules, "meshinit.linen did not import flax.linen"
    print("PRESENT OK")
    """
)

MISSING = textwrap.dedent(
    """
    import sys
    for name in ("flax", "equinox", "optax"):
        sys.modules[name] = None  # as if not installed
    import meshinit

    for adapter in ("nnx", "eqx", "optax"):
        try:
            getattr(meshinit, adapter)
        except ImportError as e:
            assert isinstance(e.__cause__, ImportError), f"{adapter}: the cause is not chained"
            print("ImportError:", e)
        else:
            raise SystemExit(f"meshinit.{adapter} imported without its framework")
    """
)


def test_importing_meshinit_imports_no_framework_and_each_adapter_imports_its_own():
    r = run_python("-c", PRESENT, timeout=120, env=CPU_ONLY)
    assert r.returncode == 0 and "PRESENT OK" in r.stdout, r.stdout + r.stderr


def test_an_adapter_whose_framework_is_missing_names_the_extra():
    r = run_python("-c", MISSING, timeout=120, env=CPU_ONLY)
    assert r.returncode == 0, r.stdout + r.stderr
    for adapter, framework in (("nnx", "flax"), ("eqx", "equinox"), ("optax", "optax")):
        said = (
            f"ImportError: meshinit.{adapter} needs {framework}: pip install 'meshinit[{adapter}]'"
        )
        assert said in r.stdout, r.stdout + r.stderr
