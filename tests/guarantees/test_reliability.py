"""Reliability: no silently wrong value, no abort, no global patching (docs/reliability.md).

Each test names the guarantee it checks; each failed before the change that made it hold.
"""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import meshinit
from meshinit._spec import fingerprints as _signature

fp = _signature.initializer_fingerprint


@pytest.fixture
def mesh():
    return Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))


def first(tree, path="w"):
    return float(np.asarray(tree[path]).flat[0])


def plan_source(tmp_path, capsys, source, *args):
    """``meshinit plan`` of ``specs`` in a module of ``source``: (status, stdout, stderr)."""
    from meshinit._cli.cli import main

    module = tmp_path / "model_under_test.py"
    module.write_text(source)
    rc = main(["plan", f"{module}:specs", *args])
    out, err = capsys.readouterr()
    return rc, out, err


# ---------------------------------------------------------------- sound fingerprints


def test_a_closure_over_a_dict_mutated_between_calls_is_not_served_stale_values(mesh):
    cfg = {"scale": 1.0}

    def make():
        def init(key, shape, dtype):
            return jnp.full(shape, cfg["scale"], dtype)

        return init

    assert first(meshinit.init({"w": meshinit.param((8, 4), make(), mesh=mesh)}, 0)) == 1.0
    cfg["scale"] = 2.0
    assert first(meshinit.init({"w": meshinit.param((8, 4), make(), mesh=mesh)}, 0)) == 2.0


def _module(name, scale):
    source = (
        "import jax.numpy as jnp\n"
        f"SCALE = {scale}\n"
        "def init(key, shape, dtype):\n"
        "    return jnp.full(shape, SCALE, dtype)\n"
    )
    module = types.ModuleType(name)
    exec(compile(source, "same_source.py", "exec"), module.__dict__)
    return module


def test_the_same_source_in_two_modules_with_different_globals_is_not_deduplicated(mesh):
    a, b = _module("a", 3.0), _module("b", 5.0)
    assert a.init.__code__ == b.init.__code__  # what fooled the old fingerprint
    out = meshinit.init(
        {
            "a": meshinit.param((8, 4), a.init, mesh=mesh),
            "b": meshinit.param((8, 4), b.init, mesh=mesh),
        },
        0,
    )
    assert (first(out, "a"), first(out, "b")) == (3.0, 5.0)
    assert fp(a.init) != fp(b.init)


def test_a_global_rebound_between_calls_changes_the_fingerprint(mesh):
    m = _module("c", 1.0)
    before = fp(m.init)
    assert first(meshinit.init({"w": meshinit.param((8, 4), m.init, mesh=mesh)}, 0)) == 1.0
    m.SCALE = 4.0
    assert fp(m.init) != before
    assert first(meshinit.init({"w": meshinit.param((8, 4), m.init, mesh=mesh)}, 0)) == 4.0


def test_a_closure_over_a_numpy_array_counts_by_its_contents(mesh):
    table = np.ones((8, 4), np.float32)

    def init(key, shape, dtype):
        return jnp.asarray(table, dtype)

    assert fp(init)[0] == "fp"
    before = fp(init)
    assert first(meshinit.init({"w": meshinit.param((8, 4), init, mesh=mesh)}, 0)) == 1.0
    table[:] = 7.0  # in place: the same object, other values
    assert fp(init) != before
    assert first(meshinit.init({"w": meshinit.param((8, 4), init, mesh=mesh)}, 0)) == 7.0


def test_what_has_no_value_fingerprint_is_shared_within_a_plan_and_never_across(mesh):
    class Config:  # hashed by identity, attributes mutable
        scale = 1.0

    cfg = Config()

    def init(key, shape, dtype):
        return jnp.full(shape, cfg.scale, dtype)

    specs = {f"w{i}": meshinit.param((8, 4), init, mesh=mesh) for i in range(3)}
    plan = meshinit.plan(specs)
    assert len({e.signature for e in plan.entries}) == 1  # one compile for the three
    assert plan.entries[0].signature != meshinit.plan(specs).entries[0].signature
    assert first(meshinit.materialize(plan, 0), "w0") == 1.0
    cfg.scale = 3.0
    assert first(meshinit.init(specs, 0), "w2") == 3.0


