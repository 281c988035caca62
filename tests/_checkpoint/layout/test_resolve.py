"""Stacked, concatenated, sliced and scaled parameters: ``Stack``, ``Concat``,
``Tensor(index=, scale=)``, read shard by shard, against numpy's own stack,
concatenate and slicing of the stored tensors, with bytes read == bytes owned."""

import re
import warnings

import jax
import ml_dtypes
import numpy as np
import pytest
from helpers import Reads, mesh8, owned_bytes, plan_of, stored

import meshinit
from meshinit.safetensors import Concat, Stack, Tensor

save_file = pytest.importorskip("safetensors.numpy").save_file


def assert_loaded(array, want, entry):
    assert array.sharding == entry.sharding
    assert array.dtype == want.dtype
    for shard in array.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index])


def layers(n, shape, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return {f"model.layers.{i}.w": rng.standard_normal(shape).astype(dtype) for i in range(n)}


@pytest.mark.parametrize(
    "axis, axes",
    [
        (1, ("tensor", "fsdp", None)),  # MaxText's [embed, layers, ...]: layers on fsdp
        (0, ("fsdp", None, "tensor")),  # the layer axis split: each half reads its layers
        (-1, (None, "fsdp", "tensor")),
    ],
)
def test_stack_is_numpys_stack_and_each_device_reads_only_its_own_bytes(tmp_path, axis, axes):
    held = layers(4, (8, 8))
    stored(tmp_path, held)
    want = np.stack(list(held.values()), axis=axis)
    plan = plan_of({"w": (want.shape, axes)})
    names = {"w": Stack([f"model.layers.{i}.w" for i in range(4)], axis=axis)}
    with Reads() as reads:
        loaded = meshinit.safetensors.load(plan, tmp_path, names=names)
    assert_loaded(loaded["w"], want, plan.entries[0])
    assert reads.values == [owned_bytes(plan, 4)]  # once per load; read == owned


def test_a_rule_builds_one_stack_for_every_layer_with_transforms(tmp_path):
    # MaxText's example: q_proj (heads * head_dim, d) of each layer as
    # (d, heads, head_dim), stacked at axis 1 into [embed, layers, heads, head_dim].
    n, d, heads, head_dim = 4, 8, 4, 2
    rng = np.random.default_rng(1)
    held = {
        f"model.layers.{i}.self_attn.{p}_proj.weight": rng.standard_normal(
            (heads * head_dim, d)
        ).astype(np.float32)
        for i in range(n)
        for p in ("q", "k")
    }
    stored(tmp_path, held)
    plan = plan_of(
        {
            f"decoder.layers.self_attention.{p}.kernel": (
                (d, n, heads, head_dim),
                ("fsdp", None, "tensor", None),
            )
            for p in ("query", "key")
        }
    )
    part = dict(shape=(heads, head_dim, -1), permute=(2, 0, 1))
    names = [
        (
            r"decoder\.layers\.self_attention\.(q|k)\w*\.kernel",
            Stack(
                [Tensor(rf"model.layers.{i}.self_attn.\1_proj.weight", **part) for i in range(n)],
                axis=1,
            ),
        )
    ]
    with Reads() as reads:
        loaded = meshinit.safetensors.load(plan, tmp_path, names=names)
    for entry in plan.entries:
        p = "q" if ".query." in entry.path else "k"
        per_layer = [
            held[f"model.layers.{i}.self_attn.{p}_proj.weight"]
            .reshape(heads, head_dim, d)
            .transpose(2, 0, 1)
            for i in range(n)
        ]
        assert_loaded(loaded[entry.path], np.stack(per_layer, axis=1), entry)
    assert reads.values == [owned_bytes(plan, 4)]


@pytest.mark.parametrize("sizes", [(3, 5), (4, 4), (1, 2, 5)])
def test_concat_is_numpys_concatenate_and_blocks_cut_across_parts(tmp_path, sizes):
    # 8 rows in parts of 3 and 5 over fsdp=2: each device's block (rows 0-3 or 4-7)
    # takes rows from both parts, or one.
    rng = np.random.default_rng(2)
    held = {f"p{i}": rng.standard_normal((n, 4)).astype(np.float32) for i, n in enumerate(sizes)}
    stored(tmp_path, held)
    want = np.concatenate(list(held.values()), axis=0)
    plan = plan_of({"fused": (want.shape, ("fsdp", "tensor"))})
    with Reads() as reads:
        loaded = meshinit.safetensors.load(
            plan, tmp_path, names={"fused": Concat(list(held), axis=0)}
        )
    assert_loaded(loaded["fused"], want, plan.entries[0])
    assert reads.values == [owned_bytes(plan, 4)]


def test_gemma_style_fused_kv_and_gating_from_separate_tensors(tmp_path):
    # gemma's kv_einsum: (2, kv_heads, d, head_dim) from k_proj and v_proj, each
    # (kv_heads * head_dim, d) in torch's layout; gating_einsum: (2, ffn, d).
    kv, d, hd, ffn = 2, 8, 4, 16
    rng = np.random.default_rng(3)
    held = {
        "k": rng.standard_normal((kv * hd, d)).astype(np.float32),
        "v": rng.standard_normal((kv * hd, d)).astype(np.float32),
        "gate": rng.standard_normal((ffn, d)).astype(np.float32),
        "up": rng.standard_normal((ffn, d)).astype(np.float32),
    }
    stored(tmp_path, held)
    plan = plan_of(
        {
            "kv_einsum": ((2, kv, d, hd), (None, "fsdp", "tensor", None)),
            "gating_einsum": ((2, ffn, d), (None, "tensor", "fsdp")),
        }
    )
    head = dict(shape=(kv, hd, d), permute=(0, 2, 1))
    names = {
        "kv_einsum": Stack([Tensor("k", **head), Tensor("v", **head)], axis=0),
        "gating_einsum": Stack(["gate", "up"], axis=0),
    }
    loaded = meshinit.safetensors.load(plan, tmp_path, names=names)
    kv_want = np.stack([held[n].reshape(kv, hd, d).transpose(0, 2, 1) for n in ("k", "v")])
    assert_loaded(loaded["kv_einsum"], kv_want, plan.entries[1])
    assert_loaded(loaded["gating_einsum"], np.stack([held["gate"], held["up"]]), plan.entries[0])


def test_a_fused_stored_tensor_feeds_several_parameters_by_index(tmp_path):
    # Phi-3's qkv_proj (q + k + v rows, d) and gate_up_proj, split into parameters.
    d, q_rows, kv_rows, ffn = 8, 16, 8, 12
    rng = np.random.default_rng(4)
    qkv = rng.standard_normal((q_rows + 2 * kv_rows, d)).astype(np.float32)
    gate_up = rng.standard_normal((2 * ffn, d)).astype(np.float32)
    stored(tmp_path, {"qkv_proj": qkv, "gate_up_proj": gate_up})
    plan = plan_of(
        {
            "q": ((d, 4, 4), ("fsdp", "tensor", None)),
            "k": ((d, kv_rows), ("fsdp", "tensor")),
            "v": ((kv_rows, d), ("tensor", "fsdp")),
            "gate": ((d, ffn), ("fsdp", "tensor")),
            "up": ((ffn, 2, 4), (None, "fsdp", "tensor")),
        }
    )
    names = {
        "q": Tensor("qkv_proj", index=np.s_[:q_rows], shape=(4, 4, d), permute=(2, 0, 1)),
        "k": Tensor("qkv_proj", index=np.s_[q_rows : q_rows + kv_rows], permute=(1, 0)),
        "v": Tensor("qkv_proj", index=np.s_[-kv_rows:]),
        "gate": Tensor("gate_up_proj", index=np.s_[:ffn], permute=(1, 0)),
        "up": Tensor("gate_up_proj", index=(slice(ffn, None), slice(None)), shape=(ffn, 2, 4)),
    }
    with Reads() as reads:
        loaded = meshinit.safetensors.load(plan, tmp_path, names=names)
    wants = {
        "q": qkv[:q_rows].reshape(4, 4, d).transpose(2, 0, 1),
        "k": qkv[q_rows : q_rows + kv_rows].T,
        "v": qkv[-kv_rows:],
        "gate": gate_up[:ffn].T,
        "up": gate_up[ffn:].reshape(ffn, 2, 4),
    }
    for entry in plan.entries:
        assert_loaded(loaded[entry.path], wants[entry.path], entry)
    assert reads.values == [owned_bytes(plan, 4)]
    found = meshinit.safetensors.inventory(plan, tmp_path, names=names)
    assert found.unused == ()  # both fused tensors are read by some part
    assert found.reads["up"] == ("gate_up_proj",)


def test_a_slice_along_a_later_axis_keeps_reading_only_owned_bytes(tmp_path):
    held = np.arange(8 * 12, dtype=np.float32).reshape(8, 12)
    stored(tmp_path, {"w": held})
    plan = plan_of({"a": ((8, 4), ("fsdp", "tensor")), "b": ((8, 2, 4), ("fsdp", None, "tensor"))})
    names = {
        "a": Tensor("w", index=np.s_[:, :4]),
        "b": Tensor("w", index=np.s_[:, 4:], shape=(8, 2, 4)),  # splitting an axis is a view
    }
    with Reads() as reads:
        loaded = meshinit.safetensors.load(plan, tmp_path, names=names)
    assert_loaded(loaded["a"], held[:, :4], plan.entries[0])
    assert_loaded(loaded["b"], held[:, 4:].reshape(8, 2, 4), plan.entries[1])
    assert reads.values == [owned_bytes(plan, 4)]


@pytest.mark.parametrize(
    "stored_dtype, planned",
    [
        (ml_dtypes.bfloat16, ml_dtypes.bfloat16),  # MaxText's default: bf16 in, bf16 out
        (np.float32, np.float32),
        (np.float32, ml_dtypes.bfloat16),  # cast to the planned dtype first, as MaxText
        (np.float16, np.float32),
    ],
)
def test_scale_gives_the_bits_of_maxtexts_query_scaling(tmp_path, stored_dtype, planned):
    head_dim = 128
    rng = np.random.default_rng(5)
    held = (rng.standard_normal((8, 16)) * 3).astype(stored_dtype)
    stored(tmp_path, {"q": held})
    plan = plan_of({"q": ((8, 16), ("fsdp", "tensor"))}, dtype=planned)
    scale = 1 / np.sqrt(head_dim)
    loaded = meshinit.safetensors.load(plan, tmp_path, names={"q": Tensor("q", scale=scale)})
    # MaxText 0.2.5's scale_query_layer on a tensor already in its save dtype:
    x = held.astype(planned)
    depth_scale = np.dtype("float32").type(1 / np.sqrt(head_dim))
    want = (x.astype(np.float32) * depth_scale).astype(x.dtype)
    got = np.asarray(loaded["q"])
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))  # bit for bit


