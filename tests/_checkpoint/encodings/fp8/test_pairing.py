"""FP8 block-scaled checkpoints (DeepSeek-V3, Kimi K2, Qwen3-FP8 as published): a float8
weight with its ``<name>_scale_inv`` beside it, planned as a wider float, is read
dequantized on the device with the bits of DeepSeek's ``weight_dequant``
(``planned(float32(w) * float32(s[i // b0, j // b1]))``, two roundings), shard by
shard; planned as float8 it loads as stored; what cannot be read so is refused before
a byte is read, naming the path, the tensors and the fix."""

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from fp8_files import BF16, F8, QUANTIZATION, bits, experts, fp8_pair, weight_dequant, write
from helpers import Reads, plan_for, plan_on, stored, xy_mesh
from jax.sharding import Mesh
from storage_servers import s3_server_fixture  # noqa: F401

import meshinit
from meshinit import safetensors as st

pytest.importorskip("safetensors.numpy")

CASES = {
    "divisible": ((256, 384), (2, 4)),
    "ragged": ((300, 200), (2, 4)),  # scale (3, 2); blocks of 150 x 50 cut scale blocks
    "cutting": ((320, 264), (4, 2)),  # 80-row and 132-column shards cross 128
}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.float16])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("explicit", [False, True])
def test_fp8_loads_with_weight_dequants_bits(tmp_path, dtype, case, explicit):
    shape, grid = CASES[case]
    rng = np.random.default_rng(hash(case) % 1000)
    w, s = fp8_pair(rng, shape)
    folder = write(tmp_path, {"w": w, "w_scale_inv": s})
    mesh = xy_mesh(grid, explicit)
    plan = plan_on(mesh, {"w": shape}, dtype)
    with Reads() as reads:
        got = st.load(plan, folder)["w"]  # no names=: the stored name
    want = weight_dequant(w, s, dtype=np.dtype(dtype))
    assert got.dtype == dtype and got.sharding == plan.entries[0].sharding
    assert (bits(got) == bits(want)).all()
    for shard in got.addressable_shards:
        assert (bits(shard.data) == bits(want[shard.index])).all()
    # each block's fp8 bytes once, plus the scale (read whole, once per parameter)
    assert reads.values == [w.nbytes + s.nbytes]


TIE_SCALE = np.float32(1 + 445645 * 2.0**-23)
"""Times 1.25 (a float8 value), its exact product lies just above a bfloat16 tie whose
lower neighbour is even, and its float32 rounding lands on the tie: rounded twice
(float32, then bfloat16, ties to even) it goes down, rounded once it goes up."""


def test_a_million_elements_keep_the_float32_rounding_before_the_planned_one(tmp_path):
    rng = np.random.default_rng(7)
    w, s = fp8_pair(rng, (1024, 1152), low=1e-3, high=1.0)
    for k in range(8):  # such a pair in 8 blocks, scaled by powers of two
        s[k, k] = TIE_SCALE * np.float32(2.0 ** -(k + 3))
        w[k * 128 + 5 + k, k * 128 + 3 : k * 128 + 6] = np.array([1.25, -2.5, 5.0]) * 2.0 ** (k % 3)
    folder = write(tmp_path, {"w": w, "w_scale_inv": s})
    plan = plan_on(xy_mesh((2, 4), False), {"w": w.shape}, jnp.bfloat16)
    got = st.load(plan, folder)["w"]
    want = weight_dequant(w, s)
    exact = w.astype(np.float64) * np.repeat(np.repeat(s.astype(np.float64), 128, 0), 128, 1)
    near = exact.astype(np.float32)  # float32 is the first rounding
    b = near.view(np.uint32)
    tie = ((b & 0xFFFF) == 0x8000) & (exact != near)  # a bfloat16 tie made by it
    away = np.abs(exact) > np.abs(near.astype(np.float64))
    once = np.where(tie, np.where(away, (b + 0x8000) >> 16, b >> 16), bits(want))
    assert (once != bits(want)).sum() >= 24  # rounded once, these have other bits
    assert (bits(got) == bits(want)).all()


def test_bfloat16_scales_a_transposed_view_and_a_split_reshape(tmp_path):
    rng = np.random.default_rng(3)
    w, s = fp8_pair(rng, (384, 256), scale_dtype=BF16)
    folder = write(tmp_path, {"q.weight": w, "q.weight_scale_inv": s})
    mesh = xy_mesh((2, 4), True)
    want = weight_dequant(w, s, dtype=np.float32)
    plan = plan_on(mesh, {"kernel": (256, 384)}, jnp.float32)
    names = {"kernel": st.Tensor("q.weight", permute=(1, 0))}
    got = st.load(plan, folder, names=names)["kernel"]
    assert (bits(got) == bits(want.T)).all()
    # (heads, head_dim, in) -> (in, heads, head_dim), heads sharded
    plan = plan_on(mesh, {"q": (256, 8, 48)}, jnp.bfloat16, ("x", "y", None))
    names = {"q": st.Tensor("q.weight", shape=(8, 48, -1), permute=(2, 0, 1))}
    got = st.load(plan, folder, names=names)["q"]
    want = weight_dequant(w, s).reshape(8, 48, 256).transpose(2, 0, 1)
    assert (bits(got) == bits(want)).all()


