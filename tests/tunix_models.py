"""google-tunix's own models, tiny, and tunix's own answers, for the tunix tests.

Import it only where tunix is installed (after ``pytest.importorskip("tunix")``).
Nothing of tunix's model code is copied here: the factories build tunix's classes from
tunix's configs, and the answers are what tunix's own loaders compute.
"""

import functools
import math
import re

import jax
import numpy as np
import qwix
from flax import nnx
from tunix.models.gemma import model as gemma
from tunix.models.gemma import params_safetensors as gemma_params
from tunix.models.gemma3 import model as gemma3
from tunix.models.gemma3 import params_safetensors as gemma3_params
from tunix.models.llama3 import model as llama3
from tunix.models.llama3 import params as llama3_params
from tunix.models.qwen2 import model as qwen2
from tunix.models.qwen2 import params as qwen2_params
from tunix.models.qwen3 import model as qwen3
from tunix.models.qwen3 import params as qwen3_params
from tunix.utils import compat
from tunix.utils.mesh import create_mesh

from meshinit.safetensors import Tensor

# Tiny, and every sharded axis divisible by its mesh axis (fsdp 2, tp 4): width 64,
# 8 query heads over 4 KV heads of 16 (heads * head_dim = 128, not the width, so a
# split of the wrong axis cannot pass), MLP 128, vocab 256, 2 layers.
_SIZES = dict(num_layers=2, embed_dim=64, hidden_dim=128, num_heads=8, head_dim=16, num_kv_heads=4)
LLAMA3 = llama3.ModelConfig(
    vocab_size=256,
    rope_theta=500_000,
    norm_eps=1e-5,
    weight_tying=False,  # a separate lm_head: one more transposed tensor
    **_SIZES,
)
QWEN3 = qwen3.ModelConfig(vocab_size=256, rope_theta=1_000_000, norm_eps=1e-6, **_SIZES)
QWEN3_MOE = qwen3.ModelConfig(
    vocab_size=256,
    rope_theta=1_000_000,
    norm_eps=1e-6,
    num_experts=4,
    num_experts_per_tok=2,
    **_SIZES,
)
QWEN2 = qwen2.ModelConfig(vocab_size=256, rope_theta=1_000_000, norm_eps=1e-6, **_SIZES)
GEMMA3 = gemma3.ModelConfig(num_embed=256, sliding_window_size=8, **_SIZES)  # bf16 params
# Gemma (1 and 2) with as many KV heads as heads: q, k and v fused in one qkv_einsum
GEMMA = gemma.ModelConfig(
    num_embed=256,
    final_logit_softcap=None,
    use_post_attn_norm=True,
    use_post_ffw_norm=True,
    attention_types=(gemma.AttentionType.GLOBAL,) * _SIZES["num_layers"],
    **{**_SIZES, "num_kv_heads": _SIZES["num_heads"]},
)
# LoRA on every projection of Llama3 (attention and MLP)
LORA = dict(module_path=".*_proj", rank=4, alpha=2.0)


def llama3_model():
    return llama3.Llama3(LLAMA3, rngs=nnx.Rngs(params=0))


def qwen3_model():
    return qwen3.Qwen3(QWEN3, rngs=nnx.Rngs(params=0))


def qwen3_moe_model():
    return qwen3.Qwen3(QWEN3_MOE, rngs=nnx.Rngs(params=0))


def qwen2_model():
    return qwen2.Qwen2(QWEN2, rngs=nnx.Rngs(params=0))


def gemma3_model():
    return gemma3.Gemma3(GEMMA3, rngs=nnx.Rngs(params=0))


def gemma_model():
    return gemma.Gemma(GEMMA, rngs=nnx.Rngs(params=0))


def lora_llama3_model():
    """tunix's LoRA recipe (tunix.cli.utils.model.apply_lora_to_model): qwix's provider
    applied with the model's own dummy input, cut to 8 tokens (qwix runs the model once,
    and eagerly 128 tokens cost seconds), with the ``rngs`` qwix asks for."""
    base = llama3_model()
    model_input = {k: v if v is None else v[..., :8] for k, v in base.get_model_input().items()}
    provider = qwix.LoraProvider(**LORA)
    return qwix.apply_lora_to_model(base, provider, rngs=nnx.Rngs(1), **model_input)


