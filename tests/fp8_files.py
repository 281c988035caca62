"""FP8 block-scaled checkpoints written for the tests, as DeepSeek publishes them (a
float8 weight and its ``<name>_scale_inv`` per 128x128 block), and the reference they
are compared with: a numpy port of DeepSeek-V3's ``weight_dequant``."""

import ml_dtypes
import numpy as np
from helpers import quantized_folder

from meshinit import safetensors as st

F8 = ml_dtypes.float8_e4m3fn
BF16 = ml_dtypes.bfloat16
QUANTIZATION = {"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e4m3"}
UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32}


def weight_dequant(w, s, block=(128, 128), dtype=BF16):
    """A numpy port of DeepSeek-V3's ``inference/kernel.py`` ``weight_dequant``: each
    element times its block's scale in float32 (the last blocks ragged), stored in
    ``dtype`` (the kernel's default dtype)."""
    rows, cols = w.shape
    b0, b1 = block
    assert s.shape == (-(-rows // b0), -(-cols // b1))
    wide = np.repeat(np.repeat(s.astype(np.float32), b0, 0), b1, 1)[:rows, :cols]
    return (w.astype(np.float32) * wide).astype(dtype)


def bits(x):
    x = np.asarray(x)
    return x.view(UINT[x.dtype.itemsize])


def fp8_pair(rng, shape, block=(128, 128), scale_dtype=np.float32, low=1e-4, high=1e-2):
    w = rng.standard_normal(shape).astype(np.float32) * 40
    w = w.astype(F8)
    grid = (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    return w, rng.uniform(low, high, grid).astype(scale_dtype)


def write(tmp_path, tensors, config=QUANTIZATION):
    return quantized_folder(tmp_path, tensors, config)


def experts(tmp_path, layers, n_experts=4, shape=(200, 136)):
    rng = np.random.default_rng(layers)
    tensors, want = {}, []
    for i in range(layers):
        row = []
        for e in range(n_experts):
            name = f"model.layers.{i}.mlp.experts.{e}.up_proj.weight"
            w, s = fp8_pair(rng, shape)
            tensors[name], tensors[name + "_scale_inv"] = w, s
            row.append(weight_dequant(w, s).T)
        want.append(row)
    folder = write(tmp_path, tensors)
    stack = st.Stack(
        [
            st.Stack(
                [
                    st.Tensor(f"model.layers.{i}.mlp.experts.{e}.up_proj.weight", permute=(1, 0))
                    for i in range(layers)
                ],
                axis=0,
            )
            for e in range(n_experts)
        ],
        axis=0,
    )  # [experts, layers, in, out]
    return folder, stack, np.array(want).transpose(1, 0, 2, 3)
