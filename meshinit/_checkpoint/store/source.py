"""Where a checkpoint's bytes live: one type, a local and a remote implementation.

A :class:`Source` is one file of a checkpoint: a local file
(:class:`~meshinit._checkpoint.store.local.LocalFile`) or an object of object storage or the Hub
(:class:`~meshinit._checkpoint.store.remote.Remote`). The loader asks every source the same
things and never which kind it is:

- :meth:`Source.check`: its header bytes read and checked, before a byte of data is
  read, and who it was when checked (its identity);
- :meth:`Source.contents`: a small file whole (``config.json``);
- :meth:`Source.changed`: its identity checked again, before anything is read;
- :meth:`Source.mapping`: a span of it in memory. A local file's span is its mapping,
  read as blocks touch it; a *fetched* source's (:attr:`Source.fetched`) is an
  anonymous mapping that :meth:`Source.fetch` fills ahead of placement
  (:mod:`.fetch`).

Which sources a load reads is decided once, from the user's ``files=``, by
:func:`meshinit._checkpoint.store.listing.listing`. :class:`Stored`, one tensor of a checked file,
holds its source.
"""

from __future__ import annotations

import abc
import pathlib
from typing import Any, ClassVar, NamedTuple

INDEX = "model.safetensors.index.json"
"""A sharded checkpoint's index: which file holds each tensor."""

CONFIG = "config.json"
"""The model's configuration, beside its weights."""


class Source(abc.ABC):
    """One file of a checkpoint, wherever its bytes live. Implementations are frozen
    dataclasses: equal sources are the same file, and a source keys the load's maps."""

    fetched: ClassVar[bool] = False
    """Whether its bytes are fetched ahead of placement into the anonymous mapping
    :meth:`mapping` gives (:meth:`fetch`, within the load's budget), rather than read
    from a mapping of the file as blocks touch them."""

    @property
    @abc.abstractmethod
    def name(self) -> str:
        """The file's name (as a checkpoint's index names its files)."""

    @property
    @abc.abstractmethod
    def shown(self) -> pathlib.Path | str:
        """The file as :attr:`meshinit.safetensors.Inventory.files` gives it: a path,
        or an object's URL."""

    @abc.abstractmethod
    def __str__(self) -> str:
        """The file as messages name it."""

    @abc.abstractmethod
    def check(self) -> tuple[Any, dict[str, Stored], list[str]]:
        """Its header read and checked as the format requires and by the
        ``safetensors`` package, no data read: ``(identity, tensors, [])``, or every
        problem found (``(None, {}, problems)``)."""

    @abc.abstractmethod
    def contents(self, limit: int, what: str) -> tuple[bytes | None, str | None]:
        """Its bytes (a small file, ``config.json``): ``(data, None)``; ``(None, None)``
        where there is no such file; ``(None, why)`` where it cannot be read or holds
        more than ``limit`` bytes (it is then not ``what``)."""

    @abc.abstractmethod
    def changed(self, checked: Any) -> str | None:
        """Why it is not, now, the file that was checked as ``checked`` (the identity
        :meth:`check` gave), or None. A
        source whose every read is conditional on its identity answers None here and
        refuses the read itself."""

    @abc.abstractmethod
    def mapping(self, checked: Any, start: int, end: int) -> Any:
        """Its bytes ``[start, end)`` as a mapping (``start`` aligned to the
        allocation granularity): the file's own, opened again and known to be the one
        checked as ``checked``; or, where :attr:`fetched`, an anonymous mapping of that
        size for :meth:`fetch` to fill."""

    async def fetch(self, start: int, end: int) -> Any:
        """Bytes ``[start, end)`` of a fetched source, as it was when checked (a
        buffer). A mapped source is never fetched."""
        raise NotImplementedError(f"{self} is read from its mapping, not fetched")


class Stored(NamedTuple):
    """One tensor of a checked file: where its bytes are (a tuple: a header makes
    hundreds of thousands)."""

    file: Source
    name: str
    dtype: str  # the format's name: "F32", "BF16", ...
    shape: tuple[int, ...]
    start: int  # of its first byte, from the start of the file
    nbytes: int
