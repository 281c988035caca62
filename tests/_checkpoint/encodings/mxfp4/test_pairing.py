"""MXFP4 checkpoints (gpt-oss as published): an ``X_blocks``/``X_scales`` pair is read as
the tensor ``X`` transformers' ``convert_moe_packed_tensors`` makes of it, dequantized on
the device shard by shard, with its bits; what cannot be read so is refused, naming
the path, the tensors and the fix."""

import json

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import Reads, plan_on, quantized_folder, xy_mesh

import meshinit
from meshinit import safetensors as st

pytest.importorskip("safetensors.numpy")

BF16 = ml_dtypes.bfloat16
MXFP4 = {"quant_method": "mxfp4", "modules_to_not_convert": ["router", "embed_tokens"]}
UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32}
FP4_VALUES = [
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
]


def convert_moe_packed_tensors(blocks, scales, dtype=BF16):
    """A numpy port of transformers' ``integrations.mxfp4.convert_moe_packed_tensors``
    (5.25): the table value of each nibble (the low one first), times 2^(byte - 127),
    rounded once to ``dtype``; its groups and rows transposed."""
    assert blocks.shape[:-1] == scales.shape
    *prefix, g, b = blocks.shape
    lut = np.array(FP4_VALUES, np.float64)
    out = np.empty((*prefix, g, 2 * b), np.float64)
    out[..., 0::2] = lut[blocks & 0x0F]
    out[..., 1::2] = lut[blocks >> 4]
    out = np.ldexp(out, scales.astype(np.int32)[..., None] - 127).astype(dtype)  # one rounding
    return out.reshape(*prefix, g * 2 * b).swapaxes(1, 2)


def test_the_numpy_port_is_transformers_function():
    """Where torch is installed (CI's MaxText venv), transformers' own function against
    the port: every dtype the load plans, exponent bytes 2 to 254 (overflows to inf in
    both) and float16's subnormal range."""
    torch = pytest.importorskip("torch")
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors as theirs

    rng = np.random.default_rng(0)
    kinds = ((torch.bfloat16, BF16, torch.int16), (torch.float32, np.float32, torch.int32))
    kinds += ((torch.float16, np.float16, torch.int16),)
    for low, high in ((2, 255), (100, 150)):
        blocks, scales = mx_pair(rng, (3, 10, 4, 16), low=low, high=high)
        for dtype, ours, same in kinds:
            got = theirs(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=dtype)
            with np.errstate(over="ignore"):
                want = convert_moe_packed_tensors(blocks, scales, ours)
            assert (got.view(same).numpy().view(bits(want).dtype) == bits(want)).all()


def bits(x):
    x = np.asarray(x)
    return x.view(UINT[x.dtype.itemsize])


def mx_pair(rng, shape, low=112, high=132):
    """Random blocks ``[E, R, G, B]`` (every nibble) and exponents in [low, high)."""
    blocks = rng.integers(0, 256, shape, dtype=np.uint8)
    return blocks, rng.integers(low, high, shape[:-1], dtype=np.uint8)


def write(tmp_path, tensors, config=MXFP4):
    return quantized_folder(tmp_path, tensors, config)


