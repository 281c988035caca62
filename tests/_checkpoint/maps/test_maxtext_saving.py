"""MaxText's saving side cut into an export's recipes (``maps/maxtext_saving``), on
maps of MaxText's forms written here (a scanned key, experts by layers, a composite
key, a hook that splits a parameter in two): each recipe's build, jitted, is the hook
run in numpy on the slice ``process_maxtext_param`` takes, in MaxText's
``weight_dtype``; every layer shares one program. tests/clients runs MaxText's own."""

import types

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from meshinit._checkpoint.maps import maxtext_saving

BF16 = np.dtype(ml_dtypes.bfloat16)

# tensor_handling's nesting and stacking as MaxText 0.2.5 has them for these keys
HANDLING = types.SimpleNamespace(
    nesting_depth=lambda keys: 1 + HANDLING.nesting_depth(keys[0]) if isinstance(keys, list) else 0,
    stacked_axes=lambda key, config, depth: tuple(range(depth)),
)


def config(scan=True, psa=1):
    return types.SimpleNamespace(scan_layers=scan, param_scan_axis=psa)


def reshape_kernel(x, target_shape):  # MaxText's, saving
    return x.reshape(np.flip(np.array(target_shape))).T


def scale_query(x, target_shape):  # MaxText's Llama query, saving
    return (x.astype(np.float32) * np.dtype("float32").type(np.sqrt(8))).astype(x.dtype)


def interleave(xs, target_shape):  # gpt-oss's composite hook, saving, in numpy
    wi_0, wi_1 = xs
    out = np.empty(target_shape, dtype=wi_0.dtype)
    out[..., ::2], out[..., 1::2] = wi_0, wi_1
    return out


def interleave_jax(xs, target_shape):  # as MaxText writes it: jnp.empty, .at[].set
    wi_0, wi_1 = xs
    out = jnp.empty(target_shape, dtype=wi_0.dtype)
    out = out.at[..., ::2].set(wi_0)
    return out.at[..., 1::2].set(wi_1)


