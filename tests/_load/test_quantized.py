"""A float8 checkpoint is never loaded unscaled: a float8 weight with its
``<name>_scale_inv`` beside it (DeepSeek-V3, Kimi K2, Qwen3-FP8 as published), or in a
checkpoint whose config.json states a ``quantization_config``, planned as a wider
float, is refused before a byte of data is read, naming the tensor, its scale, the file
and the config; planned as float8, it loads as stored."""

import json

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import Reads, plan_for, stored

import meshinit
from meshinit import safetensors as st

pytest.importorskip("safetensors.numpy")

F8 = ml_dtypes.float8_e4m3fn
QUANTIZATION = {"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e4m3"}


def fp8_checkpoint(tmp_path, layers=2, scales=True, config=True):
    """A DeepSeek-style checkpoint: per layer a (256, 256) float8 weight and its float32
    scale per 128x128 block, whose product is the weight; returns the folder and the
    dequantized weights."""
    rng = np.random.default_rng(0)
    tensors, want = {}, {}
    for i in range(layers):
        w = rng.standard_normal((256, 256)).astype(F8)
        s = np.full((2, 2), 1e-3, np.float32) * (i + 1)
        name = f"model.layers.{i}.mlp.up_proj.weight"
        tensors[name] = w
        if scales:
            tensors[name + "_scale_inv"] = s
        want[name] = w.astype(np.float32) * np.kron(s, np.ones((128, 128), np.float32))
    stored(tmp_path, tensors, "model-00001-of-00001.safetensors")
    if config:
        (tmp_path / "config.json").write_text(json.dumps({"quantization_config": QUANTIZATION}))
    return tmp_path, tensors, want


def up_names(layers):
    return {f"layers.{i}.up": st.Tensor(f"model.layers.{i}.mlp.up_proj.weight") for i in range(2)}


def test_a_float8_weight_with_its_scale_planned_as_bf16_is_refused_before_any_read(tmp_path):
    folder, _, _ = fp8_checkpoint(tmp_path)
    plan = plan_for({"layers.0.up": (256, 256), "layers.1.up": (256, 256)}, dtype=jnp.bfloat16)
    with Reads() as reads, pytest.raises(meshinit.PlanError, match="nothing was read") as e:
        st.load(plan, folder, names=up_names(2), unused="ignore")
    assert reads.values == []  # no byte read
    (problem,) = e.value.problems  # the two layers, one problem
    message = str(problem)
    for needle in (
        "layers.{0,1}.up:",
        "tensor 'model.layers.{0,1}.mlp.up_proj.weight' in model-00001-of-00001.safetensors",
        "is F8_E4M3, with its scale 'model.layers.{0,1}.mlp.up_proj.weight_scale_inv' beside it",
        f"config.json says quantization_config {json.dumps(QUANTIZATION, sort_keys=True)}",
        "planned bfloat16: loading FP8 checkpoints dequantized is not supported yet",
        "plan the parameter as float8_e4m3fn to load the stored values as they are",
        "or convert the checkpoint to bfloat16 first",
    ):
        assert needle in message, f"{needle!r} not in {message}"


def test_inventory_refuses_it_too_and_a_scale_with_no_config_suffices(tmp_path):
    folder, _, _ = fp8_checkpoint(tmp_path, config=False)
    plan = plan_for({"layers.0.up": (256, 256), "layers.1.up": (256, 256)})  # f32
    with pytest.raises(meshinit.PlanError, match=r"weight_scale_inv' beside it, planned float32"):
        st.inventory(plan, folder, names=up_names(2))


def test_many_layers_are_one_line_and_a_stack_is_refused_through_names(tmp_path):
    folder, _, _ = fp8_checkpoint(tmp_path, layers=6)
    names = [f"model.layers.{i}.mlp.up_proj.weight" for i in range(6)]
    plan = plan_for({"up": (6, 256, 256)}, dtype=jnp.bfloat16)
    with pytest.raises(
        meshinit.PlanError,
        match=r"up: tensor 'model\.layers\.\{0\.\.5\}\.mlp\.up_proj\.weight' in .* with its "
        r"scale 'model\.layers\.\{0\.\.5\}\.mlp\.up_proj\.weight_scale_inv' beside it",
    ):
        st.load(plan, folder, names={"up": st.Stack(names, 0)}, unused="ignore")
    # scanned in a Concat, transposed: the stored tensor the parameter reads decides
    parts = [st.Tensor(n, permute=(1, 0)) for n in names[:2]]
    plan = plan_for({"up": (512, 256)}, dtype=jnp.float16)
    with pytest.raises(meshinit.PlanError, match=r"up: .*'model\.layers\.\{0,1\}\..*float16"):
        st.load(plan, folder, names={"up": st.Concat(parts, 0)}, unused="ignore")


def test_no_scale_but_a_quantization_config_is_refused_naming_the_missing_scale(tmp_path):
    folder, _, _ = fp8_checkpoint(tmp_path, layers=1, scales=False)
    plan = plan_for({"up": (256, 256)}, dtype=jnp.bfloat16)
    names = {"up": "model.layers.0.mlp.up_proj.weight"}
    with pytest.raises(
        meshinit.PlanError,
        match=r"up: .*with no scale beside it \('model\.layers\.0\.mlp\.up_proj\.weight_scale_inv'"
        r" is in no file\); .*config\.json says quantization_config",
    ):
        st.load(plan, folder, names=names)


def test_planned_as_float8_it_loads_as_stored_and_unquantized_float8_casts(tmp_path):
    folder, tensors, _ = fp8_checkpoint(tmp_path)
    names = {**up_names(2), "scale": "model.layers.0.mlp.up_proj.weight_scale_inv"}
    plan = meshinit.plan(
        {
            **{
                e.path: e.spec
                for e in plan_for({p: (256, 256) for p in up_names(2)}, dtype=F8).entries
            },
            **{e.path: e.spec for e in plan_for({"scale": (2, 2)}).entries},
        }
    )
    loaded = st.load(plan, folder, names=names, unused="ignore")
    for i in range(2):
        got = np.asarray(loaded[f"layers.{i}.up"])
        stored_bits = tensors[f"model.layers.{i}.mlp.up_proj.weight"]
        assert got.dtype == F8 and got.tobytes() == stored_bits.tobytes()
    # float8 values with no scale and no quantization stated: plain values, cast
    plain = tmp_path / "plain"
    plain.mkdir()
    w = tensors["model.layers.0.mlp.up_proj.weight"]
    path = stored(plain, {"w": w})
    got = st.load(plan_for({"w": (256, 256)}, dtype=jnp.bfloat16), path)["w"]
    assert np.asarray(got).tobytes() == w.astype(jnp.bfloat16).tobytes()
