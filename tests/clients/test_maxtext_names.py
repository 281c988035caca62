"""``meshinit.maxtext.names(config)``: MaxText's own checkpoint maps as ``names=``, family
by family, against MaxText's own conversion.

For each MaxText 0.2.5 family that builds at a tiny size on CPU (:data:`TINY`), scanned
and unrolled, NNX and linen where MaxText and meshinit build them (the other names of
``PARAM_MAPPING`` with a tested family's map, :data:`ALIASES`, in one layout each):

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

Composite keys (gpt-oss's and qwen3.5's: one hook of several stored tensors, or one
hook making several parameters) load as MaxText's ``to_maxtext`` converts them; a hook
that asks what a table cannot express is refused by name: one
:class:`meshinit.PlanError` naming, for each parameter, the hook and the operation,
before a byte is read.
The tests of MaxText's actual init (``test_from_maxtexts_own_init``: each family issue
49 names, its checkpoint written from the init's own values) tie step 1's placement
to the arrays the init gives.

MaxText needs Python 3.12 and jax >= 0.11.1; the module is skipped where it is missing.
"""

import copy
import dataclasses
import inspect
import json
import math
import re
import textwrap
import types

import pytest

maxtext = pytest.importorskip(
    "maxtext", reason="MaxText is not installed (it needs Python 3.12 and jax >= 0.11.1)"
)

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import maxtext_models as mm  # noqa: E402
import ml_dtypes  # noqa: E402
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
from meshinit.safetensors import Concat, Tensor  # noqa: E402

pytestmark = pytest.mark.slow

