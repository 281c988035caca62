"""meshinit against google-tunix's own safetensors loaders.

tunix (0.1.7, Python 3.12) maps each Hugging Face key to an nnx path with a regex table
whose transforms are ``(permute, reshape)``, transpose first, then runs a preprocess
step for some families (Qwen3's experts stacked, Gemma's q/k/v fused). The same
checkpoint, read by tunix's loader and by ``meshinit.safetensors.load``, must give
every parameter of tunix's own model bit for bit, on the same shardings: through the
rule table that ``docs/names.md`` derives by hand from tunix's Llama3 map, and
through ``meshinit.tunix.names(cfg)``, which reads tunix's map itself, for every
family (Llama3, Qwen2, Qwen3 dense and MoE, Gemma, Gemma3). What tunix's map asks
that meshinit cannot express is refused before any read. Skipped where tunix is not
installed (it is not a dependency); ``.ci/run`` runs it in ``.venv-tunix``, or::

    python3.12 -m venv /work/tunix312
    /work/tunix312/bin/pip install google-tunix==0.1.7 safetensors
    /work/tunix312/bin/pip install -e .
    /work/tunix312/bin/python -m pytest tests/clients/test_tunix_names.py
"""

import json
import re

import pytest

pytest.importorskip("tunix")

import jax  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import tunix_models as tm  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402
from tunix.models.llama3 import params as llama_params  # noqa: E402
from tunix.models.qwen3 import params as qwen3_params  # noqa: E402
from tunix.utils.mesh import create_mesh  # noqa: E402

import meshinit  # noqa: E402
from meshinit.safetensors import Stack, Tensor  # noqa: E402

CONFIG = tm.LLAMA3  # weight_tying=False: a separate lm_head, one more transposed tensor
D, HEAD_DIM, HEADS = CONFIG.embed_dim, CONFIG.head_dim, CONFIG.num_heads

# tunix's table read the other way round: plan path -> Hugging Face tensor. Where
# tunix transposes (1, 0) and then reshapes, the Tensor reshapes the stored axes
# first (splitting one), then permutes them into tunix's order.
NAMES = [
    (r"embedder\.input_embedding", "model.embed_tokens.weight"),
    (  # stored (heads * head_dim, d): tunix's T then reshape (d, heads, head_dim)
        r"layers\.(\d+)\.attn\.([qkv])_proj\.w",
        Tensor(
            r"model.layers.\1.self_attn.\2_proj.weight",
            shape=(-1, HEAD_DIM, D),
            permute=(2, 0, 1),
        ),
    ),
    (  # stored (d, heads * head_dim): tunix's T then reshape (heads, head_dim, d)
        r"layers\.(\d+)\.attn\.o_proj\.w",
        Tensor(
            r"model.layers.\1.self_attn.o_proj.weight",
            shape=(D, HEADS, HEAD_DIM),
            permute=(1, 2, 0),
        ),
    ),
    (
        r"layers\.(\d+)\.mlp\.(gate|up|down)_proj\.kernel",
        Tensor(r"model.layers.\1.mlp.\2_proj.weight", permute=(1, 0)),
    ),
    (
        r"layers\.(\d+)\.(input_layernorm|post_attention_layernorm)\.w",
        r"model.layers.\1.\2.weight",
    ),
    (r"final_norm\.w", "model.norm.weight"),
    (r"lm_head\.w", Tensor("lm_head.weight", permute=(1, 0))),
]


