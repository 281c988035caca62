"""MaxText's view of a checkpoint's config.json, and the field-by-field check that the
files are of the model MaxText is configured for (each mismatch named, MaxText's own
special cases kept)."""

import sys
import types

import pytest

from meshinit._checkpoint.maps import maxtext_config
from meshinit._checkpoint.maps.framework import ConfigView


def test_without_transformers_the_file_is_read_as_it_is_and_the_fix_names_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # not installed: no import
    raw = {"model_type": "llama", "hidden_size": 64}
    hf, fix, problems = maxtext_config.hf_config(raw, "ckpt/config.json")
    assert isinstance(hf, ConfigView) and hf == raw and problems == []
    assert fix.format(key="head_dim").startswith("install transformers (MaxText builds")


def test_with_transformers_the_config_is_its_to_dict_defaults_filled():
    pytest.importorskip("transformers")
    raw = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4}
    hf, _, problems = maxtext_config.hf_config(raw, "ckpt/config.json")
    assert problems == [] and hf["head_dim"] == 16  # hidden_size // num_attention_heads


def test_the_checkpoints_sizes_against_maxtexts_each_mismatch_named():
    config = types.SimpleNamespace(
        model_name="llama3.1-8b",
        attention_type="global",
        emb_dim=64,
        mlp_dim=128,
        num_query_heads=8,
        num_kv_heads=4,
        head_dim=8,
        num_decoder_layers=2,
        vocab_size=256,
    )
    hf = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_hidden_layers": 2,
        "vocab_size": 262,  # not compared: MaxText's hooks pad and truncate it
    }
    found = maxtext_config.mismatches(hf, config, "c.json")
    assert [p.message.split(":")[0] for p in found] == [
        "config.json says num_attention_heads=4, MaxText's config num_query_heads=8",
        "config.json says num_key_value_heads=2, MaxText's config num_kv_heads=4",
        "config.json says head_dim=16, MaxText's config head_dim=8",
    ]
    assert {p.path for p in found} == {"c.json"}
    # a multimodal config's text model; Gemma 2's layer is two of Hugging Face's
    same = dict(hf, num_attention_heads=8, num_key_value_heads=4, head_dim=8)
    assert maxtext_config.mismatches({"text_config": same}, config, "c.json") == []
    gemma2 = types.SimpleNamespace(**{**vars(config), "model_name": "gemma2-2b"})
    assert maxtext_config.mismatches(dict(same, num_hidden_layers=4), gemma2, "") == []
    # with MLA attention there is no head_dim to compare
    mla = types.SimpleNamespace(**{**vars(config), "attention_type": "mla"})
    assert maxtext_config.mismatches(dict(same, head_dim=99), mla, "") == []