@pytest.mark.parametrize("explicit", [False, True])
def test_a_stack_of_experts_and_layers_compiles_independent_of_depth(
    tmp_path, count_compiles, explicit
):
    from meshinit._checkpoint.encodings.fp8 import decode as dequant

    mesh = xy_mesh((2, 4), explicit)
    counts = []
    for layers in (2, 4):
        folder, stack, want = experts(tmp_path / str(layers), layers)
        spec = ("x", None, None, "y")
        plan = plan_on(mesh, {"up": want.shape}, jnp.bfloat16, spec)
        dequant.program.cache_clear()
        with count_compiles() as compiled:
            got = st.load(plan, folder, names={"up": stack})["up"]
        assert (bits(got) == bits(want)).all()
        counts.append((compiled.count, dequant.program.cache_info().misses))
    # XLA's compiles (none where jax's persistent cache holds them) and the programs
    # built, one per signature: the same at 2 and 4 layers
    assert counts[0] == counts[1] and counts[0][1] >= 1


def fused(tmp_path, shapes, seed=0, block=(128, 128)):
    """Float8 weights of ``shapes`` with their scales, written; each dequantized by
    the reference, by name."""
    rng = np.random.default_rng(seed)
    tensors, want = {}, {}
    for name, shape in shapes.items():
        w, s = fp8_pair(rng, shape, block)
        tensors[name], tensors[name + "_scale_inv"] = w, s
        want[name] = weight_dequant(w, s, block)
        want[name, np.float32] = weight_dequant(w, s, block, np.float32)
    return write(tmp_path, tensors), want