def hf_checkpoint(directory):
    """A Llama checkpoint as Hugging Face writes it: torch's (out, in) layout,
    attention flat, every element distinct, so a wrong axis order cannot pass."""
    rng = np.random.default_rng(0)
    kv = CONFIG.num_kv_heads * HEAD_DIM
    shapes = {
        "model.embed_tokens.weight": (CONFIG.vocab_size, D),
        "model.norm.weight": (D,),
        "lm_head.weight": (CONFIG.vocab_size, D),
    }
    for i in range(CONFIG.num_layers):
        p = f"model.layers.{i}"
        shapes |= {
            f"{p}.self_attn.q_proj.weight": (HEADS * HEAD_DIM, D),
            f"{p}.self_attn.k_proj.weight": (kv, D),
            f"{p}.self_attn.v_proj.weight": (kv, D),
            f"{p}.self_attn.o_proj.weight": (D, HEADS * HEAD_DIM),
            f"{p}.mlp.gate_proj.weight": (CONFIG.hidden_dim, D),
            f"{p}.mlp.up_proj.weight": (CONFIG.hidden_dim, D),
            f"{p}.mlp.down_proj.weight": (D, CONFIG.hidden_dim),
            f"{p}.input_layernorm.weight": (D,),
            f"{p}.post_attention_layernorm.weight": (D,),
        }
    tensors = {k: rng.standard_normal(s, dtype=np.float32) for k, s in shapes.items()}
    names = sorted(tensors)  # two files, as a sharded checkpoint comes
    for i, part in enumerate((names[::2], names[1::2])):
        save_file({n: tensors[n] for n in part}, str(directory / f"model-{i + 1}.safetensors"))
    return tensors


factory = tm.llama3_model
flat = tm.arrays


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["optimized", "original"])
def test_meshinit_loads_what_tunix_loads_bit_for_bit_on_the_same_shardings(tmp_path, mode):
    tensors = hf_checkpoint(tmp_path)
    mesh = create_mesh((2, 4), ("fsdp", "tp"))  # tunix's own mesh helper: Auto axes

    theirs = flat(
        llama_params.create_model_from_safe_tensors(str(tmp_path), CONFIG, mesh=mesh, mode=mode)
    )

    meshes = [(r".*", mesh)]
    plan = meshinit.nnx.plan(factory, meshes=meshes)
    found = meshinit.safetensors.inventory(plan, tmp_path, names=NAMES)
    assert not found.skipped and not found.missing and not found.unused, found
    loaded = meshinit.safetensors.load(plan, tmp_path, names=NAMES, unused="error")
    ours = flat(meshinit.nnx.init(factory, meshes=meshes, existing=loaded))

    assert set(ours) == set(theirs) == set(loaded) == {e.path for e in plan.entries}
    assert len(ours) == 3 + 9 * CONFIG.num_layers  # every tensor of the files, once
    differ = [
        p
        for p in ours
        if ours[p].dtype != theirs[p].dtype
        or np.asarray(ours[p]).tobytes() != np.asarray(theirs[p]).tobytes()
    ]
    assert not differ, f"values differ from tunix's at {differ}"
    placed = [p for p in ours if ours[p].sharding != theirs[p].sharding]
    assert not placed, "placed unlike tunix: " + "; ".join(
        f"{p}: {ours[p].sharding} vs {theirs[p].sharding}" for p in placed
    )
    for entry in plan.entries:  # and both are what meshinit planned
        assert ours[entry.path].sharding == entry.sharding, entry.path
        assert ours[entry.path] is loaded[entry.path], entry.path  # used as read

    # The check has teeth: the o_proj rule written as tunix writes it (transpose the
    # stored (d, heads * head_dim) to (heads * head_dim, d), then split) gives other
    # values, and a plain transpose of the file's tensor differs from the parameter.
    o = tensors["model.layers.0.self_attn.o_proj.weight"]
    want = np.asarray(theirs["layers.0.attn.o_proj.w"])
    assert np.array_equal(o.T.reshape(HEADS, HEAD_DIM, D), want)
    assert not np.array_equal(o.reshape(HEADS, HEAD_DIM, D), want)


# --------------------------------------------- meshinit.tunix.names: tunix's own map

FAMILIES = sorted(tm.LOADERS)
# what tunix's map drops by name ("unused."): written into the gemma3 checkpoint, left
# unread by both loaders and named as unused by meshinit
DROPPED = {"gemma3": {"lm_head.weight": (CONFIG.vocab_size, tm.GEMMA3.embed_dim)}}


