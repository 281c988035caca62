"""Logical axis rules: linen parity, the three departures, rule tables and defaults.

Every mesh here is an ``AbstractMesh``: planning needs no devices.
"""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import examples
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

import meshinit
from meshinit._spec.rules import NotedRules, normalize_rules, partition, resolves_as_linen

zeros = jax.nn.initializers.zeros

MESH_POOL = ("data", "fsdp", "tensor", "expert")
LOGICAL_POOL = ("batch", "embed", "mlp", "heads", "vocab")

FSDP_TENSOR = AbstractMesh((2, 4), ("fsdp", "tensor"))


def _canon(entry):
    """One PartitionSpec entry as P stores it: lists as tuples, ('x',) as 'x', () as None."""
    if isinstance(entry, list | tuple):
        entry = tuple(entry)
        return entry[0] if len(entry) == 1 else entry or None
    return entry


def _linen(axes, rules):
    """linen's answer, with list targets given to it as tuples."""
    return nn.logical_to_mesh_axes(axes, [(n, _canon(t)) for n, t in rules])


@pytest.mark.parametrize(
    "axes, rules",
    [
        (("a", "b"), (("a", None), ("b", None), ("b", "x"))),
        (("batch", None), (("batch", None), ("batch", "data"))),
    ],
)
def test_a_none_rule_claims_its_dimension_even_after_other_none_dimensions(axes, rules):
    # linen discards None when it checks for used mesh axes, so (name, None) always wins.
    assert linen_equal(axes, rules)


def linen_equal(axes, rules):
    ours = meshinit.logical_to_mesh_axes(axes, rules, ("x", "data"))
    return P(*ours) == _linen(axes, rules) == P(*(None for _ in axes))


# -- strategies ----------------------------------------------------------------------

targets = st.one_of(
    st.sampled_from(MESH_POOL),
    st.lists(st.sampled_from(MESH_POOL), min_size=1, max_size=3, unique=True).map(tuple),
    st.none(),
)
rule_tables = st.lists(
    st.tuples(st.sampled_from(LOGICAL_POOL), targets), min_size=1, max_size=10
).map(tuple)


@st.composite
def tables_and_axes(draw):
    rules = draw(rule_tables)
    known = sorted({name for name, _ in rules})
    names = draw(st.lists(st.sampled_from(known), unique=True, max_size=len(known)))
    n_none = draw(st.integers(0, 2))
    axes = tuple(draw(st.permutations(names + [None] * n_none)))
    return rules, axes


# -- 1. exact parity with flax linen --------------------------------------------------


@settings(max_examples=examples(300, 60), deadline=None)
@given(tables_and_axes(), st.permutations(MESH_POOL))
def test_matches_linen_when_every_rule_fits_the_mesh(table_and_axes, mesh_names):
    rules, axes = table_and_axes
    ours = meshinit.logical_to_mesh_axes(axes, normalize_rules(rules), tuple(mesh_names))
    theirs = nn.logical_to_mesh_axes(axes, rules)
    assert P(*ours) == theirs
    assert len(ours) == len(axes)
    assert tuple(map(_canon, ours)) == tuple(map(_canon, theirs))
    # Without a mesh the answer is the same (no rule is skipped).
    assert meshinit.logical_to_mesh_axes(axes, normalize_rules(rules)) == ours


@settings(max_examples=examples(300, 60), deadline=None)
@given(
    tables_and_axes(),
    st.lists(st.sampled_from(MESH_POOL), unique=True, max_size=len(MESH_POOL)).map(tuple),
)
def test_on_a_smaller_mesh_matches_linen_without_the_rules_that_do_not_fit(
    table_and_axes, mesh_names
):
    rules, axes = table_and_axes
    fitting = tuple(
        (n, t)
        for n, t in rules
        if t is None or all(a in mesh_names for a in (t if isinstance(t, tuple) else (t,)))
    )
    ours = meshinit.logical_to_mesh_axes(axes, normalize_rules(rules), mesh_names)
    assert P(*ours) == nn.logical_to_mesh_axes(axes, fitting)
    used = [a for e in ours if e is not None for a in (e if isinstance(e, tuple) else (e,))]
    assert set(used) <= set(mesh_names), f"{ours} uses an axis outside the mesh {mesh_names}"
    assert len(used) == len(set(used)), f"{ours} uses a mesh axis twice"


