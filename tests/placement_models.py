"""Models, tables and comparisons that several tests of ``placements=`` share
(tests/_adapters/placement/): nnx, linen and equinox models with EasyDeL's paths and
layer stacks, and how their placements and bits are compared. No tests here."""

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from helpers import submesh


def mesh3():
    """EasyDeL's axis names: (fsdp, sp, tp)."""
    return submesh(range(8), (2, 1, 4), ("fsdp", "sp", "tp"), explicit=True)


def shardings_nnx(module):
    return {
        ".".join(map(str, p)): v.get_value().sharding
        for p, v in nnx.to_flat_state(nnx.state(module))
    }


def bits_nnx(module):
    return {
        ".".join(map(str, p)): np.asarray(jax.random.key_data(v.get_value()))
        if jnp.issubdtype(v.get_value().dtype, jax.dtypes.prng_key)
        else np.asarray(v.get_value())
        for p, v in nnx.to_flat_state(nnx.state(module))
    }


def assert_same_bits(got, want):
    assert got.keys() == want.keys()
    for path in got:
        assert got[path].dtype == want[path].dtype, path
        assert got[path].tobytes() == want[path].tobytes(), path


# ------------------------------------------------- an nnx model with EasyDeL's paths


class Attention(nnx.Module):
    def __init__(self, d, rngs):
        self.q_proj = nnx.Linear(d, d, use_bias=False, rngs=rngs)
        self.k_proj = nnx.Linear(d, d, use_bias=False, rngs=rngs)
        self.o_proj = nnx.Linear(d, d, use_bias=False, rngs=rngs)


class Mlp(nnx.Module):
    def __init__(self, d, rngs):
        self.gate_proj = nnx.Linear(d, 4 * d, use_bias=False, rngs=rngs)
        self.up_proj = nnx.Linear(d, 4 * d, use_bias=False, rngs=rngs)
        self.down_proj = nnx.Linear(4 * d, d, use_bias=False, rngs=rngs)


class Layer(nnx.Module):
    def __init__(self, d, rngs):
        self.self_attn = Attention(d, rngs)
        self.mlp = Mlp(d, rngs)
        self.input_layernorm = nnx.RMSNorm(d, rngs=rngs)


class Decoder(nnx.Module):
    def __init__(self, d, vocab, layers, rngs):
        self.embed_tokens = nnx.Embed(vocab, d, rngs=rngs)
        self.layers = nnx.List([Layer(d, rngs) for _ in range(layers)])
        self.norm = nnx.RMSNorm(d, rngs=rngs)


class CausalLM(nnx.Module):
    """EasyDeL's layout: model.embed_tokens.embedding, model.layers.N.mlp.gate_proj.kernel,
    lm_head.kernel; no sharding metadata anywhere (EasyDeL keeps it in its rules)."""

    def __init__(self, rngs, d=32, vocab=64, layers=3):
        self.model = Decoder(d, vocab, layers, rngs)
        self.lm_head = nnx.Linear(d, vocab, use_bias=False, rngs=rngs)
        self.rngs = rngs  # RNG state: a typed key and a counter, as EasyDeL models hold


def causal_lm():
    return CausalLM(nnx.Rngs(0))


# ----------------------------------------------------------------- int, None


class Counted(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.ones((8, 8)))
        self.step = nnx.Variable(3)
        self.cache = nnx.Variable(None)


class EqxCounted(eqx.Module):
    w: jax.Array
    step: int
    cache: object

    def __init__(self, key):
        self.w = jax.random.normal(key, (8, 8))
        self.step = 3
        self.cache = None


class LinenCounted(nn.Module):
    @nn.compact
    def __call__(self, x):
        self.variable("stats", "step", lambda: 3)
        return nn.Dense(8, use_bias=False)(x)


class ELinear(eqx.Module):
    kernel: jax.Array

    def __init__(self, n_in, n_out, key):
        self.kernel = jax.random.normal(key, (n_in, n_out)) / n_in**0.5


class ENorm(eqx.Module):
    scale: jax.Array

    def __init__(self, d):
        self.scale = jnp.ones((d,))


