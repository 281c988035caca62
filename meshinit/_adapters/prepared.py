"""The one shape of the three adapters: each framework's trace-and-plan (:mod:`.nnx`,
:mod:`.linen`, :mod:`.eqx`) returns a :class:`Prepared`, and :func:`init` runs what
every public ``init`` then does: the collective, the arrays, ``existing=`` and the
rewrap into the framework's object."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from .._engine import entry as _engine
from .._plan.plan import Plan
from .._run import agree as _agree


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A factory traced once and its variables planned; nothing compiled or allocated.

    Attributes:
      plan: the plan as the call shows it (``plan()`` returns it; nnx's typed keys as
        the key arrays ``init`` gives back).
      made: the plan of what the engine makes (nnx's typed keys as their key data;
        else ``plan`` itself).
      traced: the trace the engine cuts per variable.
      outputs: the trace's output of each entry of ``made``, in order.
      existing: ``existing=`` of the call as plan path -> value (None: none given),
        as the framework spells it (linen unboxes, nnx reads typed keys).
      rewrap: the made arrays, as ``made``'s tree, into the framework's object.
    """

    plan: Plan
    made: Plan
    traced: Any
    outputs: Sequence[int]
    existing: Callable[[Any], dict[str, Any] | None]
    rewrap: Callable[[Any], Any]


def init(what: str, prepare: Callable[[], Prepared], existing: Any) -> Any:
    """What every adapter's ``init`` runs: ``prepare()``, then the arrays it plans
    (``existing`` placed, not made), rewrapped into the framework's object.

    One collective call (a factory that fails while tracing on one process fails every
    process), with Python's cycle collector paused while tracing and cutting.

    Args:
      what: the call's name in messages (``"meshinit.nnx.init"``).
      prepare: traces the factory and plans it (called inside the collective).
      existing: the call's ``existing=``, read by :attr:`Prepared.existing`.

    Returns:
      What :attr:`Prepared.rewrap` makes of the arrays.
    """
    with _agree.collective(what), _engine.paused_gc():
        prep = prepare()
        arrays = _engine.make_arrays(
            prep.made, prep.traced, prep.outputs, what=what, existing=prep.existing(existing)
        )
        made = prep.rewrap(arrays)
        del prep, arrays
    return made
