"""A framework's layout code followed without data, on the one normal form of
``meshinit._checkpoint.maps.trace`` (``Sym``, ``views.View``), by both front-ends: numpy-like
calls on a stand-in, and jax code traced on abstract values (``meshinit._checkpoint.maps.traced``).
Every chain of slices, transposes and reshapes that a ``Tensor`` can read gives the
same values as numpy's chain, as a view the loader accepts; stacks and concatenations
become ``Stack``/``Concat``; whatever no target expresses is named, never guessed."""

import math

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from meshinit._checkpoint.layout.reshape import merges
from meshinit._checkpoint.maps import hooks, trace, traced
from meshinit.safetensors import Concat, Fill, Pad, Stack, Tensor


def read(target, stored):
    """``target`` evaluated with numpy on ``stored`` (name -> array), as the loader
    reads it: slice, reshape (a view: no copy), transpose, then merge (side-by-side
    axes only); a join's ``out_shape`` (a merge too) and ``permute`` after it."""
    if isinstance(target, Fill):
        return np.full(target.shape, target.value, np.float64)
    if isinstance(target, Pad):
        part = read(target.part, stored)
        return np.pad(part, [(0, s - n) for s, n in zip(target.shape, part.shape, strict=True)])
    if isinstance(target, Stack | Concat):
        join = np.stack if isinstance(target, Stack) else np.concatenate
        x = join([read(p, stored) for p in target.parts], target.axis)
    else:
        x = stored[target.name][target.sliced(stored[target.name].shape)]
        shape, order = target.transformed(x.shape)
        x = np.reshape(x, shape, copy=False).transpose(order)  # ValueError if it copies
    if target.out_shape is not None:
        assert merges(x.shape, target.out_shape) is not None, (x.shape, target)
        x = x.reshape(target.out_shape)
    joined = isinstance(target, Stack | Concat) and target.permute is not None
    return x.transpose(target.permute) if joined else x


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
def chains(draw, slices=True, most=4):
    """A stored shape and up to ``most`` steps on it: transposes, reshapes (a unit axis
    at times) and, with ``slices``, basic slices of one axis (a positive step)."""
    stored = tuple(draw(st.lists(st.sampled_from([1, 2, 3, 4, 6]), min_size=1, max_size=3)))
    ops, shape = [], stored
    for _ in range(draw(st.integers(0, most))):
        kind = draw(st.sampled_from(["transpose", "reshape", "slice"] if slices else ["t", "r"]))
        if kind[0] == "t":
            order = tuple(draw(st.permutations(range(len(shape)))))
            ops.append(("transpose", order))
            shape = tuple(shape[a] for a in order)
        elif kind[0] == "r":
            options = factorizations(math.prod(shape)) or [()]
            new = draw(st.sampled_from(options))
            if draw(st.booleans()):  # a unit axis somewhere
                at = draw(st.integers(0, len(new)))
                new = new[:at] + (1,) + new[at:]
            ops.append(("reshape", new))
            shape = new
        elif shape:
            a = draw(st.integers(0, len(shape) - 1))
            start = draw(st.integers(0, max(shape[a] - 1, 0)))
            stop = draw(st.integers(start + 1, max(shape[a], start + 1)))
            key = (slice(None),) * a + (slice(start, stop, draw(st.integers(1, 2))),)
            ops.append(("slice", key))
            shape = np.empty(shape)[key].shape
    return stored, ops


def followed(sym, want, ops):
    """``ops`` on a stand-in and on numpy's array alike."""
    for op, arg in ops:
        if op == "transpose":
            sym, want = sym.transpose(arg), want.transpose(arg)
        elif op == "reshape":
            sym, want = sym.reshape(arg), want.reshape(arg)
        else:
            sym, want = sym[arg], want[arg]
    return sym, want


REFUSALS = ("unevenly", "a slice of an axis that a reshape split or merged")