@pytest.mark.parametrize("gathered", ["slices", "elements"])
@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("explicit", [False, True])
def test_a_concat_of_float8_weights_takes_each_parts_own_scale(
    tmp_path, axis, explicit, gathered, monkeypatch
):
    from meshinit._checkpoint.encodings.fp8 import joins as dequant_concat

    if gathered == "elements":  # each element's scale gathered on its own, not as slices
        monkeypatch.setattr(dequant_concat, "fast", lambda *args: None)
    # q, k, v fused: shards of 318 rows (2) and 159 columns (4) cut through the parts'
    # boundaries (300, 500) and through scale blocks; the last blocks are ragged
    sizes = {"q": 300, "k": 200, "v": 136}
    shapes = {n: (m, 264) if axis == 0 else (264, m) for n, m in sizes.items()}
    folder, want = fused(tmp_path, shapes, seed=axis)
    whole = np.concatenate([want[n] for n in sizes], axis=axis)
    mesh = xy_mesh((2, 4), explicit)
    plan = plan_on(mesh, {"qkv": whole.shape}, jnp.bfloat16)
    names = {"qkv": st.Concat([st.Tensor(n) for n in sizes], axis=axis)}
    with Reads() as reads:
        got = st.load(plan, folder, names=names, unused="error")["qkv"]  # no scale unused
    assert got.sharding == plan.entries[0].sharding
    assert (bits(got) == bits(whole)).all()
    for shard in got.addressable_shards:
        assert (bits(shard.data) == bits(whole[shard.index])).all()
    scales = sum(-(-a // 128) * -(-b // 128) * 4 for a, b in shapes.values())
    assert reads.values == [whole.size + scales]  # each fp8 byte once, each scale whole
    # transposed parts (a kernel of fused q, k, v), into float32
    plan = plan_on(mesh, {"qkv": whole.T.shape}, jnp.float32)
    parts = [st.Tensor(n, permute=(1, 0)) for n in sizes]
    got = st.load(plan, folder, names={"qkv": st.Concat(parts, axis=1 - axis)})["qkv"]
    wide = np.concatenate([want[n, np.float32] for n in sizes], axis)
    assert (bits(got) == bits(wide.T)).all()


def layered(tmp_path, layers, concat_of_stacks=False):
    sizes = {"q": 192, "k": 72, "v": 72}
    shapes = {f"l{i}.{n}": (m, 200) for i in range(layers) for n, m in sizes.items()}
    folder, want = fused(tmp_path, shapes, seed=layers)
    if concat_of_stacks:  # [layers, q | k | v, in]: each part a Stack of layers
        parts = [st.Stack([f"l{i}.{n}" for i in range(layers)], axis=0) for n in sizes]
        node = st.Concat(parts, axis=1)
    else:  # a Stack of layers, each q | k | v fused
        node = st.Stack(
            [st.Concat([f"l{i}.{n}" for n in sizes], axis=0) for i in range(layers)], axis=0
        )
    whole = np.stack([np.concatenate([want[f"l{i}.{n}"] for n in sizes]) for i in range(layers)])
    return folder, node, whole


@pytest.mark.parametrize("concat_of_stacks", [False, True])
@pytest.mark.parametrize("explicit", [False, True])
def test_a_stack_of_concats_compiles_independent_of_depth(
    tmp_path, count_compiles, explicit, concat_of_stacks
):
    from meshinit._checkpoint.encodings.fp8 import joins as dequant_concat

    mesh = xy_mesh((2, 4), explicit)
    counts = []
    for layers in (2, 4):
        folder, node, want = layered(tmp_path / str(layers), layers, concat_of_stacks)
        # 84-row shards cut the parts' boundaries (192, 264) and scale blocks; 50 columns
        plan = plan_on(mesh, {"qkv": want.shape}, jnp.bfloat16, (None, "x", "y"))
        dequant_concat.program.cache_clear()
        with count_compiles() as compiled:
            got = st.load(plan, folder, names={"qkv": node})["qkv"]
        assert (bits(got) == bits(want)).all()
        counts.append((compiled.count, dequant_concat.program.cache_info().misses))
    assert counts[0] == counts[1] and counts[0][1] >= 1


@pytest.mark.parametrize("explicit", [False, True])
def test_a_pad_a_permuted_stack_and_unequal_stack_parts_dequantize(tmp_path, explicit):
    folder, want = fused(tmp_path, {"a": (256, 200), "b": (256, 264)})
    mesh = xy_mesh((2, 4), explicit)
    a, b = want["a"], want["b"]
    shapes = {
        "pad": ((320, 264), ("x", "y")),
        "perm": ((200, 2, 256), ("y", None, "x")),
        "experts": ((4, 256, 200), ("x", None, "y")),
        "slices": ((2, 256, 136), (None, "x", "y")),
    }
    zeros = jax.nn.initializers.zeros
    plan = meshinit.plan(
        {
            n: meshinit.param(shape, zeros, dtype=jnp.bfloat16, mesh=mesh, axes=axes)
            for n, (shape, axes) in shapes.items()
        }
    )
    names = {
        # padding read from no file: 0.5 where no weight is
        "pad": st.Pad("a", shape=(320, 264), value=0.5),
        # [in, 2, out]: a and b's first columns stacked, then permuted
        "perm": st.Stack(["a", st.Tensor("b", index=np.s_[:, :200])], axis=0, permute=(2, 0, 1)),
        # a padded layer's empty experts, and a bias row of a Fill concatenated
        "experts": st.Stack(
            [
                "a",
                st.Concat([st.Tensor("b", index=np.s_[:255, :200]), st.Fill(-1.5, (1, 200))], 0),
                st.Fill(0.0, (256, 200)),
                st.Fill(0.0, (256, 200)),
            ],
            axis=0,
        ),
        # two slices of b, from other columns: parts that differ
        "slices": st.Stack(
            [st.Tensor("b", index=np.s_[:, :136]), st.Tensor("b", index=np.s_[:, 100:236])],
            axis=0,
        ),
    }
    got = st.load(plan, folder, names=names)
    padded = np.full((320, 264), 0.5, BF16)
    padded[:256, :200] = a
    assert (bits(got["pad"]) == bits(padded)).all()
    assert (bits(got["perm"]) == bits(np.stack([a, b[:, :200]]).transpose(2, 0, 1))).all()
    experts = np.zeros((4, 256, 200), BF16)
    experts[0], experts[1, :255], experts[1, 255] = a, b[:255, :200], -1.5
    assert (bits(got["experts"]) == bits(experts)).all()
    assert (bits(got["slices"]) == bits(np.stack([b[:, :136], b[:, 100:236]]))).all()


@pytest.mark.parametrize("explicit", [False, True])
def test_a_merge_of_the_whole_parameter_and_its_permute_dequantize(tmp_path, explicit):
    folder, want = fused(tmp_path, {"a": (256, 200), "b": (256, 200)}, seed=3)
    a, b = want["a"], want["b"]
    mesh = xy_mesh((2, 4), explicit)
    shapes = {
        "flat": ((256 * 200,), ("x",)),  # blocks of 128 whole rows
        "layers": ((512, 200), ("x", "y")),  # a layer's rows per block
        "kernel": ((400, 256), ("y", "x")),  # 100 of a layer's 200 columns per block
    }
    zeros = jax.nn.initializers.zeros
    plan = meshinit.plan(
        {
            n: meshinit.param(shape, zeros, dtype=jnp.bfloat16, mesh=mesh, axes=axes)
            for n, (shape, axes) in shapes.items()
        }
    )
    names = {
        "flat": st.Tensor("a", out_shape=(256 * 200,)),
        "layers": st.Stack(["a", "b"], axis=0, out_shape=(512, 200)),
        "kernel": st.Stack(["a", "b"], axis=1, out_shape=(256, 400), permute=(1, 0)),
    }
    got = st.load(plan, folder, names=names)
    assert (bits(got["flat"]) == bits(a.reshape(-1))).all()
    assert (bits(got["layers"]) == bits(np.stack([a, b]).reshape(512, 200))).all()
    assert (bits(got["kernel"]) == bits(np.stack([a, b], axis=1).reshape(256, 400).T)).all()


def test_keep_quantized_float8_and_its_scale_load_as_stored(tmp_path):
    rng = np.random.default_rng(5)
    w, s = fp8_pair(rng, (256, 384))
    w2, s2 = fp8_pair(rng, (256, 384), scale_dtype=BF16)
    folder = write(tmp_path, {"a": w, "a_scale_inv": s, "b": w2, "b_scale_inv": s2})
    mesh = xy_mesh((2, 4), False)
    plan = meshinit.plan(
        {
            "kernel": meshinit.param((256, 384), jax.nn.initializers.zeros, dtype=F8, mesh=mesh),
            "kernel_b": meshinit.param((256, 384), jax.nn.initializers.zeros, dtype=F8, mesh=mesh),
            "scale": meshinit.param((2, 3), jax.nn.initializers.zeros, mesh=mesh),
            "scale_b": meshinit.param((2, 3), jax.nn.initializers.zeros, mesh=mesh),
        }
    )
    names = {"kernel": "a", "kernel_b": "b", "scale": "a_scale_inv", "scale_b": "b_scale_inv"}
    got = st.load(plan, folder, names=names, unused="error")
    assert bits(got["kernel"]).tobytes() == bits(w).tobytes()
    assert bits(got["kernel_b"]).tobytes() == bits(w2).tobytes()
    assert (bits(got["scale"]) == bits(s)).all()
    assert (bits(got["scale_b"]) == bits(s2.astype(np.float32))).all()  # exact widening
    assert st.inventory(plan, folder, names=names).dequantized == {}


def test_scales_are_used_and_the_inventory_says_what_is_dequantized(tmp_path):
    folder, stack, want = experts(tmp_path, 2)
    plan = plan_on(xy_mesh((2, 4), False), {"up": want.shape}, jnp.bfloat16, (None,) * 4)
    found = st.inventory(plan, folder, names={"up": stack})
    assert found.unused == ()
    assert found.dequantized == {
        "up": "F8_E4M3 x 'model.layers.0.mlp.experts.0.up_proj.weight_scale_inv' and 7 more "
        "(F32, 128x128 blocks) -> bfloat16"
    }
    assert "dequantized (float8 x block scales; MXFP4): 1 up <- F8_E4M3 x" in str(found)
    st.load(plan, folder, names={"up": stack}, unused="error")  # no scale unused


def refused(plan, folder, names=None, match=""):
    with Reads() as reads, pytest.raises(meshinit.PlanError, match="nothing was read") as e:
        st.load(plan, folder, names=names, unused="ignore")
    assert reads.values == []  # before any read
    message = "\n".join(str(p) for p in e.value.problems)
    for needle in [match] if isinstance(match, str) else match:
        assert needle in message, f"{needle!r} not in {message}"
    return message


def test_a_missing_scale_with_an_fp8_config_is_refused_naming_both(tmp_path):
    rng = np.random.default_rng(1)
    tensors = {f"model.layers.{i}.up.weight": fp8_pair(rng, (256, 256))[0] for i in range(3)}
    folder = write(tmp_path, tensors)
    plan = plan_for({f"layers.{i}.up": (256, 256) for i in range(3)}, dtype=jnp.bfloat16)
    names = {f"layers.{i}.up": f"model.layers.{i}.up.weight" for i in range(3)}
    refused(
        plan,
        folder,
        names,
        [
            "layers.{0..2}.up: tensor 'model.layers.{0..2}.up.weight' in "
            "model-00001-of-00001.safetensors is float8, planned bfloat16, with no scale beside it "
            "('model.layers.{0..2}.up.weight_scale_inv' is in no file)",
            f"config.json says quantization_config {json.dumps(QUANTIZATION, sort_keys=True)}",
            "plan the parameter as float8 to load the stored values",
            "ask for a plain cast: Tensor('model.layers.{0..2}.up.weight', dequantize=False)",
        ],
    )


def refused_by_both(plan, folder, new_arrays, names=None, needles=()):
    """The problems of the load's PlanError and the inventory's, each naming every one
    of ``needles``; the load read nothing and left no array alive."""
    with (
        Reads() as reads,
        new_arrays() as made,
        pytest.raises(meshinit.PlanError, match="nothing was read") as loading,
    ):
        st.load(plan, folder, names=names, unused="ignore")
    assert reads.values == [] and not made, (reads.values, made)
    with pytest.raises(meshinit.PlanError, match=r"meshinit\.safetensors\.inventory:") as found:
        st.inventory(plan, folder, names=names)
    assert found.value.problems == loading.value.problems
    message = str(loading.value)
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message}"
    return loading.value.problems


UNREADABLE = {  # config.json as written -> what the problem says of it
    "truncated": (b'{"quantization_config": {"quant_method": "fp8", "weight_bl', "is not JSON ("),
    "not utf-8": (b"\xff\xfe{}", "is not JSON ("),
    "a list": (b"[1, 2]", "holds a JSON list, not an object"),
    "a directory": (None, "is a directory, not a regular file"),
    "too large": (b'{"model_type": "llama", "hidden_size": 4096}', "is over 16 bytes"),
}


@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("case", list(UNREADABLE))
def test_a_config_json_that_cannot_be_read_is_refused_naming_it_before_any_read(
    tmp_path, case, scaled, new_arrays, monkeypatch
):
    from meshinit._checkpoint.store import listing as file

    text, said = UNREADABLE[case]
    rng = np.random.default_rng(11)
    w, s = fp8_pair(rng, (256, 384))
    folder = write(tmp_path, {"w": w, "w_scale_inv": s} if scaled else {"w": w}, None)
    if text is None:
        (folder / "config.json").mkdir()
    else:
        (folder / "config.json").write_bytes(text)
    if case == "too large":  # as one over 16 MiB is
        monkeypatch.setattr(file, "MAX_CONFIG", 16)
    plan = plan_on(xy_mesh((2, 4), True), {"w": (256, 384)}, jnp.bfloat16)
    config = str(folder / "config.json")
    problems = refused_by_both(plan, folder, new_arrays, needles=[f"{config}: {said}"])
    assert problems[0].path == config  # first: what to fix first
    if scaled:  # never dequantized with a guessed block size: the config's problem alone
        assert len(problems) == 1, problems
    else:  # and the weight without its scale, refused whatever the config would say
        assert [p.path for p in problems] == [config, "w"]
        assert "Tensor('w', dequantize=False)" in problems[1].message
    # a load that consults no config (the weight kept float8) never reads it
    kept = plan_on(xy_mesh((2, 4), True), {"w": (256, 384)}, F8)
    assert bits(st.load(kept, folder, unused="ignore")["w"]).tobytes() == bits(w).tobytes()


NO_QUANTIZATION = {
    "none": None,
    "no quantization_config": {},
    "null": {"quantization_config": None},
}


@pytest.mark.parametrize("stored_as", [F8, ml_dtypes.float8_e5m2])
@pytest.mark.parametrize("config", list(NO_QUANTIZATION))
def test_a_float8_weight_without_its_scale_is_refused_whatever_the_config_says(
    tmp_path, config, stored_as, new_arrays
):
    rng = np.random.default_rng(12)
    w = (rng.standard_normal((256, 384)) * 40).astype(stored_as)
    stored(tmp_path, {"model.up.weight": w, "model.norm": np.ones(384, BF16)})
    if NO_QUANTIZATION[config] is not None:
        settings = {"model_type": "llama", **NO_QUANTIZATION[config]}
        (tmp_path / "config.json").write_text(json.dumps(settings))
    plan = plan_on(xy_mesh((2, 4), False), {"up": (256, 384), "norm": (384,)}, jnp.float32, None)
    names = {"up": "model.up.weight", "norm": "model.norm"}
    problems = refused_by_both(
        plan,
        tmp_path,
        new_arrays,
        names,
        [
            "up: tensor 'model.up.weight' in model.safetensors is float8, planned float32, "
            "with no scale beside it ('model.up.weight_scale_inv' is in no file): cast "
            "without its scale, a quantized weight has every value off by its block's scale",
            "put the scale's file beside it",
            "plan the parameter as float8 to load the stored values",
            "ask for a plain cast: Tensor('model.up.weight', dequantize=False)",
        ],
    )
    assert [p.path for p in problems] == ["up"]  # the bf16 norm is no problem


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.float16])
@pytest.mark.parametrize("scale", ["no scale", "a scale beside it"])
@pytest.mark.parametrize("explicit", [False, True])
def test_dequantize_false_reads_the_plain_cast_bit_for_bit(tmp_path, dtype, scale, explicit):
    rng = np.random.default_rng(13)
    w, s = fp8_pair(rng, (256, 384))
    e5 = (rng.standard_normal((256, 384)) * 1000).astype(ml_dtypes.float8_e5m2)
    tensors = {"w": w, "e5": e5}
    if scale == "a scale beside it":
        tensors.update(w_scale_inv=s, e5_scale_inv=s)
    folder = write(tmp_path, tensors)  # config.json declares fp8: asked by name, cast all the same
    mesh = xy_mesh((2, 4), explicit)
    plan = plan_on(mesh, {"w": (256, 384), "kernel": (384, 256)}, dtype)
    names = {
        "w": st.Tensor("w", dequantize=False),
        "kernel": st.Tensor("e5", permute=(1, 0), dequantize=False),
    }
    got = st.load(plan, folder, names=names, unused="ignore")
    want = {"w": w.astype(np.dtype(dtype)), "kernel": e5.T.astype(np.dtype(dtype))}
    entries = {e.path: e for e in plan.entries}
    for path in want:
        assert got[path].sharding == entries[path].sharding and got[path].dtype == dtype
        assert bits(got[path]).tobytes() == bits(want[path]).tobytes(), path
        for shard in got[path].addressable_shards:
            assert (bits(shard.data) == bits(want[path][shard.index])).all()
    found = st.inventory(plan, folder, names=names)
    assert found.dequantized == {} and found.reads == {"w": ("w",), "kernel": ("e5",)}
    if scale == "a scale beside it":  # not applied, so not read: unused like any tensor
        assert found.unused == ("e5_scale_inv", "w_scale_inv")
        with pytest.warns(meshinit.UnusedTensorWarning, match="'e5_scale_inv', 'w_scale_inv'"):
            st.load(plan, folder, names=names)
        with pytest.raises(meshinit.PlanError, match="e5_scale_inv"):
            st.load(plan, folder, names=names, unused="error")
    else:
        assert found.unused == ()