MOE = dict(num_experts=4, num_experts_per_tok=2, base_moe_mlp_dim=128, sparse_matmul=False)
MLA = dict(kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
# one dense layer, then MoE; routed_bias off: MaxText cannot convert its bias (it lives
# in the MoEBiasVar collection, its map names it under params-)
DEEPSEEK = MOE | MLA | dict(first_num_dense_layers=1, base_moe_mlp_dim=32, routed_bias=False)
GDN = dict(gdn_key_head_dim=16, gdn_value_head_dim=16, gdn_num_key_heads=2, gdn_num_value_heads=4)
GEMMA4 = dict(global_head_dim=32, global_num_kv_heads=2)
VL = dict(use_multimodal=False, deepstack_visual_indexes_for_vit=(), mrope_section=(3, 3, 2))
ALL = ((True, "nnx"), (True, "linen"), (False, "nnx"), (False, "linen"))
SCANNED = ((True, "nnx"), (True, "linen"))
UNROLLED = ((False, "nnx"), (False, "linen"))


@dataclasses.dataclass(frozen=True)
class Tiny:
    """A family at a tiny size: overrides of its ``configs/models/*.yml``, its layer
    count, and the layouts (scan_layers, framework) it is tested in."""

    overrides: dict = dataclasses.field(default_factory=dict)
    layers: int = 2
    layouts: tuple = ALL


TINY = {
    "llama3.1-8b": Tiny(),
    "qwen2.5-7b": Tiny(),  # q/k/v biases
    "qwen3-8b": Tiny(),  # q/k norms
    "qwen3-30b-a3b": Tiny(MOE),
    "mixtral-8x7b": Tiny(MOE),
    "deepseek2-16b": Tiny(DEEPSEEK | dict(q_lora_rank=0)),
    "deepseek3-671b": Tiny(DEEPSEEK | dict(q_lora_rank=32)),
    "deepseek3.2-671b": Tiny(  # the sparse indexer needs dot-product attention
        DEEPSEEK
        | dict(q_lora_rank=32, indexer_n_heads=2, indexer_head_dim=16, indexer_topk=8)
        | dict(attention="dot_product")
    ),
    # the embedding padded then scaled, norms offset by 1
    "gemma2-2b": Tiny(),
    "gemma3-4b": Tiny(),  # the text model of a multimodal config (text_config)
    # blocks of 5 local layers (a nested scan) and a global one, of another head size
    "gemma4-31b": Tiny(GEMMA4, layers=6),
    "gemma4-26b": Tiny(GEMMA4 | MOE | dict(base_moe_mlp_dim=32), layers=6),
    # unrolled only (MaxText: per-layer KV sharing cannot scan); sharing off, as MaxText's
    # own init fails with it at this size
    "gemma4-e2b": Tiny(
        GEMMA4
        | dict(hidden_size_per_layer_input=16, vocab_size_per_layer_input=256)
        | dict(num_kv_shared_layers=0),
        layers=6,
        layouts=UNROLLED,
    ),
    # the text model alone (its vision tower off, so its layers may scan)
    "qwen3-vl-2b": Tiny(VL),
    # unrolled, MaxText's map names fused experts (experts.down_proj) that its HF_SHAPE has
    # not: its own save direction fails
    "qwen3-vl-30b-a3b": Tiny(VL | MOE, layouts=SCANNED),
    # a nested block scan (3 linear-attention layers, then a full one); its gated delta
    # net's embed_attn and gdn_head share 'fsdp_transpose': NNX plans with MaxText's
    # resolution (meshinit.maxtext.rules), as flax nnx's own puts it on two dimensions
    "qwen3-next-80b-a3b": Tiny(MOE | GDN, layers=4),
    "gpt-oss-20b": Tiny(MOE),
    # in_proj_ba from in_proj_b and in_proj_a; NNX as qwen3-next
    "qwen3.5-35b-a3b": Tiny(MOE | GDN | dict(mrope_section=(1, 1, 0)), layers=4),
}
# The other names of PARAM_MAPPING that build: the same map and hooks as a family above,
# another configs/models/*.yml (tied embeddings, rope, sizes); each checked in one layout
ALIASES = {
    "llama3.1-70b": "llama3.1-8b",
    "llama3.1-405b": "llama3.1-8b",
    "qwen2.5-1.5b": "qwen2.5-7b",
    "qwen2.5-14b": "qwen2.5-7b",
    "qwen3-0.6b": "qwen3-8b",
    "qwen3-1.7b": "qwen3-8b",
    "qwen3-1.7b-base": "qwen3-8b",
    "qwen3-4b": "qwen3-8b",
    "qwen3-4b-base": "qwen3-8b",
    "qwen3-4b-thinking-2507": "qwen3-8b",
    "qwen3-8b-base": "qwen3-8b",
    "qwen3-14b": "qwen3-8b",
    "qwen3-14b-base": "qwen3-8b",
    "qwen3-32b": "qwen3-8b",
    "qwen3-30b-a3b-base": "qwen3-30b-a3b",
    "qwen3-235b-a22b": "qwen3-30b-a3b",
    "qwen3-vl-4b": "qwen3-vl-2b",
    "mixtral-8x22b": "mixtral-8x7b",
    "gemma2-9b": "gemma2-2b",
    "gemma2-27b": "gemma2-2b",
    "gemma3-12b": "gemma3-4b",
    "gemma3-27b": "gemma3-4b",
    "gemma4-e4b": "gemma4-e2b",
    "gpt-oss-120b": "gpt-oss-20b",
    "qwen3.5-397b-a17b": "qwen3.5-35b-a3b",
}
for _i, (_alias, _family) in enumerate(ALIASES.items()):
    _layouts = TINY[_family].layouts  # one layout each: scanned NNX and unrolled linen by turns
    _want = ((True, "nnx"), (False, "linen"))[_i % 2]
    TINY[_alias] = dataclasses.replace(
        TINY[_family], layouts=(_want,) if _want in _layouts else _layouts[:1]
    )
SCANS = {True: "scanned", False: "unrolled"}


def layouts(models) -> list:
    return [
        pytest.param(model, scan, framework, id=f"{model}-{SCANS[scan]}-{framework}")
        for model in models
        for scan, framework in TINY[model].layouts
    ]


def config_of(model: str, scan: bool):
    tiny = TINY[model]
    return mm.tiny_config(scan, tiny.layers, model_name=model, **tiny.overrides)


# Hugging Face config fields MaxText's override leaves as they were: the MaxText size
# each must now say (where the family's config has the field)
ALSO = dict(
    first_k_dense_replace="first_num_dense_layers",
    linear_key_head_dim="gdn_key_head_dim",
    linear_value_head_dim="gdn_value_head_dim",
    linear_num_key_heads="gdn_num_key_heads",
    linear_num_value_heads="gdn_num_value_heads",
    linear_conv_kernel_dim="gdn_conv_kernel_dim",
    index_topk="indexer_topk",
    top_k_experts="num_experts_per_tok",
    hidden_size_per_layer_input="hidden_size_per_layer_input",
    vocab_size_per_layer_input="vocab_size_per_layer_input",
    num_kv_shared_layers="num_kv_shared_layers",
)


def hf_config(model: str, config) -> dict:
    """The family's Hugging Face config, with MaxText's sizes (MaxText's own
    ``_validate_or_update_architecture(override=True)``), and the fields that override
    leaves stale made to agree with them."""
    hf = copy.deepcopy(hf_model_configs.HF_MODEL_CONFIGS[model])
    text = getattr(hf, "text_config", None)
    if isinstance(text, dict):  # kept as a plain dict (qwen3-vl): the override sets attributes
        hf.text_config = types.SimpleNamespace(**text)
    layered = getattr(getattr(hf, "text_config", hf), "per_layer_config", None)
    if layered:  # gemma4: per-layer sizes, which hide the global ones from the override
        getattr(hf, "text_config", hf).per_layer_config = None
    to_huggingface._validate_or_update_architecture(hf, config, override=True)
    if isinstance(text, dict):
        hf.text_config = vars(hf.text_config)
    out = hf.to_dict()
    text = out.get("text_config", out)
    if layered:  # what the per-layer sizes said of the global layers, MaxText's now
        text["global_head_dim"] = config.global_head_dim
        text["num_global_key_value_heads"] = config.global_num_kv_heads
    for field, name in ALSO.items():
        if field in text:
            text[field] = getattr(config, name)
    if "qk_head_dim" in text:
        text["qk_head_dim"] = config.qk_nope_head_dim + config.qk_rope_head_dim
    if "shared_expert_intermediate_size" in text:
        text["shared_expert_intermediate_size"] = config.moe_mlp_dim * config.shared_experts
    if "linear_key_head_dim" in text:  # this transformers says it with layer_types only
        text.setdefault("full_attention_interval", config.inhomogeneous_layer_cycle_interval)
    if text.get("layer_types"):
        cycle = text["layer_types"]
        text["layer_types"] = [cycle[i % len(cycle)] for i in range(text["num_hidden_layers"])]
    return out


def nnx_placement(config, mesh, abstract=None) -> dict[str, jax.ShapeDtypeStruct]:
    """MaxText's own NNX placement: plan path -> shape, dtype and the sharding its init
    is jitted onto (``create_nnx_sharded_model``'s ``out_shardings``), of ``abstract``
    (else of the abstract model made here)."""
    if abstract is None:
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


def completed(shapes):
    """MaxText 0.2.5's ``QWEN3_NEXT_HF_WEIGHTS_TO_SHAPE`` builds its ``mapping`` and returns
    nothing: its own code, with the ``return mapping`` it lacks."""
    source = textwrap.dedent(inspect.getsource(shapes)) + "  return mapping\n"
    scope = dict(vars(hf_shape))
    exec(source, scope)  # noqa: S102 - MaxText's installed source, one line added
    return scope[shapes.__name__]


def write_checkpoint(model: str, config, params: dict[str, np.ndarray], folder) -> dict:
    """MaxText's own MaxText -> HF conversion of ``params`` (MaxText key -> array) into
    ``folder/model.safetensors``, with ``folder/config.json``; returns what it wrote."""
    hf = hf_config(model, config)
    maps = to_huggingface._get_model_mappings(shaped(model), config.scan_layers, hf, config)
    if maps["shape_mapping"] is None:
        maps["shape_mapping"] = completed(hf_shape.HF_SHAPE[shaped(model)])(hf)
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
    shape: its mapping, its hooks, its stacking (``load_dynamic``'s loading functions).
    A composite key (one hook of several HF tensors, or making several MaxText keys),
    which ``load_dynamic``'s functions do not take, is converted by ``to_maxtext``'s
    eager path: its loading function, then ``_get_maxtext_weight``'s ``[..., i]``."""
    hf = json.loads(json.dumps(hf_config(model, config)))
    mapping = param_mapping.PARAM_MAPPING[model](hf, config, config.scan_layers)
    hooks = param_mapping.HOOK_FNS[model](hf, config, config.scan_layers, saving_to_hf=False)
    out = {}
    for key, sources in mapping.items():
        keys = key if isinstance(key, tuple) else (key,)
        if not any(k in targets for k in keys):
            continue
        if isinstance(key, tuple) or composite_source(sources):
            out |= to_maxtext_composite(key, sources, stored, hooks.get(key), targets, config)
            continue
        load = tensor_handling.get_hf_loading_function(
            sources, stored.__getitem__, hooks.get(key), targets[key], config, key
        )
        out[key] = np.asarray(load())
    return out


def composite_source(sources) -> bool:
    """Whether MaxText's HF source (a name, or lists of them) names tuples of HF keys."""
    while isinstance(sources, list):
        sources = sources[0]
    return isinstance(sources, tuple)


def to_maxtext_composite(key, sources, stored: dict, hook, targets: dict, config) -> dict:
    """``to_maxtext``'s eager conversion of one (possibly composite) key: its loading
    function given the target shape (a list of them for a composite MaxText key), and
    its ``_get_maxtext_weight`` (which takes a composite result's ``[..., i]``)."""
    from maxtext.checkpoint_conversion import to_maxtext

    keys = key if isinstance(key, tuple) else (key,)
    shapes = [tuple(targets[k]) for k in keys]
    shape = shapes if isinstance(key, tuple) else shapes[0]
    load = to_maxtext._get_hf_loading_function(
        sources, stored.__getitem__, hook, shape, config, key
    )
    weights: dict = {}
    index = list(range(len(keys))) if isinstance(key, tuple) else 0
    to_maxtext._get_maxtext_weight(load, index, shape, key, weights, "bfloat16", False)
    return {k: np.asarray(weights[i]) for i, k in enumerate(keys)}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """One Hugging Face checkpoint per family and scan_layers (NNX and linen load the same
    files): MaxText's save direction of seeded random values in MaxText's NNX placement.
    (Not one for both scans: MaxText's maps of some families name other tensors
    unrolled, qwen3-vl-30b-a3b's fused experts.)"""
    made: dict = {}

    def get(model: str, scan: bool = True):
        if (model, scan) not in made:
            config = config_of(model, scan)
            placement = nnx_placement(config, mm.maxtext_mesh(config))
            rng = np.random.default_rng(0)
            params = {
                mt_key(p): rng.standard_normal(a.shape).astype(a.dtype)
                for p, a in placement.items()
            }
            folder = tmp_path_factory.mktemp(f"{model}-{SCANS[scan]}")
            made[model, scan] = folder, write_checkpoint(model, config, params, folder)
        return made[model, scan]

    return get


def plan_and_placement(config, framework: str):
    mesh = mm.maxtext_mesh(config)
    rules = config.logical_axis_rules
    if framework == "nnx":
        factory = model_creation_utils.get_nnx_create_model_fn(config, mesh)
        _, abstract = model_creation_utils.create_nnx_abstract_model(config, mesh)
        # names resolved as MaxText's NNX init resolves them (flax linen's algorithm)
        rules = meshinit.maxtext.rules(config, abstract)
        with jax.set_mesh(mesh):
            plan = meshinit.nnx.plan(factory, rules=rules)
        return plan, nnx_placement(config, mesh, abstract)
    model, args, kwargs = mm.linen_model_and_inputs(config, mesh)
    key, keys = mm.linen_keys(config)
    # default="replicated": a param MaxText leaves unannotated (deepseek3.2's indexer
    # k_norm) is replicated by its own init too (flax gives it P())
    plan = meshinit.linen.plan(
        model, keys, *args, mesh=mesh, rules=rules, default="replicated", **kwargs
    )
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


@pytest.mark.parametrize(("model", "scan", "framework"), layouts(TINY))
def test_load_is_maxtexts_own_conversion_bit_for_bit(checkpoint, model, scan, framework):
    folder, stored = checkpoint(model, scan)
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


# the families issue 49 names, each once from MaxText's actual init
OWN_INIT = [
    "llama3.1-8b",
    "mixtral-8x7b",
    "qwen3-8b",
    "qwen3-30b-a3b",
    "gemma2-2b",
    "gemma3-4b",
    "deepseek3-671b",
]


@pytest.mark.parametrize("model", OWN_INIT)
def test_from_maxtexts_own_init(tmp_path, model):
    """The checkpoint written from MaxText's actual NNX init (not seeded values), scanned:
    every Param as MaxText's conversion gives it, on the sharding of MaxText's own
    array, and the placement the other tests compare with is the init's."""
    config = config_of(model, True)
    mesh = mm.maxtext_mesh(config)
    flat = nnx.to_flat_state(nnx.state(mm.maxtext_nnx_init(config, mesh), nnx.Param))
    own = {".".join(map(str, p)): v.get_value() for p, v in flat}
    stored = write_checkpoint(
        model, config, {mt_key(p): np.asarray(a) for p, a in own.items()}, tmp_path
    )
    want = maxtext_conversion(model, config, stored, {mt_key(p): a.shape for p, a in own.items()})
    plan, placement = plan_and_placement(config, "nnx")
    assert {p: a.sharding for p, a in own.items()} == {
        p: a.sharding for p, a in placement.items()
    }, "MaxText's placement is where its init puts every Param"
    loaded = meshinit.safetensors.load(plan, tmp_path, names=meshinit.maxtext.names(config))
    problems = differences(loaded, want, own)
    assert not problems, "\n".join(problems)


def squares(x, target_shape):
    return x * x


def centred(x, target_shape):
    return (x - float(x.mean())).T


def signs(x, target_shape):
    return x.T if (x > 0).any() else -x.T


@pytest.mark.parametrize(
    ("hook", "operation"),
    [
        (squares, "a scale by another tensor"),
        (centred, "a reduction over the tensor's values"),
        (signs, "a comparison of the tensor's values"),
    ],
)
def test_a_hook_no_table_expresses_is_refused_before_reading(
    checkpoint, monkeypatch, hook, operation
):
    model = "llama3.1-8b"
    folder, _ = checkpoint(model)
    config = config_of(model, True)
    plan, _ = plan_and_placement(config, "nnx")
    key = "params-decoder-layers-mlp-wi_0-kernel"
    own = param_mapping.HOOK_FNS[model]

    def hooks(*args, **kwargs):  # MaxText's hooks, one of them replaced
        return own(*args, **kwargs) | {key: hook}

    monkeypatch.setitem(param_mapping.HOOK_FNS, model, hooks)
    with Reads() as reads, pytest.raises(meshinit.PlanError) as raised:
        meshinit.safetensors.load(plan, folder, names=meshinit.maxtext.names(config))
    assert [p.path for p in raised.value.problems] == ["decoder.layers.mlp.wi_0.kernel"]
    assert str(raised.value.problems[0].message) == (
        f"MaxText 0.2.5's map of {model!r}: hook {hook.__name__} of {key!r} needs "
        f"{operation}, which names= cannot express"
    )
    assert "nothing was read" in str(raised.value)
    assert reads.values == [], "refused before any byte is read"


def test_inventory_shows_the_table_maxtexts_map_builds(checkpoint):
    """Llama's table built from MaxText's map is the hand-written one of
    test_maxtext_load.py, target for target."""
    model = "llama3.1-8b"
    folder, _ = checkpoint(model)
    config = config_of(model, True)
    plan, _ = plan_and_placement(config, "nnx")
    with Reads() as reads:
        built = meshinit.safetensors.inventory(plan, folder, names=meshinit.maxtext.names(config))
        by_hand = meshinit.safetensors.inventory(plan, folder, names=mm.names_table(config))
    assert reads.values == []
    assert by_hand.table is None
    assert dict(built.table) == {**by_hand.loaded, **dict.fromkeys(by_hand.skipped)}
    assert built.loaded == by_hand.loaded
    assert built.unused == ()
    shown = str(built)
    assert "table (built by the framework's map):" in shown
    query = "decoder.layers.self_attention.query.kernel"
    assert f"  {query} <- {built.table[query]!r}" in shown


def test_a_model_maxtext_maps_not_is_refused_by_name(checkpoint):
    """llama2-7b: a MaxText model (configs/models/llama2-7b.yml) without a checkpoint map."""
    folder, _ = checkpoint("llama3.1-8b")
    config = mm.tiny_config(True, 2, model_name="llama2-7b")
    assert "llama2-7b" not in param_mapping.PARAM_MAPPING
    plan, _ = plan_and_placement(config, "nnx")
    with Reads() as reads, pytest.raises(meshinit.PlanError, match="MaxText maps no 'llama2-7b'"):
        meshinit.safetensors.load(plan, folder, names=meshinit.maxtext.names(config))
    assert reads.values == []


# ------------------------------------------- composite keys: gpt-oss and qwen3.5


def test_composite_keys_are_the_layouts_of_their_stored_tensors(checkpoint):
    """gpt-oss's ``interleave``: wi_0 and wi_1 (and their biases) are gate_up_proj's even
    and odd columns; qwen3.5's ``process_wi_0_wi_1`` its halves, transposed; its
    ``concat_qkvz_and_transpose`` the per-key-head concatenation of q, k, v (slices of
    in_proj_qkv) and z, merged and transposed (``docs/names.md``'s ``Concat``), and
    ``concat_ba_and_transpose`` that of in_proj_b and in_proj_a."""
    config = config_of("gpt-oss-20b", False)
    folder, _ = checkpoint("gpt-oss-20b", False)
    plan, _ = plan_and_placement(config, "nnx")
    with Reads() as reads:
        built = meshinit.safetensors.inventory(plan, folder, names=meshinit.maxtext.names(config))
    e, d, two = config.num_experts, config.emb_dim, 2 * config.moe_mlp_dim
    gate_up = "model.layers.1.mlp.experts.gate_up_proj"
    assert {k: v for k, v in built.table.items() if "layers_1.GptOssMlp.wi_" in k} == {
        "decoder.layers_1.GptOssMlp.wi_0": Tensor(gate_up, index=np.s_[0:e, 0:d, 0 : two - 1 : 2]),
        "decoder.layers_1.GptOssMlp.wi_1": Tensor(gate_up, index=np.s_[0:e, 0:d, 1:two:2]),
        "decoder.layers_1.GptOssMlp.wi_0_bias": Tensor(
            f"{gate_up}_bias", index=np.s_[0:e, 0 : two - 1 : 2]
        ),
        "decoder.layers_1.GptOssMlp.wi_1_bias": Tensor(
            f"{gate_up}_bias", index=np.s_[0:e, 1:two:2]
        ),
    }

    config = config_of("qwen3.5-35b-a3b", False)
    folder, _ = checkpoint("qwen3.5-35b-a3b", False)
    plan, _ = plan_and_placement(config, "linen")
    with Reads() as more:
        built = meshinit.safetensors.inventory(plan, folder, names=meshinit.maxtext.names(config))
    assert reads.values == more.values == [], "no data read"
    e, d, half = config.num_experts, config.emb_dim, config.moe_mlp_dim
    hk, dk = config.gdn_num_key_heads, config.gdn_key_head_dim
    vk = config.gdn_num_value_heads // hk * config.gdn_value_head_dim
    layer = "params.decoder.layers_0"
    hf = "model.language_model.layers.0"
    qkv, z = f"{hf}.linear_attn.in_proj_qkv.weight", f"{hf}.linear_attn.in_proj_z.weight"
    b, a = f"{hf}.linear_attn.in_proj_b.weight", f"{hf}.linear_attn.in_proj_a.weight"
    v_per_k = config.gdn_num_value_heads // hk
    expected = {
        f"{layer}.mlp.routed_experts.wi_0": Tensor(
            f"{hf}.mlp.experts.gate_up_proj", index=np.s_[0:e, 0:half, 0:d], permute=(0, 2, 1)
        ),
        f"{layer}.mlp.routed_experts.wi_1": Tensor(
            f"{hf}.mlp.experts.gate_up_proj",
            index=np.s_[0:e, half : 2 * half, 0:d],
            permute=(0, 2, 1),
        ),
        f"{layer}.attention.in_proj_qkvz.kernel": Concat(
            [
                Tensor(qkv, shape=(hk, dk, d), index=np.s_[0 : hk * dk, 0:d]),
                Tensor(qkv, shape=(hk, dk, d), index=np.s_[hk * dk : 2 * hk * dk, 0:d]),
                Tensor(qkv, shape=(hk, vk, d), index=np.s_[2 * hk * dk : hk * (2 * dk + vk), 0:d]),
                Tensor(z, shape=(hk, vk, d)),
            ],
            axis=1,
            out_shape=(hk * (2 * dk + 2 * vk), d),
            permute=(1, 0),
        ),
        f"{layer}.attention.in_proj_ba.kernel": Concat(
            [Tensor(b, shape=(hk, v_per_k, d)), Tensor(a, shape=(hk, v_per_k, d))],
            axis=1,
            out_shape=(2 * hk * v_per_k, d),
            permute=(1, 0),
        ),
    }
    assert {k: built.table[k] for k in expected} == expected


@pytest.mark.parametrize(("scan", "framework"), [(False, "nnx"), (True, "linen")])
def test_gpt_oss_from_bf16_files_is_maxtexts_conversion(tmp_path, scan, framework):
    """gpt-oss is published with MXFP4 experts; MaxText loads bf16 copies. bf16 files
    written here (MaxText's save direction of seeded values, in bf16) into MaxText's
    float32 model: every Param is MaxText's conversion of the bf16 arrays (to_maxtext's
    for the composite keys), widened, and the load reads the bytes it owns (each
    process's columns of the interleaved gate_up_proj, strided)."""
    model = "gpt-oss-20b"
    config = config_of(model, scan)
    f32 = write_checkpoint(model, config, seeded(config), tmp_path / "f32")
    stored = {k: v.astype(ml_dtypes.bfloat16) for k, v in f32.items()}
    (tmp_path / "bf16").mkdir()
    save_file(stored, str(tmp_path / "bf16" / "model.safetensors"))
    (tmp_path / "bf16" / "config.json").write_text((tmp_path / "f32" / "config.json").read_text())
    plan, placement = plan_and_placement(config, framework)
    assert {a.dtype for a in placement.values()} == {np.dtype(np.float32)}
    targets = {mt_key(p): a.shape for p, a in placement.items()}
    want = {
        k: a.astype(np.float32)
        for k, a in maxtext_conversion(model, config, stored, targets).items()
    }
    composite = [p for p in placement if re.search(r"GptOssMlp\.wi_[01]", p)]
    blocks = config.inhomogeneous_layer_cycle_interval if scan else config.num_decoder_layers
    assert len(composite) == 4 * blocks  # wi_0, wi_1 and their biases, per (scanned) block
    with Reads() as reads:
        loaded = meshinit.safetensors.load(
            plan, tmp_path / "bf16", names=meshinit.maxtext.names(config)
        )
    problems = differences(loaded, want, placement)
    assert not problems, "\n".join(problems)
    assert reads.values == [owned_bytes(plan, 2, loaded)]  # bf16 bytes read == owned
    wi = sorted(p for p in composite if not p.endswith("bias"))[:2]
    assert np.asarray(loaded[wi[0]]).tobytes() != np.asarray(loaded[wi[1]]).tobytes()


def mixed(x, target_shape):  # a composite hook no table expresses: one part a product
    return np.stack([x[..., ::2] * x[..., 1::2], x[..., 1::2]], axis=-1)


def test_a_composite_hook_no_table_expresses_is_refused_naming_its_key(checkpoint, monkeypatch):
    """gpt-oss's (wi_0, wi_1) hook replaced by one that multiplies the columns: both
    parameters of each such key refused, naming the hook, the key and the operation."""
    model = "gpt-oss-20b"
    folder, _ = checkpoint(model, True)
    config = config_of(model, True)
    plan, placement = plan_and_placement(config, "nnx")
    own = param_mapping.HOOK_FNS[model]

    def hooks(*args, **kwargs):  # MaxText's hooks, the gate/up ones replaced
        made = own(*args, **kwargs)
        return made | {k: mixed for k in made if isinstance(k, tuple) and k[0].endswith("wi_0")}

    monkeypatch.setitem(param_mapping.HOOK_FNS, model, hooks)
    with Reads() as reads, pytest.raises(meshinit.PlanError) as raised:
        meshinit.safetensors.load(plan, folder, names=meshinit.maxtext.names(config))
    assert reads.values == [], "refused before any byte is read"
    wanted = sorted(p for p in placement if re.search(r"GptOssMlp\.wi_[01]$", p))
    assert sorted(p.path for p in raised.value.problems) == wanted
    for problem in raised.value.problems:
        layers = re.search(r"layers_\d+", problem.path)[0]
        group = tuple(f"params-decoder-layers-{layers}-GptOssMlp-wi_{i}" for i in (0, 1))
        assert problem.message == (
            f"MaxText 0.2.5's map of {model!r}: hook mixed of {group!r} needs a scale by "
            f"another tensor, which names= cannot express"
        )


def test_tensors_of_two_dtypes_one_hook_combines_are_refused_naming_its_key(checkpoint, tmp_path):
    """qwen3.5's in_proj_z stored in bf16 beside a float32 in_proj_qkv: the hook that
    concatenates them would promote in numpy, which a table does not say; refused."""
    model = "qwen3.5-35b-a3b"
    folder, stored = checkpoint(model, True)
    config = config_of(model, True)
    changed = {
        k: v.astype(ml_dtypes.bfloat16) if k.endswith("in_proj_z.weight") else v
        for k, v in stored.items()
    }
    save_file(changed, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    plan, placement = plan_and_placement(config, "linen")
    with Reads() as reads, pytest.raises(meshinit.PlanError) as raised:
        meshinit.safetensors.load(plan, tmp_path, names=meshinit.maxtext.names(config))
    assert reads.values == []
    wanted = sorted(p for p in placement if "in_proj_qkvz" in p)
    assert wanted and sorted(p.path for p in raised.value.problems) == wanted
    for problem in raised.value.problems:
        assert re.fullmatch(
            rf"MaxText 0\.2\.5's map of '{model}': hook concat_qkvz_and_transpose of "
            r"'params-decoder-layers-layer_\d-attention-in_proj_qkvz-kernel' needs HF "
            r"tensors of several dtypes combined by one hook, which names= cannot express",
            problem.message,
        ), problem


# ------------------------------------------- the checkpoint's config, as MaxText reads it


def seeded(config) -> dict[str, np.ndarray]:
    """Seeded random values (MaxText key -> array) in MaxText's NNX placement of ``config``."""
    placement = nnx_placement(config, mm.maxtext_mesh(config))
    rng = np.random.default_rng(0)
    return {mt_key(p): rng.standard_normal(a.shape).astype(a.dtype) for p, a in placement.items()}


# Meta's Llama 3.1 config.json (8B), its sizes those of the tiny model: no head_dim
META_LLAMA31 = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0",
    "use_cache": True,
}


@pytest.mark.parametrize("scan", [True, False])
def test_metas_llama31_config_without_head_dim_loads_as_maxtexts_conversion(
    checkpoint, tmp_path, scan
):
    """It was refused ("needs KeyError: 'head_dim', which names= cannot express"):
    MaxText builds the config with transformers, which fills head_dim."""
    model = "llama3.1-8b"
    folder, stored = checkpoint(model, scan)
    config = config_of(model, scan)
    sizes = dict(
        hidden_size=config.emb_dim,
        intermediate_size=config.mlp_dim,
        num_attention_heads=config.num_query_heads,
        num_key_value_heads=config.num_kv_heads,
        num_hidden_layers=config.num_decoder_layers,
        vocab_size=config.vocab_size,
    )
    (tmp_path / "config.json").write_text(json.dumps(META_LLAMA31 | sizes))
    (tmp_path / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    plan, placement = plan_and_placement(config, "nnx")
    targets = {mt_key(p): a.shape for p, a in placement.items()}
    want = maxtext_conversion(model, config, stored, targets)
    loaded = meshinit.safetensors.load(plan, tmp_path, names=meshinit.maxtext.names(config))
    problems = differences(loaded, want, placement)
    assert not problems, "\n".join(problems)


def test_a_config_key_the_map_reads_and_the_file_lacks_is_named_with_the_fix(checkpoint, tmp_path):
    """A model type transformers does not know: the file as it is, and the key that
    MaxText's map reads and it lacks named (it was "needs KeyError: ..., which names=
    cannot express")."""
    model = "llama3.1-8b"
    folder, _ = checkpoint(model)
    config = config_of(model, True)
    hf = json.loads((folder / "config.json").read_text())
    del hf["num_hidden_layers"]
    hf["model_type"] = "no-such-model-type"
    (tmp_path / "config.json").write_text(json.dumps(hf))
    (tmp_path / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    plan, _ = plan_and_placement(config, "nnx")
    with Reads() as reads, pytest.raises(meshinit.PlanError) as raised:
        meshinit.safetensors.load(plan, tmp_path, names=meshinit.maxtext.names(config))
    assert reads.values == []
    (problem,) = raised.value.problems
    assert problem.path == str(tmp_path / "config.json")
    assert problem.message.startswith(
        "config.json has no 'num_hidden_layers', which MaxText 0.2.5's map of "
        "'llama3.1-8b' reads (the map); transformers builds no config of model_type "
        "'no-such-model-type' ("
    )
    assert problem.message.endswith(
        "which would fill the defaults: add 'num_hidden_layers' to config.json"
    )


# ------------------------------------------------ the checkpoint's sizes against MaxText's


def test_heads_that_disagree_at_equal_sizes_are_refused_naming_each_field(tmp_path):
    """Files of 4 heads of 16 (2 KV heads) into a model of 8 heads of 8 (4 KV heads):
    every reshape fits, and it loaded scrambled (with the files' query scale)."""
    model = "llama3.1-8b"
    files = mm.tiny_config(True, 2, model_name=model, base_num_kv_heads=2)
    write_checkpoint(model, files, seeded(files), tmp_path)
    config = mm.tiny_config(True, 2, model_name=model, base_num_query_heads=8, head_dim=8)
    plan, _ = plan_and_placement(config, "nnx")
    with Reads() as reads, pytest.raises(meshinit.PlanError) as raised:
        meshinit.safetensors.load(plan, tmp_path, names=meshinit.maxtext.names(config))
    assert reads.values == [], "refused before any byte is read"
    fix = (
        "the files are of another model than the plan's; load that model's checkpoint, or "
        "configure MaxText with the checkpoint's sizes"
    )
    where = str(tmp_path / "config.json")
    assert [str(p) for p in raised.value.problems] == [
        f"{where}: config.json says num_attention_heads=4, MaxText's config "
        f"num_query_heads=8: {fix}",
        f"{where}: config.json says num_key_value_heads=2, MaxText's config num_kv_heads=4: {fix}",
        f"{where}: config.json says head_dim=16, MaxText's config head_dim=8: {fix}",
    ]


def test_an_unrolled_model_of_fewer_layers_than_the_files_is_refused(tmp_path):
    """It loaded the files' first layers and only warned of the others as unused."""
    model = "llama3.1-8b"
    files = mm.tiny_config(False, 3, model_name=model)
    write_checkpoint(model, files, seeded(files), tmp_path)
    config = config_of(model, False)  # 2 layers
    plan, _ = plan_and_placement(config, "linen")
    with pytest.raises(meshinit.PlanError) as raised:
        meshinit.safetensors.load(plan, tmp_path, names=meshinit.maxtext.names(config))
    (problem,) = raised.value.problems
    assert problem.message.startswith(
        "config.json says num_hidden_layers=3, MaxText's config num_decoder_layers=2: "
    )


# ------------------------------------ bf16 files into a float32 model: MaxText's routes


def to_maxtext_route(model, config, stored, targets, save_dtype):
    """``to_maxtext`` at ``--save_dtype``: each stored tensor converted as its loader
    converts a torch tensor (cast to the save dtype), its loading function (hooks,
    stacking), its ``LazyTensor`` in the save dtype (what orbax saves); then the
    restore into the model's dtype."""
    from maxtext.checkpoint_conversion import to_maxtext

    save = np.dtype(ml_dtypes.bfloat16) if save_dtype == "bfloat16" else np.dtype(np.float32)
    hf = json.loads(json.dumps(hf_config(model, config)))
    mapping = param_mapping.PARAM_MAPPING[model](hf, config, config.scan_layers)
    hooks = param_mapping.HOOK_FNS[model](hf, config, config.scan_layers, saving_to_hf=False)

    def getter(key):  # _convert_tensor_to_numpy of a torch tensor: to float32, then save
        return stored[key].astype(np.float32).astype(save)

    out = {}
    for key, leaf in targets.items():
        load = to_maxtext._get_hf_loading_function(
            mapping[key], getter, hooks.get(key), leaf.shape, config, key
        )
        lazy = to_maxtext.LazyTensor(load, leaf.shape, save_dtype, name=key)
        out[key] = np.asarray(lazy.__array__(lazy.dtype)).astype(leaf.dtype)
    return out


def load_dynamic_route(model, config, stored, targets):
    """MaxText's direct loader: its loading functions on the stored arrays, onto the
    model's abstract leaves, in the model's dtype."""
    hf = json.loads(json.dumps(hf_config(model, config)))
    mapping = param_mapping.PARAM_MAPPING[model](hf, config, config.scan_layers)
    hooks = param_mapping.HOOK_FNS[model](hf, config, config.scan_layers, saving_to_hf=False)
    return {
        key: np.asarray(
            tensor_handling.get_hf_loading_function(
                mapping[key], stored.__getitem__, hooks.get(key), leaf, config, key
            )()
        ).astype(leaf.dtype)
        for key, leaf in targets.items()
    }


@pytest.mark.parametrize("model", ["llama3.1-8b", "gemma2-2b"])
def test_bf16_files_into_a_float32_model_give_maxtexts_default_routes_bits(tmp_path, model):
    """llama's query scale 1/sqrt(8) and Gemma 2's norm offset round in bfloat16 on
    MaxText's default routes (its direct loader and to_maxtext at --save_dtype=bfloat16);
    meshinit computed them in float32, which is only to_maxtext --save_dtype=float32:
    now hook_dtype="float32"."""
    config = mm.tiny_config(True, 2, model_name=model, head_dim=8)
    f32 = write_checkpoint(model, config, seeded(config), tmp_path / "f32")
    stored = {k: v.astype(ml_dtypes.bfloat16) for k, v in f32.items()}
    (tmp_path / "bf16").mkdir()
    save_file(stored, str(tmp_path / "bf16" / "model.safetensors"))
    (tmp_path / "bf16" / "config.json").write_text((tmp_path / "f32" / "config.json").read_text())
    plan, placement = plan_and_placement(config, "nnx")
    assert {a.dtype for a in placement.values()} == {np.dtype(np.float32)}
    targets = {mt_key(p): jax.ShapeDtypeStruct(a.shape, a.dtype) for p, a in placement.items()}
    direct = load_dynamic_route(model, config, stored, targets)
    default = to_maxtext_route(model, config, stored, targets, "bfloat16")
    wide = to_maxtext_route(model, config, stored, targets, "float32")
    assert {k: a.tobytes() for k, a in direct.items()} == {
        k: a.tobytes() for k, a in default.items()
    }, "MaxText's two default routes agree"
    rounds = [k for k in wide if wide[k].tobytes() != default[k].tobytes()]
    assert rounds, "a hook that rounds otherwise in float32 (the test has teeth)"

    for given, want in (({}, default), ({"hook_dtype": "bfloat16"}, default), (
        {"hook_dtype": "float32"}, wide
    )):  # fmt: skip
        names = meshinit.maxtext.names(config, **given)
        loaded = meshinit.safetensors.load(plan, tmp_path / "bf16", names=names)
        problems = differences(loaded, want, placement)
        assert not problems, f"{names!r}:\n" + "\n".join(problems)


def test_hook_dtype_bfloat16_rounds_float32_files_as_to_maxtexts_default(checkpoint):
    model = "gemma2-2b"
    folder, stored = checkpoint(model, True)
    config = config_of(model, True)
    plan, placement = plan_and_placement(config, "nnx")
    targets = {mt_key(p): jax.ShapeDtypeStruct(a.shape, a.dtype) for p, a in placement.items()}
    want = to_maxtext_route(model, config, stored, targets, "bfloat16")
    names = meshinit.maxtext.names(config, hook_dtype="bfloat16")
    problems = differences(meshinit.safetensors.load(plan, folder, names=names), want, placement)
    assert not problems, "\n".join(problems)
    with pytest.raises(ValueError, match=r"hook_dtype must be one of 'stored', 'bfloat16'"):
        meshinit.maxtext.names(config, hook_dtype="float16")


# ------------------------------------------- MaxText's own models with rule-less names


def test_deepseek4_plans_with_maxtexts_rules_completed_as_flax_places_them():
    """MaxText's rules have no entry for deepseek4's o_groups, indexer_q,
    indexer_weights, o_lora_up_proj and scanned_blocks: the strict plan refuses them;
    meshinit.maxtext.rules replicates them as flax does, lists them, and the plan is
    flax's own placement of MaxText's init, leaf for leaf."""
    config = mm.maxtext_config(
        model_name="deepseek4-tiny",
        attention="dot_product",
        sparse_matmul=False,
        ici_fsdp_parallelism=8,
        ici_tensor_parallelism=1,
    )
    mesh = mm.maxtext_mesh(config)
    model, args, kwargs = mm.linen_model_and_inputs(config, mesh)
    key, keys = mm.linen_keys(config)
    options = dict(mesh=mesh, default="replicated", **kwargs)
    with pytest.raises(meshinit.PlanError, match="logical axis 'o_groups' has no rule"):
        meshinit.linen.plan(model, keys, *args, rules=config.logical_axis_rules, **options)
    with nn.logical_axis_rules(config.logical_axis_rules):
        abstract = jax.eval_shape(
            lambda: maxtext_utils.init_initial_state(model, None, config, False, key).params
        )
    rules = meshinit.maxtext.rules(config, abstract)
    assert rules.replicated == (
        "indexer_q",
        "indexer_weights",
        "o_groups",
        "o_lora_up_proj",
        "scanned_blocks",
    )
    plan = meshinit.linen.plan(model, keys, *args, rules=rules, **options)
    summary = plan.summary()  # each added name listed, with why it is replicated
    for name in rules.replicated:
        assert f"logical axis {name!r} replicated: MaxText's rules have no entry (" in summary
    theirs = linen_placement(config, mesh, model, key)
    assert {e.path: e.sharding for e in plan.entries} == {p: a.sharding for p, a in theirs.items()}
    kernel = next(e for e in plan.entries if e.path.endswith("o_a_proj.kernel"))
    assert (
        "o_groups" in kernel.spec.axes
        and kernel.sharding.spec[kernel.spec.axes.index("o_groups")] is None
    )


# DeepSeek-V3's float8 weights as published: every attention and MLP (dense, expert,
# shared-expert) projection; not the embedding, the head, the norms or the router
FP8_WEIGHTS = re.compile(
    r"\.(self_attn\.(q_a_proj|q_b_proj|q_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)|"
    r"mlp\.(experts\.\d+\.|shared_experts\.)?(gate_proj|up_proj|down_proj))\.weight$"
)


@pytest.mark.parametrize(("scan", "framework"), [(True, "nnx"), (False, "linen")])
def test_deepseek3_fp8_files_load_as_maxtexts_conversion_of_their_dequantized_copy(
    tmp_path, scan, framework
):
    """DeepSeek-V3's FP8 files (float8 weights, a float32 scale per 128x128 block,
    config.json's quantization_config) through ``maxtext.names``: every Param has the
    bits MaxText's own conversion gives from the copy DeepSeek's ``weight_dequant``
    makes (here in the files' float32), on MaxText's sharding."""
    model = "deepseek3-671b"
    config = config_of(model, scan)
    wide = write_checkpoint(model, config, seeded(config), tmp_path / "wide")
    hf = json.loads((tmp_path / "wide" / "config.json").read_text())
    rng = np.random.default_rng(1)
    fp8, dequantized = {}, {}
    for name, x in wide.items():
        if not FP8_WEIGHTS.search(name):
            fp8[name] = dequantized[name] = x
            continue
        assert x.ndim == 2, name
        s = rng.uniform(1e-3, 1e-2, (-(-x.shape[0] // 128), -(-x.shape[1] // 128)))
        s = s.astype(np.float32)
        every = np.repeat(np.repeat(s, 128, 0), 128, 1)[: x.shape[0], : x.shape[1]]
        w = (x.astype(np.float32) / every).astype(ml_dtypes.float8_e4m3fn)
        fp8[name], fp8[name + "_scale_inv"] = w, s
        dequantized[name] = (w.astype(np.float32) * every).astype(x.dtype)  # weight_dequant
    quantization = {"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e4m3"}
    folder = quantized_checkpoint(tmp_path / "fp8", fp8, hf | {"quantization_config": quantization})
    loads_as_conversion_of(model, config, framework, folder, dequantized, at_least=5)


def quantized_checkpoint(folder, tensors, config: dict):
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def loads_as_conversion_of(model, config, framework, folder, dequantized, at_least):
    """The quantized files in ``folder`` through ``maxtext.names``: at least
    ``at_least`` paths dequantized, nothing unused, and every Param the bits MaxText's
    own conversion gives from ``dequantized`` (the reference's copy), on its sharding."""
    plan, placement = plan_and_placement(config, framework)
    want = maxtext_conversion(
        model, config, dequantized, {mt_key(p): a.shape for p, a in placement.items()}
    )
    names = meshinit.maxtext.names(config)
    found = meshinit.safetensors.inventory(plan, folder, names=names)
    assert found.unused == () and len(found.dequantized) >= at_least
    loaded = meshinit.safetensors.load(plan, folder, names=names, unused="error")
    assert sorted(loaded) == sorted(placement)
    problems = differences(loaded, want, placement)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(("scan", "framework"), [(True, "nnx"), (False, "linen")])
def test_gpt_oss_mxfp4_files_load_as_maxtexts_conversion_of_their_dequantized_copy(
    tmp_path, scan, framework
):
    """gpt-oss's MXFP4 files (each expert weight as ``_blocks`` and ``_scales``,
    config.json's ``quant_method: mxfp4``) through ``maxtext.names``: every Param has
    the bits MaxText's own conversion gives from the copy transformers'
    ``convert_moe_packed_tensors`` makes (a numpy port,
    ``tests/_checkpoint/encodings/mxfp4/test_pairing.py``'s),
    including the interleaved wi_0/wi_1 columns of gate_up_proj."""
    model = "gpt-oss-20b"
    config = config_of(model, scan)
    wide = write_checkpoint(model, config, seeded(config), tmp_path / "wide")
    hf = json.loads((tmp_path / "wide" / "config.json").read_text())
    rng = np.random.default_rng(2)
    packed, dequantized = {}, {}
    for name, x in wide.items():
        if not re.search(r"\.mlp\.experts\.(gate_up_proj|down_proj)$", name):
            packed[name] = dequantized[name] = x
            continue
        e, k, r = x.shape  # transformers' [experts, in, out]
        assert k % 32 == 0, (name, x.shape)
        blocks = rng.integers(0, 256, (e, r, k // 32, 16), dtype=np.uint8)
        scales = rng.integers(118, 128, (e, r, k // 32), dtype=np.uint8)
        packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
        values = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
        values = np.concatenate([values, -values])
        out = np.empty((e, r, k // 32, 32))
        out[..., 0::2], out[..., 1::2] = values[blocks & 15], values[blocks >> 4]
        out = np.ldexp(out, scales.astype(np.int32)[..., None] - 127)
        dequantized[name] = out.reshape(e, r, k).swapaxes(1, 2).astype(x.dtype)
    assert len(packed) > len(wide)  # some experts are packed
    quantization = {"quant_method": "mxfp4", "modules_to_not_convert": ["router"]}
    config_json = hf | {"quantization_config": quantization}
    folder = quantized_checkpoint(tmp_path / "mxfp4", packed, config_json)
    loads_as_conversion_of(model, config, framework, folder, dequantized, at_least=3)


# ------------------------------------------- qwen3.5 FP8: kept quantized, as MaxText holds it

QWEN35_FP8 = "qwen3.5-35b-a3b-fp8"
# Qwen3.5-35B-A3B-FP8's float8 weights as published: full and linear attention's
# projections (not in_proj_b/a), the shared expert's and each routed expert's own
# gate/up/down; not the embedding, the head, the router, the norms or the conv
FP8_PUBLISHED = re.compile(
    r"\.(self_attn\.[qkvo]_proj|linear_attn\.(in_proj_qkv|in_proj_z|out_proj)|"
    r"mlp\.(experts\.\d+|shared_expert)\.(gate|up|down)_proj)\.weight$"
)


def fp8_config(scan: bool, block: int = 16, model: str = QWEN35_FP8, **more):
    """MaxText's qwen3.5-35b-a3b-fp8 at qwen3.5-35b-a3b's tiny size (``weight_dtype:
    float8_e4m3fn``, ``kernel_scale`` params of float32); at block 16 every dimension
    its scales split is a multiple of the block, so MaxText's scale shapes (``d // b``,
    dims under ``b`` kept whole) are the files' (``ceil(d / b)``)."""
    tiny = TINY["qwen3.5-35b-a3b"]
    return mm.tiny_config(
        scan, tiny.layers, model_name=model, weight_block_size=block,
        **(tiny.overrides | more),
    )  # fmt: skip


def fp8_shapes(hf: dict, model: str = QWEN35_FP8) -> dict[str, list[int]]:
    """Every tensor of a Qwen3.5-FP8 checkpoint of the HF config ``hf``: MaxText's
    ``HF_SHAPE``, the routed experts per expert (``experts.{e}.gate_proj.weight``...)."""
    text = hf["text_config"]
    shapes = {k: v for k, v in hf_shape.HF_SHAPE[model](hf).items() if isinstance(k, str)}
    for name in [k for k in shapes if k.endswith((".experts.gate_up_proj", ".experts.down_proj"))]:
        experts, out, inner = shapes.pop(name)
        layer = name.rsplit(".experts.", 1)[0]
        for e in range(text["num_experts"]):
            if name.endswith("gate_up_proj"):
                shapes[f"{layer}.experts.{e}.gate_proj.weight"] = [out // 2, inner]
                shapes[f"{layer}.experts.{e}.up_proj.weight"] = [out // 2, inner]
            else:
                shapes[f"{layer}.experts.{e}.down_proj.weight"] = [out, inner]
    return shapes


def write_fp8_checkpoint(config, folder, scale_dtype, block: int = 16) -> dict:
    """A Qwen3.5-FP8 checkpoint as published, at ``config``'s sizes: every tensor of
    MaxText's ``HF_SHAPE`` in bf16, the routed experts per expert (``experts.{e}.
    gate_proj.weight``, ...), each weight ``FP8_PUBLISHED`` names float8 with a
    ``weight_scale_inv`` of ``(ceil(R / block), ceil(C / block))`` in ``scale_dtype``,
    and config.json's ``quantization_config``; returns the tensors written."""
    hf = hf_config(config.model_name, config)
    shapes = fp8_shapes(hf, config.model_name)
    rng = np.random.default_rng(3)
    stored = {}
    for name, shape in sorted(shapes.items()):
        if not FP8_PUBLISHED.search(name):
            stored[name] = rng.standard_normal(shape).astype(ml_dtypes.bfloat16)
            continue
        assert len(shape) == 2, name
        w = rng.standard_normal(shape) * 50
        stored[name] = w.astype(ml_dtypes.float8_e4m3fn)
        blocks = (-(-shape[0] // block), -(-shape[1] // block))
        stored[name + "_scale_inv"] = rng.uniform(1e-3, 1e-2, blocks).astype(scale_dtype)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(stored, str(folder / "model.safetensors"))
    quantization = {
        "quant_method": "fp8", "weight_block_size": [block, block], "fmt": "e4m3",
        "activation_scheme": "dynamic",
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(hf | {"quantization_config": quantization}))
    return stored


def to_maxtext_fp8(config, stored: dict, targets: dict) -> dict:
    """``to_maxtext --save_dtype=float8_e4m3fn`` (eager): each tensor as its loader
    keeps it (float8 as float8, a scale in its stored dtype), MaxText's loading
    function (hooks, stacking) and ``_get_maxtext_weight`` (a composite's ``[..., i]``);
    then the restore into the model's dtype (a bf16 scale widened to float32)."""
    from maxtext.checkpoint_conversion import to_maxtext

    model = config.model_name
    hf = json.loads(json.dumps(hf_config(model, config)))
    mapping = param_mapping.PARAM_MAPPING[model](hf, config, config.scan_layers)
    hooks = param_mapping.HOOK_FNS[model](hf, config, config.scan_layers, saving_to_hf=False)

    def getter(key):
        held = stored[to_maxtext.resolve_scale_key(key, stored)]
        return to_maxtext._convert_tensor_to_numpy(held, "float8_e4m3fn")

    out = {}
    for key, sources in mapping.items():
        keys = key if isinstance(key, tuple) else (key,)
        if not any(k in targets for k in keys):
            continue
        shapes = [tuple(targets[k].shape) for k in keys]
        shape = shapes if isinstance(key, tuple) else shapes[0]
        load = to_maxtext._get_hf_loading_function(
            sources, getter, hooks.get(key), shape, config, key
        )
        weights: dict = {}
        index = list(range(len(keys))) if isinstance(key, tuple) else 0
        to_maxtext._get_maxtext_weight(load, index, shape, key, weights, "float8_e4m3fn", False)
        out |= {k: np.asarray(weights[i]).astype(targets[k].dtype) for i, k in enumerate(keys)}
    return out


def fp8_layouts():
    """qwen3.5's tiny layouts (TINY), each with bfloat16 scales (as Qwen3.5-35B-A3B-FP8
    stores them) and float32 ones (as the other FP8 releases do); MaxText's other FP8
    name with a config (the same map and hooks, its own HF config) in the first."""
    found = [
        pytest.param(
            QWEN35_FP8, scan, framework, dtype,
            id=f"{QWEN35_FP8}-{SCANS[scan]}-{framework}-{np.dtype(dtype).name}",
        )
        for scan, framework in TINY["qwen3.5-35b-a3b"].layouts
        for dtype in (ml_dtypes.bfloat16, np.float32)
    ]  # fmt: skip
    scan, framework = TINY["qwen3.5-35b-a3b"].layouts[0]
    other = "qwen3.5-397b-a17b-fp8"
    named = f"{other}-{SCANS[scan]}-{framework}-bfloat16"
    return [*found, pytest.param(other, scan, framework, ml_dtypes.bfloat16, id=named)]


@pytest.mark.parametrize(("model", "scan", "framework", "scale_dtype"), fp8_layouts())
def test_qwen35_fp8_kept_quantized_is_maxtexts_conversion(
    tmp_path, model, scan, framework, scale_dtype
):
    """MaxText's qwen3.5-FP8 model holds float8 kernels and float32 ``kernel_scale``s
    (the routed experts' ``wi_0_scale``...): the files' float8 weights load as stored,
    each ``weight_scale_inv`` (bf16 or f32) widened exactly to float32, the linear
    attention's qkvz scale through ``concat_qkvz_scales_and_transpose`` (a Concat), the
    experts from MaxText's nested per-expert lists: every Param has the bits of
    ``to_maxtext --save_dtype=float8_e4m3fn``, on MaxText's sharding, nothing
    dequantized, nothing unused, and the load reads the bytes the process owns."""
    config = fp8_config(scan, model=model)
    stored = write_fp8_checkpoint(config, tmp_path, scale_dtype)
    plan, placement = plan_and_placement(config, framework)
    fp8 = {p for p, a in placement.items() if a.dtype == ml_dtypes.float8_e4m3fn}
    scales = {
        p for p in placement if re.search(r"(kernel_scale|wi_0_scale|wi_1_scale|wo_scale)$", p)
    }
    assert {placement[p].dtype for p in scales} == {np.dtype(np.float32)}
    # 3 linear-attention layers (qkvz, out_proj, 3 shared-expert, 3 routed-expert
    # kernels) and a full-attention one (q, k, v, out and the 6 MLP kernels)
    assert len(fp8) == len(scales) == 3 * 8 + 10, "every float8 kernel has its scale"
    targets = {mt_key(p): jax.ShapeDtypeStruct(a.shape, a.dtype) for p, a in placement.items()}
    want = to_maxtext_fp8(config, stored, targets)
    names = meshinit.maxtext.names(config)
    found = meshinit.safetensors.inventory(plan, tmp_path, names=names)
    assert found.unused == () and found.dequantized == {}, "kept quantized, every tensor read"
    qkvz = [p for p in scales if "in_proj_qkvz" in p]
    assert qkvz and all(
        isinstance(found.table[p], Concat) or "Concat(" in repr(found.table[p]) for p in qkvz
    )
    with Reads() as reads:
        loaded = meshinit.safetensors.load(plan, tmp_path, names=names, unused="error")
    assert sorted(loaded) == sorted(placement)
    problems = differences(loaded, want, placement)
    assert not problems, "\n".join(problems)
    others = set(placement) - fp8 - scales
    assert {placement[p].dtype for p in others} == {np.dtype(ml_dtypes.bfloat16)}
    owned = (
        owned_bytes(plan, 1, fp8)
        + owned_bytes(plan, np.dtype(scale_dtype).itemsize, scales)
        + owned_bytes(plan, 2, others)
    )
    assert reads.values == [owned], "bytes read == bytes owned, at the stored sizes"


def test_qwen35_fp8_scales_maxtext_sizes_otherwise_are_refused_by_name(tmp_path):
    """A hidden size of 72 in blocks of 16: MaxText sizes each kernel_scale by floor
    (72 // 16 = 4), the files by ceil (5). MaxText's own to_maxtext fails on them; every
    scale is refused before a byte is read, naming both shapes, why and the fix."""
    config = fp8_config(True, base_emb_dim=72)
    stored = write_fp8_checkpoint(config, tmp_path, ml_dtypes.bfloat16)
    plan, placement = plan_and_placement(config, "linen")
    targets = {mt_key(p): jax.ShapeDtypeStruct(a.shape, a.dtype) for p, a in placement.items()}
    with pytest.raises(ValueError):  # MaxText's own conversion refuses them too
        to_maxtext_fp8(config, stored, targets)
    with Reads() as reads, pytest.raises(meshinit.PlanError) as raised:
        meshinit.safetensors.load(plan, tmp_path, names=meshinit.maxtext.names(config))
    assert reads.values == [], "refused before any byte is read"
    scales = sorted(p for p in placement if re.search(r"(_scale|kernel_scale)$", p))
    assert sorted(p.path for p in raised.value.problems) == scales and len(scales) == 34
    said = {p.path: p.message for p in raised.value.problems}
    hf = "model.language_model.layers"
    fix = (
        "The two sizes disagree where a dimension is not a multiple of the block "
        "(MaxText's own to_maxtext refuses these files too); load these files into a "
        "model whose quantized dimensions are multiples of 16, or with a "
        "weight_block_size that divides them"
    )
    assert said["params.decoder.layers.layer_0.mlp.shared_expert.wi_0.kernel_scale"] == (
        f"MaxText 0.2.5's map of '{QWEN35_FP8}': MaxText holds this scale as (4, 8) of "
        f"each layer: its kernel (72, 128) in blocks of 16, each dimension divided by 16 "
        f"and rounded down, one under 16 kept whole; the files' "
        f"'{hf}.0.mlp.shared_expert.gate_proj.weight_scale_inv' has one scale per 16x16 "
        f"block of its weight, rounded up ((8, 5)), and MaxText's hook transpose makes "
        f"(5, 8) of it. {fix}"
    )
    assert said["params.decoder.layers.layer_3.attention.attention.query.kernel_scale"] == (
        f"MaxText 0.2.5's map of '{QWEN35_FP8}': MaxText holds this scale as (4, 4, 2) "
        f"of each layer: its kernel (72, 4, 32) in blocks of 16, each dimension divided by "
        f"16 and rounded down, one under 16 kept whole; the files' "
        f"'{hf}.3.self_attn.q_proj.weight_scale_inv' has one scale per 16x16 block of its "
        f"weight, rounded up ((8, 5)), and MaxText's hook reshape_kernel cannot make it "
        f"(ValueError: cannot reshape array of size 40 into shape (4,4,2)). {fix}"
    )
    experts = said["params.decoder.layers.layer_1.mlp.routed_experts.wo_scale"]
    assert "(8, 4) of each expert and layer: its kernel (128, 72)" in experts
    assert "'model.language_model.layers.1.mlp.experts.0.down_proj.weight_scale_inv'" in experts
    qkvz = said["params.decoder.layers.layer_2.attention.in_proj_qkvz.kernel_scale"]
    assert "concat_qkvz_scales_and_transpose makes (5, 12) of it" in qkvz


def test_qwen35_fp8_scale_that_fits_by_size_only_is_refused(tmp_path, monkeypatch):
    """A scale hook that reshapes where MaxText's transposes (the shapes fit, the blocks
    do not): every kernel element would be given another block's scale; refused naming
    the first such element and both blocks, not loaded."""
    config = fp8_config(False)
    write_fp8_checkpoint(config, tmp_path, np.float32)
    plan, _ = plan_and_placement(config, "linen")
    own = param_mapping.HOOK_FNS[QWEN35_FP8]
    key = "params-decoder-layers_0-mlp-shared_expert-wo-kernel_scale"

    def hooks(*args, **kwargs):  # MaxText's hooks, one scale's replaced
        return own(*args, **kwargs) | {key: lambda x, target_shape: x.reshape(target_shape)}

    monkeypatch.setitem(param_mapping.HOOK_FNS, QWEN35_FP8, hooks)
    with Reads() as reads, pytest.raises(meshinit.PlanError) as raised:
        meshinit.safetensors.load(plan, tmp_path, names=meshinit.maxtext.names(config))
    assert reads.values == []
    (problem,) = raised.value.problems
    assert problem.path == "params.decoder.layers_0.mlp.shared_expert.wo.kernel_scale"
    name = "model.language_model.layers.0.mlp.shared_expert.down_proj.weight_scale_inv"
    assert problem.message == (
        f"MaxText 0.2.5's map of '{QWEN35_FP8}': MaxText's dequantization would give "
        f"kernel element (0, 16) the scale of block (0, 1) of '{name}', but its weight "
        f"lies in block (1, 0) of '{name}' (7680 of 8192 elements): the scale (8, 4) and "
        f"the files' blocks of 16x16 fit by size only. Load these files into a model "
        f"whose quantized dimensions are multiples of 16"
    )


def test_qwen35_fp8_files_of_another_block_size_are_refused(tmp_path):
    config = fp8_config(True)
    write_fp8_checkpoint(config, tmp_path, ml_dtypes.bfloat16, block=32)
    plan, _ = plan_and_placement(config, "linen")
    with pytest.raises(meshinit.PlanError) as raised:
        meshinit.safetensors.load(plan, tmp_path, names=meshinit.maxtext.names(config))
    (problem,) = raised.value.problems
    assert problem.path == str(tmp_path / "config.json")
    assert problem.message == (
        "config.json's quantization_config says weight_block_size=[32, 32], MaxText's "
        "config weight_block_size=16: MaxText would size and split these files' scales "
        "for blocks of 16; configure MaxText with weight_block_size: 32"
    )


# The FP8 releases' own sizes (their config.json), at 4 layers, 4 experts and a small
# vocabulary: heads under the block (16 or 32 of 256, 2 KV heads) kept whole
PUBLISHED = dict(base_num_kv_heads=2, head_dim=256, gdn_key_head_dim=128)
PUBLISHED |= dict(gdn_value_head_dim=128, gdn_num_key_heads=16, num_experts=4)
PUBLISHED |= dict(num_experts_per_tok=2, sparse_matmul=False, vocab_size=256)
PUBLISHED |= dict(mrope_section=(11, 11, 10))
QWEN35_FP8_SIZES = {
    QWEN35_FP8: PUBLISHED
    | dict(base_emb_dim=2048, base_num_query_heads=16, gdn_num_value_heads=32)
    | dict(base_moe_mlp_dim=512, base_mlp_dim=512),
    "qwen3.5-397b-a17b-fp8": PUBLISHED
    | dict(base_emb_dim=4096, base_num_query_heads=32, gdn_num_value_heads=64)
    | dict(base_moe_mlp_dim=1024, base_mlp_dim=1024),
}


@pytest.mark.parametrize("model", sorted(QWEN35_FP8_SIZES))
def test_qwen35_fp8_at_its_published_sizes_is_not_refused(tmp_path, model):
    """At the release's own sizes and block (128), every scale MaxText sizes by floor
    (dims under 128 kept whole: 16 heads, 2 KV heads) gives each kernel element its
    block's scale: nothing refused, every scale read from its weight_scale_inv. The
    file holds headers and a sparse data section (no data is read here)."""
    config = mm.tiny_config(True, 4, model_name=model, **QWEN35_FP8_SIZES[model])
    assert config.weight_block_size == 128
    hf = hf_config(model, config)
    header, end = {}, 0
    for name, shape in sorted(fp8_shapes(hf, model).items()):
        tensors = [(name, "F8_E4M3" if FP8_PUBLISHED.search(name) else "BF16", shape)]
        if FP8_PUBLISHED.search(name):
            tensors.append((f"{name}_scale_inv", "BF16", [-(-d // 128) for d in shape]))
        for n, dtype, s in tensors:
            size = math.prod(s) * (1 if dtype == "F8_E4M3" else 2)
            header[n] = {"dtype": dtype, "shape": list(s), "data_offsets": [end, end + size]}
            end += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(tmp_path / "model.safetensors", "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        f.truncate(8 + len(raw) + end)
    quantization = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (tmp_path / "config.json").write_text(json.dumps(hf | {"quantization_config": quantization}))
    plan, placement = plan_and_placement(config, "linen")
    query = "params.decoder.layers.layer_3.attention.attention.query.kernel_scale"
    heads = config.num_query_heads
    assert placement[query].shape == (config.emb_dim // 128, 1, heads, 4), "heads kept whole"
    with Reads() as reads:
        found = meshinit.safetensors.inventory(plan, tmp_path, names=meshinit.maxtext.names(config))
    assert reads.values == []
    assert found.unused == () and found.dequantized == {}
    scales = [p for p in placement if re.search(r"(_scale|kernel_scale)$", p)]
    assert len(scales) == 34
    for path in scales:
        assert "weight_scale_inv" in repr(found.table[path]), path


def test_qwen35_fp8_scales_of_another_block_than_maxtexts_are_refused(tmp_path):
    """Files quantized in blocks of 32, config.json without a quantization_config, into
    MaxText at weight_block_size 16: each scale names its shape against the one blocks
    of 16 would give; nothing read."""
    config = fp8_config(True)
    write_fp8_checkpoint(config, tmp_path, np.float32, block=32)
    hf = json.loads((tmp_path / "config.json").read_text())
    del hf["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(hf))
    plan, placement = plan_and_placement(config, "linen")
    with Reads() as reads, pytest.raises(meshinit.PlanError) as raised:
        meshinit.safetensors.load(plan, tmp_path, names=meshinit.maxtext.names(config))
    assert reads.values == []
    said = {p.path: p.message for p in raised.value.problems}
    assert len(said) == 34
    name = "model.language_model.layers.0.mlp.shared_expert.gate_proj.weight_scale_inv"
    assert said["params.decoder.layers.layer_0.mlp.shared_expert.wi_0.kernel_scale"] == (
        f"MaxText 0.2.5's map of '{QWEN35_FP8}': the files' '{name}' is (4, 2), but one "
        f"scale per 16x16 block of its weight (128, 64) is (8, 4): the files are quantized "
        f"in other blocks than MaxText's weight_block_size 16 (config.json declares none); "
        f"give config.json's quantization_config the files' weight_block_size, and "
        f"MaxText's config the same"
    )
