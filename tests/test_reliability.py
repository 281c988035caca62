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
from meshinit import _signature

fp = _signature.fingerprint


@pytest.fixture
def mesh():
    return Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))


def first(tree, path="w"):
    return float(np.asarray(tree[path]).flat[0])


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
    from meshinit._cli import main

    module = tmp_path / "huge_model.py"
    module.write_text(
        "import jax, meshinit\n"
        "def specs():\n"
        "    return {'w': meshinit.param((2**40, 2**40), jax.nn.initializers.zeros,\n"
        "                                axes=('embed', 'mlp'))}\n"
    )
    rc = main(["plan", f"{module}:specs", "--abstract-mesh", "embed=2,mlp=4"])
    out, err = capsys.readouterr()
    assert rc != 0
    assert "TiB" not in out and "must fit in int64" in err


# ----------------------------------------------------------- inputs that used to crash


def _zeros_spec(m):
    return meshinit.param((8,), jax.nn.initializers.zeros, mesh=m)


def test_a_tree_nested_past_the_recursion_limit_is_a_plan_error(mesh):
    import sys

    deep = _zeros_spec(mesh)
    for _ in range(sys.getrecursionlimit() + 100):
        deep = {"x": deep}
    with pytest.raises(meshinit.PlanError, match=r"x\.x\.x.*nested \d+ levels deep") as e:
        meshinit.plan(deep)
    assert e.value.problems[0].path.startswith("x.x.x")


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
        "import sys; from meshinit._cli import main\n"
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
    # MaxText-style tables naming axes this mesh lacks still plan
    ok = meshinit.plan(
        {"e": meshinit.param((8, 8), zeros, axes=("exp", "embed"), mesh=m, rules=rules)}
    )
    assert ok.entries[0].sharding.spec == jax.sharding.PartitionSpec(None, "fsdp")


def test_the_cli_warns_once_about_abstract_mesh_axes_nothing_uses(tmp_path, capsys):
    from meshinit._cli import main

    module = tmp_path / "model_axes.py"
    module.write_text(
        "import jax, meshinit\n"
        "RULES = (('embed', 'fsdp'), ('mlp', 'tensor'))\n"
        "def specs():\n"
        "    z = jax.nn.initializers.zeros\n"
        "    return {'w': meshinit.param((8, 8), z, axes=('embed', 'mlp'), rules=RULES)}\n"
    )
    rc = main(["plan", f"{module}:specs", "--abstract-mesh", "data=2,fsdp=2,tensor=2"])
    _, err = capsys.readouterr()
    assert rc == 0
    warnings = [line for line in err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "'data'" in warnings[0] and "'fsdp'" not in warnings[0]