# Every float dtype meshinit reads, by the format's name (float8_e8m0fnu from ml_dtypes
# 0.5), and every float dtype a plan may hold (float64 under jax.enable_x64).
STORED_FLOATS = {
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F32": np.float32,
    "F64": np.float64,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
    "F8_E4M3FNUZ": ml_dtypes.float8_e4m3fnuz,
    "F8_E5M2FNUZ": ml_dtypes.float8_e5m2fnuz,
    "F8_E8M0": getattr(ml_dtypes, "float8_e8m0fnu", None),
}
PLANNED_FLOATS = [np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)] + [
    np.dtype(getattr(ml_dtypes, n))
    for n in (
        "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
        "float8_e4m3b11fnuz", "float8_e3m4", "float8_e4m3", "float8_e8m0fnu",
    )
    if hasattr(ml_dtypes, n)
]  # fmt: skip


def maxtext_scaled(stored, planned, scale):
    """MaxText 0.2.5's route for a scaled tensor, with the planned dtype as its save
    dtype: ``to_maxtext``'s getter casts the stored tensor to the save dtype, then
    ``scale_query_layer`` computes in float32 and rounds back to that dtype (a float64
    plan in float64: MaxText's hooks never see float64)."""
    x = stored.astype(planned)
    work = np.float64 if x.dtype == np.float64 else np.float32
    return (x.astype(work) * work(scale)).astype(x.dtype)


