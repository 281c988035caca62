"""Layout transforms of ``names=``: ``Tensor(offset=)``, an index with steps,
``Fill``, ``Pad``, and ``out_shape=``/``permute=`` after a ``Stack`` or ``Concat``,
each against numpy computing the same thing, bit for bit, on plans sharded over the 8
simulated devices; bytes read == bytes owned (a constant and a pad's padding read
nothing); every refusal before anything is read, naming the path and the part."""

import warnings

import ml_dtypes
import numpy as np
import pytest
from helpers import Reads, owned, owned_bytes, plan_of, stored
from storage_servers import s3_server_fixture  # noqa: F401 (moto is imported when used)

import meshinit
from meshinit.safetensors import Concat, Fill, Pad, Stack, Tensor

save_file = pytest.importorskip("safetensors.numpy").save_file
bf16 = ml_dtypes.bfloat16


def random(shape, seed=0, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def assert_bits(array, want, entry):
    """``array`` is ``want`` bit for bit, on the planned sharding, every shard too."""
    assert array.sharding == entry.sharding, (entry.path, array.sharding)
    got = np.asarray(array)
    assert (got.dtype, got.shape) == (want.dtype, want.shape), (entry.path, got.dtype, got.shape)
    assert got.tobytes() == want.tobytes(), f"{entry.path}: not numpy's bits"
    for shard in array.addressable_shards:
        assert np.asarray(shard.data).tobytes() == want[shard.index].tobytes(), shard.index


def load(plan, tmp_path, names, **kw):
    """The load, and the bytes it recorded as read."""
    with Reads() as reads:
        loaded = meshinit.safetensors.load(plan, tmp_path, names=names, **kw)
    (read,) = reads.values
    return loaded, read


def blocks(entry):
    """The distinct blocks of an entry, as ``((start, stop), ...)`` per axis."""
    shape = entry.spec.shape
    return {
        tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))
        for index in entry.sharding.devices_indices_map(shape).values()
    }


# ------------------------------------------------------------------ offset


def rounded(x, op, value):
    """MaxText's hook arithmetic on ``x`` in its dtype: float32 (float64 for float64),
    rounded back to ``x``'s dtype."""
    work = np.float64 if x.dtype == np.float64 else np.float32
    return op(x.astype(work), work(value)).astype(x.dtype)


@pytest.mark.parametrize(
    "stored_dtype, planned",
    [(bf16, bf16), (np.float32, np.float32), (np.float32, bf16), (np.float16, np.float32)],
)
def test_offset_is_numpys_x_plus_1_in_the_planned_dtype(tmp_path, stored_dtype, planned):
    # MaxText's Gemma norm: the checkpoint stores scale - 1, MaxText adds 1.0 to the
    # bf16 array (ml_dtypes computes in float32 and rounds to bf16)
    held = random((8, 16), 1, stored_dtype)
    stored(tmp_path, {"model.norm": held})
    plan = plan_of({"norm": ((8, 16), ("fsdp", "tensor"))}, dtype=planned)
    loaded, read = load(plan, tmp_path, {"norm": Tensor("model.norm", offset=1.0)})
    x = held.astype(planned)
    want = x + 1.0  # numpy's (ml_dtypes') own arithmetic on the planned dtype
    assert want.dtype == planned
    assert want.tobytes() == rounded(x, np.add, 1.0).tobytes()
    assert_bits(loaded["norm"], want, plan.entries[0])
    assert read == owned_bytes(plan, np.dtype(stored_dtype).itemsize)


@pytest.mark.parametrize("planned", [bf16, np.float32, np.float16])
def test_scale_then_offset_round_each_as_a_step_of_its_own(tmp_path, planned):
    held = random((8, 16), 2) * 3
    stored(tmp_path, {"w": held})
    plan = plan_of({"w": ((8, 16), ("fsdp", "tensor"))}, dtype=planned)
    scale, offset = 1 / np.sqrt(128), 1 / 3
    loaded, _ = load(plan, tmp_path, {"w": Tensor("w", scale=scale, offset=offset)})
    x = held.astype(planned)
    want = rounded(rounded(x, np.multiply, scale), np.add, offset)
    assert_bits(loaded["w"], want, plan.entries[0])
    # the order shows: offset first, or one rounding of both, give other bits
    assert rounded(rounded(x, np.add, offset), np.multiply, scale).tobytes() != want.tobytes()
    if planned != np.float32:
        once = (x.astype(np.float32) * np.float32(scale) + np.float32(offset)).astype(planned)
        assert once.tobytes() != want.tobytes()