FACTORIES = {
    "llama3": llama3_model,
    "qwen3": qwen3_model,
    "qwen3-moe": qwen3_moe_model,
    "qwen2": qwen2_model,
    "gemma3": gemma3_model,
    "lora-llama3": lora_llama3_model,
}
# case -> (tunix's params module, config) for the models whose safetensors name map is
# a plain table (Qwen3-MoE stacks experts and Gemma3 fuses q/k/v in a preprocess_fn)
NAME_MAPS = {
    "llama3": (llama3_params, LLAMA3),
    "qwen3": (qwen3_params, QWEN3),
    "qwen2": (qwen2_params, QWEN2),
    "lora-llama3": (llama3_params, LLAMA3),  # base weights from the files, adapters new
}


def mesh():
    """tunix's own mesh helper over the 8 CPU devices: fsdp=2, tp=4, Auto axes."""
    return create_mesh((2, 4), ("fsdp", "tp"))


def stage_meshes():
    """Two disjoint stages, devices 0-3 and 4-7, each (fsdp=2, tp=2), by tunix's helper."""
    devices = jax.devices()
    return create_mesh((2, 2), ("fsdp", "tp"), devices[:4]), create_mesh(
        (2, 2), ("fsdp", "tp"), devices[4:]
    )


def path_of(path) -> str:
    return ".".join(map(str, path))


def variables(model) -> dict:
    """``path -> Variable`` of an nnx Module's state."""
    return {path_of(p): v for p, v in nnx.to_flat_state(nnx.state(model))}


def arrays(model) -> dict:
    """``path -> value`` of an nnx Module's state."""
    return {p: v.get_value() for p, v in variables(model).items()}


def bits(array) -> np.ndarray:
    """The array's bits as numpy: typed PRNG keys as their key data."""
    if jax.dtypes.issubdtype(array.dtype, jax.dtypes.prng_key):
        array = jax.random.key_data(array)
    return np.asarray(array)


def abstract_state(factory, mesh):
    """The abstract state as tunix's loaders build it (safetensors_loader)."""
    with compat.set_mesh(mesh):
        return nnx.state(nnx.eval_shape(factory))


def tunix_shardings(factory, mesh) -> dict:
    """``path -> NamedSharding``: tunix's placement of the model on ``mesh``, as its
    loaders compute it: ``nnx.get_named_sharding(abs_state, mesh)``."""
    named = nnx.get_named_sharding(abstract_state(factory, mesh), mesh)
    return {path_of(p): v.get_value() for p, v in nnx.to_flat_state(named)}


@functools.cache
def eager(case: str) -> dict:
    """``path -> Variable`` of the model built eagerly (tunix turned eager sharding off)."""
    return variables(FACTORIES[case]())


# case -> (factory, config, tunix's safetensors loader module) for meshinit.tunix.names
LOADERS = {
    "llama3": (llama3_model, LLAMA3, llama3_params),
    "qwen2": (qwen2_model, QWEN2, qwen2_params),
    "qwen3": (qwen3_model, QWEN3, qwen3_params),
    "qwen3-moe": (qwen3_moe_model, QWEN3_MOE, qwen3_params),
    "gemma": (gemma_model, GEMMA, gemma_params),
    "gemma3": (gemma3_model, GEMMA3, gemma3_params),
}