@pytest.mark.parametrize("name", list(STORED_FLOATS))
def test_scale_rounds_as_maxtext_for_every_stored_and_planned_float(tmp_path, name):
    stored_dtype = STORED_FLOATS[name]
    if stored_dtype is None:
        pytest.skip(f"ml_dtypes {ml_dtypes.__version__} has no {name}")
    rng = np.random.default_rng(8)
    signed = (rng.standard_normal(128) * 3).astype(stored_dtype)
    positive = (np.abs(rng.standard_normal(128)) * 3 + 0.25).astype(stored_dtype)  # for e8m0
    tensors = {"positive": positive}
    if name != "F8_E8M0":  # no sign bit: e8m0 stores positives only
        tensors["signed"] = signed
    try:
        save_file(tensors, str(tmp_path / "m.safetensors"))
    except Exception as e:  # safetensors < 0.6 stores no float8 but E4M3 and E5M2
        pytest.skip(f"this safetensors package cannot store {name}: {e}")
    held = {p: positive if "e8m0" in p.name + name.lower() else signed for p in PLANNED_FLOATS}
    scale = 1 / 3  # rounds in every dtype: each rounding dropped or added shows
    mesh = mesh8()
    meshinit.clear_cache()  # the float64 entry's init is checked under x64, not from the cache
    with jax.enable_x64(True):
        init = jax.nn.initializers.zeros
        specs = {
            p.name: meshinit.param((128,), init, dtype=p, axes=("tensor",), mesh=mesh)
            for p in PLANNED_FLOATS
        }
        # float8 values that are the weights themselves (no block scale): a plain cast
        plain = name.startswith("F8_")
        names = {
            p.name: Tensor(
                "positive" if held[p] is positive else "signed", scale=scale, dequantize=not plain
            )
            for p in PLANNED_FLOATS
        }
        loaded = meshinit.safetensors.load(meshinit.plan(specs), tmp_path, names=names)
    meshinit.clear_cache()
    nmant = lambda d: ml_dtypes.finfo(d).nmant  # noqa: E731
    for planned in PLANNED_FLOATS:
        x = held[planned]
        want = maxtext_scaled(x, planned, scale)
        got = np.asarray(loaded[planned.name])
        assert got.dtype == planned, planned
        assert got.tobytes() == want.tobytes(), f"{name} -> {planned.name}: not MaxText's bits"
        # The values tell MaxText's order from the others wherever they differ:
        # rounded once from the stored values (where the cast to the plan rounds) ...
        once = (x.astype(np.float64) * scale).astype(planned)
        if nmant(planned) < nmant(x.dtype):
            assert once.tobytes() != want.tobytes(), f"{name} -> {planned.name}"
        # ... and rounded to the stored dtype before the cast (where the plan holds more)
        stored_first = (x.astype(np.float32) * np.float32(scale)).astype(x.dtype)
        if nmant(x.dtype) < nmant(planned):
            assert stored_first.astype(planned).tobytes() != want.tobytes(), planned.name


