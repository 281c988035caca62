"""``meshinit.tunix.names`` on export: tunix's own map read from the parameters' side.

A Hugging Face checkpoint loaded through ``meshinit.tunix.names(cfg)`` and saved through
the same map gives back the files' tensors byte for byte (dtype, shape, bits), for each
family tunix 0.1.7's map covers (Llama3, Qwen2, Qwen3 dense and MoE, Gemma, Gemma3), on
Explicit and Auto meshes; tunix's own loader reads the export back to the parameters.
The stored names are written from tunix's regexes, the shapes from the parameters through
tunix's transforms undone and its preprocess step followed (Qwen3's experts, Gemma's
fused q, k and v). What does not invert is refused by name, before a byte is written.
Skipped where tunix is not installed; ``.ci/run`` runs it in ``.venv-tunix``.
"""

import json
import os

import ml_dtypes
import pytest

pytest.importorskip("tunix")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import tunix_models as tm  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import AxisType  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402
from tunix.models.llama3 import model as llama3  # noqa: E402
from tunix.models.llama3 import params as llama_params  # noqa: E402
from tunix.models.qwen3 import params as qwen3_params  # noqa: E402

import meshinit  # noqa: E402

FAMILIES = sorted(tm.LOADERS)
MESHES = pytest.mark.parametrize("explicit", [True, False], ids=["explicit", "auto"])


def write_checkpoint(case, folder):
    """A Hugging Face checkpoint of ``case`` in two files, as transformers names and
    shapes it (``tm.hf_shapes``), in tunix's parameter dtype, every element distinct."""
    folder.mkdir()
    dtype = ml_dtypes.bfloat16 if case == "gemma3" else np.float32
    rng = np.random.default_rng(0)
    tensors = {
        n: rng.standard_normal(s, dtype=np.float32).astype(dtype)
        for n, s in tm.hf_shapes(case).items()
    }
    names = sorted(tensors)
    for i, part in enumerate((names[::2], names[1::2])):
        save_file({n: tensors[n] for n in part}, str(folder / f"model-{i + 1}.safetensors"))
    return tensors


def mesh_of(explicit):
    """tunix's (fsdp 2, tp 4) over the 8 CPU devices: Explicit axes (``jax.make_mesh``'s
    default), or Auto (tunix's own ``create_mesh``)."""
    if not explicit:
        return tm.mesh()
    mesh = jax.make_mesh((2, 4), ("fsdp", "tp"), axis_types=(AxisType.Explicit,) * 2)
    assert all(t == AxisType.Explicit for t in mesh.axis_types)
    return mesh


def files(folder):
    """``name -> array`` of every .safetensors file under ``folder``."""
    out = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            out.update(load_file(str(folder / f)))
    return out


def bits(x):
    x = np.ascontiguousarray(x)
    return x.view(f"u{x.dtype.itemsize}")


def nothing_written(folder):
    return not folder.exists() or not any(folder.iterdir())


@pytest.mark.slow
@MESHES
@pytest.mark.parametrize("case", FAMILIES)
def test_the_export_is_the_loaded_files_byte_for_byte(tmp_path, case, explicit):
    factory, config, loader = tm.LOADERS[case]
    tensors = write_checkpoint(case, tmp_path / "src")
    mesh = mesh_of(explicit)
    plan = meshinit.nnx.plan(factory, meshes=[(r".*", mesh)])
    names = meshinit.tunix.names(config)
    loaded = meshinit.safetensors.load(plan, tmp_path / "src", names=names, unused="error")
    assert all(a.sharding.mesh == mesh for a in loaded.values())

    hf = {"model_type": case, "tie_word_embeddings": case in ("gemma", "gemma3")}
    report = meshinit.safetensors.save(loaded, tmp_path / "out", names=names, config=hf)

    got = files(tmp_path / "out")
    want = tensors
    assert sorted(got) == sorted(want), f"{case}: the export's names differ from the files'"
    wrong = [
        f"{n}: {got[n].dtype}{got[n].shape} vs {x.dtype}{x.shape}"
        for n, x in sorted(want.items())
        if got[n].dtype != x.dtype or got[n].shape != x.shape
        or bits(got[n]).tobytes() != bits(x).tobytes()
    ]  # fmt: skip
    assert not wrong, f"{case}: the export differs from the files at {wrong}"
    assert report.total_size == sum(x.nbytes for x in want.values())
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == hf

    # tunix's own loader reads the export back to the parameters meshinit loaded
    theirs = tm.arrays(
        loader.create_model_from_safe_tensors(
            str(tmp_path / "out"), config, mesh=tm.mesh(), mode="optimized"
        )
    )
    differ = [p for p in loaded if tm.bits(loaded[p]).tobytes() != tm.bits(theirs[p]).tobytes()]
    assert not differ, f"{case}: tunix reads the export otherwise at {differ}"


