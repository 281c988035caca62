"""MaxText's own models, tiny, and MaxText's own inits, for the MaxText tests.

Import it only where MaxText is installed (after ``pytest.importorskip("maxtext")``).
Nothing of MaxText's code is copied here: the configs are MaxText's base.yml, and the
inits are MaxText's own factories and recipes. The Hugging Face Llama checkpoint's
tensors (``hf_shapes``) and meshinit's ``names=`` table onto MaxText's model
(``names_table``) serve tests/clients/test_maxtext_load.py and benchmarks/maxtext_load.py.
"""

import functools
import math
import os

import flax.linen as nn
import jax
import numpy as np
from maxtext.configs import pyconfig
from maxtext.utils import maxtext_utils, maxtext_utils_nnx, model_creation_utils
from maxtext.utils.globals import MAXTEXT_CONFIGS_DIR

from meshinit.safetensors import Stack, Tensor


@functools.cache
def tiny_config(scan_layers: bool, layers: int = 2, **overrides):
    """MaxText's base.yml with a tiny model on fsdp=4 x tensor=2, nothing downloaded
    (``model_name=`` a family's yml, its sizes overridden; ``overrides`` win over every
    setting here, the mesh's too)."""
    if "model_name" in overrides:
        overrides.setdefault("override_model_config", True)
    sizes = dict(
        base_emb_dim=64, base_num_query_heads=4, base_num_kv_heads=4, head_dim=16, vocab_size=256
    )
    fixed = dict(
        base_mlp_dim=128,
        base_num_decoder_layers=layers,
        max_target_length=16,
        per_device_batch_size=1,
        scan_layers=scan_layers,
        ici_fsdp_parallelism=4,
        ici_tensor_parallelism=2,
        dcn_data_parallelism=1,
        hardware="cpu",
        enable_checkpointing=False,
        dataset_type="synthetic",
        skip_jax_distributed_system=True,
        # base.yml turns on jax's persistent compilation cache (~/jax_cache) for the
        # whole process: compiles would be served from disk and not counted.
        jax_cache_dir="",
        log_config=False,
    )
    return pyconfig.initialize(
        ["", os.path.join(MAXTEXT_CONFIGS_DIR, "base.yml")], **(fixed | sizes | overrides)
    )


@functools.cache
def maxtext_config(**overrides):
    """MaxText's base.yml with a model's yml as it is (``model_name=``), on CPU."""
    return pyconfig.initialize(
        ["", os.path.join(MAXTEXT_CONFIGS_DIR, "base.yml")],
        max_target_length=16,
        per_device_batch_size=1,
        scan_layers=True,
        dcn_data_parallelism=1,
        hardware="cpu",
        enable_checkpointing=False,
        dataset_type="synthetic",
        skip_jax_distributed_system=True,
        jax_cache_dir="",
        log_config=False,
        **overrides,
    )


def maxtext_mesh(config):
    """MaxText's own mesh for the config: every axis of ``config.mesh_axes``."""
    return maxtext_utils.get_mesh_from_config(config)


def maxtext_nnx_init(config, mesh):
    """MaxText's own NNX init, as ``from_pretrained`` and the trainer's abstract model do."""
    create, abstract = model_creation_utils.create_nnx_abstract_model(config, mesh)
    return maxtext_utils_nnx.create_nnx_sharded_model(abstract, create, mesh=mesh)


def linen_model_and_inputs(config, mesh):
    """MaxText's linen model and what ``maxtext_utils.init_initial_state`` passes to init."""
    model = model_creation_utils.from_config(config, mesh=mesh)  # no rngs: the linen wrapper
    shape = (config.micro_batch_size_to_train_on, config.max_target_length)
    tokens = np.ones(shape, np.int32)
    kwargs = {"encoder_images": None, "encoder_audios": None}
    return model, (tokens, tokens), kwargs


def linen_keys(config):
    """MaxText's init key, and ``init_initial_state``'s split of it into the model's streams."""
    key = jax.random.PRNGKey(config.init_weights_seed)
    params_key, dropout_key, aqt_key = jax.random.split(key, 3)
    return key, {"params": params_key, "dropout": dropout_key, "aqt": aqt_key}


def maxtext_linen_init(config, mesh, model, key):
    """``init_initial_state`` jitted onto flax's shardings of its logical annotations."""

    def init_variables():
        return maxtext_utils.init_initial_state(model, None, config, False, key).params

    rules = config.logical_axis_rules
    with nn.logical_axis_rules(rules):
        abstract = jax.eval_shape(init_variables)
    shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, rules)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        return jax.jit(init_variables, out_shardings=shardings)()