@settings(max_examples=examples(500, 100), deadline=None)
@given(chains())
def test_a_chain_of_slices_transposes_and_reshapes_reads_the_values_numpy_computes(chain):
    stored, ops = chain
    x = np.arange(math.prod(stored)).reshape(stored)
    try:
        sym, want = followed(trace.stand_in("w", stored, np.float32), x, ops)
        target = trace.target(sym)
    except trace.Inexpressible as e:  # only an uneven cut, or a slice of a cut axis
        assert any(r in str(e) for r in REFUSALS), (str(e), ops)
        return
    got = read(target, {"w": x})
    assert got.shape == want.shape and np.array_equal(got, want), (target, ops)


@settings(max_examples=examples(150, 30), deadline=None)
@given(chains(slices=False))
def test_jax_code_traced_gives_the_target_of_the_same_steps_on_a_stand_in(chain):
    stored, ops = chain
    x = np.arange(math.prod(stored), dtype=np.float32).reshape(stored)

    def fn(t):
        y = t["w"]
        for op, arg in ops:
            y = jnp.transpose(y, arg) if op == "transpose" else jnp.reshape(y, arg)
        return {"y": y}

    found = traced.trace(fn, {"w": trace.stand_in("w", stored, np.float32)}, {"w": np.float32})
    try:
        direct = trace.target(followed(trace.stand_in("w", stored, np.float32), x, ops)[0])
    except trace.Inexpressible as e:
        with pytest.raises(trace.Inexpressible, match="unevenly"):
            trace.target(found["y"])
        assert "unevenly" in str(e)
        return
    assert trace.target(found["y"]) == direct
    assert np.array_equal(read(direct, {"w": x}), np.asarray(fn({"w": jnp.asarray(x)})["y"]))


@st.composite
def joins(draw):
    """Parts made by one chain from equal stored tensors, joined, then transposed
    and merged at times."""
    stored, ops = draw(chains(slices=False, most=3))
    n = draw(st.integers(1, 4))
    shape = np.empty(stored)
    for op, arg in ops:
        shape = shape.transpose(arg) if op == "transpose" else shape.reshape(arg)
    rank = shape.ndim + 1
    stacked = draw(st.booleans()) or shape.ndim == 0
    axis = draw(st.integers(-rank, rank - 1) if stacked else st.integers(0, shape.ndim - 1))
    after = []
    if draw(st.booleans()):
        after.append(("transpose", tuple(draw(st.permutations(range(rank - (not stacked)))))))
    return stored, ops, n, stacked, axis, after


@settings(max_examples=examples(300, 60), deadline=None)
@given(joins(), st.booleans())
def test_joins_of_chains_read_what_numpy_and_jax_join(join, by_jax):
    stored, ops, n, stacked, axis, after = join
    rng = np.random.default_rng(0)
    arrays = {f"w{i}": rng.standard_normal(stored).astype(np.float32) for i in range(n)}

    def fn(t, np=jnp):
        parts = []
        for k in sorted(t):
            y = t[k]
            for op, arg in ops:
                y = np.transpose(y, arg) if op == "transpose" else np.reshape(y, arg)
            parts.append(y)
        y = (np.stack if stacked else np.concatenate)(parts, axis)
        for _, arg in after:
            y = np.transpose(y, arg)
        return {"y": y}

    syms = {k: trace.stand_in(k, stored, np.float32) for k in arrays}
    want = fn(arrays, np)["y"]
    try:
        if by_jax:
            found = traced.trace(fn, syms, {k: np.float32 for k in arrays})["y"]
        else:
            found = fn(syms, hooks.NUMPY)["y"]
        target = trace.target(found)
    except trace.Inexpressible as e:
        assert "unevenly" in str(e), str(e)
        return
    assert np.array_equal(read(target, arrays), want), (target, join)


def _inputs(shapes):
    syms = {k: trace.stand_in(f"file.{k}", s, np.float32) for k, s in shapes.items()}
    dtypes = {k: np.float32 for k in shapes}
    rng = np.random.default_rng(0)
    arrays = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    stored = {f"file.{k}": a for k, a in arrays.items()}
    return syms, dtypes, arrays, stored


