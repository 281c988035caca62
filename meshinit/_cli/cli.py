"""The command line: ``meshinit demo`` (:mod:`meshinit._cli.demo`) and ``meshinit plan
MODULE:FACTORY``, the plan of a model's specs, or of ordinary nnx code, allocating
nothing."""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Sequence
from typing import Any

from . import png as _png
from . import rules


class _BadInput(Exception):
    """One line for stderr (more only for a PlanError's problems); exit status 2."""


_MESH_FORMAT = "NAME=SIZE pairs joined by commas, e.g. data=16,fsdp=16,tensor=8"
_RETURNS = (
    "a tree of meshinit.param specs, an nnx Module whose Variables hold specs, "
    "an ordinary nnx Module (with flax sharding metadata or none), "
    "or an equinox Module holding specs"
)


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def parse_mesh(text: str) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """``"data=16,fsdp=16,tensor=8"`` -> ``((16, 16, 8), ("data", "fsdp", "tensor"))``."""
    sizes: list[int] = []
    names: list[str] = []
    for part in text.split(","):
        name, eq, size = (s.strip() for s in part.partition("="))
        why = None
        if not eq:
            why = f"{part.strip()!r} is not NAME=SIZE"
        elif not name.isidentifier():
            why = f"{name!r} is not an axis name"
        elif not (size.isdecimal() and int(size) > 0):
            why = f"the size {size!r} of {name} is not a positive integer"
        elif name in names:
            why = f"axis {name!r} appears twice"
        if why:
            raise _BadInput(f"--abstract-mesh {text!r}: {why}; expected {_MESH_FORMAT}")
        names.append(name)
        sizes.append(int(size))
    return tuple(sizes), tuple(names)


_TOO_FEW = (
    re.compile(r"Number of devices (\d+) must be >= the product of mesh_shape \(([\d, ]+)\)"),
    re.compile(r"cannot reshape array of size (\d+) into shape \(([\d, ]+)\)"),
)


def _devices_hint(e: BaseException) -> str:
    """A hint when ``e`` says the factory's mesh needs more devices than exist."""
    for pattern in _TOO_FEW:
        found = pattern.search(str(e))
        if found:
            have = int(found.group(1))
            need = math.prod(int(d) for d in found.group(2).replace(" ", "").split(",") if d)
            if need > have:
                return (
                    f"\nhint: this mesh needs {need} devices and there are {have}; simulate "
                    f"more CPU devices with --devices N (N >= {need}, or what all meshes need)"
                )
    return ""


def _unused_axes(plan: Any, mesh: Any) -> list[str]:
    """The axes of ``mesh`` that no entry on it is sharded over and no rule names."""
    used: set[str] = set()
    for e in plan.entries:
        if e.mesh is not mesh:
            continue
        for part in (*e.sharding.spec, *(t for _, t in e.spec.rules or ())):
            used.update((part,) if isinstance(part, str) else part or ())
    return [a for a in mesh.axis_names if a not in used]


def _import(source: str) -> Any:
    """A module by import name, or by ``.py`` path, as ``python path`` would run it."""
    import importlib
    import importlib.util
    import os
    import pathlib

    if source.endswith(".py") or os.sep in source or "/" in source:
        path = pathlib.Path(source)
        if not path.is_file():
            raise _BadInput(f"no such file: {source}")
        name = path.stem if path.stem.isidentifier() and path.stem not in sys.modules else None
        name = name or "_meshinit_plan_target"
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise _BadInput(f"cannot import {source}: not a Python source file")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses (equinox Modules) look their module up
        folder = str(path.resolve().parent)
        if folder not in sys.path:
            # Its sibling imports work, as for a script; appended, so that a file next
            # to it named like a standard module (plistlib.py) never shadows that module.
            sys.path.append(folder)
        loader = spec.loader
        run = lambda: loader.exec_module(module)  # noqa: E731
    else:
        if "" not in sys.path and os.getcwd() not in sys.path:
            sys.path.append(os.getcwd())  # the console script does not add it; appended too
        module = None

        def run() -> None:
            nonlocal module
            module = importlib.import_module(source)

    try:
        run()
    except ModuleNotFoundError as e:
        if module is None and e.name and (source == e.name or source.startswith(e.name + ".")):
            raise _BadInput(
                f"no module named {e.name!r}; give an importable module name from the "
                f"current directory or sys.path, or a .py file path"
            ) from None
        raise _BadInput(f"importing {source} failed: {_one_line(e)}") from None
    except (Exception, SystemExit) as e:
        raise _BadInput(f"importing {source} failed: {_one_line(e)}") from None
    return module


