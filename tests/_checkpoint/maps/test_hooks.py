"""Hooks written as MaxText writes them, followed on stand-ins (``meshinit._checkpoint.maps.hooks``
over ``meshinit._checkpoint.maps.trace``):
the target they become, loaded by ``meshinit.safetensors.load``, has the bits of the
hook run on the real arrays; what no target can express is refused by name."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import plan_for
from safetensors.numpy import save_file

import meshinit
from meshinit import safetensors as st
from meshinit._checkpoint.maps import hooks, trace

BF16 = np.dtype(ml_dtypes.bfloat16)


def followed(hook, stored, shape, dtype=np.float32):
    """The hook's target for a stored array, from its shape alone."""
    return hooks.followed(hook, trace.stand_in("w", stored.shape, np.dtype(dtype)), shape)


def same_as_the_hook(tmp_path, hook, stored, shape, dtype=np.float32, axes=None):
    """Loads the hook's target onto a sharded plan; its bits are the hook's on the
    stored array cast to the planned dtype (MaxText's hooks see it in its save dtype)."""
    target = followed(hook, stored, shape, dtype)
    save_file({"w": stored}, str(tmp_path / "m.safetensors"))
    plan = plan_for({"p": shape}, dtype=dtype, axes=axes)
    (loaded,) = st.load(plan, tmp_path, names={"p": target}).values()
    want = np.asarray(hook(stored.astype(dtype), shape))
    assert want.dtype == np.dtype(dtype) and want.shape == shape
    assert np.asarray(loaded).tobytes() == want.tobytes()
    return target


def reshape_kernel(x, target_shape):  # MaxText's, HF -> MaxText
    return x.T.reshape(target_shape)


def adjust_rope(x, target_shape):  # MaxText's Llama: HF halves -> interleaved pairs
    half = x.shape[-1] // 2
    return jax.numpy.stack([x[..., :half], x[..., half:]], axis=-1).reshape(x.shape)


def scale_query(x, target_shape):
    original = x.dtype
    return (x.astype(np.float32) * np.dtype("float32").type(1 / np.sqrt(16))).astype(original)


def chain(*fns):
    def run(x, shape):
        for hook in fns:
            x = hook(x, shape)
        return x

    return run


RNG = np.random.default_rng(0)


def test_a_transpose_then_split_is_a_reshape_then_permute(tmp_path):
    stored = RNG.standard_normal((4 * 16, 32)).astype(np.float32)  # (heads * hd, d)
    target = same_as_the_hook(
        tmp_path, reshape_kernel, stored, (32, 4, 16), axes=("fsdp", "tensor", None)
    )
    assert target == st.Tensor("w", shape=(4, 16, 32), permute=(2, 0, 1))


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
def test_llamas_query_chain_is_one_view_split_merged_and_scaled(tmp_path, dtype):
    stored = RNG.standard_normal((4 * 16, 32)).astype(np.float32)
    chained = [reshape_kernel, adjust_rope, scale_query]  # MaxText's order, HF -> MaxText
    x = trace.stand_in("w", stored.shape, np.dtype(dtype))
    target = hooks.followed(chained, x, (32, 4, 16))
    assert target == st.Tensor(
        "w", shape=(4, 2, 8, 32), permute=(3, 0, 2, 1), out_shape=(32, 4, 16), scale=0.25
    )
    same_as_the_hook(
        tmp_path, chain(*chained), stored, (32, 4, 16), dtype, ("fsdp", "tensor", None)
    )


def test_slices_with_steps_and_ints_go_into_the_stored_index(tmp_path):
    stored = RNG.standard_normal((6, 8, 10)).astype(np.float32)

    def hook(x, shape):
        return x[1, 2:8, ::1].T[:, :4]

    target = same_as_the_hook(tmp_path, hook, stored, (10, 4))
    assert [i.indices(n) for i, n in zip(target.index, stored.shape, strict=True)] == [
        (1, 2, 1),
        (2, 6, 1),
        (0, 10, 1),
    ]