def hf_shapes(case: str) -> dict[str, tuple[int, ...]]:
    """The tensors of a Hugging Face checkpoint of ``case``'s tiny config, as
    transformers names and shapes them (torch's ``(out, in)`` Linear weights), written
    from the transformers models, not from tunix's map."""
    cfg = LOADERS[case][1]
    d, f, hd = cfg.embed_dim, cfg.hidden_dim, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    vocab = getattr(cfg, "vocab_size", None) or cfg.num_embed
    shapes = {"model.embed_tokens.weight": (vocab, d), "model.norm.weight": (d,)}
    if case in ("llama3", "qwen2", "qwen3", "qwen3-moe"):  # untied: a head of its own
        shapes["lm_head.weight"] = (vocab, d)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        shapes |= {
            f"{p}.self_attn.q_proj.weight": (q, d),
            f"{p}.self_attn.k_proj.weight": (kv, d),
            f"{p}.self_attn.v_proj.weight": (kv, d),
            f"{p}.self_attn.o_proj.weight": (d, q),
            f"{p}.input_layernorm.weight": (d,),
            f"{p}.post_attention_layernorm.weight": (d,),
        }
        if case == "qwen3-moe":
            shapes[f"{p}.mlp.gate.weight"] = (cfg.num_experts, d)
            for e in range(cfg.num_experts):
                shapes |= {
                    f"{p}.mlp.experts.{e}.gate_proj.weight": (f, d),
                    f"{p}.mlp.experts.{e}.up_proj.weight": (f, d),
                    f"{p}.mlp.experts.{e}.down_proj.weight": (d, f),
                }
        else:
            shapes |= {
                f"{p}.mlp.gate_proj.weight": (f, d),
                f"{p}.mlp.up_proj.weight": (f, d),
                f"{p}.mlp.down_proj.weight": (d, f),
            }
        if case in ("qwen3", "qwen3-moe", "gemma3"):
            shapes |= {f"{p}.self_attn.q_norm.weight": (hd,), f"{p}.self_attn.k_norm.weight": (hd,)}
        if case == "qwen2":
            shapes |= {
                f"{p}.self_attn.q_proj.bias": (q,),
                f"{p}.self_attn.k_proj.bias": (kv,),
                f"{p}.self_attn.v_proj.bias": (kv,),
            }
        if case in ("gemma", "gemma3"):
            shapes |= {
                f"{p}.pre_feedforward_layernorm.weight": (d,),
                f"{p}.post_feedforward_layernorm.weight": (d,),
            }
    return shapes


# -- tunix's safetensors name maps, read the other way round -------------------------------


def _groups(hf_regex: str) -> list[str]:
    return re.findall(r"\((?!\?)[^()]*\)", hf_regex)


def names_from_tunix(key_map: dict, width: int) -> list[tuple[str, str | Tensor]]:
    """meshinit's ``names=`` rule table read off tunix's map, with nothing typed again.

    tunix maps a Hugging Face regex to ``(nnx template, (permute, reshape))`` and
    computes ``stored.transpose(permute).reshape(reshape)``. Here each nnx template
    becomes a plan-path regex (its ``\\N`` the regex's own groups) and each stored name a
    template of those groups. A transpose and split becomes reshape-then-permute: the
    stored ``(out, in)`` weight is ``(prod(R[k:]), prod(R[:k]))`` for tunix's result
    ``R``, with ``k`` the split that leaves the model's width (``width``) alone, as
    Hugging Face stores a projection.
    """
    table = []
    for hf, (template, transform) in key_map.items():
        groups = _groups(hf)
        parts = re.split(r"\\(\d)", template)  # literal, group number, literal, ...
        path = "".join(
            re.escape(p) if i % 2 == 0 else f"(?P<g{p}>{groups[int(p) - 1][1:-1]})"
            for i, p in enumerate(parts)
        )
        name = hf
        for n, group in enumerate(groups, 1):
            name = name.replace(group, f"\0{n}\0", 1)
        name = re.sub(r"\\(.)", r"\1", name)
        name = re.sub("\0(\\d)\0", r"\\g<g\1>", name)
        if transform is None:
            table.append((path, name))
            continue
        permute, reshape = transform
        assert tuple(permute) == (1, 0), f"tunix's {hf}: a transpose other than (1, 0)"
        if reshape is None:
            table.append((path, Tensor(name, permute=(1, 0))))
            continue
        k = 1 if reshape[0] == width else len(reshape) - 1
        m = len(reshape) - k
        table.append(
            (
                path,
                Tensor(
                    name,
                    shape=tuple(reshape[k:]) + tuple(reshape[:k]),
                    permute=tuple(range(m, len(reshape))) + tuple(range(m)),
                ),
            )
        )
    return table


def stored_tensors(table, values: dict) -> dict[str, np.ndarray]:
    """A Hugging Face checkpoint of these parameter values: ``stored name -> array``,
    each its rule's Tensor undone (a parameter no rule maps, or maps to None, is left out)."""
    out = {}
    for path, value in values.items():
        for pattern, target in table:
            match = re.fullmatch(pattern, path)
            if match is None:
                continue
            if target is None:  # not stored
                break
            value = np.asarray(value)
            if isinstance(target, str):
                out[match.expand(target)] = value
                break
            split = value.transpose(np.argsort(target.permute))  # as target.shape has it
            if target.shape is not None:  # back to 2-D: the permute's first axis ends "out"
                out_axes = target.permute[0]
                split = split.reshape(
                    math.prod(split.shape[:out_axes]), math.prod(split.shape[out_axes:])
                )
            out[match.expand(target.name)] = split
            break
    return out
