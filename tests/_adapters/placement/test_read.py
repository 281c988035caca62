"""``placements=`` read in any form: a sequence that is neither a table nor a tree of
shardings is refused, naming both forms, in nnx, linen and eqx alike."""

import jax
import jax.numpy as jnp
import pytest
from placement_models import Counted, EqxCounted, LinenCounted, mesh3

import meshinit


@pytest.mark.parametrize(
    "placements, holds",
    [
        ([1, 2], r"int 1 at placements\[0\]"),
        ([[]], r"list \[\] at placements\[0\]"),
        (  # the model's abstract values given for its shardings
            [jax.ShapeDtypeStruct((8,), jnp.float32)],
            r"ShapeDtypeStruct\(shape=\(8,\), dtype=float32\) at placements\[0\]",
        ),
    ],
    ids=["ints", "empty", "structs"],
)
@pytest.mark.parametrize("adapter", ["nnx", "linen", "eqx"])
def test_a_sequence_neither_a_table_nor_a_tree_names_both_forms(adapter, placements, holds):
    mesh = mesh3()
    want = (
        r"placements is a list of neither table entries nor shardings: a table is an ordered "
        r"sequence of \(regex, axes\), .* tuples \(first match wins\); a tree of shardings has "
        r"the model's structure with a NamedSharding, PartitionSpec or None per array; this "
        rf"one holds {holds}$"
    )
    with pytest.raises(TypeError, match=want):
        if adapter == "nnx":
            meshinit.nnx.plan(Counted, placements=placements, mesh=mesh)
        elif adapter == "linen":
            meshinit.linen.plan(
                LinenCounted(), 0, jnp.ones((1, 8)), mesh=mesh, placements=placements
            )
        else:
            meshinit.eqx.plan(EqxCounted, 0, placements, mesh=mesh)