def test_an_offset_that_overflows_is_a_plan_error_naming_the_value(tmp_path, new_arrays):
    held = np.full((4, 8), 60000, np.float16)
    stored(tmp_path, {"model.n": held})
    plan = plan_of({"n": ((4, 8), ("fsdp", "tensor"))}, dtype=np.float16)
    with (
        warnings.catch_warnings(),
        new_arrays() as made,
        pytest.raises(meshinit.PlanError, match="an offset value does not fit") as raised,
    ):
        warnings.simplefilter("error")  # numpy's RuntimeWarning does not escape
        meshinit.safetensors.load(plan, tmp_path, names={"n": Tensor("model.n", offset=8000.0)})
    assert made == []
    assert [(p.path, p.message) for p in raised.value.problems] == [
        (
            "n",
            "tensor 'model.n' holds 60000.0, which plus offset=8000.0 is 68000.0: it "
            "overflows float16; plan a wider dtype",
        )
    ]
    with pytest.raises(meshinit.PlanError, match=r"offset by 1e\+39, which overflows float32"):
        meshinit.safetensors.load(plan, tmp_path, names={"n": Tensor("model.n", offset=1e39)})


@pytest.mark.parametrize("what", ["offset", "scale"])
def test_offset_and_scale_are_refused_on_an_integer_tensor(tmp_path, what):
    stored(tmp_path, {"i": np.zeros((4, 4), np.int32)})
    plan = plan_of({"i": ((4, 4), ("fsdp", "tensor"))}, dtype=np.int32)
    done = {"offset": "offset", "scale": "scaled"}[what]
    with pytest.raises(
        meshinit.PlanError, match=rf"i: tensor 'i' .* cannot be {done}: {what}= is for floating"
    ):
        meshinit.safetensors.inventory(plan, tmp_path, names={"i": Tensor("i", **{what: 1.0})})


# ------------------------------------------------------------------ steps


@pytest.mark.parametrize(
    "shape, index, axes",
    [
        ((8, 32), np.s_[..., ::2], (None, "tensor")),  # every other column, columns split
        ((8, 32), np.s_[:, 1::2], ("fsdp", "tensor")),
        ((16, 16), np.s_[::2], ("fsdp", "tensor")),  # every other row
        ((8, 3, 16), np.s_[::2, ..., 1::2], ("fsdp", None, "tensor")),
        ((9, 40), np.s_[1:, 3:35:4], ("tensor", "fsdp")),  # bounds and a step
    ],
)
def test_a_step_reads_what_numpy_slices_and_only_the_kept_elements(tmp_path, shape, index, axes):
    held = random(shape, 3)
    stored(tmp_path, {"w": held})
    want = held[index]
    plan = plan_of({"w": (want.shape, axes)})
    loaded, read = load(plan, tmp_path, {"w": Tensor("w", index=index)})
    assert_bits(loaded["w"], want, plan.entries[0])
    assert read == owned_bytes(plan, 4)


def test_a_stepped_axis_split_by_the_reshape_and_transposed_is_a_view(tmp_path):
    held = random((8, 32), 4)
    stored(tmp_path, {"w": held})
    plan = plan_of({"w": ((4, 8, 4), ("tensor", "fsdp", None)), "flat": ((128,), ("tensor",))})
    names = {
        "w": Tensor("w", index=np.s_[:, ::2], shape=(8, 4, 4), permute=(2, 0, 1)),
        # every other column of every row is every other element: one stride, a view
        "flat": Tensor("w", index=np.s_[:, ::2], shape=(-1,)),
    }
    loaded, read = load(plan, tmp_path, names)
    want = held[:, ::2].reshape(8, 4, 4).transpose(2, 0, 1)
    assert_bits(loaded["w"], want, plan.entries[1])
    assert_bits(loaded["flat"], held.reshape(-1)[::2], plan.entries[0])
    assert read == owned_bytes(plan, 4)


