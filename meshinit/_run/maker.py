"""The protocol of meshinit's one run loop: a group maker.

:func:`meshinit._run.loop.run_plan` makes a plan's arrays one mesh group at a time,
and asks a :class:`GroupMaker` three things about each group: which executables it
will call (``builds``: compiled in parallel, into the one executable cache, before
anything is allocated), how many calls each gets (``work``: the progress bar and the
log line), and a runner that makes the group's arrays (``prepare``). The spec path
(:class:`meshinit._run.strategies.Specs`), the constructor engine
(``meshinit._engine.run``) and optax's state init (``meshinit.optax``) each
implement it.
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Protocol

import jax

from .._plan.entries import MeshGroup
from .compile import Build

Runner = Callable[[], Iterator[tuple[int, jax.Array]]]
"""Makes a group's arrays: ``(position in group.entries, array)`` pairs."""

Needs = Sequence[tuple[Hashable | None, int]]
"""A ``(cache key, calls)`` per executable; a key of None: compiled every time, never
cached."""


@typing.runtime_checkable
class GroupMaker(Protocol):
    """How one mesh group's arrays are compiled and made.

    Neither ``builds`` nor ``work`` compiles anything; both are asked before any
    group is prepared.
    """

    def builds(self, group: MeshGroup) -> Sequence[tuple[Hashable, Build]]:
        """A ``(cache key, build)`` per cached executable ``prepare`` will call: the
        run loop compiles the uncached ones of every group in parallel first
        (:func:`meshinit._run.compile.precompile`)."""
        ...

    def work(self, group: MeshGroup) -> Needs:
        """A ``(cache key, calls)`` per executable ``prepare`` will call, before any
        is compiled."""
        ...

    def prepare(self, group: MeshGroup) -> Runner:
        """Compiles (or fetches) what the group needs, and returns its runner."""
        ...
