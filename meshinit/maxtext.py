"""``names=`` from MaxText's own Hugging Face checkpoint maps.

:func:`names` builds, for a MaxText config, the table that
:func:`meshinit.safetensors.load` reads a Hugging Face checkpoint with into MaxText's
own linen or NNX model, from MaxText's own ``PARAM_MAPPING`` (MaxText key -> HF keys,
lists of them for scanned layers and experts) and ``HOOK_FNS`` (numpy functions
``hook(x, target_shape)``), at load time, against the checkpoint's ``config.json``
and tensor headers. meshinit keeps no table of its own: each hook is followed on a
stand-in of its stored tensor (:mod:`meshinit._checkpoint.maps.hooks`; no data is read) and
becomes a :class:`~meshinit.safetensors.Tensor`, :class:`~meshinit.safetensors.Stack`,
:class:`~meshinit.safetensors.Concat`, :class:`~meshinit.safetensors.Pad` or
:class:`~meshinit.safetensors.Fill`; lists of HF keys stack as MaxText's
``tensor_handling`` stacks them. A composite key is followed as ``to_maxtext`` runs it:
a tuple of HF keys on a tuple of stand-ins, a tuple of MaxText keys (gpt-oss's
``wi_0``/``wi_1``) as part ``[..., i]`` of its hook's result, each parameter read
alone. MaxText is imported only when the table is built.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
from collections.abc import Mapping
from typing import Any

import jax
import ml_dtypes
import numpy as np

from ._checkpoint.layout import parts as _names
from ._checkpoint.layout.recipe import Recipe
from ._checkpoint.maps import hooks as _hooks
from ._checkpoint.maps import maxtext_saving as _saving
from ._checkpoint.maps import maxtext_scales as _scales
from ._checkpoint.maps import trace as _trace
from ._checkpoint.maps.framework import Checkpoint, FrameworkMap, MissingKey
from ._checkpoint.maps.maxtext_config import hf_config as hf_config
from ._checkpoint.maps.maxtext_config import mismatches as mismatches
from ._checkpoint.maps.maxtext_saving import made_by_init as _made_by_init
from ._checkpoint.maps.maxtext_saving import mt_key as mt_key
from ._checkpoint.maps.maxtext_saving import named as _named
from ._checkpoint.store.header import READABLE
from ._errors import Problem
from ._spec.rules import NotedRules

__all__ = ["names", "rules"]

VERSIONS = ("0.2.5",)
"""The MaxText releases whose maps this module was tested against."""


HOOK_DTYPES = ("stored", "bfloat16", "float32")
"""The values of ``hook_dtype`` of :func:`names`: the dtype MaxText's hooks run in."""