def test_a_reshape_that_merges_a_stepped_axis_is_refused_before_reading(tmp_path):
    # half of each row, every other element: no one stride walks the flattened slice
    stored(tmp_path, {"w": np.zeros((8, 32), np.float32)})
    plan = plan_of({"w": ((64,), ("fsdp",))})
    with pytest.raises(
        meshinit.PlanError, match=r"w: tensor 'w' .* cannot be reshaped without a copy"
    ):
        meshinit.safetensors.inventory(
            plan, tmp_path, names={"w": Tensor("w", index=np.s_[:, :16:2], shape=(-1,))}
        )


@pytest.mark.parametrize(
    "index, error",
    [
        (np.s_[::0], "a step must be positive"),
        (np.s_[:, ::-1], "a step must be positive"),
        (np.s_[::1.5], "basic slices with a positive step"),
        (np.s_[..., :2, ...], "at most one Ellipsis"),
        (np.s_[::True], "basic slices with a positive step"),
    ],
)
def test_a_step_that_is_not_positive_is_a_type_error(index, error):
    with pytest.raises(TypeError, match=error):
        Tensor("w", index=index)


# ------------------------------------------------------------------ Fill


@pytest.mark.parametrize(
    "dtype, value",
    [(np.float32, 1.5), (bf16, 1.0), (np.int32, 7), (np.bool_, True), (np.float16, -np.inf)],
)
def test_a_fill_reads_nothing_and_holds_its_value_in_the_planned_dtype(tmp_path, dtype, value):
    stored(tmp_path, {"x": np.ones(4, np.float32)})
    plan = plan_of({"c": ((8, 16), ("fsdp", "tensor"))}, dtype=dtype)
    names = {"c": Fill(value)}
    loaded, read = load(plan, tmp_path, names, unused="ignore")
    assert_bits(loaded["c"], np.full((8, 16), value, dtype), plan.entries[0])
    assert read == 0
    found = meshinit.safetensors.inventory(plan, tmp_path, names=names)
    assert found.reads == {"c": ()} and found.loaded == {"c": Fill(value)}
    assert found.unused == ("x",)


def test_a_fill_inside_a_stack_reads_only_the_tensor_parts(tmp_path):
    a, b = random((8, 8), 5), random((8, 8), 6)
    stored(tmp_path, {"a": a, "b": b})
    # layers 0-1 and 2-3 on the two fsdp rows: each reads one tensor and fills one
    plan = plan_of({"s": ((4, 8, 8), ("fsdp", None, "tensor"))})
    names = {"s": Stack(["a", Fill(0.0, (8, 8)), "b", Fill(-1.0, (8, 8))], axis=0)}
    loaded, read = load(plan, tmp_path, names)
    want = np.stack([a, np.zeros((8, 8), np.float32), b, -np.ones((8, 8), np.float32)])
    assert_bits(loaded["s"], want, plan.entries[0])
    assert read == owned_bytes(plan, 4) // 2 == a.nbytes + b.nbytes
    assert meshinit.safetensors.inventory(plan, tmp_path, names=names).reads == {"s": ("a", "b")}


def test_a_fill_beside_a_tensor_in_a_concat(tmp_path):
    a = random((8, 7), 7)
    stored(tmp_path, {"a": a})
    plan = plan_of({"c": ((8, 12), ("fsdp", "tensor"))}, dtype=bf16)
    loaded, read = load(plan, tmp_path, {"c": Concat(["a", Fill(2.0, (8, 5))], axis=1)})
    want = np.concatenate([a, np.full((8, 5), 2.0, np.float32)], axis=1).astype(bf16)
    assert_bits(loaded["c"], want, plan.entries[0])
    assert read == a.nbytes  # each element of a in one block; the fill's blocks read none


# ------------------------------------------------------------------ Pad


