"""meshinit on MaxText's own models, unchanged, against MaxText's own initialization.

A tiny MaxText config (base.yml; emb 64, vocab 256, 4 heads of 16, mlp 128, 2 decoder
layers) on MaxText's own mesh (fsdp=4, tensor=2, every other axis 1) over the 8 simulated
CPU devices, with MaxText's own logical axis rules. For the NNX ``Transformer`` and its
linen wrapper (``transformer_as_linen``), scanned and unrolled, the tests check that
``meshinit.nnx.init`` / ``meshinit.linen.init`` give every leaf MaxText's path, shape and
dtype (typed RNG keys stay typed keys), an equivalent placement and the same bits, and
emit no ``FallbackWarning``; and that the number of executables they compile does not
grow with depth.

MaxText needs Python 3.12 and jax >= 0.11.1; the module is skipped where it is missing.
"""

import warnings

import pytest

maxtext = pytest.importorskip(
    "maxtext", reason="MaxText is not installed (it needs Python 3.12 and jax >= 0.11.1)"
)

import conformance  # noqa: E402
import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import maxtext_models as mm  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from maxtext.utils import (  # noqa: E402
    model_creation_utils,
)

import meshinit  # noqa: E402

pytestmark = pytest.mark.slow

# Depths whose compile counts must agree. Not 2: meshinit's rounds share one executable
# among signatures with equally many variables, and at 2 layers MaxText's per-layer
# signatures (query, out, wo) have as many as its one 2-variable signature (the first
# layer's two RNG counters), so 2 layers compile one executable fewer than 3 or more.
DEPTHS = (3, 6)
LAYOUTS = pytest.mark.parametrize("scan_layers", [True, False], ids=["scanned", "unrolled"])


def key_free(array):
    """The array's bits as numpy: typed PRNG keys as their key data."""
    if jax.dtypes.issubdtype(array.dtype, jax.dtypes.prng_key):
        array = jax.random.key_data(array)
    return np.asarray(array)


def leaf_problems(got: dict, want: dict) -> list[str]:
    """Every way a leaf of ``got`` differs from MaxText's ``want``, each naming its path.

    Both map a path to a placed ``jax.Array``.
    """
    problems = []
    if sorted(got) != sorted(want):
        problems.append(
            f"paths differ: only meshinit has {sorted(set(got) - set(want))}, "
            f"only MaxText has {sorted(set(want) - set(got))}"
        )
    for path in sorted(set(got) & set(want)):
        g, w = got[path], want[path]
        if (g.shape, g.dtype) != (w.shape, w.dtype):
            problems.append(
                f"{path}: meshinit gives {g.dtype}{g.shape}, MaxText {w.dtype}{w.shape}"
            )
            continue
        # ==, not only equivalent: P() and P(None, None) place alike but differ
        if g.sharding != w.sharding:
            problems.append(f"{path}: meshinit places it on {g.sharding}, MaxText on {w.sharding}")
        if key_free(g).tobytes() != key_free(w).tobytes():
            problems.append(f"{path}: values differ from MaxText's init")
    return problems


def fallbacks(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, meshinit.FallbackWarning)]


# -- NNX: models.Transformer, built by MaxText's own factory ------------------------------


def nnx_leaves(model) -> tuple[dict, dict]:
    """``path -> array`` and ``path -> Variable type`` of an nnx Module's state."""
    flat = [(".".join(map(str, p)), v) for p, v in nnx.to_flat_state(nnx.state(model))]
    return {p: v.get_value() for p, v in flat}, {p: type(v) for p, v in flat}


@conformance.parametrize("maxtext", "shardings", "values", "metadata", case="nnx-.*")
def test_nnx_transformer_matches_maxtext_init_on_every_leaf(row):
    config = mm.tiny_config(row.case.endswith("-scanned"))
    mesh = mm.maxtext_mesh(config)
    factory = model_creation_utils.get_nnx_create_model_fn(config, mesh)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with jax.set_mesh(mesh):
            got = meshinit.nnx.init(factory, rules=config.logical_axis_rules)
            plan = meshinit.nnx.plan(factory, rules=config.logical_axis_rules)
    assert not fallbacks(caught), (
        f"meshinit fell back on MaxText's Transformer: {fallbacks(caught)}"
    )

    want = mm.maxtext_nnx_init(config, mesh)
    got_arrays, got_types = nnx_leaves(got)
    want_arrays, want_types = nnx_leaves(want)
    assert type(got) is type(want), f"meshinit returns a {type(got)}, MaxText a {type(want)}"
    assert any(jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key) for a in want_arrays.values()), (
        "MaxText's state holds no typed key: the typed-key check would check nothing"
    )
    problems = leaf_problems(got_arrays, want_arrays)
    problems += [
        f"{path}: meshinit gives a {got_types[path].__name__}, MaxText a {kind.__name__}"
        for path, kind in want_types.items()
        if path in got_types and got_types[path] is not kind
    ]
    # the plan shows what init makes, typed keys (rngs.aqt.key) included
    problems += [
        f"{e.path}: planned {e.spec.dtype}{e.spec.shape} on {e.sharding}, init made {a.dtype}"
        f"{a.shape} on {a.sharding}"
        for e in plan.entries
        if ((a := got_arrays[e.path]).shape, a.dtype, a.sharding)
        != (e.spec.shape, e.spec.dtype, e.sharding)
    ]
    assert not problems, "\n".join(problems)