def names(config: Any, *, hook_dtype: str = "stored") -> FrameworkMap:
    """The ``names=`` of a Hugging Face checkpoint for MaxText's own model of ``config``.

    The checkpoint's ``config.json`` is read as MaxText reads a Hugging Face config:
    built by transformers (``AutoConfig.for_model``, then ``.to_dict()``, which fills
    ``head_dim = hidden_size // num_attention_heads`` and the other defaults: Meta's
    Llama 3.1 files have no ``head_dim``). Where transformers is not installed the
    file is read as it is, and a key MaxText's map reads that it lacks is named. It
    is then checked against ``config``, as MaxText's own
    ``to_huggingface._validate_or_update_architecture`` checks the two: heads, KV
    heads, head_dim, hidden and intermediate sizes, layers, experts, the MLA and
    indexer sizes. A checkpoint of other sizes would load scrambled where the
    reshapes still fit (4 heads of 16 into 8 of 8), or only its first layers into an
    unrolled model of fewer: every field that differs is a problem, before any byte is
    read. The vocabulary is not compared: MaxText's hooks pad or truncate the
    embedding (Gemma 3's 262208 rows into MaxText's 262144), and a map without such a
    hook is refused by the shapes.

    ``hook_dtype`` says in which dtype MaxText's hooks (its query scale, Gemma's norm
    offset, a padding) compute, which decides the bits where they round:

    - ``"stored"`` (the default): in each tensor's dtype in the files, as MaxText's
      direct loader (``load_safetensors_dynamic_state``, ``load_dynamic``) runs them
      on the arrays it reads, then cast to the planned dtype. For bfloat16 files (as
      models are published) this is also ``to_maxtext`` at its default
      ``--save_dtype=bfloat16``: a float32 model gets the bfloat16 results, widened.
    - ``"bfloat16"``: ``to_maxtext``'s default for any file: every tensor cast to
      bfloat16, the hooks run in bfloat16, then cast to the planned dtype.
    - ``"float32"``: ``to_maxtext --save_dtype=float32``: every tensor cast to
      float32, the hooks run in float32, then cast to the planned dtype.

    Args:
      config: MaxText's config object, as its ``pyconfig.initialize`` gives it
        (``model_name``, ``scan_layers``, ``param_scan_axis``, ...).
      hook_dtype: ``"stored"``, ``"bfloat16"`` or ``"float32"``, as above.

    On export (``names=`` of :func:`meshinit.safetensors.save`, with ``config=`` the
    ``config.json`` to write) it writes what MaxText's ``to_huggingface`` writes, bit
    for bit: MaxText's saving hooks (``saving_to_hf=True``) run on the devices, each
    parameter restored in ``weight_dtype`` and sliced per layer as MaxText slices it
    (:mod:`meshinit._checkpoint.maps.maxtext_saving`); ``hook_dtype`` plays no part.

    Returns:
      A :class:`~meshinit.safetensors.FrameworkMap` for ``names=`` of
      :func:`meshinit.safetensors.load`, :func:`~meshinit.safetensors.inventory` and
      :func:`~meshinit.safetensors.save`,
      on plans of MaxText's linen (``params.decoder...``) or NNX (``decoder...``)
      model. Built at load time from MaxText's ``PARAM_MAPPING[config.model_name]``
      and ``HOOK_FNS[config.model_name]`` with the checkpoint's ``config.json``; every
      hook followed without reading data. Whatever a hook asks that a table cannot
      express, a model name MaxText maps not, a plan parameter the map does not
      name, is one :class:`~meshinit.PlanError` before any byte is read.

    Raises:
      ImportError: MaxText is not installed, or is a release this module was not
        tested with (:data:`VERSIONS`).
      ValueError: ``hook_dtype`` is not one of :data:`HOOK_DTYPES`.

    Examples:
      >>> plan = meshinit.nnx.plan(lambda: maxtext_model(config, mesh))  # doctest: +SKIP
      >>> params = meshinit.safetensors.load(  # doctest: +SKIP
      ...     plan, "hf://Qwen/Qwen3-8B", names=meshinit.maxtext.names(config))
      >>> as_float32 = meshinit.maxtext.names(config, hook_dtype="float32")  # doctest: +SKIP

      (Skipped: it needs MaxText, on Python 3.12, and a checkpoint.)
    """
    if hook_dtype not in HOOK_DTYPES:
        raise ValueError(
            f"hook_dtype must be one of {', '.join(map(repr, HOOK_DTYPES))} (the dtype "
            f"MaxText's hooks compute in), got {hook_dtype!r}"
        )
    _maxtext()
    return _MaxTextMap(config, hook_dtype)


NO_ENTRY = "replicated: MaxText's rules have no entry"
"""The note a plan's reports give a name :func:`rules` added."""


class Rules(NotedRules):
    """A rule table (``rules=`` of the plans), with the logical names it replicates
    because MaxText's own rules have no entry for them (:attr:`replicated`); a plan's
    table and summary list each such name its parameters use, as "logical axis
    'o_groups' replicated: MaxText's rules have no entry (n params)". nnx Variables'
    names resolve as MaxText's own NNX init resolves them: by flax linen's algorithm
    (``as_linen``)."""

    replicated: tuple[str, ...]

    def __new__(cls, table: Any, replicated: tuple[str, ...] = ()) -> Rules:
        made = super().__new__(cls, table, {n: NO_ENTRY for n in replicated}, as_linen=True)
        made.replicated = tuple(replicated)
        return made