def _factory(target: str) -> Any:
    import functools
    import inspect

    source, colon, attr = target.rpartition(":")
    if not colon or not source or not attr:
        raise _BadInput(
            f"{target!r}: expected MODULE:FACTORY, e.g. examples/capacity_405b.py:model "
            f"or mypackage.models:specs"
        )
    module = _import(source)
    try:
        factory = functools.reduce(getattr, attr.split("."), module)
    except AttributeError:
        defined = sorted(
            k
            for k, v in vars(module).items()
            if callable(v)
            and not k.startswith("_")
            and getattr(v, "__module__", None) == module.__name__
        )
        hint = f"; it defines {', '.join(defined[:8])}" + (", ..." if len(defined) > 8 else "")
        raise _BadInput(f"{source} has no attribute {attr!r}" + (hint if defined else "")) from None
    if not callable(factory):
        raise _BadInput(
            f"{target} is not callable ({type(factory).__name__}); give a function that "
            f"takes no arguments and returns {_RETURNS}"
        )
    try:
        inspect.signature(factory).bind()
    except TypeError:
        raise _BadInput(
            f"{target}{inspect.signature(factory)} needs arguments; meshinit plan calls it "
            f"with none: wrap it in a function that takes none"
        ) from None
    except ValueError:  # no signature to read (some builtins): let the call tell
        pass
    return factory


def _problems(error: Exception, hint_mesh: bool, limit: int = 10, hint_rules: bool = False) -> str:
    """A PlanError's problems, repeated layers collapsed: ``layers.{0..3}.w: ...``."""
    from .._report.report import collapse_paths

    problems = error.problems  # type: ignore[attr-defined]
    rows = collapse_paths([p.path for p in problems], [p.message for p in problems])
    lines = [
        f"{path}: {problems[ks[0]].message}" if problems[ks[0]].path else problems[ks[0]].message
        for path, ks in rows
    ]
    n = len(problems)
    head = f"{n} problem{'s' if n != 1 else ''} found while planning"
    if len(rows) < n:
        head += f" ({len(rows)} after collapsing repeated layers)"
    shown = [f"  {line}" for line in lines[:limit]]
    if len(lines) > limit:
        shown.append(f"  +{len(lines) - limit} more")
    if hint_mesh and any(p.message.startswith("no mesh given") for p in problems):
        shown.append(
            "hint: --abstract-mesh data=16,fsdp=16,tensor=8 gives specs without a mesh one"
        )
    if hint_mesh and any("sharding metadata but no mesh" in p.message for p in problems):
        shown.append(
            "hint: --abstract-mesh data=16,fsdp=16,tensor=8 gives nnx Variables without a "
            "mesh one, as jax.set_mesh would"
        )
    if hint_rules and any(s in p.message for p in problems for s in rules.ASKED):
        shown.append(rules.HINT)
    return "\n".join([head + ":", *shown])


def _ordinary_nnx(made: Any) -> tuple[str, ...] | None:
    """For an nnx Module none of whose Variables holds a spec (ordinary nnx code): the
    dot-joined paths of the Variables whose metadata names no mesh. None otherwise.

    flax is read from ``sys.modules`` only: an nnx Module implies it was imported.
    """
    from jax.sharding import Mesh

    from .._spec.spec import ParamSpec

    nnx = sys.modules.get("flax.nnx")
    if nnx is None or not isinstance(made, nnx.Module):
        return None
    flat = list(nnx.to_flat_state(nnx.state(made)))
    if any(isinstance(v.get_value(), ParamSpec) for _, v in flat):
        return None
    meshes = [(".".join(map(str, p)), v.get_metadata().get("mesh")) for p, v in flat]
    # As meshinit.nnx reads it: no mesh, or the empty Mesh(), leaves it to the context.
    return tuple(p for p, m in meshes if m is None or (isinstance(m, Mesh) and m.empty))


def _traced_nnx(factory: Any) -> tuple[str, ...] | None:
    """:func:`_ordinary_nnx` of what ``factory()`` builds, found by tracing it once.

    The trace is abstract: ordinary nnx code, whose constructor makes arrays, is seen
    without allocating any. None where flax is not installed, where the factory builds
    something else, or where it cannot be traced (a spec factory may read concrete
    values): such factories are then called as they always were.
    """
    import importlib.util

    try:
        if importlib.util.find_spec("flax") is None:
            return None
        from flax import nnx
    except ImportError:
        return None
    import jax

    found: list[tuple[str, ...] | None] = []

    def probe() -> tuple[()]:
        with nnx.use_eager_sharding(False):  # placing a tracer means nothing; and no mesh
            found.append(_ordinary_nnx(factory()))
        return ()

    try:
        jax.eval_shape(probe)
    except (Exception, SystemExit):
        return None  # called eagerly next; that call reports what it raises
    return found[0]