def test_library_initializers_keep_their_quick_fingerprint():
    lecun = jax.nn.initializers.lecun_normal
    _signature._QUICK.clear()
    assert fp(lecun()) == fp(lecun())
    assert len(_signature._QUICK) == 1  # the second fresh closure hit the memo
    assert fp(jax.nn.initializers.normal(0.1)) != fp(jax.nn.initializers.normal(0.2))


# ------------------------------------------------------------- refused before allocating


def test_a_deleted_existing_array_is_refused_with_its_path(mesh):
    specs = {"w": meshinit.param((8, 4), jax.nn.initializers.ones, mesh=mesh)}
    plan = meshinit.plan(specs)
    gone = jnp.zeros((8, 4))
    gone.delete()
    with pytest.raises(meshinit.PlanError, match=r"w: existing array was deleted"):
        meshinit.materialize(plan, 0, existing={"w": gone})


def test_an_element_count_past_int64_is_a_plan_error_not_an_abort(mesh):
    zeros = jax.nn.initializers.zeros
    specs = {
        "w": meshinit.param((2**40, 2**40), zeros, mesh=mesh),
        "v": meshinit.param((2**62, 4), zeros, mesh=mesh),  # bytes past int64 too
        "ok": meshinit.param((8, 4), zeros, mesh=mesh),
    }
    with pytest.raises(meshinit.PlanError) as e:
        meshinit.plan(specs)
    assert [p.path for p in e.value.problems] == ["v", "w"]
    assert all("must fit in int64" in p.message for p in e.value.problems)


def test_the_cli_exits_nonzero_for_an_overflowing_shape(tmp_path, capsys):
    source = (
        "import jax, meshinit\n"
        "def specs():\n"
        "    return {'w': meshinit.param((2**40, 2**40), jax.nn.initializers.zeros,\n"
        "                                axes=('embed', 'mlp'))}\n"
    )
    rc, out, err = plan_source(tmp_path, capsys, source, "--abstract-mesh", "embed=2,mlp=4")
    assert rc != 0
    assert "TiB" not in out and "must fit in int64" in err


# ----------------------------------------------------------- inputs that used to crash


def _zeros_spec(m):
    return meshinit.param((8,), jax.nn.initializers.zeros, mesh=m)


def _nested(spec, depth):
    for _ in range(depth):
        spec = {"x": spec}
    return spec


def test_a_tree_nested_past_the_recursion_limit_is_a_plan_error(mesh):
    # jax flattens up to sys.getrecursionlimit() levels on Python 3.11, and up to
    # CPython's fixed C recursion limit (about 1500) on 3.12: 100000 is past both.
    with pytest.raises(meshinit.PlanError, match=r"x\.x\.x.*nested 100000 levels deep") as e:
        meshinit.plan(_nested(_zeros_spec(mesh), 100_000))
    assert e.value.problems[0].path == "x.x.x.x.x.x.x.x.<...>"


@pytest.mark.parametrize("limit", [None, 10_000])
def test_a_deep_tree_is_planned_or_a_plan_error_whatever_the_recursion_limit(mesh, limit):
    # 4000 levels, under a raised recursion limit: Python 3.11 lets jax flatten them,
    # 3.12 does not (its C limit stays); either way no bare SystemError reaches the user.
    import sys

    before = sys.getrecursionlimit()
    try:
        if limit is not None:
            sys.setrecursionlimit(limit)
        try:
            plan = meshinit.plan(_nested(_zeros_spec(mesh), 4000))
        except meshinit.PlanError as e:
            assert "nested 4000 levels deep" in str(e)
        else:
            assert [e.path for e in plan.entries] == [".".join(["x"] * 4000)]
    finally:
        sys.setrecursionlimit(before)


