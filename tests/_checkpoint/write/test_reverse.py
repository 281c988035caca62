"""names= read in reverse: each step undone, reshapes by their runs, joins by their
parts' own shapes; what the table does not say is refused naming the path."""

import jax.numpy as jnp
import numpy as np
import pytest

from meshinit._checkpoint.write.reverse import recipes
from meshinit.safetensors import Concat, Fill, Pad, Stack, Tensor


def _one(target, shape, dtype=jnp.float32):
    made, problems = recipes({"p": target}, {"p": (shape, np.dtype(dtype))})
    assert problems == [], problems
    return made


@pytest.mark.parametrize(
    ("shape", "view", "stored"),
    [
        ((4, 8, -1), (16, 4, 8), (32, 16)),  # a (heads * head_dim, d) weight
        ((-1, 4, 8), (16, 4, 8), (16, 32)),  # a (d, heads * head_dim) weight
        ((4, 8), (4, 8), (32,)),  # a bias: one run, one axis
        ((4, -1), (4, 8), (4, 8)),  # each -1 its own axis
    ],
)
def test_a_reshape_is_undone_by_its_runs(shape, view, stored):
    permute = (2, 0, 1) if len(view) == 3 and shape[0] != -1 else None
    t = Tensor("w", shape=shape, permute=permute)
    param = tuple(np.empty(view).reshape(np.empty(view).shape).shape)
    if permute is not None:
        param = tuple(view[a] for a in (0, 1, 2))
        resolved = tuple(view[1:]) + (view[0],)  # shape=(4, 8, -1) resolved: (4, 8, 16)
        param = tuple(resolved[a] for a in permute)
    (r,) = _one(t, param)
    assert r.shape == stored and r.name == "w"


def test_a_stack_gives_one_recipe_per_layer_sharing_one_build():
    made = _one(Stack([Tensor(f"l{i}", permute=(1, 0)) for i in range(3)], axis=0), (3, 4, 5))
    assert [r.name for r in made] == ["l0", "l1", "l2"]
    assert [r.shape for r in made] == [(5, 4)] * 3
    assert [r.at for r in made] == [(0,), (1,), (2,)]
    assert made[0].build == made[1].build == made[2].build


def test_a_concat_needs_all_parts_but_one_to_say_their_length():
    made = _one(Concat([Tensor("a", shape=(3, -1)), "b"], axis=0), (8, 4))
    assert [(r.name, r.shape) for r in made] == [("a", (3, 4)), ("b", (5, 4))]
    _, problems = recipes({"p": Concat(["a", "b"], axis=0)}, {"p": ((8, 4), np.dtype("f4"))})
    assert [p.path for p in problems] == ["p"]
    assert "do not say their length along axis 0" in problems[0].message


def test_a_pad_needs_its_part_s_shape_and_a_fill_writes_nothing():
    made = _one(Pad(Tensor("e", shape=(60, -1)), shape=(64, 8)), (64, 8))
    assert [(r.name, r.shape) for r in made] == [("e", (60, 8))]
    assert _one(Fill(0.0), (4,)) == []
    _, problems = recipes({"p": Pad(Tensor("e"), shape=(64, 8))}, {"p": ((64, 8), np.dtype("f4"))})
    assert "has no shape the export can know" in problems[0].message


@pytest.mark.parametrize(
    ("target", "said"),
    [
        (Tensor("w", scale=2.0), "scale=2.0, which has no saving hook"),
        (Tensor("w", offset=1.0), "offset=1.0, which has no saving hook"),
        (Tensor("w", out_shape=(4, 8)), "out_shape= without shape="),
        (Tensor("w", shape=(5, -1)), "does not hold"),
    ],
)
def test_what_cannot_be_undone_is_refused_naming_the_path(target, said):
    _, problems = recipes({"p": target}, {"p": ((4, 8), np.dtype("f4"))})
    assert [p.path for p in problems] == ["p"] and said in problems[0].message
