"""``meshinit.maxtext.names(config)`` on export: what MaxText's own ``to_huggingface``
writes, family by family, bit for bit; loaded back by meshinit and by transformers.

For each family (llama3, qwen3 dense and MoE, gemma3, deepseek3, gpt-oss), scanned and
unrolled, in bfloat16 (``weight_dtype``, as MaxText's trained models are):

1. seeded random values in MaxText's own NNX placement (the shapes, dtypes and
   shardings its init gives every Param; random, not the init's ones and zeros, so
   that a swap or a missing offset shows);
2. MaxText's own MaxText -> HF conversion of them: ``to_huggingface``'s functions as
   its ``main`` calls them (``_get_model_mappings``, ``validate_and_filter_param_map_keys``,
   ``_transform_weights_to_full_model``: ``process_maxtext_param``, ``HOOK_FNS`` with
   ``saving_to_hf=True``, ``HF_SHAPE``), once on jax arrays (as ``to_huggingface``
   restores them) and once on host numpy arrays;
3. ``meshinit.safetensors.save(arrays, dest, names=meshinit.maxtext.names(config),
   config=...)`` of the sharded arrays: every stored tensor must have step 2's name,
   shape, dtype and bytes, and each MaxText key's layers share one program (the
   compiles do not grow with depth).

Then the way round: a Hugging Face checkpoint loaded by ``meshinit.safetensors.load``
into MaxText's model and exported again gives back its files' bytes wherever MaxText's
hooks are layouts (and MaxText's own round trip elsewhere); and transformers'
``from_pretrained`` loads the export of a tiny Llama and a tiny Qwen3, bfloat16 and
``quantize="fp8"`` (which, on a machine without a GPU, transformers dequantizes as it
loads), with no key missing or unexpected and the files' values.

A hook the export cannot follow exactly is refused by name, before anything runs.

MaxText needs Python 3.12 and jax >= 0.11.1; the module is skipped where it is missing.
"""

import dataclasses
import functools
import json
import re
import unittest.mock

import pytest

maxtext = pytest.importorskip(
    "maxtext", reason="MaxText is not installed (it needs Python 3.12 and jax >= 0.11.1)"
)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import maxtext_models as mm  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from maxtext.checkpoint_conversion import to_huggingface  # noqa: E402
from maxtext.checkpoint_conversion.utils import hf_shape, param_mapping  # noqa: E402
from maxtext.checkpoint_conversion.utils.utils import (  # noqa: E402
    validate_and_filter_param_map_keys,
)
from safetensors import safe_open  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

import meshinit  # noqa: E402
import meshinit.maxtext  # noqa: E402
from clients.test_maxtext_names import (  # noqa: E402
    SCANS,
    TINY,
    completed,
    hf_config,
    maxtext_conversion,
    nnx_placement,
    plan_and_placement,
    shaped,
    write_checkpoint,
)
from meshinit.maxtext import mt_key  # noqa: E402

torch = pytest.importorskip("torch", reason="transformers' loads of the export need torch")

pytestmark = pytest.mark.slow

EXPORTED = [
    "llama3.1-8b",
    "qwen3-8b",
    "qwen3-30b-a3b",
    "gemma3-4b",
    "deepseek3-671b",
    "gpt-oss-20b",
]


def config_of(model: str, scan: bool, layers: int | None = None, **more):
    tiny = TINY[model]
    return mm.tiny_config(
        scan,
        layers or tiny.layers,
        model_name=model,
        weight_dtype="bfloat16",
        **tiny.overrides,
        **more,
    )