@pytest.mark.slow
def test_the_experts_and_fused_einsums_are_one_program_per_signature(tmp_path):
    """Qwen3-MoE's stacked experts: one stored tensor per expert and layer, each a
    slice of the stacked parameter taken at run time (the compiles do not grow with
    the experts)."""
    write_checkpoint("qwen3-moe", tmp_path / "src")
    plan = meshinit.nnx.plan(tm.qwen3_moe_model, meshes=[(r".*", tm.mesh())])
    names = meshinit.tunix.names(tm.QWEN3_MOE)
    loaded = meshinit.safetensors.load(plan, tmp_path / "src", names=names)
    planned = {p: (tuple(a.shape), np.dtype(a.dtype)) for p, a in loaded.items()}
    recipes, problems = names.saving(planned, None)
    assert problems == []
    experts = [r for r in recipes if ".mlp.experts." in r.name]
    cfg = tm.QWEN3_MOE
    assert len(experts) == 3 * cfg.num_experts * cfg.num_layers
    up = [r for r in experts if r.name.endswith("up_proj.weight")]
    assert {r.paths for r in up} == {(f"layers.{i}.mlp.up_proj",) for i in range(cfg.num_layers)}
    assert {r.at for r in up} == {(e,) for e in range(cfg.num_experts)}
    assert len({r.build for r in up}) == 1  # one signature: one program for them all
    assert {r.shape for r in up} == {(cfg.hidden_dim, cfg.embed_dim)}


# ------------------------------------------------------------------- refusals


def llama_model():
    return meshinit.nnx.init(tm.llama3_model, meshes=[(r".*", tm.mesh())])


def test_a_family_meshinit_does_not_read_is_refused_naming_it(tmp_path):
    from tunix.models.gemma4 import model as gemma4

    with pytest.raises(
        meshinit.PlanError, match=r"tunix's map of gemma, gemma3, .*not of gemma4; export with"
    ):
        meshinit.safetensors.save(
            llama_model(),
            tmp_path / "out",
            names=meshinit.tunix.names(gemma4.ModelConfig.gemma4_e2b()),
        )
    assert nothing_written(tmp_path / "out")


def test_a_preprocess_step_that_computes_is_refused_naming_the_parameter(tmp_path, monkeypatch):
    own = qwen3_params._stack_experts

    def scaled(params):  # a preprocess step that computes: no layout undoes it
        out = own(params)
        out["layers.0.mlp.up_proj"] = out["layers.0.mlp.up_proj"] * 2
        return out

    model = meshinit.nnx.init(tm.qwen3_moe_model, meshes=[(r".*", tm.mesh())])
    monkeypatch.setattr(qwen3_params, "_stack_experts", scaled)
    with pytest.raises(meshinit.PlanError, match="nothing was written") as e:
        meshinit.safetensors.save(model, tmp_path / "out", names=meshinit.tunix.names(tm.QWEN3_MOE))
    assert [p.path for p in e.value.problems] == ["layers.0.mlp.up_proj"]
    assert "tunix 0.1.7's qwen3 map: the operation mul: no target expresses it" in str(e.value)
    assert nothing_written(tmp_path / "out")