def test_a_weight_read_both_ways_in_one_parameter_is_refused(tmp_path, new_arrays):
    rng = np.random.default_rng(14)
    w, s = fp8_pair(rng, (256, 256))
    folder = write(tmp_path, {"a": w, "a_scale_inv": s, "b": w})
    plan = plan_for({"same": (512, 256), "apart": (512, 256)}, jnp.bfloat16)
    names = {
        "same": st.Concat(["a", st.Tensor("a", dequantize=False)], axis=0),
        "apart": st.Concat(["a", st.Tensor("b", dequantize=False)], axis=0),
    }
    refused_by_both(
        plan,
        folder,
        new_arrays,
        names,
        [
            "same: Concat part [1] tensor 'a' is read as a plain cast (dequantize=False) where "
            "other parts read it dequantized: one parameter reads its float8 weights one "
            "way; give every part the same dequantize=",
            "apart: it reads float8 weights with scales and other tensors ('b') together",
        ],
    )


def test_a_scale_of_the_wrong_shape_or_a_disagreeing_block_is_refused(tmp_path):
    rng = np.random.default_rng(2)
    w = fp8_pair(rng, (256, 384))[0]
    wrong = np.ones((2, 2), np.float32)
    folder = write(tmp_path / "a", {"w": w, "w_scale_inv": wrong})
    plan = plan_for({"w": (256, 384)}, dtype=jnp.bfloat16)
    refused(
        plan,
        folder,
        match=[
            "w: tensor 'w' in model-00001-of-00001.safetensors is float8 (256, 384), planned "
            "bfloat16, and its scale 'w_scale_inv' has shape (2, 2), not (ceil(256/128), "
            "ceil(384/128)) = (2, 3) for the block (128, 128) (",
            "config.json's quantization_config.weight_block_size); the shapes fit a block of "
            "(128, 256) instead: the "
            "config and the shapes disagree; fix the scale or the block size",
        ],
    )
    # the scale fits 64x64 blocks, the config says 128x128
    folder = write(tmp_path / "b", {"w": w, "w_scale_inv": np.ones((4, 6), np.float32)})
    refused(plan, folder, match="the shapes fit a block of (64, 64) instead: the config and")
    with pytest.raises(meshinit.PlanError) as e:  # named by its refusal, not unused as well
        st.load(plan, folder, unused="error")
    assert "unused" not in str(e.value) and "no plan path claims" not in str(e.value)
    # no config: 128x128 only if it fits, never a guess
    folder = write(tmp_path / "c", {"w": w, "w_scale_inv": np.ones((4, 6), np.float32)}, None)
    config = folder / "config.json"
    refused(plan, folder, match=f"(the default, as no quantization_config is found in {config})")
    # a config that states a quantization_config without a block size: named, field and all
    (folder / "config.json").write_text(json.dumps({"quantization_config": {"fmt": "e4m3"}}))
    refused(
        plan,
        folder,
        match=f"(the default, as {config}'s quantization_config has no weight_block_size); the sha",
    )
    # the config's block, honoured
    cfg = {**QUANTIZATION, "weight_block_size": [64, 64]}
    s = rng.uniform(1e-3, 1e-2, (4, 6)).astype(np.float32)
    folder = write(tmp_path / "d", {"w": w, "w_scale_inv": s}, cfg)
    got = st.load(plan, folder)["w"]
    assert (bits(got) == bits(weight_dequant(w, s, (64, 64)))).all()


