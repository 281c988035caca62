"""The framework maps' own mechanisms (``meshinit.maxtext``, ``meshinit.tunix``) where
neither framework is installed: what runs on the stacks, with stand-ins for the
framework's code. The maps against MaxText and tunix themselves are in
test_maxtext_names.py and test_tunix_names.py (their own venvs)."""

import re
import sys
import types

import jax
import numpy as np
import pytest

import meshinit
import meshinit.maxtext
from meshinit import tunix as tunix_map
from meshinit._checkpoint.maps import hooks, trace
from meshinit._checkpoint.maps.framework import Checkpoint, MissingKey
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


# ------------------------------------------------------------------ meshinit.maxtext


def llama_hook_fns(config):
    """The form of MaxText's Llama hooks: the query scale reads the config's head_dim
    when it runs (as ``scale_query_layer`` does)."""

    def scale_query_layer(x, target_shape):
        depth_scale = np.dtype("float32").type(1 / np.sqrt(config["head_dim"]))
        return (x.astype(np.float32) * depth_scale).astype(x.dtype)

    return scale_query_layer


def test_a_config_key_a_hook_reads_is_named_not_inexpressible(monkeypatch):
    # Meta's Llama 3.1 config.json has no head_dim; without transformers (which
    # fills it, as MaxText builds the config) the file is read as it is
    monkeypatch.setitem(sys.modules, "transformers", None)  # not installed: no import
    raw = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4}
    hf, fix, problems = meshinit.maxtext.hf_config(raw, "ckpt/config.json")
    assert problems == [] and hf == raw
    hook = llama_hook_fns(hf)
    with pytest.raises(MissingKey) as raised:
        hooks.followed(hook, trace.stand_in("q", (64, 64), np.float32), (64, 64))
    assert raised.value.key == "head_dim"
    problem = meshinit.maxtext._missing(
        "head_dim", ["hook scale_query_layer of 'q'", "k"], "MaxText's map", "ckpt/config.json", fix
    )
    assert str(problem) == (
        "ckpt/config.json: config.json has no 'head_dim', which MaxText's map reads (hook "
        "scale_query_layer of 'q' and 1 more); install transformers (MaxText builds the "
        "config with it, filling 'head_dim' and the other defaults), or add 'head_dim' to "
        "config.json"
    )


def test_an_exception_of_a_hook_is_still_what_it_cannot_express():
    def hook(x, target_shape):
        return {}["other"]  # a KeyError that is not the config's

    with pytest.raises(trace.Inexpressible, match="KeyError: 'other'"):
        hooks.followed(hook, trace.stand_in("q", (4, 4), np.float32), (4, 4))


def test_maxtext_rules_replicate_and_list_the_names_its_rules_leave_out():
    import flax.linen as nn
    from flax import nnx

    import meshinit.nnx

    config = types.SimpleNamespace(logical_axis_rules=[["embed", ["fsdp"]], ["mlp", "tensor"]])
    linen = {
        "w": nn.LogicallyPartitioned(np.zeros((4, 4)), ("embed", "o_groups")),
        "b": nn.LogicallyPartitioned(np.zeros((4,)), ("mlp",)),
    }
    rules = meshinit.maxtext.rules(config, linen)
    assert rules == (("embed", ("fsdp",)), ("mlp", "tensor"), ("o_groups", None))
    assert rules.replicated == ("o_groups",)
    with nnx.use_eager_sharding(False):
        kernel = nnx.Param(np.zeros((4, 4)), out_sharding=("embed", "scanned_blocks"))
    assert meshinit.maxtext.rules(config, {"k": kernel}).replicated == ("scanned_blocks",)
    plan = meshinit.plan(
        {"w": meshinit.param((8, 4), jax.nn.initializers.zeros, axes=("embed", "o_groups"),
                             rules=rules, mesh=jax.make_mesh((8,), ("fsdp",)))}
    )  # fmt: skip
    assert plan.entries[0].sharding.spec == jax.sharding.PartitionSpec("fsdp", None)
    # the plan's table and summary say which names are replicated for want of a rule
    noted = "logical axis 'o_groups' replicated: MaxText's rules have no entry (1 param)"
    assert f"  {noted}" in str(plan).splitlines() and noted in plan.summary(), str(plan)
    assert "'embed'" not in str(plan) and noted in plan.compact()

    # nnx resolves the names before planning: its plan lists them as well
    class Scanned(nnx.Module):
        def __init__(self):
            self.k = nnx.Param(np.zeros((8, 4)), out_sharding=("embed", "scanned_blocks"))

    scanned = meshinit.maxtext.rules(config, {"k": kernel})
    nnx_plan = meshinit.nnx.plan(Scanned, rules=scanned, mesh=jax.make_mesh((8,), ("fsdp",)))
    assert nnx_plan.entries[0].sharding.spec == jax.sharding.PartitionSpec("fsdp", None)
    assert noted.replace("o_groups", "scanned_blocks") in nnx_plan.summary()
    # a table written out by hand (a plain tuple) notes nothing
    plain = meshinit.plan(
        {"w": meshinit.param((8, 4), jax.nn.initializers.zeros, axes=("embed", "o_groups"),
                             rules=tuple(rules), mesh=jax.make_mesh((8,), ("fsdp",)))}
    )  # fmt: skip
    assert "MaxText" not in str(plain) and plain.entries[0].sharding == plan.entries[0].sharding


def test_tunix_sizes_against_the_model_config_each_mismatch_named():
    moe = types.SimpleNamespace(
        embed_dim=64, hidden_dim=32, num_heads=8, num_kv_heads=4, head_dim=16, num_layers=2,
        num_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    hf = {
        "hidden_size": 64,
        "intermediate_size": 6144,  # the dense width: an MoE model's experts are moe_...
        "moe_intermediate_size": 32,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "num_hidden_layers": 2,
        "num_experts": 4,
        "num_experts_per_tok": 2,
    }
    assert tunix_map.mismatches(hf, moe, "c.json") == []
    assert tunix_map.mismatches(None, moe, "c.json") == []  # no config.json: nothing to check
    found = tunix_map.mismatches({"text_config": hf | {"num_experts": 8}}, moe, "c.json")
    assert [p.message.split(":")[0] for p in found] == [
        "config.json says num_experts=8, the tunix ModelConfig num_experts=4"
    ]