def seeded(placement: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """MaxText key -> seeded random values of each Param's shape and dtype."""
    rng = np.random.default_rng(seed)
    return {mt_key(p): rng.standard_normal(a.shape).astype(a.dtype) for p, a in placement.items()}


def to_huggingface_of(model: str, config, hf: dict, state: dict) -> dict[str, np.ndarray]:
    """MaxText's own ``to_huggingface`` of ``state`` (MaxText key -> array), as its
    ``main`` runs it once the checkpoint is restored: its mappings, its key filter, its
    vision filter, its transform (hooks, slicing, cast to ``weight_dtype``)."""
    maps = to_huggingface._get_model_mappings(shaped(model), config.scan_layers, hf, config)
    if maps["shape_mapping"] is None:  # qwen3-next: MaxText's function lacks its return
        maps["shape_mapping"] = completed(hf_shape.HF_SHAPE[shaped(model)])(hf)
    keys = validate_and_filter_param_map_keys(maps["param_mapping"], set(state))
    keys = [k for k in keys if "vision_encoder" not in str(k)]
    # its gc.collect() after each key, which only frees memory, took 0.4 s a key here
    with unittest.mock.patch.object(to_huggingface.gc, "collect", lambda *_: 0):
        out = to_huggingface._transform_weights_to_full_model(
            config,
            keys,
            dict(state),
            maps["param_mapping"],
            maps["hook_fn_mapping"],
            maps["shape_mapping"],
        )
    return {k: np.ascontiguousarray(np.asarray(v)) for k, v in out.items()}


def saved(case: "Case", dest, params: dict | None = None, **kwargs) -> dict[str, np.ndarray]:
    """``meshinit.safetensors.save`` of the case's sharded arrays, with MaxText's
    names and its HF config; the tensors of the files it wrote."""
    meshinit.safetensors.save(
        case.arrays(params),
        dest,
        names=meshinit.maxtext.names(case.config),
        config=case.hf,
        **kwargs,
    )
    return files_in(dest)


def files_in(folder) -> dict[str, np.ndarray]:
    """Every tensor of a folder's safetensors files, float8 and bfloat16 included."""
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no iteration
                out[name] = as_numpy(f.get_tensor(name))
    return out


def as_numpy(x) -> np.ndarray:
    """A torch tensor's values as numpy (float8 and bfloat16 through ml_dtypes)."""
    kinds = {
        torch.float8_e4m3fn: (torch.uint8, ml_dtypes.float8_e4m3fn),
        torch.bfloat16: (torch.int16, ml_dtypes.bfloat16),
    }
    if x.dtype in kinds:
        bits, dtype = kinds[x.dtype]
        return x.contiguous().view(bits).numpy().view(dtype)
    return x.numpy()


def differences(got: dict, want: dict) -> list[str]:
    problems = [f"{n}: not exported" for n in sorted(set(want) - set(got))]
    problems += [f"{n}: exported, MaxText writes no such tensor" for n in set(got) - set(want)]
    for name in sorted(set(got) & set(want)):
        g, w = got[name], want[name]
        if (g.dtype, g.shape) != (w.dtype, w.shape):
            problems.append(f"{name}: {g.dtype}{g.shape}, MaxText {w.dtype}{w.shape}")
        elif g.tobytes() != w.tobytes():
            problems.append(f"{name}: {(g != w).sum()} elements differ from MaxText's")
    return problems


@dataclasses.dataclass
class Case:
    model: str
    config: object
    hf: dict
    placement: dict
    params: dict

    @property
    def planned(self) -> dict:
        return {p: (tuple(a.shape), np.dtype(a.dtype)) for p, a in self.placement.items()}

    def arrays(self, params: dict | None = None) -> dict[str, jax.Array]:
        """The parameters on MaxText's own shardings."""
        params = self.params if params is None else params
        return {p: jax.device_put(params[mt_key(p)], a.sharding) for p, a in self.placement.items()}

    def recipes(self):
        recipes, problems = meshinit.maxtext.names(self.config).saving(self.planned, self.hf)
        assert not problems, "\n".join(map(str, problems))
        return recipes


@functools.cache
def case_of(model: str, scan: bool, layers: int | None = None) -> Case:
    """One family's tiny model, its placement and seeded values (made once: read only)."""
    config = config_of(model, scan, layers)
    placement = nnx_placement(config, mm.maxtext_mesh(config))
    hf = hf_config(model, config)
    return Case(model, config, hf, placement, seeded(placement))


@pytest.mark.parametrize("scan", [True, False], ids=SCANS.get)
@pytest.mark.parametrize("model", EXPORTED)
def test_export_is_maxtexts_own_to_huggingface_bit_for_bit(tmp_path, model, scan):
    case = case_of(model, scan)
    assert np.dtype(jnp.dtype(case.config.weight_dtype)) == np.dtype(jnp.bfloat16)
    recipes = case.recipes()
    got = saved(case, tmp_path / "export")
    on_jax = {k: jnp.asarray(v) for k, v in case.params.items()}  # as to_huggingface restores
    want = to_huggingface_of(model, case.config, case.hf, on_jax)
    assert not differences(got, want), "\n".join(differences(got, want))
    on_host = to_huggingface_of(model, case.config, case.hf, case.params)  # numpy arrays
    assert not differences(got, on_host), "\n".join(differences(got, on_host))
    # each MaxText key: one build for every layer and expert (an index picks it at run time)
    keys = {r.paths for r in recipes}
    parts = {(r.paths, r.build.part) for r in recipes}
    assert len({(r.paths, r.build) for r in recipes}) == len(parts) >= len(keys)
    assert all(r.shape == want[r.name].shape and r.dtype == want[r.name].dtype for r in recipes)


@pytest.mark.parametrize("scan", [True, False], ids=SCANS.get)
def test_the_compiles_do_not_grow_with_depth(tmp_path, count_compiles, scan):
    builds, compiles = {}, {}
    for layers in (2, 4):
        case = case_of("llama3.1-8b", scan, layers)
        recipes = case.recipes()
        builds[layers] = {r.build for r in recipes}
        assert len(recipes) == 3 + 9 * layers
        meshinit.clear_cache()  # the export's programs: each depth compiles its own
        with count_compiles() as counted:
            written = saved(case, tmp_path / f"{layers}")
        compiles[layers] = counted.count
        assert len(written) == len(recipes)
    assert len(builds[2]) == len(builds[4]) <= 9
    assert compiles[2] == compiles[4], "one program per MaxText key, whatever the depth"


SUBNORMAL = [1e-40, -1e-39, 9e-39, 5e-39]


def test_subnormals_are_flushed_by_the_query_scale_as_to_huggingface_flushes_them(tmp_path):
    """MaxText's Llama query hook scales by sqrt(head_dim) (arithmetic): XLA flushes
    subnormal values to zero, on the devices and in ``to_huggingface`` (jax arrays)
    alike, where numpy on the host keeps them (unrolled: ``process_maxtext_param``
    hands a host array to the hooks as it is). Layout hooks move them as they are."""
    case = case_of("llama3.1-8b", False)
    params = dict(case.params)
    for key in (
        "params-decoder-layers_0-self_attention-query-kernel",
        "params-decoder-layers_0-self_attention-value-kernel",
    ):
        planted = params[key].copy()
        planted.reshape(-1)[:4] = np.asarray(SUBNORMAL, np.float32).astype(planted.dtype)
        params[key] = planted
    got = saved(case, tmp_path / "export", params)
    on_jax = {k: jnp.asarray(v) for k, v in params.items()}
    want = to_huggingface_of(case.model, case.config, case.hf, on_jax)
    assert not differences(got, want), "\n".join(differences(got, want))
    on_host = to_huggingface_of(case.model, case.config, case.hf, params)
    assert differences(got, on_host) == [
        "model.layers.0.self_attn.q_proj.weight: 4 elements differ from MaxText's"
    ]


# ---- the way round: meshinit's load, then its export

# the stored tensors whose hooks do arithmetic that a round trip does not undo
# bit for bit: Gemma 3's norms are stored less one and kept plus one (in bfloat16).
# (Llama's query is scaled by sqrt(head_dim) = 4 here and Gemma 3's embedding by
# sqrt(64) = 8: powers of two, undone exactly.)
NOT_UNDONE = {"gemma3-4b": r"norm\.weight$"}


@pytest.mark.parametrize("scan", [True, False], ids=SCANS.get)
@pytest.mark.parametrize("model", EXPORTED)
def test_a_load_then_an_export_gives_back_the_files(tmp_path, model, scan):
    """A Hugging Face checkpoint of seeded values (MaxText's names and shapes, values
    never through MaxText), loaded into MaxText's model by meshinit and exported
    again: the same bytes in every tensor MaxText's hooks only lay out, and in every
    tensor MaxText's own round trip (its HF -> MaxText conversion, then its
    ``to_huggingface``)."""
    case = case_of(model, scan)
    shapes = write_checkpoint(model, case.config, case.params, tmp_path / "made")
    rng = np.random.default_rng(1)
    files = {k: rng.standard_normal(v.shape).astype(v.dtype) for k, v in shapes.items()}
    (tmp_path / "hf").mkdir()
    save_file(files, str(tmp_path / "hf" / "model.safetensors"))
    (tmp_path / "hf" / "config.json").write_text((tmp_path / "made" / "config.json").read_text())
    plan, placement = plan_and_placement(case.config, "nnx")
    names = meshinit.maxtext.names(case.config)
    loaded = meshinit.safetensors.load(plan, tmp_path / "hf", names=names)
    meshinit.safetensors.save(loaded, tmp_path / "out", names=names, config=case.hf)
    got = files_in(tmp_path / "out")
    targets = {mt_key(p): a.shape for p, a in placement.items()}
    mt = maxtext_conversion(model, case.config, files, targets)
    round_trip = to_huggingface_of(
        model, case.config, case.hf, {k: jnp.asarray(v) for k, v in mt.items()}
    )
    assert not differences(got, round_trip), "\n".join(differences(got, round_trip))
    changed = [d.split(":")[0] for d in differences(got, files)]
    pattern = NOT_UNDONE.get(model)
    assert all(pattern and re.search(pattern, n) for n in changed), changed
    if pattern:  # the norms' values do change (else the list above says nothing)
        assert changed


# ---- transformers' from_pretrained

LOADED_BY_TRANSFORMERS = ["llama3.1-8b", "qwen3-8b"]


def dequantized(files: dict, name: str) -> np.ndarray:
    """A stored weight's values: float8 times its block's scale (DeepSeek's
    ``weight_dequant``: float32, then bfloat16), or the tensor as it is."""
    w = files[name]
    scale = files.get(f"{name}_scale_inv")
    if scale is None:
        return w
    rows, cols = w.shape
    blocks = np.repeat(np.repeat(scale, 128, axis=0)[:rows], 128, axis=1)[:, :cols]
    return (w.astype(np.float32) * blocks).astype(ml_dtypes.bfloat16)


@pytest.mark.parametrize("quantize", [None, "fp8"], ids=["bfloat16", "fp8"])
@pytest.mark.parametrize("model", LOADED_BY_TRANSFORMERS)
def test_transformers_loads_the_export_with_every_key_and_its_values(tmp_path, model, quantize):
    transformers = pytest.importorskip("transformers")
    case = case_of(model, True)
    files = saved(case, tmp_path / "export", quantize=quantize)
    options = {}
    if quantize == "fp8":  # dequantized as it loads: FP8 kernels need a GPU (none here)
        options["quantization_config"] = transformers.FineGrainedFP8Config(dequantize=True)
        said = json.loads((tmp_path / "export" / "config.json").read_text())
        assert said["quantization_config"]["quant_method"] == "fp8"
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "export", dtype=torch.bfloat16, output_loading_info=True, **options
    )
    assert {k: v for k, v in info.items() if v} == {}, "no key missing, unexpected or mismatched"
    state = loaded.state_dict()
    assert sorted(state) == sorted(n for n in files if not n.endswith("_scale_inv"))
    wrong = [
        n for n, t in state.items() if as_numpy(t).tobytes() != dequantized(files, n).tobytes()
    ]
    assert wrong == []
    scaled = [n for n in files if n.endswith("_scale_inv")]
    if quantize == "fp8":  # transformers read each block's scale: not a plain cast
        assert len(scaled) == 7 * case.config.num_decoder_layers
        for name in (n.removesuffix("_scale_inv") for n in scaled):
            plain = files[name].astype(ml_dtypes.bfloat16)
            assert as_numpy(state[name]).tobytes() != plain.tobytes(), name
    else:
        assert scaled == []


