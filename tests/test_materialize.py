import re
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_exact, submesh, three_mesh_specs
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import AbstractMesh

import meshinit
from meshinit._run import compile as _compile
from meshinit._run import strategies as _strategies
from meshinit._run.loop import run_plan

lecun = jax.nn.initializers.lecun_normal


def reference(spec, key, path):
    """The value contract's jitted reference for one parameter."""
    fn = jax.jit(lambda k: spec.init(k, spec.shape, spec.dtype))
    return np.asarray(fn(meshinit.param_key(key, path)))


@pytest.mark.parametrize("explicit", [False, True])
@pytest.mark.parametrize("context", [False, True])
def test_three_meshes_materialize_exactly_with_or_without_context_mesh(explicit, context):
    specs, _ = three_mesh_specs(explicit)
    plan = meshinit.plan(specs)
    if context:
        with jax.set_mesh(jax.make_mesh((4, 2), ("data", "context"))):
            out = meshinit.materialize(plan, jax.random.key(0))
    else:
        out = meshinit.materialize(plan, jax.random.key(0))
    by_path = assert_exact(plan, out)
    for e in plan.entries:
        np.testing.assert_array_max_ulp(
            np.asarray(by_path[e.path]), reference(e.spec, jax.random.key(0), e.path), maxulp=2
        )


@pytest.mark.parametrize("explicit", [False, True])
def test_disjoint_pipeline_stages_materialize_under_a_context_mesh(explicit):
    # flax/jit fail here with "incompatible devices": one jit cannot output to both.
    stages = [
        submesh(range(0, 4), (2, 2), ("fsdp", "tensor"), explicit),
        submesh(range(4, 8), (2, 2), ("fsdp", "tensor"), explicit),
    ]
    specs = [
        {
            "w": meshinit.param((32, 64), lecun(), axes=("fsdp", "tensor"), mesh=m),
            "b": meshinit.param((64,), jax.nn.initializers.zeros, axes=("tensor",), mesh=m),
        }
        for m in stages
    ]
    plan = meshinit.plan(specs)
    assert len(plan.groups) == 2
    with jax.set_mesh(jax.make_mesh((8,), ("data",))):
        key = jax.random.key(1)  # placed on the context mesh
        out = meshinit.materialize(plan, key)
    by_path = assert_exact(plan, out)
    assert {d.id for d in by_path["0.w"].devices()} == {0, 1, 2, 3}
    assert {d.id for d in by_path["1.w"].devices()} == {4, 5, 6, 7}


def test_overlapping_and_reordered_submeshes():
    meshes = [
        submesh([0, 1, 2, 3], (4,), ("x",)),
        submesh([2, 3, 4, 5], (2, 2), ("x", "y")),
        submesh([7, 6, 5, 4, 3, 2, 1, 0], (8,), ("x",), explicit=True),
    ]
    specs = {
        f"m{i}": meshinit.param((16, 8), lecun(), axes=("x", None), mesh=m)
        for i, m in enumerate(meshes)
    }
    plan = meshinit.plan(specs)
    out = meshinit.materialize(plan, 0)
    assert_exact(plan, out)


def test_seed_typed_and_legacy_keys_give_the_same_values():
    specs, _ = three_mesh_specs(explicit=True)
    plan = meshinit.plan(specs)
    a = meshinit.materialize(plan, 5)
    b = meshinit.materialize(plan, jax.random.key(5))
    c = meshinit.materialize(plan, jax.random.PRNGKey(5))
    for k in a:
        assert np.array_equal(a[k], b[k]) and np.array_equal(a[k], c[k])


def model(mesh, layers, rules, order=None, extra=False):
    with meshinit.defaults(mesh=mesh, rules=rules):
        tree = {
            "embed": meshinit.param((512, 64), lecun(), axes=("vocab", "embed")),
            "layers": [
                {
                    "q": meshinit.param((64, 64), lecun(), axes=("embed", "heads")),
                    "up": meshinit.param((64, 256), lecun(), axes=("embed", "mlp")),
                    "n": meshinit.param((64,), jax.nn.initializers.ones, axes=("embed",)),
                    "u": meshinit.param(
                        (64, 8),
                        jax.nn.initializers.uniform(),
                        axes=("embed", None),
                        dtype=jnp.bfloat16,
                    ),
                }
                for _ in range(layers)
            ],
        }
        if extra:
            tree["extra"] = meshinit.param((8, 8), lecun(), axes=(None, None))
    return tree


RULES = (("vocab", "tensor"), ("embed", "fsdp"), ("heads", "tensor"), ("mlp", "tensor"))