def write_checkpoint(case, directory, seed=0, dtype=None):
    """A Hugging Face checkpoint of ``case`` in two files, in the planned dtype unless
    told (tunix keeps the file's dtype unless given ``dtype=``, meshinit casts to the
    plan's), every element distinct, and a config.json beside it."""
    if dtype is None:
        dtype = np.float32 if case != "gemma3" else ml_dtypes.bfloat16  # tunix's param dtypes
    rng = np.random.default_rng(seed)
    shapes = tm.hf_shapes(case) | DROPPED.get(case, {})
    tensors = {k: rng.standard_normal(s, dtype=np.float32).astype(dtype) for k, s in shapes.items()}
    names = sorted(tensors)
    for i, part in enumerate((names[::2], names[1::2])):
        save_file({n: tensors[n] for n in part}, str(directory / f"model-{i + 1}.safetensors"))
    (directory / "config.json").write_text(json.dumps({"model_type": case}))
    return tensors


@pytest.mark.slow
@pytest.mark.parametrize("case", FAMILIES)
def test_tunix_names_loads_what_tunix_loads_bit_for_bit_on_tunix_shardings(tmp_path, case):
    factory, config, loader = tm.LOADERS[case]
    tensors = write_checkpoint(case, tmp_path)
    mesh = tm.mesh()
    theirs = tm.arrays(
        loader.create_model_from_safe_tensors(str(tmp_path), config, mesh=mesh, mode="optimized")
    )
    plan = meshinit.nnx.plan(factory, meshes=[(r".*", mesh)])
    names = meshinit.tunix.names(config)
    found = meshinit.safetensors.inventory(plan, tmp_path, names=names)
    assert not found.skipped and not found.missing, found
    assert set(found.unused) == set(DROPPED.get(case, {})), found  # every other tensor read
    assert set(found.table) == {e.path for e in plan.entries}
    loaded = meshinit.safetensors.load(plan, tmp_path, names=names, unused="ignore")

    assert set(loaded) == set(theirs) == {e.path for e in plan.entries}
    differ = [
        f"{p}: {loaded[p].dtype}{loaded[p].shape} vs {theirs[p].dtype}{theirs[p].shape}"
        for p in sorted(loaded)
        if loaded[p].dtype != theirs[p].dtype
        or np.asarray(loaded[p]).tobytes() != np.asarray(theirs[p]).tobytes()
    ]
    assert not differ, f"{case}: values differ from tunix's loader at {differ}"
    placed = tm.tunix_shardings(factory, mesh)  # nnx.get_named_sharding, as tunix places
    wrong = [
        f"{p}: {loaded[p].sharding.spec} vs {placed[p].spec}"
        for p in sorted(loaded)
        if not (loaded[p].sharding == placed[p] == theirs[p].sharding)
    ]
    assert not wrong, f"{case}: placed unlike tunix: {wrong}"
    assert len({t for r in found.reads.values() for t in r}) == len(tensors) - len(
        DROPPED.get(case, {})
    )