@pytest.mark.parametrize("value", [0, -1.5])
@pytest.mark.parametrize("given", [True, False])
def test_a_pad_is_numpys_pad_and_blocks_in_the_padding_read_nothing(tmp_path, value, given):
    w = random((6, 10), 8)
    stored(tmp_path, {"w": w})
    plan = plan_of({"p": ((16, 24), ("fsdp", "tensor"))})
    shape = (16, 24) if given else None
    loaded, read = load(plan, tmp_path, {"p": Pad("w", shape, value=value)})
    want = np.pad(w, [(0, 10), (0, 14)], constant_values=value)
    assert_bits(loaded["p"], want, plan.entries[0])
    outside = [b for b in blocks(plan.entries[0]) if b[0][0] >= 6 or b[1][0] >= 10]
    assert len(outside) == 6  # of the 8 blocks (8, 6): wholly in the padding
    assert read == w.nbytes  # each element of w once, nothing for those six


def test_pads_nest_in_joins_and_hold_joins_and_fills(tmp_path):
    a, b = random((6, 10), 9), random((6, 10), 10)
    stored(tmp_path, {"a": a, "b": b})
    plan = plan_of(
        {
            "vocab": ((8, 24), ("fsdp", "tensor")),  # a pad inside a concat
            "stack": ((4, 8, 16), ("fsdp", None, "tensor")),  # a stack inside a pad
            "corner": ((4, 4), ("fsdp", "tensor")),  # a fill inside a pad
            "pads": ((10, 12), ("fsdp", "tensor")),  # a pad inside a pad
        }
    )
    names = {
        "vocab": Concat([Pad("a", (8, 12)), Pad(Tensor("b"), (8, 12), value=-1)], axis=1),
        "stack": Pad(Stack(["a", "b"], axis=0), (4, 8, 16)),
        "corner": Pad(Fill(1.0, (2, 2))),
        "pads": Pad(Pad("a", (8, 10), value=2.0), value=3.0),
    }
    loaded, read = load(plan, tmp_path, names)
    wants = {
        "vocab": np.concatenate(
            [np.pad(a, [(0, 2), (0, 2)]), np.pad(b, [(0, 2), (0, 2)], constant_values=-1)], 1
        ),
        "stack": np.pad(np.stack([a, b]), [(0, 2), (0, 2), (0, 6)]),
        "corner": np.pad(np.ones((2, 2), np.float32), [(0, 2), (0, 2)]),
        "pads": np.pad(
            np.pad(a, [(0, 2), (0, 0)], constant_values=2.0), [(0, 2), (0, 2)], constant_values=3.0
        ),
    }
    for entry in plan.entries:
        assert_bits(loaded[entry.path], wants[entry.path], entry)
    # every stored element is in exactly one block of each parameter that reads it
    assert read == 3 * a.nbytes + 2 * b.nbytes


def test_a_rule_expands_its_groups_inside_a_pad(tmp_path):
    held = {f"model.layers.{i}.w": random((6, 10), 20 + i) for i in range(2)}
    stored(tmp_path, held)
    plan = plan_of({f"layers.{i}.w": ((12, 8), ("tensor", "fsdp")) for i in range(2)})
    names = [(r"layers\.(\d+)\.w", Pad(Tensor(r"model.layers.\1.w", permute=(1, 0)), (12, 8)))]
    loaded, read = load(plan, tmp_path, names)
    for i, entry in enumerate(sorted(plan.entries, key=lambda e: e.path)):
        assert_bits(
            loaded[entry.path], np.pad(held[f"model.layers.{i}.w"].T, [(0, 2), (0, 2)]), entry
        )
    assert read == 2 * 60 * 4
    found = meshinit.safetensors.inventory(plan, tmp_path, names=names)
    assert found.reads == {f"layers.{i}.w": (f"model.layers.{i}.w",) for i in range(2)}
    assert found.unused == ()


