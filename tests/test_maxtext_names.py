"""``meshinit.maxtext.names(config)``: MaxText's own checkpoint maps as ``names=``, family
by family, against MaxText's own conversion.

For each MaxText 0.2.5 family that builds at a tiny size on CPU, scanned and unrolled,
NNX and linen:

1. MaxText's own model of the family's config (``tiny_config(model_name=...)``: its
   ``configs/models/*.yml`` with the sizes made small), and its own placement: the
   shapes, dtypes and shardings its init gives every Param (NNX: the abstract model of
   ``create_nnx_abstract_model``, whose shardings ``create_nnx_sharded_model`` jits its
   init onto; linen: ``init_initial_state``'s logical annotations through flax, as
   ``maxtext_models.maxtext_linen_init`` jits it);
2. the family's Hugging Face ``config.json``: MaxText's own HF config of the model
   (``hf_model_configs``), given MaxText's sizes by MaxText's own
   ``to_huggingface._validate_or_update_architecture(override=True)``;
3. a Hugging Face checkpoint written through MaxText's own MaxText -> HF direction:
   ``PARAM_MAPPING``, ``HOOK_FNS(saving_to_hf=True)``, ``utils.process_maxtext_param``
   (which splits scanned and expert-stacked leaves), ``HF_SHAPE``'s shapes; one
   ``.safetensors`` file. Its values are seeded random numbers, not the init's: an
   init's norm scales are all ones and its biases all zeros, and a map that swapped two
   of them would load them unchanged;
4. MaxText's own HF -> MaxText conversion of that file (``HOOK_FNS(saving_to_hf=False)``,
   stacked by ``tensor_handling.get_hf_loading_function``, as ``load_dynamic`` runs it);
5. ``meshinit.safetensors.load(plan, folder, names=meshinit.maxtext.names(config))`` onto
   ``meshinit.nnx.plan`` / ``meshinit.linen.plan`` of MaxText's own model: every Param
   must have step 4's bytes and MaxText's sharding, and the load reads the bytes the
   process owns.

Families whose hooks ask what a table cannot express are refused by name: one
:class:`meshinit.PlanError` naming the hook and the operation, before a byte is read.
The one test of MaxText's actual init (``test_llama_from_maxtexts_own_init``) ties step
1's placement to the arrays the init gives.

MaxText needs Python 3.12 and jax >= 0.11.1; the module is skipped where it is missing.
"""

import copy
import json

import pytest

maxtext = pytest.importorskip(
    "maxtext", reason="MaxText is not installed (it needs Python 3.12 and jax >= 0.11.1)"
)

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import maxtext_models as mm  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from helpers import Reads, owned_bytes  # noqa: E402
from maxtext.checkpoint_conversion import to_huggingface  # noqa: E402
from maxtext.checkpoint_conversion.utils import (  # noqa: E402
    hf_model_configs,
    hf_shape,
    param_mapping,
    tensor_handling,
)
from maxtext.checkpoint_conversion.utils.utils import process_maxtext_param  # noqa: E402
from maxtext.utils import maxtext_utils, model_creation_utils  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

import meshinit  # noqa: E402
import meshinit.maxtext  # noqa: E402
from meshinit.maxtext import mt_key  # noqa: E402

pytestmark = pytest.mark.slow