@pytest.mark.slow
def test_every_tensor_gemmas_map_sends_to_one_unused_name_is_left_unread(tmp_path):
    """tunix's Gemma map sends every ``.*\\.bias`` to ``unused.bias`` and each layer's
    rotary tensors to ``unused.rotary.<layer>``: several tensors to one name, which
    tunix's loader drops (it loads the checkpoint); meshinit refused it ("maps both
    ...k_proj.bias and ...q_proj.bias here") and now leaves them unread, named unused."""
    factory, config, loader = tm.LOADERS["gemma"]
    dropped = {}
    for i in range(config.num_layers):
        p = f"model.layers.{i}"
        dropped |= {
            f"{p}.self_attn.q_proj.bias": (config.num_heads * HEAD_DIM,),
            f"{p}.self_attn.k_proj.bias": (config.num_kv_heads * HEAD_DIM,),
            f"{p}.self_attn.rotary_emb.inv_freq": (HEAD_DIM // 2,),
            f"{p}.self_attn.rotary_emb.cos_cached": (8, HEAD_DIM),
        }
    rng = np.random.default_rng(1)
    shapes = tm.hf_shapes("gemma") | dropped
    tensors = {k: rng.standard_normal(s, dtype=np.float32) for k, s in shapes.items()}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    mesh = tm.mesh()
    theirs = tm.arrays(
        loader.create_model_from_safe_tensors(str(tmp_path), config, mesh=mesh, mode="optimized")
    )
    plan = meshinit.nnx.plan(factory, meshes=[(r".*", mesh)])
    names = meshinit.tunix.names(config)
    found = meshinit.safetensors.inventory(plan, tmp_path, names=names)
    assert set(found.unused) == set(dropped), found
    with pytest.warns(meshinit.UnusedTensorWarning, match=r"k_proj\.bias"):
        loaded = meshinit.safetensors.load(plan, tmp_path, names=names)
    assert set(loaded) == set(theirs)
    differ = [p for p in loaded if tm.bits(loaded[p]).tobytes() != tm.bits(theirs[p]).tobytes()]
    assert not differ, f"values differ from tunix's loader at {differ}"


@pytest.mark.slow
def test_float32_files_are_cast_to_the_planned_bfloat16_as_tunix_casts_with_dtype(tmp_path):
    write_checkpoint("gemma3", tmp_path, dtype=np.float32)
    mesh = tm.mesh()
    theirs = tm.arrays(
        tm.gemma3_params.create_model_from_safe_tensors(
            str(tmp_path), tm.GEMMA3, mesh=mesh, dtype=jax.numpy.bfloat16, mode="optimized"
        )
    )
    plan = meshinit.nnx.plan(tm.gemma3_model, meshes=[(r".*", mesh)])
    loaded = meshinit.safetensors.load(
        plan, tmp_path, names=meshinit.tunix.names(tm.GEMMA3), unused="ignore"
    )
    assert {p: a.dtype for p, a in loaded.items()} == {p: a.dtype for p, a in theirs.items()}
    differ = [p for p in loaded if tm.bits(loaded[p]).tobytes() != tm.bits(theirs[p]).tobytes()]
    assert not differ, f"cast unlike tunix's dtype=bfloat16 at {differ}"


def test_the_built_table_is_what_inventory_shows(tmp_path):
    write_checkpoint("qwen3-moe", tmp_path)
    cfg = tm.QWEN3_MOE
    plan = meshinit.nnx.plan(tm.qwen3_moe_model, meshes=[(r".*", tm.mesh())])
    found = meshinit.safetensors.inventory(plan, tmp_path, names=meshinit.tunix.names(cfg))
    table = found.table
    heads, d = cfg.num_heads, cfg.embed_dim
    # tunix: transpose (1, 0), then reshape (d, heads, head_dim)
    assert table["layers.0.attn.q_proj.w"] == Tensor(
        "model.layers.0.self_attn.q_proj.weight", shape=(heads, HEAD_DIM, d), permute=(2, 0, 1)
    )
    # tunix: transpose (1, 0), then reshape (heads, head_dim, d)
    assert table["layers.1.attn.o_proj.w"] == Tensor(
        "model.layers.1.self_attn.o_proj.weight", shape=(d, heads, HEAD_DIM), permute=(1, 2, 0)
    )
    # tunix's _stack_experts: each expert transposed, stacked along a new first axis
    assert table["layers.0.mlp.down_proj"] == Stack(
        [
            Tensor(f"model.layers.0.mlp.experts.{e}.down_proj.weight", permute=(1, 0))
            for e in range(cfg.num_experts)
        ],
        axis=0,
    )
    assert table["final_norm.w"] == Tensor("model.norm.weight")
    shown = str(found)
    assert "table (built by the framework's map):" in shown
    assert "layers.0.mlp.router.kernel <- Tensor(name='model.layers.0.mlp.gate.weight'" in shown


def test_gemma_fused_einsums_are_stacks_of_transposed_tensors(tmp_path):
    write_checkpoint("gemma3", tmp_path)
    plan = meshinit.nnx.plan(tm.gemma3_model, meshes=[(r".*", tm.mesh())])
    cfg = tm.GEMMA3
    table = meshinit.safetensors.inventory(plan, tmp_path, names=meshinit.tunix.names(cfg)).table
    kv, d = cfg.num_kv_heads, cfg.embed_dim
    # tunix: (1, 0) and reshape (d, kv, head_dim), then its preprocess: -> (kv, d, head_dim)
    assert table["layers.1.attn.kv_einsum.w"] == Stack(
        [
            Tensor(f"model.layers.1.self_attn.{s}_proj.weight", shape=(kv, HEAD_DIM, d),
                   permute=(0, 2, 1))
            for s in "kv"
        ],
        axis=0,
    )  # fmt: skip
    assert table["layers.1.attn.q_einsum.w"] == Tensor(
        "model.layers.1.self_attn.q_proj.weight", shape=(cfg.num_heads, HEAD_DIM, d),
        permute=(0, 2, 1)
    )  # fmt: skip


# ------------------------------------------------------------------- refusals


def llama_plan():
    return meshinit.nnx.plan(tm.llama3_model, meshes=[(r".*", tm.mesh())])


def test_a_family_meshinit_does_not_read_is_refused_naming_it(tmp_path):
    from tunix.models.gemma4 import model as gemma4

    write_checkpoint("llama3", tmp_path)
    with pytest.raises(meshinit.PlanError, match=r"tunix's map of gemma, gemma3, .*not of gemma4"):
        meshinit.safetensors.load(
            llama_plan(), tmp_path, names=meshinit.tunix.names(gemma4.ModelConfig.gemma4_e2b())
        )

    class NotTunix:
        pass

    with pytest.raises(meshinit.PlanError, match=r"NotTunix from .* is not a tunix ModelConfig"):
        meshinit.safetensors.load(llama_plan(), tmp_path, names=meshinit.tunix.names(NotTunix()))


@pytest.mark.parametrize(
    "entry",
    [
        ("layers.\\1.attn.q_proj.w", ((1, 0), (64, 8, 16), "scale")),  # a third step
        ("layers.\\1.attn.q_proj.w", lambda x: x.T),  # a hook, not (permute, reshape)
        ("layers.\\1.attn.q_proj.w",),  # no transform
    ],
)
def test_a_map_entry_of_an_unknown_form_refuses_it_all_naming_the_version(
    tmp_path, monkeypatch, entry
):
    write_checkpoint("llama3", tmp_path)
    own = llama_params._get_key_and_transform_mapping

    def mapping(cfg):
        m = dict(own(cfg))
        m[r"model\.layers\.([0-9]+)\.self_attn\.q_proj\.weight"] = entry
        return m

    monkeypatch.setattr(llama_params, "_get_key_and_transform_mapping", mapping)
    with pytest.raises(meshinit.PlanError, match=r"tunix 0\.1\.7's llama3 map: tunix\.models") as e:
        meshinit.safetensors.load(llama_plan(), tmp_path, names=meshinit.tunix.names(CONFIG))
    (problem,) = e.value.problems
    assert "q_proj" in problem.message and "is not regex -> (nnx path template" in problem.message


def test_another_tunix_version_is_read_if_its_map_has_the_known_form(tmp_path, monkeypatch):
    write_checkpoint("llama3", tmp_path)
    real = meshinit.tunix.metadata.version
    monkeypatch.setattr(
        meshinit.tunix.metadata, "version", lambda d: "0.1.8" if d == "google-tunix" else real(d)
    )
    names = meshinit.tunix.names(CONFIG)
    assert names.family == "tunix 0.1.8 (meshinit is tested with 0.1.7)'s llama3 map"
    assert len(meshinit.safetensors.load(llama_plan(), tmp_path, names=names)) == 3 + 9 * 2

    monkeypatch.setattr(
        llama_params, "_get_key_and_transform_mapping", lambda cfg: {r"model\.norm": "final_norm.w"}
    )
    with pytest.raises(
        meshinit.PlanError, match=r"tunix 0\.1\.8 \(meshinit is tested with 0\.1\.7\)"
    ):
        meshinit.safetensors.load(llama_plan(), tmp_path, names=names)


def test_a_preprocess_operation_no_target_expresses_names_the_parameter(tmp_path, monkeypatch):
    write_checkpoint("qwen3-moe", tmp_path)
    own = qwen3_params._stack_experts

    def scaled(params):  # a preprocess step that computes: no layout reads it
        out = own(params)
        out["layers.0.mlp.up_proj"] = out["layers.0.mlp.up_proj"] * 2
        return out

    monkeypatch.setattr(qwen3_params, "_stack_experts", scaled)
    plan = meshinit.nnx.plan(tm.qwen3_moe_model, meshes=[(r".*", tm.mesh())])
    with pytest.raises(meshinit.PlanError, match="the operation mul") as e:
        meshinit.safetensors.load(plan, tmp_path, names=meshinit.tunix.names(tm.QWEN3_MOE))
    assert [p.path for p in e.value.problems] == ["layers.0.mlp.up_proj"]
    assert "tunix 0.1.7's qwen3 map: the operation mul: no target expresses it" in str(e.value)


def test_a_loader_step_meshinit_does_not_know_is_refused(tmp_path, monkeypatch):
    write_checkpoint("llama3", tmp_path)

    def _fix_norms(params):  # tunix's loader calling a step of its own module
        return params

    monkeypatch.setattr(llama_params, "_fix_norms", _fix_norms, raising=False)
    code = llama_params.create_model_from_safe_tensors.__code__
    monkeypatch.setattr(
        llama_params.create_model_from_safe_tensors,
        "__code__",
        code.replace(co_names=(*code.co_names, "_fix_norms")),
    )
    with pytest.raises(meshinit.PlanError, match="its loader calls _fix_norms, a step meshinit"):
        meshinit.safetensors.load(llama_plan(), tmp_path, names=meshinit.tunix.names(CONFIG))


def test_a_checkpoint_of_other_heads_at_equal_sizes_is_refused_naming_each_field(tmp_path):
    """Files of 4 heads of 32 (2 KV heads) fit the plan's 8 heads of 16 (4 KV heads) in
    every shape, and loaded scrambled; config.json says so, and is checked."""
    write_checkpoint("llama3", tmp_path)
    sizes = dict(
        model_type="llama",
        hidden_size=D,
        intermediate_size=CONFIG.hidden_dim,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_hidden_layers=CONFIG.num_layers,
    )
    (tmp_path / "config.json").write_text(json.dumps(sizes))
    with pytest.raises(meshinit.PlanError) as e:
        meshinit.safetensors.load(llama_plan(), tmp_path, names=meshinit.tunix.names(CONFIG))
    fix = (
        "the files are of another model than the plan's; load that model's checkpoint, or "
        "build the ModelConfig with its sizes"
    )
    where = str(tmp_path / "config.json")
    assert [str(p) for p in e.value.problems] == [
        f"{where}: config.json says num_attention_heads=4, the tunix ModelConfig "
        f"num_heads=8: {fix}",
        f"{where}: config.json says num_key_value_heads=2, the tunix ModelConfig "
        f"num_kv_heads=4: {fix}",
        f"{where}: config.json says head_dim=32, the tunix ModelConfig head_dim=16: {fix}",
    ]


def test_tensors_the_map_sends_nowhere_and_parameters_nothing_fills_are_each_named(tmp_path):
    tensors = write_checkpoint("llama3", tmp_path)
    for f in tmp_path.glob("*.safetensors"):
        f.unlink()
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.2.input_layernorm.weight"] = tensors["model.norm.weight"]  # a 3rd layer
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(meshinit.PlanError) as e:
        meshinit.safetensors.inventory(llama_plan(), tmp_path, names=meshinit.tunix.names(CONFIG))
    assert [str(p) for p in e.value.problems] == [
        "layers.1.mlp.up_proj.kernel: tunix 0.1.7's llama3 map: no stored tensor maps to it",
        "layers.2.input_layernorm.w: tunix 0.1.7's llama3 map maps "
        "model.layers.2.input_layernorm.weight here: not a path of the plan",
    ]


def test_rng_state_of_the_plan_is_left_to_the_init():
    names = meshinit.tunix.names(CONFIG)
    tensors = {"model.norm.weight": ((D,), "F32")}
    planned = {
        "final_norm.w": ((D,), np.dtype(np.float32)),
        "rngs.default.key": ((), jax.random.key(0).dtype),
        "rngs.default.count": ((), np.dtype(np.uint32)),
    }
    table, problems = names.table(meshinit.safetensors.Checkpoint(None, "", tensors, planned))
    assert problems == []
    assert table == {
        "final_norm.w": Tensor("model.norm.weight"),
        "rngs.default.key": None,
        "rngs.default.count": None,
    }


# Qwen3's FP8 releases (Qwen3-8B-FP8, ...): every attention and MLP projection float8
# with a float32 scale per 128x128 block; not the embedding, the head or the norms
FP8_WEIGHTS = re.compile(r"\.(self_attn\.[qkvo]_proj|mlp\.(experts\.\d+\.)?\w+_proj)\.weight$")


@pytest.mark.slow
@pytest.mark.parametrize("case", ["qwen3", "qwen3-moe"])
def test_qwen3_fp8_files_load_as_tunix_loads_their_dequantized_copy(tmp_path, case):
    """Qwen3's FP8 files through ``meshinit.tunix.names``: dequantized on the devices,
    every parameter has the bits tunix's own loader reads from the copy DeepSeek's
    ``weight_dequant`` makes (in tunix's float32), on tunix's shardings."""
    factory, config, loader = tm.LOADERS[case]
    (tmp_path / "wide").mkdir()
    wide = write_checkpoint(case, tmp_path / "wide")
    rng = np.random.default_rng(3)
    fp8, dequantized = {}, {}
    for name, x in wide.items():
        if not FP8_WEIGHTS.search(name):
            fp8[name] = dequantized[name] = x
            continue
        s = rng.uniform(1e-3, 1e-2, (-(-x.shape[0] // 128), -(-x.shape[1] // 128)))
        s = s.astype(np.float32)
        every = np.repeat(np.repeat(s, 128, 0), 128, 1)[: x.shape[0], : x.shape[1]]
        w = (x / every).astype(ml_dtypes.float8_e4m3fn)
        fp8[name], fp8[name + "_scale_inv"] = w, s
        dequantized[name] = w.astype(np.float32) * every  # weight_dequant, in float32
    assert len(fp8) > len(wide)
    quantization = {"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e4m3"}
    for folder, tensors, extra in (("fp8", fp8, {"quantization_config": quantization}),
                                   ("copy", dequantized, {})):  # fmt: skip
        (tmp_path / folder).mkdir()
        save_file(tensors, str(tmp_path / folder / "model.safetensors"))
        (tmp_path / folder / "config.json").write_text(json.dumps({"model_type": case} | extra))
    mesh = tm.mesh()
    theirs = tm.arrays(
        loader.create_model_from_safe_tensors(
            str(tmp_path / "copy"), config, mesh=mesh, mode="optimized"
        )
    )
    plan = meshinit.nnx.plan(factory, meshes=[(r".*", mesh)])
    names = meshinit.tunix.names(config)
    found = meshinit.safetensors.inventory(plan, tmp_path / "fp8", names=names)
    assert found.unused == () and len(found.dequantized) >= 7, found
    loaded = meshinit.safetensors.load(plan, tmp_path / "fp8", names=names, unused="error")
    differ = [
        p
        for p in sorted(loaded)
        if np.asarray(loaded[p]).tobytes() != np.asarray(theirs[p]).tobytes()
        or loaded[p].sharding != theirs[p].sharding
    ]
    assert not differ, f"{case}: values or shardings differ from tunix's loader at {differ}"
