"""``names=`` from MaxText's own Hugging Face checkpoint maps.

:func:`names` builds, for a MaxText config, the table that
:func:`meshinit.safetensors.load` reads a Hugging Face checkpoint with into MaxText's
own linen or NNX model, from MaxText's own ``PARAM_MAPPING`` (MaxText key -> HF keys,
lists of them for scanned layers and experts) and ``HOOK_FNS`` (numpy functions
``hook(x, target_shape)``), at load time, against the checkpoint's ``config.json``
and tensor headers. meshinit keeps no table of its own: each hook is followed on a
stand-in of its stored tensor (:mod:`meshinit._load.hooks`; no data is read) and
becomes a :class:`~meshinit.safetensors.Tensor`, :class:`~meshinit.safetensors.Stack`,
:class:`~meshinit.safetensors.Concat`, :class:`~meshinit.safetensors.Pad` or
:class:`~meshinit.safetensors.Fill`; lists of HF keys stack as MaxText's
``tensor_handling`` stacks them. MaxText is imported only when the table is built.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

import jax
import numpy as np

from ._errors import Problem
from ._load import hooks as _hooks
from ._load import parts as _names
from ._load import trace as _trace
from ._load.framework import Checkpoint, FrameworkMap

__all__ = ["names"]

VERSIONS = ("0.2.5",)
"""The MaxText releases whose maps this module was tested against."""


def names(config: Any) -> FrameworkMap:
    """The ``names=`` of a Hugging Face checkpoint for MaxText's own model of ``config``.

    Args:
      config: MaxText's config object, as its ``pyconfig.initialize`` gives it
        (``model_name``, ``scan_layers``, ``param_scan_axis``, ...).

    Returns:
      A :class:`~meshinit.safetensors.FrameworkMap` for ``names=`` of
      :func:`meshinit.safetensors.load` and :func:`~meshinit.safetensors.inventory`,
      on plans of MaxText's linen (``params.decoder...``) or NNX (``decoder...``)
      model. Built at load time from MaxText's ``PARAM_MAPPING[config.model_name]``
      and ``HOOK_FNS[config.model_name]`` with the checkpoint's ``config.json``; every
      hook followed without reading data. Whatever a hook asks that a table cannot
      express, a model name MaxText maps not, a plan parameter the map does not
      name, is one :class:`~meshinit.PlanError` before any byte is read.

    Raises:
      ImportError: MaxText is not installed, or is a release this module was not
        tested with (:data:`VERSIONS`).

    Examples:
      >>> plan = meshinit.nnx.plan(lambda: maxtext_model(config, mesh))  # doctest: +SKIP
      >>> params = meshinit.safetensors.load(  # doctest: +SKIP
      ...     plan, "hf://Qwen/Qwen3-8B", names=meshinit.maxtext.names(config))

      (Skipped: it needs MaxText, on Python 3.12, and a checkpoint.)
    """
    _maxtext()
    return _MaxTextMap(config)


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
            f"maxtext=={VERSIONS[-1]}, or write names= by hand (docs/pretrained.md)"
        )
    from maxtext.checkpoint_conversion.utils import param_mapping, tensor_handling

    return param_mapping, tensor_handling


def mt_key(path: str) -> str:
    """MaxText's conversion key of a plan path (nnx, or linen's ``params.``)."""
    return "params-" + path.removeprefix("params.").replace(".", "-")


class _MaxTextMap(FrameworkMap):
    def __init__(self, config: Any):
        self.config = config
        self.model = str(config.model_name)
        self.scan = bool(config.scan_layers)

    @property
    def family(self) -> str:
        return f"MaxText {importlib.metadata.version('maxtext')}'s map of {self.model!r}"

    def __repr__(self) -> str:
        return f"meshinit.maxtext.names(<{self.model}, scan_layers={self.scan}>)"

    def table(self, checkpoint: Checkpoint) -> tuple[dict[str, Any], list[Problem]]:
        param_mapping, tensor_handling = _maxtext()
        where = self.family
        if self.model not in param_mapping.PARAM_MAPPING:
            known = ", ".join(sorted(param_mapping.PARAM_MAPPING))
            return {}, [Problem(where, f"MaxText maps no {self.model!r}; it maps {known}")]
        hf = dict(checkpoint.config or {})
        try:
            mapping = param_mapping.PARAM_MAPPING[self.model](hf, self.config, self.scan)
            hooks = param_mapping.HOOK_FNS[self.model](
                hf, self.config, self.scan, saving_to_hf=False
            )
        except Exception as e:  # noqa: BLE001 - MaxText's own error, named
            said = f"{type(e).__name__}: {str(e)[:300]}"
            return {}, [Problem(where, f"MaxText's map fails on {checkpoint.where}: {said}")]
        table: dict[str, Any] = {}
        problems: list[Problem] = []
        composite = {mt: key for key in mapping if isinstance(key, tuple) for mt in key}
        for path, (shape, dtype) in checkpoint.planned.items():
            key = mt_key(path)
            if key not in mapping:
                if key in composite:
                    group = composite[key]
                    others = ", ".join(repr(k) for k in group if k != key)
                    problems.append(
                        Problem(
                            path,
                            f"{where}: hook {_named(hooks.get(group))} of {group!r} makes "
                            f"it together with {others} from the same stored tensors (a "
                            f"composite key), which names= cannot express",
                        )
                    )
                elif _made_by_init(path, dtype):
                    table[path] = None  # RNG state, made by the init
                else:
                    problems.append(Problem(path, f"{where} names no tensor for {key!r}"))
                continue
            try:
                table[path] = self._target(
                    key, mapping[key], hooks.get(key), shape, dtype, checkpoint, tensor_handling
                )
            except _trace.Inexpressible as e:
                problems.append(
                    Problem(
                        path,
                        f"{where}: hook {_named(hooks.get(key))} of {key!r} needs {e}, "
                        f"which names= cannot express",
                    )
                )
            except _Absent as e:
                problems.append(
                    Problem(path, f"{where}: {key!r} reads {e}, which is not in the files")
                )
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
    ) -> _names.Target:
        def leaf(name: Any, target_shape: tuple[int, ...]) -> _names.Target:
            if isinstance(name, tuple):
                raise _trace.Inexpressible("several HF tensors combined by one hook")
            if name not in checkpoint.tensors:
                raise _Absent(repr(name))
            stored = checkpoint.tensors[name][0]
            return _hooks.followed(hook, _trace.stand_in(name, stored, dtype), target_shape)

        if not isinstance(hf, list):
            return leaf(hf, shape)
        depth = tensor_handling.nesting_depth(hf)
        if depth == 1:  # tensor_handling's single-axis stacking
            psa = self.config.param_scan_axis
            axis = psa if self.scan and len(shape) > psa else 0
            inner = shape[:axis] + shape[axis + 1 :]
            return _names.Stack(tuple(leaf(k, inner) for k in hf), axis)
        axes = tuple(tensor_handling.stacked_axes(key, self.config, depth))
        inner = tensor_handling.slice_shape(shape, axes)

        def nested(keys: Any, level: int) -> _names.Target:
            if level == depth:
                return leaf(keys, inner)
            # the axes still to stack at this level sit where they land, less the
            # stacked axes before them that are stacked further out
            at = axes[level] - sum(a < axes[level] for a in axes[:level])
            return _names.Stack(tuple(nested(k, level + 1) for k in keys), at)

        return nested(hf, 0)


class _Absent(Exception):
    pass


def _named(hook: Any) -> str:
    """A hook (or MaxText's list of them, applied in order) as messages name it."""
    hooks = hook if isinstance(hook, list) else [hook]
    return ", ".join(getattr(h, "__name__", repr(h)) for h in hooks if h) or "(none)"


def _made_by_init(path: str, dtype: Any) -> bool:
    """A plan entry that is no weight: nnx's RNG state, a typed key or a stream's
    uint32 ``count``. Any other entry MaxText's map does not name is a problem."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return True
    return np.dtype(dtype) == np.uint32 and path.rsplit(".", 1)[-1] == "count"