def rules(config: Any, abstract: Any) -> Rules:
    """MaxText's ``logical_axis_rules`` for one of its models, completed as MaxText runs
    it: each logical axis name the model's parameters use that the rules leave out
    gets ``(name, None)`` (replicated, as flax places a name with no rule), and is
    listed in :attr:`Rules.replicated`, and in the table and summary of a plan made
    with these rules ("logical axis 'o_groups' replicated: MaxText's rules have no
    entry (4 params)").

    meshinit's plans refuse a logical name that has no rule (a typo would otherwise
    replicate a parameter silently). MaxText's own models use names its rules lack
    (deepseek4's ``o_groups``, ``indexer_weights``, ``o_lora_up_proj``, nnx's scan axis
    ``scanned_blocks``), and MaxText runs them replicated; with these rules they plan
    unchanged, each such name in the plan's logical axes, its dimension replicated.

    Under :func:`meshinit.nnx.plan` the table resolves each Variable's names as
    MaxText's own NNX init does (``sharding.get_nnx_var_named_sharding_with_scan_axis``:
    flax linen's ``logical_to_mesh_axes``, where the first rule that fits wins and a rule
    whose mesh axes an earlier dimension took is skipped), not as flax nnx's
    ``get_var_pspec`` does (each name's last rule). The two differ where a name has
    several rules, or where two names of one Variable map to one mesh axis: the gated
    delta net of qwen3-next and qwen3.5 has ``embed_attn`` and ``gdn_head`` both on
    ``fsdp_transpose``, which nnx's resolution puts on two dimensions (jax refuses it)
    and MaxText's leaves to the first.

    Args:
      config: MaxText's config object (its ``logical_axis_rules``).
      abstract: the model's abstract variables, with their logical names: the nnx
        model of ``nnx.eval_shape(factory)`` (or its ``nnx.state``), or linen's
        ``jax.eval_shape(model.init, ...)`` (flax's boxed metadata), as MaxText's
        own abstract model gives them.

    Returns:
      The table for ``rules=`` of :func:`meshinit.nnx.plan`, :func:`meshinit.linen.plan`
      (and their ``init``); its ``replicated`` names the added names, sorted.

    Examples:
      >>> abstract = nnx.eval_shape(factory)  # doctest: +SKIP
      >>> rules = meshinit.maxtext.rules(config, abstract)  # doctest: +SKIP
      >>> rules.replicated  # doctest: +SKIP
      ('indexer_weights', 'o_groups', 'o_lora_up_proj', 'scanned_blocks')
      >>> plan = meshinit.nnx.plan(factory, rules=rules)  # doctest: +SKIP
    """
    table = [(str(n), tuple(a) if isinstance(a, list) else a) for n, a in config.logical_axis_rules]
    known = {n for n, _ in table}
    left = tuple(sorted(n for n in _logical_names(abstract) if n not in known))
    return Rules((*table, *((n, None) for n in left)), left)


def _logical_names(abstract: Any) -> set[str]:
    """Every logical axis name the abstract variables' metadata names."""
    from flax import nnx
    from flax.linen import meta

    if isinstance(abstract, nnx.Module):
        abstract = nnx.state(abstract)
    found: set[str] = set()

    def names(axes: Any) -> None:
        for a in axes if isinstance(axes, tuple | list) else ():
            if isinstance(a, str):
                found.add(a)
            elif isinstance(a, tuple | list):
                names(a)

    boxed = (nnx.Variable, meta.AxisMetadata)
    for leaf in jax.tree_util.tree_leaves(abstract, is_leaf=lambda x: isinstance(x, boxed)):
        if isinstance(leaf, nnx.Variable):
            metadata = leaf.get_metadata()
            for key in ("out_sharding", "sharding_names", "sharding"):
                names(metadata.get(key))
        elif isinstance(leaf, meta.AxisMetadata):
            names(getattr(leaf, "names", None))
    return found


def _maxtext() -> Any:
    try:
        version = importlib.metadata.version("maxtext")
    except importlib.metadata.PackageNotFoundError:
        raise ImportError(
            "meshinit.maxtext.names needs MaxText: pip install 'maxtext==0.2.5' (Python 3.12)"
        ) from None
    if version not in VERSIONS:
        raise ImportError(
            f"meshinit.maxtext.names was tested with MaxText {', '.join(VERSIONS)}; this is "
            f"MaxText {version}, whose maps may have another form: install "
            f"maxtext=={VERSIONS[-1]}, or write names= by hand (docs/names.md)"
        )
    from maxtext.checkpoint_conversion.utils import param_mapping, tensor_handling

    return param_mapping, tensor_handling