def halves(x, target_shape):  # one parameter written as two tensors
    return x[: x.shape[0] // 2], x[x.shape[0] // 2 :]


def cut(key, hf, planned, shapes, hooks, weight=BF16, cfg=None):
    paths = tuple(k.replace("-", ".") for k in (key if isinstance(key, tuple) else (key,)))
    recipes, problems = maxtext_saving._cut(
        key, hf, paths, planned, shapes, tuple(hooks), weight, cfg or config(), HANDLING
    )
    assert problems == []
    return recipes


def run(recipes, arrays):
    programs = {}
    out = {}
    for r in recipes:
        program = programs.setdefault(r.build, jax.jit(r.build))
        at = tuple(np.int32(i) for i in r.at)
        out[r.name] = np.asarray(program(tuple(arrays[p] for p in r.paths), at))
    return out, len(programs)


def seeded(shape, dtype=BF16, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def test_a_scanned_key_is_one_recipe_per_layer_sharing_one_program(count_compiles):
    # (emb, layers, heads * head_dim) as MaxText scans a query kernel (param_scan_axis 1)
    w = seeded((4, 3, 6))
    names = [f"model.layers.{i}.q_proj.weight" for i in range(3)]
    recipes = cut(
        "params-q",
        names,
        {"params.q": ((4, 3, 6), BF16)},
        {n: [6, 4] for n in names},
        [scale_query, reshape_kernel],
    )
    assert [(r.name, r.at, r.shape, r.dtype) for r in recipes] == [
        (n, (i,), (6, 4), BF16) for i, n in enumerate(names)
    ]
    with count_compiles() as compiles:
        got, programs = run(recipes, {"params.q": w})
    assert programs == 1 and compiles.count == 1, "one program for every layer"
    for i, n in enumerate(names):
        want = reshape_kernel(scale_query(w[:, i], [6, 4]), [6, 4])
        assert got[n].tobytes() == np.ascontiguousarray(want).tobytes(), n


def test_experts_by_layers_are_picked_as_process_maxtext_param_slices_them():
    w = seeded((2, 3, 4, 5))  # (experts, layers, in, out)
    names = [[f"l{layer}.e{e}" for layer in range(3)] for e in range(2)]
    recipes = cut(
        "params-wi",
        names,
        {"params.wi": ((2, 3, 4, 5), BF16)},
        {n: [5, 4] for row in names for n in row},
        [reshape_kernel],
    )
    assert {r.at for r in recipes} == {(e, layer) for e in range(2) for layer in range(3)}
    got, programs = run(recipes, {"params.wi": w})
    assert programs == 1
    for e in range(2):
        for layer in range(3):
            want = np.ascontiguousarray(w[e, layer].T)
            assert got[f"l{layer}.e{e}"].tobytes() == want.tobytes()


def test_a_composite_key_reads_its_members_together():
    a, b = seeded((2, 4, 3), seed=1), seeded((2, 4, 3), seed=2)
    recipes = cut(
        ("params-wi_0", "params-wi_1"),
        "experts.gate_up_proj",
        {"params.wi_0": ((2, 4, 3), BF16), "params.wi_1": ((2, 4, 3), BF16)},
        {"experts.gate_up_proj": [2, 4, 6]},
        [interleave_jax],
    )
    assert [r.paths for r in recipes] == [("params.wi_0", "params.wi_1")]
    got, _ = run(recipes, {"params.wi_0": a, "params.wi_1": b})
    assert got["experts.gate_up_proj"].tobytes() == interleave((a, b), [2, 4, 6]).tobytes()


def test_a_hook_that_splits_a_parameter_makes_one_recipe_per_tensor():
    w = seeded((6, 4))
    recipes = cut(
        "params-kv",
        ("k.weight", "v.weight"),
        {"params.kv": ((6, 4), BF16)},
        {("k.weight", "v.weight"): [[3, 4], [3, 4]]},
        [halves],
    )
    assert [(r.name, r.build.part) for r in recipes] == [("k.weight", 0), ("v.weight", 1)]
    got, _ = run(recipes, {"params.kv": w})
    assert got["k.weight"].tobytes() == w[:3].tobytes()
    assert got["v.weight"].tobytes() == w[3:].tobytes()


def test_a_parameter_is_restored_in_weight_dtype_before_its_hooks():
    # to_huggingface restores floating parameters in weight_dtype, then hooks them
    w = seeded((4, 6), np.float32)
    recipes = cut(
        "params-q", "q.weight", {"params.q": ((4, 6), np.float32)}, {"q.weight": [6, 4]},
        [scale_query, reshape_kernel],
    )  # fmt: skip
    assert recipes[0].dtype == BF16
    got, _ = run(recipes, {"params.q": w})
    want = reshape_kernel(scale_query(w.astype(BF16), [6, 4]), [6, 4])
    assert got["q.weight"].tobytes() == np.ascontiguousarray(want).tobytes()
    # and the same hook in float32, where weight_dtype says so
    recipes = cut(
        "params-q", "q.weight", {"params.q": ((4, 6), np.float32)}, {"q.weight": [6, 4]},
        [scale_query, reshape_kernel], weight=np.dtype(np.float32),
    )  # fmt: skip
    got, _ = run(recipes, {"params.q": w})
    want = reshape_kernel(scale_query(w, [6, 4]), [6, 4])
    assert got["q.weight"].tobytes() == np.ascontiguousarray(want).tobytes()


def test_a_stored_name_maxtexts_shapes_lack_is_a_problem():
    recipes, problems = maxtext_saving._cut(
        "params-q", "q.weight", ("params.q",), {"params.q": ((4, 6), BF16)}, {}, (), BF16,
        config(), HANDLING,
    )  # fmt: skip
    assert recipes == []
    assert [str(p) for p in problems] == [
        "params.q: MaxText's HF_SHAPE has no 'q.weight', which 'params-q' maps to"
    ]


@pytest.mark.parametrize(
    ("path", "dtype", "made"),
    [
        ("decoder.rngs.params.count", np.uint32, True),
        ("decoder.layers.mlp.wo.kernel", BF16, False),
        ("decoder.count", np.int32, False),
    ],
)
def test_rng_state_is_made_by_the_init_and_not_exported(path, dtype, made):
    assert maxtext_saving.made_by_init(path, np.dtype(dtype)) is made


def test_plan_paths_read_as_maxtexts_keys():
    assert maxtext_saving.mt_key("params.decoder.layers.mlp.wo.kernel") == (
        "params-decoder-layers-mlp-wo-kernel"
    )
    assert maxtext_saving.mt_key("decoder.layers_0.mlp.wo.kernel") == (
        "params-decoder-layers_0-mlp-wo-kernel"
    )