def test_a_reshape_whose_stored_axes_are_not_known_is_refused_naming_each_parameter(tmp_path):
    """A model whose head_dim is its width: tunix's ``(d, heads, head_dim)`` of a q
    projection could be split from a ``(heads * head_dim, d)`` or a ``(head_dim, d *
    heads)`` weight; the parameters do not say which, and nothing is guessed."""
    cfg = llama3.ModelConfig(
        vocab_size=256, rope_theta=500_000, norm_eps=1e-5, weight_tying=False,
        num_layers=1, embed_dim=16, hidden_dim=32, num_heads=4, head_dim=16, num_kv_heads=4,
    )  # fmt: skip
    model = meshinit.nnx.init(
        lambda: llama3.Llama3(cfg, rngs=nnx.Rngs(params=0)),
        meshes=[(r".*", tm.mesh())],
    )
    with pytest.raises(meshinit.PlanError) as e:
        meshinit.safetensors.save(model, tmp_path / "out", names=meshinit.tunix.names(cfg))
    problems = {p.path: p.message for p in e.value.problems}
    assert sorted(problems) == [f"layers.0.attn.{s}_proj.w" for s in "koqv"]
    assert "which stored axes it split is not known" in problems["layers.0.attn.q_proj.w"]
    assert nothing_written(tmp_path / "out")


def test_lora_adapters_are_refused_by_name(tmp_path):
    """tunix's map has no stored names for qwix's LoRA factors (merging them is not a
    layout): each is named, and the export writes nothing."""
    model = meshinit.nnx.init(tm.lora_llama3_model, meshes=[(r".*", tm.mesh())])
    with pytest.raises(meshinit.PlanError) as e:
        meshinit.safetensors.save(model, tmp_path / "out", names=meshinit.tunix.names(tm.LLAMA3))
    paths = sorted(p.path for p in e.value.problems)
    assert paths and all("_lora_" in p for p in paths), paths
    assert len(paths) == 2 * 7 * tm.LLAMA3.num_layers  # a and b of every projection
    assert "no entry of its map writes it" in e.value.problems[0].message
    assert nothing_written(tmp_path / "out")


def test_a_regex_that_is_not_one_name_is_refused_naming_the_parameters(tmp_path, monkeypatch):
    own = llama_params._get_key_and_transform_mapping

    def mapping(cfg):
        m = dict(own(cfg))
        m[r"model\.layers\.([0-9]+)\.self_attn\.q_proj\..*"] = m.pop(
            r"model\.layers\.([0-9]+)\.self_attn\.q_proj\.weight"
        )
        return m

    model = llama_model()
    monkeypatch.setattr(llama_params, "_get_key_and_transform_mapping", mapping)
    with pytest.raises(meshinit.PlanError) as e:
        meshinit.safetensors.save(model, tmp_path / "out", names=meshinit.tunix.names(tm.LLAMA3))
    assert [p.path for p in e.value.problems] == [
        "layers.0.attn.q_proj.w",
        "layers.1.attn.q_proj.w",
    ]
    assert "'.' outside a group, not a name" in e.value.problems[0].message
    assert nothing_written(tmp_path / "out")


def test_a_config_of_another_model_is_refused_naming_each_field(tmp_path):
    hf = {"model_type": "llama", "num_attention_heads": 4, "head_dim": 32}
    with pytest.raises(meshinit.PlanError) as e:
        meshinit.safetensors.save(
            llama_model(), tmp_path / "out", names=meshinit.tunix.names(tm.LLAMA3), config=hf
        )
    fix = "it is another model's config; pass the config of the model the parameters are of"
    assert [str(p) for p in e.value.problems] == [
        f"config=: num_attention_heads=4, the tunix ModelConfig num_heads=8: {fix}",
        f"config=: head_dim=32, the tunix ModelConfig head_dim=16: {fix}",
    ]
    assert nothing_written(tmp_path / "out")
