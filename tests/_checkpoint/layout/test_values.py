"""A block's values on the host: cast within a kind (int4 and uint4 included), and
refused where the cast would change a value, naming the part."""

import types

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import load_refused, mesh8, plan_for

import meshinit
from meshinit import safetensors as st
from meshinit._checkpoint.layout import values

save_file = pytest.importorskip("safetensors.numpy").save_file


def test_a_cast_that_would_change_a_value_is_a_plan_error_naming_the_part():
    leaf = types.SimpleNamespace(label="", stored=types.SimpleNamespace(name="t"))
    np.testing.assert_array_equal(
        values.cast(np.array([1, 2], np.int32), np.dtype(np.int8), "p", leaf), [1, 2]
    )
    with pytest.raises(meshinit.PlanError, match="holds values from 1 to 300, outside int8"):
        values.cast(np.array([1, 300], np.int32), np.dtype(np.int8), "p", leaf)


@pytest.mark.parametrize(
    "stored,planned,said",
    [
        (np.array([2**40, 1], np.int64), np.int32, "outside int32's range"),
        (np.array([1e5, 1], np.float32), np.float16, "overflows float16"),
    ],
)
def test_a_cast_that_would_change_a_value_is_refused(tmp_path, stored, planned, said):
    save_file({"a": stored}, str(tmp_path / "m.safetensors"))
    load_refused(plan_for({"a": stored.shape}, dtype=planned), tmp_path, "'a'", said)


def test_casts_within_a_kind_keep_infinities_and_fit_ranges(tmp_path):
    stored = {
        "f": np.array([np.inf, -np.inf, 1.5, 0], np.float32),
        "i": np.arange(4, dtype=np.int64),
    }
    save_file(stored, str(tmp_path / "m.safetensors"))
    plan = meshinit.plan(
        {
            "f": meshinit.param((4,), jax.nn.initializers.zeros, dtype=np.float16, mesh=mesh8()),
            "i": meshinit.param((4,), jax.nn.initializers.zeros, dtype=np.int8, mesh=mesh8()),
        }
    )
    got = st.load(plan, tmp_path)
    np.testing.assert_array_equal(np.asarray(got["f"]), stored["f"].astype(np.float16))
    np.testing.assert_array_equal(np.asarray(got["i"]), stored["i"].astype(np.int8))


@pytest.mark.parametrize(
    "stored, planned",
    [(np.int8, jnp.int4), (np.uint8, jnp.uint4), (np.int32, jnp.int4)],
)
def test_sub_byte_integer_plans_load_exactly(tmp_path, stored, planned):
    info = ml_dtypes.iinfo(planned)
    want = (np.arange(64) % (int(info.max) - int(info.min) + 1) + int(info.min)).astype(stored)
    save_file({"w": want.reshape(8, 8)}, str(tmp_path / "m.safetensors"))
    plan = plan_for({"w": (8, 8)}, dtype=planned, axes=("fsdp", "tensor"))
    (loaded,) = st.load(plan, tmp_path).values()
    assert loaded.dtype == planned and loaded.sharding == plan.entries[0].sharding
    np.testing.assert_array_equal(np.asarray(loaded).astype(np.int64), want.reshape(8, 8))


def test_a_value_outside_int4_is_refused_naming_the_range(tmp_path):
    save_file({"w": np.full((8, 8), 8, np.int8)}, str(tmp_path / "m.safetensors"))
    plan = plan_for({"w": (8, 8)}, dtype=jnp.int4)
    load_refused(plan, tmp_path, "'w'", "outside int4's range", "wider dtype")