# ---- refused by name


def one_hook_replaced(monkeypatch, model: str, key: str, hook):
    real = param_mapping.HOOK_FNS[model]

    def hooks(*args, **kwargs):
        made = dict(real(*args, **kwargs))
        made[key] = hook
        return made

    monkeypatch.setitem(param_mapping.HOOK_FNS, model, hooks)


def doubled_in_float64(x, target_shape):
    return (x * np.float64(2.0)).reshape(np.flip(np.array(target_shape))).T


def signs(x, target_shape):
    return (x > 0).reshape(np.flip(np.array(target_shape))).T


@pytest.mark.parametrize(
    ("hook", "said"),
    [
        (doubled_in_float64, "np.multiply that numpy computes in float64 and jax in float32"),
        (signs, "a comparison of the tensor's values"),
    ],
)
def test_a_hook_it_cannot_follow_exactly_is_refused_naming_the_parameter(monkeypatch, hook, said):
    case = case_of("llama3.1-8b", True)
    key = "params-decoder-layers-self_attention-value-kernel"
    one_hook_replaced(monkeypatch, case.model, key, hook)
    recipes, problems = meshinit.maxtext.names(case.config).saving(case.planned, case.hf)
    assert recipes == []
    assert [str(p) for p in problems] == [
        f"decoder.layers.self_attention.value.kernel: MaxText 0.2.5's map of 'llama3.1-8b': "
        f"hook {hook.__name__} of {key!r} needs {said}, which cannot be followed exactly "
        f"on the devices"
    ]


