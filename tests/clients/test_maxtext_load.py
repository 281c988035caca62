"""A Hugging Face Llama checkpoint loaded by meshinit straight into MaxText's own model,
scanned and unrolled, NNX and linen, against MaxText's own HF -> MaxText conversion.

The checkpoint is written the way MaxText writes one: from a model MaxText initialized,
through MaxText's own MaxText -> HF mapping and hooks (``LLAMA31_MAXTEXT_TO_HF_PARAM_*``,
``saving_to_hf=True``: the query scaled back, the rotary pairs split into halves,
kernels transposed to torch's layout, scanned layers split). meshinit then loads it
through one ``names=`` table (``Stack`` over the layers, ``Tensor`` with
``shape``/``permute``/``out_shape``/``scale``) onto ``meshinit.nnx.plan`` /
``meshinit.linen.plan`` of MaxText's own model. Every loaded leaf must have the bits of
MaxText's own conversion of the same file (its hooks with ``saving_to_hf=False``, its
own stacking) and the sharding of MaxText's own init, ``==``; each process reads only
the bytes it owns.

MaxText needs Python 3.12 and jax >= 0.11.1; the module is skipped where it is missing.
"""

import subprocess
import sys
from pathlib import Path

import pytest

maxtext = pytest.importorskip(
    "maxtext", reason="MaxText is not installed (it needs Python 3.12 and jax >= 0.11.1)"
)

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import maxtext_models as mm  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from helpers import Reads, owned_bytes  # noqa: E402
from maxtext.checkpoint_conversion import to_maxtext  # noqa: E402
from maxtext.checkpoint_conversion.utils import param_mapping  # noqa: E402
from maxtext.checkpoint_conversion.utils.tensor_handling import apply_hook_fns  # noqa: E402
from maxtext.utils import model_creation_utils  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

import meshinit  # noqa: E402

pytestmark = pytest.mark.slow

LAYOUTS = pytest.mark.parametrize("scan_layers", [True, False], ids=["scanned", "unrolled"])


def mt_key(path: str) -> str:
    """MaxText's conversion key of a meshinit plan path (nnx, or linen's ``params.``)."""
    return "params-" + path.removeprefix("params.").replace(".", "-")


def write_hf_checkpoint(config, params: dict[str, np.ndarray], path) -> dict[str, np.ndarray]:
    """MaxText's own MaxText -> HF conversion of ``params`` (MaxText key -> array),
    written as one safetensors file; returns what it wrote."""
    scan = config.scan_layers
    mapping = param_mapping.LLAMA31_MAXTEXT_TO_HF_PARAM_MAPPING(mm.hf_config(config), config, scan)
    hooks = param_mapping.LLAMA31_MAXTEXT_TO_HF_PARAM_HOOK_FN(
        mm.hf_config(config), config, scan, saving_to_hf=True
    )
    shapes = mm.hf_shapes(config)
    out = {}
    for key, value in params.items():
        names = mapping[key]
        if isinstance(names, list):  # scanned: one tensor per layer, along the scan axis
            axis = config.param_scan_axis if value.ndim > config.param_scan_axis else 0
            layers = [np.take(value, i, axis=axis) for i in range(len(names))]
            pairs = list(zip(names, layers, strict=True))
        else:
            pairs = [(names, value)]
        for name, array in pairs:
            hf = apply_hook_fns(array, shapes[name], hooks.get(key))
            out[name] = np.ascontiguousarray(np.asarray(hf))
            assert out[name].shape == shapes[name], (name, out[name].shape)
    save_file(out, str(path))
    return out


def maxtext_conversion(config, stored: dict[str, np.ndarray], targets: dict) -> dict:
    """MaxText's own HF -> MaxText conversion of ``stored``: its mapping, its hooks
    (``saving_to_hf=False``) and its stacking, for each MaxText key's target shape."""
    scan = config.scan_layers
    mapping = param_mapping.LLAMA31_MAXTEXT_TO_HF_PARAM_MAPPING(mm.hf_config(config), config, scan)
    hooks = param_mapping.LLAMA31_MAXTEXT_TO_HF_PARAM_HOOK_FN(
        mm.hf_config(config), config, scan, saving_to_hf=False
    )
    out = {}
    for key, shape in targets.items():
        names = mapping[key]
        if isinstance(names, list):
            out[key] = to_maxtext._build_single_axis_stacked_tensor(
                names, stored.__getitem__, hooks.get(key), shape, config, key
            )
        else:
            out[key] = np.asarray(apply_hook_fns(stored[names], shape, hooks.get(key)))
    return out


def nnx_params(model) -> dict[str, jax.Array]:
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    return {".".join(map(str, p)): v.get_value() for p, v in flat}


def check(loaded: dict, want: dict, shardings: dict) -> list[str]:
    """Every way a loaded leaf differs from MaxText's conversion or placement."""
    problems = []
    for path, array in loaded.items():
        w = np.asarray(want[mt_key(path)])
        if (array.shape, array.dtype) != (w.shape, w.dtype):
            problems.append(f"{path}: {array.dtype}{array.shape}, MaxText {w.dtype}{w.shape}")
        elif np.asarray(array).tobytes() != w.tobytes():
            problems.append(f"{path}: values differ from MaxText's conversion")
        if array.sharding != shardings[path]:
            problems.append(f"{path}: placed on {array.sharding}, MaxText on {shardings[path]}")
    return problems