class EAttention(eqx.Module):
    q_proj: ELinear
    k_proj: ELinear
    o_proj: ELinear

    def __init__(self, d, key):
        kq, kk, ko = jax.random.split(key, 3)
        self.q_proj, self.k_proj, self.o_proj = (
            ELinear(d, d, kq),
            ELinear(d, d, kk),
            ELinear(d, d, ko),
        )


class EMlp(eqx.Module):
    gate_proj: ELinear
    up_proj: ELinear
    down_proj: ELinear

    def __init__(self, d, key):
        kg, ku, kd = jax.random.split(key, 3)
        self.gate_proj, self.up_proj = ELinear(d, 4 * d, kg), ELinear(d, 4 * d, ku)
        self.down_proj = ELinear(4 * d, d, kd)


class ELayer(eqx.Module):
    self_attn: EAttention
    mlp: EMlp
    input_layernorm: ENorm

    def __init__(self, d, key):
        ka, km = jax.random.split(key)
        self.self_attn, self.mlp, self.input_layernorm = EAttention(d, ka), EMlp(d, km), ENorm(d)


class EEmbed(eqx.Module):
    embedding: jax.Array

    def __init__(self, vocab, d, key):
        self.embedding = jax.random.normal(key, (vocab, d))


class EDecoder(eqx.Module):
    embed_tokens: EEmbed
    layers: list
    norm: ENorm

    def __init__(self, d, vocab, layers, key):
        keys = jax.random.split(key, layers + 1)
        self.embed_tokens = EEmbed(vocab, d, keys[0])
        self.layers = [ELayer(d, k) for k in keys[1:]]
        self.norm = ENorm(d)


class ECausalLM(eqx.Module):
    """The same paths as CausalLM's, in equinox."""

    model: EDecoder
    lm_head: ELinear

    def __init__(self, key, d=32, vocab=64, layers=3):
        km, kh = jax.random.split(key)
        self.model, self.lm_head = EDecoder(d, vocab, layers, km), ELinear(d, vocab, kh)


def flax_jit_with(factory, shardings):
    """flax's own answer: the Module made in nnx.jit, its state constrained to
    ``shardings`` (a State of NamedShardings), as flax's sharding guide does it
    (``reshard`` on Explicit axes, where jax asks for it)."""
    pure = nnx.to_pure_dict(shardings)
    explicit = jax.sharding.AxisType.Explicit in jax.sharding.get_abstract_mesh().axis_types
    constrain = jax.sharding.reshard if explicit else jax.lax.with_sharding_constraint

    @nnx.jit
    def create():
        model = factory()
        state = nnx.state(model)
        nnx.replace_by_pure_dict(state, constrain(nnx.to_pure_dict(state), pure))
        nnx.update(model, state)
        return model

    return create()


def same_placement(got, want, ndims, spelled_alike):
    """``==`` where jax spells the two alike, else the same placement
    (``is_equivalent_to``): inside nnx.jit, jax spells a constrained output as it
    likes, P(None,) for a replicated one on Explicit axes (flax's metadata: P()), and
    P("fsdp",) for P("fsdp", None) on Auto axes."""
    assert got.keys() == want.keys()
    for path in got:
        if spelled_alike:
            assert got[path] == want[path], path
        else:
            assert got[path].is_equivalent_to(want[path], ndims[path]), path


class LinenBlocks(nn.Module):
    sharded: bool = False

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()

        def kernel(names):
            return nn.with_partitioning(init, names) if self.sharded else init

        for i in range(2):
            h = nn.Dense(128, kernel_init=kernel(("fsdp", "tp")), name=f"up_{i}")(x)
            x = x + nn.Dense(32, kernel_init=kernel(("tp", "fsdp")), name=f"down_{i}")(h)
        return x


X = jnp.ones((2, 32))


def linen_leaves(variables):
    flat = jax.tree_util.tree_flatten_with_path(nn.unbox(variables))[0]
    return {".".join(str(k.key) for k in kp): v for kp, v in flat}


class EStack(eqx.Module):
    blocks: list

    def __init__(self, key):
        self.blocks = [ELayer(32, k) for k in jax.random.split(key, 2)]