def test_pads_and_fills_that_cannot_fit_are_one_plan_error_naming_each_part(tmp_path, new_arrays):
    stored(tmp_path, {"w": np.zeros((6, 10), np.float32)})
    plan = plan_of(
        {
            "small": ((4, 4), ("fsdp", "tensor")),
            "rank": ((6, 10, 1), ("fsdp", None, None)),
            "nested": ((2, 6, 12), (None, "fsdp", "tensor")),
            "fill": ((8, 8), ("fsdp", "tensor")),
            "far": ((8, 8), ("fsdp", "tensor")),
        },
        dtype=np.float16,
    )
    names = {
        "small": Pad("w", (4, 4)),
        "rank": Pad("w"),
        "nested": Stack([Pad("w", (6, 12)), Pad("w", (6, 8))], axis=0),
        "fill": Fill(1e6),
        "far": Fill(0.0, (2, 2)),
    }
    with (
        new_arrays() as made,
        pytest.raises(meshinit.PlanError, match="nothing was read") as raised,
    ):
        meshinit.safetensors.load(plan, tmp_path, names=names)
    assert made == []
    found = {p.path: p.message for p in raised.value.problems}
    assert found == {
        "small": "Pad shape=(4, 4) is smaller than its part tensor 'w' (F32), which gives "
        "(6, 10); a Pad only adds after the part, on each axis",
        "rank": "Pad shape=(6, 10, 1) has another rank than its part tensor 'w' (F32), which "
        "gives (6, 10); a Pad only adds after the part, on each axis",
        "nested": "Stack part [1] Pad shape=(6, 8) is smaller than its part tensor 'w' (F32), "
        "which gives (6, 10); a Pad only adds after the part, on each axis",
        "fill": "Fill value 1000000.0 overflows float16; plan a wider dtype",
        "far": "Fill(0.0) gives shape (2, 2), planned (8, 8)",
    }


@pytest.mark.parametrize(
    "dtype, target, error",
    [
        (np.int8, Fill(1000), "Fill value 1000 is outside int8's range"),
        (np.int32, Fill(1.5), "Fill value 1.5 is not an integer, planned int32"),
        (np.uint8, Pad("u", value=-1), "Pad value -1 is outside uint8's range"),
        (np.bool_, Fill(2), "Fill value 2 is outside bool's range"),
        (
            ml_dtypes.float8_e4m3fn,
            Fill(float("inf")),
            "Fill value inf is not held by float8_e4m3fn, which has no infinity",
        ),
    ],
)
def test_a_constant_the_planned_dtype_cannot_hold_is_refused(tmp_path, dtype, target, error):
    u = np.zeros((2, 2), np.float32 if dtype == ml_dtypes.float8_e4m3fn else dtype)
    stored(tmp_path, {"u": u})
    plan = plan_of({"c": ((4, 4), ("fsdp", "tensor"))}, dtype=dtype)
    with pytest.raises(meshinit.PlanError, match=rf"c: {error}"):
        meshinit.safetensors.inventory(plan, tmp_path, names={"c": target})


# ------------------------------------------------------------------ out_shape, permute


def test_concat_out_shape_then_permute_is_qwens_concatenate_reshape_transpose(tmp_path):
    # Qwen3.5's MaxText hook: np.concatenate([q, k, v, z], axis=1).reshape(-1, d).T
    d, n = 8, 4
    held = {
        x: random((d, h, n), 30 + i)
        for i, (x, h) in enumerate(zip("qkvz", (2, 1, 1, 4), strict=True))
    }
    stored(tmp_path, held)
    want = np.concatenate(list(held.values()), axis=1).reshape(-1, n).T  # (4, 64)
    plan = plan_of({"qkvz": (want.shape, ("fsdp", "tensor"))})  # 16 rows of 8 a block
    names = {"qkvz": Concat(list(held), axis=1, out_shape=(d * 8, n), permute=(1, 0))}
    loaded, read = load(plan, tmp_path, names)
    assert_bits(loaded["qkvz"], want, plan.entries[0])
    assert read == owned_bytes(plan, 4)


def test_stack_out_shape_and_permute(tmp_path):
    a, b = random((6, 10), 40), random((6, 10), 41)
    stored(tmp_path, {"a": a, "b": b})
    plan = plan_of({"s": ((10, 12), ("fsdp", "tensor")), "m": ((12, 10), ("tensor", None))})
    names = {
        "s": Stack(["a", "b"], axis=0, out_shape=(12, 10), permute=(-1, 0)),
        "m": Stack(["a", "b"], axis=0, out_shape=(12, 10)),
    }
    loaded, read = load(plan, tmp_path, names)
    assert_bits(loaded["s"], np.stack([a, b]).reshape(12, 10).T, plan.entries[1])
    assert_bits(loaded["m"], np.stack([a, b]).reshape(12, 10), plan.entries[0])
    assert read == owned_bytes(plan, 4)


