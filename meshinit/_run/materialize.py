"""Materialization: compiled per mesh group, with exact out_shardings.

``materialize`` and ``init``: the call's arguments checked, then the plan made by the
run loop (:func:`meshinit._run.loop.run_plan`) with the strategy of the call
(:mod:`meshinit._run.strategies`) as its group maker.

No computation ever mixes meshes, so jit never resolves outputs across meshes. Every
output carries its planned sharding as an out_sharding, and tracing happens under an
all-Auto twin of the mesh, so XLA partitions the random generation itself and each
device computes only its own shard; no full copy exists anywhere.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .. import _paths
from .._errors import PlanError
from .._plan.plan import Plan
from .._plan.planner import plan
from . import agree as _agree
from . import progress as _progress
from . import strategies as _strategies
from .checks import abstract_problems, bound_problems, given_arrays
from .loop import run_plan
from .strategies import Rounds, Specs


def materialize(
    plan: Plan,
    key: Any,
    existing: Mapping[str, Any] | None = None,
    *,
    max_bytes_per_call: int | None = None,
    progress: bool | None = None,
) -> Any:
    """Allocates every planned parameter with exactly its planned sharding.

    Every computation's out_shardings are the planned ``NamedSharding``s, so each
    device generates only its own shards, and no computation mixes meshes. Works with or
    without an active ``jax.set_mesh``, on any mesh, including disjoint submeshes, and
    unchanged under ``jax.distributed``: every process runs the same call and makes only
    its addressable shards (an array on a mesh of other processes' devices has none).

    Args:
      plan: from :func:`meshinit.plan`.
      key: an int seed, a typed key or a legacy uint32 key; all three give the same
        values. The parameter at ``path`` is ``init(param_key(key, path), shape, dtype)``.
      existing: maps dot-joined paths to arrays (``jax.Array`` or numpy) that are used
        instead of generating those parameters, for example restored from a
        checkpoint; each is placed on its planned sharding. Only the rest are
        generated, with the values a full init gives them. Arrays passed here are never
        deleted, not even on failure. A big-endian numpy array is placed with its
        values, in native byte order.
      max_bytes_per_call: at most this many bytes of parameters made per device by one
        compiled call (default: no bound beyond the strategy's own). Smaller bounds
        mean more, smaller executables.
      progress: ``True`` always shows a progress bar (tqdm, on stderr) through the
        compile and generate steps, ``False`` never does. ``None`` (default) decides
        once, before compiling, from the plan: a bar is shown when stderr is a
        terminal and the call will compile at least 2 executables, make at least 1000
        compiled calls, or generate at least 1 GiB of parameters. Either way, one INFO
        record on the ``"meshinit"`` logger sums the call up (params, groups,
        executables compiled and cached, calls, bytes, seconds); DEBUG adds each
        compile's time.

    Returns:
      The planned tree with a ready ``jax.Array`` in place of each spec.

    Raises:
      PlanError: (a ``ValueError``) before anything is allocated, with every problem:
        a mesh is an ``AbstractMesh``; an ``existing`` path is not planned, or its
        value is no array (PRNG keys, a restore target's ``ShapeDtypeStruct``) or has
        the wrong shape or dtype; a parameter alone exceeds
        ``max_bytes_per_call``; the parameters do not fit in the free memory of a
        device that reports it (``device.memory_stats()``), naming the largest
        parameters on the worst device.
      ValueError: the key's values would depend on the sharding (a non-threefry key,
        or ``jax_threefry_partitionable`` off).

    Atomic: if anything fails part-way (a runtime error, an out-of-memory, a
    ``KeyboardInterrupt``), every array made so far is deleted, the error gets a note
    naming the mesh group and its paths, and it propagates; nothing partial is returned.

    Examples:
      >>> params = meshinit.materialize(meshinit.plan(specs), jax.random.key(0))
      >>> params = meshinit.materialize(plan, 0, existing={"head": restored_head})
    """
    with _agree.collective("materialize"):  # failures before allocating agree too
        return _materialize(plan, key, existing, max_bytes_per_call, progress)


def _materialize(
    plan: Plan,
    key: Any,
    existing: Mapping[str, Any] | None,
    max_bytes_per_call: int | None,
    progress: bool | None,
) -> Any:
    if not isinstance(plan, Plan):
        raise TypeError(
            f"materialize takes a Plan from meshinit.plan(tree), got "
            f"{type(plan).__name__}; or call meshinit.init(tree, key)"
        )
    key_data, impl = _paths.host_key(key)
    if max_bytes_per_call is None:
        strategy = _strategies.chosen()  # meshinit.options, read per call
    else:
        if isinstance(max_bytes_per_call, bool) or not isinstance(max_bytes_per_call, int):
            raise TypeError(f"max_bytes_per_call must be an int, got {max_bytes_per_call!r}")
        if max_bytes_per_call <= 0:
            raise ValueError(f"max_bytes_per_call must be positive, got {max_bytes_per_call}")
        strategy = Rounds(max_bytes_per_call)  # bounded calls always use rounds
    _progress.check_progress(progress)
    given, problems = given_arrays(plan, existing)
    if problems:  # all at once, with the abstract-mesh and bound problems
        todo = [e for e in plan.entries if id(e) not in given]
        problems += abstract_problems(plan) + bound_problems(todo, max_bytes_per_call)
        raise PlanError(problems, header="cannot materialize this plan:")
    # every process makes its own shards: with another key, another plan or other
    # existing arrays, a replicated parameter would differ between processes
    facts = {
        "key": f"{impl} {np.asarray(key_data).tolist()}"[:200],
        "max_bytes_per_call": str(max_bytes_per_call),
        "the plan": _agree.digest(
            [(e.path, e.spec.shape, str(e.spec.dtype), e.sharding) for e in plan.entries]
        ),
        "existing": _agree.digest(sorted(e.path for e in plan.entries if id(e) in given)),
    }
    _agree.checkpoint("materialize", "inputs", facts)
    return run_plan(
        plan,
        Specs(strategy, key_data, impl),
        given=given,
        max_bytes_per_call=max_bytes_per_call,
        progress=progress,
    )


def init(tree: Any, key: Any, *, progress: bool | None = None) -> Any:
    """``materialize(plan(tree), key)``: plans and allocates in one call.

    Args:
      tree: a tree whose leaves may be ``ParamSpec``s.
      key: an int seed, a typed key or a legacy uint32 key.
      progress: ``True`` or ``False`` forces the progress bar on or off; ``None``
        (default) decides as :func:`materialize` describes.

    Returns:
      The tree with a ready ``jax.Array`` in place of each spec, as
      :func:`materialize` returns it.

    Raises:
      PlanError: what :func:`meshinit.plan` or :func:`materialize` finds.

    Examples:
      >>> m = jax.make_mesh((2, 4), ("a", "b"))
      >>> params = meshinit.init({"w": meshinit.param((8, 8), init, mesh=m)}, 0)
    """
    with _agree.collective("meshinit.init"):  # a plan failing on one process agrees too
        return materialize(plan(tree), key, progress=progress)
