"""The framework maps' own mechanisms (``meshinit.maxtext``, ``meshinit.tunix``) where
neither framework is installed: what runs on the stacks, with stand-ins for the
framework's code. The maps against MaxText and tunix themselves are in
test_maxtext_names.py and test_tunix_names.py (their own venvs)."""

import re

import numpy as np

import meshinit
from meshinit import tunix as tunix_map
from meshinit._load.framework import Checkpoint
from meshinit.safetensors import Tensor


def torch_key_to_jax_key(mapping, source_key):
    """tunix 0.1.7's ``tunix.utils.torch_utils.torch_key_to_jax_key``, as it reads."""
    subs = [
        (re.sub(pat, repl, source_key), reshape)
        for pat, (repl, reshape) in mapping.items()
        if re.match(pat, source_key)
    ]
    if len(subs) != 1:
        raise ValueError(f"Only one key should be found. Found: {subs} for {source_key}")
    return subs[0]


def test_tunix_unused_names_leave_every_tensor_sent_there_unread():
    # Gemma's map: every bias to the one name unused.bias, each layer's rotary tensors
    # to unused.rotary.<layer>; both were refused as "maps both ... here"
    key_map = {
        r"model\.norm\.weight": ("final_norm.scale", None),
        r"model\.layers\.([0-9]+)\.self_attn\.rotary_emb\..*": (r"unused.rotary.\1", None),
        r".*\.bias": ("unused.bias", None),
    }
    tensors = {
        "model.norm.weight": ((8,), "F32"),
        "model.layers.0.self_attn.q_proj.bias": ((8,), "F32"),
        "model.layers.0.self_attn.k_proj.bias": ((4,), "F32"),
        "model.layers.0.self_attn.rotary_emb.inv_freq": ((4,), "F32"),
        "model.layers.0.self_attn.rotary_emb.cos_cached": ((2, 8), "F32"),
    }
    planned = {"final_norm.scale": ((8,), np.dtype(np.float32))}
    checkpoint = Checkpoint(None, "", tensors, planned)
    syms, _, problems = tunix_map._mapped(key_map, checkpoint, "gemma", torch_key_to_jax_key)
    assert problems == []
    assert sorted(syms) == ["final_norm.scale"]
    table, problems = tunix_map._assembled(syms, checkpoint, "gemma")
    assert problems == []
    assert table == {"final_norm.scale": Tensor("model.norm.weight")}


def test_tunix_two_tensors_to_one_planned_name_are_still_refused():
    key_map = {r"model\.norm\.(weight|scale)": ("final_norm.scale", None)}
    tensors = {"model.norm.weight": ((8,), "F32"), "model.norm.scale": ((8,), "F32")}
    checkpoint = Checkpoint(None, "", tensors, {"final_norm.scale": ((8,), np.dtype("f4"))})
    _, _, problems = tunix_map._mapped(key_map, checkpoint, "toy", torch_key_to_jax_key)
    assert [str(p) for p in problems] == [
        "final_norm.scale: toy maps both model.norm.scale and model.norm.weight here"
    ]
    assert isinstance(problems[0], meshinit.Problem)