# [E, K, R] as planned; the mesh; the spec: K cut mid-group (48 of 32), E and R split
CASES = {
    "k_mid_group": ((4, 192, 24), (2, 4), ("x", "y", None)),
    "r_and_e": ((4, 96, 24), (2, 4), ("x", None, "y")),
    "k_across": ((4, 192, 24), (4, 2), (None, "x", "y")),
}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.float16])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("explicit", [False, True])
def test_mxfp4_loads_with_transformers_bits(tmp_path, dtype, case, explicit):
    (e, k, r), grid, spec = CASES[case]
    rng = np.random.default_rng(len(case))
    low, high = (112, 132) if dtype != jnp.float16 else (100, 128)
    blocks, scales = mx_pair(rng, (e, r, k // 32, 16), low, high)
    name = "model.layers.0.mlp.experts.gate_up_proj"
    folder = write(tmp_path, {f"{name}_blocks": blocks, f"{name}_scales": scales})
    plan = plan_on(xy_mesh(grid, explicit), {name: (e, k, r)}, dtype, spec)
    with Reads() as reads:
        got = st.load(plan, folder)[name]  # no names=: the name transformers gives it
    want = convert_moe_packed_tensors(blocks, scales, np.dtype(dtype))
    assert got.dtype == dtype and got.sharding == plan.entries[0].sharding
    assert (bits(got) == bits(want)).all()
    for shard in got.addressable_shards:
        assert (bits(shard.data) == bits(want[shard.index])).all()
    # each distinct block once: 16 bytes and an exponent per group, as many groups
    # for every block as the most any reaches
    cuts = [range(k)[shard.index[1]] for shard in got.addressable_shards]
    groups = max(-(-c.stop // 32) - c.start // 32 for c in cuts)
    distinct = {str(shard.index): shard.data.shape for shard in got.addressable_shards}
    assert sum(reads.values) == sum(ne * nr * groups * 17 for ne, _, nr in distinct.values())


def test_an_odd_start_inside_a_group_and_gpt_oss_interleaved_columns(tmp_path):
    """gpt-oss's wi_0 and wi_1 are gate_up_proj's even and odd columns (MaxText's
    ``interleave``); a slice of K from 1 puts shards' first k inside a group and odd."""
    rng = np.random.default_rng(1)
    blocks, scales = mx_pair(rng, (4, 48, 3, 16))
    name = "gate_up_proj"
    folder = write(tmp_path, {f"{name}_blocks": blocks, f"{name}_scales": scales})
    mesh = xy_mesh((2, 4), True)
    want = convert_moe_packed_tensors(blocks, scales)
    plan = plan_on(mesh, {"wi_0": (4, 94, 24), "wi_1": (4, 96, 24)}, jnp.bfloat16, ("y", "x", None))
    names = {
        "wi_0": st.Tensor(name, index=np.s_[:, 1:95, 0::2]),
        "wi_1": st.Tensor(name, index=np.s_[:, :, 1::2]),
    }
    got = st.load(plan, folder, names=names, unused="error")
    assert (bits(got["wi_0"]) == bits(want[:, 1:95, 0::2])).all()
    assert (bits(got["wi_1"]) == bits(want[:, :, 1::2])).all()
    # a permuted view: [E, R, K]
    plan = plan_on(mesh, {"t": (4, 48, 96)}, jnp.float32, (None, "x", "y"))
    got = st.load(plan, folder, names={"t": st.Tensor(name, permute=(0, 2, 1))})["t"]
    wide = convert_moe_packed_tensors(blocks, scales, np.float32)
    assert (bits(got) == bits(wide.transpose(0, 2, 1))).all()


def layers_of(tmp_path, layers):
    rng = np.random.default_rng(layers)
    tensors, want = {}, []
    for i in range(layers):
        name = f"model.layers.{i}.mlp.experts.down_proj"
        blocks, scales = mx_pair(rng, (4, 32, 2, 16))
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        want.append(convert_moe_packed_tensors(blocks, scales))
    folder = write(tmp_path, tensors)
    names = [f"model.layers.{i}.mlp.experts.down_proj" for i in range(layers)]
    return folder, st.Stack([st.Tensor(n) for n in names], axis=1), np.stack(want, 1)


@pytest.mark.parametrize("explicit", [False, True])
def test_a_stack_of_layers_compiles_independent_of_depth(tmp_path, count_compiles, explicit):
    from meshinit._checkpoint.encodings.mxfp4 import pairing as mxfp4

    mesh = xy_mesh((2, 4), explicit)
    counts = []
    for layers in (2, 4):
        folder, stack, want = layers_of(tmp_path / str(layers), layers)
        plan = plan_on(mesh, {"wo": want.shape}, jnp.bfloat16, ("x", None, "y", None))
        mxfp4.program.cache_clear()
        with count_compiles() as compiled:
            got = st.load(plan, folder, names={"wo": stack})["wo"]
        assert (bits(got) == bits(want)).all()  # [E, layers, K, R]
        counts.append((compiled.count, mxfp4.program.cache_info().misses))
    assert counts[0] == counts[1] and counts[0][1] == 1


def test_the_inventory_says_what_is_dequantized_and_claims_the_pair(tmp_path):
    folder, stack, want = layers_of(tmp_path, 2)
    plan = plan_on(xy_mesh((2, 4), False), {"wo": want.shape}, jnp.bfloat16, (None,) * 4)
    found = st.inventory(plan, folder, names={"wo": stack})
    assert found.unused == ()
    assert found.dequantized == {
        "wo": "MXFP4 'model.layers.0.mlp.experts.down_proj_blocks' x "
        "'model.layers.0.mlp.experts.down_proj_scales' and 1 more (e2m1 x e8m0, groups of "
        "32) -> bfloat16"
    }
    assert "wo <- MXFP4" in str(found)
    # planned as uint8, the pair loads as stored
    rng = np.random.default_rng(2)
    blocks, scales = mx_pair(rng, (2, 8, 2, 16))
    folder = write(tmp_path / "kept", {"w_blocks": blocks, "w_scales": scales})
    mesh = xy_mesh((2, 4), False)
    plan = plan_on(mesh, {"w_blocks": blocks.shape, "w_scales": scales.shape}, jnp.uint8, None)
    got = st.load(plan, folder, unused="error")
    assert (np.asarray(got["w_blocks"]) == blocks).all()
    assert (np.asarray(got["w_scales"]) == scales).all()


def refused(plan, folder, names=None, match=(), read=False):
    with Reads() as reads, pytest.raises(meshinit.PlanError) as e:
        st.load(plan, folder, names=names, unused="ignore")
    if not read:
        assert reads.values == [] and "nothing was read" in str(e.value)
    message = "\n".join(str(p) for p in e.value.problems)
    for needle in [match] if isinstance(match, str) else match:
        assert needle in message, f"{needle!r} not in {message}"
    return message


def test_what_is_not_read_dequantized_is_refused_by_name(tmp_path):
    rng = np.random.default_rng(4)
    blocks, scales = mx_pair(rng, (2, 8, 2, 16))
    tensors = {"w_blocks": blocks, "w_scales": scales, "b": np.zeros((2, 64), np.float32)}
    mesh = xy_mesh((2, 4), False)
    plan = plan_on(mesh, {"w": (2, 64, 8)}, jnp.bfloat16, None)
    refused(
        plan,
        write(tmp_path / "none", tensors, None),
        match=("w: it reads the MXFP4 tensor 'w_blocks'", "no quant"),
    )
    fp8 = {"quant_method": "fp8"}
    refused(plan, write(tmp_path / "fp8", tensors, fp8), match="says quant_method 'fp8'")
    folder = write(tmp_path / "ok", tensors)
    ints = plan_on(mesh, {"w": (2, 64, 8)}, jnp.int32, None)
    refused(ints, folder, match="is MXFP4 (its _blocks and _scales), planned int32")
    flat = plan_on(mesh, {"w": (2, 512)}, jnp.bfloat16, None)
    refused(flat, folder, {"w": st.Tensor("w", shape=(2, -1))}, "a reshape to (2, 512)")
    steps = plan_on(mesh, {"w": (2, 32, 8)}, jnp.bfloat16, None)
    refused(steps, folder, {"w": st.Tensor("w", index=np.s_[:, ::2])}, "steps along its groups")
    plain = plan_on(mesh, {"w": (2, 64, 8)}, jnp.bfloat16, None)
    names = {"w": st.Tensor("w", dequantize=False)}
    refused(plain, folder, names, "tensor 'w' is MXFP4 (its _blocks and _scales), read with "
            "dequantize=False: MXFP4 has no plain cast")  # fmt: skip
    mixed = plan_on(mesh, {"w": (2, 64, 9)}, jnp.bfloat16, None)
    names = {"w": st.Concat([st.Tensor("w"), st.Tensor("b", shape=(2, 64, 1))], axis=2)}
    refused(mixed, folder, names, "with other tensors")


def layered_pairs(rng, layers):
    """``layers.{i}.w_blocks`` and ``_scales`` of ``layers`` layers, (2, 8, 2, 16)."""
    tensors = {}
    for i in range(layers):
        tensors[f"layers.{i}.w_blocks"], tensors[f"layers.{i}.w_scales"] = mx_pair(
            rng, (2, 8, 2, 16)
        )
    return tensors


def test_a_config_without_mxfp4_is_one_problem_for_every_layer_alike(tmp_path):
    folder = write(tmp_path, layered_pairs(np.random.default_rng(8), 3), None)
    mesh = xy_mesh((2, 4), False)
    plan = plan_on(mesh, {f"layers.{i}.w": (2, 64, 8) for i in range(3)}, jnp.bfloat16, None)
    message = refused(plan, folder, match="layers.{0..2}.w: it reads the MXFP4 tensor "
                                          "'layers.{0..2}.w_blocks'")  # fmt: skip
    assert message.count("declares no quantization") == 1


@pytest.mark.parametrize(
    "text, said",
    [
        (b'{"quantization_config": {"quant_method": "mxf', "is not JSON ("),
        (b'{"quantization_config": "mxfp4"}', 'quantization_config holds the JSON string "mxfp4"'),
        (
            b'{"text_config": {"quantization_config": ["mxfp4"]}}',
            'text_config.quantization_config holds the JSON array ["mxfp4"], not an object',
        ),
        (
            b'{"quantization_config": {"quant_method": ["mxfp4"]}}',
            'quantization_config.quant_method holds the JSON array ["mxfp4"], not a string',
        ),
    ],
)
def test_a_config_that_cannot_be_read_is_refused_naming_it_not_as_no_quantization(
    tmp_path, text, said, new_arrays
):
    folder = write(tmp_path, layered_pairs(np.random.default_rng(9), 2), None)
    (folder / "config.json").write_bytes(text)
    plan = plan_on(xy_mesh((2, 4), True), {f"layers.{i}.w": (2, 64, 8) for i in range(2)},
                   jnp.bfloat16, None)  # fmt: skip
    config = str(folder / "config.json")
    with new_arrays() as made:
        refused(plan, folder, match=f"{config}: {said}")
    assert not made, made
    with pytest.raises(meshinit.PlanError, match="meshinit.safetensors.inventory") as e:
        st.inventory(plan, folder)
    assert [p.path for p in e.value.problems] == [config]  # once, and no guess past it
    assert said in e.value.problems[0].message


@pytest.mark.parametrize(
    "byte,dtype,match,fix",
    [
        (255, jnp.bfloat16, "exponent byte 255, NaN in e8m0", "download or convert it again"),
        (1, jnp.bfloat16, "exponent byte 1 under a non-zero value", "on the host first"),
        (141, jnp.float16, "byte 141 under values that overflow float16", "plan float32 or b"),
        (253, jnp.float32, "byte 253 under values that overflow float32", "no float is wider"),
    ],
)
def test_exponents_the_device_cannot_apply_are_refused_as_they_are_read(
    tmp_path, byte, dtype, match, fix
):
    rng = np.random.default_rng(5)
    blocks, scales = mx_pair(rng, (2, 8, 2, 16))
    blocks[1, 3, 1, :] = 0x77  # every value 6.0 in that group
    scales[1, 3, 1] = byte
    folder = write(tmp_path, {"w_blocks": blocks, "w_scales": scales})
    plan = plan_on(xy_mesh((2, 4), False), {"w": (2, 64, 8)}, dtype, ("x", None, "y"))
    refused(plan, folder, match=("w: 'w_scales' holds the", match, fix), read=True)


def test_zero_values_under_exponents_zero_and_one_load(tmp_path):
    """Bytes 0 and 1 under +-0 only (a group of zeros) give +-0, as the reference."""
    rng = np.random.default_rng(6)
    blocks, scales = mx_pair(rng, (2, 8, 2, 16))
    blocks[0, 2, 0, :] = 0x08  # +0 then -0
    blocks[1, 5, 1, :] = 0x80
    scales[0, 2, 0], scales[1, 5, 1] = 0, 1
    folder = write(tmp_path, {"w_blocks": blocks, "w_scales": scales})
    plan = plan_on(xy_mesh((2, 4), False), {"w": (2, 64, 8)}, jnp.bfloat16, ("x", None, "y"))
    got = st.load(plan, folder)["w"]
    assert (bits(got) == bits(convert_moe_packed_tensors(blocks, scales))).all()


U8 = np.uint8
UNPAIRED = {
    "a scales shape unlike blocks[:-1]": (
        {"w_blocks": np.zeros((2, 8, 2, 16), U8), "w_scales": np.zeros((2, 8, 3), U8)},
        "'w_blocks' (U8 (2, 8, 2, 16)) and 'w_scales' (U8 (2, 8, 3)) do not form an MXFP4 "
        "pair: the scales' shape is not the blocks' without its last axis, (2, 8, 2)",
    ),
    "no scales": (
        {"w_blocks": np.zeros((2, 8, 2, 16), U8)},
        "'w_blocks' (U8 (2, 8, 2, 16)) has no 'w_scales' beside it: an MXFP4 tensor is "
        "read from both",
    ),
    "no blocks": (
        {"w_scales": np.zeros((2, 8, 2), U8)},
        "'w_scales' (U8 (2, 8, 2)) has no 'w_blocks' beside it: an MXFP4 tensor is read from both",
    ),
    "I8 blocks": (
        {"w_blocks": np.zeros((2, 8, 2, 16), np.int8), "w_scales": np.zeros((2, 8, 2), U8)},
        "'w_blocks' (I8 (2, 8, 2, 16)) and 'w_scales' (U8 (2, 8, 2)) do not form an MXFP4 "
        "pair: both are stored as U8 (gpt-oss's bytes), the blocks here as I8",
    ),
    "F8_E8M0 scales": (
        {"w_blocks": np.zeros((2, 8, 2, 16), U8), "w_scales": np.zeros((2, 8, 2), U8)},
        "'w_blocks' (U8 (2, 8, 2, 16)) and 'w_scales' (F8_E8M0 (2, 8, 2)) do not form an "
        "MXFP4 pair: both are stored as U8 (gpt-oss's bytes), the scales here as F8_E8M0",
    ),
    "3-D blocks": (
        {"w_blocks": np.zeros((8, 2, 16), U8), "w_scales": np.zeros((8, 2), U8)},
        "'w_blocks' (U8 (8, 2, 16)) and 'w_scales' (U8 (8, 2)) do not form an MXFP4 pair: "
        "the blocks are 4-D ([experts, rows, groups, bytes]), these 3-D",
    ),
}


def retyped(path, name, dtype):
    """The safetensors file at ``path`` with tensor ``name``'s header dtype set to
    ``dtype`` (its bytes kept): a dtype that numpy's writer cannot write."""
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    header[name]["dtype"] = dtype
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    path.write_bytes(len(new).to_bytes(8, "little") + new + data[8 + n :])


@pytest.mark.parametrize("case", list(UNPAIRED))
def test_a_pair_that_does_not_form_says_why_naming_both_tensors(tmp_path, case):
    tensors, said = UNPAIRED[case]
    folder = write(tmp_path, tensors)
    if "E8M0" in case:  # e8m0 bytes, as safetensors' F8_E8M0 names them
        retyped(folder / "model-00001-of-00001.safetensors", "w_scales", "F8_E8M0")
        from safetensors import safe_open

        try:
            safe_open(folder / "model-00001-of-00001.safetensors", "numpy").keys()
        except Exception:  # safetensors before 0.5 knows no F8_E8M0, and refuses the file
            pytest.skip("this safetensors package refuses F8_E8M0")
    plan = plan_on(xy_mesh((2, 4), False), {"w": (2, 64, 8)}, jnp.bfloat16, None)
    with pytest.raises(meshinit.PlanError) as e:
        st.load(plan, folder, unused="ignore")
    message = str(e.value)
    assert f"w: tensor 'w' is not in the files, and {said}" in message, message
    assert "did you mean" not in message, message


def test_the_typo_in_the_overflow_fix_is_gone():
    from meshinit._checkpoint.encodings.mxfp4 import program

    raw = np.full((1, 1, 1, 1, 16), 0x77, U8)
    exps = np.full((1, 1, 1, 1), 141, U8)
    pair = type("P", (), {"quant": type("Q", (), {"scales": type("S", (), {"name": "w_scales"})})})
    with pytest.raises(meshinit.PlanError) as e:
        program.checked(raw, exps, (np.dtype(np.float16),) * 2, "w", [(pair, None)])
    message = str(e.value)
    assert "or;" not in message and "plan float32 or bfloat16, or dequantize" in message, message


@pytest.mark.parametrize("spec", [(None, "x", "y"), (None, None, None)])
@pytest.mark.parametrize("inside", [False, True])
def test_an_exponent_the_view_never_reads_loads_on_every_sharding(tmp_path, spec, inside):
    """The view reads K 0 to 95 of 256 (groups 0 to 2 of 8). Split in 4, a block of 24
    from K 72 takes groups 2 and 3 (every block takes as many groups as the most any
    needs, 2); a NaN exponent of group 3 is never applied, however K is split, and one
    of group 2 is refused, however split."""
    rng = np.random.default_rng(9)
    blocks, scales = mx_pair(rng, (2, 8, 8, 16))
    scales[1, 3, 2 if inside else 3] = 255
    folder = write(tmp_path, {"w_blocks": blocks, "w_scales": scales})
    mesh = xy_mesh((4, 2), False)
    plan = plan_on(mesh, {"w": (2, 96, 8)}, jnp.bfloat16, spec)
    view = {"w": st.Tensor("w", index=np.s_[:, :96])}
    if inside:
        refused(plan, folder, view, match="'w_scales' holds the exponent byte 255", read=True)
        return
    got = st.load(plan, folder, names=view)["w"]
    assert (bits(got) == bits(convert_moe_packed_tensors(blocks, scales)[:, :96])).all()


@pytest.mark.parametrize("spec", [("x", None, None, "y"), (None, None, None, None)])
def test_a_bad_exponent_in_a_stack_names_its_own_layer(tmp_path, spec):
    tensors = layered_pairs(np.random.default_rng(10), 4)
    tensors["layers.2.w_scales"][1, 3, 1] = 255
    folder = write(tmp_path, tensors)
    plan = plan_on(xy_mesh((2, 4), False), {"w": (4, 2, 64, 8)}, jnp.bfloat16, spec)
    names = {"w": st.Stack([f"layers.{i}.w" for i in range(4)], axis=0)}
    message = refused(
        plan, folder, names, "w: 'layers.2.w_scales' holds the exponent byte 255", True
    )
    assert "layers.0" not in message and "stacked" not in message, message


@pytest.mark.parametrize("spec", [(None, "x", "y"), (None, None, None)])
def test_a_value_outside_the_view_in_a_group_it_reads_is_not_checked(tmp_path, spec):
    """The view reads K 0 to 47 of 64: group 1 (K 32 to 63) only in part. A 6.0 at K 60
    under exponent byte 141 would overflow float16 (98304), but the view never reads
    it; the 0.5s it reads there fit (8192). A 6.0 at K 40 is read, and refused."""
    blocks, scales = mx_pair(np.random.default_rng(11), (2, 8, 2, 16))
    blocks[1, 3, 1, :] = 0x11  # every value 0.5
    scales[1, 3, 1] = 141
    mesh = xy_mesh((4, 2), False)
    plan = plan_on(mesh, {"w": (2, 48, 8)}, jnp.float16, spec)
    view = {"w": st.Tensor("w", index=np.s_[:, :48])}
    for k, loads in ((60, True), (40, False)):
        held = blocks.copy()
        held[1, 3, 1, (k - 32) // 2] = 0x17  # K k: 6.0 (its byte's low nibble), K k+1: 0.5
        folder = write(tmp_path / str(k), {"w_blocks": held, "w_scales": scales})
        if not loads:
            refused(plan, folder, view, "byte 141 under values that overflow float16", True)
            continue
        got = st.load(plan, folder, names=view)["w"]
        want = convert_moe_packed_tensors(held, scales, np.float64)[:, :48].astype(np.float16)
        assert (bits(got) == bits(want)).all()


def test_the_dequantization_compiles_with_the_callers_compiler_options(tmp_path):
    # as FP8's (tests/_checkpoint/encodings/fp8/test_pairing.py): the caller's options
    # reach the compile on the worker thread
    rng = np.random.default_rng(70)
    blocks, scales = mx_pair(rng, (4, 24, 6, 16))
    name = "model.layers.0.mlp.experts.down_proj"
    folder = write(tmp_path, {f"{name}_blocks": blocks, f"{name}_scales": scales})
    plan = plan_on(xy_mesh((2, 4), False), {name: (4, 192, 24)}, jnp.bfloat16, ("x", None, "y"))
    meshinit.clear_cache()
    with meshinit.options(compiler_options={"xla_meshinit_no_such_option": True}):
        with pytest.raises(Exception, match="xla_meshinit_no_such_option"):
            st.load(plan, folder)
    got = st.load(plan, folder)[name]
    assert (bits(got) == bits(convert_moe_packed_tensors(blocks, scales))).all()