@pytest.mark.parametrize(
    "stored_dtype, planned, over",
    [
        (np.float32, np.float32, "overflows float32"),  # the product
        (ml_dtypes.bfloat16, ml_dtypes.bfloat16, "overflows float32"),
        (np.float16, np.float16, "is 131008.0: it overflows float16"),  # the rounding back
        (np.float32, np.float16, "is 131008.0: it overflows float16"),
        (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e4m3fn, "is 896.0: it overflows float8_e4m3fn"),
    ],
)
def test_a_scale_that_overflows_is_a_plan_error_naming_the_value(
    tmp_path, stored_dtype, planned, over, new_arrays
):
    # max / 2 times 4: the product overflows float32 (bf16 and f32 hold up to ~3.4e38),
    # or fits float32 and overflows the planned dtype when rounded back.
    top = float(ml_dtypes.finfo(planned).max) / 2
    held = np.full((4, 8), top, np.float64).astype(stored_dtype)
    held[0, 0] = np.inf  # an infinity stays one: not an overflow
    stored(tmp_path, {"model.q": held})
    plan = plan_of({"q": ((4, 8), ("fsdp", "tensor"))}, dtype=planned)
    with (
        warnings.catch_warnings(),
        new_arrays() as made,
        pytest.raises(meshinit.PlanError) as raised,
    ):
        warnings.simplefilter("error")  # numpy's RuntimeWarning no longer escapes
        meshinit.safetensors.load(plan, tmp_path, names={"q": Tensor("model.q", scale=4.0)})
    assert made == []
    (problem,) = raised.value.problems
    assert problem.path == "q"
    assert re.fullmatch(
        rf"tensor 'model\.q' holds {re.escape(str(float(held[0, 1])))}, which times scale=4\.0 "
        rf"{re.escape(over)}; plan a wider dtype",
        problem.message,
    ), problem.message
    fine = plan_of({"q": ((4, 8), ("fsdp", "tensor"))}, dtype=planned)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = meshinit.safetensors.load(fine, tmp_path, names={"q": Tensor("model.q", scale=0.25)})
    np.testing.assert_array_equal(np.asarray(got["q"]), maxtext_scaled(held, planned, 0.25))


