"""The initializer of specs whose values come from a module's constructor."""

from __future__ import annotations

from typing import Any


def from_constructor(key: Any, shape: Any, dtype: Any) -> Any:
    """The ``init`` of specs whose values come from a module's constructor.

    ``meshinit.nnx.init``, ``meshinit.linen.init`` and ``meshinit.eqx.init`` plan such
    specs and fill them with the constructor engine (:mod:`meshinit._engine.run`); the
    initializer itself is never meant to be called.
    """
    raise TypeError(
        "this spec's value comes from its module's constructor, not from an initializer, "
        "so it cannot be materialized on its own; for nnx use meshinit.nnx.init(factory), "
        "for equinox call meshinit.eqx.init(factory, key, placements)"
    )