def test_a_reshape_that_merges_then_splits_other_sizes(tmp_path):
    stored = RNG.standard_normal((6, 4, 10)).astype(np.float32)

    def hook(x, shape):  # (6, 4, 10) -> (24, 10) -> (3, 8, 10) -> T
        return x.reshape(24, 10).reshape(3, 8, 10).transpose(2, 0, 1)

    same_as_the_hook(tmp_path, hook, stored, (10, 3, 8))


def test_experts_transposed_and_new_axes(tmp_path):
    stored = RNG.standard_normal((4, 6, 8)).astype(np.float32)

    def hook(x, shape):
        return x.transpose(0, 2, 1)[None, :, :, :]

    same_as_the_hook(tmp_path, hook, stored, (1, 4, 8, 6))


@pytest.mark.parametrize(
    "hook, said",
    [
        (lambda x, s: x * x, "a scale by another tensor"),
        (lambda x, s: x / 2.0, "a division"),
        (lambda x, s: x if float(np.asarray(x).sum()) else x, "a reduction over the tensor's"),
        (lambda x, s: x if x[0, 0] > 0 else x, "a comparison of the tensor's values"),
        (lambda x, s: np.where(x > 0, x, 0), "a comparison of the tensor's values"),
        (lambda x, s: (x * 2.0) * 3.0, "a second scale"),
        (lambda x, s: x.reshape(5, -1), "a reshape"),
        (lambda x, s: x.T.reshape(12, 2)[:6], "a slice of an axis that a reshape split or merged"),
        (lambda x, s: x.astype(np.int32), "a cast to int32"),
        (lambda x, s: x * np.float64(2.0), "a scale in float64 of a float32 tensor"),
        (lambda x, s: jax.device_put(x), "is not a valid JAX type"),
        (lambda x, s: np.asarray(x, np.int8), "a cast to int8"),
        (lambda x, s: x.astype(np.float64), "a cast to float64"),
    ],
)
def test_what_no_target_expresses_is_refused_naming_the_operation(hook, said):
    with pytest.raises(trace.Inexpressible, match=said):
        followed(hook, np.zeros((4, 6), np.float32), (6, 4))


def test_numpy_and_jax_are_untouched_by_a_followed_hook():
    def hook(x, shape):
        assert np.zeros is not None
        return np.stack([x[:2], x[2:]], axis=0)

    before = (np.stack, np.zeros, jnp.stack, jax.numpy)
    followed(hook, np.zeros((4, 6), np.float32), (2, 2, 6))
    assert (np.stack, np.zeros, jnp.stack, jax.numpy) == before
    assert isinstance(np.zeros(2), np.ndarray)


def test_a_join_with_values_is_refused():
    def hook(x, shape):
        return np.concatenate([x, np.arange(6, dtype=np.float32)[None]], axis=0)

    with pytest.raises(trace.Inexpressible, match="a join with an array of values"):
        followed(hook, np.zeros((4, 6), np.float32), (5, 6))


def test_the_plan_error_of_a_framework_map_names_everything(tmp_path):
    # the message a FrameworkMap turns Inexpressible into is tested with MaxText;
    # here: the error reaches the user as one PlanError before any read
    class Map(st.FrameworkMap):
        family = "a map"
        needs_config = False

        def table(self, checkpoint):
            try:
                followed(lambda x, s: x * x, np.zeros((4, 6)), (6, 4))
            except trace.Inexpressible as e:
                return {}, [meshinit.Problem("p", f"hook square needs {e}")]

    save_file({"w": np.zeros((4, 6), np.float32)}, str(tmp_path / "m.safetensors"))
    with pytest.raises(meshinit.PlanError, match="hook square needs a scale by another tensor"):
        st.load(plan_for({"p": (6, 4)}), tmp_path, names=Map())


# ------------------------------------------------- pads, fills and offsets


def pad_by_writing(x, target_shape):  # MaxText's Qwen and Gemma 2: zeros, then the tensor
    padded = np.zeros(target_shape, dtype=x.dtype)
    padded[: x.shape[0], :] = x
    return padded


def pad_and_scale(x, target_shape):  # MaxText's Gemma 3: scale, then zeros concatenated
    normalizer = np.dtype("bfloat16").type(2560**0.5)  # 50.5, not 50.596
    scaled = (x * normalizer).astype(x.dtype)
    padding = np.zeros((target_shape[0] - x.shape[0], target_shape[1]), dtype=scaled.dtype)
    return np.concatenate([scaled, padding], axis=0)