class _MaxTextMap(FrameworkMap):
    def __init__(self, config: Any, hook_dtype: str = "stored"):
        self.config = config
        self.model = str(config.model_name)
        self.scan = bool(config.scan_layers)
        self.hook_dtype = hook_dtype

    @property
    def family(self) -> str:
        return f"MaxText {importlib.metadata.version('maxtext')}'s map of {self.model!r}"

    def __repr__(self) -> str:
        dtype = "" if self.hook_dtype == "stored" else f", hook_dtype={self.hook_dtype!r}"
        return f"meshinit.maxtext.names(<{self.model}, scan_layers={self.scan}>{dtype})"

    def saving(
        self,
        planned: Mapping[str, tuple[tuple[int, ...], np.dtype]],
        config: Mapping[str, Any] | None,
    ) -> tuple[list[Recipe], list[Problem]]:
        """The export's stored tensors, as MaxText's ``to_huggingface`` writes them
        (:mod:`meshinit._checkpoint.maps.maxtext_saving`), or the problems that refuse
        it. ``hook_dtype`` plays no part: MaxText's saving hooks run in its
        ``weight_dtype``, as ``to_huggingface`` restores the parameters."""
        _maxtext()
        return _saving.recipes(self.config, planned, config, self.family)

    def table(self, checkpoint: Checkpoint) -> tuple[dict[str, Any], list[Problem]]:
        param_mapping, tensor_handling = _maxtext()
        where = self.family
        if self.model not in param_mapping.PARAM_MAPPING:
            known = ", ".join(sorted(param_mapping.PARAM_MAPPING))
            return {}, [Problem(where, f"MaxText maps no {self.model!r}; it maps {known}")]
        hf, fix, problems = hf_config(checkpoint.config or {}, checkpoint.where)
        if problems:
            return {}, problems
        problems = mismatches(hf, self.config, checkpoint.where)
        if problems:  # another model's files: nothing of its map is worth reading
            return {}, problems
        missing: dict[Any, list[str]] = {}  # config key -> what of the map reads it
        try:
            mapping = param_mapping.PARAM_MAPPING[self.model](hf, self.config, self.scan)
            hooks = param_mapping.HOOK_FNS[self.model](
                hf, self.config, self.scan, saving_to_hf=False
            )
        except MissingKey as e:
            return {}, [_missing(e.key, ["the map"], where, checkpoint.where, fix)]
        except Exception as e:  # noqa: BLE001 - MaxText's own error, named
            said = f"{type(e).__name__}: {str(e)[:300]}"
            return {}, [Problem(where, f"MaxText's map fails on {checkpoint.where}: {said}")]
        shapes = {mt_key(p): s for p, (s, _) in checkpoint.planned.items()}
        scales, block = _scales.problems(
            mapping,
            hooks,
            shapes,
            checkpoint.tensors,
            checkpoint.config or {},
            self.config,
            tensor_handling,
        )
        if block is not None:  # the files' scales are of another block size than MaxText's
            return {}, [Problem(checkpoint.where, block)]
        table: dict[str, Any] = {}
        problems = []
        # a composite key: one hook makes several parameters (MaxText's [..., i] of it)
        composite = {mt: key for key in mapping if isinstance(key, tuple) for mt in key}
        for path, (shape, dtype) in checkpoint.planned.items():
            key = mt_key(path)
            group: Any = composite.get(key, key)
            if group not in mapping:
                if _made_by_init(path, dtype):
                    table[path] = None  # RNG state, made by the init
                else:
                    problems.append(Problem(path, f"{where} names no tensor for {key!r}"))
                continue
            if key in scales:  # a float8 kernel's scale MaxText sizes otherwise than the files
                problems.append(Problem(path, f"{where}: {scales[key]}"))
                continue
            part = group.index(key) if isinstance(group, tuple) else None
            members = tuple(shapes.get(k, shape) for k in group) if part is not None else None
            hook = f"hook {_named(hooks.get(group))} of {group!r}"
            try:
                table[path] = self._target(
                    key, mapping[group], hooks.get(group), shape, dtype, checkpoint,
                    tensor_handling, part, members,
                )  # fmt: skip
            except MissingKey as e:
                missing.setdefault(e.key, []).append(hook)
            except _trace.Inexpressible as e:
                problems.append(
                    Problem(
                        path,
                        f"{where}: {hook} needs {e}, which names= cannot express",
                    )
                )
            except _Absent as e:
                problems.append(
                    Problem(path, f"{where}: {key!r} reads {e}, which is not in the files")
                )
        problems += [
            _missing(k, users, where, checkpoint.where, fix) for k, users in missing.items()
        ]
        return table, problems

    def _target(
        self,
        key: str,
        hf: Any,
        hook: Any,
        shape: tuple[int, ...],
        dtype: np.dtype,
        checkpoint: Checkpoint,
        tensor_handling: Any,
        part: int | None = None,
        members: tuple[tuple[int, ...], ...] | None = None,
    ) -> _names.Target:
        """The target of ``key`` from ``hf`` (a name, a tuple of them that ``hook``
        combines, or MaxText's lists of either, stacked); of a composite key's member
        ``part`` (whose shapes are ``members``), part ``[..., part]`` of the hook's result."""

        def leaf(name: Any, cut: Any) -> _names.Target:
            names = name if isinstance(name, tuple) else (name,)
            absent = [n for n in names if n not in checkpoint.tensors]
            if absent:
                raise _Absent(", ".join(map(repr, absent)))
            kinds = {READABLE.get(checkpoint.tensors[n][1]) for n in names}
            if len(kinds) > 1:
                raise _trace.Inexpressible("HF tensors of several dtypes combined by one hook")
            held = kinds.pop()
            compute = self._compute(held, dtype)
            x = tuple(_trace.stand_in(n, checkpoint.tensors[n][0], compute) for n in names)
            hooked = x if isinstance(name, tuple) else x[0]
            # a composite key's hook is given every member's shape, as MaxText gives them
            target_shape = [cut(m) for m in members] if members is not None else cut(shape)
            made = _hooks.followed(hook, hooked, target_shape, part)
            return _computed(made, compute, np.dtype(dtype), held)

        if not isinstance(hf, list):
            return leaf(hf, lambda s: s)
        depth = tensor_handling.nesting_depth(hf)
        if depth == 1:  # tensor_handling's single-axis stacking
            psa = self.config.param_scan_axis
            axis = psa if self.scan and len(shape) > psa else 0
            cut = lambda s: s[:axis] + s[axis + 1 :]  # noqa: E731
            return _names.Stack(tuple(leaf(k, cut) for k in hf), axis)
        axes = tuple(tensor_handling.stacked_axes(key, self.config, depth))
        inner = lambda s: tensor_handling.slice_shape(s, axes)  # noqa: E731

        def nested(keys: Any, level: int) -> _names.Target:
            if level == depth:
                return leaf(keys, inner)
            # the axes still to stack at this level sit where they land, less the
            # stacked axes before them that are stacked further out
            at = axes[level] - sum(a < axes[level] for a in axes[:level])
            return _names.Stack(tuple(nested(k, level + 1) for k in keys), at)

        return nested(hf, 0)

    def _compute(self, held: np.dtype | None, planned: Any) -> np.dtype:
        """The dtype the hooks of a tensor stored as ``held`` compute in."""
        if self.hook_dtype == "bfloat16":
            return np.dtype(ml_dtypes.bfloat16)
        if self.hook_dtype == "float32":
            return np.dtype(np.float32)
        floating = held is not None and jax.dtypes.issubdtype(held, np.floating)
        return held if floating and held is not None else np.dtype(planned)