def test_a_scale_beyond_float32_is_named_not_made_inf(tmp_path):
    stored(tmp_path, {"model.q": np.ones((4, 8), np.float32)})
    plan = plan_of({"q": ((4, 8), ("fsdp", "tensor"))}, dtype=ml_dtypes.bfloat16)
    with warnings.catch_warnings(), pytest.raises(meshinit.PlanError) as raised:
        warnings.simplefilter("error")
        meshinit.safetensors.load(plan, tmp_path, names={"q": Tensor("model.q", scale=1e300)})
    assert [(p.path, p.message) for p in raised.value.problems] == [
        (
            "q",
            "tensor 'model.q' is scaled by 1e+300, which overflows float32 (the product's "
            "dtype); plan a wider dtype",
        )
    ]


def test_a_stack_of_concats_is_maxtexts_scanned_fused_layout(tmp_path):
    n, d, ffn = 4, 8, 6
    rng = np.random.default_rng(6)
    held = {
        f"model.layers.{i}.mlp.{p}_proj.weight": rng.standard_normal((ffn, d)).astype(np.float32)
        for i in range(n)
        for p in ("gate", "up")
    }
    stored(tmp_path, held)
    plan = plan_of({"wi": ((d, n, 2 * ffn), ("fsdp", None, "tensor"))})
    names = [
        (
            r"wi",
            Stack(
                [
                    Concat(
                        [
                            Tensor(f"model.layers.{i}.mlp.gate_proj.weight", permute=(1, 0)),
                            Tensor(f"model.layers.{i}.mlp.up_proj.weight", permute=(1, 0)),
                        ],
                        axis=-1,
                    )
                    for i in range(n)
                ],
                axis=1,
            ),
        )
    ]
    with Reads() as reads:
        loaded = meshinit.safetensors.load(plan, tmp_path, names=names)
    want = np.stack(
        [
            np.concatenate(
                [held[f"model.layers.{i}.mlp.{p}_proj.weight"].T for p in ("gate", "up")], -1
            )
            for i in range(n)
        ],
        axis=1,
    )
    assert_loaded(loaded["wi"], want, plan.entries[0])
    assert reads.values == [owned_bytes(plan, 4)]
    found = meshinit.safetensors.inventory(plan, tmp_path, names=names)
    assert found.reads["wi"] == tuple(held)  # every layer's gate, then up, in order
    assert isinstance(found.loaded["wi"], Stack)