MOE = dict(num_experts=4, num_experts_per_tok=2, base_moe_mlp_dim=128, sparse_matmul=False)
MLA = dict(kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
# one dense layer, then MoE; routed_bias off: MaxText cannot convert its bias (it lives
# in the MoEBiasVar collection, its map names it under params-)
DEEPSEEK = MOE | MLA | dict(first_num_dense_layers=1, base_moe_mlp_dim=32, routed_bias=False)

FAMILIES = {  # model name -> tiny overrides of its configs/models/*.yml
    "llama3.1-8b": {},
    "qwen2.5-7b": {},
    "qwen3-8b": {},
    "qwen3-30b-a3b": MOE,
    "mixtral-8x7b": MOE,
    "deepseek2-16b": DEEPSEEK | dict(q_lora_rank=0),
    "deepseek3-671b": DEEPSEEK | dict(q_lora_rank=32),
}

LAYOUTS = [
    pytest.param(scan, framework, id=f"{'scanned' if scan else 'unrolled'}-{framework}")
    for scan in (True, False)
    for framework in ("nnx", "linen")
]


def config_of(model: str, scan: bool):
    return mm.tiny_config(scan, 2, model_name=model, **FAMILIES[model])


def hf_config(model: str, config) -> dict:
    """The family's Hugging Face config, with MaxText's sizes (MaxText's own override),
    and the fields that override leaves stale made to agree with them."""
    hf = copy.deepcopy(hf_model_configs.HF_MODEL_CONFIGS[model])
    to_huggingface._validate_or_update_architecture(hf, config, override=True)
    out = hf.to_dict()
    text = out.get("text_config", out)
    if "first_k_dense_replace" in text:
        text["first_k_dense_replace"] = config.first_num_dense_layers
    if "qk_head_dim" in text:
        text["qk_head_dim"] = config.qk_nope_head_dim + config.qk_rope_head_dim
    if text.get("layer_types"):
        cycle = text["layer_types"]
        text["layer_types"] = [cycle[i % len(cycle)] for i in range(text["num_hidden_layers"])]
    return out


def nnx_placement(config, mesh) -> dict[str, jax.ShapeDtypeStruct]:
    """MaxText's own NNX placement: plan path -> shape, dtype and the sharding its init
    is jitted onto (``create_nnx_sharded_model``'s ``out_shardings``)."""
    _, abstract = model_creation_utils.create_nnx_abstract_model(config, mesh)
    flat = nnx.to_flat_state(nnx.state(abstract, nnx.Param))
    return {".".join(map(str, p)): v.get_value() for p, v in flat}


def linen_placement(config, mesh, model, key) -> dict[str, jax.ShapeDtypeStruct]:
    """MaxText's own linen placement, as ``maxtext_models.maxtext_linen_init`` jits it."""
    rules = config.logical_axis_rules

    def init_variables():
        return maxtext_utils.init_initial_state(model, None, config, False, key).params

    with nn.logical_axis_rules(rules):
        abstract = jax.eval_shape(init_variables)
    shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, rules)
    boxed = lambda x: isinstance(x, nn.meta.AxisMetadata)  # noqa: E731
    leaves = jax.tree_util.tree_flatten_with_path(abstract, is_leaf=boxed)[0]
    out = {}
    for (path, leaf), sharding in zip(leaves, jax.tree_util.tree_leaves(shardings), strict=True):
        leaf = leaf.value if boxed(leaf) else leaf
        name = ".".join(str(k.key) for k in path)
        out[name] = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
    return out


def shaped(model: str) -> str:
    """``model``, or where MaxText keeps no ``HF_SHAPE`` of it (``qwen3-1.7b``), a name
    with the same map and hooks that has one: the save direction needs the HF shapes."""
    if model in hf_shape.HF_SHAPE:
        return model
    same = [
        name
        for name in hf_shape.HF_SHAPE
        if param_mapping.PARAM_MAPPING.get(name) is param_mapping.PARAM_MAPPING[model]
        and param_mapping.HOOK_FNS.get(name) is param_mapping.HOOK_FNS[model]
    ]
    if not same:
        pytest.fail(f"MaxText keeps no HF_SHAPE for {model!r} nor for a name of its map")
    return same[0]


def write_checkpoint(model: str, config, params: dict[str, np.ndarray], folder) -> dict:
    """MaxText's own MaxText -> HF conversion of ``params`` (MaxText key -> array) into
    ``folder/model.safetensors``, with ``folder/config.json``; returns what it wrote."""
    hf = hf_config(model, config)
    maps = to_huggingface._get_model_mappings(shaped(model), config.scan_layers, hf, config)
    mapping = maps["param_mapping"]
    stored = {}
    for key in mapping:
        weight = [params[k] for k in key] if isinstance(key, tuple) else params.get(key)
        if weight is None:
            continue
        for name, array in process_maxtext_param(
            key, weight, mapping, maps["hook_fn_mapping"], maps["shape_mapping"], config
        ):
            stored[name] = np.ascontiguousarray(np.asarray(array))
    folder.mkdir(parents=True, exist_ok=True)
    save_file(stored, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(hf))
    return stored


