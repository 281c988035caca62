import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import three_mesh_specs
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P

import meshinit
from meshinit import _paths
from meshinit._spec import fingerprints as _signature

lecun = jax.nn.initializers.lecun_normal
zeros = jax.nn.initializers.zeros
ones = jax.nn.initializers.ones


@pytest.mark.parametrize("explicit", [False, True])
def test_three_mesh_plan_has_exact_shardings_and_one_group_per_mesh(explicit):
    specs, (m1, m2, m3) = three_mesh_specs(explicit)
    p = meshinit.plan(specs)
    assert [e.path for e in p.entries] == ["small_linear1", "small_linear2", "small_linear3"]
    want = [
        NamedSharding(m1, P("a", "b")),
        NamedSharding(m2, P("x", "y", "z")),
        NamedSharding(m3, P("c", None)),
    ]
    assert [e.sharding for e in p.entries] == want
    assert [g.mesh for g in p.groups] == [m1, m2, m3]
    assert all(len(g.entries) == 1 for g in p.groups)


def test_entries_follow_tree_flatten_order_and_other_leaves_pass_through():
    m = AbstractMesh((8,), ("x",))
    tree = {
        "b": [meshinit.param((8,), zeros, axes=("x",), mesh=m), "keep"],
        "a": meshinit.param((2,), ones, mesh=m),
        "c": None,
        "d": 3.0,
    }
    p = meshinit.plan(tree)
    assert [e.path for e in p.entries] == ["a", "b.0"]
    abstract = p.abstract()
    assert abstract["b"][1] == "keep" and abstract["c"] is None and abstract["d"] == 3.0
    assert abstract["a"] == jax.ShapeDtypeStruct(
        (2,), jnp.float32, sharding=NamedSharding(m, P(None))
    )
    assert abstract["b"][0].sharding == NamedSharding(m, P("x"))


def test_groups_collect_entries_by_mesh_in_first_appearance_order():
    m1, m2 = AbstractMesh((8,), ("x",)), AbstractMesh((2, 4), ("x", "y"))
    tree = [meshinit.param((8,), zeros, axes=("x",), mesh=m) for m in (m1, m2, m1, m2, m1)]
    p = meshinit.plan(tree)
    assert [g.mesh for g in p.groups] == [m1, m2]
    assert [e.path for e in p.groups[0].entries] == ["0", "2", "4"]
    assert [e.path for e in p.groups[1].entries] == ["1", "3"]


def test_plan_on_abstract_mesh_has_sizes_without_devices():
    m = AbstractMesh((16, 16, 8), ("data", "fsdp", "tensor"))
    rules = (("embed", "fsdp"), ("mlp", "tensor"), ("vocab", "tensor"))
    with meshinit.defaults(mesh=m, rules=rules, dtype=jnp.bfloat16):
        tree = {
            "up": meshinit.param((16384, 53248), lecun(), axes=("embed", "mlp")),
            "norm": meshinit.param((16384,), jax.nn.initializers.ones, axes=("embed",)),
        }
    p = meshinit.plan(tree)
    up, norm = p.entries[1], p.entries[0]
    assert up.sharding == NamedSharding(m, P("fsdp", "tensor"))
    assert up.shard_shape == (1024, 6656) and up.device_bytes == 1024 * 6656 * 2
    assert norm.device_bytes == 16384 * 2 // 16
    assert p.nbytes == (16384 * 53248 + 16384) * 2
    assert p.groups[0].device_bytes == up.device_bytes + norm.device_bytes


def test_str_plan_lists_every_full_path_with_specs_and_totals():
    m = AbstractMesh((2, 4), ("fsdp", "tensor"))
    with meshinit.defaults(mesh=m, rules=(("embed", "fsdp"), ("mlp", "tensor"))):
        tree = {
            "layers": [
                {"mlp": {"up": meshinit.param((256, 1024), lecun(), axes=("embed", "mlp"))}}
                for _ in range(3)
            ]
        }
    text = str(meshinit.plan(tree))
    for i in range(3):
        assert f"layers.{i}.mlp.up" in text
    assert "P('fsdp', 'tensor')" in text and "(embed, mlp)" in text
    assert "fsdp=2,tensor=4" in text  # the mesh axes used, with sizes
    assert "128.0 KiB" in text  # 256*1024*4 bytes / 8 devices
    assert "3 params, 3.0 MiB in all, 384.0 KiB per device" in text


def errors_of(tree) -> list[str]:
    with pytest.raises(meshinit.PlanError) as info:
        meshinit.plan(tree)
    return [str(p) for p in info.value.problems]


M = AbstractMesh((2, 4), ("fsdp", "tensor"))


