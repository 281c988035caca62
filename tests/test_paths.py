import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshinit
from meshinit import _paths
from meshinit._jax import threefry as _threefry


def test_path_str_joins_dict_keys_indices_and_attributes():
    tree = {"layers": [{"attn": {"q": 1}}, (2, 3)], "b": 4}
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    paths = [_paths.path_str(kp) for kp, _ in flat]
    assert paths == ["b", "layers.0.attn.q", "layers.1.0", "layers.1.1"]
    assert _paths.path_str([jax.tree_util.GetAttrKey("w"), jax.tree_util.SequenceKey(2)]) == "w.2"


def test_digest_is_stable_across_processes_and_releases():
    # A known answer: changing it changes every value meshinit has ever produced.
    hi, lo = _paths.path_digest("layers.0.attn.q")
    import hashlib

    d = hashlib.blake2b(b"layers.0.attn.q", digest_size=8).digest()
    assert (hi, lo) == (int.from_bytes(d[:4], "big"), int.from_bytes(d[4:], "big"))
    assert _paths.path_digest("a") != _paths.path_digest("b")


def test_param_key_folds_both_halves_of_the_digest():
    key = jax.random.key(7)
    hi, lo = _paths.path_digest("w")
    expected = jax.random.fold_in(jax.random.fold_in(key, hi), lo)
    assert jnp.array_equal(
        jax.random.key_data(meshinit.param_key(key, "w")), jax.random.key_data(expected)
    )


def test_host_fold_equals_jax_fold_in_bit_for_bit():
    # materialize derives every parameter's key on the host; a mismatch changes values.
    rng = np.random.default_rng(0)
    for _ in range(4):
        key_data = rng.integers(0, 2**32, 2, dtype=np.uint64).astype(np.uint32)
        digests = rng.integers(0, 2**32, (16, 2), dtype=np.uint64).astype(np.uint32)
        digests[0] = (0, 0xFFFFFFFF)  # both extremes of a half
        host = _threefry.fold_digests(key_data, digests)
        key = jax.random.wrap_key_data(key_data)
        expected = jax.vmap(
            lambda d, key=key: jax.random.key_data(_paths.fold_digest(key, d[0], d[1]))
        )(digests)
        np.testing.assert_array_equal(host, np.asarray(expected))
    none = _threefry.fold_digests(np.zeros(2, np.uint32), np.zeros((0, 2), np.uint32))
    assert none.shape == (0, 2)


def test_param_key_accepts_seed_typed_and_legacy_keys_alike():
    typed = meshinit.param_key(jax.random.key(3), "x.y")
    seed = meshinit.param_key(3, "x.y")
    legacy = meshinit.param_key(jax.random.PRNGKey(3), "x.y")
    assert legacy.dtype == jnp.uint32  # same kind of key as given
    np.testing.assert_array_equal(jax.random.key_data(typed), jax.random.key_data(seed))
    np.testing.assert_array_equal(jax.random.key_data(typed), legacy)


@pytest.mark.parametrize(
    "key, err, match",
    [
        ("seed", TypeError, "int seed"),
        (1.5, TypeError, "int seed"),
        (True, TypeError, "int seed"),
        (np.zeros((3,), np.uint32), TypeError, r"uint32\[2\]"),
    ],
)
def test_host_key_rejects_bad_keys(key, err, match):
    with pytest.raises(err, match=match):
        _paths.host_key(key)


def test_host_key_rejects_batched_keys():
    with pytest.raises(TypeError, match="single key"):
        _paths.host_key(jax.random.split(jax.random.key(0), 2))


def test_host_key_rejects_sharding_dependent_key_impls():
    with pytest.raises(ValueError, match="rbg.*depend on the sharding"):
        _paths.host_key(jax.random.key(0, impl="rbg"))


def test_host_key_rejects_non_partitionable_threefry():
    jax.config.update("jax_threefry_partitionable", False)
    try:
        with pytest.raises(ValueError, match="jax_threefry_partitionable is off"):
            _paths.host_key(jax.random.key(0))
    finally:
        jax.config.update("jax_threefry_partitionable", True)


def _slow(seed):
    return pytest.param(seed, marks=pytest.mark.slow)


@pytest.mark.parametrize(
    "seed",  # the fast tier: zero, negative, past 31 and 32 bits, both ends of 64 bits
    [
        0,
        _slow(1),
        -1,
        _slow(2**31 - 1),
        _slow(-(2**31)),
        2**31,
        _slow(2**32 - 1),
        2**32,
        _slow(2**40 + 5),
        _slow(-(2**40)),
        2**63 - 1,
        -(2**63),
    ],
)
def test_int_seeds_give_jax_random_key_data_without_a_device(seed, new_arrays):
    with new_arrays() as made:
        data, impl = _paths.host_key(seed)
    assert made == []
    assert impl == "threefry2x32"
    np.testing.assert_array_equal(data, jax.random.key_data(jax.random.key(seed)))
