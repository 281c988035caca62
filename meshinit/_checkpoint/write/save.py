"""An export from start to end (:func:`save`): the recipes of every stored tensor
(``names=`` in reverse, or a framework's saving side), the files, one agreement, then
batch by batch one compiled program per recipe signature that makes each stored tensor
on the devices, gathered onto every process of its parameters; each process copies to
its host only the tensors of its own files and writes them, front to back, on a
thread beside the next batch's programs; then the commit.

Memory: a batch's programs hold at most half of ``max_inflight_bytes`` of gathered
tensors on each process's devices, and the tensors waiting for this process's writer
at most the other half (where one tensor is larger, it is the bound). On CPU the
devices' memory is the host's.

Failure: any error, on any process, fails every process (the collective call's
agreement, as ``load``); each process then aborts its uploads and removes what it
wrote, and every process removes every file name of the export (a process that died
cannot remove its own), so nothing under ``dest`` is left that a loader would take for
a checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..._errors import PlanError, Problem
from ..._run import agree as _agree
from ..._run import progress as _progress
from ..encodings.fp8 import encode as _fp8
from ..layout.recipe import Recipe
from ..maps import framework as _framework
from ..maps import names as _names
from ..store.sink import Sink
from . import files as _files
from . import inputs as _inputs
from . import programs as _programs
from . import reverse as _reverse
from . import writer as _writer

BYTES_WRITTEN = "/meshinit/safetensors/bytes_written"
"""The ``jax.monitoring`` scalar each process records once per export: the bytes of
the files it wrote (headers included)."""


DEFAULT_INFLIGHT = 1 << 30
"""``max_inflight_bytes``'s default, as ``load``'s."""


@dataclasses.dataclass(frozen=True)
class Export:
    """What :func:`meshinit.safetensors.save` wrote.

    Attributes:
      dest: where (as given).
      files: the files written, the index and ``config.json`` included, in order.
      total_size: the bytes of the stored tensors (the index's ``total_size``).
      bytes_by_process: the bytes of the files each process wrote (headers included;
        the index and ``config.json`` not), by process index.
      bytes_written: this process's entry of ``bytes_by_process``.
      seconds: the time the export took on this process.

    Examples:
      >>> report = meshinit.safetensors.save(arrays, "export/")  # doctest: +SKIP
      >>> report.files, report.bytes_by_process  # doctest: +SKIP
      (('model.safetensors',), (9648,))
    """

    dest: str
    files: tuple[str, ...]
    total_size: int
    bytes_by_process: tuple[int, ...]
    bytes_written: int
    seconds: float


def save(
    given: Any,
    dest: Any,
    names: Any,
    dtype: Any,
    quantize: str | None,
    modules_to_not_convert: Sequence[str] | None,
    max_shard_size: Any,
    config: Any,
    storage_options: Any,
    max_inflight_bytes: int | None,
    overwrite: bool,
    progress: bool | None,
    what: str,
) -> Export:
    """The export; every problem raised at once, before a byte is written."""
    started = time.monotonic()
    cast = _dtype(dtype)
    if quantize not in (None, "fp8"):
        raise TypeError(f'quantize must be None or "fp8", got {quantize!r}')
    if modules_to_not_convert is not None and (
        isinstance(modules_to_not_convert, str)
        or not all(isinstance(m, str) for m in modules_to_not_convert)
    ):
        raise TypeError(
            f"modules_to_not_convert must be a list of module names, got {modules_to_not_convert!r}"
        )
    if modules_to_not_convert is not None and quantize is None:
        raise TypeError('modules_to_not_convert is for quantize="fp8"')
    shard = None if max_shard_size is None else _files.shard_size(max_shard_size)
    cfg = _config(config)
    budget = DEFAULT_INFLIGHT if max_inflight_bytes is None else max_inflight_bytes
    if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
        raise TypeError(
            f"max_inflight_bytes must be a positive int or None, got {max_inflight_bytes!r}"
        )
    if not isinstance(overwrite, bool):
        raise TypeError(f"overwrite must be a bool, got {overwrite!r}")
    _progress.check_progress(progress)
    sink = Sink(dest, storage_options)

    flat, problems = _inputs.arrays_of(given)
    arrays = {p: a for p, a in flat.items() if isinstance(a, jax.Array)}
    planned = {p: (tuple(a.shape), np.dtype(a.dtype)) for p, a in arrays.items()}
    recipes, found = _recipes(names, planned, cfg, what)
    problems += found
    if cfg is not None and _tied(cfg):
        recipes = [r for r in recipes if r.name != "lm_head.weight"]
    works, stored, found = _works(recipes, arrays, cast, quantize, modules_to_not_convert)
    problems += found
    if not stored and not problems:
        problems.append(
            Problem(str(dest), "nothing to write: no parameter maps to a stored tensor")
        )
    existing = [] if problems else sink.checkpoint_files()
    if existing and not overwrite:
        problems.append(
            Problem(
                str(sink),
                f"already holds a checkpoint ({', '.join(sorted(existing)[:4])}"
                f"{', ...' if len(existing) > 4 else ''}): choose an empty destination, or "
                f"pass overwrite=True to replace it",
            )
        )
    if problems:
        raise PlanError(problems, header=f"{what}: nothing was written:")

    me, count = jax.process_index(), jax.process_count()
    plan = _files.plan(stored, shard, count)
    if quantize == "fp8":
        every = [s.name for s in stored]
        shapes = {s.name: s.shape for s in stored}
        try:
            modules = _fp8.not_converted(every, shapes, modules_to_not_convert)
        except ValueError as e:
            raise PlanError(
                [Problem("modules_to_not_convert", str(e))], header=f"{what}: nothing was written:"
            ) from None
        cfg = {**(cfg or {}), "quantization_config": _fp8.quantization_config(modules)}
    facts = {
        "dest": str(sink),
        "files": _agree.digest([(f.name, f.writer, f.header) for f in plan.files]),
        "programs": _agree.digest([(w.recipe.paths, w.recipe.build, w.devices) for w in works]),
        "config": _agree.digest([json.dumps(cfg, sort_keys=True, default=str)]),
        "max_inflight_bytes": str(budget),
        "existing": ", ".join(sorted(existing)),
    }
    _agree.checkpoint(what, "inputs", facts)
    names_all = [f.name for f in plan.files] + [_writer.PARTIAL]
    committed: list[str] = []
    writer = _writer.Writer(sink, plan, me, budget // 2, progress)
    try:
        if existing:  # the old checkpoint's config.json too: it may describe other
            if me == 0:  # weights (a quantization_config over bf16 ones)
                _raise_undeleted(sink, [*existing, "config.json"])
            _agree.checkpoint(what, "cleared")
        writer.start()
        _run(works, plan, writer, budget, what)
        writer.finish()
        _agree.checkpoint(what, "written")
        if me == (plan.files[0].writer if plan.index is None else 0):
            committed = _commit(sink, plan, cfg, writer)
        _agree.checkpoint(what, "committed")
    except BaseException:
        writer.abort()
        undone = sink.delete([*names_all, *committed, *writer.opened])
        del undone  # best effort: the error that failed the export is the one raised
        raise
    total = sum(s.nbytes for s in stored)
    written = plan.bytes_by_process(count)
    jax.monitoring.record_scalar(BYTES_WRITTEN, float(written[me]))
    listed = [f.name if f.name != _writer.PARTIAL else _files.LONE for f in plan.files]
    if plan.index is not None:
        listed.append(_files.INDEX)
    if cfg is not None:
        listed.append("config.json")
    return Export(
        str(dest), tuple(listed), total, tuple(written), written[me], time.monotonic() - started
    )


# ------------------------------------------------------------------- arguments


def _dtype(dtype: Any) -> str | None:
    if dtype is None:
        return None
    try:
        d = np.dtype(dtype)
    except TypeError as e:
        raise TypeError(
            f"dtype must be a floating dtype (jnp.bfloat16, 'float32'), got {dtype!r}"
        ) from e
    if not jnp.issubdtype(d, jnp.floating):
        raise TypeError(f"dtype must be a floating dtype (jnp.bfloat16, 'float32'), got {d}")
    return d.name


def _config(config: Any) -> dict[str, Any] | None:
    if config is None:
        return None
    if hasattr(config, "to_dict") and not isinstance(config, Mapping):
        config = config.to_dict()
    if not isinstance(config, Mapping):
        raise TypeError(
            f"config must be a dict or have to_dict() (a transformers config), got "
            f"{type(config).__name__}"
        )
    try:
        json.dumps(config)
    except (TypeError, ValueError) as e:
        raise TypeError(f"config must be JSON: {e}") from e
    return dict(config)


def _tied(cfg: Mapping[str, Any]) -> bool:
    text = cfg.get("text_config")
    inner = text.get("tie_word_embeddings") if isinstance(text, Mapping) else None
    return bool(cfg.get("tie_word_embeddings", inner))


def _recipes(
    names: Any, planned: Mapping[str, tuple[tuple[int, ...], np.dtype]], cfg: Any, what: str
) -> tuple[list[Recipe], list[Problem]]:
    if isinstance(names, _framework.FrameworkMap):
        made = names.saving(planned, cfg)
        if made is not None:
            return made
        if names.needs_config and cfg is None:
            fix = "pass config= (the model's config.json, which the export also writes)"
            return [], [Problem("config=", f"{names.family} needs the checkpoint's config: {fix}")]
        table, problems = _framework.built(names, cfg, "config=", {}, planned)
        if problems:
            return [], problems
    else:
        table, problems, _ = _names.targets(list(planned), names, what)
    recipes, found = _reverse.recipes(table, planned)
    return recipes, problems + found


# ------------------------------------------------------------- programs


def _works(
    recipes: Sequence[Recipe],
    arrays: Mapping[str, jax.Array],
    cast: str | None,
    quantize: str | None,
    modules: Sequence[str] | None,
) -> tuple[list[_programs.Work], list[_files.Stored], list[Problem]]:
    works, stored, problems = [], [], []
    seen: dict[str, str] = {}
    for r in recipes:
        sources = tuple(arrays[p] for p in r.paths)
        orders = {tuple(_programs.order(a)) for a in sources}
        if len(orders) > 1:
            problems.append(
                Problem(
                    r.name,
                    f"is made of parameters on different devices or device orders "
                    f"({', '.join(r.paths)}): place them on one mesh",
                )
            )
            continue
        (devices,) = orders
        writers = tuple(sorted({d.process_index for d in devices}))
        fp8 = quantize == "fp8" and _fp8.converted(r.name, r.shape, modules or ())
        if fp8 and not jnp.issubdtype(r.dtype, jnp.floating):
            fp8 = False
        if fp8:
            w_dtype = np.dtype(jnp.float8_e4m3fn)
            rows, cols = r.shape[-2:]
            b0, b1 = _fp8.BLOCK
            scale_shape = (*r.shape[:-2], -(-rows // b0), -(-cols // b1))
            outs = [
                _programs.Out(_files.Stored(r.name, w_dtype, r.shape, writers), 0),
                _programs.Out(
                    _files.Stored(
                        f"{r.name}_scale_inv", np.dtype(np.float32), scale_shape, writers
                    ),
                    1,
                ),
            ]
        else:
            out_dtype = (
                np.dtype(cast) if cast and jnp.issubdtype(r.dtype, jnp.floating) else r.dtype
            )
            outs = [_programs.Out(_files.Stored(r.name, out_dtype, r.shape, writers), 0)]
        for o in outs:
            if o.stored.name in seen:
                problems.append(
                    Problem(
                        o.stored.name, f"is written twice: by {seen[o.stored.name]} and {r.origin}"
                    )
                )
            seen[o.stored.name] = r.origin
        works.append(_programs.Work(r, sources, devices, outs, cast, fp8))
        stored += [o.stored for o in outs]
    return works, stored, problems


def _run(
    works: Sequence[_programs.Work],
    plan: _files.Files,
    writer: _writer.Writer,
    budget: int,
    what: str,
) -> None:
    me = jax.process_index()
    mine = {t.name for f in plan.written_by(me) for t in f.tensors}
    for number, whole in enumerate(_programs.batches(works, plan, budget // 2)):
        writer.check()
        at = f"batch {number} ({_agree.digest([w.recipe.name for w in whole])})"
        # a process that holds none of a recipe's parameters takes no part in its program
        batch = [w for w in whole if any(d.process_index == me for d in w.devices)]
        inputs = [tuple(_programs.auto(a) for a in w.sources) for w in batch]
        programs = [_programs.program(w, x) for w, x in zip(batch, inputs, strict=True)]
        writer.wait_room(
            sum(o.stored.nbytes for w in batch for o in w.outs if o.stored.name in mine)
        )
        _agree.checkpoint(what, at)
        failed: BaseException | None = None
        with _agree.uninterrupted():
            for w, x, compiled in zip(batch, inputs, programs, strict=True):
                indices = tuple(np.int32(i) for i in w.recipe.at)
                try:
                    made = compiled(x, indices)
                except BaseException as e:  # its peers are in it: they must stop
                    _agree.left_collectives(e)
                    raise
                _agree.settle(made[0], f"{at}, {w.recipe.name}")
                if w.fp8 and failed is None and not bool(made[-1]):  # the same on every
                    failed = _not_finite(w, what)  # process: each raises it
                for o in w.outs:
                    out = made[o.output]
                    if o.stored.name in mine and failed is None:
                        try:
                            writer.hand(o.stored.name, out)
                        except BaseException as e:  # after its collective: run the rest
                            failed = e
                    else:
                        out.delete()
        if failed is not None:
            raise failed


# ------------------------------------------------------------------- writing


def _not_finite(work: _programs.Work, what: str) -> PlanError:
    problem = Problem(
        work.recipe.name,
        f"holds NaN or inf (from {work.recipe.origin}): its FP8 block scale would spread it "
        f"over its whole 128 x 128 block; fix the values, or leave the tensor unquantized "
        f"(modules_to_not_convert)",
    )
    return PlanError([problem], header=f"{what}: nothing is left written:")


# -------------------------------------------------------------------- commit


def _commit(
    sink: Sink, plan: _files.Files, cfg: Mapping[str, Any] | None, writer: _writer.Writer
) -> list[str]:
    """The last writes, by one process once every process's files are written (process
    0, or a lone file's writer): ``config.json``, then the index, or the lone file
    (renamed from its hidden name on a disk; in a bucket its upload closed). The names
    written."""
    done = []
    if cfg is not None:
        done.append("config.json")
        sink.put("config.json", (json.dumps(cfg, indent=2, sort_keys=True) + "\n").encode())
    if plan.index is None:
        done.append(_files.LONE)
        if writer.lone is None:
            sink.rename(_writer.PARTIAL, _files.LONE)
        else:
            written = writer.lone.close()
            writer.lone = None
            if written != plan.files[0].size:
                where = f"{sink}/{_files.LONE}"
                raise PlanError([Problem(where, f"wrote {written} of {plan.files[0].size} bytes")])
    else:
        done.append(_files.INDEX)
        sink.put(_files.INDEX, plan.index)
    return done


def _raise_undeleted(sink: Sink, existing: Sequence[str]) -> None:
    left = sink.delete(existing)
    if left:
        raise PlanError(
            [Problem(str(sink), f"could not remove the old checkpoint: {'; '.join(left)}")]
        )