def pad_then_scale(x, target_shape):  # MaxText's Gemma 2: zeros, the tensor, then scaled
    normalizer = np.dtype("float32").type(2304**0.5)
    padded = np.zeros(target_shape, dtype=x.dtype)
    padded[: x.shape[0], : x.shape[1]] = x
    return (padded * normalizer).astype(x.dtype)


def pad_then_offset(x, target_shape):
    padded = np.full(target_shape, 3.0, dtype=x.dtype)
    padded[: x.shape[0], :] = x
    return padded - 0.1


def scale_rmsnorm(x, target_shape):  # MaxText's Gemma: HF norm + 1
    return (x + 1.0).reshape(target_shape)


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("hook", [pad_by_writing, pad_and_scale], ids=["write", "concatenate"])
def test_a_vocabulary_padded_with_zeros_reads_only_the_stored_rows(tmp_path, hook, dtype):
    stored = RNG.standard_normal((20, 16)).astype(np.float32)
    target = same_as_the_hook(tmp_path, hook, stored, (32, 16), dtype, axes=("fsdp", "tensor"))
    found = st.inventory(plan_for({"p": (32, 16)}, dtype=dtype), tmp_path, names={"p": target})
    assert found.reads == {"p": ("w",)}


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("hook", [pad_then_scale, pad_then_offset], ids=["scale", "offset"])
def test_a_scale_or_offset_after_a_pad_goes_into_the_tensor_and_the_padding(tmp_path, hook, dtype):
    stored = RNG.standard_normal((20, 16)).astype(np.float32)
    target = same_as_the_hook(tmp_path, hook, stored, (32, 16), dtype, axes=("fsdp", "tensor"))
    assert isinstance(target, st.Pad) and target.part.name == "w"
    assert (target.part.scale, target.part.offset) != (None, None)


def test_gemmas_norm_offset_in_bf16(tmp_path):
    stored = RNG.standard_normal((16,)).astype(np.float32)
    target = same_as_the_hook(tmp_path, scale_rmsnorm, stored, (16,), BF16)
    assert target == st.Tensor("w", offset=1.0)


def test_ones_and_zeros_made_by_a_hook_are_fills(tmp_path):
    def make_ones(_x, target_shape):  # MaxText's small Gemma 4
        return np.ones(target_shape, dtype=np.float32)

    target = followed(make_ones, np.zeros((4,), np.float32), (8, 4))
    assert target == st.Fill(1, (8, 4))


def test_a_write_that_is_no_pad_is_refused():
    def hook(x, target_shape):
        out = np.zeros(target_shape, dtype=x.dtype)
        out[2:, :] = x
        return out

    with pytest.raises(trace.Inexpressible, match="writing a .* tensor into a fill"):
        followed(hook, np.zeros((4, 6), np.float32), (6, 6))


def test_a_stand_in_used_again_after_a_reshape_of_its_transpose_keeps_its_own_view():
    x = trace.stand_in("w", (128, 64), np.float32)
    split = x.T.reshape(64, 8, 16)  # splits an axis of x.T's view: x's own is untouched
    assert trace.target(split) == st.Tensor("w", shape=(8, 16, 64), permute=(2, 0, 1))
    assert trace.target(x.T) == st.Tensor("w", permute=(1, 0))
    assert trace.target(x) == st.Tensor("w")


# ------------------------------------------------- the normal form and joins


def test_the_simplest_form_is_given():
    q = trace.stand_in("q", (128, 64), np.float32)  # tunix: transpose (1, 0), reshape
    target = trace.target
    assert target(q.transpose((1, 0)).reshape((64, 8, 16))) == st.Tensor(
        "q", shape=(8, 16, 64), permute=(2, 0, 1)
    )
    assert target(q.transpose((1, 0))) == st.Tensor("q", permute=(1, 0))
    assert target(q) == st.Tensor("q")
    merged = q.reshape((2, 64, 64)).transpose((1, 0, 2)).reshape((64, -1))
    assert target(merged) == st.Tensor(
        "q", shape=(2, 64, 64), permute=(1, 0, 2), out_shape=(64, 128)
    )
    # side by side in the file: one axis of the reshape, not a merge of the view
    assert target(q.reshape((8192,))) == st.Tensor("q", shape=(8192,))
    assert target(q.reshape((2, 64, 64)).reshape((128, 64))) == st.Tensor("q")
    # a slice whose reshape would copy keeps the merge in out_shape
    assert target(q[:, :32].reshape((4096,))) == st.Tensor(
        "q", index=np.s_[0:128, 0:32], out_shape=(4096,)
    )


