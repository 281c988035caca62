"""A framework's layout code followed without data (``meshinit._load.traced``): every
chain of transposes and reshapes that a ``Tensor`` can read gives the same values as
numpy's chain, stacks and concatenations traced by jax become ``Stack``/``Concat``,
and whatever no target expresses is named, never guessed."""

import math

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshinit._load import traced
from meshinit.safetensors import Concat, Stack, Tensor


def read(target, stored):
    """``target`` evaluated with numpy on ``stored`` (name -> array), as the loader
    reads it: slice, reshape, transpose, then merge."""
    if isinstance(target, Stack):
        return np.stack([read(p, stored) for p in target.parts], target.axis)
    if isinstance(target, Concat):
        return np.concatenate([read(p, stored) for p in target.parts], target.axis)
    x = stored[target.name]
    shape, order = target.transformed(x.shape)
    x = x.reshape(shape).transpose(order)
    return x if target.out_shape is None else x.reshape(target.out_shape)


def factorizations(n, most=4):
    """Every way to write ``n`` as an ordered product of at most ``most`` factors > 1."""
    if n == 1:
        return [()]
    out = []
    for d in range(2, n + 1):
        if n % d == 0:
            out += [(d, *rest) for rest in factorizations(n // d, most - 1) if most > 1]
    return out


@st.composite
def chains(draw):
    stored = tuple(draw(st.lists(st.sampled_from([1, 2, 3, 4, 6]), min_size=1, max_size=3)))
    ops, shape = [], stored
    for _ in range(draw(st.integers(0, 4))):
        if draw(st.booleans()):
            order = tuple(draw(st.permutations(range(len(shape)))))
            ops.append(("transpose", order))
            shape = tuple(shape[a] for a in order)
        else:
            options = factorizations(math.prod(shape)) or [()]
            new = draw(st.sampled_from(options))
            if draw(st.booleans()):  # a unit axis somewhere
                at = draw(st.integers(0, len(new)))
                new = new[:at] + (1,) + new[at:]
            ops.append(("reshape", new))
            shape = new
    return stored, ops


@settings(max_examples=400, deadline=None)
@given(chains())
def test_a_chain_of_transposes_and_reshapes_reads_the_values_numpy_computes(chain):
    stored, ops = chain
    x = np.arange(math.prod(stored)).reshape(stored)
    node, want = traced.stored("w", stored), x
    for op, arg in ops:
        if op == "transpose":
            node, want = traced.permuted(node, arg), want.transpose(arg)
        else:
            node, want = traced.reshaped(node, arg), want.reshape(arg)
    target = traced.target(node)
    if isinstance(target, str):  # only a reshape that cuts a factor unevenly
        assert "unevenly" in target and "no slice-free reshape" in target, target
        return
    got = read(target, {"w": x})
    assert got.shape == want.shape and np.array_equal(got, want), (target, ops)


def test_the_simplest_form_is_given():
    q = traced.stored("q", (128, 64))  # tunix: transpose (1, 0), reshape (64, 8, 16)
    node = traced.reshaped(traced.permuted(q, (1, 0)), (64, 8, 16))
    assert traced.target(node) == Tensor("q", shape=(8, 16, 64), permute=(2, 0, 1))
    assert traced.target(traced.permuted(q, (1, 0))) == Tensor("q", permute=(1, 0))
    assert traced.target(q) == Tensor("q")
    merged = traced.reshaped(traced.permuted(traced.reshaped(q, (2, 64, 64)), (1, 0, 2)), (64, -1))
    assert traced.target(merged) == Tensor(
        "q", shape=(2, 64, 64), permute=(1, 0, 2), out_shape=(64, 128)
    )


def test_a_reshape_that_cuts_an_axis_unevenly_is_named():
    node = traced.reshaped(traced.permuted(traced.stored("w", (4, 3)), (1, 0)), (2, 6))
    why = traced.target(node)
    assert isinstance(why, str)
    assert "w: the reshape to (2, 6) cuts an axis of size 3 unevenly" in why
    assert "after transpose (1, 0), reshape (2, 6)" in why


@pytest.mark.parametrize(
    "op, said",
    [
        (lambda n: traced.permuted(n, (0, 0)), "are not an order of its 2 axes"),
        (lambda n: traced.reshaped(n, (5, -1)), "cannot reshape (4, 3) to (5, -1)"),
        (lambda n: traced.reshaped(n, (-1, -1)), "cannot reshape"),
    ],
)
def test_a_step_numpy_refuses_is_a_value_error(op, said):
    with pytest.raises(ValueError, match=said.replace("(", r"\(").replace(")", r"\)")):
        op(traced.stored("w", (4, 3)))


def _inputs(shapes):
    nodes = {k: traced.stored(f"file.{k}", s) for k, s in shapes.items()}
    dtypes = {k: np.float32 for k in shapes}
    rng = np.random.default_rng(0)
    arrays = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    stored = {f"file.{k}": a for k, a in arrays.items()}
    return nodes, dtypes, arrays, stored


def test_stacks_concatenations_and_transposes_traced_by_jax_read_the_same_values():
    n = 20  # jax concatenates at most 16 operands at a time: one stack all the same
    shapes = {f"e{i}": (4, 6) for i in range(n)} | {"q": (4, 2, 3), "k": (4, 2, 3), "b": (6,)}

    def fn(t):
        return {
            "experts": jnp.stack([t[f"e{i}"].T for i in range(n)], 0),
            "fused": jnp.stack([jnp.transpose(t["q"], (1, 0, 2)), t["k"].transpose(1, 0, 2)]),
            "joined": jnp.concatenate([t["e0"], t["e1"].astype(jnp.float32)], axis=1),
            "unit": jnp.expand_dims(t["b"], 0),
            "b": t["b"],
        }

    nodes, dtypes, arrays, stored = _inputs(shapes)
    found = traced.trace(fn, nodes, dtypes)
    want = fn({k: jnp.asarray(a) for k, a in arrays.items()})
    assert sorted(found) == sorted(want)
    targets = {k: traced.target(v) for k, v in found.items()}
    for k, t in targets.items():
        assert not isinstance(t, str), (k, t)
        assert np.array_equal(read(t, stored), np.asarray(want[k])), k
    assert targets["experts"] == Stack(
        [Tensor(f"file.e{i}", permute=(1, 0)) for i in range(n)], axis=0
    )
    assert targets["fused"] == Stack([Tensor(f"file.{s}", permute=(1, 0, 2)) for s in "qk"], axis=0)
    assert targets["joined"] == Concat([Tensor("file.e0"), Tensor("file.e1")], axis=1)
    assert targets["b"] == Tensor("file.b")
    assert traced.tensors(found["fused"]) == ["file.q", "file.k"]


@pytest.mark.parametrize(
    "fn, said",
    [
        (lambda t: {"x": t["a"] * 2}, "the operation mul"),
        (lambda t: {"x": t["a"].astype(jnp.bfloat16)}, "from float32 to bfloat16 (rounds)"),
        (lambda t: {"x": jnp.broadcast_to(t["a"], (2, 4, 6))}, "values repeated"),
        (lambda t: {"x": jnp.concatenate([t["a"], jnp.zeros((4, 1))], 1)}, "not a stored tensor"),
        (lambda t: {"x": jnp.stack([t["a"], t["a"]]).reshape(8, 6)}, "a reshape of stacked parts"),
    ],
)
def test_what_no_target_expresses_is_named(fn, said):
    nodes, dtypes, _, _ = _inputs({"a": (4, 6)})
    why = traced.target(traced.trace(fn, nodes, dtypes)["x"])
    assert isinstance(why, str) and said in why, why


def test_code_that_returns_no_dict_of_arrays_is_a_type_error():
    nodes, dtypes, _, _ = _inputs({"a": (4, 6)})
    with pytest.raises(TypeError, match="not a dict of arrays"):
        traced.trace(lambda t: [t["a"]], nodes, dtypes)