WRONG_KINDS = {  # config.json -> what its problem says, after the file's name
    "a string": (
        {"quantization_config": "fp8"},
        'quantization_config holds the JSON string "fp8", not an object: meshinit reads a '
        "checkpoint's quantization from its quant_method and weight_block_size; write it as "
        'an object ({"quant_method": "fp8", "weight_block_size": [128, 128]}), or remove it '
        "where the checkpoint is not quantized",
    ),
    "a list": (
        {"quantization_config": ["fp8", 128]},
        'quantization_config holds the JSON array ["fp8", 128], not an object',
    ),
    "a string in text_config": (
        {"text_config": {"quantization_config": "fp8"}},
        'text_config.quantization_config holds the JSON string "fp8", not an object',
    ),
    "a list in text_config": (
        {"text_config": {"hidden_size": 8, "quantization_config": [{"quant_method": "fp8"}]}},
        'text_config.quantization_config holds the JSON array [{"quant_method": "fp8"}], not',
    ),
    "a block size as a string": (
        {"quantization_config": {**QUANTIZATION, "weight_block_size": "128"}},
        'quantization_config.weight_block_size holds the JSON string "128", not a block '
        "size (a string): write it as a list of two positive integers, the rows and columns each "
        "scale covers ([128, 128]), or remove it for the default 128x128",
    ),
    "a block size of a string": (
        {"quantization_config": {**QUANTIZATION, "weight_block_size": [128, "128"]}},
        'quantization_config.weight_block_size holds the JSON array [128, "128"], not a',
    ),
    "a block size of zero": (
        {"text_config": {"quantization_config": {"weight_block_size": 0}}},
        "text_config.quantization_config.weight_block_size holds the JSON number 0, not a",
    ),
    "a block size of three": (
        {"quantization_config": {**QUANTIZATION, "weight_block_size": [128, 128, 128]}},
        "quantization_config.weight_block_size holds the JSON array [128, 128, 128], not a",
    ),
    "a block size of true": (
        {"quantization_config": {**QUANTIZATION, "weight_block_size": True}},
        "quantization_config.weight_block_size holds the JSON boolean true, not a",
    ),
    "a method as a number": (
        {"quantization_config": {**QUANTIZATION, "quant_method": 8}},
        "quantization_config.quant_method holds the JSON number 8, not a string: write it as "
        'the method\'s name ("fp8", "mxfp4")',
    ),
}


