"""MaxText's own MaxText -> Hugging Face conversion as an export's recipes.

``meshinit.maxtext.names(config)`` given to :func:`meshinit.safetensors.save` writes
what MaxText's ``to_huggingface`` writes. :func:`recipes` reads MaxText's own maps,
as ``to_huggingface._get_model_mappings`` builds them: ``PARAM_MAPPING`` (a MaxText key
to an HF key, a list of them per layer or expert, nested lists for both, a tuple of
them that one hook splits into), ``HOOK_FNS(..., saving_to_hf=True)`` (numpy functions
``hook(x, target_shape)``, composite keys promoted) and ``HF_SHAPE`` (the stored
shapes); it cuts each parameter as ``utils.process_maxtext_param`` does: one recipe
per stored tensor, a scanned layer or an expert picked by its dynamic index (``at``),
so one build serves every layer. Each recipe's build runs as ``to_huggingface`` runs a
tensor: the parameter restored in MaxText's ``weight_dtype`` (floating ones), sliced,
the hooks applied, cast to ``weight_dtype`` and reshaped to the HF shape. The hooks
run as written, on :class:`~.held.Held` values (numpy's dtypes and bits on the
devices); a step they cannot follow exactly refuses the parameter by name, with its
hook, before anything runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..._errors import Problem
from ..layout.recipe import Recipe
from . import held as _held
from . import hooks as _hooks
from .framework import MissingKey
from .maxtext_config import hf_config, mismatches


@dataclasses.dataclass(frozen=True)
class Build:
    """One stored tensor made as ``to_huggingface`` makes it (a recipe's ``build``).

    Equal for every layer (or expert) of one MaxText key: the index is ``at``.

    Attributes:
      hooks: MaxText's hooks, applied in order (compared by identity: one map's).
      target: the ``target_shape`` the hooks are given (HF_SHAPE's, a tuple of shapes
        for a hook that splits one parameter into several tensors).
      shape: the stored shape (the result reshaped to it, as MaxText reshapes it).
      axes: the axis each dynamic index of ``at`` picks, in order (each after the ones
        before it are gone, as ``process_maxtext_param`` slices).
      part: of a hook that makes several tensors, which one.
      composite: the hooks take a list of parameters (a composite MaxText key).
      dtype: MaxText's ``weight_dtype``: floating parameters are restored in it, and
        every result cast to it.
    """

    hooks: tuple[Any, ...]
    target: Any
    shape: tuple[int, ...]
    axes: tuple[int, ...]
    part: int | None
    composite: bool
    dtype: np.dtype

    def __call__(self, arrays: tuple[jax.Array, ...], at: tuple[Any, ...]) -> jax.Array:
        xs = []
        for x in arrays:
            h = _held.Held(x)
            if _held.floating(h.dtype):  # restored as MaxText restores it
                h = _held.cast(h, self.dtype)
            for axis, i in zip(self.axes, at, strict=True):
                h = h._with(jax.lax.dynamic_index_in_dim(h.value, i, axis, keepdims=False))
            xs.append(h)
        made: Any = xs if self.composite else xs[0]
        target = _shown(self.target)
        for hook in self.hooks:
            made = _hooks.rebound(hook, _held.SPACES)(made, target)
        if self.part is not None:
            made = made[self.part]
        out = _held.value(made)
        out = _held.cast(out, self.dtype)  # convert_jax_weight_to_numpy's astype
        result = out.value.reshape(self.shape)
        # the stored bits stay as MaxText's, whatever the export does after (a cast)
        return _held.pinned(result) if out.rounded else result


def _shown(target: Any) -> Any:
    """A target shape as MaxText's maps give it (lists of ints)."""
    if target and isinstance(target[0], tuple):
        return [list(t) for t in target]
    return list(target)


def _frozen(target: Any) -> Any:
    if target and isinstance(target[0], list | tuple):
        return tuple(tuple(int(d) for d in t) for t in target)
    return tuple(int(d) for d in target)


def mt_key(path: str) -> str:
    """MaxText's conversion key of a plan path (nnx, or linen's ``params.``)."""
    return "params-" + path.removeprefix("params.").replace(".", "-")