def _computed(
    target: _names.Target, compute: np.dtype, planned: np.dtype, held: np.dtype | None
) -> _names.Target:
    """``target`` with every tensor that the hooks' dtype ``compute`` rounds otherwise
    than the planned dtype would told so (``compute_dtype``): a scaled or offset one, or
    any one whose stored dtype is not ``compute`` (cast to it first, as MaxText does)."""
    if compute == planned:
        return target
    if isinstance(target, _names.Tensor):
        rounds = target.scale is not None or target.offset is not None or held != compute
        return dataclasses.replace(target, compute_dtype=compute) if rounds else target
    if isinstance(target, _names.Pad):
        return dataclasses.replace(target, part=_computed(target.part, compute, planned, held))
    if isinstance(target, _names.Stack | _names.Concat):
        parts = tuple(_computed(p, compute, planned, held) for p in target.parts)
        return dataclasses.replace(target, parts=parts)
    return target  # a Fill: its value computed by the hook, in its dtype


def _missing(key: Any, users: list[str], where: str, file: str, fix: str) -> Problem:
    """The problem of a config key MaxText's map reads that the checkpoint's config lacks."""
    shown = users[0] + (f" and {len(users) - 1} more" if len(users) > 1 else "")
    said = f"config.json has no {key!r}, which {where} reads ({shown}); {fix.format(key=key)}"
    return Problem(file, said)


class _Absent(Exception):
    pass