def test_a_lone_surrogate_in_a_path_is_a_plan_error_naming_it(mesh):
    with pytest.raises(meshinit.PlanError, match=r"UTF-8 cannot encode") as e:
        meshinit.plan({"ok": _zeros_spec(mesh), "bad\udcff": _zeros_spec(mesh)})
    assert [p.path for p in e.value.problems] == ["bad\udcff"]
    assert "bad\\udcff" in str(e.value)  # escaped: the message itself can be printed
    str(e.value).encode("utf-8")


def test_a_dict_with_mixed_key_types_is_a_plan_error_naming_it(mesh):
    tree = {"layers": {"a": _zeros_spec(mesh), 1: _zeros_spec(mesh)}}
    with pytest.raises(meshinit.PlanError, match=r"layers: a dict whose keys mix types"):
        meshinit.plan(tree)


def test_control_characters_in_paths_are_escaped_in_the_text_tables():
    m = jax.sharding.AbstractMesh((2, 4), ("a", "b"))
    plan = meshinit.plan({"x\x1b[31m\nnew\x00": _zeros_spec(m)})
    for text in (str(plan), plan.compact()):
        assert "\x1b" not in text and "\x00" not in text
        assert "x\\x1b[31m\\nnew\\x00" in text
        # each row is one line: the newline in the path did not break the table
        assert len([line for line in text.splitlines() if "x\\x1b" in line]) >= 1
        assert not any(line.startswith("new") for line in text.splitlines())


# ------------------------------------------------------------------------- boundaries


