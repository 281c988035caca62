"""Every ``>>>`` example in meshinit's docstrings runs, and shows what it really prints.

Each docstring with examples is one test. It runs with the globals of its own module plus
:func:`namespace`: the names the examples take as given (a mesh, an initializer, specs,
an nnx ``Model``, ...), made once. Lines that need what a test cannot give (a checkpoint
on disk, a downloaded checkpoint) carry ``# doctest: +SKIP``, and their docstring says why.
"""

import copy
import doctest
import functools
import importlib
import logging
import pathlib
import pkgutil
import sys
import warnings

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.nn.initializers import lecun_normal
from jax.sharding import AbstractMesh, AxisType
from jax.sharding import PartitionSpec as P

import meshinit

ROOT = pathlib.Path(__file__).resolve().parents[2]
OPTIONS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE

# The modules and names the examples use as imported.
IMPORTED = dict(
    jax=jax, jnp=jnp, np=np, nnx=nnx, nn=nn, eqx=eqx, optax=optax, meshinit=meshinit,
    warnings=warnings, pathlib=pathlib, lecun_normal=lecun_normal,
    AbstractMesh=AbstractMesh, AxisType=AxisType, P=P,
)  # fmt: skip


def _docstrings() -> list[doctest.DocTest]:
    """The docstrings with examples of every meshinit module, each found once."""
    finder = doctest.DocTestFinder()
    found: dict[tuple, doctest.DocTest] = {}
    for info in pkgutil.walk_packages(meshinit.__path__, "meshinit."):
        if info.name == "meshinit.__main__":
            continue
        module = importlib.import_module(info.name)
        for test in finder.find(module, info.name):
            # Only what the module defines itself; a property has no line number.
            if test.examples and test.filename == module.__file__:
                found.setdefault((test.filename, test.lineno or test.name), test)
    return list(found.values())


DOCSTRINGS = _docstrings()


@functools.cache
def namespace() -> dict:
    """The names the examples use without defining them, made once."""
    log = logging.getLogger("meshinit.doctests")
    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"))
    stage0 = jax.make_mesh((2, 2), ("fsdp", "tensor"), devices=jax.devices()[:4])
    stage1 = jax.make_mesh((2, 2), ("fsdp", "tensor"), devices=jax.devices()[4:])
    init = lecun_normal()
    rules = (("embed", "fsdp"), ("mlp", "tensor"), ("vocab", "tensor"))
    d = 64
    with meshinit.defaults(mesh=mesh, rules=rules):
        specs = {
            "embed": meshinit.param((256, d), init, axes=("vocab", "embed")),
            "layers": [
                {"up": meshinit.param((d, 4 * d), init, axes=("embed", "mlp"))} for _ in range(2)
            ],
            "head": meshinit.param((d, 256), init, axes=("embed", "vocab")),
        }
    plan = meshinit.plan(specs)
    restored_head = np.zeros((d, 256), np.float32)  # as if read from a checkpoint

    class Model(nnx.Module):
        """Ordinary nnx code: its Params are placed on ``mesh`` by flax's own metadata."""

        def __init__(self, rngs):
            sharded = {"out_sharding": ("fsdp", "tensor"), "mesh": mesh}
            self.w = nnx.Param(init(rngs.params(), (d, 4 * d)), **sharded)
            self.layers = nnx.List(
                nnx.Linear(d, d, kernel_metadata=sharded, bias_metadata={"mesh": mesh}, rngs=rngs)
                for _ in range(2)
            )

    factory = lambda: Model(rngs=nnx.Rngs(0))  # noqa: E731
    meshes = [(r"layers\..*", stage0), (r".*", stage1)]  # every pattern matches

    class LinenModel(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            table = nn.with_logical_partitioning(init, ("vocab", "embed"))
            x = nn.Embed(256, d, embedding_init=table)(tokens)
            kernel = nn.with_logical_partitioning(init, ("embed", "mlp"))
            return nn.Dense(4 * d, kernel_init=kernel, use_bias=False)(x)

    model = LinenModel()  # linen's examples plan it
    tokens = jnp.zeros((1, 16), jnp.int32)

    def train_step(params):
        return jax.tree.map(lambda p: 0.9 * p, params)

    return {**IMPORTED, **locals()}


def test_the_docstrings_are_found():
    assert len(DOCSTRINGS) >= 40, [t.name for t in DOCSTRINGS]


@pytest.mark.parametrize("test", DOCSTRINGS, ids=[t.name for t in DOCSTRINGS])
def test_docstring_examples_run(test, tmp_path, monkeypatch):
    # In a directory of its own, where the examples/ the CLI's example names is found.
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the CLI adds the examples' folder
    test = copy.copy(test)
    test.globs = {**test.globs, **namespace()}  # test.globs: a copy of its module's
    out: list[str] = []
    result = doctest.DocTestRunner(optionflags=OPTIONS).run(test, out=out.append)
    assert result.failed == 0, "".join(out)