def test_a_join_whose_merge_blocks_cannot_read_is_refused_naming_the_target(tmp_path):
    stored(
        tmp_path,
        {"p": np.zeros((3, 1, 5), np.float32), "r": np.zeros((3, 3, 5), np.float32)},
    )
    plan = plan_of(
        {
            "cut": ((12, 5), ("tensor", None)),  # rows 3-6 span rows 0 and 1 of (3, 4)
            "nomerge": ((6, 10), (None, None)),
            "order": ((12, 5), (None, None)),
            "fine": ((5, 12), (None, None)),
        }
    )
    names = {
        "cut": Concat(["p", "r"], axis=1, out_shape=(12, 5)),
        "nomerge": Concat(["p", "r"], axis=1, out_shape=(6, 10)),
        "order": Concat(["p", "r"], axis=1, out_shape=(12, 5), permute=(0, 0)),
        "fine": Concat(["p", "r"], axis=1, out_shape=(12, 5), permute=(1, 0)),
    }
    with pytest.raises(meshinit.PlanError) as raised:
        meshinit.safetensors.inventory(plan, tmp_path, names=names)
    found = {p.path: p.message for p in raised.value.problems}
    assert found == {
        "cut": "Concat out_shape=(12, 5): the block [3:6, 0:5] cuts a merged axis within a "
        "row of the joined shape (3, 4, 5); shard the merged axis into whole rows, or not "
        "at all",
        "nomerge": "Concat out_shape=(6, 10) does not merge side-by-side axes of the joined "
        "shape (3, 4, 5)",
        "order": "Concat permute=(0, 0) is not an order of the 2 axes of (12, 5)",
    }
    with pytest.raises(meshinit.PlanError, match=r"shape \(5, 12\), planned \(12, 5\)"):
        meshinit.safetensors.inventory(
            plan, tmp_path, names={**names, "cut": names["fine"], "nomerge": None, "order": None}
        )


# ------------------------------------------------------------------ the types


@pytest.mark.parametrize(
    "make, kind, error",
    [
        (
            lambda: Stack(["a", Fill(0.0)], axis=0),
            ValueError,
            r"Stack parts\[1\] is a Fill with shape=None",
        ),
        (
            lambda: Concat([Pad("a")], axis=0),
            ValueError,
            r"Concat parts\[0\] is a Pad with shape=None",
        ),
        (lambda: Pad(Fill(1.0)), ValueError, "Pad part is a Fill with shape=None"),
        (lambda: Pad(Pad("a"), (4, 4)), ValueError, "Pad part is a Pad with shape=None"),
        (lambda: Pad(3), TypeError, "Pad part must be a tensor name, a Tensor"),
        (lambda: Pad("a", value="0"), TypeError, "Pad value must be a Python float"),
        (lambda: Pad("a", (4, -1)), ValueError, r"Pad shape \(4, -1\): sizes are non-negative"),
        (lambda: Fill("0"), TypeError, "Fill value must be a Python float"),
        (lambda: Fill(np.zeros(2)), TypeError, "Fill value must be a Python float"),
        (lambda: Fill(0.0, (2.0, 2)), TypeError, "Fill shape must be a sequence of ints"),
        (lambda: Stack(["a"], 0, out_shape=(4, -1)), ValueError, "Stack out_shape .* non-negative"),
        (
            lambda: Concat(["a"], 0, permute=(1.5, 0)),
            TypeError,
            "Concat permute must be a sequence",
        ),
        (lambda: Tensor("a", offset="1"), TypeError, "Tensor offset must be a Python float"),
        (lambda: Tensor("a", offset=float("nan")), ValueError, "Tensor offset must be finite"),
        (lambda: Tensor("a", dequantize=0), TypeError, r"Tensor dequantize must be a bool \("),
        (lambda: Tensor("a", dequantize="no"), TypeError, "cast float8 values as stored, with"),
        (
            lambda: Tensor("a", dequantize=np.False_),
            TypeError,
            r"must be a bool .*got (np\.)?False",
        ),
        (lambda: Tensor("a", dequantize=None), TypeError, "must be a bool .*got None"),
    ],
)
def test_malformed_transforms_are_refused_as_they_are_made(make, kind, error):
    with pytest.raises(kind, match=error):
        make()