# -- 2. the worked example: rules apply in order and skip used axes ---------------------


def test_worked_example_rules_apply_in_order_and_skip_used_axes():
    rules = (("mlp", "tensor"), ("embed", "tensor"), ("embed", "fsdp"))
    spec = meshinit.param((8, 16), zeros, axes=("embed", "mlp"), mesh=FSDP_TENSOR, rules=rules)
    plan = meshinit.plan(spec)
    assert plan.entries[0].sharding.spec == P("fsdp", "tensor")
    assert plan.entries[0].shard_shape == (4, 4)
    assert nn.logical_to_mesh_axes(("embed", "mlp"), rules) == P("fsdp", "tensor")


# -- 3. a MaxText-style table, as given in a config (lists, not tuples) ----------------

MAXTEXT_MESH_AXES = (
    "data",
    "stage",
    "fsdp",
    "fsdp_transpose",
    "sequence",
    "tensor",
    "expert",
    "autoregressive",
)
MAXTEXT_MESH = AbstractMesh((1, 1, 2, 1, 1, 4, 1, 1), MAXTEXT_MESH_AXES)
MAXTEXT_RULES = [
    ["activation_batch", ["data", "fsdp", "fsdp_transpose", "expert"]],
    ["activation_heads", ["tensor", "sequence"]],
    ["activation_length", "sequence"],
    ["activation_embed", "tensor"],
    ["activation_mlp", "tensor"],
    ["activation_vocab", ["tensor", "sequence"]],
    ["activation_vocab", "tensor"],
    ["activation_vocab", "sequence"],
    ["mlp", ["fsdp_transpose", "tensor", "autoregressive"]],
    ["vocab", ["tensor", "autoregressive"]],
    ["embed", ["fsdp", "fsdp_transpose", "sequence", "expert"]],
    ["embed", ["fsdp", "sequence", "expert"]],
    ["embed", ["fsdp", "sequence"]],
    ["embed", "fsdp"],
    ["heads", ["tensor", "autoregressive"]],
    ["kv_heads", ["tensor", "autoregressive"]],
    ["kv_head_dim", []],
    ["kv", None],
    ["layers", "stage"],
    ["exp", "expert"],
    ["norm", None],
]


@pytest.mark.parametrize(
    ("axes", "expected"),
    [
        # "mlp" is ruled first and takes fsdp_transpose, so "embed" falls to its 2nd rule.
        (
            ("embed", "mlp"),
            P(("fsdp", "sequence", "expert"), ("fsdp_transpose", "tensor", "autoregressive")),
        ),
        (
            ("mlp", "embed"),
            P(("fsdp_transpose", "tensor", "autoregressive"), ("fsdp", "sequence", "expert")),
        ),
        (
            ("vocab", "embed"),
            P(("tensor", "autoregressive"), ("fsdp", "fsdp_transpose", "sequence", "expert")),
        ),
        (
            ("layers", "embed", "heads", "kv"),
            P(
                "stage",
                ("fsdp", "fsdp_transpose", "sequence", "expert"),
                ("tensor", "autoregressive"),
                None,
            ),
        ),
        (
            ("embed", "kv_heads", "kv_head_dim"),
            P(("fsdp", "fsdp_transpose", "sequence", "expert"), ("tensor", "autoregressive"), None),
        ),
        # "embed" is ruled before "exp" and takes expert: "exp" is replicated.
        (
            ("exp", "embed", "mlp"),
            P(None, ("fsdp", "sequence", "expert"), ("fsdp_transpose", "tensor", "autoregressive")),
        ),
        (("norm",), P(None)),
        (
            ("activation_batch", "activation_length", "activation_embed"),
            P(("data", "fsdp", "fsdp_transpose", "expert"), "sequence", "tensor"),
        ),
        (
            ("activation_batch", "activation_heads", "activation_vocab"),
            P(("data", "fsdp", "fsdp_transpose", "expert"), ("tensor", "sequence"), None),
        ),
        (
            ("layers", None, "embed"),
            P("stage", None, ("fsdp", "fsdp_transpose", "sequence", "expert")),
        ),
    ],
)
def test_maxtext_table_resolves_as_linen_does(axes, expected):
    ours = meshinit.logical_to_mesh_axes(axes, normalize_rules(MAXTEXT_RULES), MAXTEXT_MESH_AXES)
    theirs = _linen(axes, MAXTEXT_RULES)
    assert theirs == expected
    assert P(*ours) == theirs
    assert tuple(map(_canon, ours)) == tuple(map(_canon, theirs))

    shape = tuple(8 * (i + 1) for i in range(len(axes)))
    spec = meshinit.param(shape, zeros, axes=axes, mesh=MAXTEXT_MESH, rules=MAXTEXT_RULES)
    assert meshinit.plan(spec).entries[0].sharding.spec == expected