def hf_config(config) -> dict:
    """What MaxText's Llama mapping reads of a Hugging Face config."""
    return {"num_hidden_layers": config.num_decoder_layers, "head_dim": config.head_dim}


def hf_shapes(config) -> dict[str, tuple[int, ...]]:
    """Every tensor of the Hugging Face Llama checkpoint, in torch's (out, in) layout."""
    emb, heads, kv, hd = (
        config.emb_dim,
        config.num_query_heads,
        config.num_kv_heads,
        config.head_dim,
    )
    mlp, vocab = config.mlp_dim, config.vocab_size
    shapes = {
        "model.embed_tokens.weight": (vocab, emb),
        "model.norm.weight": (emb,),
        "lm_head.weight": (vocab, emb),
    }
    for i in range(config.num_decoder_layers):
        layer = f"model.layers.{i}"
        shapes |= {
            f"{layer}.self_attn.q_proj.weight": (heads * hd, emb),
            f"{layer}.self_attn.k_proj.weight": (kv * hd, emb),
            f"{layer}.self_attn.v_proj.weight": (kv * hd, emb),
            f"{layer}.self_attn.o_proj.weight": (emb, heads * hd),
            f"{layer}.mlp.gate_proj.weight": (mlp, emb),
            f"{layer}.mlp.up_proj.weight": (mlp, emb),
            f"{layer}.mlp.down_proj.weight": (emb, mlp),
            f"{layer}.input_layernorm.weight": (emb,),
            f"{layer}.post_attention_layernorm.weight": (emb,),
        }
    return shapes


def names_table(config, nnx_rngs: bool = True) -> list:
    """The ``names=`` rule table for MaxText's Llama, scanned or unrolled, nnx or linen
    (whose plan has no RNG state): every row of MaxText's mapping and hooks, as layouts."""
    emb, heads, kv, hd = (
        config.emb_dim,
        config.num_query_heads,
        config.num_kv_heads,
        config.head_dim,
    )
    n = config.num_decoder_layers

    def rope(count):  # reshape_kernel, then adjust_rope (HF halves -> MaxText pairs)
        return dict(
            shape=(count, 2, hd // 2, emb), permute=(3, 0, 2, 1), out_shape=(emb, count, hd)
        )

    kernels = {  # MaxText name -> (HF name, Tensor transforms)
        r"self_attention\.query\.kernel": (
            "self_attn.q_proj",
            rope(heads) | {"scale": 1 / math.sqrt(hd)},
        ),
        r"self_attention\.key\.kernel": ("self_attn.k_proj", rope(kv)),
        r"self_attention\.value\.kernel": (
            "self_attn.v_proj",
            dict(shape=(kv, hd, emb), permute=(2, 0, 1)),
        ),
        r"self_attention\.out\.kernel": (
            "self_attn.o_proj",
            dict(shape=(emb, heads, hd), permute=(1, 2, 0)),
        ),
        r"mlp\.wi_0\.kernel": ("mlp.gate_proj", dict(permute=(1, 0))),
        r"mlp\.wi_1\.kernel": ("mlp.up_proj", dict(permute=(1, 0))),
        r"mlp\.wo\.kernel": ("mlp.down_proj", dict(permute=(1, 0))),
        r"pre_self_attention_layer_norm\.scale": ("input_layernorm", {}),
        r"post_self_attention_layer_norm\.scale": ("post_attention_layernorm", {}),
    }
    table: list = []
    for regex, (hf, transform) in kernels.items():
        if config.scan_layers:
            parts = [Tensor(f"model.layers.{i}.{hf}.weight", **transform) for i in range(n)]
            axis = config.param_scan_axis  # every scanned leaf here has 2 axes or more
            table.append((rf"(?:params\.)?decoder\.layers\.{regex}", Stack(parts, axis=axis)))
        else:
            target = Tensor(rf"model.layers.\1.{hf}.weight", **transform)
            table.append((rf"(?:params\.)?decoder\.layers_(\d+)\.{regex}", target))
    return [
        *table,
        (r"(?:params\.)?decoder\.decoder_norm\.scale", "model.norm.weight"),
        (r"(?:params\.)?decoder\.logits_dense\.kernel", Tensor("lm_head.weight", permute=(1, 0))),
        (r"(?:params\.)?token_embedder\.embedding", "model.embed_tokens.weight"),
        *([(r".*rngs.*", None)] if nnx_rngs else []),  # RNG state: made by the init
    ]
