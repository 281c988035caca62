"""A load from start to end: the survey (every file checked, every path resolved, nothing
read), the policy of ``missing=`` and ``unused=``, then the read onto the plan's
shardings and the typed keys wrapped. :func:`meshinit.safetensors.load` runs it inside
its collective call; nothing half-done is returned, and on failure no array is left.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax

from ... import _patterns
from ..._errors import PlanError, Problem, UnusedTensorWarning
from ..._plan.plan import Plan
from ..._run import agree as _agree
from ..encodings import keys as _keys
from ..maps import unused as _unused
from . import loop as _read
from . import staging as _staging
from . import survey as _survey


def load(
    plan: Plan,
    files: Any,
    names: Any,
    missing: str,
    unused: str,
    what: str,
    options: Any,
    budget: int,
    progress: bool | None,
    fan_out: bool | None = None,
) -> dict[str, jax.Array]:
    """The arrays of every path ``files`` fill, read onto ``plan``'s shardings; every
    problem of the survey and of the policy raised at once, as one :class:`PlanError`
    headed by ``what``, before a byte of data is read."""
    # before the survey, which a process can fail alone: every process posts its host
    one = fan_out is None and _staging.processes() > 1 and _staging.one_host()
    survey = _survey.survey(plan, files, names, what, options)
    found, jobs, checked, problems = survey.inventory, survey.jobs, survey.checked, survey.problems
    problems += [
        Problem(j.entry.path, "is planned on an AbstractMesh: load needs devices")
        for j in jobs
        if isinstance(j.entry.mesh, jax.sharding.AbstractMesh)
    ]
    # With missing="error" a path whose part is missing fails the load, and its
    # problem names the path: its other parts are not unused, they are not reached.
    stranded = survey.stranded if missing == "skip" else {}
    idle = tuple(n for n in found.unused if missing == "skip" or n not in survey.stranded)
    if missing == "error":
        problems += survey.absent
    if unused == "error":
        files = {n: str(s.file) for c in checked.values() for n, s in c.tensors.items()}
        problems += _unused.problems(idle, stranded, found.missing, files)
    if problems:
        raise PlanError(problems, header=f"{what}: nothing was read:")
    if unused == "warn" and idle:
        warnings.warn(
            UnusedTensorWarning(_unused.warning(what, idle, stranded, found.missing), idle),
            stacklevel=_patterns.outside_stacklevel(),
        )
    jobs = _staging.staged(jobs, fan_out, one)  # the reads planned: which are staged,
    ends = _staging.ends(jobs, budget)  # and in which batches their reshards run

    def inputs() -> None:  # before the first collective: every process reads the same
        # paths, with the same staging, in the same batches (else a reshard would pair
        # with another's); the read calls it once its fetches and compiles are under way
        _agree.checkpoint(what, "inputs", _staging.facts(jobs, fan_out, budget))

    arrays = _read.read(jobs, checked, budget, progress, ends=ends, agreed=inputs)
    keys = {e.path: e for e in plan.entries if _keys.is_key(e.spec.dtype)}
    try:
        for path in keys.keys() & arrays.keys():
            arrays[path] = _keys.wrapped(arrays[path], keys[path])
    except BaseException:
        for made in arrays.values():
            made.delete()
        raise
    return arrays
