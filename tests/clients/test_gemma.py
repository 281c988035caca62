"""A Hugging Face Gemma checkpoint loaded into google-deepmind gemma's own fused linen
model: ``kv_einsum`` (or ``qkv_einsum``) and ``gating_einsum`` built by ``Stack`` from the
separate stored tensors, shard by shard (issue 41).

gemma 4.0.1's ``gm.nn.Transformer`` with a tiny config, planned by ``meshinit.linen.plan``
with a ``placements=`` table. The checkpoint is gemma's own init written in Hugging Face's
names and torch's ``(out, in)`` layout; the load must give back gemma's init bit for bit
(and so the stacked stored tensors, as numpy stacks them), on the shardings the table
asks, and ``meshinit.linen.init(existing=...)`` must build gemma's variables around it.

gemma needs Python 3.12 (and ``sentencepiece<0.2.3``); the module is skipped where it is
missing. Its install takes minutes (tensorflow-cpu), so CI leaves it out; run it in a
venv with ``pip install -e '.[test]' gemma==4.0.1 'sentencepiece<0.2.3'``.
"""

import re

import pytest

gm = pytest.importorskip("gemma.gm", reason="gemma is not installed (it needs Python 3.12)")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from helpers import same_bits  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

import meshinit  # noqa: E402
from meshinit.safetensors import Stack, Tensor  # noqa: E402

pytestmark = pytest.mark.slow

EMBED, HIDDEN, HEADS, HEAD_DIM, LAYERS = 64, 128, 4, 16, 2


def model(kv_heads: int):
    attention = gm.nn.AttentionType.GLOBAL
    config = gm.nn.config.TransformerConfig(
        num_embed=256,
        embed_dim=EMBED,
        hidden_dim=HIDDEN,
        num_heads=HEADS,
        head_dim=HEAD_DIM,
        num_kv_heads=kv_heads,
        final_logit_softcap=None,
        use_post_attn_norm=True,
        use_post_ffw_norm=True,
        attention_types=(attention,) * LAYERS,
        transpose_gating_einsum=True,
    )
    return gm.nn.Transformer(config=config, tokens="batch.tokens", dtype=jnp.float32)


def placements(kv_heads: int) -> list:
    """Mesh axes per dimension, as a kauldron or t5x table keeps them: gemma's fused
    q/k/v where every head has its own k and v, q and k/v apart otherwise."""
    attn = r"params\.layer_\d+\.attn"
    if kv_heads == HEADS:
        rows = [(rf"{attn}\.qkv_einsum\.w", P(None, "tp", "fsdp", None))]
    else:
        rows = [
            (rf"{attn}\.q_einsum\.w", P("tp", "fsdp", None)),
            (rf"{attn}\.kv_einsum\.w", P(None, None, "fsdp", "tp")),
        ]
    return [
        *rows,
        (rf"{attn}\.attn_vec_einsum\.w", P("tp", None, "fsdp")),
        (r"params\.layer_\d+\.mlp\.gating_einsum", P(None, "tp", "fsdp")),
        (r"params\.layer_\d+\.mlp\.linear", P("tp", "fsdp")),
    ]


def heads(n):  # torch's (n * head_dim, embed) -> gemma's (n, embed, head_dim)
    return dict(shape=(n, HEAD_DIM, EMBED), permute=(0, 2, 1))


def names(kv_heads: int) -> list:
    hf = r"model.layers.\1"
    attn = r"params\.layer_(\d+)\.attn"
    if kv_heads == HEADS:  # gemma fuses q, k and v
        qkv = [Tensor(rf"{hf}.self_attn.{x}_proj.weight", **heads(HEADS)) for x in "qkv"]
        rows = [(rf"{attn}\.qkv_einsum\.w", Stack(qkv, axis=0))]
    else:
        kv = [Tensor(rf"{hf}.self_attn.{x}_proj.weight", **heads(kv_heads)) for x in "kv"]
        rows = [
            (rf"{attn}\.q_einsum\.w", Tensor(rf"{hf}.self_attn.q_proj.weight", **heads(HEADS))),
            (rf"{attn}\.kv_einsum\.w", Stack(kv, axis=0)),
        ]
    o = Tensor(rf"{hf}.self_attn.o_proj.weight", shape=(EMBED, HEADS, HEAD_DIM), permute=(1, 2, 0))
    gating = Stack([rf"{hf}.mlp.gate_proj.weight", rf"{hf}.mlp.up_proj.weight"], axis=0)
    return [
        *rows,
        (rf"{attn}\.attn_vec_einsum\.w", o),
        (r"params\.layer_(\d+)\.mlp\.gating_einsum", gating),
        (
            r"params\.layer_(\d+)\.mlp\.linear",
            Tensor(rf"{hf}.mlp.down_proj.weight", permute=(1, 0)),
        ),
        (r".*", None),  # embedder and norms: made by the init
    ]