def flat_values(tree):
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {meshinit._paths.path_str(kp): np.asarray(v) for kp, v in flat}


def test_values_are_bit_identical_across_meshes_groupings_order_and_other_params():
    base = flat_values(meshinit.init(model(jax.make_mesh((2, 4), ("fsdp", "tensor")), 2, RULES), 0))
    one_device = submesh([5], (1, 1), ("fsdp", "tensor"))
    variants = [
        model(jax.make_mesh((4, 2), ("fsdp", "tensor")), 2, RULES),
        model(submesh([3, 1, 2, 0], (2, 2), ("fsdp", "tensor")), 2, RULES),
        model(one_device, 2, RULES),
        model(jax.make_mesh((1, 8), ("fsdp", "tensor")), 2, RULES),  # fsdp of size 1
        model(jax.make_mesh((2, 4), ("fsdp", "tensor")), 3, RULES, extra=True),  # more params
    ]
    # Another grouping: every layer on its own mesh.
    split = model(jax.make_mesh((2, 4), ("fsdp", "tensor")), 2, RULES)
    split["layers"][1] = model(submesh(range(4), (2, 2), ("fsdp", "tensor")), 2, RULES)["layers"][1]
    variants.append(split)
    # Declaration order: a tree whose flatten order differs, same paths.
    variants.append(
        {
            "layers": {
                "1": model(one_device, 2, RULES)["layers"][1],
                "0": model(one_device, 2, RULES)["layers"][0],
            },
            "embed": model(one_device, 1, RULES)["embed"],
        }
    )
    for tree in variants:
        got = flat_values(meshinit.init(tree, 0))
        for path, value in base.items():
            assert np.array_equal(got[path], value), path


def test_values_equal_the_jitted_reference_within_2_ulp():
    tree = model(jax.make_mesh((2, 4), ("fsdp", "tensor")), 2, RULES)
    plan = meshinit.plan(tree)
    got = flat_values(meshinit.materialize(plan, jax.random.key(42)))
    for e in plan.entries:
        ref = reference(e.spec, jax.random.key(42), e.path)
        np.testing.assert_array_max_ulp(
            got[e.path].astype(np.float32), ref.astype(np.float32), maxulp=2
        )


def test_second_key_and_same_shaped_model_trigger_zero_compiles(count_compiles):
    meshinit.clear_cache()
    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"))
    plan = meshinit.plan(model(mesh, 3, RULES))
    keys = [jax.random.key(i) for i in range(3)]  # the user's own key ops compile outside
    with count_compiles() as first:
        a = meshinit.materialize(plan, keys[0])
    assert first.count >= 1
    with count_compiles() as second:
        b = meshinit.materialize(plan, keys[1])
        c = meshinit.materialize(meshinit.plan(model(mesh, 3, RULES)), 2)  # fresh closures
        meshinit.materialize(plan, jax.random.PRNGKey(5))
    assert second.count == 0
    assert not np.array_equal(a["embed"], b["embed"])
    assert not np.array_equal(b["embed"], c["embed"])


def test_compiles_do_not_grow_with_depth(count_compiles):
    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"))
    counts = []
    for layers in (2, 16):
        meshinit.clear_cache()
        plan = meshinit.plan(model(mesh, layers, RULES))
        signatures = {e.signature for e in plan.entries}
        assert len(signatures) == 5  # embed, q, up, n, u: the same at any depth
        with count_compiles() as cold:
            meshinit.materialize(plan, 0)
        with count_compiles() as warm:
            meshinit.materialize(plan, 1)
        # at most one compile per distinct signature per mesh group; none when warm
        assert 1 <= cold.count <= len(signatures)
        assert warm.count == 0
        counts.append(cold.count)
    assert counts[0] == counts[1]


@pytest.mark.parametrize("strategy", sorted(_strategies.STRATEGIES))
def test_every_strategy_compiles_at_most_once_per_signature(strategy, count_compiles):
    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"))
    plan = meshinit.plan(model(mesh, 3, RULES))
    meshinit.clear_cache()
    key_data, impl = meshinit._paths.host_key(0)
    s = _strategies.STRATEGIES[strategy]
    with count_compiles() as cold:  # builds: compiled in parallel first, as materialize does
        run_plan(plan, _strategies.Specs(s, key_data, impl))
    with count_compiles() as warm:
        run_plan(plan, _strategies.Specs(s, key_data, impl))
    assert 1 <= cold.count <= len({e.signature for e in plan.entries})
    assert warm.count == 0