# -- 4. departure 1: a rule naming an axis outside the mesh is skipped ----------------

SHARED_RULES = (
    ("embed", ("data", "fsdp")),
    ("embed", "fsdp"),
    ("mlp", "expert"),
    ("mlp", "tensor"),
    ("heads", "expert"),
)
DATA_FSDP_EXPERT = AbstractMesh((2, 2, 2), ("data", "fsdp", "expert"))


@pytest.mark.parametrize(
    ("axes", "on_fsdp_tensor", "on_data_fsdp_expert"),
    [
        # Falls through to the next rule for the name.
        (("embed", "mlp"), P("fsdp", "tensor"), P(("data", "fsdp"), "expert")),
        # No later rule for "heads": replicated.
        (("heads", "embed"), P(None, "fsdp"), P("expert", ("data", "fsdp"))),
        # ("mlp", "expert") comes first and takes expert, so "heads" is replicated.
        (("heads", "mlp"), P(None, "tensor"), P(None, "expert")),
    ],
)
def test_one_table_serves_two_meshes(axes, on_fsdp_tensor, on_data_fsdp_expert):
    tree = {
        "a": meshinit.param((8, 8), zeros, axes=axes, mesh=FSDP_TENSOR, rules=SHARED_RULES),
        "b": meshinit.param((8, 8), zeros, axes=axes, mesh=DATA_FSDP_EXPERT, rules=SHARED_RULES),
    }
    plan = meshinit.plan(tree)
    specs = {e.path: e.sharding.spec for e in plan.entries}
    assert specs == {"a": on_fsdp_tensor, "b": on_data_fsdp_expert}
    assert [g.mesh for g in plan.groups] == [FSDP_TENSOR, DATA_FSDP_EXPERT]


def test_linen_would_use_a_rule_outside_the_mesh():
    # The departure is real: linen picks the first rule regardless of the mesh.
    assert nn.logical_to_mesh_axes(("embed", "mlp"), SHARED_RULES) == P(("data", "fsdp"), "expert")
    assert meshinit.logical_to_mesh_axes(("embed", "mlp"), SHARED_RULES, ("fsdp", "tensor")) == (
        "fsdp",
        "tensor",
    )


# -- 5. departure 2: a logical name with no rule is an error ---------------------------


def test_unknown_logical_name_names_it_and_suggests_a_replicate_rule():
    rules = (("embed", "fsdp"), ("mlp", "tensor"))
    spec = meshinit.param((8, 16), zeros, axes=("embed", "mlpp"), mesh=FSDP_TENSOR, rules=rules)
    with pytest.raises(meshinit.PlanError, match=r"logical axis 'mlpp' has no rule") as exc:
        meshinit.plan({"layers": [{"mlp": {"up": spec}}]})
    [problem] = exc.value.problems
    assert problem.path == "layers.0.mlp.up"
    assert "known: embed, mlp" in problem.message
    assert "add ('mlpp', None) to the rules" in problem.message
    assert str(problem) == f"layers.0.mlp.up: {problem.message}"
    assert isinstance(exc.value, ValueError)
    # linen would silently replicate the dimension.
    assert nn.logical_to_mesh_axes(("embed", "mlpp"), rules) == P("fsdp", None)


