"""meshinit: initialize large JAX models straight onto device meshes, exactly.

Declare parameters as lazy specs, plan them to exact ``NamedSharding``s grouped by
mesh, and materialize each group with its own compiled programs (with the default
``rounds`` strategy, one per bucket of signatures: as many for 32 layers as for 8).
Importing meshinit starts no jax backend.
"""

from ._caches import clear_cache as clear_cache
from ._errors import FallbackWarning as FallbackWarning
from ._errors import PeerFailure as PeerFailure
from ._errors import PlanError as PlanError
from ._errors import Problem as Problem
from ._errors import UnusedPatternWarning as UnusedPatternWarning
from ._errors import UnusedTensorWarning as UnusedTensorWarning
from ._paths import param_key as param_key
from ._patterns import searched as searched
from ._plan.entries import MeshGroup as MeshGroup
from ._plan.entries import PlanEntry as PlanEntry
from ._plan.plan import Plan as Plan
from ._plan.planner import plan as plan
from ._plan.shardings import shardings as shardings
from ._run.materialize import init as init
from ._run.materialize import materialize as materialize
from ._run.options import options as options
from ._spec.rules import logical_to_mesh_axes as logical_to_mesh_axes
from ._spec.spec import MESH_AXES as MESH_AXES
from ._spec.spec import ParamSpec as ParamSpec
from ._spec.spec import defaults as defaults
from ._spec.spec import param as param
from ._spec.spec import stacked as stacked


def _version() -> str:
    """The installed distribution's version (pyproject.toml holds the one number)."""
    from importlib import metadata

    try:
        return metadata.version("meshinit")
    except metadata.PackageNotFoundError:  # a checkout on sys.path, not installed
        return "0+unknown"


__version__ = _version()

_ADAPTERS = ("nnx", "eqx", "optax", "linen", "safetensors", "maxtext", "tunix")


def __getattr__(name: str):
    # PEP 562: adapters load on first use, so importing meshinit never imports flax
    # or equinox.
    if name in _ADAPTERS:
        import importlib

        module = importlib.import_module(f"{__name__}.{name}")
        globals()[name] = module
        return module
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_ADAPTERS])
