"""Defects the differential fuzzer (tests/fuzz/test_fuzz_constructor.py) found, each kept as a
plain test, minimal, that failed before its fix."""

import warnings

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

import meshinit


def test_a_key_of_another_implementation_closed_over_and_staged_under_a_context_mesh():
    """A key made outside the factory, of an implementation other than threefry, sends
    its variables to the whole-constructor program (a FallbackWarning). Staged onto a
    mesh that is not the trace's, that program reads the key constant through the
    re-homing bind, which took its data with ``np.asarray`` inside the program's trace:
    "TracerArrayConversionError" on jax 0.10.2 and 0.12.0.1."""
    devices = np.array(jax.devices())
    mesh = Mesh(devices.reshape(2, 4), ("a", "b"))
    stage = Mesh(devices[4:].reshape(2, 2), ("a", "b"))
    closed = jax.random.key(0, impl="rbg")

    class M(nnx.Module):
        def __init__(self, rngs):
            self.w = nnx.Param(jax.random.normal(rngs.params(), (8, 8)))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", meshinit.FallbackWarning)
        with jax.set_mesh(mesh):
            got = meshinit.nnx.init(lambda: M(nnx.Rngs(closed)), meshes=[("w", stage)])
    fell = [str(w.message) for w in caught if w.category is meshinit.FallbackWarning]
    assert len(fell) == 1 and "key made outside the factory" in fell[0], fell
    with nnx.use_eager_sharding(False):
        want = M(nnx.Rngs(closed))
    assert got.w[...].sharding.mesh == stage
    assert np.asarray(got.w[...]).tobytes() == np.asarray(want.w[...]).tobytes(), (
        "the staged variable's values differ from eager construction"
    )