@pytest.mark.parametrize(
    "axes, rules, want",
    [
        # a typo of a logical name: the fix of the name first, the replicate rule second
        (("embed", "mlpp"), (("embed", "fsdp"), ("mlp", "tensor")),
         r"logical axis 'mlpp' has no rule; did you mean 'mlp'\? \(known: embed, mlp\); "
         r"fix the name, or add \('mlpp', None\) to the rules to replicate it$"),
        # two neighbours swapped: one edit, guessed as any typo (difflib's 0.67 was not)
        (("embed", "mpl"), (("embed", "fsdp"), ("mlp", "tensor")),
         r"logical axis 'mpl' has no rule; did you mean 'mlp'\? \(known: embed, mlp\); "
         r"fix the name, or add \('mpl', None\) to the rules to replicate it$"),
        (("MLP", "embed"), (("embed", "fsdp"), ("mlp", "tensor")),
         r"logical axis 'MLP' has no rule; did you mean 'mlp'\? "),
        # a name like none of the known ones: no guess, the replicate rule
        (("embed", "ffw"), (("embed", "fsdp"), ("mlp", "tensor")),
         r"logical axis 'ffw' has no rule; known: embed, mlp; add \('ffw', None\) to the "
         r"rules to replicate it$"),
        # a typo of a mesh axis, without rules
        ((None, "tensr"), None,
         r"mesh axis name\(s\) 'tensr' not in the mesh \(axes: fsdp, tensor\); did you mean "
         r"'tensor'\? otherwise use a mesh axis, or pass rules to map logical names$"),
        # several missing, one a typo: the guess names the name it is for
        (("embed", "tensr"), None,
         r"mesh axis name\(s\) 'embed', 'tensr' not in the mesh \(axes: fsdp, tensor\); did "
         r"you mean 'tensor' for 'tensr'\? otherwise use a mesh axis"),
        (("embed", "mlp"), None,
         r"mesh axis name\(s\) 'embed', 'mlp' not in the mesh \(axes: fsdp, tensor\); use a "
         r"mesh axis, or pass rules to map logical names$"),
    ],
)  # fmt: skip
def test_a_typo_gets_a_guess_before_any_other_fix(axes, rules, want):
    spec = meshinit.param((8, 16), zeros, axes=axes, mesh=FSDP_TENSOR, rules=rules)
    with pytest.raises(meshinit.PlanError, match=r"\n  w: " + want) as exc:
        meshinit.plan({"w": spec})
    assert re.search(want, exc.value.problems[0].message)


def test_a_rule_naming_a_typo_of_a_mesh_axis_guesses_it_before_dropping_the_rule():
    # dropping the rule would replicate what it shards: the likely name comes first
    rules = (("embed", "fsdp"), ("mlp", "tensr"))
    spec = meshinit.param((8, 16), zeros, axes=("embed", "mlp"), mesh=FSDP_TENSOR, rules=rules)
    with pytest.raises(
        meshinit.PlanError,
        match=r"w: rule \('mlp', 'tensr'\) names mesh axis 'tensr', which is in none of the "
        r"plan's meshes \(axes: fsdp, tensor\); .* instead: did you mean 'tensor'\? otherwise add "
        r"the axis to the mesh, or drop the rule$",
    ):
        meshinit.plan({"w": spec})


def test_following_the_suggestion_fixes_the_unknown_name():
    rules = (("embed", "fsdp"), ("mlp", "tensor"), ("mlpp", None))
    spec = meshinit.param((8, 16), zeros, axes=("embed", "mlpp"), mesh=FSDP_TENSOR, rules=rules)
    plan = meshinit.plan({"layers": [{"mlp": {"up": spec}}]})
    assert plan.entries[0].path == "layers.0.mlp.up"
    assert plan.entries[0].sharding.spec == P("fsdp", None)


def test_every_unknown_name_is_reported_once():
    rules = (("embed", "fsdp"),)
    spec = meshinit.param(
        (8, 16, 4), zeros, axes=("heads", "embed", "kv"), mesh=FSDP_TENSOR, rules=rules
    )
    with pytest.raises(meshinit.PlanError, match=r"'heads' has no rule") as exc:
        meshinit.plan({"attn": spec})
    messages = [p.message for p in exc.value.problems]
    assert [p.path for p in exc.value.problems] == ["attn", "attn"]
    assert "logical axis 'heads' has no rule" in messages[0]
    assert "logical axis 'kv' has no rule" in messages[1]


# -- 6. departure 3: the same name twice is an error ----------------------------------


