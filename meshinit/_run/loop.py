"""The run loop: a plan made into arrays, one mesh group at a time, by a group maker.

:func:`run_plan` is the loop that ``materialize``, the constructor engine, the
adapters and ``meshinit.optax`` share: check everything (:mod:`meshinit._run.checks`), compile every
executable the maker lists (:mod:`meshinit._run.compile`, in parallel, cached), then
call each group's runner (:mod:`meshinit._run.maker`), and delete everything made if
anything fails; under ``jax.distributed`` every process agrees on the outcome
(:mod:`meshinit._run.agree`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from typing import Any

import jax

from .._errors import PlanError
from .._format import describe_mesh, some
from .._plan.plan import Plan
from . import agree as _agree
from . import progress as _progress
from .checks import abstract_problems, bound_problems, memory_problems, stale_problems, subplan
from .compile import is_cached, precompile, some_paths
from .maker import GroupMaker
from .place import place


@contextlib.contextmanager
def deleting_on_failure(
    made: list[jax.Array], note: Callable[[int], str] | None = None
) -> Iterator[None]:
    """If the block raises anything (``KeyboardInterrupt`` too), every array in ``made``
    (as it is then) is deleted and the error, with ``note(len(made))`` added, propagates.

    The one delete-everything-on-failure of meshinit: :func:`run_plan` (materialize, the
    adapters' engine and ``meshinit.optax``) uses it, so nothing half-made outlives a
    failed call.
    """
    try:
        yield
    except BaseException as e:
        for array in made:
            array.delete()
        if note is not None:
            e.add_note(note(len(made)))
        raise


def run_plan(
    plan: Plan,
    maker: GroupMaker,
    *,
    given: Mapping[int, Any] | None = None,
    max_bytes_per_call: int | None = None,
    progress: bool | None = None,
    what: str = "materialize",
    log: bool = True,
    note: Callable[[int, str], str] | None = None,
) -> Any:
    """:func:`_run_here`, agreed between processes (:mod:`meshinit._run.agree`).

    What the caller says, alike for every maker: ``what`` names the call (the bar, the
    log line, the agreement); ``progress`` decides the bar (None: the auto rule of
    :mod:`meshinit._run.progress`); ``log=False`` logs nothing (no INFO line for the
    call, no DEBUG line per executable); ``note(n, where)`` is the note a failure gets
    after the ``n`` arrays made are deleted (default: ``"meshinit: {what} failed while
    {where}; deleted the {n} arrays it had made, and returned nothing"``).

    Under ``jax.distributed`` it returns only when every process succeeded; when any
    failed, every process raises (its own error, or ``PeerFailure`` naming the failed
    process) with every array it made deleted. Alone, it is :func:`_run_here`. Inside
    a caller's :func:`meshinit._run.agree.collective` call (an adapter's init), that call
    agrees instead, once, when it ends.
    """
    with _agree.collective(what):  # or the caller's call
        tree, made = _run_here(
            plan, maker, given, max_bytes_per_call, progress, what, log, note or _failed_note(what)
        )
        _agree.keep(made)  # deleted if the call fails after all, here or elsewhere
    return tree


def _run_here(
    plan: Plan,
    maker: GroupMaker,
    given: Mapping[int, Any] | None,
    max_bytes_per_call: int | None,
    progress: bool | None,
    what: str,
    log: bool,
    note: Callable[[int, str], str],
) -> Any:
    """Checks, compiles, then allocates; deletes everything it made if anything fails.

    ``given`` maps ``id(entry)`` to the caller's array for that entry: it is placed,
    not generated, and never deleted here. ``maker.work`` says what its runners will
    compile and call; with ``progress`` it decides the progress bar (see
    :func:`meshinit.materialize`). ``maker.builds`` lists each group's cached
    executables, which are compiled in parallel first, into the process-wide cache of
    executables.
    """
    start = time.perf_counter()
    given = given or {}
    todo = subplan(plan, [e for e in plan.entries if id(e) not in given]) if given else plan
    problems = (
        abstract_problems(plan)
        + stale_problems(plan)
        + bound_problems(todo.entries, max_bytes_per_call)
    )
    if problems:
        raise PlanError(problems, header="cannot materialize this plan:")
    moved = [
        e
        for e in plan.entries
        if id(e) in given
        and not (isinstance(given[id(e)], jax.Array) and given[id(e)].sharding == e.sharding)
    ]
    problems = memory_problems([*todo.entries, *moved])
    if problems:
        raise PlanError(
            problems, header="the parameters do not fit in the memory planned for them:"
        )
    summary = _work(plan, todo, maker)
    # The bar is decided here, once; it draws on stderr only, and closes on any exit.
    bar = _progress.show_bar(progress, summary)
    with _progress.Tracker(what, summary, bar, start, log=log) as t:
        # Compile everything before allocating anything, so a compile error leaves nothing.
        precompile([(i, g, *job) for i, g in enumerate(todo.groups) for job in maker.builds(g)])
        runners = []
        for i, g in enumerate(todo.groups):
            t.group(i, describe_mesh(g.mesh))
            runners.append(maker.prepare(g))
        t.generating()
        callers = {id(a) for a in given.values()}
        made: list[jax.Array] = []
        values: dict[int, jax.Array] = {}
        where = ""
        with deleting_on_failure(made, lambda n: note(n, where)):
            for entry in plan.entries:
                if id(entry) in given:
                    where = f"placing existing[{entry.path!r}] on {describe_mesh(entry.mesh)}"
                    array = place(given[id(entry)], entry.sharding)
                    if id(array) not in callers:
                        made.append(array)
                    values[id(entry)] = array
            for i, (group, run) in enumerate(zip(todo.groups, runners, strict=True)):
                where = f"mesh group {i}, {describe_mesh(group.mesh)}, making {some_paths(group)}"
                t.group(i, describe_mesh(group.mesh))
                for pos, array in run():
                    made.append(array)
                    values[id(group.entries[pos])] = array
                    t.made()
            where = "waiting for the arrays"
            t.waiting()
            try:
                jax.block_until_ready(made)
            except Exception:
                where = f"waiting for the arrays: {_failed(plan, values, made)} failed"
                raise
        t.finished()
    return plan.fill([values[id(e)] for e in plan.entries]), made


def _failed_note(what: str) -> Callable[[int, str], str]:
    def failed(n: int, where: str) -> str:
        return (
            f"meshinit: {what} failed while {where}; deleted the {n} arrays "
            f"it had made, and returned nothing"
        )

    return failed


def _work(plan: Plan, todo: Plan, maker: GroupMaker) -> _progress.Work:
    """What ``run_plan`` will compile, call and make, before it does any of it."""
    keys: set[Hashable] = set()
    executables = to_compile = calls = 0
    for g in todo.groups:
        for key, n in maker.work(g):
            executables += 1
            calls += n
            if key is None:
                to_compile += 1
            elif key not in keys:
                keys.add(key)
                to_compile += not is_cached(key)
    return _progress.Work(
        params=len(plan.entries),
        placed=len(plan.entries) - len(todo.entries),
        groups=len(todo.groups),
        executables=executables,
        to_compile=to_compile,
        calls=calls,
        nbytes=sum(e.spec.nbytes for e in todo.entries),
    )


def _failed(plan: Plan, values: Mapping[int, jax.Array], made: Sequence[jax.Array]) -> str:
    """The paths whose arrays fail when waited for: the failed call's parameters
    (an array of a call that failed at run time, an out-of-memory, raises its error)."""
    path_of = {id(values[id(e)]): e.path for e in plan.entries if id(e) in values}
    failed = []
    for array in made:
        try:
            array.block_until_ready()
        except Exception:
            failed.append(path_of.get(id(array), "?"))
    return f"the arrays of {some(failed, 8)}" if failed else "an array"