def test_a_composite_key_given_in_part_is_refused_naming_what_it_lacks():
    case = case_of("gpt-oss-20b", False)
    planned = dict(case.planned)
    del planned["decoder.layers_0.GptOssMlp.wi_1"]
    recipes, problems = meshinit.maxtext.names(case.config).saving(planned, case.hf)
    assert recipes == []
    assert [str(p) for p in problems] == [
        "decoder.layers_0.GptOssMlp.wi_0: MaxText 0.2.5's map of 'gpt-oss-20b': its hook "
        "interleave also reads 'params-decoder-layers_0-GptOssMlp-wi_1', not given"
    ]


def test_a_parameter_the_map_does_not_name_is_refused():
    case = case_of("llama3.1-8b", True)
    planned = case.planned | {"decoder.extra.kernel": ((4, 4), np.dtype(jnp.bfloat16))}
    recipes, problems = meshinit.maxtext.names(case.config).saving(planned, case.hf)
    assert recipes == []
    assert [str(p) for p in problems] == [
        "decoder.extra.kernel: MaxText 0.2.5's map of 'llama3.1-8b' names no Hugging Face "
        "tensor for 'params-decoder-extra-kernel'"
    ]


def test_without_config_the_export_is_refused_naming_maxtexts_own(tmp_path):
    case = case_of("llama3.1-8b", True)
    recipes, problems = meshinit.maxtext.names(case.config).saving(case.planned, None)
    assert recipes == []
    assert [p.path for p in problems] == ["config="]
    assert "HF_MODEL_CONFIGS['llama3.1-8b']" in problems[0].message
    with pytest.raises(meshinit.PlanError, match=r"config=: MaxText's map of 'llama3.1-8b'"):
        meshinit.safetensors.save(
            case.arrays(), tmp_path, names=meshinit.maxtext.names(case.config)
        )


def test_a_config_of_other_sizes_is_refused_field_by_field():
    case = case_of("llama3.1-8b", True)
    other = dict(case.hf, hidden_size=128, num_attention_heads=8)
    recipes, problems = meshinit.maxtext.names(case.config).saving(case.planned, other)
    assert recipes == []
    assert [p.message.split(":")[0] for p in problems] == [
        "config.json says hidden_size=128, MaxText's config emb_dim=64",
        "config.json says num_attention_heads=8, MaxText's config num_query_heads=4",
    ]


def test_a_model_maxtext_does_not_map_is_refused_by_name():
    config = mm.tiny_config(True, 2, model_name="llama2-7b", weight_dtype="bfloat16")
    recipes, problems = meshinit.maxtext.names(config).saving({}, {})
    assert recipes == []
    assert [p.message.split(";")[0] for p in problems] == [
        "MaxText maps no 'llama2-7b' to Hugging Face"
    ]
