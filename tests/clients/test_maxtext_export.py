"""``meshinit.maxtext.names(config)`` on export: what MaxText's own ``to_huggingface``
writes, family by family, bit for bit.

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
3. the recipes of ``names(config).saving(planned, config=)``, each build jitted on the
   sharded arrays: every stored tensor must have step 2's name, shape, dtype and bytes,
   and each MaxText key's layers share one build (the compiles do not grow with depth).

A hook the export cannot follow exactly is refused by name, before anything runs.

MaxText needs Python 3.12 and jax >= 0.11.1; the module is skipped where it is missing.
"""

import dataclasses
import functools
import unittest.mock

import pytest

maxtext = pytest.importorskip(
    "maxtext", reason="MaxText is not installed (it needs Python 3.12 and jax >= 0.11.1)"
)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import maxtext_models as mm  # noqa: E402
import numpy as np  # noqa: E402
from maxtext.checkpoint_conversion import to_huggingface  # noqa: E402
from maxtext.checkpoint_conversion.utils import hf_shape, param_mapping  # noqa: E402
from maxtext.checkpoint_conversion.utils.utils import (  # noqa: E402
    validate_and_filter_param_map_keys,
)

import meshinit  # noqa: E402
import meshinit.maxtext  # noqa: E402
from clients.test_maxtext_names import (  # noqa: E402
    SCANS,
    TINY,
    completed,
    hf_config,
    nnx_placement,
    shaped,
)
from meshinit.maxtext import mt_key  # noqa: E402

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


def exported(recipes, arrays: dict[str, jax.Array]) -> dict[str, np.ndarray]:
    """Each recipe's build jitted (one program per distinct build) and run on the
    parameters, each layer's index passed at run time."""
    programs: dict = {}
    out = {}
    for r in recipes:
        program = programs.setdefault(r.build, jax.jit(r.build))
        at = tuple(np.int32(i) for i in r.at)
        out[r.name] = np.asarray(program(tuple(arrays[p] for p in r.paths), at))
    return out


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
def test_export_is_maxtexts_own_to_huggingface_bit_for_bit(model, scan):
    case = case_of(model, scan)
    assert np.dtype(jnp.dtype(case.config.weight_dtype)) == np.dtype(jnp.bfloat16)
    recipes = case.recipes()
    got = exported(recipes, case.arrays())
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
def test_the_builds_do_not_grow_with_depth(scan):
    builds = {}
    for layers in (2, 4):
        recipes = case_of("llama3.1-8b", scan, layers).recipes()
        builds[layers] = {r.build for r in recipes}
        assert len(recipes) == 3 + 9 * layers
    assert len(builds[2]) == len(builds[4]) <= 9


SUBNORMAL = [1e-40, -1e-39, 9e-39, 5e-39]


def test_subnormals_are_flushed_by_the_query_scale_as_to_huggingface_flushes_them():
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
    got = exported(case.recipes(), case.arrays(params))
    on_jax = {k: jnp.asarray(v) for k, v in params.items()}
    want = to_huggingface_of(case.model, case.config, case.hf, on_jax)
    assert not differences(got, want), "\n".join(differences(got, want))
    on_host = to_huggingface_of(case.model, case.config, case.hf, params)
    assert differences(got, on_host) == [
        "model.layers.0.self_attn.q_proj.weight: 4 elements differ from MaxText's"
    ]


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


def test_without_config_maxtexts_own_hf_config_must_be_of_the_models_sizes():
    case = case_of("llama3.1-8b", True)
    recipes, problems = meshinit.maxtext.names(case.config).saving(case.planned, None)
    assert recipes == [] and problems
    assert all("pass config=" in p.message for p in problems)
    assert "config.json says hidden_size=4096, MaxText's config emb_dim=64" in str(problems[0])


def test_a_model_maxtext_does_not_map_is_refused_by_name():
    config = mm.tiny_config(True, 2, model_name="llama2-7b", weight_dtype="bfloat16")
    recipes, problems = meshinit.maxtext.names(config).saving({}, {})
    assert recipes == []
    assert [p.message.split(";")[0] for p in problems] == [
        "MaxText maps no 'llama2-7b' to Hugging Face"
    ]