def test_the_types_read_as_they_were_written():
    assert repr(Fill(0.0)) == "Fill(value=0.0, shape=None)"
    assert repr(Fill(np.float32(1.5), (2, 3))) == "Fill(value=1.5, shape=(2, 3))"
    assert type(Fill(np.int64(3)).value) is int
    assert repr(Pad("w", (4, 4), value=-1)) == (
        "Pad(part=Tensor(name='w', shape=None, permute=None, index=None, scale=None, "
        "out_shape=None, offset=None), shape=(4, 4), value=-1)"
    )
    assert repr(Tensor("w", index=np.s_[..., 1::2], offset=1)) == (
        "Tensor(name='w', shape=None, permute=None, index=(Ellipsis, slice(1, None, 2)), "
        "scale=None, out_shape=None, offset=1.0)"
    )
    assert Tensor("w", index=np.s_[::1]).index == (slice(None, None, None),)  # a step of 1
    assert repr(Tensor("w", dequantize=False, compute_dtype="float32")) == (
        "Tensor(name='w', shape=None, permute=None, index=None, scale=None, out_shape=None, "
        "offset=None, compute_dtype='float32', dequantize=False)"
    )
    assert Tensor("w") == Tensor("w", dequantize=True) != Tensor("w", dequantize=False)
    assert repr(Concat(["a"], 0, out_shape=[4, 2], permute=[1, 0])).endswith(
        "axis=0, out_shape=(4, 2), permute=(1, 0))"
    )
    assert meshinit.safetensors.Fill is Fill and Fill.__module__ == "meshinit.safetensors"
    assert {"Fill", "Pad"} <= set(meshinit.safetensors.__all__)


# ------------------------------------------------------------------ remote


def test_steps_and_pads_from_s3_give_the_local_bits_and_fetch_only_what_blocks_keep(
    tmp_path, request
):
    pytest.importorskip("obstore")
    pytest.importorskip("moto")
    server = request.getfixturevalue("s3_server")
    rows, cols = random((128, 1024), 50), random((256, 512), 51)
    pad = random((200, 96), 52)
    stored(tmp_path, {"rows": rows, "cols": cols, "pad": pad})
    bucket = server.bucket()
    server.put(f"{bucket}/ckpt/model.safetensors", (tmp_path / "model.safetensors").read_bytes())
    fills = Stack([Fill(1.0, (8, 96)), Tensor("pad", index=np.s_[:8])], axis=0)
    plans = {
        # every other row (4 KiB runs, 4 KiB apart): each row its own run
        "rows": (
            plan_of({"x": ((64, 1024), ("fsdp", "tensor"))}),
            {"x": Tensor("rows", index=np.s_[::2])},
            1.0,
        ),
        # every other element: 4-byte runs; the gaps between them are read through
        "cols": (
            plan_of({"x": ((256, 256), (None, "tensor"))}),
            {"x": Tensor("cols", index=np.s_[..., 1::2])},
            2.0,
        ),
        # six of eight blocks wholly in the padding; a fill alone and in a stack
        "pad": (
            plan_of(
                {
                    "x": ((512, 256), ("fsdp", "tensor")),
                    "f": ((8, 8), ("fsdp", "tensor")),
                    "s": ((2, 8, 96), ("fsdp", None, "tensor")),
                }
            ),
            {"x": Pad("pad"), "f": Fill(2.0), "s": fills},
            1.0,
        ),
    }
    for case, (plan, names, most) in plans.items():
        server.reset()
        remote = meshinit.safetensors.load(
            plan, f"s3://{bucket}/ckpt/", names=names, unused="ignore"
        )
        local = meshinit.safetensors.load(plan, tmp_path, names=names, unused="ignore")
        for entry in plan.entries:
            assert_bits(remote[entry.path], np.asarray(local[entry.path]), entry)
        sent = sum(
            r.sent for r in server.counters.log if r.method == "GET" and r.range and r.range[0] > 0
        )
        # the padding and the fills are fetched from nowhere
        kept = owned(local) if case != "pad" else pad.nbytes + pad[:8].nbytes
        assert sent <= most * kept + 4096, f"{case}: {sent} bytes sent for {kept} kept"
        assert sent >= kept, f"{case}: {sent} bytes sent, fewer than the {kept} kept"