@pytest.mark.parametrize("explicit", [False, True])
def test_strategies_give_identical_values_and_exact_shardings(explicit):
    mesh = submesh(range(8), (2, 4), ("fsdp", "tensor"), explicit)
    plan = meshinit.plan(model(mesh, 2, RULES))
    key_data, impl = meshinit._paths.host_key(3)
    results = {
        name: run_plan(plan, _strategies.Specs(strategy, key_data, impl))
        for name, strategy in _strategies.STRATEGIES.items()
    }
    base = flat_values(results.pop("rounds"))
    for tree in results.values():
        assert_exact(plan, tree)
        got = flat_values(tree)
        for path, value in base.items():
            assert np.array_equal(got[path], value), path


def largest_array_in(compiled) -> int:
    shapes = re.findall(r"\b(?:f32|bf16|u32|s32|f16)\[([\d,]*)\]", compiled.as_text())
    return max(int(np.prod([int(d) for d in s.split(",") if d])) for s in shapes)


@pytest.mark.parametrize("explicit", [False, True])
def test_no_device_ever_holds_a_full_copy(explicit):
    mesh = submesh(range(8), (2, 4), ("fsdp", "tensor"), explicit)
    specs = {
        "up": meshinit.param((512, 1024), lecun(), axes=("fsdp", "tensor"), mesh=mesh),
        "down": meshinit.param(
            (1024, 512), jax.nn.initializers.normal(), axes=("tensor", "fsdp"), mesh=mesh
        ),
    }
    plan = meshinit.plan(specs)
    group = plan.groups[0]
    full = 512 * 1024
    for name, strategy in _strategies.STRATEGIES.items():
        for exe in strategy.executables(group, "threefry2x32"):
            # Per-device programs see only shard-sized arrays (1/8 of a parameter).
            assert largest_array_in(exe) <= full // 8, name


def test_abstract_mesh_cannot_be_materialized():
    plan = meshinit.plan({"w": meshinit.param((8, 8), lecun(), mesh=AbstractMesh((8,), ("x",)))})
    with pytest.raises(meshinit.PlanError, match="w: mesh .* is abstract"):
        meshinit.materialize(plan, 0)


def test_materialize_rejects_sharding_dependent_keys():
    plan = meshinit.plan(
        {"w": meshinit.param((8,), jax.nn.initializers.normal(), mesh=jax.make_mesh((8,), ("x",)))}
    )
    with pytest.raises(ValueError, match="'rbg' generates values that depend on the sharding"):
        meshinit.materialize(plan, jax.random.key(0, impl="rbg"))


def test_failure_in_a_later_group_frees_earlier_arrays():
    stages = [submesh(range(0, 4), (4,), ("x",)), submesh(range(4, 8), (4,), ("x",))]
    plan = meshinit.plan(
        [meshinit.param((64, 64), lecun(), axes=("x", None), mesh=m) for m in stages]
    )
    meshinit.materialize(plan, 0)  # compile and cache both groups
    real = _strategies.chosen()

    class FailsInSecondGroup:
        builds, work = real.builds, real.work

        def prepare(self, group, impl):
            run = real.prepare(group, impl)
            if group is not plan.groups[1]:
                return run

            def failing(key_data):
                yield from run(key_data)  # the group's first array is made ...
                raise RuntimeError("device out of memory")  # ... then it fails

            return failing

    before = {id(a) for a in jax.live_arrays()}
    with (
        meshinit.options(strategy=FailsInSecondGroup()),
        pytest.raises(RuntimeError, match="device out of memory"),
    ):
        meshinit.materialize(plan, 1)
    leaked = [a for a in jax.live_arrays() if id(a) not in before]
    assert leaked == []


def two_stage_plan():
    stages = [submesh(range(0, 4), (2, 2), ("x", "y")), submesh(range(4, 8), (2, 2), ("x", "y"))]
    return meshinit.plan(
        {
            f"s{i}": {
                "w": meshinit.param((64, 32), lecun(), axes=("x", "y"), mesh=m),
                "b": meshinit.param((32,), jax.nn.initializers.ones, axes=("y",), mesh=m),
            }
            for i, m in enumerate(stages)
        }
    )


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
        np.testing.assert_array_max_ulp(
            np.asarray(by_path[e.path]), reference(e.spec, jax.random.key(0), e.path), maxulp=2
        )
    with count_compiles() as warm:
        meshinit.materialize(plan, 1)
    assert warm.count == 0


def break_compiles_on(monkeypatch, bad):
    """Every compile for the mesh ``bad`` fails, naming an XLA option that does not
    exist (not one of meshinit's, so it is not dropped); returns the real options."""
    real = _compile.compiler_options
    monkeypatch.setattr(
        _compile,
        "compiler_options",
        lambda mesh: {"xla_no_such_option_here": 1} if mesh is bad else real(mesh),
    )
    return real


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