@pytest.mark.parametrize(
    ("axes", "rules"),
    [
        (("embed", "embed"), (("embed", "fsdp"),)),
        (("fsdp", "fsdp"), meshinit.MESH_AXES),
    ],
)
def test_a_name_twice_in_axes_is_an_error(axes, rules):
    spec = meshinit.param((8, 8), zeros, axes=axes, mesh=FSDP_TENSOR, rules=rules)
    with pytest.raises(meshinit.PlanError, match=rf"'{axes[0]}' appear more than once") as exc:
        meshinit.plan({"w": spec})
    assert [p.path for p in exc.value.problems] == ["w"]
    assert "a mesh axis can shard only one dimension" in exc.value.problems[0].message


# -- 7. MESH_AXES, rules=None and nested defaults -------------------------------------

RULES_A = (("embed", "fsdp"), ("mlp", "tensor"))
RULES_B = (("embed", "tensor"), ("mlp", "fsdp"))


def test_mesh_axes_switches_rules_off_inside_a_rules_context():
    with meshinit.defaults(mesh=FSDP_TENSOR, rules=RULES_A):
        logical = meshinit.param((8, 16), zeros, axes=("embed", "mlp"))
        direct = meshinit.param((16, 8), zeros, axes=("tensor", "fsdp"), rules=meshinit.MESH_AXES)
        with meshinit.defaults(rules=meshinit.MESH_AXES):
            inner = meshinit.param((8, 16), zeros, axes=(None, ("fsdp", "tensor")))
    assert logical.rules == RULES_A
    assert direct.rules is None and inner.rules is None
    plan = meshinit.plan({"logical": logical, "direct": direct, "inner": inner})
    specs = {e.path: e.sharding.spec for e in plan.entries}
    assert specs == {
        "logical": P("fsdp", "tensor"),
        "direct": P("tensor", "fsdp"),
        "inner": P(None, ("fsdp", "tensor")),
    }


def test_without_mesh_axes_mesh_names_are_read_as_logical_names():
    with meshinit.defaults(mesh=FSDP_TENSOR, rules=RULES_A):
        spec = meshinit.param((16, 8), zeros, axes=("tensor", "fsdp"))
    with pytest.raises(meshinit.PlanError, match=r"logical axis 'tensor' has no rule"):
        meshinit.plan({"w": spec})


def test_param_rules_none_takes_the_defaults_rules_at_call_time():
    with meshinit.defaults(mesh=FSDP_TENSOR, rules=RULES_A):
        spec = meshinit.param((8, 16), zeros, axes=("embed", "mlp"), rules=None)
    # Planned outside the context: the rules were captured when param() ran.
    assert spec.rules == RULES_A
    assert meshinit.plan(spec).entries[0].sharding.spec == P("fsdp", "tensor")
    # Outside any context, the same axes are read as mesh axis names.
    bare = meshinit.param((8, 16), zeros, axes=("embed", "mlp"), mesh=FSDP_TENSOR)
    assert bare.rules is None
    with pytest.raises(meshinit.PlanError, match=r"mesh axis name\(s\) 'embed', 'mlp' not in"):
        meshinit.plan(bare)


def test_nested_defaults_override_only_what_they_set():
    other = AbstractMesh((4, 2), ("fsdp", "tensor"))
    with meshinit.defaults(mesh=FSDP_TENSOR, rules=RULES_A, dtype=jnp.bfloat16):
        with meshinit.defaults(rules=RULES_B):
            b = meshinit.param((8, 16), zeros, axes=("embed", "mlp"))
        with meshinit.defaults(mesh=other):
            m = meshinit.param((8, 16), zeros, axes=("embed", "mlp"))
        after = meshinit.param((8, 16), zeros, axes=("embed", "mlp"))
    assert (b.mesh, b.rules, b.dtype) == (FSDP_TENSOR, RULES_B, np.dtype(jnp.bfloat16))
    assert (m.mesh, m.rules, m.dtype) == (other, RULES_A, np.dtype(jnp.bfloat16))
    assert (after.mesh, after.rules, after.dtype) == (FSDP_TENSOR, RULES_A, np.dtype(jnp.bfloat16))
    plan = meshinit.plan({"b": b, "m": m, "after": after})
    specs = {e.path: (e.sharding.spec, e.shard_shape) for e in plan.entries}
    assert specs == {
        "b": (P("tensor", "fsdp"), (2, 8)),
        "m": (P("fsdp", "tensor"), (2, 8)),
        "after": (P("fsdp", "tensor"), (4, 4)),
    }