def test_every_part_that_cannot_fit_is_one_problem_naming_path_and_part(tmp_path, new_arrays):
    held = {
        "a": np.zeros((4, 4), np.float32),
        "b": np.zeros((4, 5), np.float32),
        "w": np.zeros((8, 12), np.float32),
    }
    stored(tmp_path, held)
    plan = plan_of(
        {
            "stack": ((2, 4, 4), (None, "fsdp", "tensor")),
            "concat": ((8, 4), ("fsdp", "tensor")),
            "far": ((4, 4, 2), (None, None, None)),
            "gone": ((3, 4, 4), (None, "fsdp", "tensor")),
            "merged": ((16,), ("fsdp",)),
            "shape": ((4, 8), ("fsdp", "tensor")),
        }
    )
    names = {
        "stack": Stack(["a", "b"], axis=0),
        "concat": Concat(["a", "b"], axis=0),
        "far": Stack(["a", "a"], axis=3),
        "gone": Stack(["a", "missing.0", Concat(["a", "missing.1"], axis=0)], axis=0),
        "merged": Tensor("w", index=np.s_[:4, :4], shape=(16,)),
        "shape": Stack(["a", "a"], axis=0),
    }
    with new_arrays() as made, pytest.raises(meshinit.PlanError) as raised:
        meshinit.safetensors.load(plan, tmp_path, names=names)
    assert made == []
    found = {p.path: p.message for p in raised.value.problems}
    assert found["stack"] == (
        "Stack parts give different shapes: 1 of 2 gives (4, 4), but part [1] tensor 'b' "
        "(F32) gives (4, 5); fix those parts' names or transforms"
    )
    assert found["concat"].startswith("Concat parts must agree on every axis but 0")
    assert found["far"] == "Stack axis 3 is out of range for 3 axes"
    assert re.fullmatch(
        r"Stack part \[1\] tensor 'missing\.0'.*, Stack part \[2\] Concat part \[1\] tensor "
        r"'missing\.1'.* are not in the files .*",
        found["gone"],
    ), found["gone"]
    assert "cannot be reshaped without a copy" in found["merged"]
    assert found["shape"] == "Stack of 2 parts along axis 0 gives shape (2, 4, 4), planned (4, 8)"
    assert len(found) == 6


def test_parts_that_do_not_fit_are_named_by_index_and_tensor_among_64(tmp_path):
    # A rule table's Stack over 64 layers: the message gives the shape most parts give
    # and names each part that differs by index and stored tensor (a nested part by its
    # tensors), not 64 shapes.
    n = 64
    held = {f"model.layers.{i}.w": np.zeros((8, 16), np.float32) for i in range(n)}
    held["model.layers.5.w"] = np.zeros((8, 12), np.float32)
    held["model.layers.40.w"] = np.zeros((12, 8), np.float32)  # transposed: (8, 12)
    held.update({"extra.a": np.zeros((8, 6), np.float32), "extra.b": np.zeros((8, 8), np.float32)})
    stored(tmp_path, held)
    plan = plan_of({"layers.w": ((n, 8, 16), (None, "fsdp", "tensor"))})
    parts = [Tensor(rf"model.\1.{i}.w", permute=(1, 0) if i == 40 else None) for i in range(n)]
    parts[63] = Concat(["extra.a", "extra.b"], axis=1)  # (8, 14)
    with pytest.raises(meshinit.PlanError) as raised:
        meshinit.safetensors.load(plan, tmp_path, names=[(r"(\w+)\.w", Stack(parts, axis=0))])
    (problem,) = raised.value.problems
    assert (problem.path, problem.message) == (
        "layers.w",
        "Stack parts give different shapes: 61 of 64 give (8, 16), but part [5] tensor "
        "'model.layers.5.w' (F32) gives (8, 12), part [40] tensor 'model.layers.40.w' "
        "(stored F32 (12, 8)) gives (8, 12), part [63] (Concat of 'extra.a', 'extra.b') "
        "gives (8, 14); fix those parts' names or transforms",
    )