@pytest.mark.parametrize("case", list(WRONG_KINDS))
def test_a_quantization_config_of_the_wrong_kind_is_refused_naming_the_field(
    tmp_path, case, new_arrays
):
    settings, said = WRONG_KINDS[case]
    rng = np.random.default_rng(15)
    w, s = fp8_pair(rng, (256, 384))
    folder = write(tmp_path, {"w": w, "w_scale_inv": s, "v": w}, None)
    (folder / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", **settings}))
    plan = plan_on(xy_mesh((2, 4), True), {"w": (256, 384), "v": (256, 384)}, jnp.bfloat16)
    config = str(folder / "config.json")
    problems = refused_by_both(plan, folder, new_arrays, needles=[f"{config}: {said}"])
    # the config's problem first, once; the weight without a scale refused all the same
    assert [p.path for p in problems] == [config, "v"], problems


@pytest.mark.parametrize("size", [64, [64], [64, 64], [64.0, 64.0]])
def test_a_block_size_of_one_number_is_square(tmp_path, size):
    rng = np.random.default_rng(16)
    w, s = fp8_pair(rng, (256, 384), block=(64, 64))
    folder = write(
        tmp_path, {"w": w, "w_scale_inv": s}, {**QUANTIZATION, "weight_block_size": size}
    )
    plan = plan_on(xy_mesh((2, 4), False), {"w": (256, 384)}, jnp.bfloat16)
    got = st.load(plan, folder)["w"]
    assert (bits(got) == bits(weight_dequant(w, s, (64, 64)))).all()
    assert "64x64 blocks" in st.inventory(plan, folder).dequantized["w"]


def test_other_scales_ranks_and_joins_are_refused_by_name(tmp_path):
    rng = np.random.default_rng(4)
    w, s = fp8_pair(rng, (256, 256))
    folder = write(
        tmp_path,
        {
            "a": w,
            "a_scale_inv": s,
            "h": w,
            "h_scale_inv": s.astype(np.float16),
            "c": w,
            "c_scale": s,
            "t": w.reshape(2, 128, 256),
            "t_scale_inv": s,
            "e": w.astype(np.float32).astype(ml_dtypes.float8_e5m2),
            "e_scale_inv": s,
            "bias": np.ones((1, 256), BF16),
        },
    )
    plan = plan_for({"h": (256, 256), "c": (256, 256), "t": (2, 128, 256)}, dtype=jnp.bfloat16)
    refused(
        plan,
        folder,
        match=[
            "h: tensor 'h' in model-00001-of-00001.safetensors is float8, planned bfloat16, "
            "and its scale 'h_scale_inv' is F16: block scales are read from F32 or BF16",
            "c: tensor 'c' in model-00001-of-00001.safetensors is float8 with a 'c_scale' "
            "beside it, planned bfloat16: only DeepSeek-style block scales",
            "t: tensor 't' in model-00001-of-00001.safetensors is float8 of shape "
            "(2, 128, 256), planned bfloat16: block-scaled weights are read dequantized where "
            "they are 2-D",
        ],
    )
    # a Concat and a Pad read dequantized (test_a_concat_..., test_a_pad_...); still refused:
    plan = plan_for(
        {
            "flat": (2, 256 * 256),
            "merged": (512 * 256,),
            "crossed": (256, 512),
            "mixed": (512, 256),
            "bias": (257, 256),
        },
        jnp.bfloat16,
    )
    names = {
        "flat": st.Stack([st.Tensor("a", out_shape=(256 * 256,))] * 2, axis=0),
        "merged": st.Concat([st.Stack(["a", "a"], axis=0, out_shape=(512 * 256,))], axis=0),
        "crossed": st.Concat(["a", st.Tensor("a", permute=(1, 0))], axis=1),
        "mixed": st.Concat(["a", "e"], axis=0),
        "bias": st.Concat(["a", "bias"], axis=0),
    }
    refused(
        plan,
        folder,
        names,
        [
            "flat: Stack part [0] tensor 'a' (float8, dequantized) is not read dequantized "
            "through out_shape=(65536,) inside a Stack, Concat or Pad yet; plan the parameter "
            "as float8",
            "merged: Concat part [0] Stack with out_shape= inside a Stack, Concat or Pad over "
            "float8 weights read dequantized is not supported yet",
            "crossed: Concat of float8 weights read dequantized: along axis 0, tensor 'a''s "
            "view steps (1, 0) (stored rows, columns) and 'a''s (0, 1): its parts' views step "
            "through their stored tensors differently; plan the parameter as float8",
            "mixed: Concat of float8 weights read dequantized: its weights are stored as "
            "F8_E4M3 and F8_E5M2; plan",
            "bias: it reads float8 weights with scales and other tensors ('bias') together",
        ],
    )


def test_a_scale_too_small_for_float32_is_refused_while_reading(tmp_path):
    rng = np.random.default_rng(6)
    w, s = fp8_pair(rng, (256, 256))
    s[1, 0] = 2.0**-120
    folder = write(tmp_path, {"w": w, "w_scale_inv": s})
    plan = plan_for({"w": (256, 256)}, dtype=jnp.float32)
    with pytest.raises(
        meshinit.PlanError, match=r"w: block scale \(1, 0\) of tensor 'w' is .*, below"
    ):
        st.load(plan, folder)


def test_a_product_overflowing_float16_is_refused(tmp_path):
    w = np.full((128, 128), 448.0, np.float32).astype(F8)
    s = np.array([[1000.0]], np.float32)
    folder = write(tmp_path, {"w": w, "w_scale_inv": s})
    plan = plan_for({"w": (128, 128)}, dtype=jnp.float16)
    with pytest.raises(meshinit.PlanError, match="w: tensor 'w' times its block scales overflows"):
        st.load(plan, folder)


@pytest.mark.parametrize("explicit", [False, True])
def test_a_remote_float8_weight_fetches_its_owned_bytes_and_covering_scales(s3_server, explicit):
    pytest.importorskip("obstore")
    pytest.importorskip("moto")
    from safetensors.numpy import save

    rng = np.random.default_rng(8)
    w, s = fp8_pair(rng, (640, 264))  # scale (5, 3)
    k, sk = fp8_pair(rng, (136, 264))  # scale (2, 3)
    data = save({"w": w, "w_scale_inv": s, "k": k, "k_scale_inv": sk})
    header = 8 + int.from_bytes(data[:8], "little")
    bucket = s3_server.bucket()
    s3_server.put(f"{bucket}/m.safetensors", data)
    devices = np.array(jax.devices())
    mesh = jax.make_mesh((8,), ("d",)) if explicit else Mesh(devices, ("d",))
    zeros = jax.nn.initializers.zeros
    plan = meshinit.plan(
        {  # whole rows per device: each block's fp8 bytes one run
            n: meshinit.param(shape, zeros, dtype=jnp.bfloat16, mesh=mesh, axes=("d", None))
            for n, shape in {"w": (320, 264), "wk": (216, 264)}.items()
        }
    )
    names = {  # rows 200:520 of w (scale rows 1-4), and rows 520:600 (row 4) with k (0-1)
        "w": st.Tensor("w", index=np.s_[200:520]),
        "wk": st.Concat([st.Tensor("w", index=np.s_[520:600]), "k"], axis=0),
    }
    s3_server.reset()
    with Reads() as reads:
        got = st.load(plan, f"s3://{bucket}/m.safetensors", names=names)
    full = weight_dequant(w, s)
    assert (bits(got["w"]) == bits(full[200:520])).all()
    assert (bits(got["wk"]) == bits(np.concatenate([full[520:600], weight_dequant(k, sk)]))).all()
    served = [r for r in s3_server.counters.log if r.method == "GET" and r.range]
    sent = sum(r.sent for r in served if r.range[0] >= header)
    fp8 = (320 + 80 + 136) * 264
    scales = (4 + 1 + 2) * 3 * 4  # the covering scale rows, whole rows here
    assert sent == fp8 + scales
    assert reads.values == [sent]


@pytest.mark.slow
def test_two_processes_each_dequantize_the_blocks_their_devices_hold(tmp_path):
    import os
    import pathlib
    import socket
    import subprocess
    import sys

    rng = np.random.default_rng(9)
    w, s = fp8_pair(rng, (320, 264))  # 160-row and 66-column shards cut scale blocks
    write(tmp_path, {"w": w, "w_scale_inv": s})
    np.save(tmp_path / "w.npy", w.view(np.uint8))
    np.save(tmp_path / "s.npy", s)
    # an MXFP4 pair (gpt-oss's layout): K = 192 (6 groups), shards of 96 cut no group
    blocks = rng.integers(0, 256, (4, 24, 6, 16), dtype=np.uint8)
    scales = rng.integers(112, 132, (4, 24, 6), dtype=np.uint8)
    lut = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    lut = np.concatenate([lut, -lut])
    values = np.stack([lut[blocks & 15], lut[blocks >> 4]], -1).reshape(4, 24, 6, 32)
    values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127).reshape(4, 24, 192)
    mx = {"gate_up_proj_blocks": blocks, "gate_up_proj_scales": scales}
    write(tmp_path / "mx", mx, {"quant_method": "mxfp4"})
    np.save(tmp_path / "mx" / "want.npy", values.swapaxes(1, 2).astype(BF16).view(np.uint16))
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    root = pathlib.Path(__file__).resolve().parents[4]
    worker = root / "tests" / "quantized_worker.py"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(root)}
    procs = [
        subprocess.Popen(
            [sys.executable, str(worker), str(i), str(port), str(tmp_path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    try:
        done = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (out, err) in zip(procs, done, strict=True):
        assert p.returncode == 0, err[-3000:]
        got = json.loads(out.strip().splitlines()[-1])
        layouts = ("split", "replicated", "transposed", "fused", "mxfp4 split", "mxfp4 replicated")
        assert got == {k: [True] * 4 for k in layouts}, got


def test_the_dequantization_compiles_with_the_callers_compiler_options(tmp_path):
    # compiled as every compile of meshinit's (compile_lowered), on the worker thread
    # (.ahead) with the options of the block that called load: XLA is handed the
    # option it names, and rejects it; outside the block, meshinit's own options
    rng = np.random.default_rng(70)
    w, s = fp8_pair(rng, (256, 384))
    folder = write(tmp_path, {"w": w, "w_scale_inv": s})
    plan = plan_on(xy_mesh((2, 4), False), {"w": w.shape}, jnp.bfloat16)
    meshinit.clear_cache()
    with meshinit.options(compiler_options={"xla_meshinit_no_such_option": True}):
        with pytest.raises(Exception, match="xla_meshinit_no_such_option"):
            st.load(plan, folder)
    got = st.load(plan, folder)["w"]
    assert (bits(got) == bits(weight_dequant(w, s))).all()
