"""Errors raised by meshinit: every problem names its parameter path and the fix."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from ._format import collapse_paths

_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def printable(text: str) -> str:
    """``text`` with every character a terminal would act on or cannot show escaped.

    Control characters (ESC, newline, NUL) and lone surrogates become Python escapes
    (``\\x1b``, ``\\n``, ``\\udcff``), so that a path cannot recolour, break or
    truncate a table or a message; everything else is left as it is.
    """
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else _ESCAPES.get(c) or repr(c)[1:-1] for c in text)


@dataclasses.dataclass(frozen=True)
class Problem:
    """One thing wrong with one parameter (or with the tree, when ``path`` is empty).

    Attributes:
      path: the parameter's dot-joined path, or ``""`` for a problem with the tree.
      message: what is wrong, and what would fix it.

    Examples:
      >>> str(meshinit.Problem("layers.3.mlp.up", "logical axis 'mlpp' has no rule"))
      "layers.3.mlp.up: logical axis 'mlpp' has no rule"
    """

    path: str
    message: str

    def __str__(self) -> str:
        return f"{printable(self.path)}: {self.message}" if self.path else self.message


class PlanError(ValueError):
    """Raised once for all problems found while planning or materializing.

    A ``ValueError``: code that catches ``ValueError`` keeps working.

    Args:
      problems: the problems, in the order they were found.
      header: the first line of the message; by default ``"N problems found while
        planning:"``.

    Attributes:
      problems: one :class:`Problem` per problem, each naming its path. ``str(p)``
        reads ``"layers.3.mlp.up: logical axis 'mlpp' has no rule; ..."``. The
        message says each distinct problem once: the same message in repeated layers
        is one line, ``layers.{0..31}.mlp.up: ...``, while ``problems`` keeps every
        path.

    Examples:
      >>> specs = {"up": meshinit.param((d, 4 * d), init, axes=("embed", "mlpp"),
      ...                               mesh=mesh, rules=rules)}  # a typo: mlpp
      >>> try:
      ...     meshinit.plan(specs)
      ... except meshinit.PlanError as e:
      ...     bad_paths = [p.path for p in e.problems]
      >>> bad_paths
      ['up']
    """

    def __init__(self, problems: Iterable[Problem], header: str | None = None):
        self.problems = list(problems)
        n = len(self.problems)
        lines = collapsed(self.problems)
        if header is None:
            header = f"{n} problem{'s' if n != 1 else ''} found while planning"
            if len(lines) < n:
                header += f" ({len(lines)} after collapsing repeated layers)"
            header += ":"
        super().__init__("\n".join([header, *(f"  {line}" for line in lines)]))


def collapsed(problems: Sequence[Problem]) -> list[str]:
    """Problems as message lines, one per distinct message over repeated layers.

    The same message at paths that differ only in their integer components is one
    line naming the layers: ``layers.{0..31}.mlp.up: logical axis 'mlpp' has no
    rule; ...``. Every path a line stands for is named by it exactly (see
    :func:`meshinit._format.collapse_paths`); the problems themselves are not merged.
    """
    rows = collapse_paths([p.path for p in problems], [p.message for p in problems])
    out = []
    for path, positions in rows:
        first = problems[positions[0]]
        out.append(f"{printable(path)}: {first.message}" if first.path else str(first))
    return out


class UnusedPatternWarning(UserWarning):
    """Warned when a placement pattern matches no path, while every leaf is placed.

    ``meshes=`` of ``meshinit.nnx`` and ``meshinit.linen`` and the ``placements`` of
    ``meshinit.eqx`` are ordered ``(regex, ...)`` pairs, the first full match winning.
    As in the partition-rule tables of t5x and EasyLM, a pattern that matches nothing
    is allowed (one table can serve several models), but it is usually a typo that
    quietly leaves a stage on another mesh, so it is warned about, naming each idle
    pattern by its index and regex. A leaf that no pattern places is an error instead
    (a :class:`PlanError`). A ``UserWarning``, so it shows by default; silence it with
    ``warnings.filterwarnings("ignore", category=meshinit.UnusedPatternWarning)``.

    Examples:
      >>> with warnings.catch_warnings():
      ...     warnings.simplefilter("error", meshinit.UnusedPatternWarning)
      ...     model = meshinit.nnx.init(factory, meshes=meshes)  # a typo now raises
    """


class UnusedTensorWarning(UserWarning):
    """Warned when tensors of a checkpoint go unused: no plan path claims them.

    :func:`meshinit.safetensors.load` reads each plan path's tensor; a stored tensor
    that no path's ``names=`` target names would otherwise vanish without a word, and a
    name map that misses a layer would leave that layer to be made at random by
    ``existing=``'s init. As Hugging Face's "Some weights of the model checkpoint were
    not used", the warning names the count and every unused tensor (also in
    ``.tensors``). ``unused="error"`` makes them a :class:`PlanError` instead, and
    ``unused="ignore"`` silences them; :func:`meshinit.safetensors.inventory` lists them
    without reading anything.

    Args:
      message: the warning's text.
      tensors: the unused tensors' names.

    Attributes:
      tensors: the unused tensors' names, sorted.

    Examples:
      >>> with warnings.catch_warnings():
      ...     warnings.simplefilter("error", meshinit.UnusedTensorWarning)
      ...     loaded = meshinit.safetensors.load(plan, "ckpt/", names=names)  # doctest: +SKIP

      (The load needs a checkpoint in ``ckpt/``: not run in the tests.)
    """

    def __init__(self, message: str, tensors: Iterable[str] = ()):
        super().__init__(message)
        self.tensors = tuple(tensors)


class FallbackWarning(UserWarning):
    """Warned when the constructor engine cannot cut some variables out of an unchanged
    constructor, and makes them with one program per mesh holding the whole
    constructor instead.

    Their values are the same; what changes is the cost: that program's compile time
    grows with the model's depth, which the cut keeps flat. One warning per cause
    names the number of variables, the first paths, the cause and what to change (a
    key made outside the factory, a callback or print in the constructor, a primitive
    parameter meshinit cannot compare). Every path goes to the ``"meshinit"`` logger
    at DEBUG. A ``UserWarning``, so it shows by default; silence it with
    ``warnings.filterwarnings("ignore", category=meshinit.FallbackWarning)``.

    Examples:
      >>> with warnings.catch_warnings():
      ...     warnings.simplefilter("error", meshinit.FallbackWarning)
      ...     model = meshinit.nnx.init(factory)  # a fallback now raises
    """


class RenamedWarning(DeprecationWarning):
    """Warned when an old name of a renamed public method is called
    (:mod:`meshinit._plan.renamed`); the new name does the same."""


class PeerFailure(RuntimeError):
    """Raised on every process whose part of a collective call succeeded when another
    process's part failed.

    Under ``jax.distributed``, ``materialize``, ``meshinit.safetensors.load`` and the
    adapters' ``init`` are collective: they return only when every process succeeded
    (see the Reliability page, "Processes"). This process's arrays are deleted before
    this is raised; the failed process raises its own error. The message names each
    failed process and its error; where a collective lost a peer, the processes that
    posted no outcome (killed, or hung); where an earlier call left a collective
    unfinished, that the job must restart (every later collective call raises it).

    Examples:
      >>> try:
      ...     params = meshinit.materialize(plan, 0)
      ... except meshinit.PeerFailure as e:
      ...     log.error("another host failed: %s", e)  # this host made nothing
    """
