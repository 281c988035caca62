"""tunix's own safetensors map as ``names=`` of :func:`meshinit.safetensors.load`.

google-tunix keeps, for each model family, a map from Hugging Face tensor names to its
nnx parameters: ``_get_key_and_transform_mapping(cfg)`` (a regex -> an nnx path
template and a ``(permute, reshape)`` transform, transpose first) and, for some
families, a preprocess step over the mapped arrays (Qwen3's ``_stack_experts``,
Gemma's ``_make_preprocess_fn(cfg)`` fusing q, k and v). :func:`names` reads that map
at load time, from the installed tunix, for the checkpoint's own tensors::

    plan = meshinit.nnx.plan(lambda: tunix_model(cfg, rngs=nnx.Rngs(params=0)))
    loaded = meshinit.safetensors.load(plan, folder, names=meshinit.tunix.names(cfg))

Each stored tensor goes through tunix's own regex match (``torch_key_to_jax_key``)
and transform; the preprocess step is run by jax on abstract values (no data) and
followed operation by operation on stand-ins of the stored tensors
(:mod:`meshinit._checkpoint.maps.trace`, through :mod:`meshinit._checkpoint.maps.traced`). What
tunix asks that a
target cannot express is a problem naming the parameter, and any problem refuses the
whole map before a byte is read. tunix is imported only when a table is built.

On export (:func:`meshinit.safetensors.save` with the same ``names=``), the map is read
from the parameters' side (:mod:`meshinit._checkpoint.maps.inverse`): the stored names
written from tunix's regexes, their shapes by its transforms undone and its
preprocess step followed, then the table the load would build for those tensors read
in reverse; what does not invert is refused naming the parameter.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable, Mapping
from importlib import metadata
from typing import Any

import jax
import numpy as np

from ._checkpoint.encodings.fp8 import pairing as _quantized
from ._checkpoint.layout import parts as _parts
from ._checkpoint.layout.recipe import Recipe
from ._checkpoint.maps import framework as _framework
from ._checkpoint.maps import inverse as _inverse
from ._checkpoint.maps import trace as _trace
from ._checkpoint.maps import traced as _traced
from ._checkpoint.maps.framework import Checkpoint, FrameworkMap
from ._checkpoint.maps.names import Target
from ._checkpoint.store.header import READABLE
from ._checkpoint.write import reverse as _reverse
from ._errors import Problem

__all__ = ["names"]

TESTED = "0.1.7"
"""The google-tunix version whose maps meshinit's tests compare with tunix's loader."""

# family -> the module of tunix's safetensors loader (gemma's params.py reads Kaggle's)
_LOADERS = {
    "gemma": "params_safetensors",
    "gemma3": "params_safetensors",
    "llama3": "params",
    "qwen2": "params",
    "qwen3": "params",
}
_KEY_MAP = "_get_key_and_transform_mapping"
# tunix's preprocess steps: a function of the mapped arrays, or made from the config
_PREPROCESS = {"_stack_experts": False, "_make_preprocess_fn": True}
# what else a loader may call: Gemma's reads the vocabulary size from the files (the
# plan's own is then checked against the stored shapes)
_HELPERS = {"_peek_vocab_size_from_safetensors"}
_UNUSED = "unused."  # the prefix of tunix's names for tensors its loaders drop


def names(model_config: Any) -> FrameworkMap:
    """tunix's safetensors map for ``model_config``'s family, as ``names=``.

    The table is built when :func:`meshinit.safetensors.load` (or ``inventory``) has
    checked the files: for each stored tensor, tunix's own regex map gives the nnx
    path and the transpose-then-reshape, which become a
    :class:`~meshinit.safetensors.Tensor` (reshape, permute and merge of the stored
    axes: the same values); tunix's preprocess step is followed on abstract values,
    its stacks of experts becoming a :class:`~meshinit.safetensors.Stack` and its
    fused q/k/v einsums a ``Stack`` of transposed tensors. Values are cast to the
    planned dtype (tunix keeps the file's unless its loader is given ``dtype=``).

    Families: ``llama3``, ``qwen2``, ``qwen3`` (dense and MoE), ``gemma`` and
    ``gemma3``, as google-tunix 0.1.7 has them (another version is read if its map
    has the same form, and named in every message). Refused, as problems naming the
    parameter, all before any read: another family; a map entry not of the form
    ``regex -> (template, None or (permute, reshape))``; a transform or preprocess
    operation no target expresses (a reshape that cuts an axis unevenly, a
    broadcast, arithmetic); a preprocess step or loader call meshinit does not know;
    a stored tensor tunix maps to a path the plan does not have, or two to one path;
    and a planned parameter that no stored tensor fills; where the files have a
    ``config.json``, each size it states (hidden, intermediate or expert width,
    heads, KV heads, head_dim, layers, experts) that differs from ``model_config``'s
    (files of 4 heads of 32 fit a model of 8 heads of 16 in every shape). Tensors that tunix's map
    does not match, or sends to its ``unused.`` names, are left unread (and named by
    ``unused=``). Plan paths of nnx RNG state (typed keys, uint32 counts) map to
    None: made by the init.

    As ``names=`` of :func:`meshinit.safetensors.save`, it writes the tensors it would
    read: each name from tunix's regex with the parameter's groups (an optional group
    left out, an unused alternation its first spelling), checked by tunix's own
    matcher; each shape by tunix's transform undone (a reshape's stored axes are its
    runs beside the model's width, as Hugging Face stores a projection); the inputs of
    its preprocess step enumerated over ``num_layers`` and ``num_experts`` and their
    shapes read off its outputs. Refused by name: a parameter no entry writes (LoRA
    factors), a reshape whose stored axes are not known (a head_dim equal to the
    width), a regex that is not one name, a step that is not a layout, and a
    ``config=`` of other sizes than ``model_config``.

    Args:
      model_config: a tunix ``ModelConfig`` (``tunix.models.<family>.model``), the
        one the plan's model is built from.

    Returns:
      A :class:`meshinit.safetensors.FrameworkMap` for ``names=``; its table is
      shown by ``meshinit.safetensors.inventory(...).table``.

    Examples:
      >>> from tunix.models.qwen3 import model as qwen3  # doctest: +SKIP
      >>> cfg = qwen3.ModelConfig.qwen3_0p6b()  # doctest: +SKIP
      >>> factory = lambda: qwen3.Qwen3(cfg, rngs=nnx.Rngs(params=0))  # doctest: +SKIP
      >>> plan = meshinit.nnx.plan(factory)  # doctest: +SKIP
      >>> loaded = meshinit.safetensors.load(
      ...     plan, "Qwen3-0.6B/", names=meshinit.tunix.names(cfg))  # doctest: +SKIP

      (It needs google-tunix, on Python 3.12, and a downloaded checkpoint: not run
      in the doctests; ``tests/clients/test_tunix_names.py`` runs it against tunix's loader.)
    """
    return _TunixMap(model_config)


class _TunixMap(FrameworkMap):
    """tunix's map of one model config (what :func:`names` returns)."""

    needs_config = False  # tunix's map needs the ModelConfig, not config.json

    def __init__(self, model_config: Any):
        self.model_config = model_config
        module = type(model_config).__module__
        found = re.fullmatch(r"tunix\.models\.(\w+)\.model", module)
        self.kind = found.group(1) if found else None
        self.described = self.kind or f"{module}.{type(model_config).__qualname__}"

    def __repr__(self) -> str:
        return f"meshinit.tunix.names(<{self.described} {type(self.model_config).__qualname__}>)"

    @property
    def family(self) -> str:
        return f"{_version()}'s {self.described} map"

    def _unread(self, doing: str) -> list[Problem]:
        """The problem of a config whose family meshinit does not read (none if it does)."""
        if self.kind in _LOADERS:
            return []
        why = (
            f"{type(self.model_config).__qualname__} from {self.described} is not a "
            f"tunix ModelConfig"
            if self.kind is None
            else f"meshinit reads tunix's map of {', '.join(sorted(_LOADERS))}, not of {self.kind}"
        )
        return [Problem("", f"{self.family}: {why}; {doing} with a table of your own")]

    def table(self, checkpoint: Checkpoint) -> tuple[Mapping[str, Target | None], list[Problem]]:
        family = self.family
        if self.kind not in _LOADERS:
            return {}, self._unread("load")
        problems = mismatches(checkpoint.config, self.model_config, checkpoint.where)
        if problems:  # another model's files: nothing of its map is worth reading
            return {}, problems
        try:
            key_map, preprocess, problems = _loader(self.kind, self.model_config, family)
        except ImportError as e:
            fix = f"pip install google-tunix=={TESTED} (Python 3.12)"
            return {}, [Problem("", f"meshinit.tunix.names needs google-tunix: {e}; {fix}")]
        if problems:
            return {}, problems
        syms, dtypes, problems = _mapped(key_map, checkpoint, family)
        if preprocess is not None and not problems:
            try:
                syms = _traced.trace(preprocess, syms, dtypes)
            except Exception as e:  # noqa: BLE001 - tunix's own code, on these shapes
                what = f"{type(e).__name__}: {e}"
                problems.append(Problem("", f"{family}: its preprocess step failed ({what})"))
        if problems:
            return {}, problems
        return _assembled(syms, checkpoint, family)

    def saving(
        self,
        planned: Mapping[str, tuple[tuple[int, ...], np.dtype]],
        config: Mapping[str, Any] | None,
    ) -> tuple[list[Recipe], list[Problem]]:
        """tunix's map read from the parameters' side (:mod:`._checkpoint.maps.inverse`):
        the stored tensors it would read into ``planned``, their names written from its
        regexes and their shapes by its transforms undone; then the table the load
        would build from those tensors, read in reverse. Every parameter the map does
        not write, or writes through a step that is not a layout, is a problem naming
        it."""
        family, kind, cfg = self.family, self.kind, self.model_config
        if kind not in _LOADERS:
            return [], self._unread("export")
        problems = mismatches(config, cfg, "config=", saving=True)
        try:
            key_map, preprocess, found = _loader(kind, cfg, family)
            from tunix.utils.torch_utils import torch_key_to_jax_key
        except ImportError as e:
            fix = f"pip install google-tunix=={TESTED} (Python 3.12)"
            return [], [Problem("", f"meshinit.tunix.names needs google-tunix: {e}; {fix}")]
        if problems or found:
            return [], problems + found
        params = {p: v for p, v in planned.items() if not _rng_state(*v)}

        def fresh() -> Any:  # a preprocess step of its own for each run (Gemma's keeps state)
            return _loader(kind, cfg, family)[1]

        counts = {"layers": cfg.num_layers, "experts": getattr(cfg, "num_experts", None) or 0}
        made, problems = _inverse.stored(
            key_map,
            params,
            width=cfg.embed_dim,
            counts=counts,
            preprocess=fresh,
            match=torch_key_to_jax_key,
            dropped=_UNUSED,
            family=family,
        )
        if problems:
            return [], problems

        def follow(shapes: Mapping[str, tuple[int, ...]]) -> Mapping[str, _trace.Sym]:
            headers = {n: (shape, "F32") for n, shape in shapes.items()}
            syms, types, _ = _mapped(key_map, Checkpoint(None, "", headers, {}), family)
            return syms if preprocess is None else _traced.trace(fresh(), syms, types)

        fed = _inverse.fed(made, params, follow)
        tensors = {n: (shape, _STORED.get(dtype, "F32")) for n, (shape, dtype) in fed.items()}
        table, problems = _framework.built(self, config, "config=", tensors, planned)
        if problems:
            return [], problems
        shapes = {n: shape for n, (shape, _) in tensors.items()}
        spelled, problems = _inverse.spelled(table, shapes, family)
        if problems:
            return [], problems
        recipes, problems = _reverse.recipes(spelled, planned)
        for r in recipes:
            if r.name in shapes and tuple(r.shape) != tuple(shapes[r.name]):
                problems.append(
                    Problem(
                        r.origin,
                        f"{family}: the export would write {r.name} {tuple(r.shape)}, which "
                        f"tunix's map reads as {tuple(shapes[r.name])}",
                    )
                )
        return ([] if problems else recipes), problems


_STORED = {dtype: name for name, dtype in READABLE.items()}


# a tunix ModelConfig's sizes and the Hugging Face config fields that say them (an MoE
# model's expert width is its moe_intermediate_size); the vocabulary is left out:
# Gemma's loader takes it from the files, and the others' shapes check it
_COMPARED = (
    ("embed_dim", ("hidden_size",)),
    ("hidden_dim", ("intermediate_size",)),
    ("num_heads", ("num_attention_heads",)),
    ("num_kv_heads", ("num_key_value_heads",)),
    ("head_dim", ("head_dim",)),
    ("num_layers", ("num_hidden_layers",)),
    ("num_experts", ("num_experts", "num_local_experts")),
    ("num_experts_per_tok", ("num_experts_per_tok",)),
)


_LOADING = (
    "the files are of another model than the plan's; load that model's checkpoint, or "
    "build the ModelConfig with its sizes"
)
_SAVING = "it is another model's config; pass the config of the model the parameters are of"


def mismatches(
    hf: Mapping[str, Any] | None, model_config: Any, where: str, saving: bool = False
) -> list[Problem]:
    """Every size of the checkpoint's ``config.json`` (where it has one, and the
    field) that differs from the tunix ``model_config`` the plan's model is built from:
    files of other heads fit the same shapes (4 heads of 32 as 8 of 16) and would load
    scrambled. Each is a problem naming both values; ``saving``: of an export's
    ``config=``, which would describe files of another model."""
    if not isinstance(hf, Mapping):
        return []
    text = hf.get("text_config") or hf
    problems = []
    for attr, fields in _COMPARED:
        ours = getattr(model_config, attr, None)
        if attr == "hidden_dim" and getattr(model_config, "num_experts", None):
            fields = ("moe_intermediate_size",)  # tunix's MoE MLP: one expert's width
        for field in fields:
            theirs = text.get(field) if isinstance(text, Mapping) else None
            if ours is None or theirs is None or theirs == ours:
                continue
            problems.append(
                Problem(
                    where,
                    f"{'' if saving else 'config.json says '}{field}={theirs!r}, "
                    f"the tunix ModelConfig {attr}={ours!r}: " + (_SAVING if saving else _LOADING),
                )
            )
    return problems


def _version() -> str:
    try:
        version = metadata.version("google-tunix")
    except metadata.PackageNotFoundError:
        return "tunix (not installed)"
    tested = "" if version == TESTED else f" (meshinit is tested with {TESTED})"
    return f"tunix {version}{tested}"


def _loader(family: str, config: Any, described: str) -> tuple[Any, Any, list[Problem]]:
    """tunix's key map of ``config`` and its loader's preprocess step (or None), with
    every problem of their form."""
    module = importlib.import_module(f"tunix.models.{family}.{_LOADERS[family]}")
    where = f"{described}: {module.__name__}"
    load = getattr(module, "create_model_from_safe_tensors", None)
    if not inspect.isfunction(load) or not inspect.isfunction(getattr(module, _KEY_MAP, None)):
        return None, None, [Problem("", f"{where} has no {_KEY_MAP} and loader of the form known")]
    calls = {  # the functions of its module the loader refers to
        n for n in load.__code__.co_names if inspect.isfunction(getattr(module, n, None))
    }
    unknown = sorted(calls - {_KEY_MAP, *_PREPROCESS, *_HELPERS})
    steps = sorted(calls & set(_PREPROCESS))
    problems = [
        Problem("", f"{where}: its loader calls {n}, a step meshinit does not know")
        for n in unknown
    ]
    if _KEY_MAP not in calls:
        problems.append(Problem("", f"{where}: its loader does not read {_KEY_MAP}"))
    if len(steps) > 1:
        problems.append(Problem("", f"{where}: its loader has preprocess steps {steps}"))
    try:
        key_map = getattr(module, _KEY_MAP)(config)
        preprocess = None
        for step in steps:
            preprocess = getattr(module, step)
            preprocess = preprocess(config) if _PREPROCESS[step] else preprocess
    except Exception as e:  # noqa: BLE001 - tunix's own code, on this config
        return None, None, [*problems, Problem("", f"{where}: {type(e).__name__}: {e}")]
    return key_map, preprocess, problems + _form(key_map, where)


def _form(key_map: Any, where: str) -> list[Problem]:
    """Every entry of ``key_map`` not of the form this module reads."""
    form = "regex -> (nnx path template, None or (permute or None, reshape or None))"
    if not isinstance(key_map, Mapping):
        return [Problem("", f"{where}'s {_KEY_MAP} gave {type(key_map).__name__}, not {form}")]
    problems = []
    for regex, value in key_map.items():
        ok = (
            isinstance(regex, str)
            and isinstance(value, tuple | list)
            and len(value) == 2
            and isinstance(value[0], str)
            and _transform(value[1])
        )
        if ok:
            try:
                re.compile(regex)
            except re.error as e:
                ok, value = False, f"{value!r} (the regex: {e})"
        if not ok:
            problems.append(
                Problem("", f"{where}: the entry {regex!r} -> {value!r} is not {form}; refused")
            )
    return problems


def _transform(t: Any) -> bool:
    def ints(x: Any) -> bool:
        return x is None or (
            isinstance(x, tuple | list)
            and all(isinstance(d, int | np.integer) and not isinstance(d, bool) for d in x)
        )

    return t is None or (isinstance(t, tuple | list) and len(t) == 2 and all(map(ints, t)))


def _mapped(
    key_map: Mapping[str, Any],
    checkpoint: Checkpoint,
    family: str,
    match: Callable[[Mapping[str, Any], str], tuple[str, Any]] | None = None,
) -> tuple[dict[str, _trace.Sym], dict[str, Any], list[Problem]]:
    """Each stored tensor as tunix's loader has it before its preprocess step: by
    tunix's own regex match (``match``: tunix's ``torch_key_to_jax_key``), transposed,
    then reshaped. A tensor sent to one of tunix's ``unused.`` names is left unread,
    however many go to the same name (Gemma's map sends every ``.*\\.bias`` to
    ``unused.bias``; tunix's loader overwrites one with the next and uses none). A
    float8 weight's block scale is the loader's, read with its weight (dequantized),
    never tunix's: its map, whose patterns match a name's start, would send it to a
    path beside the weight's."""
    if match is None:
        from tunix.utils.torch_utils import torch_key_to_jax_key

        match = torch_key_to_jax_key

    syms: dict[str, _trace.Sym] = {}
    dtypes: dict[str, Any] = {}
    problems = []
    scales = _quantized.paired_scales(checkpoint.tensors)
    for name, (shape, dtype) in sorted(checkpoint.tensors.items()):
        if name in scales:
            continue
        try:
            key, transform = match(key_map, name)
        except ValueError:  # no regex, or several: tunix skips it, and so is it here
            continue
        if key.startswith(_UNUSED):  # tunix's own name for what it drops: unread
            continue
        if key in syms:
            first = ", ".join(_read(syms[key]))
            problems.append(Problem(key, f"{family} maps both {first} and {name} here"))
            continue
        dtypes[key] = READABLE.get(dtype, np.dtype(np.float32))
        sym = _trace.stand_in(name, tuple(shape), dtypes[key])
        try:
            if transform is not None:  # as tunix's loader: permute, then reshape
                permute, reshape = transform
                if permute:
                    sym = sym.transpose(tuple(permute))
                if reshape:
                    sym = sym.reshape(tuple(reshape))
        except _trace.Inexpressible as e:
            problems.append(
                Problem(key, f"{family}: {name} {tuple(shape)} by {tuple(transform)}: {e}")
            )
            continue
        syms[key] = sym
    return syms, dtypes, problems


def _read(sym: _trace.Sym) -> list[str]:
    """The names of the stored tensors ``sym`` reads, in order (none if it is refused)."""
    try:
        return [t.name for t in _parts.leaves(_trace.target(sym))]
    except _trace.Inexpressible:
        return []


def _assembled(
    syms: Mapping[str, _trace.Sym], checkpoint: Checkpoint, family: str
) -> tuple[dict[str, Target | None], list[Problem]]:
    """The table over the plan's paths (tunix's loader looks a path up as it is or
    with ``.value``), with every path nothing fills and every tensor sent nowhere."""
    table: dict[str, Target | None] = {}
    problems = []
    used = set()
    for path, (shape, dtype) in checkpoint.planned.items():
        key = next((k for k in (path, f"{path}.value") if k in syms), None)
        if key is None:
            if _rng_state(shape, dtype):
                table[path] = None
            else:
                problems.append(Problem(path, f"{family}: no stored tensor maps to it"))
            continue
        used.add(key)
        try:
            table[path] = _trace.target(syms[key])
        except _trace.Inexpressible as e:
            problems.append(Problem(path, f"{family}: {e}: no target expresses it"))
    for key in sorted(set(syms) - used):
        read = ", ".join(_read(syms[key])) or "a value"
        problems.append(Problem(key, f"{family} maps {read} here: not a path of the plan"))
    return table, problems


def _rng_state(shape: tuple[int, ...], dtype: Any) -> bool:
    """Whether a planned leaf is nnx RNG state: a typed key, or a scalar uint32 count."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return True
    return np.dtype(dtype) == np.uint32 and tuple(shape) == ()