def _plan_nnx(factory: Any, target: str, mesh: Any, meshless: tuple[str, ...], table: Any) -> Any:
    """``meshinit.nnx.plan(factory)``; ``mesh`` (from --abstract-mesh) goes to the
    ``meshless`` Variables, as a ``jax.set_mesh`` around the factory would give it them."""
    import re

    from .. import nnx as meshinit_nnx
    from .._errors import PlanError

    meshes = None
    if mesh is not None and meshless:
        # one pattern for all of them: meshinit.nnx tries each pattern on each path
        meshes = [("|".join(map(re.escape, meshless)), mesh)]
    try:
        return meshinit_nnx.plan(factory, meshes=meshes, rules=table)
    except PlanError as e:
        raise _BadInput(_problems(e, hint_mesh=mesh is None, hint_rules=table is None)) from None
    except Exception as e:
        raise _BadInput(
            f"meshinit.nnx.plan({target}) failed: {_one_line(e)}{_devices_hint(e)}"
        ) from None


def plan_command(args: argparse.Namespace) -> int:
    """``meshinit plan MODULE:FACTORY``: prints the plan of the factory's specs."""
    import contextlib

    if args.png:
        try:
            _png.check(args.png)
        except _png.Unwritable as e:
            raise _BadInput(str(e)) from None
    mesh_shape = parse_mesh(args.abstract_mesh) if args.abstract_mesh is not None else None
    table = rules.parse_rules(args.rules) if args.rules is not None else None
    if args.devices is not None:
        if args.devices < 1:
            raise _BadInput(f"--devices must be a positive number, got {args.devices}")
        import jax

        jax.config.update("jax_platforms", "cpu")
        try:
            jax.config.update("jax_num_cpu_devices", args.devices)
        except RuntimeError:
            raise _BadInput(
                f"--devices {args.devices}: jax already started its backend with "
                f"{len(jax.devices())} devices in this process"
            ) from None

    factory = _factory(args.target)

    from jax.sharding import AbstractMesh, AxisType

    import meshinit

    from .._plan import record as _record
    from .._report import json_text as _json_text
    from .._report import report as _report

    mesh = None
    if mesh_shape is not None:  # Auto axes, as Mesh(...) has: AbstractMesh's default
        sizes, names = mesh_shape  # is Auto on jax 0.10 and Explicit from 0.11
        mesh = AbstractMesh(sizes, names, axis_types=(AxisType.Auto,) * len(names))
    made: Any = None  # what factory() returned, if it was called
    with contextlib.ExitStack() as stack:
        if mesh is not None:
            stack.enter_context(meshinit.defaults(mesh=mesh))
        if args.replicated:
            axes = tuple(a.strip() for a in args.replicated.split(",") if a.strip())
            stack.enter_context(meshinit.defaults(replicated=axes))
        if table is not None:  # specs without rules of their own take these
            stack.enter_context(meshinit.defaults(rules=table))
        # Ordinary nnx code makes its arrays as it is built: it is traced, never called,
        # and planned as meshinit.nnx.plan plans it.
        meshless = _traced_nnx(factory)
        if meshless is None:
            try:
                made = factory()
            except (Exception, SystemExit) as e:
                raise _BadInput(
                    f"{args.target}() raised {_one_line(e)}{_devices_hint(e)}"
                ) from None
            meshless = _ordinary_nnx(made)  # one that cannot be traced: nnx.plan says why
        if meshless is not None:
            made = None
            plan = _plan_nnx(factory, args.target, mesh, meshless, table)
    ordinary_nnx = meshless is not None
    if not ordinary_nnx:
        tree = made
        nnx = sys.modules.get("flax.nnx")
        if nnx is not None and isinstance(made, nnx.Module):
            from ..nnx import spec_tree

            tree = spec_tree(made)  # the tree meshinit.nnx.materialize plans, same paths
        try:
            plan = meshinit.plan(tree)
        except meshinit.PlanError as e:
            problems = _problems(e, hint_mesh=mesh is None, hint_rules=table is None)
            raise _BadInput(problems) from None
        except Exception as e:
            raise _BadInput(
                f"planning what {args.target}() returned failed: {_one_line(e)}"
            ) from None
    if not plan.entries:
        what = (
            "an nnx Module whose Variables hold no arrays"
            if ordinary_nnx
            else f"a {type(made).__name__} with no meshinit.param specs in it"
        )
        raise _BadInput(f"{args.target}() returned {what}; return {_RETURNS}")

    if mesh is not None:
        unused = _unused_axes(plan, mesh)
        if unused:
            print(
                f"meshinit plan: warning: --abstract-mesh axis "
                f"{', '.join(map(repr, unused))} is used by no spec or rule, so every "
                f"parameter is replicated over it (check the rules for a typo)",
                file=sys.stderr,
            )

    def source(group: meshinit.MeshGroup) -> str:
        # jax interns AbstractMesh: a spec that binds an equal one binds this very mesh.
        if group.mesh is mesh:
            return "--abstract-mesh"
        return "metadata" if ordinary_nnx else "spec"

    sources = source if mesh is not None else None
    if args.json:
        print(_json_text.to_json(_record.to_dict(plan, source=sources)))
    elif args.compact:
        print(_report.compact(_record.record(plan, sources)))
    else:
        print(_report.table(_record.record(plan, sources)))
    if args.png:
        try:
            written = _png.write(plan, args.png)
        except _png.Unwritable as e:
            raise _BadInput(str(e)) from None
        print(f"meshinit plan: wrote {' and '.join(written)}", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """The ``meshinit`` command line; returns the exit status.

    Args:
      argv: the arguments after the program name; None reads ``sys.argv``.

    Returns:
      0 on success, 1 if the demo finds a wrong placement, 2 on bad input (after
      one line on stderr, never a traceback).

    Examples:
      >>> main(["plan", "examples/capacity_405b.py:model",
      ...       "--abstract-mesh", "data=16,fsdp=16,tensor=8", "--compact"])
      a row stands for the n parameters its path pattern names; per device sums all n
      ...
      total: 1137 params, 756.0 GiB, 1 mesh, most on one device 378.0 MiB
      0
    """
    parser = argparse.ArgumentParser(prog="meshinit", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p_demo = sub.add_parser("demo", help="build, plan and materialize a multi-mesh model")
    p_demo.add_argument("--devices", type=int, default=8, help="simulated CPU devices (8)")
    p_demo.add_argument("--png", metavar="FILE", help=_png.HELP)
    p_plan = sub.add_parser(
        "plan",
        help="print where every parameter of a model goes, allocating nothing",
        description=(
            "Prints the plan of what FACTORY() builds: "
            + _RETURNS
            + ". Nothing is allocated. FACTORY is first traced once, abstractly: an "
            "ordinary nnx Module, whose constructor makes arrays, is never called but "
            "planned as meshinit.nnx.plan(FACTORY) plans it, with nnx paths. Anything "
            "else (or a factory that cannot be traced) is then called, and what it "
            "returns is planned."
        ),
    )
    p_plan.add_argument(
        "target",
        metavar="MODULE:FACTORY",
        help="an importable module or a .py file, and a function in it taking no arguments",
    )
    p_plan.add_argument(
        "--devices",
        type=int,
        metavar="N",
        help="simulate N CPU devices (sets jax_platforms=cpu) for factories that build meshes",
    )
    p_plan.add_argument(
        "--abstract-mesh",
        metavar="AXES",
        help=(
            "give specs without a mesh an AbstractMesh, e.g. data=16,fsdp=16,tensor=8; "
            "for ordinary nnx code, the Variables whose metadata names no mesh get it, as "
            "a jax.set_mesh around the factory would give it them"
        ),
    )
    p_plan.add_argument(
        "--replicated",
        metavar="AXES",
        help=(
            "mesh axes the parameters are meant to be replicated over, e.g. data (HSDP): "
            "no shardable hint (!) for them, as meshinit.defaults(replicated=...) gives"
        ),
    )
    p_plan.add_argument("--rules", metavar="RULES", help=rules.HELP)
    view = p_plan.add_mutually_exclusive_group()
    view.add_argument("--json", action="store_true", help="print Plan.to_json()")
    view.add_argument("--compact", action="store_true", help="collapse repeated layers")
    p_plan.add_argument("--png", metavar="FILE", help=_png.HELP)
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import demo

        try:
            if args.png:
                _png.check(args.png)
            return demo(args.devices, png=args.png)
        except _png.Unwritable as e:
            print(f"meshinit demo: {e}", file=sys.stderr)
            return 2
    if args.command == "plan":
        try:
            return plan_command(args)
        except (_BadInput, rules.RulesError) as e:
            print(f"meshinit plan: {e}", file=sys.stderr)
            return 2
        except BrokenPipeError:  # `meshinit plan ... | head`: the reader has gone
            import os

            # Python would flush stdout again at exit and print a traceback for that.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 1
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
