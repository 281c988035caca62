"""MaxText's own models, tiny, and MaxText's own inits, for the MaxText tests.

Import it only where MaxText is installed (after ``pytest.importorskip("maxtext")``).
Nothing of MaxText's code is copied here: the configs are MaxText's base.yml, and the
inits are MaxText's own factories and recipes.
"""

import functools
import os

import flax.linen as nn
import jax
import numpy as np
from maxtext.configs import pyconfig
from maxtext.utils import maxtext_utils, maxtext_utils_nnx, model_creation_utils
from maxtext.utils.globals import MAXTEXT_CONFIGS_DIR


@functools.cache
def tiny_config(scan_layers: bool, layers: int = 2):
    """MaxText's base.yml with a tiny model on fsdp=4 x tensor=2, nothing downloaded."""
    return pyconfig.initialize(
        ["", os.path.join(MAXTEXT_CONFIGS_DIR, "base.yml")],
        base_emb_dim=64,
        base_num_query_heads=4,
        base_num_kv_heads=4,
        head_dim=16,
        base_mlp_dim=128,
        base_num_decoder_layers=layers,
        vocab_size=256,
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