# -- 8. normalize_rules ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("rules", "pattern"),
    [
        ("embed", r"rules must be a sequence of \(logical_name, mesh_axes\) pairs"),
        (42, r"rules must be a sequence of \(logical_name, mesh_axes\) pairs"),
        ({"embed": "fsdp"}, r"rules must be a sequence of \(logical_name, mesh_axes\) pairs"),
        (["embed"], r"bad rule 'embed'"),
        ([("embed",)], r"bad rule \('embed',\)"),
        ([("embed", "fsdp", "tensor")], r"bad rule \('embed', 'fsdp', 'tensor'\)"),
        ([(1, "fsdp")], r"bad rule \(1, 'fsdp'\)"),
        ([(None, "fsdp")], r"bad rule \(None, 'fsdp'\)"),
        ([("embed", 3)], r"bad rule \('embed', 3\)"),
        ([("embed", {"fsdp"})], r"bad rule \('embed', \{'fsdp'\}\)"),
        ([("embed", ("fsdp", 3))], r"bad rule \('embed', \('fsdp', 3\)\)"),
        ([("embed", ("fsdp", "fsdp"))], r"a tuple of distinct names"),
        ([("mlp", "tensor"), ["embed", ["fsdp", "fsdp"]]], r"bad rule \['embed'"),
    ],
)
def test_normalize_rules_rejects_malformed_tables(rules, pattern):
    with pytest.raises(TypeError, match=pattern):
        normalize_rules(rules)


def test_malformed_rules_fail_at_param_and_defaults():
    with pytest.raises(TypeError, match=r"bad rule \('embed', 3\)"):
        meshinit.param((8,), zeros, axes=("embed",), mesh=FSDP_TENSOR, rules=[("embed", 3)])
    with pytest.raises(TypeError, match=r"bad rule \('embed', 3\)"):
        with meshinit.defaults(rules=[("embed", 3)]):
            pass


def test_normalize_rules_turns_lists_into_tuples():
    rules = [["embed", ["fsdp", "tensor"]], ["mlp", "tensor"], ["norm", None], ("kv", [])]
    out = normalize_rules(rules)
    assert out == (("embed", ("fsdp", "tensor")), ("mlp", "tensor"), ("norm", None), ("kv", ()))
    assert type(out) is tuple and all(type(r) is tuple for r in out)
    assert type(out[0][1]) is tuple
    hash(out)  # usable as a cache key
    assert normalize_rules(out) == out
    assert normalize_rules([]) == ()
    spec = meshinit.param((8, 16), zeros, axes=("embed", "mlp"), mesh=FSDP_TENSOR, rules=rules)
    assert spec.rules == out


# -- 9. every problem in a tree, gathered into one error ------------------------------


def test_all_problems_are_gathered_with_their_paths():
    def p(shape, axes, **kw):
        return meshinit.param(shape, zeros, axes=axes, **kw)

    with meshinit.defaults(rules=RULES_A):
        logical = {
            "ok": p((8, 16), ("embed", "mlp"), mesh=FSDP_TENSOR),
            "unknown": p((8, 16), ("embed", "mlpp"), mesh=FSDP_TENSOR),
            "rank": p((8, 16), ("embed",), mesh=FSDP_TENSOR),
            "indivisible": p((8, 10), ("embed", "mlp"), mesh=FSDP_TENSOR),
        }
    direct = [
        p((8, 16), (("fsdp", "tensor"), "tensor"), mesh=FSDP_TENSOR),
        p((8, 16), ("fsdp", "model"), mesh=FSDP_TENSOR),
        p((8, 16), ("fsdp", "tensor")),
        p((8, 16), ("fsdp", "tensor"), mesh=FSDP_TENSOR),
    ]
    with pytest.raises(meshinit.PlanError, match=r"^6 problems found while planning:") as exc:
        meshinit.plan({"logical": logical, "direct": direct})

    expected = {
        "direct.0": r"mesh axis 'tensor' used by more than one dimension",
        "direct.1": r"mesh axis name\(s\) 'model' not in the mesh \(axes: fsdp, tensor\)",
        "direct.2": r"no mesh given and no default",
        "logical.indivisible": (
            r"dimension 1 \(logical 'mlp'\) of size 10 is not divisible by mesh axes "
            r"'tensor' of size 4"
        ),
        "logical.rank": r"axes \('embed',\) have 1 entries but shape \(8, 16\) has 2 dimensions",
        "logical.unknown": r"logical axis 'mlpp' has no rule",
    }
    problems = exc.value.problems
    assert sorted(p.path for p in problems) == sorted(expected)
    for problem in problems:
        assert re.search(expected[problem.path], problem.message), str(problem)
        assert f"  {problem}" in str(exc.value)


