"""The block scales a block refuses as it reads them, as DeepSeek's ``weight_dequant``
could not apply them or as no checkpoint should hold them: a NaN or infinite scale (a
damaged file), a scale that makes float32 subnormals, a product that overflows. Each is
refused naming the tensor that holds it (not the first of a Stack or a Concat), its
block and its value, and only where the view reads it: the outcome does not depend on
the sharding."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import plan_on, quantized_folder, xy_mesh

import meshinit
from meshinit import safetensors as st

F8 = ml_dtypes.float8_e4m3fn
QUANTIZATION = {"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e4m3"}
FILE = "model-00001-of-00001.safetensors"


def pair(rng, shape):
    pytest.importorskip("safetensors.numpy")
    w = (rng.standard_normal(shape).astype(np.float32) * 40).astype(F8)
    grid = (-(-shape[0] // 128), -(-shape[1] // 128))
    return w, rng.uniform(1e-4, 1e-2, grid).astype(np.float32)


def refusal(plan, folder, names=None):
    with pytest.raises(meshinit.PlanError) as e:
        st.load(plan, folder, names=names, unused="ignore")
    return str(e.value)


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_a_scale_that_is_nan_or_infinite_is_refused_as_a_damaged_file(tmp_path, value, dtype):
    w, s = pair(np.random.default_rng(1), (256, 384))
    s[1, 2] = value
    folder = quantized_folder(tmp_path, {"w": w, "w_scale_inv": s}, QUANTIZATION)
    said = refusal(plan_on(xy_mesh((2, 4), False), {"w": w.shape}, dtype), folder)
    assert (
        f"w: block scale (1, 2) of tensor 'w' is {str(np.float32(value))} in 'w_scale_inv' "
        f"in {FILE}: "
        f"a scale that is not a finite number makes every value of its block"
    ) in said, said
    assert "the file is damaged: download or convert it again" in said, said
    assert "overflow" not in said and "wider" not in said, said


def test_a_real_overflow_names_the_block_and_says_what_to_do(tmp_path):
    pytest.importorskip("safetensors.numpy")
    w = np.full((256, 128), 448.0, np.float32).astype(F8)
    s = np.array([[1e-3], [1000.0]], np.float32)
    folder = quantized_folder(tmp_path, {"w": w, "w_scale_inv": s}, QUANTIZATION)
    said = refusal(plan_on(xy_mesh((2, 4), False), {"w": w.shape}, jnp.float16), folder)
    assert (
        "w: tensor 'w' times its block scales overflows float16: block scale (1, 0) is "
        "1000.0 in 'w_scale_inv'; plan float32 or bfloat16"
    ) in said, said
    # computed in float32, planned float16: the planned dtype overflows, never inf silently
    plan = plan_on(xy_mesh((2, 4), False), {"w": w.shape}, jnp.float16)
    wide = {"w": st.Tensor("w", compute_dtype=jnp.float32)}
    said = refusal(plan, folder, wide)
    assert "w: tensor 'w' times its block scales overflows float16: block scale (1, 0)" in said
    # float32 has no wider plan: the fix names what can be done instead
    s[1, 0] = 1e36
    folder = quantized_folder(tmp_path / "wide", {"w": w, "w_scale_inv": s}, QUANTIZATION)
    said = refusal(plan_on(xy_mesh((2, 4), False), {"w": w.shape}, jnp.float32), folder)
    assert "overflows float32: block scale (1, 0) is 1e+36 in 'w_scale_inv'" in said, said
    assert "no float is wider than float32" in said and "wider dtype" not in said, said


def experts(tmp_path, bad, n=8):
    rng = np.random.default_rng(2)
    tensors = {}
    for e in range(n):
        w, s = pair(rng, (256, 128))
        tensors[f"experts.{e}.w"], tensors[f"experts.{e}.w_scale_inv"] = w, s
    tensors[f"experts.{bad}.w_scale_inv"][1, 0] = np.nan
    folder = quantized_folder(tmp_path, tensors, QUANTIZATION)
    names = {"up": st.Stack([f"experts.{e}.w" for e in range(n)], axis=0)}
    return folder, names


@pytest.mark.parametrize("grid", [(2, 4), (8, 1)])
def test_a_bad_scale_in_a_stack_names_its_own_expert(tmp_path, grid):
    folder, names = experts(tmp_path, bad=5)
    plan = plan_on(xy_mesh(grid, False), {"up": (8, 256, 128)}, jnp.bfloat16, ("x", None, "y"))
    said = refusal(plan, folder, names)
    assert "block scale (1, 0) of tensor 'experts.5.w' is nan in 'experts.5.w_scale_inv'" in said
    assert "experts.0" not in said, said


def test_a_tiny_scale_in_a_stack_or_a_concat_names_its_own_tensor(tmp_path):
    rng = np.random.default_rng(3)
    tensors = {}
    for name in ("a", "b", "c"):
        tensors[name], tensors[name + "_scale_inv"] = pair(rng, (256, 128))
    tensors["b_scale_inv"][1, 0] = 2.0**-120
    folder = quantized_folder(tmp_path, tensors, QUANTIZATION)
    mesh = xy_mesh((2, 4), False)
    for node, shape in (
        (st.Stack(["a", "b", "c"], axis=0), (3, 256, 128)),
        (st.Concat(["a", "b", st.Fill(0.0, (256, 128))], axis=0), (768, 128)),
    ):
        spec = (None, "x", "y") if len(shape) == 3 else ("x", "y")
        plan = plan_on(mesh, {"p": shape}, jnp.float32, spec)
        said = refusal(plan, folder, {"p": node})
        assert "block scale (1, 0) of tensor 'b' is 7.523164e-37 in 'b_scale_inv'" in said
        assert "'a'" not in said, said


def test_a_nan_scale_in_a_concat_part_names_that_part(tmp_path):
    rng = np.random.default_rng(4)
    tensors = {}
    for name in ("a", "b"):
        tensors[name], tensors[name + "_scale_inv"] = pair(rng, (256, 128))
    tensors["b_scale_inv"][0, 0] = np.inf
    folder = quantized_folder(tmp_path, tensors, QUANTIZATION)
    plan = plan_on(xy_mesh((2, 4), False), {"p": (768, 128)}, jnp.bfloat16)
    node = st.Concat(["a", "b", st.Fill(0.0, (256, 128))], axis=0)
    said = refusal(plan, folder, {"p": node})
    assert "block scale (0, 0) of tensor 'b' is inf in 'b_scale_inv'" in said, said
    assert "'a'" not in said, said


SHARDINGS = {"split": ("x", "y"), "unsplit": (None, None)}


@pytest.mark.parametrize("sharding", list(SHARDINGS))
@pytest.mark.parametrize("bad", ["tiny", "nan"])
def test_a_bad_scale_outside_the_view_loads_and_inside_it_is_refused_on_every_sharding(
    tmp_path, sharding, bad
):
    """The view reads rows 0 to 127 and columns 128 to 255 of a (384, 384) weight: a
    bad scale of any other block is never applied; one of block (0, 1) is."""
    w, s = pair(np.random.default_rng(5), (384, 384))
    value = 2.0**-120 if bad == "tiny" else np.nan
    for r, c in ((1, 1), (2, 1), (0, 0), (0, 2), (1, 0)):
        s[r, c] = value  # every block the view does not read
    folder = quantized_folder(tmp_path, {"w": w, "w_scale_inv": s}, QUANTIZATION)
    mesh = xy_mesh((2, 4), False)
    plan = plan_on(mesh, {"v": (128, 128)}, jnp.float32, SHARDINGS[sharding])
    view = {"v": st.Tensor("w", index=(slice(0, 128), slice(128, 256)))}
    got = st.load(plan, folder, names=view, unused="ignore")["v"]
    want = w[:128, 128:256].astype(np.float32) * s[0, 1]
    assert (np.asarray(got) == want).all()
    # the view through a Concat part: the same
    plan2 = plan_on(mesh, {"v": (256, 128)}, jnp.float32, SHARDINGS[sharding])
    joined = {"v": st.Concat([view["v"], st.Fill(0.0, (128, 128))], axis=0)}
    got = st.load(plan2, folder, names=joined, unused="ignore")["v"]
    assert (np.asarray(got)[:128] == want).all()
    s[0, 1] = value  # now a block the view reads
    folder = quantized_folder(tmp_path / "in", {"w": w, "w_scale_inv": s}, QUANTIZATION)
    for p, names in ((plan, view), (plan2, joined)):
        assert "block scale (0, 1) of tensor 'w' is" in refusal(p, folder, names)
