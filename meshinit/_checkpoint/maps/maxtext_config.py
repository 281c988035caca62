"""How MaxText's checkpoint maps see a Hugging Face checkpoint's ``config.json``, and
the check that the files are of the model MaxText is configured for, before a byte is
read: :func:`hf_config` builds the config as MaxText's converters do (a transformers
config's ``.to_dict()``, its defaults filled), and :func:`mismatches` compares it with
MaxText's config field by field, as MaxText's own ``_validate_or_update_architecture``
does. :mod:`meshinit.maxtext` re-exports both."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from ..._errors import Problem
from .framework import ConfigView


def hf_config(raw: Mapping[str, Any], where: str) -> tuple[ConfigView, str, list[Problem]]:
    """The checkpoint's ``config.json`` as MaxText's maps read a Hugging Face config:
    a transformers config's ``.to_dict()`` (defaults filled: ``head_dim``, ...), built
    with transformers where it is installed and knows the file's ``model_type``, else
    the file as it is (a key it lacks is then named: :class:`ConfigView`); and, where
    it is the file as it is, the fix a missing key's message gives."""
    try:
        import transformers
    except ImportError:
        fix = "install transformers (MaxText builds the config with it, filling {key!r} and the"
        return ConfigView(raw), f"{fix} other defaults), or add {{key!r}} to config.json", []
    model_type = raw.get("model_type")
    try:
        made = transformers.AutoConfig.for_model(**copy.deepcopy(dict(raw)))
    except Exception as e:  # noqa: BLE001 - a type transformers does not know, named
        said = f"{type(e).__name__}: {str(e)[:120]}"
        fix = (
            f"transformers builds no config of model_type {model_type!r} ({said}), which "
            f"would fill the defaults: add {{key!r}} to config.json"
        )
        return ConfigView(raw), fix, []
    return ConfigView(made.to_dict()), "add {key!r} to config.json", []


# MaxText 0.2.5's to_huggingface._validate_or_update_architecture: each Hugging Face
# config field and the MaxText config attribute it must equal (head_dim too, except
# with MLA attention). The vocabulary is left out: see names().
_COMPARED = (
    ("hidden_size", "emb_dim"),
    ("intermediate_size", "mlp_dim"),
    ("kv_lora_rank", "kv_lora_rank"),
    ("moe_intermediate_size", "moe_mlp_dim"),
    ("n_routed_experts", "num_experts"),
    ("n_shared_experts", "shared_experts"),
    ("num_attention_heads", "num_query_heads"),
    ("num_experts", "num_experts"),
    ("num_experts_per_tok", "num_experts_per_tok"),
    ("num_hidden_layers", "num_decoder_layers"),
    ("num_key_value_heads", "num_kv_heads"),
    ("num_local_experts", "num_experts"),
    ("q_lora_rank", "q_lora_rank"),
    ("qk_nope_head_dim", "qk_nope_head_dim"),
    ("qk_rope_head_dim", "qk_rope_head_dim"),
    ("v_head_dim", "v_head_dim"),
    ("global_head_dim", "global_head_dim"),
    ("num_global_key_value_heads", "global_num_kv_heads"),
    ("hc_mult", "mhc_expansion_rate"),
    ("num_hash_layers", "first_num_hash_layers"),
    ("index_n_heads", "indexer_n_heads"),
    ("index_head_dim", "indexer_head_dim"),
    ("o_lora_rank", "o_lora_rank"),
    ("o_groups", "o_groups"),
)


def mismatches(hf: Mapping[str, Any], config: Any, where: str) -> list[Problem]:
    """Every field of the checkpoint's config (``hf``, a config dict) that differs from
    MaxText's ``config``, as MaxText's own check compares them (its special cases too),
    each a problem naming both values."""
    compared = list(_COMPARED)
    if getattr(config, "attention_type", None) != "mla":
        compared.append(("head_dim", "head_dim"))
    text = hf.get("text_config") or hf
    model = str(getattr(config, "model_name", ""))
    problems = []
    for field, attr in compared:
        ours = getattr(config, attr, None)
        theirs = text.get(field) if isinstance(text, Mapping) else None
        if ours is None or theirs is None:
            continue
        if model.startswith("gemma2") and field == "num_hidden_layers" and isinstance(ours, int):
            ours *= 2  # MaxText's Gemma 2 layer is a local and a global one
        if "qwen3" in model and getattr(config, "num_experts", 0) > 1:
            if field == "intermediate_size":  # MaxText's: per expert, times those routed
                ours *= getattr(config, "num_experts_per_tok", 1)
        if isinstance(theirs, float) or isinstance(ours, float):
            try:
                same = abs(float(theirs) - float(ours)) < 1e-6
            except (TypeError, ValueError):
                same = theirs == ours
        else:
            same = theirs == ours
        if not same:
            problems.append(
                Problem(
                    where,
                    f"config.json says {field}={theirs!r}, MaxText's config {attr}={ours!r}: "
                    f"the files are of another model than the plan's; load that model's "
                    f"checkpoint, or configure MaxText with the checkpoint's sizes",
                )
            )
    return problems
