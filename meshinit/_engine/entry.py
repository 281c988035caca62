"""The engine's one entry point, for the adapters (nnx, linen, eqx).

An adapter runs the user's constructor under :func:`trace`, plans its variables, then
hands the trace and the plan to :func:`make_arrays`, inside :func:`paused_gc`::

    traced = entry.trace(build, *args)          # the constructor, traced once
    plan = ...                                   # the adapter's plan of its variables
    with entry.paused_gc():
        tree = entry.make_arrays(plan, traced, outputs, what="meshinit.nnx.init")

Everything else in :mod:`meshinit._engine` is the engine's own business.
"""

from __future__ import annotations

from .run import make_arrays
from .trace import NeedsConcreteValue, Traced, paused_gc, trace

__all__ = ["NeedsConcreteValue", "Traced", "make_arrays", "paused_gc", "trace"]