def maxtext_conversion(model: str, config, stored: dict, targets: dict) -> dict:
    """MaxText's own HF -> MaxText conversion of ``stored`` for each MaxText key's target
    shape: its mapping, its hooks, its stacking (``load_dynamic``'s loading functions)."""
    hf = json.loads(json.dumps(hf_config(model, config)))
    mapping = param_mapping.PARAM_MAPPING[model](hf, config, config.scan_layers)
    hooks = param_mapping.HOOK_FNS[model](hf, config, config.scan_layers, saving_to_hf=False)
    return {
        key: np.asarray(
            tensor_handling.get_hf_loading_function(
                mapping[key], stored.__getitem__, hooks.get(key), shape, config, key
            )()
        )
        for key, shape in targets.items()
    }


_CHECKPOINTS: dict = {}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """One Hugging Face checkpoint per family (the same files for every layout): MaxText's
    save direction of seeded random values in MaxText's scanned NNX placement."""

    def get(model: str):
        if model not in _CHECKPOINTS:
            config = config_of(model, True)
            placement = nnx_placement(config, mm.maxtext_mesh(config))
            rng = np.random.default_rng(0)
            params = {
                mt_key(p): rng.standard_normal(a.shape).astype(a.dtype)
                for p, a in placement.items()
            }
            folder = tmp_path_factory.mktemp(model)
            _CHECKPOINTS[model] = folder, write_checkpoint(model, config, params, folder)
        return _CHECKPOINTS[model]

    return get


def plan_and_placement(config, framework: str):
    mesh = mm.maxtext_mesh(config)
    rules = config.logical_axis_rules
    if framework == "nnx":
        factory = model_creation_utils.get_nnx_create_model_fn(config, mesh)
        with jax.set_mesh(mesh):
            plan = meshinit.nnx.plan(factory, rules=rules)
        return plan, nnx_placement(config, mesh)
    model, args, kwargs = mm.linen_model_and_inputs(config, mesh)
    key, keys = mm.linen_keys(config)
    plan = meshinit.linen.plan(model, keys, *args, mesh=mesh, rules=rules, **kwargs)
    return plan, linen_placement(config, mesh, model, key)


def differences(loaded: dict, want: dict, placement: dict) -> list[str]:
    """Every way a loaded leaf differs from MaxText's conversion or placement."""
    problems = []
    for path, array in loaded.items():
        w = want[mt_key(path)]
        if (array.shape, array.dtype) != (w.shape, w.dtype):
            problems.append(f"{path}: {array.dtype}{array.shape}, MaxText {w.dtype}{w.shape}")
        elif np.asarray(array).tobytes() != w.tobytes():
            problems.append(f"{path}: values differ from MaxText's conversion")
        if array.sharding != placement[path].sharding:
            problems.append(
                f"{path}: placed on {array.sharding}, MaxText on {placement[path].sharding}"
            )
    return problems


@pytest.mark.parametrize("model", FAMILIES)
@pytest.mark.parametrize(("scan", "framework"), LAYOUTS)
def test_load_is_maxtexts_own_conversion_bit_for_bit(checkpoint, model, scan, framework):
    folder, stored = checkpoint(model)
    config = config_of(model, scan)
    plan, placement = plan_and_placement(config, framework)
    targets = {mt_key(p): a.shape for p, a in placement.items()}
    want = maxtext_conversion(model, config, stored, targets)
    with Reads() as reads:
        loaded = meshinit.safetensors.load(plan, folder, names=meshinit.maxtext.names(config))
    assert sorted(loaded) == sorted(placement), "every Param of MaxText's model, and only those"
    problems = differences(loaded, want, placement)
    assert not problems, "\n".join(problems)
    assert reads.values == [owned_bytes(plan, 4, loaded)]  # bytes read == bytes owned
