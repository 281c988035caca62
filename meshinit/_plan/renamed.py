"""Old names of renamed public methods: each warns, then does what its new name does.

Kept in one place, as mixins of :class:`meshinit.Plan` and :class:`meshinit.PlanEntry`,
so that removing them later is one deletion (docs/changelog.md lists the renames).
"""

from __future__ import annotations

import warnings
from typing import Any

from .._errors import RenamedWarning


def _warn(old: str, new: str) -> None:
    warnings.warn(f"{old} is now {new}", RenamedWarning, stacklevel=3)


class PlanRenames:
    """``Plan.device_bytes()`` and ``Plan.replicated_bytes()``: ``MeshGroup`` has int
    properties of those names, so the plan's dicts got names of their own."""

    def device_bytes(self) -> dict[Any, int]:
        """Deprecated: :meth:`Plan.bytes_per_device`."""
        _warn("Plan.device_bytes()", "Plan.bytes_per_device()")
        return self.bytes_per_device()  # type: ignore[attr-defined]

    def replicated_bytes(self) -> dict[Any, int]:
        """Deprecated: :meth:`Plan.replicated_bytes_per_device`."""
        _warn("Plan.replicated_bytes()", "Plan.replicated_bytes_per_device()")
        return self.replicated_bytes_per_device()  # type: ignore[attr-defined]


class EntryRenames:
    """``PlanEntry.abstract``: ``Plan.abstract()`` is a method returning the tree, so the
    entry's one ``ShapeDtypeStruct`` is ``PlanEntry.struct``."""

    @property
    def abstract(self) -> Any:
        """Deprecated: :attr:`PlanEntry.struct`."""
        _warn("PlanEntry.abstract", "PlanEntry.struct")
        return self.struct  # type: ignore[attr-defined]
