"""The normal form of layout code: a stand-in's transposes, reshapes, slices and joins
become the ``names=`` target that reads them; what no target expresses is named."""

import numpy as np
import pytest

from meshinit._checkpoint.layout.views import Inexpressible
from meshinit._checkpoint.maps import trace
from meshinit.safetensors import Stack, Tensor


def w():
    return trace.stand_in("w", (4, 6), np.float32)


@pytest.mark.parametrize(
    ("step", "want"),
    [
        (lambda x: x, Tensor("w")),
        (lambda x: x.T, Tensor("w", permute=(1, 0))),
        (lambda x: x.reshape(2, 12), Tensor("w", shape=(2, 12))),
        (lambda x: x[1:3], Tensor("w", index=(slice(1, 3), slice(0, 6)))),
    ],
    ids=["as stored", "transposed", "reshaped", "sliced"],
)
def test_a_stand_ins_steps_become_the_tensor_that_reads_them(step, want):
    assert trace.target(step(w())) == want


def test_a_stack_of_stand_ins_is_a_stack_of_their_tensors():
    v = trace.stand_in("v", (4, 6), np.float32)
    assert trace.target(trace.stack([w(), v], axis=0)) == Stack([Tensor("w"), Tensor("v")], axis=0)


def test_what_no_target_expresses_is_named():
    with pytest.raises(Inexpressible, match="a scale by another tensor"):
        trace.target(w() * w())
    with pytest.raises(Inexpressible, match="a result that is not the stored tensor"):
        trace.target(np.zeros(3))