def hf_checkpoint(params: dict, kv_heads: int) -> dict[str, np.ndarray]:
    """gemma's own weights in Hugging Face's names and torch's layout."""
    out = {}
    for i in range(LAYERS):
        layer, hf = params[f"layer_{i}"], f"model.layers.{i}"
        attn = layer["attn"]

        def torch(w):  # (n, embed, head_dim) -> (n * head_dim, embed)
            return w.transpose(0, 2, 1).reshape(-1, EMBED)

        if kv_heads == HEADS:
            q, k, v = np.asarray(attn["qkv_einsum"]["w"])
        else:
            q = np.asarray(attn["q_einsum"]["w"])
            k, v = np.asarray(attn["kv_einsum"]["w"])
        out |= {
            f"{hf}.self_attn.{x}_proj.weight": torch(w)
            for x, w in zip("qkv", (q, k, v), strict=True)
        }
        o = np.asarray(attn["attn_vec_einsum"]["w"])  # (heads, head_dim, embed)
        out[f"{hf}.self_attn.o_proj.weight"] = o.reshape(-1, EMBED).T
        gate, up = np.asarray(layer["mlp"]["gating_einsum"])  # (2, hidden, embed)
        out[f"{hf}.mlp.gate_proj.weight"], out[f"{hf}.mlp.up_proj.weight"] = gate, up
        out[f"{hf}.mlp.down_proj.weight"] = np.asarray(layer["mlp"]["linear"]).T
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


@pytest.mark.parametrize("kv_heads", [2, HEADS], ids=["kv_einsum", "qkv_einsum"])
def test_a_hugging_face_checkpoint_fills_gemmas_fused_einsums(tmp_path, kv_heads):
    mesh = jax.make_mesh((2, 4), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    gemma = model(kv_heads)
    tokens = jnp.zeros((1, 8), jnp.int32)
    own = jax.jit(gemma.init)(jax.random.key(0), tokens)["params"]  # gemma's own init
    stored = hf_checkpoint(own, kv_heads)
    save_file(stored, str(tmp_path / "model.safetensors"))

    plan = meshinit.linen.plan(
        gemma, 0, tokens, mesh=mesh, placements=placements(kv_heads), default="replicated"
    )
    loaded = meshinit.safetensors.load(plan, tmp_path, names=names(kv_heads))
    fused = "qkv_einsum" if kv_heads == HEADS else "kv_einsum"
    ends = {p.removesuffix(".w").rsplit(".", 1)[1] for p in loaded}
    assert ends == {fused, "attn_vec_einsum", "gating_einsum", "linear"} | (
        set() if kv_heads == HEADS else {"q_einsum"}
    )
    placed = {e.path: e.sharding for e in plan.entries}
    for path, array in loaded.items():
        keys = path.split(".")[1:]
        want = own
        for k in keys:
            want = want[k]
        assert np.asarray(array).tobytes() == np.asarray(want).tobytes(), path
        spec = next(s for r, s in placements(kv_heads) if re.fullmatch(r, path))
        assert array.sharding == placed[path] == NamedSharding(mesh, spec), path
    for i in range(LAYERS):  # and so numpy's stack of the stored tensors
        hf = f"model.layers.{i}"
        gating = loaded[f"params.layer_{i}.mlp.gating_einsum"]
        want = np.stack([stored[f"{hf}.mlp.gate_proj.weight"], stored[f"{hf}.mlp.up_proj.weight"]])
        assert np.array_equal(np.asarray(gating), want)

    variables = meshinit.linen.init(
        gemma,
        0,
        tokens,
        mesh=mesh,
        placements=placements(kv_heads),
        default="replicated",
        existing=loaded,
    )
    for path, array in loaded.items():
        leaf = variables
        for k in path.split("."):
            leaf = leaf[k]
        assert getattr(leaf, "value", leaf) is array, path


def test_kauldrons_init_rngs_are_taken_as_the_keys_they_hold():
    """kauldron's ``RngStreams.init_rngs()`` (what its ``TrainStep`` passes to
    ``model.init``) is a dict of ``kd.random.PRNGKey``, which wraps a jax key; issue 42
    found it refused as "got PRNGKey". Each stands for the key it holds: gemma's
    variables are those of ``jax.jit(model.init)`` given the same dict."""
    kd = pytest.importorskip("kauldron.kd", reason="kauldron is not installed")
    mesh = jax.make_mesh((2, 4), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    gemma = model(2)
    tokens = jnp.zeros((1, 8), jnp.int32)
    rngs = kd.train.RngStreams(seed=3)
    assert type(rngs.init_rngs()["params"]).__module__ == "kauldron.random.random"
    got = meshinit.linen.init(
        gemma,
        rngs.init_rngs(),
        tokens,
        mesh=mesh,
        placements=placements(2),
        default="replicated",
    )["params"]
    plan = meshinit.linen.plan(
        gemma, rngs.init_rngs(), tokens, mesh=mesh, placements=placements(2), default="replicated"
    )
    placed = {e.path: e.sharding for e in plan.entries}
    unbox = pytest.importorskip("flax.linen").unbox
    # kauldron's own recipe, jax.jit(model.init), with meshinit's placement as its
    # out_shardings: XLA's CPU code may round a sharded block otherwise than the whole
    # array (jax 0.12.0.1 here: 176 of 4,096 kv_einsum elements 2 ulp off the unplaced
    # jit), and meshinit's bits are jit's for the placement
    out = jax.tree.map(lambda a: a.sharding, unbox(got))
    init = jax.jit(lambda r, t: unbox(gemma.init(r, t)["params"]), out_shardings=out)
    flat_want = dict(jax.tree_util.tree_leaves_with_path(init(rngs.init_rngs(), tokens)))
    flat_got = jax.tree_util.tree_leaves_with_path(unbox(got))
    assert len(flat_got) == len(flat_want) > 10
    for keypath, array in flat_got:
        path = "params." + ".".join(str(k.key) for k in keypath)
        same_bits(array, flat_want[keypath], path)  # another key: nearly every element
        assert array.sharding == placed[path], path