def test_concat_parts_that_do_not_fit_are_named_and_the_rest_counted(tmp_path):
    # Parts agree on every axis but the joined one: (8, *); seven that do not are
    # named by index and tensor, five of them, and two more counted.
    held = {f"p{i}": np.zeros((8, 2), np.float32) for i in range(20)}
    for i in range(13, 20):
        held[f"p{i}"] = np.zeros((4, 2), np.float32)
    held["p19"] = np.zeros((8,), np.float32)  # another rank
    stored(tmp_path, held)
    plan = plan_of({"fused": ((8, 40), ("fsdp", "tensor"))})
    nested = Stack([f"p{i}" for i in range(20)], axis=0)
    names = {"fused": Concat([f"p{i}" for i in range(20)], axis=1)}
    with pytest.raises(meshinit.PlanError) as raised:
        meshinit.safetensors.inventory(plan, tmp_path, names=names)
    (problem,) = raised.value.problems
    assert problem.message == (
        "Concat parts must agree on every axis but 1: 13 of 20 give (8, *), but part [13] "
        "tensor 'p13' (F32) gives (4, 2), part [14] tensor 'p14' (F32) gives (4, 2), part "
        "[15] tensor 'p15' (F32) gives (4, 2), part [16] tensor 'p16' (F32) gives (4, 2), "
        "part [17] tensor 'p17' (F32) gives (4, 2) and 2 more; fix those parts' names or "
        "transforms"
    )
    assert "p0" not in problem.message and "p19" not in problem.message
    # nested: the inner Stack is named by its label, its parts by their tensors
    plan = plan_of({"fused": ((20, 8, 2), (None, "fsdp", None))})
    names = {"fused": Concat([nested], axis=0)}
    with pytest.raises(meshinit.PlanError) as raised:
        meshinit.safetensors.inventory(plan, tmp_path, names=names)
    assert raised.value.problems[0].message.startswith(
        "Concat part [0] Stack parts give different shapes: 13 of 20 give (8, 2), but part "
        "[13] tensor 'p13' (F32) gives (4, 2),"
    )


def test_scale_is_refused_on_an_integer_tensor(tmp_path):
    stored(tmp_path, {"i": np.zeros((4, 4), np.int32)})
    plan = plan_of({"i": ((4, 4), ("fsdp", "tensor"))}, dtype=np.int32)
    with pytest.raises(meshinit.PlanError, match="i: tensor 'i' .* scale= is for floating-point"):
        meshinit.safetensors.load(plan, tmp_path, names={"i": Tensor("i", scale=0.5)})


def test_a_stack_with_an_absent_part_is_skipped_whole_with_missing_skip(tmp_path):
    stored(tmp_path, {"a": np.ones((4, 4), np.float32), "extra": np.ones(2, np.float32)})
    plan = plan_of({"s": ((2, 4, 4), (None, "fsdp", "tensor"))})
    names = {"s": Stack(["a", "b"], axis=0)}
    found = meshinit.safetensors.inventory(plan, tmp_path, names=names)
    assert found.missing == {"s": "b"} and found.unused == ("a", "extra")  # nothing reads 'a'
    with pytest.warns(meshinit.UnusedTensorWarning, match="'a' is a part of 's'"):
        loaded = meshinit.safetensors.load(plan, tmp_path, names=names, missing="skip")
    assert loaded == {}


def test_a_part_that_overflows_the_planned_dtype_leaves_nothing_alive(tmp_path, new_arrays):
    big = np.full((4, 4), 1e30, np.float32)
    stored(tmp_path, {"ok": np.ones((4, 4), np.float32), "big": big})
    plan = plan_of(
        {"first": ((4, 4), ("fsdp", "tensor")), "s": ((2, 4, 4), (None, "fsdp", "tensor"))},
        dtype=np.float16,
    )
    names = {"first": "ok", "s": Stack(["ok", "big"], axis=0)}
    with new_arrays() as made, pytest.raises(meshinit.PlanError, match=r"s: Stack part \[1\] "):
        meshinit.safetensors.load(plan, tmp_path, names=names)
    assert made == []