def test_the_cli_imports_only_the_module_it_names(tmp_path):
    import subprocess
    import sys

    (tmp_path / "model.py").write_text(
        "import jax, meshinit\n"
        "from helper import AXES\n"  # a sibling import still works
        "def specs():\n"
        "    return {'w': meshinit.param((8, 4), jax.nn.initializers.zeros, axes=AXES)}\n"
    )
    (tmp_path / "helper.py").write_text("AXES = ('embed', 'mlp')\n")
    (tmp_path / "plistlib.py").write_text(
        "raise SystemExit('the model folder shadowed plistlib')\n"
    )
    code = (
        "import sys; from meshinit._cli.cli import main\n"
        f"rc = main(['plan', {str(tmp_path / 'model.py')!r} + ':specs', "
        "'--abstract-mesh', 'embed=2,mlp=4'])\n"
        "import plistlib\n"  # what matplotlib imports for --png
        "print('rc', rc, plistlib.__file__)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "rc 0" in r.stdout and str(tmp_path) not in r.stdout.splitlines()[-1]


# ------------------------------------------------------------ no global patch of flax


def test_linen_init_leaves_flax_alone_on_other_threads_and_afterwards(mesh):
    import threading

    import flax.linen as nn
    from flax.core import meta

    import meshinit.linen

    inside, checked = threading.Event(), threading.Event()

    class Dense(nn.Module):
        @nn.compact
        def __call__(self, x):
            init = nn.with_partitioning(nn.initializers.lecun_normal(), ("a", "b"))
            w = self.param("w", init, (x.shape[-1], 8))
            inside.set()  # meshinit's trace is running now, in this thread
            checked.wait(60)
            return x @ w

    def constrained() -> bool:
        def use(x):
            return meta.Partitioned(x, names=("a", "b"), mesh=mesh).unbox()

        return "sharding_constraint" in str(jax.make_jaxpr(use)(jnp.zeros((8, 8))))

    seen = []

    def plain_flax_elsewhere():
        inside.wait(60)
        seen.append(constrained())
        checked.set()

    other = threading.Thread(target=plain_flax_elsewhere)
    other.start()
    out = meshinit.linen.init(Dense(), jax.random.key(0), jnp.ones((2, 8)), mesh=mesh)
    other.join()
    assert seen == [True]  # flax on another thread kept its constraint meanwhile
    assert constrained()  # and this thread has flax's own unbox back
    assert out["params"]["w"].value.sharding.spec == jax.sharding.PartitionSpec("a", "b")


def test_a_plan_on_a_cleared_backend_is_refused_before_allocating():
    import subprocess
    import sys

    code = """
import jax, numpy as np
jax.config.update("jax_num_cpu_devices", 8)
import meshinit
from jax.extend.backend import clear_backends
from jax.sharding import Mesh
mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
plan = meshinit.plan({"w": meshinit.param((8, 4), jax.nn.initializers.ones, mesh=mesh)})
clear_backends()
try:
    meshinit.materialize(plan, 0)
except meshinit.PlanError as e:
    print("REFUSED", e.problems[0].path, "cleared" in e.problems[0].message)
live = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
spec = meshinit.param((8, 4), jax.nn.initializers.ones, mesh=live)
again = meshinit.materialize(meshinit.plan({"w": spec}), 0)
print("LIVE", again["w"].sharding.mesh.devices.flat[0] in jax.devices())
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "REFUSED w True" in r.stdout and "LIVE True" in r.stdout


def test_a_rule_whose_mesh_axis_looks_like_a_typo_is_a_plan_error():
    m = jax.sharding.AbstractMesh((2, 4), ("fsdp", "tensor"))
    zeros = jax.nn.initializers.zeros
    rules = (("embed", "fsdp"), ("heads", "tensr"), ("exp", "expert"), ("stage", "stage"))
    with pytest.raises(meshinit.PlanError) as e:
        meshinit.plan(
            {"q": meshinit.param((8, 8), zeros, axes=("embed", "heads"), mesh=m, rules=rules)}
        )
    (problem,) = e.value.problems
    assert problem.path == "q"
    assert "('heads', 'tensr')" in problem.message and "did you mean 'tensor'?" in problem.message
    # rules the specs do not use ('stage') are a table serving other models: they plan
    ok = meshinit.plan(
        {"e": meshinit.param((8, 8), zeros, axes=("embed", None), mesh=m, rules=rules)}
    )
    assert ok.entries[0].sharding.spec == jax.sharding.PartitionSpec("fsdp", None)


def test_a_rule_naming_an_axis_of_no_mesh_is_a_plan_error_as_in_flax():
    # ('y', 'zz') against axes x, y, z: nothing like a typo, and still refused, as flax's
    # eager path refuses it (jax will not build a PartitionSpec naming a missing axis)
    m = jax.sharding.AbstractMesh((2, 2, 2), ("x", "y", "z"))
    zeros = jax.nn.initializers.zeros
    rules = (("a", "x"), ("b", "zz"), ("b", "y"))
    with pytest.raises(meshinit.PlanError) as e:
        meshinit.plan(
            {
                "w": meshinit.param((8, 8), zeros, axes=("a", "b"), mesh=m, rules=rules),
                "v": meshinit.param((8,), zeros, axes=("b",), mesh=m, rules=rules),
            }
        )
    (problem,) = e.value.problems  # said once, at the first spec that uses it
    assert problem.path == "v" or problem.path == "w"
    assert "rule ('b', 'zz') names mesh axis 'zz'" in problem.message
    assert "in none of the plan's meshes (axes: x, y, z)" in problem.message
    assert "did you mean" not in problem.message


def test_a_rule_whose_axis_is_on_another_mesh_of_the_plan_is_skipped_on_the_rest():
    # one table for two stages of different shapes: 'tensor' exists on stage 0 only
    stage0 = jax.sharding.AbstractMesh((2, 2), ("fsdp", "tensor"))
    stage1 = jax.sharding.AbstractMesh((4,), ("fsdp",))
    zeros = jax.nn.initializers.zeros
    rules = (("embed", "fsdp"), ("mlp", "tensor"))
    plan = meshinit.plan(
        {
            "s0": meshinit.param((8, 8), zeros, axes=("embed", "mlp"), mesh=stage0, rules=rules),
            "s1": meshinit.param((8, 8), zeros, axes=("embed", "mlp"), mesh=stage1, rules=rules),
        }
    )
    got = {e.path: e.sharding.spec for e in plan.entries}
    P = jax.sharding.PartitionSpec
    assert got == {"s0": P("fsdp", "tensor"), "s1": P("fsdp", None)}


def test_the_cli_warns_once_about_abstract_mesh_axes_nothing_uses(tmp_path, capsys):
    source = (
        "import jax, meshinit\n"
        "RULES = (('embed', 'fsdp'), ('mlp', 'tensor'))\n"
        "def specs():\n"
        "    z = jax.nn.initializers.zeros\n"
        "    return {'w': meshinit.param((8, 8), z, axes=('embed', 'mlp'), rules=RULES)}\n"
    )
    mesh = ("--abstract-mesh", "data=2,fsdp=2,tensor=2")
    rc, _, err = plan_source(tmp_path, capsys, source, *mesh)
    assert rc == 0
    warnings = [line for line in err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "'data'" in warnings[0] and "'fsdp'" not in warnings[0]


# ------------------------------------------------------------- errors a new user hit


def test_a_context_mesh_is_named_when_a_spec_has_no_mesh():
    explicit = jax.make_mesh((2, 4), ("fsdp", "tensor"))
    with jax.set_mesh(explicit), pytest.raises(meshinit.PlanError) as e:
        meshinit.plan({"w": meshinit.param((8, 8), jax.nn.initializers.zeros, axes=("fsdp", None))})
    message = e.value.problems[0].message
    assert "jax.set_mesh context mesh is active, fsdp=2, tensor=4" in message
    assert "meshinit.defaults(mesh=jax.sharding.get_mesh())" in message


def test_nnx_init_of_something_that_is_not_a_module_factory_is_a_type_error():
    from flax import nnx

    import meshinit.nnx

    class Model(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.zeros((4,)))

    with pytest.raises(TypeError, match=r"zero-argument callable.*lambda: Model"):
        meshinit.nnx.init(Model())
    with pytest.raises(TypeError, match=r"the factory returned int, not an nnx Module"):
        meshinit.nnx.init(lambda: 3)
    with pytest.raises(TypeError, match=r"takes an nnx Module.*got dict"):
        meshinit.nnx.materialize({"w": 1}, 0)


def test_a_name_missing_from_sharding_rules_says_the_rules_were_searched():
    from flax import nnx

    import meshinit.nnx

    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"))
    rules = (("embed", "fsdp"), ("mlp", "tensor"))

    class Model(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(
                jnp.zeros((8, 8)), out_sharding=("embed", "mlpp"), sharding_rules=rules, mesh=mesh
            )

    with pytest.raises(meshinit.PlanError) as e:
        meshinit.nnx.init(Model)
    (problem,) = e.value.problems
    assert problem.path == "w"
    assert "'mlpp'" in problem.message and "no rule in its sharding_rules" in problem.message
    assert "did you mean 'mlp'? (known: embed, mlp)" in problem.message


def test_equinox_errors_speak_of_its_own_api():
    import equinox as eqx

    import meshinit.eqx

    def linear(k):
        return eqx.nn.Linear(8, 8, key=k)

    key = jax.random.key(0)
    with pytest.raises(meshinit.PlanError) as e:
        meshinit.eqx.init(linear, key, [(r".*weight", ("fsdp", None)), (r".*bias", None)])
    text = str(e.value)
    assert "pass mesh= to meshinit.eqx.init" in text and "param()" not in text
    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"))
    with pytest.raises(meshinit.PlanError) as e:
        meshinit.eqx.init(
            linear, key, [(r"lin.weight", ("fsdp", None)), (r"bias", None)], mesh=mesh
        )
    lines = str(e.value).splitlines()[1:]
    assert len(lines) == 2
    assert 'r"lin.weight" matched no array leaf' in lines[0] and "r'.*weight'" in lines[0]
    assert lines[1].strip() == "1 array leaves matched no placement: weight"


def test_the_cli_suggests_devices_when_the_mesh_needs_more(tmp_path, capsys):
    source = (
        "import jax, meshinit\n"
        "def specs():\n"
        "    mesh = jax.make_mesh((4, 4), ('a', 'b'))\n"
        "    return {'w': meshinit.param((8, 8), jax.nn.initializers.zeros, axes=('a', 'b'),\n"
        "                                mesh=mesh)}\n"
    )
    rc, _, err = plan_source(tmp_path, capsys, source)
    assert rc == 2 and "--devices N (N >= 16" in err


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: meshinit.optax.init("adam", {"w": jnp.zeros(3)}), r"optax GradientTransformation"),
        (lambda: meshinit.param_key(0, 5), r"path must be .* str"),
        (
            lambda: meshinit.plan(
                {
                    "w": meshinit.param(
                        (8,), jax.nn.initializers.zeros, mesh=jax.make_mesh((8,), ("x",))
                    )
                }
            ).fill([1, 2]),
            r"one value per entry.*1 values, got 2",
        ),
        (
            lambda: meshinit.param((8,), jax.nn.initializers.zeros, dtype=jax.dtypes.prng_key),
            r"numeric dtype",
        ),
    ],
    ids=["optax-str", "param_key-int", "fill-length", "param-key-dtype"],
)
def test_unclear_errors_are_type_errors(call, match):
    import meshinit.optax  # noqa: F401

    with pytest.raises(TypeError, match=match):
        call()


# ---------------------------------------------------- shardings equal to flax's own


def test_nnx_and_linen_spell_partition_specs_as_flax_does():
    import flax.linen as nn
    from flax import nnx

    import meshinit.linen
    import meshinit.nnx

    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("fsdp", "tensor"))  # Auto axes

    class Attention(nnx.Module):
        def __init__(self, rngs):
            init = jax.nn.initializers.lecun_normal()
            self.k = nnx.Param(
                init(rngs.params(), (8, 4, 4)), out_sharding=("fsdp", None), mesh=mesh
            )

    eager = Attention(nnx.Rngs(0))
    ours = meshinit.nnx.init(lambda: Attention(nnx.Rngs(0)))
    assert ours.k.get_value().sharding == eager.k.get_value().sharding  # P('fsdp', None)
    assert (
        ours.k.get_value().sharding.spec
        == nnx.get_partition_spec(nnx.state(eager))["k"].get_value()
    )

    class DenseGeneral(nn.Module):  # lm1b's 3-D attention kernels
        @nn.compact
        def __call__(self, x):
            init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "heads"))
            self.param("kernel", init, (8, 4, 4))
            return x

    rules = (("embed", "fsdp"), ("heads", "tensor"))
    x = jnp.ones((2, 8))
    abstract = jax.eval_shape(DenseGeneral().init, jax.random.key(0), x)
    flax_sharding = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, rules)
    out = meshinit.linen.init(DenseGeneral(), jax.random.key(0), x, mesh=mesh, rules=rules)
    assert out["params"]["kernel"].value.sharding == flax_sharding["params"]["kernel"]


# ------------------------------------------------------------ out of memory, named


def _failing_calls(monkeypatch, *, at_wait: bool, where=None):
    """Every compiled call after the first fails as an out-of-memory would: at once,
    or (``at_wait``) asynchronously, when its arrays are waited for. ``where`` is the
    module whose ``compiled`` is replaced: the spec path's strategies by default,
    ``meshinit._run.compile`` for the constructor engine's programs."""
    from meshinit._run import strategies as _strategies

    where = _strategies if where is None else where
    real = where.compiled
    calls = []

    class Failed:  # an array whose computation failed on the device
        def block_until_ready(self):
            raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory (injected)")

        def delete(self):
            pass

    def compiled(*args, **kwargs):
        exe = real(*args, **kwargs)

        def run(*a):
            calls.append(1)
            if len(calls) == 1:
                return exe(*a)
            if not at_wait:
                raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory (injected)")
            return [Failed() for _ in exe(*a)]

        return run

    monkeypatch.setattr(where, "compiled", compiled)


@pytest.mark.parametrize("at_wait", [False, True], ids=["at-dispatch", "at-wait"])
def test_an_out_of_memory_names_the_parameters_of_the_failed_call(monkeypatch, mesh, at_wait):
    ones = jax.nn.initializers.ones
    # calls: one that makes "a" (the largest first), then one per layer's q
    specs = {
        "a": meshinit.param((64, 64), ones, mesh=mesh),
        "layers": [{"q": meshinit.param((16, 16), ones, mesh=mesh)} for _ in range(2)],
    }
    plan = meshinit.plan(specs)
    _failing_calls(monkeypatch, at_wait=at_wait)
    with pytest.raises(jax.errors.JaxRuntimeError, match="RESOURCE_EXHAUSTED") as e:
        meshinit.materialize(plan, 0)
    notes = "\n".join(e.value.__notes__)
    if at_wait:  # both layer calls failed on the device; the call that made "a" did not
        assert "waiting for the arrays: the arrays of layers.0.q, layers.1.q failed" in notes
    else:
        assert "meshinit: in the call that makes layers.0.q" in notes
    assert "deleted the" in notes


# ------------------------------------------------------------ caches (issue 18)


def test_a_failed_adapter_init_names_the_adapter_not_materialize(monkeypatch, mesh):
    from flax import nnx

    from meshinit._run import compile as _compile

    _failing_calls(monkeypatch, at_wait=False, where=_compile)  # the engine's programs

    class Two(nnx.Module):
        def __init__(self, rngs):
            init = nnx.initializers.lecun_normal()
            # two signatures with 1 and 2 variables: two executables, three calls
            self.a = nnx.Param(init(rngs.params(), (64, 64)), out_sharding=("a", None))
            self.b = nnx.Param(init(rngs.params(), (16, 16)), out_sharding=("a", None))
            self.c = nnx.Param(init(rngs.params(), (16, 16)), out_sharding=("a", None))

    with jax.set_mesh(mesh), pytest.raises(jax.errors.JaxRuntimeError) as e:
        meshinit.nnx.init(lambda: Two(nnx.Rngs(0)))
    notes = "\n".join(e.value.__notes__)
    assert "meshinit: meshinit.nnx.init failed while" in notes, notes
    assert "materialize failed" not in notes


def test_clear_cache_empties_every_cache_meshinit_keeps(mesh):
    import optax
    from flax import nnx

    import meshinit.nnx
    import meshinit.optax
    from meshinit import _caches

    lecun = jax.nn.initializers.lecun_normal()
    rules = [["embed", "a"], ["mlp", "b"]]  # lists, as from YAML
    specs = {"w": meshinit.param((8, 8), lecun, axes=("embed", "mlp"), mesh=mesh, rules=rules)}
    params = meshinit.init(specs, 0)
    meshinit.optax.init(optax.adam(1e-3), params)

    class M(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones((8, 8)), out_sharding=("a", None), mesh=mesh)

    model = meshinit.nnx.init(M)
    meshinit.nnx.optimizer(model, optax.sgd(0.1))
    meshinit.logical_to_mesh_axes(["embed", "mlp"], rules)
    names = [name for name, _ in _caches.registered()]
    assert {"compiled executables", "initializer fingerprints", "abstract init checks"} <= set(
        names
    )
    assert sum(_caches.size(c) for _, c in _caches.registered()) > 0
    meshinit.clear_cache()
    assert {name: _caches.size(c) for name, c in _caches.registered() if _caches.size(c)} == {}


def test_every_cache_in_the_package_is_registered():
    import functools
    import importlib
    import pkgutil
    import weakref

    import meshinit as package
    from meshinit import _caches

    modules = [  # every module imported first: a lazily imported one registers late
        importlib.import_module(info.name)
        for info in pkgutil.walk_packages(package.__path__, "meshinit.")  # stages too
        if info.name != "meshinit.__main__"  # runs the command line
    ]
    registered = {id(c) for _, c in _caches.registered()}
    missing = []
    seen = 0
    for module in modules:
        seen += 1
        for name, value in vars(module).items():
            cache_like = isinstance(
                value, _caches.LRUCache | weakref.WeakKeyDictionary | functools._lru_cache_wrapper
            )
            if cache_like and id(value) not in registered:
                missing.append(f"{module.__name__}.{name}")
    assert missing == []
    assert seen >= 40  # every module of the package, in its stage packages too
