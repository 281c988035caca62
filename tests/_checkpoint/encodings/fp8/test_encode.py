"""FP8 on export: a weight quantized on the devices, inside a jit over an array sharded in
any way, has the bits of DeepGEMM's ``per_block_cast_to_fp8`` (ported below), decodes
within float8's rounding, and loads back through meshinit's own reader with the bits of
DeepSeek's ``weight_dequant``; which tensors are quantized, and what ``config.json``
lists as not, agree with how transformers and vLLM read that list."""

import json
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import plan_on, quantized_folder
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from meshinit import safetensors as st
from meshinit._checkpoint.encodings import config as quant_config
from meshinit._checkpoint.encodings.fp8 import encode

pytest.importorskip("safetensors.numpy")

F8 = ml_dtypes.float8_e4m3fn
BF16 = ml_dtypes.bfloat16
F32 = np.float32
UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def ceil_div(a, b):
    return (a + b - 1) // b


def per_block_cast_to_fp8(x, block=(128, 128)):
    """DeepGEMM's ``per_block_cast_to_fp8``, line by line in numpy and ml_dtypes, from
    deepseek-ai/DeepGEMM's ``test_core.py`` (in its tests folder) as first published
    (commit a6d97a1, 2025-02-25); ``block`` generalizes its fixed 128. Each torch
    operation keeps the arithmetic torch gives it on the GPU, where DeepGEMM runs:

    - ``x_padded`` is zeros of ``x``'s dtype; ``abs().float()`` is exact;
    - ``.clamp(1e-4)`` casts the bound to the tensor's float32;
    - ``448.0 / x_amax`` is ``Tensor.__rtruediv__``, which torch/_tensor.py defines as
      ``self.reciprocal() * other``: two roundings;
    - ``x_view * (...)`` multiplies a bfloat16/float16/float32 tensor by a float32 one:
      torch promotes to float32 (numpy's promotion here is the same, float64 included);
    - ``.to(torch.float8_e4m3fn)`` rounds to nearest even (no product comes near 464,
      where torch and ml_dtypes would part);
    - ``x_amax / 448.0`` divides by a host scalar, which CUDA computes as
      ``a * (1 / b)`` (aten/src/ATen/native/cuda/BinaryDivTrueKernel.cu).
    """
    b0, b1 = block
    assert x.ndim == 2
    m, n = x.shape
    x_padded = np.zeros((ceil_div(m, b0) * b0, ceil_div(n, b1) * b1), dtype=x.dtype)
    x_padded[:m, :n] = x
    x_view = x_padded.reshape(-1, b0, x_padded.shape[1] // b1, b1)
    x_amax = np.abs(x_view).astype(F32).max(axis=(1, 3), keepdims=True)
    x_amax = np.maximum(x_amax, F32(1e-4))
    x_scaled = (x_view * ((F32(1) / x_amax) * F32(448.0))).astype(F8)
    scale = x_amax * (F32(1) / F32(448.0))
    return (
        np.ascontiguousarray(x_scaled.reshape(x_padded.shape)[:m, :n]),
        scale.reshape(x_view.shape[0], x_view.shape[2]),
    )


def cast_stacked(x, block=(128, 128)):
    """The port over each matrix of a stack ``(..., R, C)``."""
    flat = x.reshape(-1, *x.shape[-2:])
    pairs = [per_block_cast_to_fp8(m, block) for m in flat]
    w = np.stack([p[0] for p in pairs]).reshape(x.shape)
    s = np.stack([p[1] for p in pairs])
    return w, s.reshape(*x.shape[:-2], *s.shape[-2:])


def weight_dequant(w, s, block=(128, 128), dtype=F32):
    """DeepSeek-V3's ``inference/kernel.py`` ``weight_dequant`` (what meshinit's reader
    computes): each element times its block's scale in float32, then ``dtype``."""
    rows, cols = w.shape[-2:]
    wide = np.repeat(np.repeat(s.astype(F32), block[0], -2), block[1], -1)[..., :rows, :cols]
    return (w.astype(F32) * wide).astype(dtype)


def bits(x):
    x = np.asarray(x)
    return x.view(UINT[x.dtype.itemsize])


def differing(got, want):
    """The number of elements whose bits differ (0 is the claim)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.shape)
    return int((bits(got) != bits(want)).sum())


def weights(rng, shape, dtype, zero_block=False):
    """Normal values with magnitudes spread over 2**-12 to 2**4 by row and column (so
    blocks take scales far apart, and small values reach float8's subnormals)."""
    x = rng.standard_normal(shape)
    x *= 2.0 ** rng.integers(-12, 0, shape[-2])[:, None]
    x *= 2.0 ** rng.integers(0, 6, shape[-1])
    if zero_block:
        x[..., :128, -min(shape[-1], 100) :] = 0
    return x.astype(dtype)


def mesh_of(shape, kind):
    """The 8 devices as ("x", "y"): jax.make_mesh's default (Explicit), its Auto twin,
    or x Explicit and y Auto."""
    types = {
        "explicit": (AxisType.Explicit,) * 2,
        "auto": (AxisType.Auto,) * 2,
        "mixed": (AxisType.Explicit, AxisType.Auto),
    }[kind]
    return jax.make_mesh(shape, ("x", "y"), axis_types=types)


# shape, mesh, spec: shards of 50 x 152 cut every block; 128-row shards hold whole
# blocks while 132-column ones cut them; 256 x 256 shards hold whole blocks
CASES = {
    "cut": ((200, 304), (4, 2), ("x", "y")),
    "ragged": ((300, 200), (2, 4), ("x", "y")),
    "rows whole, columns cut": ((512, 264), (4, 2), ("x", "y")),
    "whole": ((1024, 512), (4, 2), ("x", "y")),
    "both axes on rows": ((200, 136), (4, 2), (("x", "y"), None)),
}


def _shard_cases():
    """(kind, case, dtype): every layout on both kinds of mesh in bf16, and every dtype
    on both kinds where the shards cut every block ("cut"). The dtype only enters as
    the promotion to float32 before the block amax, the same on every layout, so the
    fast tier leaves out the rest of the product; MESHINIT_TESTS=all runs all of it."""
    out = []
    for kind in ("explicit", "auto"):
        for case in CASES:
            for dtype in (jnp.bfloat16, jnp.float16, jnp.float32):
                fast = dtype == jnp.bfloat16 or case == "cut"
                marks = () if fast else (pytest.mark.slow,)
                out.append(pytest.param(kind, case, dtype, marks=marks))
    return out


@pytest.mark.parametrize("kind, case, dtype", _shard_cases())
def test_quantize_has_deepgemms_bits_whatever_the_shards(dtype, case, kind):
    shape, grid, spec = CASES[case]
    rng = np.random.default_rng(len(case))
    x = weights(rng, shape, np.dtype(dtype), zero_block=case == "ragged")
    sharded = jax.device_put(x, NamedSharding(mesh_of(grid, kind), P(*spec)))
    w, s = jax.jit(encode.quantize)(sharded)
    want_w, want_s = per_block_cast_to_fp8(x)
    assert w.dtype == F8 and s.dtype == F32 and s.shape == want_s.shape
    assert differing(w, want_w) == 0
    assert differing(s, want_s) == 0
    if kind == "explicit":  # placed as x was; the scales as the blocks lay
        assert w.sharding.spec == sharded.sharding.spec
        if case == "whole":
            assert s.sharding.spec == P("x", "y")


def test_uneven_shards_inside_the_jit_and_a_mixed_mesh():
    rng = np.random.default_rng(3)
    x = weights(rng, (130, 260), BF16)
    # 130 rows over 4 devices: uneven, as an array made inside the export's jit may be
    uneven = NamedSharding(mesh_of((4, 2), "auto"), P("x", "y"))
    w, s = jax.jit(lambda a: encode.quantize(jax.lax.with_sharding_constraint(a, uneven)))(x)
    want_w, want_s = per_block_cast_to_fp8(x)
    assert differing(w, want_w) == 0 and differing(s, want_s) == 0
    mixed = jax.device_put(x[:128], NamedSharding(mesh_of((4, 2), "mixed"), P("x", "y")))
    w, s = jax.jit(encode.quantize)(mixed)
    want_w, want_s = per_block_cast_to_fp8(x[:128])
    assert differing(w, want_w) == 0 and differing(s, want_s) == 0


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_a_stack_of_experts_is_quantized_expert_by_expert(kind):
    rng = np.random.default_rng(5)
    x = np.stack([weights(rng, (200, 264), BF16) for _ in range(4)])
    for spec in (("x", "y", None), (None, "x", "y")):
        sharded = jax.device_put(x, NamedSharding(mesh_of((4, 2), kind), P(*spec)))
        w, s = jax.jit(encode.quantize)(sharded)
        want_w, want_s = cast_stacked(x)
        assert s.shape == (4, 2, 3)
        assert differing(w, want_w) == 0 and differing(s, want_s) == 0
        if kind == "explicit":
            assert w.sharding.spec == sharded.sharding.spec


def test_other_blocks_and_float64():
    rng = np.random.default_rng(11)
    x = weights(rng, (100, 90), np.float32)
    w, s = jax.jit(encode.quantize, static_argnums=1)(x, (64, 32))
    want_w, want_s = per_block_cast_to_fp8(x, (64, 32))
    assert s.shape == (2, 3) and differing(w, want_w) == 0 and differing(s, want_s) == 0
    # float64 times float32 is taken in float64, as torch promotes it: one rounding. A
    # block of amax 448 (scaled by 1) holds values a hair off float8 ties, which float32
    # would round onto the ties
    wide = x.astype(np.float64)
    wide[:128, :32] = 0
    wide[0, :3] = [448, 432 - 2.0**-30, 400 + 2.0**-30]
    with jax.enable_x64(True):
        w, s = jax.jit(encode.quantize, static_argnums=1)(wide, (64, 32))
    want_w, want_s = per_block_cast_to_fp8(wide, (64, 32))
    assert differing(w, want_w) == 0 and differing(s, want_s) == 0
    assert np.asarray(w)[0, :3].astype(F32).tolist() == [448, 416, 416]
    assert differing(w, per_block_cast_to_fp8(wide.astype(F32), (64, 32))[0]) == 2


def test_the_divisions_are_torchs_on_the_gpu_not_ieee_quotients():
    # read as IEEE quotients, 448 / amax and amax / 448 give other bits: the test above
    # tells the two apart (here, about half the scales and some weights)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((1024, 1024)).astype(BF16)
    w, s = jax.jit(encode.quantize)(x)
    want_w, want_s = per_block_cast_to_fp8(x)
    assert differing(w, want_w) == 0 and differing(s, want_s) == 0
    view = x.reshape(8, 128, 8, 128).astype(F32)
    amax = np.maximum(np.abs(view).max(axis=(1, 3), keepdims=True), F32(1e-4))
    quotient_w = (view * (F32(448) / amax)).astype(F8).reshape(x.shape)
    quotient_s = (amax / F32(448)).reshape(8, 8)
    assert differing(s, quotient_s) >= 16
    assert differing(w, quotient_w) >= 16


def test_the_reciprocal_is_ieee_divisions_on_every_backend():
    # a TPU's float32 division is off by an ulp in about a fifth of cases (measured on a
    # v5e: 214058 of 1048576), which moved 0.03% of the float8 weights of a bfloat16
    # matrix; the long division in int32 gives the IEEE quotient everywhere
    rng = np.random.default_rng(4)
    a = rng.integers(0, 2**31, 1 << 18, dtype=np.int64).astype(np.uint32).view(F32)
    edges = [1e-4, 1, 3, 448, 2.0**-126, np.nextafter(F32(2.0**126), F32(0))]
    a = np.concatenate([a, -a[:100], 2.0 ** np.arange(-126, 126, dtype=F32), np.array(edges, F32)])
    normal = (np.abs(a) >= 2.0**-126) & (np.abs(a) < 2.0**126)
    got = np.asarray(jax.jit(encode.reciprocal)(a))
    assert differing(got[normal], F32(1) / a[normal]) == 0
    special = np.array([np.inf, -np.inf, np.nan, 2.0**127], F32)  # the backend's division
    with np.errstate(over="ignore", divide="ignore"):
        assert np.asarray(encode.reciprocal(special))[:2].tolist() == [0.0, -0.0]
    assert np.isnan(np.asarray(encode.reciprocal(special))[2])


def test_all_zero_and_tiny_blocks_take_the_amax_floor():
    x = np.zeros((256, 384), F32)
    x[128:, :128] = 3e-5  # a block below the floor: scaled by 448 / 1e-4, not to 448
    x[128:, 128:256] = 2.0**-140  # a float32 subnormal block: zeros, as DeepGEMM's
    x[:128, 256:] = np.linspace(-1, 1, 128 * 128, dtype=F32).reshape(128, 128)
    w, s = jax.jit(encode.quantize)(x)
    floor = F32(1e-4) * (F32(1) / F32(448))
    assert bits(s)[0, 0] == bits(floor) and bits(s)[1, 0] == bits(floor)
    assert (bits(w)[:128, :256] == 0).all()  # +0 in float8
    small = np.asarray(w)[128:, :128]
    factor = (F32(1) / F32(1e-4)) * F32(448)
    assert (bits(small) == bits((F32(3e-5) * factor).astype(F8))).all()
    assert float(small[0, 0].astype(F32)) == pytest.approx(3e-5 * 448 / 1e-4, rel=2**-4)
    want_w, want_s = per_block_cast_to_fp8(x)
    assert differing(w, want_w) == 0 and differing(s, want_s) == 0
    assert float(np.asarray(s)[0, 2]) == pytest.approx(1 / 448, rel=2**-20)


def test_values_round_to_nearest_even_at_the_float8_max_and_below_the_normals():
    # a block whose amax is 448 is scaled by exactly 1: products are the values
    block = np.zeros((128, 128), F32)
    values = {
        448.0: 448.0,  # the largest magnitude lands on float8's max, never NaN
        -448.0: -448.0,
        440.0: 448.0,
        432.0: 448.0,  # the tie between 416 and 448: to the even mantissa, 448
        float(np.nextafter(F32(432), F32(0))): 416.0,  # just below it (a double
        # rounding through float16 would make this the tie, then 448)
        416.0: 416.0,
        400.0: 384.0,  # the tie between 384 and 416: to 384
        float(np.nextafter(F32(400), F32(500))): 416.0,
        3 * 2.0**-10: 2.0**-8,  # a tie among float8 subnormals (2**-9 apart): to even
        2.0**-10: 0.0,  # half the smallest subnormal: to zero
        -(2.0**-10): -0.0,
    }
    block.flat[: len(values)] = list(values)
    w, s = jax.jit(encode.quantize)(block)
    assert float(np.asarray(s)[0, 0]) * 448 == pytest.approx(448, rel=2**-22)
    got = np.asarray(w).astype(F32).flat[: len(values)]
    assert bits(got).tolist() == bits(np.array(list(values.values()), F32)).tolist()
    assert differing(w, per_block_cast_to_fp8(block)[0]) == 0
    # the same ties in bfloat16, scaled by 64 (amax 7)
    small = (block / 64).astype(BF16)
    small[0, 0] = 7
    w, _ = jax.jit(encode.quantize)(small)
    assert differing(w, per_block_cast_to_fp8(small)[0]) == 0
    assert float(np.asarray(w)[0, 3].astype(F32)) == 448.0  # 432 / 64, times 64: the tie


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_decoding_gives_the_weight_back_within_float8s_rounding(dtype):
    rng = np.random.default_rng(8)
    x = weights(rng, (300, 392), np.dtype(dtype), zero_block=True)
    w, s = jax.jit(encode.quantize)(x)
    back = weight_dequant(np.asarray(w), np.asarray(s))
    wide = x.astype(F32)
    scale = np.repeat(np.repeat(np.asarray(s), 128, 0), 128, 1)[:300, :392]
    # half a float8 ulp: 2**-4 relative among normals, 2**-10 absolute (times the
    # scale) among subnormals; and the float32 roundings of the two products
    bound = np.maximum(np.abs(wide) * 2.0**-4, scale * 2.0**-10) + np.abs(wide) * 2.0**-19
    error = np.abs(back - wide)
    assert (error <= bound).all(), float((error / bound).max())
    assert (error / np.maximum(np.abs(wide), 1e-30)).max() > 2.0**-6  # the bound bites
    assert (back[np.abs(wide) > scale * 16] != 0).all()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("explicit", [True, False])
def test_written_with_safetensors_it_loads_back_as_weight_dequant(tmp_path, dtype, explicit):
    rng = np.random.default_rng(13)
    name = "model.layers.0.mlp.down_proj.weight"
    x = weights(rng, (320, 264), BF16, zero_block=True)
    mesh = mesh_of((4, 2), "explicit" if explicit else "auto")
    w, s = jax.jit(encode.quantize)(jax.device_put(x, NamedSharding(mesh, P("x", "y"))))
    w, s = np.asarray(w), np.asarray(s)
    settings = encode.quantization_config(["lm_head"])
    folder = quantized_folder(tmp_path, {name: w, name + "_scale_inv": s}, settings)
    with open(folder / "model-00001-of-00001.safetensors", "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert header[name]["dtype"] == "F8_E4M3" and header[name + "_scale_inv"]["dtype"] == "F32"
    plan = plan_on(mesh, {name: x.shape}, dtype)
    got = st.load(plan, folder)[name]
    want = weight_dequant(w, s, dtype=np.dtype(dtype))
    assert got.dtype == dtype and got.sharding == plan.entries[0].sharding
    assert differing(got, want) == 0


def test_the_config_is_the_one_published_and_the_reader_takes_it():
    settings = encode.quantization_config(["lm_head", "model.layers.0.mlp.gate"])
    assert settings == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": ["lm_head", "model.layers.0.mlp.gate"],
    }
    declared, problems = quant_config.declared({"quantization_config": settings}, "config.json")
    assert problems == [] and declared.method == "fp8" and declared.block == (128, 128)
    assert encode.quantization_config([], (64, 32))["weight_block_size"] == [64, 32]


def test_quantize_refuses_what_it_cannot_quantize():
    with pytest.raises(TypeError, match=r"quantize: x is int32, not a float array"):
        encode.quantize(jnp.ones((4, 4), jnp.int32))
    with pytest.raises(ValueError, match=r"x has shape \(4,\): block scales cover"):
        encode.quantize(jnp.ones((4,)))
    with pytest.raises(ValueError, match=r"block is \(128, 0\), not two positive ints"):
        encode.quantize(jnp.ones((4, 4)), (128, 0))


# ---- which tensors are quantized


def should_convert_module(full_name, patterns=None):
    """transformers' ``quantizers_utils.should_convert_module`` (v5), ported as is: a
    module is left unconverted if an entry matches it as a regex from the start, with
    or without a following dot, or if its name ends with the entry."""
    if patterns is None:
        return True
    return not any(
        re.match(f"{key}\\.", full_name) or re.match(f"{key}", full_name) or full_name.endswith(key)
        for key in patterns
    )


QWEN3_MOE_LAYER = {  # Qwen3-30B-A3B-FP8's tensors of one layer (2 experts of 128)
    "input_layernorm.weight": ((2048,), False),
    "post_attention_layernorm.weight": ((2048,), False),
    "self_attn.q_proj.weight": ((4096, 2048), True),
    "self_attn.k_proj.weight": ((512, 2048), True),
    "self_attn.v_proj.weight": ((512, 2048), True),
    "self_attn.o_proj.weight": ((2048, 4096), True),
    "self_attn.q_norm.weight": ((128,), False),
    "self_attn.k_norm.weight": ((128,), False),
    "mlp.gate.weight": ((128, 2048), False),
    "mlp.experts.0.gate_proj.weight": ((768, 2048), True),
    "mlp.experts.0.up_proj.weight": ((768, 2048), True),
    "mlp.experts.1.down_proj.weight": ((2048, 768), True),
}
OTHERS = {  # other families' tensors, and the shapes the rule turns on
    "model.embed_tokens.weight": ((151936, 2048), False),
    "lm_head.weight": ((151936, 2048), False),
    "model.norm.weight": ((2048,), False),
    "transformer.wte.weight": ((50257, 768), False),  # GPT-2
    "transformer.wpe.weight": ((1024, 768), False),
    "transformer.h.0.attn.c_attn.weight": ((768, 2304), True),
    "transformer.h.0.attn.c_attn.bias": ((2304,), False),
    "model.layers.3.self_attn.kv_a_proj_with_mqa.weight": ((576, 7168), True),  # DeepSeek-V3
    "model.layers.3.self_attn.q_a_layernorm.weight": ((1536,), False),
    "model.layers.3.mlp.gate.e_score_correction_bias": ((256,), False),
    "model.layers.3.mlp.shared_experts.gate_proj.weight": ((2048, 7168), True),
    "model.layers.0.block_sparse_moe.gate.weight": ((8, 4096), False),  # Mixtral
    "model.layers.0.block_sparse_moe.experts.0.w1.weight": ((14336, 4096), True),
    "model.layers.0.mlp.shared_expert_gate.weight": ((1, 2048), False),  # Qwen2-MoE
    "model.layers.0.mlp.router.weight": ((32, 2880), False),  # gpt-oss
    "model.layers.0.mlp.experts.gate_up_proj": ((32, 2880, 5760), False),  # no .weight
    "model.layers.0.self_attn.sinks": ((64,), False),
    "model.layers.0.feed_forward.router.weight": ((16, 5120), False),  # Llama 4
    "model.layers.1.mlp.experts.down_proj.weight": ((8, 2048, 768), True),  # stacked
    "visual.patch_embed.proj.weight": ((1280, 3, 2, 14, 14), False),  # 5-D
    "model.layers.0.mlp.conv.weight": ((8, 4, 3, 3), False),  # 4-D
}


def qwen3_moe(layers):
    tensors = {
        f"model.layers.{i}.{k}": v for i in range(layers) for k, v in QWEN3_MOE_LAYER.items()
    }
    for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        tensors[name] = OTHERS[name]
    return tensors


EVERY = {**{f"model.layers.7.{k}": v for k, v in QWEN3_MOE_LAYER.items()}, **OTHERS}


@pytest.mark.parametrize("name", list(EVERY))
def test_which_tensors_are_quantized(name):
    shape, quantized = EVERY[name]
    assert encode.converted(name, shape, ()) is quantized
    assert encode.converted(name, shape, ["model", "transformer"]) is False


QO = ("q_proj", "o_proj")


@pytest.mark.parametrize(
    ("entries", "skipped"),
    [
        (["lm_head"], []),
        (["model.layers.1.self_attn"], ["1.self_attn.q_proj", "1.self_attn.o_proj"]),
        (["model.layers.*.self_attn"], [f"{i}.self_attn.{p}" for i in (0, 1) for p in QO]),
        (["o_proj"], ["0.self_attn.o_proj", "1.self_attn.o_proj"]),  # a suffix
        (["model.layers.1.mlp.experts.0"], ["1.mlp.experts.0.gate_proj"]),  # a prefix
        (["experts"], []),  # neither a prefix nor a suffix of a module's name
        (
            [r"model\.layers\.0\..*_proj"],
            [f"0.self_attn.{p}" for p in QO] + ["0.mlp.experts.0.gate_proj"],
        ),
    ],
)
def test_modules_to_not_convert_match_as_transformers_matches_them(entries, skipped):
    modules = [
        f"model.layers.{i}.{m}"
        for i in (0, 1)
        for m in ("self_attn.q_proj", "self_attn.o_proj", "mlp.experts.0.gate_proj")
    ]
    got = [m for m in modules if not encode.converted(m + ".weight", (256, 256), entries)]
    want = [m for m in modules if not should_convert_module(m, entries)]
    assert got == want == [f"model.layers.{s}" for s in skipped]


def test_an_entry_that_is_no_regex_is_named():
    with pytest.raises(ValueError, match=r"modules_to_not_convert: 'experts\[0' is not a valid"):
        encode.converted("model.layers.0.mlp.experts.0.up_proj.weight", (8, 8), ["experts[0"])


def test_config_lists_each_unquantized_module_by_name_as_qwen_does():
    tensors = qwen3_moe(11)
    shapes = {n: s for n, (s, _) in tensors.items()}
    listed = encode.not_converted(list(tensors), shapes, None)
    gates = [f"model.layers.{i}.mlp.gate" for i in range(11)]  # layer 10 after layer 9
    assert listed == ["lm_head", "model.embed_tokens", *gates]
    # Qwen3-30B-A3B-FP8 lists lm_head and each layer's gate (and its 1-D norms, which
    # no reader quantizes): the same modules of two or more axes
    qwen = ["lm_head"] + [
        f"model.layers.{i}.{m}"
        for i in range(11)
        for m in ("input_layernorm", "mlp.gate", "post_attention_layernorm")
    ]
    assert [m for m in qwen if m + ".weight" in tensors and len(shapes[m + ".weight"]) > 1] == [
        m for m in listed if m != "model.embed_tokens"
    ]
    # a reader of the list agrees with what was quantized: transformers by its matching,
    # vLLM by exact names
    for name, (shape, quantized) in tensors.items():
        module = name.removesuffix(".weight")
        assert encode.converted(name, shape, ()) is quantized
        if len(shape) > 1:
            assert should_convert_module(module, listed) is quantized, name
            assert (module in listed) is not quantized, name


def test_config_lists_a_given_list_as_given_and_other_families_modules():
    shapes = {n: s for n, (s, _) in OTHERS.items()}
    assert encode.not_converted(shapes, shapes, ["lm_head", "x"]) == ["lm_head", "x"]
    assert encode.not_converted(shapes, shapes, []) == []
    assert encode.not_converted(shapes, shapes, None) == [
        "lm_head",
        "model.embed_tokens",
        "model.layers.0.block_sparse_moe.gate",
        "model.layers.0.feed_forward.router",
        "model.layers.0.mlp.conv",
        "model.layers.0.mlp.experts",  # gpt-oss's fused experts (no .weight) stay whole
        "model.layers.0.mlp.router",
        "model.layers.0.mlp.shared_expert_gate",
        "transformer.wpe",
        "transformer.wte",
        "visual.patch_embed.proj",
    ]


def test_a_listed_name_that_would_also_skip_a_quantized_module_is_refused():
    # "m.gate" as transformers reads it (a regex from the start) matches "m.gate_proj"
    shapes = {"m.gate.weight": (8, 64), "m.gate_proj.weight": (64, 64)}
    with pytest.raises(ValueError, match=r"\('m\.gate' matches 'm\.gate_proj'\); pass modules_"):
        encode.not_converted(shapes, shapes, None)
    assert encode.not_converted(shapes, shapes, ["m.gate$"]) == ["m.gate$"]