# -- partition() directly: entries and problems ----------------------------------------


@pytest.mark.parametrize(
    ("shape", "axes", "rules", "entries"),
    [
        ((8, 16), None, RULES_A, (None, None)),
        ((8, 16), ("embed", "mlp"), RULES_A, ("fsdp", "tensor")),
        ((8, 16), (None, "embed"), RULES_A, (None, "fsdp")),
        ((8, 16), (("fsdp", "tensor"), None), None, (("fsdp", "tensor"), None)),
        ((0, 16), ("embed", "mlp"), RULES_A, ("fsdp", "tensor")),
    ],
)
def test_partition_returns_full_length_entries(shape, axes, rules, entries):
    assert partition(shape, axes, rules, {"fsdp": 2, "tensor": 4}) == (entries, [])


def test_partition_rejects_a_tuple_entry_with_rules():
    entries, problems = partition(
        (8, 16), (("embed", "mlp"), None), RULES_A, {"fsdp": 2, "tensor": 4}
    )
    assert entries == ()
    assert len(problems) == 1
    assert "is a tuple, but with rules each entry is one logical name" in problems[0]


def test_noted_rules_keep_their_notes_through_a_spec_and_resolve_as_the_plain_table():
    # meshinit.maxtext.rules' table: the notes travel with the checked table onto the
    # spec (lists become tuples), and placement is the plain table's
    mesh = AbstractMesh((2, 4), ("fsdp", "tensor"))
    noted = NotedRules([["embed", ["fsdp"]], ["o_groups", None]], {"o_groups": "replicated: why"})
    init = jax.nn.initializers.zeros
    spec = meshinit.param((8, 4), init, axes=("embed", "o_groups"), mesh=mesh, rules=noted)
    assert spec.rules == (("embed", ("fsdp",)), ("o_groups", None))
    assert isinstance(spec.rules, NotedRules) and spec.rules.notes == {
        "o_groups": "replicated: why"
    }
    plain = meshinit.param((8, 4), init, axes=("embed", "o_groups"), mesh=mesh, rules=tuple(noted))
    planned = meshinit.plan({"a": spec, "b": plain})
    assert planned.entries[0].sharding == planned.entries[1].sharding
    assert "logical axis 'o_groups' replicated: why (1 param)" in planned.summary()


def test_a_table_marked_as_linen_keeps_the_mark_through_a_spec_and_resolves_as_linen():
    # meshinit.maxtext.rules' mark: nnx Variables' names resolve as flax linen resolves
    # them (MaxText's NNX init); the core resolves every table so already
    mesh = AbstractMesh((2, 4), ("fsdp", "tensor"))
    table = [["mlp", "tensor"], ["embed", ["fsdp", "tensor"]], ["embed", "fsdp"]]
    marked = NotedRules(table, {}, as_linen=True)
    assert resolves_as_linen(normalize_rules(marked))
    assert not resolves_as_linen(normalize_rules(NotedRules(table)))
    assert not resolves_as_linen(normalize_rules(tuple(marked)))
    spec = meshinit.param((8, 4), jax.nn.initializers.zeros, axes=("mlp", "embed"), mesh=mesh,
                          rules=marked)  # fmt: skip
    assert resolves_as_linen(spec.rules)
    planned = meshinit.plan({"w": spec})
    # 'mlp' is ruled first and takes tensor: embed's first rule is skipped, its second fits
    want = P(*_linen(("mlp", "embed"), tuple(map(tuple, table))))
    assert want == P("tensor", "fsdp")
    assert planned.entries[0].sharding.spec == want