@LAYOUTS
def test_nnx_load_is_maxtexts_own_conversion_bit_for_bit(tmp_path, scan_layers):
    config = mm.tiny_config(scan_layers)
    mesh = mm.maxtext_mesh(config)
    rules = config.logical_axis_rules
    own = nnx_params(mm.maxtext_nnx_init(config, mesh))  # MaxText's own init: the anchor
    params = {mt_key(p): np.asarray(a) for p, a in own.items()}
    stored = write_hf_checkpoint(config, params, tmp_path / "model.safetensors")
    want = maxtext_conversion(config, stored, {k: v.shape for k, v in params.items()})

    factory = model_creation_utils.get_nnx_create_model_fn(config, mesh)
    with jax.set_mesh(mesh):
        plan = meshinit.nnx.plan(factory, rules=rules)
    with Reads() as reads:
        loaded = meshinit.safetensors.load(plan, tmp_path, names=mm.names_table(config))
    assert sorted(loaded) == sorted(own), "every Param of MaxText's model, and only those"
    problems = check(loaded, want, {p: a.sharding for p, a in own.items()})
    assert not problems, "\n".join(problems)
    assert reads.values == [owned_bytes(plan, 4, loaded)]  # bytes read == bytes owned

    with jax.set_mesh(mesh):  # the model, with the loaded weights, as MaxText builds it
        model = meshinit.nnx.init(factory, rules=rules, existing=loaded)
    for path, array in nnx_params(model).items():
        assert array is loaded[path], path


@LAYOUTS
def test_linen_load_is_maxtexts_own_conversion_bit_for_bit(tmp_path, scan_layers):
    config = mm.tiny_config(scan_layers)
    mesh = mm.maxtext_mesh(config)
    rules = config.logical_axis_rules
    model, args, kwargs = mm.linen_model_and_inputs(config, mesh)
    key, keys = mm.linen_keys(config)
    own = mm.maxtext_linen_init(config, mesh, model, key)
    boxed = lambda x: isinstance(x, nn.meta.AxisMetadata)  # noqa: E731
    arrays = {  # "params.decoder...": MaxText's variables hold the params collection
        ".".join(str(k.key) for k in p): (v.value if boxed(v) else v)
        for p, v in jax.tree_util.tree_flatten_with_path(own, is_leaf=boxed)[0]
    }
    params = {mt_key(p): np.asarray(a) for p, a in arrays.items()}
    stored = write_hf_checkpoint(config, params, tmp_path / "model.safetensors")
    want = maxtext_conversion(config, stored, {k: v.shape for k, v in params.items()})

    plan = meshinit.linen.plan(model, keys, *args, mesh=mesh, rules=rules, **kwargs)
    loaded = meshinit.safetensors.load(plan, tmp_path, names=mm.names_table(config, False))
    assert sorted(loaded) == sorted(arrays)
    problems = check(loaded, want, {p: a.sharding for p, a in arrays.items()})
    assert not problems, "\n".join(problems)

    variables = meshinit.linen.init(  # MaxText's variables, with the loaded weights
        model, keys, *args, mesh=mesh, rules=rules, existing=loaded, **kwargs
    )
    for p, v in jax.tree_util.tree_flatten_with_path(variables, is_leaf=boxed)[0]:
        path = ".".join(str(k.key) for k in p)
        assert (v.value if boxed(v) else v) is loaded[path], path


def test_scanned_nnx_load_onto_two_disjoint_stages(tmp_path):
    config = mm.tiny_config(True)
    mesh = mm.maxtext_mesh(config)
    rules = config.logical_axis_rules
    own = nnx_params(mm.maxtext_nnx_init(config, mesh))
    params = {mt_key(p): np.asarray(a) for p, a in own.items()}
    stored = write_hf_checkpoint(config, params, tmp_path / "model.safetensors")
    want = maxtext_conversion(config, stored, {k: v.shape for k, v in params.items()})

    devices = np.array(jax.devices())
    shape = tuple(2 if a in ("fsdp", "tensor") else 1 for a in mesh.axis_names)
    stage0 = jax.sharding.Mesh(devices[:4].reshape(shape), mesh.axis_names)
    stage1 = jax.sharding.Mesh(devices[4:].reshape(shape), mesh.axis_names)
    meshes = [(r"(token_embedder|decoder\.layers)\..*", stage0), (r".*", stage1)]
    factory = model_creation_utils.get_nnx_create_model_fn(config, mesh)
    with jax.set_mesh(mesh):
        plan = meshinit.nnx.plan(factory, rules=rules, meshes=meshes)
    loaded = meshinit.safetensors.load(plan, tmp_path, names=mm.names_table(config))
    by_path = {e.path: e.sharding for e in plan.entries}
    problems = check(loaded, want, by_path)
    assert not problems, "\n".join(problems)
    for path, array in loaded.items():
        stage = stage0 if path.startswith(("token_embedder", "decoder.layers")) else stage1
        assert array.sharding.mesh == stage, path
    with jax.set_mesh(mesh):
        model = meshinit.nnx.init(factory, rules=rules, meshes=meshes, existing=loaded)
    assert nnx_params(model).keys() == loaded.keys()


def test_benchmark_routes_give_the_same_model():
    """benchmarks/maxtext_load.py at one layer: MaxText's whole route (``to_maxtext``,
    its orbax save, ``from_pretrained``'s restore) and meshinit's load must leave every
    Param with the same bytes and the same sharding, through the hand-written table and
    through ``meshinit.maxtext.names``, each reading only the bytes it owns, or the
    script fails."""
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "maxtext_load.py"
    command = [sys.executable, str(script), "--layers", "1", "--repeats", "1"]
    r = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "every Param of the three models: same bytes, same sharding (12)" in r.stdout, r.stdout
    assert "hand-written: bytes read / owned = 1.000" in r.stdout, r.stdout
    assert "maxtext.names: bytes read / owned = 1.000" in r.stdout, r.stdout
