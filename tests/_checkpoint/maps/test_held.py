"""numpy hooks run on jax values under ``jax.jit`` (``meshinit._checkpoint.maps.held``):
the bits numpy gives on the host, where XLA alone would give others (a division by a
constant folded into a product, a bfloat16 intermediate kept in float32, a Python
float converted otherwise), and a step whose bits it cannot promise refused by name.
Subnormal values are the one exception, and it is XLA's on every backend: its
arithmetic flushes them to zero, as MaxText's own ``to_huggingface`` does, which runs
the hooks on jax arrays."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from meshinit._checkpoint.maps import held, hooks

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)


SPECIAL = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-30, -3e30, 3.0]
SUBNORMAL = [1e-40, -1e-39, 9e-39]


def values(shape, dtype, seed=0, special=SPECIAL) -> np.ndarray:
    """Normal values with ``special`` ones among them (none subnormal by default)."""
    x = (np.random.default_rng(seed).standard_normal(shape) * 30).astype(np.float32)
    x.reshape(-1)[: len(special)] = special
    return x.astype(dtype)


def on_devices(hook, x, target_shape):
    """``hook`` run as the export runs it: on held values, inside one jitted program."""

    def program(v):
        out = hooks.rebound(hook, held.SPACES)(held.Held(v), list(target_shape))
        return held.value(out).value

    return np.asarray(jax.jit(program)(x))


def scale_query(x, target_shape):  # MaxText's Llama query: float32 product, cast back
    return (x.astype(np.float32) * np.dtype("float32").type(np.sqrt(128))).astype(x.dtype)


def gemma_embedding(x, target_shape):  # MaxText's Gemma 3: a bfloat16 division
    normalizer = np.dtype("bfloat16").type(2560**0.5)
    return (x / normalizer).astype(x.dtype)


def f32_division(x, target_shape):  # XLA alone makes it a product by the inverse
    return x / np.float32(50.5)


def reciprocal(x, target_shape):
    with np.errstate(divide="ignore"):  # 2 / 0 is inf, as on the devices
        return 2.0 / x


def offset_then_scale(x, target_shape):  # a bfloat16 chain, read in float32 after
    with np.errstate(over="ignore"):  # inf, as on the devices
        return ((x - 1.0) * 3.0).astype(np.float32)


def weak_constant(x, target_shape):  # a Python float that numpy rounds through float32
    return x * (1.0 + 2**-8 + 2**-30)


def rope_halves(x, target_shape):  # MaxText's adjust_rope, saving
    return jax.numpy.concatenate((x[..., ::2], x[..., 1::2]), axis=x.ndim - 1)


def numpy_join(x, target_shape):
    return np.concatenate([x[:2], -x[2:]], axis=0)


def reshape_kernel(x, target_shape):  # MaxText's, saving
    return x.reshape(np.flip(np.array(target_shape))).T


def interleave(x, target_shape):  # gpt-oss's composite hook, saving, on one tensor
    out = jnp.empty(target_shape, dtype=x.dtype)
    out = out.at[..., ::2].set(x[..., : target_shape[-1] // 2])
    return out.at[..., 1::2].set(x[..., target_shape[-1] // 2 :])


def pad_rows(x, target_shape):  # Gemma's embedding padded on its numpy branch
    pad = np.zeros((target_shape[0] - x.shape[0], x.shape[1]), dtype=x.dtype)
    if isinstance(x, jax.Array):
        return jnp.concatenate([x, pad], axis=0)
    return np.concatenate([x, pad], axis=0)


SAME_BITS = [
    (scale_query, (6, 8), (6, 8), BF16),
    (scale_query, (6, 8), (6, 8), F32),
    (gemma_embedding, (64, 8), (64, 8), BF16),
    (f32_division, (256, 64), (256, 64), F32),
    (reciprocal, (256, 64), (256, 64), F32),
    (reciprocal, (256, 64), (256, 64), BF16),
    (offset_then_scale, (256, 64), (256, 64), BF16),
    (weak_constant, (256, 64), (256, 64), BF16),
    (rope_halves, (4, 3, 8), (4, 3, 8), BF16),
    (numpy_join, (4, 6), (4, 6), F32),
    (reshape_kernel, (16, 4, 8), (32, 16), BF16),
    (interleave, (3, 4, 8), (3, 4, 8), BF16),
    (pad_rows, (5, 4), (8, 4), BF16),
]


@pytest.mark.parametrize(
    ("hook", "shape", "target", "dtype"),
    SAME_BITS,
    ids=[f"{h.__name__}-{np.dtype(d).name}" for h, _, _, d in SAME_BITS],
)
def test_a_hook_on_the_devices_has_numpys_bits(hook, shape, target, dtype):
    x = values(shape, dtype)
    want = np.asarray(hook(x, list(target)))
    got = on_devices(hook, x, target)
    assert (got.dtype, got.shape) == (want.dtype, want.shape)
    assert got.tobytes() == want.tobytes(), f"{(got != want).sum()} elements differ from numpy's"


def test_without_held_values_xla_gives_other_bits():
    """Why held.py exists: the same hooks jitted on jax arrays as they are differ."""
    x = values((256, 64), F32)
    plain = np.asarray(jax.jit(lambda v: f32_division(v, None))(x))
    assert plain.tobytes() != f32_division(x, None).tobytes()
    b = values((256, 64), BF16)
    plain = np.asarray(jax.jit(lambda v: offset_then_scale(v, None))(b))
    assert plain.tobytes() != offset_then_scale(b, None).tobytes()


@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bfloat16", "float32"])
def test_subnormals_are_flushed_by_arithmetic_as_maxtexts_jax_path_flushes_them(dtype):
    x = values((8, 8), dtype, special=SUBNORMAL)
    got = on_devices(scale_query, x, (8, 8))
    maxtexts = np.asarray(scale_query(jnp.asarray(x), (8, 8)))  # to_huggingface: jax arrays
    assert got.tobytes() == maxtexts.tobytes()
    numpys = scale_query(x, (8, 8))
    assert (got[0, :3] == 0).all() and (numpys[0, :3] != 0).all(), "numpy keeps them"
    # a layout step moves them as they are
    assert on_devices(reshape_kernel, x, (8, 8)).tobytes() == reshape_kernel(x, (8, 8)).tobytes()


def doubled(x, target_shape):
    return x * np.float64(2.0)


def compared(x, target_shape):
    return x if x.shape[0] > 0 and (x > 0) else -x


def summed(x, target_shape):
    return x - x.mean()


def rooted(x, target_shape):
    return np.sqrt(x)


def on_host(x, target_shape):
    return np.asarray(x) + np.ones(x.shape, x.dtype)


def to_int(x, target_shape):
    return x.astype(np.int32)


def written(x, target_shape):  # numpy's in-place write of the tensor into a host array
    out = np.zeros(x.shape, x.dtype)
    out[...] = x
    return out


@pytest.mark.parametrize(
    ("hook", "said"),
    [
        (doubled, "np.multiply that numpy computes in float64 and jax in float32"),
        (compared, "a comparison of the tensor's values"),
        (summed, "the array method 'mean'"),
        (rooted, "np.sqrt of the tensor"),
        (to_int, "a cast from bfloat16 to int32"),
        (written, "the tensor's values as a host array"),
    ],
)
def test_a_step_it_cannot_follow_exactly_is_refused_by_name(hook, said):
    with pytest.raises(held.Unfollowable, match=f"^{said}"):
        on_devices(hook, values((4, 4), BF16), (4, 4))


def test_numpy_asarray_keeps_the_held_value():
    # np.asarray of a held value is the held value (as numpy's of an array is the array)
    got = on_devices(on_host, values((4, 4), BF16), (4, 4))
    x = values((4, 4), BF16)
    assert got.tobytes() == (x + np.ones(x.shape, x.dtype)).tobytes()