def made_by_init(path: str, dtype: Any) -> bool:
    """A plan entry that is no weight: nnx's RNG state, a typed key or a stream's
    uint32 ``count``."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return True
    return np.dtype(dtype) == np.uint32 and path.rsplit(".", 1)[-1] == "count"


def named(hook: Any) -> str:
    """A hook (or MaxText's list of them, applied in order) as messages name it."""
    hooks = hook if isinstance(hook, list | tuple) else [hook]
    return ", ".join(getattr(h, "__name__", repr(h)) for h in hooks if h) or "(none)"


def recipes(
    config: Any,
    planned: Mapping[str, tuple[tuple[int, ...], Any]],
    files: Mapping[str, Any] | None,
    where: str,
) -> tuple[list[Recipe], list[Problem]]:
    """The recipes of MaxText's own HF export of ``planned`` (plan path -> shape and
    dtype) for MaxText's ``config``, whose HF ``config.json`` is ``files`` (the
    export's ``config=``, checked against ``config`` as ``to_huggingface`` checks it;
    None is refused); or every problem, each naming its parameter. ``where`` is how
    messages name the map."""
    from maxtext.checkpoint_conversion.utils import hf_shape, param_mapping, tensor_handling

    model = str(config.model_name)
    if model not in param_mapping.PARAM_MAPPING or model not in param_mapping.HOOK_FNS:
        known = ", ".join(sorted(set(param_mapping.PARAM_MAPPING) & set(param_mapping.HOOK_FNS)))
        return [], [Problem("", f"MaxText maps no {model!r} to Hugging Face; it maps {known}")]
    hf, fix, problems = _hf_config(model, files)
    if problems:
        return [], problems
    said = "config="
    problems = mismatches(hf, config, said)
    if problems:  # another model's config.json: written beside these weights, it would lie
        return [], problems
    shapes_of = _shapes_function(model, param_mapping, hf_shape)
    scan = bool(config.scan_layers)
    try:
        mapping = dict(param_mapping.PARAM_MAPPING[model](hf, config, scan))
        hooks = param_mapping.HOOK_FNS[model](hf, config, scan, saving_to_hf=True)
        shapes = shapes_of(hf) if shapes_of is not None else None
    except MissingKey as e:
        said_fix = fix.format(key=e.key)
        return [], [Problem(said, f"has no {e.key!r}, which {where} reads; {said_fix}")]
    except Exception as e:  # noqa: BLE001 - MaxText's own error, named
        return [], [Problem(said, f"{where} fails on it: {type(e).__name__}: {str(e)[:300]}")]
    if shapes is None:
        return [], [Problem("", f"{where}: MaxText keeps no Hugging Face shapes of {model!r}")]
    for key in [k for k in hooks if isinstance(k, tuple)]:  # _get_model_mappings' promotion
        if mapping.get(key[0]) is not None:
            mapping[key] = mapping[key[0]]
            for k in key:
                mapping.pop(k, None)
    by_key: dict[str, str] = {}
    for path, (_, dtype) in planned.items():
        if not made_by_init(path, dtype):
            by_key[mt_key(path)] = path
    covered = {k for key in mapping for k in (key if isinstance(key, tuple) else (key,))}
    problems = [
        Problem(path, f"{where} names no Hugging Face tensor for {key!r}")
        for key, path in by_key.items()
        if key not in covered
    ]
    out: list[Recipe] = []
    checked: dict[Any, str | None] = {}  # build -> why it cannot run
    weight = np.dtype(jnp.dtype(config.weight_dtype))
    multimodal = bool(getattr(config, "use_multimodal", False))
    for key, hf_paths in mapping.items():
        members = key if isinstance(key, tuple) else (key,)
        present = [k in by_key for k in members]
        if not any(present) or hf_paths is None:
            continue  # not in this model (MaxText's maps name variants), or not exported
        if not multimodal and any("vision_encoder" in k for k in members):
            continue  # to_huggingface skips the vision encoder of a text-only model
        if not all(present):
            lacking = ", ".join(repr(k) for k, p in zip(members, present, strict=True) if not p)
            hook_of = f"its hook {named(hooks.get(key))}"
            problems += [
                Problem(by_key[k], f"{where}: {hook_of} also reads {lacking}, not given")
                for k in members
                if k in by_key
            ]
            continue
        paths = tuple(by_key[k] for k in members)
        hook = hooks.get(key)
        chain = tuple(hook) if isinstance(hook, list) else (hook,) if hook is not None else ()
        made, wrong = _cut(
            key, hf_paths, paths, planned, shapes, chain, weight, config, tensor_handling
        )
        problems += wrong
        for recipe in made:
            if recipe.build not in checked:
                checked[recipe.build] = _checked(recipe, planned)
            why = checked[recipe.build]
            if why is not None:
                said_hook = f"hook {named(hook)} of {key!r}"
                problems += [Problem(p, f"{where}: {said_hook} {why}") for p in paths]
                break
            out.append(recipe)
    return ([] if problems else out), _unique(problems)


def _unique(problems: list[Problem]) -> list[Problem]:
    return list(dict.fromkeys(problems))


def _hf_config(model: str, files: Mapping[str, Any] | None) -> tuple[Any, str, list[Problem]]:
    """The HF config MaxText's maps read: ``files`` (``config=``, the config.json the
    export writes) as transformers fills it. Without one, nothing is guessed: MaxText's
    own config of ``model`` is named as the fix (what ``to_huggingface`` writes)."""
    if files is not None:
        return hf_config(files, "config=")
    fix = (
        f"pass config= (the config.json to write, of the model's sizes: MaxText's own is "
        f"maxtext.checkpoint_conversion.utils.hf_model_configs.HF_MODEL_CONFIGS"
        f"[{model!r}], with --override_model_architecture's sizes where they differ)"
    )
    return {}, "", [Problem("config=", f"MaxText's map of {model!r} reads the HF config: {fix}")]


def _shapes_function(model: str, param_mapping: Any, hf_shape: Any) -> Any:
    """``HF_SHAPE[model]``, or where MaxText keeps none for it (``qwen3-1.7b``), that of
    a name with the same map and hooks."""
    if model in hf_shape.HF_SHAPE:
        return hf_shape.HF_SHAPE[model]
    for name, shapes in hf_shape.HF_SHAPE.items():
        same_map = param_mapping.PARAM_MAPPING.get(name) is param_mapping.PARAM_MAPPING[model]
        if same_map and param_mapping.HOOK_FNS.get(name) is param_mapping.HOOK_FNS[model]:
            return shapes
    return None


def _cut(
    key: Any,
    hf_paths: Any,
    paths: tuple[str, ...],
    planned: Mapping[str, tuple[tuple[int, ...], Any]],
    shapes: Mapping[Any, Any],
    chain: tuple[Any, ...],
    weight: np.dtype,
    config: Any,
    tensor_handling: Any,
) -> tuple[list[Recipe], list[Problem]]:
    """The recipes of one MaxText key, cut as ``process_maxtext_param`` cuts it."""
    composite = isinstance(key, tuple)
    origin = " + ".join(paths)
    made: list[Recipe] = []
    problems: list[Problem] = []

    def leaf(hf_path: Any, axes: tuple[int, ...], at: tuple[int, ...]) -> None:
        if hf_path not in shapes:
            problems.append(
                Problem(paths[0], f"MaxText's HF_SHAPE has no {hf_path!r}, which {key!r} maps to")
            )
            return
        target = _frozen(shapes[hf_path])
        names = hf_path if isinstance(hf_path, tuple) else (hf_path,)
        cut = f"[{', '.join(map(str, at))}]" if at else ""
        for j, name in enumerate(names):
            stored = target[j] if isinstance(hf_path, tuple) else target
            part = j if isinstance(hf_path, tuple) else None
            build = Build(chain, target, tuple(stored), axes, part, composite, weight)
            made.append(Recipe(name, tuple(stored), weight, paths, at, build, origin + cut))

    if not isinstance(hf_paths, list):
        leaf(hf_paths, (), ())
    elif not isinstance(hf_paths[0], list):
        ndim = len(planned[paths[0]][0])
        psa = config.param_scan_axis
        axis = (psa if ndim > psa else 0) if config.scan_layers else 0
        for i, hf_path in enumerate(hf_paths):
            leaf(hf_path, (axis,), (i,))
    else:
        depth = tensor_handling.nesting_depth(hf_paths)
        stacked = tensor_handling.stacked_axes(key[0] if composite else key, config, depth)
        axes = tuple(a - level for level, a in enumerate(stacked))

        def emit(sub: Any, level: int, at: tuple[int, ...]) -> None:
            if level == depth:
                leaf(sub, axes, at)
                return
            for i, s in enumerate(sub):
                emit(s, level + 1, (*at, i))

        emit(hf_paths, 0, ())
    return made, problems


def _checked(recipe: Recipe, planned: Mapping[str, tuple[tuple[int, ...], Any]]) -> str | None:
    """Why ``recipe``'s build cannot run (traced on abstract values), or None."""
    arrays = tuple(jax.ShapeDtypeStruct(planned[p][0], planned[p][1]) for p in recipe.paths)
    at = tuple(jax.ShapeDtypeStruct((), np.int32) for _ in recipe.at)
    try:
        got = jax.eval_shape(recipe.build, arrays, at)
    except _held.Unfollowable as e:
        return f"needs {e}, which cannot be followed exactly on the devices"
    except Exception as e:  # noqa: BLE001 - what the hook did instead, named
        return f"fails on the parameter: {type(e).__name__}: {str(e)[:300]}"
    if tuple(got.shape) != recipe.shape or np.dtype(got.dtype) != recipe.dtype:
        return f"makes {got.dtype}{tuple(got.shape)}, not {recipe.dtype}{recipe.shape}"
    return None
