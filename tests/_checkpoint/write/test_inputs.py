"""What an export takes: load's flat result, any pytree under dot-joined paths, an nnx
Module or State (its nnx.Params); each leaf without an array on devices named."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax import nnx
from helpers import xy_mesh
from safetensors.numpy import load_file

import meshinit
from meshinit._checkpoint.write.inputs import arrays_of


def test_an_nnx_module_and_linen_variables_are_written_under_their_paths(tmp_path):
    mesh = xy_mesh((2, 4), True)

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(8, 16, rngs=rngs)
            self.norm = nnx.RMSNorm(16, rngs=rngs)

    with jax.set_mesh(mesh):
        model = Model(nnx.Rngs(0))
    meshinit.safetensors.save(model, tmp_path / "nnx")
    got = load_file(str(tmp_path / "nnx" / "model.safetensors"))
    assert sorted(got) == ["norm.scale", "up.bias", "up.kernel"]
    np.testing.assert_array_equal(got["up.kernel"], np.asarray(model.up.kernel[...]))

    variables = nn.Dense(4).init(jax.random.key(0), jnp.ones((1, 8)))
    meshinit.safetensors.save(variables, tmp_path / "linen")
    got = load_file(str(tmp_path / "linen" / "model.safetensors"))
    assert sorted(got) == ["params.bias", "params.kernel"]


def test_leaves_without_an_array_are_each_a_problem_naming_the_path():
    x = jnp.ones((2,))
    flat, problems = arrays_of(
        {
            "a": {"b": x, "c": None},
            "d": jax.ShapeDtypeStruct((2,), jnp.float32),
            "k": jax.random.key(0),
        }
    )
    assert set(flat) == {"a.b", "a.c", "d", "k"}
    said = {p.path: p.message for p in problems}
    assert set(said) == {"a.c", "d", "k"}
    assert (
        "it is None" in said["a.c"] and "ShapeDtypeStruct" in said["d"] and "PRNG key" in said["k"]
    )


def test_loads_flat_result_is_taken_as_it_is():
    flat, problems = arrays_of({"layers.0.w": jnp.ones(2)})
    assert list(flat) == ["layers.0.w"] and problems == []
