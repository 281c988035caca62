"""A float8 kernel's scale as MaxText sizes it (``d // b``, dims under ``b`` kept whole)
against the files' ``weight_scale_inv`` (``ceil(d / b)`` per block of the weight),
checked before a byte is read: on shapes, and element by element on block numbers
through the hooks. The hooks here are small numpy layouts of the kinds MaxText's
qwen3.5 map uses (a transpose, ``x.T.reshape(target)``); tests/clients runs MaxText's."""

import types

from meshinit._checkpoint.maps import maxtext_scales


def transpose(x, target_shape):
    return x.T


def reshaped(x, target_shape):  # a query kernel: (heads * head_dim, emb) -> (emb, heads, hd)
    return x.T.reshape(target_shape)


def config(block=128):
    return types.SimpleNamespace(weight_block_size=block, scan_layers=False, param_scan_axis=1)


def check(planned, tensors, hooks, files=None, block=128):
    mapping = {"k-kernel": "w.weight", "k-kernel_scale": "w.weight_scale_inv"}
    tensors = {n: (s, "F8_E4M3" if n == "w.weight" else "F32") for n, s in tensors.items()}
    return maxtext_scales.problems(
        mapping, hooks, planned, tensors, files or {}, config(block), tensor_handling=None
    )


def test_a_query_whose_heads_are_under_the_block_kept_whole_is_right():
    """Qwen3.5-35B-A3B-FP8's query: 16 heads of 512, in 2048: MaxText's scale
    (16, 16, 4) is the files' (64, 16) transposed and reshaped, block for block."""
    planned = {"k-kernel": (2048, 16, 512), "k-kernel_scale": (16, 16, 4)}
    tensors = {"w.weight": (8192, 2048), "w.weight_scale_inv": (64, 16)}
    hooks = {"k-kernel": reshaped, "k-kernel_scale": reshaped}
    assert check(planned, tensors, hooks) == ({}, None)


def test_a_dimension_not_a_multiple_of_the_block_is_refused_with_both_shapes():
    planned = {"k-kernel": (200, 256), "k-kernel_scale": (1, 2)}  # MaxText: 200 // 128
    tensors = {"w.weight": (256, 200), "w.weight_scale_inv": (2, 2)}  # ceil(200 / 128)
    hooks = {"k-kernel": transpose, "k-kernel_scale": transpose}
    refused, whole = check(planned, tensors, hooks)
    assert whole is None
    assert refused == {
        "k-kernel_scale": (
            "MaxText holds this scale as (1, 2): its kernel (200, 256) in blocks of 128, "
            "each dimension divided by 128 and rounded down, one under 128 kept whole; the "
            "files' 'w.weight_scale_inv' has one scale per 128x128 block of its weight, "
            "rounded up ((2, 2)), and MaxText's hook transpose makes (2, 2) of it. The two "
            "sizes disagree where a dimension is not a multiple of the block (MaxText's own "
            "to_maxtext refuses these files too); load these files into a model whose "
            "quantized dimensions are multiples of 128, or with a weight_block_size that "
            "divides them"
        )
    }


def test_a_scale_that_fits_by_size_only_is_refused_naming_an_element_and_both_blocks():
    """A dimension under the block kept whole where the files' blocks cut across it: the
    weight (130, 2) is two blocks of rows and one of columns; MaxText's kernel
    (2, 1, 130) keeps its 2 whole, and its scale (2, 1, 1), the files' (2, 1) reshaped,
    fits by size and gives half the kernel (130 of 260 elements) another block's scale."""
    planned = {"k-kernel": (2, 1, 130), "k-kernel_scale": (2, 1, 1)}
    tensors = {"w.weight": (130, 2), "w.weight_scale_inv": (2, 1)}
    hooks = {"k-kernel": reshaped, "k-kernel_scale": reshaped}
    refused, _ = check(planned, tensors, hooks)
    assert refused == {
        "k-kernel_scale": (
            "MaxText's dequantization would give kernel element (0, 0, 128) the scale of "
            "block (0, 0) of 'w.weight_scale_inv', but its weight lies in block (1, 0) of "
            "'w.weight_scale_inv' (130 of 260 elements): the scale (2, 1, 1) and the files' "
            "blocks of 128x128 fit by size only. Load these files into a model whose "
            "quantized dimensions are multiples of 128"
        )
    }


def test_files_of_another_block_size_than_maxtexts_are_refused_whole():
    planned = {"k-kernel": (256, 256), "k-kernel_scale": (2, 2)}
    tensors = {"w.weight": (256, 256), "w.weight_scale_inv": (4, 4)}
    hooks = {"k-kernel": transpose, "k-kernel_scale": transpose}
    files = {"text_config": {"quantization_config": {"weight_block_size": [64, 64]}}}
    refused, whole = check(planned, tensors, hooks, files)
    assert refused == {} and whole == (
        "config.json's quantization_config says weight_block_size=[64, 64], MaxText's "
        "config weight_block_size=128: MaxText would size and split these files' scales "
        "for blocks of 128; configure MaxText with weight_block_size: 64"
    )


def test_per_tensor_scales_have_no_blocks_to_check():
    planned = {"k-kernel": (200, 256), "k-kernel_scale": ()}
    tensors = {"w.weight": (256, 200), "w.weight_scale_inv": ()}
    assert check(planned, tensors, {}, block=None) == ({}, None)


def test_a_map_that_reads_no_scale_is_not_checked_whatever_the_block_sizes():
    """DeepSeek's FP8 files read dequantized (MaxText's map names no weight_scale_inv):
    a weight_block_size in MaxText's config that is not the files' is not a problem."""
    mapping = {"k-kernel": "w.weight"}
    tensors = {"w.weight": ((256, 256), "F8_E4M3"), "w.weight_scale_inv": ((4, 4), "F32")}
    files = {"quantization_config": {"weight_block_size": [64, 64]}}
    found = maxtext_scales.problems(
        mapping, {}, {"k-kernel": (256, 256)}, tensors, files, config(128), tensor_handling=None
    )
    assert found == ({}, None)


def test_a_quantization_config_of_the_wrong_kind_refuses_the_map_naming_the_field():
    """Where MaxText's map reads scales, config.json's block size is compared with
    MaxText's: a quantization_config that is no object is named, never read as none
    (it crashed with AttributeError: 'str' object has no attribute 'get')."""
    planned = {"k-kernel": (256, 256), "k-kernel_scale": (2, 2)}
    tensors = {"w.weight": (256, 256), "w.weight_scale_inv": (2, 2)}
    hooks = {"k-kernel": transpose, "k-kernel_scale": transpose}
    for files, said in [
        ({"quantization_config": "fp8"}, 'quantization_config holds the JSON string "fp8"'),
        (
            {"text_config": {"quantization_config": ["fp8"]}},
            'text_config.quantization_config holds the JSON array ["fp8"], not an object',
        ),
        (
            {"quantization_config": {"weight_block_size": "128"}},
            'quantization_config.weight_block_size holds the JSON string "128", not a block',
        ),
    ]:
        refused, whole = check(planned, tensors, hooks, files)
        assert refused == {} and whole is not None and whole.startswith(said), whole
    # a list of one is MaxText's square block, as config.json's
    files = {"text_config": {"quantization_config": {"weight_block_size": [128]}}}
    assert check(planned, tensors, hooks, files) == ({}, None)