# -- linen: transformer_as_linen, init by MaxText's jit recipe ----------------------------


def is_box(x) -> bool:
    return isinstance(x, nn.meta.AxisMetadata)


def linen_leaves(variables) -> tuple[dict, dict]:
    """``path -> array`` and ``path -> box`` (or None) of linen variables."""
    flat = jax.tree_util.tree_flatten_with_path(variables, is_leaf=is_box)[0]
    arrays = {jax.tree_util.keystr(p): (v.value if is_box(v) else v) for p, v in flat}
    boxes = {jax.tree_util.keystr(p): (v if is_box(v) else None) for p, v in flat}
    return arrays, boxes


@conformance.parametrize("maxtext", "shardings", "values", "metadata", case="linen-.*")
def test_linen_transformer_matches_maxtext_init_on_every_leaf(row):
    config = mm.tiny_config(row.case.endswith("-scanned"))
    mesh = mm.maxtext_mesh(config)
    model, args, kwargs = mm.linen_model_and_inputs(config, mesh)
    key, keys = mm.linen_keys(config)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = meshinit.linen.init(
            model, keys, *args, mesh=mesh, rules=config.logical_axis_rules, **kwargs
        )
    assert not fallbacks(caught), (
        f"meshinit fell back on MaxText's linen model: {fallbacks(caught)}"
    )

    want = mm.maxtext_linen_init(config, mesh, model, key)
    got_arrays, got_boxes = linen_leaves(got)
    want_arrays, want_boxes = linen_leaves(want)
    problems = leaf_problems(got_arrays, want_arrays)
    for path in sorted(set(want_boxes) & set(got_boxes)):
        box, other = want_boxes[path], got_boxes[path]
        if (type(other), getattr(other, "names", None)) != (type(box), getattr(box, "names", None)):
            problems.append(f"{path}: meshinit boxes it as {other!r:.120}, MaxText as {box!r:.120}")
    assert not problems, "\n".join(problems)


# -- compile counts do not grow with depth --------------------------------------------------


def _meshinit_init(framework, config):
    """``meshinit.nnx.init`` or ``meshinit.linen.init`` of MaxText's model for ``config``."""
    mesh = mm.maxtext_mesh(config)
    rules = config.logical_axis_rules
    if framework == "nnx":
        factory = model_creation_utils.get_nnx_create_model_fn(config, mesh)
        with jax.set_mesh(mesh):
            return meshinit.nnx.init(factory, rules=rules)
    model, args, kwargs = mm.linen_model_and_inputs(config, mesh)
    _, keys = mm.linen_keys(config)
    return meshinit.linen.init(model, keys, *args, mesh=mesh, rules=rules, **kwargs)


@LAYOUTS
@pytest.mark.parametrize("framework", ["nnx", "linen"])
def test_init_compiles_as_many_executables_at_3_and_6_layers(
    framework, scan_layers, count_compiles
):
    counts = {}
    for layers in DEPTHS:
        config = mm.tiny_config(scan_layers, layers)
        meshinit.clear_cache()
        jax.clear_caches()
        with count_compiles() as compiled:
            _meshinit_init(framework, config)
        counts[layers] = compiled.count
    assert counts[3] > 0, "a cold init compiled nothing: the compile counter is not counting"
    assert len(set(counts.values())) == 1, f"executables compiled, by depth: {counts}"


def test_every_conformance_cell_claimed_for_maxtext_is_checked_here():
    assert conformance.claimed("maxtext"), "tests/conformance.py claims nothing for MaxText"
    missing = conformance.unchecked("maxtext")
    assert not missing, f"claimed in tests/conformance.py but run by no test: {missing}"