def test_a_reshape_that_cuts_an_axis_unevenly_is_named():
    w = trace.stand_in("w", (4, 3), np.float32)
    with pytest.raises(trace.Inexpressible, match=r"a reshape to \(2, 6\) that cuts an axis"):
        w.transpose((1, 0)).reshape((2, 6))


@pytest.mark.parametrize(
    "op, said",
    [
        (lambda w: w.transpose((0, 0)), r"transpose\(0, 0\) of a 2-d tensor"),
        (lambda w: w.transpose((0, 2)), r"transpose\(0, 2\) of a 2-d tensor"),
        (lambda w: w.reshape((5, -1)), r"a reshape of 12 elements to \(5, -1\)"),
        (lambda w: w.reshape((-1, -1)), r"a reshape to \(-1, -1\)"),
    ],
)
def test_a_step_numpy_refuses_is_named(op, said):
    with pytest.raises(trace.Inexpressible, match=said):
        op(trace.stand_in("w", (4, 3), np.float32))


def test_joins_flatten_unit_slices_stack_and_equal_slices_split():
    e = [trace.stand_in(f"e{i}", (4, 6), np.float32) for i in range(3)]
    units = [x.reshape((1, 4, 6)) for x in e]
    assert trace.target(trace.concatenate(units, 0)) == st.Stack(["e0", "e1", "e2"], axis=0)
    inner = trace.concatenate(units[:2], 0), trace.concatenate(units[2:], 0)
    assert trace.target(trace.concatenate(inner, 0)) == st.Stack(["e0", "e1", "e2"], axis=0)
    cat = trace.concatenate([trace.concatenate(e[:2], 1), e[2]], 1)
    assert trace.target(cat) == st.Concat(["e0", "e1", "e2"], axis=1)
    # equal slices of one axis of one tensor, in order: a split of it, no join
    halves = trace.stack([e[0][:, :3], e[0][:, 3:]], axis=0)
    assert trace.target(halves) == st.Tensor("e0", shape=(4, 2, 3), permute=(1, 0, 2))
    twice = trace.stack([e[0].T, e[1].T]).transpose((2, 0, 1)).transpose((0, 2, 1))
    transposed = [st.Tensor(f"e{i}", permute=(1, 0)) for i in range(2)]
    assert trace.target(twice) == st.Stack(transposed, axis=0, permute=(2, 1, 0))


@pytest.mark.parametrize(
    "use",
    [
        trace.target,
        lambda r: r.T,
        lambda r: r.reshape(24),
        lambda r: r[:2],
        lambda r: trace.stack([r, r]),
    ],
    ids=["target", "transpose", "reshape", "slice", "stack"],
)
def test_a_refused_stand_in_names_why_where_it_is_used(use):
    refused = trace.refused("the operation mul", (4, 6), np.float32)
    with pytest.raises(trace.Inexpressible, match="^the operation mul$"):
        use(refused)


@pytest.mark.parametrize("compute", [BF16, np.dtype(np.float32)])
def test_a_hook_computed_in_another_dtype_than_the_plans(tmp_path, compute):
    """MaxText's direct loader runs its hooks on the stored bfloat16 of a float32
    model (compute_dtype bfloat16: scaled, rounded to bfloat16, widened exactly), and
    to_maxtext --save_dtype=float32 in float32: both the hook's own bits."""

    def scale(x, target_shape):
        s = np.dtype("float32").type(1 / np.sqrt(8))
        return (x.astype(np.float32) * s).astype(x.dtype)

    stored = RNG.standard_normal((16, 8)).astype(BF16)
    made = hooks.followed(scale, trace.stand_in("w", stored.shape, compute), (16, 8))
    target = dataclasses.replace(made, compute_dtype=compute)
    assert target.compute_dtype == compute and "compute_dtype=" in repr(target)
    save_file({"w": stored}, str(tmp_path / "m.safetensors"))
    plan = plan_for({"p": (16, 8)}, dtype=np.float32)
    (loaded,) = st.load(plan, tmp_path, names={"p": target}).values()
    want = scale(stored.astype(compute), (16, 8)).astype(np.float32)
    assert np.asarray(loaded).tobytes() == want.tobytes()
    planned = scale(stored.astype(np.float32), (16, 8))  # in the plan's dtype: other bits
    assert (want.tobytes() != planned.tobytes()) == (compute == BF16)


