"""meshinit's rule table against google-tunix's own Llama3 safetensors loader.

tunix (0.1.7, Python 3.12) maps each Hugging Face key to an nnx path with a regex table
whose transforms are ``(permute, reshape)``, transpose first. The same checkpoint,
read by tunix's loader and by ``meshinit.safetensors.load`` through the rule table
that ``docs/pretrained.md`` derives from tunix's, must give every parameter of
tunix's own model bit for bit, on the same shardings. Skipped where tunix is not
installed (it is not a dependency); ``.ci/run`` runs it in ``.venv-tunix``, or::

    python3.12 -m venv /work/tunix312
    /work/tunix312/bin/pip install google-tunix==0.1.7 safetensors
    /work/tunix312/bin/pip install -e .
    /work/tunix312/bin/python -m pytest tests/test_tunix_names.py
"""

import pytest

pytest.importorskip("tunix")

import numpy as np  # noqa: E402
import tunix_models as tm  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402
from tunix.models.llama3 import params as llama_params  # noqa: E402
from tunix.utils.mesh import create_mesh  # noqa: E402

import meshinit  # noqa: E402
from meshinit.safetensors import Tensor  # noqa: E402

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