def test_materialize_rejects_non_plans_with_the_fix():
    with pytest.raises(TypeError, match=r"call meshinit.init\(tree, key\)"):
        meshinit.materialize({"w": 1}, 0)


def test_empty_and_spec_free_trees_pass_through():
    assert meshinit.init({"a": 1, "b": [None, "x"]}, 0) == {"a": 1, "b": [None, "x"]}


FACTORIZATIONS = [(8,), (2, 4), (4, 2), (2, 2, 2), (1, 8), (8, 1), (2, 1, 4)]
INITS = [
    jax.nn.initializers.normal(0.5),
    jax.nn.initializers.uniform(2.0),
    jax.nn.initializers.truncated_normal(),
]
FAN_INITS = [lecun(), jax.nn.initializers.he_uniform()]  # need at least 2 dimensions


@st.composite
def mesh_and_specs(draw):
    shape = draw(st.sampled_from(FACTORIZATIONS))
    names = tuple("abc"[: len(shape)])
    perm = draw(st.permutations(range(8)))
    explicit = draw(st.booleans())
    mesh = submesh(perm, shape, names, explicit)
    specs = {}
    for i in range(draw(st.integers(1, 4))):
        ndim = draw(st.integers(1, 3))
        dims = tuple(8 * draw(st.integers(1, 3)) for _ in range(ndim))
        free = list(names)
        axes = []
        for _ in range(ndim):
            choice = draw(st.sampled_from([None, *free]))
            if choice is not None:
                free.remove(choice)
            axes.append(choice)
        specs[f"p{i}"] = meshinit.param(
            dims,
            draw(st.sampled_from(INITS + (FAN_INITS if ndim > 1 else []))),
            axes=tuple(axes),
            mesh=mesh,
            dtype=draw(st.sampled_from([jnp.float32, jnp.bfloat16])),
        )
    return mesh, specs


@pytest.mark.slow
@settings(max_examples=12, deadline=None)
@given(mesh_and_specs(), st.integers(0, 2**31 - 1))
def test_property_exact_placement_and_value_contract_on_random_meshes(mesh_specs, seed):
    mesh, specs = mesh_specs
    plan = meshinit.plan(specs)
    by_path = assert_exact(plan, meshinit.materialize(plan, seed))
    single = submesh([0], (1,) * len(mesh.axis_names), mesh.axis_names)
    alone = {
        k: meshinit.param(s.shape, s.init, axes=s.axes, mesh=single, dtype=s.dtype)
        for k, s in specs.items()
    }
    single_values = meshinit.init(alone, seed)
    for e in plan.entries:
        got = np.asarray(by_path[e.path])
        assert np.array_equal(got, np.asarray(single_values[e.path])), e.path
        np.testing.assert_array_max_ulp(
            got.astype(np.float32),
            reference(e.spec, jax.random.key(seed), e.path).astype(np.float32),
            maxulp=2,
        )


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


def test_the_strategy_is_chosen_per_block_and_nests(count_compiles):
    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"))
    plan = meshinit.plan(model(mesh, 3, RULES))
    base = flat_values(meshinit.materialize(plan, 4))
    meshinit.clear_cache()
    with meshinit.options(strategy="per_signature"):
        assert _strategies.chosen() is _strategies.STRATEGIES["per_signature"]
        with meshinit.options(compiler_options={}):  # the strategy stays
            assert _strategies.chosen() is _strategies.STRATEGIES["per_signature"]
        with count_compiles() as compiles:
            got = flat_values(meshinit.materialize(plan, 4))
    assert compiles.count == len({e.signature for e in plan.entries})  # one per signature
    assert _strategies.chosen() is _strategies.STRATEGIES["rounds"]
    for path, value in base.items():
        assert np.array_equal(got[path], value), path


def test_bad_options_are_refused_with_the_choices():
    with pytest.raises(ValueError, match="'rounds', 'per_signature'"):
        with meshinit.options(strategy="fused_group"):
            pass
    with pytest.raises(TypeError, match="has no builds, work"):
        with meshinit.options(strategy=object()):
            pass
    with pytest.raises(TypeError, match="compiler_options must be a mapping"):
        with meshinit.options(compiler_options=[("a", 1)]):
            pass
    with pytest.raises(TypeError, match=r"'xla_x': \[1\]"):
        with meshinit.options(compiler_options={"xla_x": [1]}):
            pass