def test_a_compute_dtype_that_is_not_floating_is_a_type_error():
    with pytest.raises(TypeError, match="Tensor compute_dtype must be a floating dtype"):
        st.Tensor("w", compute_dtype=np.int8)


# MaxText's composite keys, as its hooks write them (HF -> MaxText): one hook makes
# several parameters, stacked on a new last axis that to_maxtext takes [..., i] of
def interleave(x, target_shape):  # gpt-oss: gate_up_proj's even and odd columns
    return np.stack([x[..., ::2], x[..., 1::2]], axis=-1)


def halves(x, target_shape):  # qwen3.5: gate_up_proj's halves, each transposed
    gate, up = np.split(x, 2, axis=-2)
    return np.stack([gate.swapaxes(-1, -2), up.swapaxes(-1, -2)], axis=-1)


def thirds(x, target_shape):  # np.split at given indices, one part transposed
    a, b, c = np.split(x, [2, 5], axis=1)
    return np.stack([a.T, b.T[:2], c.T[1:]], axis=-1)


@pytest.mark.parametrize(
    ("hook", "stored", "dtype"),
    [
        (interleave, (4, 6, 10), np.float32),
        (interleave, (4, 10), BF16),
        (halves, (4, 12, 6), np.float32),
        (halves, (2, 8, 4), BF16),
        (thirds, (4, 8), np.float32),
    ],
    ids=["interleave", "interleave-bias", "halves", "halves-bf16", "split-at"],
)
def test_each_part_of_a_composite_hooks_result_is_its_own_layout(tmp_path, hook, stored, dtype):
    """``followed(..., part=i)`` is the hook's result ``[..., i]`` (a strided slice, a
    half transposed), loaded bit for bit onto a sharded plan; no join is read."""
    array = np.random.default_rng(0).standard_normal(stored).astype(dtype)
    save_file({"w": array}, str(tmp_path / "m.safetensors"))
    whole = np.asarray(hook(array, None))
    shapes = {f"p{i}": whole.shape[:-1] for i in range(whole.shape[-1])}
    x = trace.stand_in("w", stored, np.dtype(dtype))
    table = {p: hooks.followed(hook, x, None, part=i) for i, p in enumerate(shapes)}
    assert all(isinstance(t, st.Tensor) for t in table.values()), table
    loaded = st.load(plan_for(shapes, dtype=dtype), tmp_path, names=table)
    for i, p in enumerate(shapes):
        assert np.asarray(loaded[p]).tobytes() == np.ascontiguousarray(whole[..., i]).tobytes()


def test_a_part_of_a_join_is_the_joined_part_and_an_uneven_split_is_named():
    e = [trace.stand_in(f"e{i}", shape, np.float32) for i, shape in enumerate([(4, 6), (6, 4)])]
    both = trace.stack([e[0].T, e[1]], axis=-1)  # two tensors: a Stack
    assert trace.picked(both, 0) == st.Tensor("e0", permute=(1, 0))
    assert trace.picked(both, 1) == st.Tensor("e1")
    # a part of the last axis of what is no stack: the slice of it
    assert trace.picked(e[0], 2) == st.Tensor("e0", shape=(4,), index=np.s_[0:4, 2:3])
    with pytest.raises(trace.Inexpressible, match="does not divide 6 into 4 equal parts"):
        hooks.followed(lambda x, s: np.split(x, 4, axis=1)[0], e[0], None)
    assert [p.shape for p in hooks.NUMPY.split(np.zeros((4, 6)), 3, axis=1)] == [(4, 2)] * 3