@pytest.mark.parametrize(
    "make, error",
    [
        (lambda: Tensor("w", index=np.s_[::-1]), "a step must be positive"),
        (lambda: Tensor("w", index=np.s_[..., ..., :2]), "at most one Ellipsis"),
        (lambda: Tensor("w", index=3), "basic slices with a positive step"),
        (lambda: Tensor("w", scale="2"), "scale must be a Python float"),
        (lambda: Stack([], axis=0), "non-empty sequence"),
        (lambda: Stack("ab", axis=0), "non-empty sequence"),
        (lambda: Concat(["a", 3], axis=0), r"Concat parts\[1\] must be a tensor name"),
        (lambda: Concat(["a"], axis=1.0), "axis must be an int"),
    ],
)
def test_malformed_parts_are_type_errors(make, error):
    with pytest.raises(TypeError, match=error):
        make()


def maxtext_query(hf, heads, head_dim, scale):
    """MaxText 0.2.5's HF -> MaxText query hooks, in its order: reshape_kernel
    (transpose, reshape), adjust_rope (HF's halves to MaxText's interleaved pairs),
    scale_query_layer (float32, back to the dtype)."""
    x = hf.transpose().reshape(hf.shape[1], heads, head_dim)
    half = head_dim // 2
    x = np.stack([x[..., :half], x[..., half:]], axis=-1).reshape(x.shape)
    if scale:
        depth_scale = np.dtype("float32").type(1 / np.sqrt(head_dim))
        x = (x.astype(np.float32) * depth_scale).astype(x.dtype)
    return x


@pytest.mark.parametrize("axes", [("fsdp", "tensor", None), ("fsdp", None, "tensor")])
def test_out_shape_interleaves_rotary_halves_as_maxtexts_adjust_rope(tmp_path, axes):
    d, heads, head_dim, n = 8, 4, 8, 2
    rng = np.random.default_rng(7)
    held = {
        f"model.layers.{i}.self_attn.q_proj.weight": rng.standard_normal(
            (heads * head_dim, d)
        ).astype(ml_dtypes.bfloat16)
        for i in range(n)
    }
    stored(tmp_path, held)
    plan = plan_of(
        {"query": ((d, n, heads, head_dim), (axes[0], None, *axes[1:]))}, dtype=ml_dtypes.bfloat16
    )
    rope = dict(
        shape=(heads, 2, head_dim // 2, -1),
        permute=(3, 0, 2, 1),
        out_shape=(d, heads, head_dim),
        scale=1 / np.sqrt(head_dim),
    )
    names = {"query": Stack([Tensor(name, **rope) for name in held], axis=1)}
    with Reads() as reads:
        loaded = meshinit.safetensors.load(plan, tmp_path, names=names)
    want = np.stack([maxtext_query(w, heads, head_dim, True) for w in held.values()], axis=1)
    assert_loaded(loaded["query"], want, plan.entries[0])
    assert reads.values == [owned_bytes(plan, 2)]


def test_out_shape_refuses_what_is_no_merge_and_blocks_that_cut_a_row(tmp_path):
    stored(tmp_path, {"w": np.zeros((6, 8), np.float32), "v": np.zeros((2, 3, 8), np.float32)})
    plan = plan_of({"cut": ((8, 6), (None, "fsdp")), "split": ((4, 12), (None, None))})
    names = {
        "cut": Tensor("w", shape=(3, 2, 8), permute=(2, 0, 1), out_shape=(8, 6)),
        "split": Tensor("v", permute=(2, 0, 1), out_shape=(4, 12)),
    }
    with pytest.raises(meshinit.PlanError) as raised:
        meshinit.safetensors.inventory(plan, tmp_path, names=names)
    found = {p.path: p.message for p in raised.value.problems}
    assert "the block [0:8, 0:3] cuts a merged axis within a row" in found["cut"]
    assert "does not merge side-by-side axes of the transposed view (8, 2, 3)" in found["split"]