@pytest.mark.parametrize("n", [3, 20, 300])
def test_stacks_concatenations_and_transposes_traced_by_jax_read_the_same_values(n):
    # jax concatenates at most 16 operands at a time: one stack all the same
    shapes = {f"e{i}": (4, 6) for i in range(n)} | {"q": (4, 2, 3), "k": (4, 2, 3), "b": (6,)}

    def fn(t):
        return {
            "experts": jnp.stack([t[f"e{i}"].T for i in range(n)], 0),
            "fused": jnp.stack([jnp.transpose(t["q"], (1, 0, 2)), t["k"].transpose(1, 0, 2)]),
            "joined": jnp.concatenate([t["e0"], t["e1"].astype(jnp.float32)], axis=1),
            "halves": jnp.stack([t["e0"][:, :3], t["e0"][:, 3:]], axis=0),
            "unit": jnp.expand_dims(t["b"], 0),
            "merged": jnp.stack([t["e0"], t["e1"]]).reshape(8, 6),
            "b": t["b"],
        }

    syms, dtypes, arrays, stored = _inputs(shapes)
    found = traced.trace(fn, syms, dtypes)
    want = fn({k: jnp.asarray(a) for k, a in arrays.items()})
    assert sorted(found) == sorted(want)
    targets = {}
    for k, sym in found.items():
        if k == "halves":  # a slice: jax's slice is no operation here
            with pytest.raises(trace.Inexpressible, match="the operation slice"):
                trace.target(sym)
            continue
        targets[k] = trace.target(sym)
        assert np.array_equal(read(targets[k], stored), np.asarray(want[k])), k
    assert targets["experts"] == Stack(
        [Tensor(f"file.e{i}", permute=(1, 0)) for i in range(n)], axis=0
    )
    assert targets["fused"] == Stack([Tensor(f"file.{s}", permute=(1, 0, 2)) for s in "qk"], axis=0)
    assert targets["joined"] == Concat([Tensor("file.e0"), Tensor("file.e1")], axis=1)
    assert targets["merged"] == Stack(["file.e0", "file.e1"], axis=0, out_shape=(8, 6))
    assert targets["b"] == Tensor("file.b")


@pytest.mark.parametrize(
    "fn, said",
    [
        (lambda t: {"x": t["a"] * 2}, "the operation mul"),
        (lambda t: {"x": t["a"].astype(jnp.bfloat16)}, "from float32 to bfloat16 (rounds)"),
        (lambda t: {"x": jnp.broadcast_to(t["a"], (2, 4, 6))}, "values repeated"),
        (lambda t: {"x": jnp.concatenate([t["a"], jnp.zeros((4, 1))], 1)}, "not a stored tensor"),
        (
            lambda t: {"x": jnp.stack([t["a"], t["a"]]).transpose(1, 0, 2).reshape(4, 12)},
            "a reshape after a pad, a fill, or a transposed join",
        ),
        (
            lambda t: {"x": jnp.stack([t["a"], t["a"]]).reshape(2, 4, 2, 3)},
            "a reshape of joined parts from (2, 4, 6) to (2, 4, 2, 3), no merge",
        ),
        (lambda t: {"x": t["a"].reshape(3, 8)}, "a reshape to (3, 8) that cuts an axis"),
    ],
)
def test_what_no_target_expresses_is_named_where_it_is_used(fn, said):
    syms, dtypes, _, _ = _inputs({"a": (4, 6)})
    found = traced.trace(lambda t: {**fn(t), "a": t["a"]}, syms, dtypes)
    assert trace.target(found["a"]) == Tensor("file.a")  # the refusal of x is x's alone
    with pytest.raises(trace.Inexpressible) as e:
        trace.target(found["x"])
    assert said in str(e.value), str(e.value)


def test_code_that_returns_no_dict_of_arrays_is_a_type_error():
    syms, dtypes, _, _ = _inputs({"a": (4, 6)})
    with pytest.raises(TypeError, match="not a dict of arrays"):
        traced.trace(lambda t: [t["a"]], syms, dtypes)