@pytest.mark.parametrize(
    "spec, match",
    [
        (meshinit.param((8, 8), zeros, axes=("fsdp",), mesh=M), "have 1 entries but shape"),
        (
            meshinit.param((6, 8), zeros, axes=("tensor", None), mesh=M),
            r"dimension 0 of size 6 is not divisible by mesh axes 'tensor' of size 4",
        ),
        (
            meshinit.param((8, 8), zeros, axes=("fsdp", "fsdp"), mesh=M),
            "'fsdp' appear more than once",
        ),
        (
            meshinit.param((8, 8), zeros, axes=(("fsdp", "tensor"), "tensor"), mesh=M),
            "mesh axis 'tensor' used by more than one dimension",
        ),
        (
            meshinit.param((8, 8), zeros, axes=("data", None), mesh=M),
            r"mesh axis name\(s\) 'data' not in the mesh \(axes: fsdp, tensor\)",
        ),
        (meshinit.param((8, 8), zeros, axes=("fsdp", None)), "no mesh given and no default"),
        (meshinit.param((8, 8), zeros, mesh="mesh"), "must be a jax.sharding.Mesh"),
        (meshinit.param((8, 8), "normal", mesh=M), "init 'normal' is not callable"),
        (
            meshinit.param((8, 8), lambda k, s, d: jnp.zeros((8,), d), mesh=M),
            r"init returned float32\[8\], expected float32\[8, 8\]",
        ),
        (
            meshinit.param((8, 8), lambda k, s, d: jnp.zeros(s, jnp.int32), mesh=M),
            r"init returned int32\[8, 8\], expected float32\[8, 8\]",
        ),
        (meshinit.param((8, 8), lambda k, s: jnp.zeros(s), mesh=M), "init raised TypeError"),
        (
            meshinit.param((8, 8), lambda k, s, d: (jnp.zeros(s), 1), mesh=M),
            "init returned a tuple",
        ),
        (
            meshinit.param((8,), zeros, axes=("embed",), mesh=M, rules=(("mlp", "tensor"),)),
            r"logical axis 'embed' has no rule; known: mlp; add \('embed', None\)",
        ),
    ],
)
def test_each_bad_spec_is_a_plan_error_naming_its_path(spec, match):
    problems = errors_of({"layers": [{"w": spec}]})
    assert len(problems) == 1
    assert problems[0].startswith("layers.0.w: ")
    assert re.search(match, problems[0]), problems[0]


def test_all_problems_are_gathered_and_raised_once():
    tree = {
        "a": meshinit.param((8, 8), zeros, axes=("fsdp",), mesh=M),
        "b": meshinit.param((8, 8), zeros),
        "c": meshinit.param((8, 8), zeros, axes=("fsdp", "tensor"), mesh=M),  # fine
        "d": meshinit.param((8, 8), 3, mesh=M),
    }
    with pytest.raises(meshinit.PlanError, match="3 problems found while planning") as info:
        meshinit.plan(tree)
    assert [p.path for p in info.value.problems] == ["a", "b", "d"]
    assert isinstance(info.value, ValueError)


def test_duplicate_paths_are_an_error():
    spec = meshinit.param((8,), zeros, mesh=M)
    problems = errors_of({"a.b": spec, "a": {"b": spec}})
    assert problems == [
        "a.b: two parameters have this path; rename one (paths join keys "
        "with '.', so 'a.b' and a/b collide)"
    ]


def test_digest_collisions_are_detected(monkeypatch):
    monkeypatch.setattr(_paths, "path_digest", lambda path: (1, 2))
    spec = meshinit.param((8,), zeros, mesh=M)
    problems = errors_of({"x": spec, "y": spec})
    assert problems == ["y: its 64-bit key digest collides with 'x'; rename one of them"]


def test_abstract_init_check_runs_once_per_distinct_signature_at_10000_specs(monkeypatch):
    calls = []
    real = jax.eval_shape

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(jax, "eval_shape", counting)
    _signature._CHECKS.clear()
    m = AbstractMesh((2, 4), ("fsdp", "tensor"))
    with meshinit.defaults(mesh=m, rules=(("embed", "fsdp"), ("mlp", "tensor"))):
        tree = [
            {
                "up": meshinit.param((256, 1024), lecun(), axes=("embed", "mlp")),
                "down": meshinit.param((1024, 256), lecun(), axes=("mlp", "embed")),
                "n": meshinit.param((256,), jax.nn.initializers.ones, axes=("embed",)),
                "s": meshinit.param((256,), jax.nn.initializers.normal(0.1), axes=(None,)),
            }
            for _ in range(2500)
        ]
    p = meshinit.plan(tree)
    assert len(p.entries) == 10_000
    # lecun_normal() is a fresh closure per call; still one check per (init, shape, dtype).
    assert len(calls) == 4
    assert len({e.signature for e in p.entries}) == 4


def test_fingerprint_tells_apart_initializers_that_compute_differently():
    fp = _signature.initializer_fingerprint
    assert fp(lecun()) == fp(lecun())
    assert fp(jax.nn.initializers.normal(0.1)) != fp(jax.nn.initializers.normal(0.2))
    assert fp(jax.nn.initializers.normal(1)) != fp(jax.nn.initializers.normal(1.0))
    assert fp(lecun()) != fp(jax.nn.initializers.he_normal())
    arr = np.ones(3)
    f = lambda k, s, d: arr  # noqa: E731  (closure over an array: by its contents)
    g = lambda k, s, d: arr + 0  # noqa: E731
    assert fp(f)[0] == "fp" and fp(f) != fp(g)
    big = np.ones(1 << 19)  # over _MAX_ARRAY_BYTES: identity, never equal to another call's
    h = lambda k, s, d: big  # noqa: E731
    assert fp(h)[:2] == ("call", h) and fp(h) != fp(h)


def test_plan_error_is_a_value_error_with_problems():
    err = meshinit.PlanError([meshinit.Problem("a.b", "bad"), meshinit.Problem("", "tree")])
    assert isinstance(err, ValueError)
    assert str(err) == "2 problems found while planning:\n  a.b: bad\n  tree"
