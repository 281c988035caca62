"""Differential fuzzing of the constructor engine behind meshinit.nnx/linen/eqx.init.

Hypothesis draws small constructors (2-6 variables) out of jax's random functions and
initializers, key chains, scalars of every Python, numpy and jax kind, shared jitted
helpers, control flow, remat and stacking, in several dtypes and shapes (narrow last
dimensions of 1 to 8 included), with some variables sharded on meshes of the 8
simulated CPU devices, in memory kinds, or moved to a stage mesh by ``meshes=`` (made
inside a loop or branch, under a context mesh of another size). Each drawn constructor
is written as ordinary flax nnx, flax linen and equinox code, and built under a drawn
jax configuration (:class:`Config`: ``jax_threefry_partitionable``,
``jax_enable_x64``, the default PRNG implementation, and meshinit's host bound, low
in most examples, so that most variables go through the compiled programs); an nnx
constructor is sometimes built a second time with partitionable threefry flipped. What
the engine builds is compared with the same code run eagerly and under ``jax.jit``,
under the same configuration:

* every output lands exactly where the adapter's own ``plan(...)`` says, by path, and
  the plan says what the code's annotations (or placements) say, memory kinds included;
* values follow :func:`assert_matches`: bit-identical to ``jax.jit`` of the same
  construction, else within a stated tolerance of eager construction; integers, bools
  and PRNG keys are always bit-identical to eager;
* where an adapter refuses the configuration (linen and equinox take the key as an
  argument and refuse one whose values would depend on the sharding: rbg, unsafe_rbg,
  threefry without partitionable), plan and init both raise its ValueError; where the
  engine falls back (a closed-over key of another implementation than threefry), it
  warns its documented reason and the values still keep the contract.

``MESHINIT_FUZZ_EXAMPLES=N`` sets the total number of drawn constructors across the
three frameworks (default 200 with ``MESHINIT_TESTS=all``); the draws are derandomized,
so a run is repeatable. ``MESHINIT_FUZZ_PART=k/n`` makes part ``k`` of ``n``: ``N/n``
draws from a seed of their own. CI's two stacks run parts 1/2 and 2/2, 200 different
constructors in all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import math
import os
import re
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import FUZZ_PART, examples
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import meshinit
from meshinit._engine import trace as _trace

EXAMPLES = int(os.environ.get("MESHINIT_FUZZ_EXAMPLES", examples(200, 6)))
"""Drawn constructors in all: 200 (CI's size) with ``MESHINIT_TESTS=all``, 6 in the
fast tier (2 each for nnx, linen and equinox: each framework's path runs);
``MESHINIT_FUZZ_EXAMPLES`` sets it outright. A run that is one part of several
(:data:`helpers.FUZZ_PART`) draws its share."""


RELEASE_EVERY = 50
"""Examples between releases of every compiled executable (:func:`released`)."""
_runs = [0]


def released() -> None:
    """Every ``RELEASE_EVERY`` calls, drops jax's and meshinit's compiled executables.

    Each XLA CPU executable keeps memory maps of its code, and a process may hold at
    most ``vm.max_map_count`` of them (65530 by default). A few thousand drawn
    constructors compile enough distinct programs (the engine's, eager's and
    ``jax.jit``'s) to reach it, and jaxlib then segfaults inside a compile; measured:
    39,481 maps after 1,400 examples, a segfault at about 1,800.
    """
    _runs[0] += 1
    if _runs[0] % RELEASE_EVERY == 0:
        jax.clear_caches()
        meshinit.clear_cache()
        gc.collect()


def _settings(share: float) -> Callable[[Callable], Callable]:
    """``share`` of :data:`EXAMPLES`, and of those this run's part
    (:data:`helpers.FUZZ_PART`): one part is derandomized, part ``k`` of several is
    seeded with ``k``, so that the parts draw different constructors."""
    k, n = FUZZ_PART
    chosen = settings(
        max_examples=max(1, round(EXAMPLES * share / n)),
        deadline=None,
        derandomize=True,  # the same draws on every run: CI is repeatable
        database=None,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    if n == 1:
        return chosen
    return lambda test: seed(k)(chosen(test))  # a seed overrides derandomize


# ----------------------------------------------------------------------------- the contract

ULP_TOLERANCE = 8
"""``k`` in :func:`assert_matches`: the allowed error, in units of the dtype's epsilon
times the sum of the magnitudes of the terms."""

_EPS = {
    np.dtype(jnp.float32): float(jnp.finfo(jnp.float32).eps),
    np.dtype(jnp.bfloat16): float(jnp.finfo(jnp.bfloat16).eps),
    np.dtype(jnp.float16): float(jnp.finfo(jnp.float16).eps),
}


def _is_key(x: Any) -> bool:
    return jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)


def _bits(x: Any) -> np.ndarray:
    if _is_key(x):
        x = jax.random.key_data(x)
    x = np.asarray(x)
    return x.view(np.dtype(f"u{x.dtype.itemsize}")) if _floating(x.dtype) else x


def _floating(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)  # bfloat16's numpy kind is "V", not "f"


def assert_matches(
    engine: Any,
    eager: Any,
    jitted: Any,
    *,
    terms: Any = None,
    eps_dtype: Any = None,
    path: str = "",
) -> str:
    """Asserts that the engine's value of one variable keeps the value contract.

    The contract, for a variable whose eager value is ``eager`` and whose value under
    ``jax.jit`` of the same constructor is ``jitted``:

    1. Shape and dtype equal eager's (a PRNG key array keeps its key type, for example
       ``key<fry>``, and its implementation).
    2. Integer, bool and PRNG key values are bit-identical to eager (key data compared).
    3. A float value is bit-identical to ``jitted``, or else, element by element,

           |engine - eager| <= K * eps * S

       where ``K = ULP_TOLERANCE`` (8), ``eps`` is the machine epsilon
       (``jnp.finfo(d).eps``: 2**-23 for float32, 2**-7 for bfloat16, 2**-10 for
       float16) of the least precise float dtype ``d`` the value's computation passes
       through (``eps_dtype``; default the variable's dtype), and ``S`` (``terms``) is
       the sum of the magnitudes of the terms that are added to form the value
       (default ``|eager|``): for ``x * c + n``, ``S = |x| * |c| + |n|``; for
       ``jax.random.uniform(k, minval=lo, maxval=hi)``, whose ``u * (hi - lo) + lo``
       XLA contracts into one fused multiply-add, ``S = |value - lo| + |lo|``. NaN
       must meet NaN and an infinity the same infinity.

    This is the error one rounding more or less per term can make (a fused
    multiply-add where eager rounds twice, or the reverse), which is what moves a
    compiled program's floats away from eager's: near a cancellation (``x * 1.37 + n``
    close to zero) it is thousands of ulp of the result, yet at most a few ulp of the
    terms.

    Args:
      engine: what the engine made.
      eager: the same variable from eager construction.
      jitted: the same variable from ``jax.jit`` of the construction.
      terms: ``S`` above, an array broadcastable to the value; None for ``|eager|``.
      eps_dtype: the least precise float dtype of the computation; None for the
        variable's dtype.
      path: the variable's path, for the messages.

    Returns:
      ``"jit"`` when bit-identical to ``jitted``, ``"eager"`` when bit-identical to
      eager only, ``"tolerance"`` when within the tolerance only.

    Raises:
      AssertionError: saying what a user would see differ.
    """
    assert _is_key(engine) == _is_key(eager), (
        f"{path}: eager construction gives {eager.dtype}, the engine gives {engine.dtype}"
    )
    if _is_key(eager):
        assert jax.random.key_impl(engine) == jax.random.key_impl(eager), (
            f"{path}: eager gives a {jax.random.key_impl(eager)} key, the engine a "
            f"{jax.random.key_impl(engine)} key"
        )
    assert (engine.shape, engine.dtype) == (eager.shape, eager.dtype), (
        f"{path}: eager construction gives {eager.dtype}{list(eager.shape)}, "
        f"the engine gives {engine.dtype}{list(engine.shape)}"
    )
    got, want = _bits(engine), _bits(eager)
    if _is_key(eager) or not _floating(eager.dtype):
        differ = got != want
        assert not differ.any(), (
            f"{path}: {int(differ.sum())} of {differ.size} values differ from eager "
            f"construction (integers, bools and keys must be bit-identical); first at "
            f"{np.argwhere(differ)[0].tolist()}: eager {want[differ][0]}, engine {got[differ][0]}"
        )
        return "jit" if np.array_equal(got, _bits(jitted)) else "eager"
    if np.array_equal(got, _bits(jitted)):
        return "jit"
    if np.array_equal(got, want):
        return "eager"
    a = np.asarray(engine, np.float64)
    b = np.asarray(eager, np.float64)
    s = np.abs(b) if terms is None else np.broadcast_to(np.asarray(terms, np.float64), b.shape)
    eps = _EPS[np.dtype(eps_dtype if eps_dtype is not None else eager.dtype)]
    same_special = (np.isnan(a) & np.isnan(b)) | (np.isinf(b) & (a == b))
    err = np.where(same_special, 0.0, np.abs(a - b))
    err = np.where(np.isnan(err), np.inf, err)
    bound = ULP_TOLERANCE * eps * s
    bad = err > bound
    if bad.any():
        i = tuple(np.argwhere(bad)[0])
        raise AssertionError(
            f"{path}: {int(bad.sum())} of {bad.size} values are neither jax.jit's bits nor "
            f"within {ULP_TOLERANCE} * eps * (sum of term magnitudes) of eager construction; "
            f"first at {list(i)}: eager {b[i]!r}, jit {np.asarray(jitted, np.float64)[i]!r}, "
            f"engine {a[i]!r}, error {err[i]:.3g} > bound {bound[i]:.3g} "
            f"({err[i] / (eps * s[i]) if s[i] else np.inf:.1f} eps * S)"
        )
    return "tolerance"


def error_in_eps(engine: Any, eager: Any, terms: Any, eps_dtype: Any) -> float:
    """The largest ``|engine - eager| / (eps * S)``: what ``K`` would have to be."""
    a, b = np.asarray(engine, np.float64), np.asarray(eager, np.float64)
    s = np.broadcast_to(np.asarray(terms, np.float64), b.shape)
    eps = _EPS[np.dtype(eps_dtype)]
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where(a == b, 0.0, np.abs(a - b) / (eps * s))
    return float(np.nanmax(r)) if r.size else 0.0


# ----------------------------------------------------------------------------- meshes


@functools.cache
def meshes() -> dict[str, Mesh]:
    """A small fixed set, reused by every example so compiles stay cached."""
    devices = np.array(jax.devices())
    return {
        "ab": Mesh(devices.reshape(2, 4), ("a", "b")),  # Auto axes
        "ab_explicit": jax.make_mesh((2, 4), ("a", "b")),  # Explicit axes
        "xyz": Mesh(devices.reshape(2, 2, 2), ("x", "y", "z")),
        "stage": Mesh(devices[4:].reshape(2, 2), ("a", "b")),  # disjoint from devices 0-3
        "c": Mesh(devices, ("c",)),
    }


AUTO_MESHES = ("ab", "xyz", "stage", "c")
FUZZ_RULES = (("A", "a"), ("B", "b"), ("X", "x"), ("Y", "y"), ("Z", "z"), ("C", "c"))
LOGICAL = {mesh_axis: logical for logical, mesh_axis in FUZZ_RULES}


# ----------------------------------------------------------------------------- recipes


@dataclasses.dataclass(frozen=True)
class Scalar:
    """A scalar operand, spelled as a Python, numpy or jax scalar."""

    value: float
    kind: str  # float | int | np_float32 | np_int32 | jnp | jnp_closed
    prob: bool = False  # a probability: it shrinks with the layer index instead of growing

    def at(self, layer: int, vary: bool) -> float:
        if not vary:
            return self.value
        return self.value / (1 + layer) if self.prob else self.value * (1 + layer)

    def spelled(self, layer: int, vary: bool) -> Callable[[], Any]:
        """The scalar as the constructor of layer ``layer`` writes it."""
        v = self.at(layer, vary)
        if self.kind == "float":
            return lambda: float(v)
        if self.kind == "int":
            return lambda: int(round(v)) or 1
        if self.kind == "np_float32":
            return lambda: np.float32(v)
        if self.kind == "np_int32":
            return lambda: np.int32(round(v) or 1)
        if self.kind == "jnp":
            return lambda: jnp.asarray(v)  # made inside the constructor
        closed = jnp.asarray(v)  # a concrete array the constructor closes over
        return lambda: closed

    def magnitude(self, layer: int, vary: bool) -> float:
        return abs(float(np.asarray(self.spelled(layer, vary)())))


@dataclasses.dataclass(frozen=True)
class Leaf:
    """What a variable starts from: a jax random function or initializer, a captured
    numpy constant, another variable (a tie), or a framework layer (``linear``)."""

    kind: str
    dtype: str  # the dtype it is made in (a linear layer's param_dtype)
    args: tuple = ()


@dataclasses.dataclass(frozen=True)
class Var:
    """One drawn variable: leaf, key chain, scalar ops, wrapper, dtype and placement."""

    name: str
    shape: tuple[int, ...]  # the variable's shape (stacked wrappers included)
    dtype: str
    leaf: Leaf
    keys: tuple = ()  # steps: ("split", n, i) | ("fold_in", d) | ("split_pair",)
    ops: tuple = ()  # ("mul"|"add"|"fma", Scalar) | ("mask", p) | ("clip",) | ("astype", d)
    wrapper: str = "none"  # none|cond|fori|fori_closure|while|scan|scan_carry|vmap|checkpoint
    stack: int = 1  # leading length for scan / scan_carry / vmap
    vary: bool = False  # its scalars change with the layer index
    axes: tuple | None = None  # mesh axes per dimension; None: no annotation
    mesh: str = "ab"
    memory: str | None = None  # its memory kind (nnx metadata, an equinox placement)
    memory_even: bool = False  # in that memory in even layers only (odd: the default)

    def memory_in(self, layer: int) -> str | None:
        """Its memory kind in layer ``layer`` (None where unannotated: nothing asks)."""
        if self.axes is None or (self.memory_even and layer % 2):
            return None
        return self.memory


THREEFRY = "threefry2x32"


@dataclasses.dataclass(frozen=True)
class Config:
    """jax's configuration that changes bits, and meshinit's host bound, for one init
    and its references (:func:`configured`)."""

    partitionable: bool = True  # jax_threefry_partitionable
    x64: bool = False  # jax_enable_x64
    prng_impl: str = THREEFRY  # jax_default_prng_impl
    host_eval_bytes: int | None = None  # meshinit.options(host_eval_bytes=); None: 16 KiB


@contextlib.contextmanager
def configured(config: Config) -> Iterator[None]:
    """``config`` in force for a block, with jax's own context managers: jax's previous
    configuration is back afterwards, also when the block fails."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(jax.threefry_partitionable(config.partitionable))
        stack.enter_context(jax.enable_x64(config.x64))
        stack.enter_context(jax.default_prng_impl(config.prng_impl))
        stack.enter_context(meshinit.options(host_eval_bytes=config.host_eval_bytes))
        yield


@dataclasses.dataclass(frozen=True)
class Constructor:
    vars: tuple[Var, ...]
    layers: int = 1
    seed: int = 0
    framework: tuple = ()  # (name, value) options of one framework's spelling
    config: Config = Config()
    again: Config | None = None  # a second configuration the same code is built under

    def option(self, name: str) -> Any:
        return dict(self.framework).get(name)


# Shared jitted helpers, as a model's utility module would define them: every layer
# calls the same function, with its own scalars.
@functools.partial(jax.jit, static_argnums=(2, 3))
def scaled_normal(key, scale, shape, dtype):
    return jax.random.normal(key, shape, dtype) * scale


@functools.partial(jax.jit, static_argnums=(2,))
def dropout_mask(key, p, shape):
    return jax.random.bernoulli(key, p, shape)


@functools.cache
def captured(seed: int, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """A numpy constant the constructor closes over (pretrained weights, a table)."""
    rng = np.random.default_rng(seed)
    if _floating(jnp.dtype(dtype)):
        return rng.standard_normal(shape).astype(jnp.dtype(dtype))
    return rng.integers(0, 2 if dtype == "bool" else 100, shape).astype(jnp.dtype(dtype))


def _is_float(dtype: str) -> bool:
    return _floating(jnp.dtype(dtype))


def leaf_value(var: Var, key: Any, shape: tuple[int, ...], layer: int, env: dict) -> Any:
    """The leaf's value; traceable."""
    leaf = var.leaf
    dt = jnp.dtype(leaf.dtype)
    k, a = leaf.kind, leaf.args
    init = jax.nn.initializers
    if k == "normal":
        return jax.random.normal(key, shape, dt)
    if k == "uniform":
        return jax.random.uniform(key, shape, dt, minval=a[0], maxval=a[1])
    if k == "truncated_normal":
        return jax.random.truncated_normal(key, a[0], a[1], shape, dt)
    if k == "orthogonal":
        return init.orthogonal(a[0])(key, shape, dt)
    if k in ("lecun_normal", "glorot_uniform", "he_normal"):
        return getattr(init, k)()(key, shape, dt)
    if k == "variance_scaling":
        return init.variance_scaling(*a)(key, shape, dt)
    if k in ("zeros", "ones"):
        return getattr(init, k)(key, shape, dt)
    if k == "constant":
        return init.constant(a[0])(key, shape, dt)
    if k == "helper_normal":
        return scaled_normal(key, a[0].spelled(layer, var.vary)(), shape, dt)
    if k == "bernoulli":
        return jax.random.bernoulli(key, a[0].spelled(layer, var.vary)(), shape)
    if k == "helper_mask":
        return dropout_mask(key, a[0].spelled(layer, var.vary)(), shape)
    if k == "randint":
        return jax.random.randint(key, shape, a[0], a[1], dt)
    if k == "captured":
        return jnp.asarray(captured(a[0], shape, leaf.dtype))
    if k == "gamma":  # a while loop inside a jitted function
        return jax.random.gamma(key, a[0], shape, dt)
    if k in ("exponential", "gumbel"):
        return getattr(jax.random, k)(key, shape, dt)
    if k == "rademacher":
        return jax.random.rademacher(key, shape, dt)
    if k == "categorical":  # argmax over a trailing axis
        return jax.random.categorical(key, jnp.zeros((*shape, a[0])), shape=shape)
    if k == "choice":
        return jax.random.choice(key, 10 * a[0], shape).astype(dt)
    if k == "permutation":  # a sort
        return jax.random.permutation(key, shape[0] * a[0])[: shape[0]].astype(dt)
    if k == "arange":  # no key: an integer literal computation
        return (jnp.arange(math.prod(shape), dtype=dt) * a[0]).reshape(shape)
    if k == "full":
        return jnp.full(shape, a[0], dt)
    if k == "eye":
        return jnp.eye(shape[0], shape[1], dtype=dt) * a[0]
    if k == "tie":  # a variable derived from an earlier one
        return env[a[0]] * a[1].spelled(layer, var.vary)()
    raise AssertionError(k)


def leaf_terms(var: Var, value: Any, layer: int, src_terms: Any) -> np.ndarray:
    """``S`` of the leaf: the magnitudes of the terms its own computation adds."""
    v = np.asarray(value, np.float64)
    if var.leaf.kind == "tie":
        return src_terms * var.leaf.args[1].magnitude(layer, var.vary)
    return sampler_terms(var.leaf, v, layer, var.vary)


_erf = np.frompyfunc(math.erf, 1, 1)


def _uniform_terms(v: np.ndarray, lo: float, c: float = 1.0) -> np.ndarray:
    """``S`` of ``c * (r * (hi - lo) + lo)`` (jax's uniform, scaled): the terms of the
    sum, and the product's own rounding."""
    return c * (np.abs(v / c - lo) + abs(lo)) + (np.abs(v) if c != 1.0 else 0.0)


def _erfinv_terms(v: np.ndarray, a: float, c: float = 1.0) -> np.ndarray:
    """``S`` of ``c * sqrt(2) * erfinv(r * (b - a) + a)``: jax's normal (``a = -1``) and
    truncated normal (``a = erf(lower / sqrt(2))``). The uniform's terms ``|x - a| +
    |a|`` carried through erfinv's slope ``sqrt(pi) / 2 * exp(erfinv(x) ** 2)``, plus the
    products' own rounding. Near 0 this is about ``2.5 c``, not ``|v|``: a value near 0
    is the difference of two terms near ``|a|``."""
    z = v / c
    x = np.asarray(_erf(z / math.sqrt(2)), np.float64)  # frompyfunc: a float for a 0-d v
    slope = math.sqrt(math.pi / 2) * np.exp(np.minimum(z * z / 2, 700.0))
    return c * slope * (np.abs(x - a) + abs(a)) + np.abs(v)


def _fans(shape: tuple[int, ...]) -> tuple[float, float]:
    """jax.nn.initializers' fan-in and fan-out (in axis -2, out axis -1)."""
    receptive = math.prod(shape[:-2])
    return shape[-2] * receptive, shape[-1] * receptive


def _variance_scaling_terms(
    v: np.ndarray, shape: tuple[int, ...], scale: float, mode: str, dist: str
) -> np.ndarray:
    fan_in, fan_out = _fans(shape)
    fan = {"fan_in": fan_in, "fan_out": fan_out, "fan_avg": (fan_in + fan_out) / 2}[mode]
    variance = scale / fan
    if dist == "truncated_normal":
        return _erfinv_terms(v, math.erf(-math.sqrt(2)), math.sqrt(variance) / 0.87962566103423978)
    if dist == "normal":
        return _erfinv_terms(v, -1.0, math.sqrt(variance))
    return _uniform_terms(v, -1.0, math.sqrt(3 * variance))


_SCALING = {
    "lecun_normal": (1.0, "fan_in", "truncated_normal"),
    "he_normal": (2.0, "fan_in", "truncated_normal"),
    "glorot_uniform": (1.0, "fan_avg", "uniform"),
}


def sampler_terms(
    leaf: Leaf, v: np.ndarray, layer: int, vary: bool, shape: tuple[int, ...] | None = None
) -> np.ndarray:
    """``S`` of a leaf's value ``v`` (float64), from ``v`` alone: how jax's sampler
    computes it (default ``|v|``). ``shape``: the shape the sampler was called with
    (default ``v``'s; one layer's for a stacked value)."""
    shape = v.shape if shape is None else shape
    k, a = leaf.kind, leaf.args
    if k == "uniform":  # u * (hi - lo) + lo
        return _uniform_terms(v, a[0])
    if k == "normal":
        return _erfinv_terms(v, -1.0)
    if k == "truncated_normal":
        return _erfinv_terms(v, math.erf(a[0] / math.sqrt(2)))
    if k == "helper_normal":
        c = a[0].magnitude(layer, vary)
        return _erfinv_terms(v, -1.0, c) if c else np.abs(v)
    if k in _SCALING or k == "variance_scaling":
        return _variance_scaling_terms(v, shape, *(_SCALING.get(k) or a))
    return np.abs(v)


def linear_terms(framework: str, var: Var, leaf: str, v: np.ndarray) -> np.ndarray:
    """``S`` of a framework layer's parameter (``leaf``: kernel, weight or bias) of value
    ``v``: equinox's Linear draws weight and bias uniformly in ``+-1/sqrt(in)``; flax's
    kernels use the drawn initializer (default lecun_normal), and biases are zeros."""
    init = var.leaf.args[0]
    if framework == "eqx":
        return _uniform_terms(v, -1 / math.sqrt(var.shape[0]))
    if leaf != "kernel":
        return np.abs(v)
    shape = v.shape[-2:]  # a stacked kernel: one layer's fans
    if init in ("default", "lecun_normal", *_SCALING):
        return _variance_scaling_terms(v, shape, *_SCALING.get(init, _SCALING["lecun_normal"]))
    if init == "normal":
        return _erfinv_terms(v, -1.0, 0.02)
    return np.abs(v)


def derive(key: Any, chain: tuple) -> Any:
    for step in chain:
        if step[0] == "split":
            key = jax.random.split(key, step[1])[step[2]]
        elif step[0] == "fold_in":
            key = jax.random.fold_in(key, step[1])
        else:
            key = jax.random.split(key)[1]
    return key


def _apply_ops(var: Var, x: Any, s: Any, key: Any, layer: int) -> tuple[Any, Any]:
    """The scalar ops; ``s`` (the terms so far) is None while tracing."""
    for j, op in enumerate(var.ops):
        name = op[0]
        if name in ("mul", "add", "fma"):
            c = op[1].spelled(layer, var.vary)()
            m = op[1].magnitude(layer, var.vary) if s is not None else None
            if name == "mul":
                x, s = x * c, None if s is None else s * m
            elif name == "add":
                x, s = x + c, None if s is None else s + m
            else:  # x * c + noise: XLA contracts it into one fused multiply-add
                noise = jax.random.normal(jax.random.fold_in(key, 1000 + j), x.shape, x.dtype)
                x = x * c + noise
                s = None if s is None else s * m + np.abs(np.asarray(noise, np.float64))
        elif name == "mask":
            keep = jax.random.bernoulli(jax.random.fold_in(key, 2000 + j), op[1], x.shape)
            x = x * keep.astype(x.dtype)
            s = None if s is None else s * np.asarray(keep)
        elif name == "clip":
            x = jnp.clip(x, -1.5, 1.5)
        elif name == "normalize":  # a reduction: x / (|x| + 1) over the last axis
            if s is not None and x.ndim:  # one rounding per term of the sum, the root, the add, the
                # quotient, plus what the input's own error moves (first order)
                x64 = np.asarray(x, np.float64)
                n = x64.shape[-1] if x64.ndim else 1
                norm = np.sqrt(np.sum(x64 * x64, axis=-1, keepdims=True)) + 1.0
                moved = np.sum(np.abs(x64) * s, axis=-1, keepdims=True) / (norm * (norm - 1) + 1)
                s = s / norm + np.abs(x64 / norm) * (n + 3 + moved)
            if x.ndim:  # a scalar has no last axis to normalize over
                x = x / (jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True)) + 1.0)
        elif name == "astype":
            x = x.astype(op[1])
        elif name == "imul":
            x = x * op[1]
        elif name == "iadd":
            x = x + op[1]
        else:
            raise AssertionError(name)
    return x.astype(var.dtype), s


def _step(var: Var, x: Any, key: Any) -> Any:
    """One iteration of the fori / while wrappers."""
    if _is_float(var.dtype):
        return (x * 0.5 + jax.random.normal(key, x.shape, x.dtype)).astype(x.dtype)
    if var.dtype == "bool":
        return x ^ jax.random.bernoulli(key, 0.5, x.shape)
    return x + jax.random.randint(key, x.shape, 0, 3, x.dtype)


STACKED = ("scan", "scan_carry", "vmap")


def _inner(var: Var) -> tuple[int, ...]:
    return var.shape[1:] if var.wrapper in STACKED else var.shape


@functools.lru_cache(maxsize=4096)
def _value_fn(var: Var, layer: int) -> Callable[[Any, dict], Any]:
    """(key, env) -> the variable's value, traceable. Cached, so that an eager run of a
    recipe drawn before reuses jax's caches of its control flow."""
    inner = _inner(var)

    def make(key, env):
        k = derive(key, var.keys)
        return _apply_ops(var, leaf_value(var, k, inner, layer, env), None, k, layer)[0]

    def one(key):  # a wrapped variable is never a tie: no env
        return make(key, {})

    # The bodies are made once per recipe and take the key as an operand, so that jax's
    # caches serve an eager run of a recipe seen before ("fori_closure" closes over it).
    w = var.wrapper
    if w == "none":
        return make
    if w == "checkpoint":
        remat = jax.checkpoint(one)
        return lambda key, env: remat(key)
    if w == "cond":

        def other(key):
            return one(jax.random.fold_in(key, 1))

        def cond(key, env):
            pred = jax.random.bernoulli(jax.random.fold_in(key, 7), 0.5)
            return jax.lax.cond(pred, one, other, key)

        return cond
    if w == "fori":

        def fori_body(i, carry):
            k, x = carry
            return k, _step(var, x, jax.random.fold_in(k, i))

        return lambda key, env: jax.lax.fori_loop(0, 3, fori_body, (key, one(key)))[1]
    if w == "fori_closure":

        def fori_closure(key, env):
            return jax.lax.fori_loop(
                0, 3, lambda i, x: _step(var, x, jax.random.fold_in(key, i)), one(key)
            )

        return fori_closure
    if w == "while":

        def while_body(carry):
            i, k, x = carry
            return i + 1, k, _step(var, x, jax.random.fold_in(k, i))

        def while_cond(carry):
            return carry[0] < 2

        return lambda key, env: jax.lax.while_loop(while_cond, while_body, (0, key, one(key)))[2]
    if w == "scan":

        def scan_body(carry, k):
            return carry, one(k)

        return lambda key, env: jax.lax.scan(scan_body, None, jax.random.split(key, var.stack))[1]
    if w == "scan_carry":

        def carry_body(k, _):
            k, sub = jax.random.split(k)
            return k, one(sub)

        return lambda key, env: jax.lax.scan(carry_body, key, None, length=var.stack)[1]
    if w == "vmap":
        batched = jax.vmap(one)
        return lambda key, env: batched(jax.random.split(key, var.stack))
    raise AssertionError(w)


def value_fn(var: Var, layer: int, keys: dict | None = None) -> Callable[[Any, dict], Any]:
    """(key, env) -> the variable's value, as the constructor computes it (traceable);
    ``env`` holds the values of the layer's earlier variables, for ties.

    With ``keys``, an eager call records its key there under ``(var.name, layer)``, so
    that :func:`terms_of` can recompute the terms from the very key eager used.
    """
    fn = _value_fn(var, layer if var.vary else 0)  # the layer matters through scalars only
    if keys is None:
        return fn

    def recording(key, env):
        if not isinstance(key, jax.core.Tracer):
            keys[var.name, layer] = key
        return fn(key, env)

    return recording


def terms_of(var: Var, layer: int, key: Any, src_terms: Any = None) -> tuple[np.ndarray, Any]:
    """``S`` for :func:`assert_matches` and the least precise float dtype, eagerly, from
    eager's key (``src_terms``: the S of a tie's source)."""
    inner = _inner(var)

    def element(key):
        k = derive(key, var.keys)
        env = {var.leaf.args[0]: jnp.zeros(inner, var.dtype)} if var.leaf.kind == "tie" else {}
        x = leaf_value(var, k, inner, layer, env)  # a tie's S comes from its source's
        return _apply_ops(var, x, leaf_terms(var, x, layer, src_terms), k, layer)[1]

    w = var.wrapper
    if w in ("none", "checkpoint"):
        s = element(key)
    elif w == "cond":
        pred = bool(jax.random.bernoulli(jax.random.fold_in(key, 7), 0.5))
        s = element(key if pred else jax.random.fold_in(key, 1))
    elif w in ("fori", "fori_closure", "while"):
        s = element(key)
        for i in range(2 if w == "while" else 3):
            n = jax.random.normal(jax.random.fold_in(key, i), inner, var.dtype)
            s = s * 0.5 + np.abs(np.asarray(n, np.float64))
    elif w in ("scan", "vmap"):
        s = np.stack([element(k) for k in jax.random.split(key, var.stack)])
    else:
        subs, k = [], key
        for _ in range(var.stack):
            k, sub = jax.random.split(k)
            subs.append(element(sub))
        s = np.stack(subs)
    floats = [var.dtype, var.leaf.dtype] + [op[1] for op in var.ops if op[0] == "astype"]
    floats = [jnp.dtype(d) for d in floats if _is_float(d)]
    return s, min(floats, key=lambda d: jnp.finfo(d).nmant)


# ----------------------------------------------------------------------------- strategies

FLOATS = ("float32", "bfloat16", "float16")
INTS = ("int32", "uint8", "bool")
LINEAR_INITS = ("default", "lecun_normal", "glorot_uniform", "he_normal", "orthogonal", "normal")


def linear_init(name: str) -> Any:
    """A flax kernel initializer by name (None: the layer's default)."""
    init = jax.nn.initializers
    if name == "default":
        return None
    if name == "normal":
        return init.normal(0.02)
    if name == "orthogonal":
        return init.orthogonal()
    return getattr(init, name)()


def scalars() -> st.SearchStrategy[Scalar]:
    return st.builds(
        Scalar,
        st.sampled_from([1.37, 0.5, 2.0, -0.75, 3.0, 1e-3]),
        st.sampled_from(["float", "int", "np_float32", "np_int32", "jnp", "jnp_closed"]),
    )


def probabilities() -> st.SearchStrategy[Scalar]:
    return st.builds(
        Scalar,
        st.sampled_from([0.1, 0.25, 0.5, 0.9]),
        st.sampled_from(["float", "np_float32", "jnp", "jnp_closed"]),
        st.just(True),
    )


@st.composite
def leaves(draw, dtype: str, ndim: int) -> Leaf:
    if not _is_float(dtype):
        kinds = ["bernoulli", "helper_mask", "randint", "captured", "arange", "full"]
        kinds += ["categorical", "choice"] + (["permutation"] if ndim == 1 else [])
        kind = draw(st.sampled_from(kinds))
        as_int = "int32" if dtype == "bool" else dtype
        if kind == "randint":
            return Leaf("randint", as_int, (0, 7))
        if kind == "captured":
            return Leaf("captured", dtype, (draw(st.integers(0, 3)),))
        if kind in ("arange", "full", "permutation", "choice"):
            return Leaf(kind, as_int, (draw(st.sampled_from([1, 3])),))
        if kind == "categorical":
            return Leaf(kind, "int32", (draw(st.sampled_from([2, 5])),))
        return Leaf(kind, "bool", (draw(probabilities()),))
    gen = draw(st.sampled_from([dtype, "float32"]))
    kinds = ["normal", "uniform", "truncated_normal", "zeros", "ones", "constant"]
    kinds += ["helper_normal", "bernoulli", "helper_mask", "captured"]
    kinds += ["gamma", "exponential", "gumbel", "rademacher", "full"]
    if ndim >= 2:
        kinds += ["lecun_normal", "glorot_uniform", "he_normal", "variance_scaling"]
        kinds += ["orthogonal", "eye"]
    kind = draw(st.sampled_from(kinds))
    if kind == "uniform":
        lo = draw(st.sampled_from([-1.0, 0.0, -0.1, 2.0]))
        return Leaf(kind, gen, (lo, lo + draw(st.sampled_from([0.2, 1.0, 3.0]))))
    if kind == "truncated_normal":
        return Leaf(kind, gen, draw(st.sampled_from([(-2.0, 2.0), (-1.0, 0.5), (0.0, 3.0)])))
    if kind == "orthogonal":  # QR runs in float32
        return Leaf(kind, "float32", (draw(st.sampled_from([1.0, 0.5])),))
    if kind == "variance_scaling":
        scale = draw(st.sampled_from([1.0, 2.0, 0.1]))
        mode = draw(st.sampled_from(["fan_in", "fan_out", "fan_avg"]))
        dist = draw(st.sampled_from(["truncated_normal", "normal", "uniform"]))
        return Leaf(kind, gen, (scale, mode, dist))
    if kind == "constant":
        return Leaf(kind, gen, (draw(st.sampled_from([0.5, -2.0, 3.0])),))
    if kind == "helper_normal":
        return Leaf(kind, gen, (draw(scalars()),))
    if kind in ("bernoulli", "helper_mask"):
        return Leaf(kind, "bool", (draw(probabilities()),))
    if kind == "captured":
        return Leaf(kind, gen, (draw(st.integers(0, 3)),))
    if kind == "gamma":
        return Leaf(kind, gen, (draw(st.sampled_from([0.5, 2.0])),))
    if kind in ("full", "eye"):
        return Leaf(kind, gen, (draw(st.sampled_from([1, 0.25, 3.0])),))
    return Leaf(kind, gen)


def key_chains() -> st.SearchStrategy[tuple]:
    steps = st.one_of(
        st.tuples(st.just("split"), st.just(4), st.integers(0, 3)),
        st.tuples(st.just("fold_in"), st.integers(0, 2**31 - 1)),
        st.just(("split_pair",)),
    )
    return st.lists(steps, max_size=3).map(tuple)


@st.composite
def op_lists(draw, dtype: str, leaf: Leaf) -> tuple:
    if not _is_float(dtype):
        ops = st.one_of(
            st.tuples(st.just("imul"), st.sampled_from([2, 3])),
            st.tuples(st.just("iadd"), st.sampled_from([1, 5])),
        )
        return tuple(draw(st.lists(ops, max_size=2))) if leaf.kind == "randint" else ()
    ops = st.one_of(
        st.tuples(st.just("mul"), scalars()),
        st.tuples(st.just("add"), scalars()),
        st.tuples(st.just("fma"), scalars()),
        st.tuples(st.just("mask"), st.sampled_from([0.5, 0.9])),
        st.just(("clip",)),
        st.just(("normalize",)),
        st.tuples(st.just("astype"), st.sampled_from(FLOATS)),
    )
    drawn = draw(st.lists(ops, max_size=3))
    if leaf.dtype == "bool":  # a mask leaf: make it a float first
        drawn.insert(0, ("astype", dtype))
    return tuple(drawn)


NARROW = st.integers(1, 8)
"""A narrow last dimension: where jax 0.12 rounded a per-variable program differently
from eager construction (``lecun_normal`` at ``(N, 4)``)."""


def _axes_for(draw, shape: tuple[int, ...], mesh: Mesh) -> tuple:
    free = list(mesh.axis_names)
    axes = []
    for d in shape:
        a = draw(st.sampled_from([None] + [a for a in free if d % mesh.shape[a] == 0]))
        if a is not None:
            free.remove(a)
        axes.append(a)
    return tuple(axes)


@st.composite
def variables(draw, name: str, mesh_names: tuple[str, ...], linear: bool) -> Var:
    mesh = draw(st.sampled_from(mesh_names))
    placed = draw(st.booleans())
    if linear and draw(st.integers(0, 5)) == 0:  # a framework layer: nnx.Linear, nn.Dense
        shape = (draw(st.sampled_from([8, 16])), draw(st.sampled_from([8, 16]) | NARROW))
        init = draw(st.sampled_from(LINEAR_INITS))
        dtype = "float32" if init == "orthogonal" else draw(st.sampled_from(FLOATS))  # QR
        leaf = Leaf("linear", dtype, (init, draw(st.booleans())))
        axes = _axes_for(draw, shape, meshes()[mesh]) if placed else None
        return Var(name=name, shape=shape, dtype=leaf.dtype, leaf=leaf, axes=axes, mesh=mesh)
    dtype = draw(st.sampled_from(FLOATS + INTS))
    wrapper = draw(st.sampled_from(["none"] * 6 + ["cond", "fori", "while", "checkpoint"]))
    if wrapper == "fori" and draw(st.integers(0, 3)) == 0:
        wrapper = "fori_closure"
    if wrapper == "none" and draw(st.integers(0, 3)) == 0:
        wrapper = draw(st.sampled_from(STACKED))
    dims = st.sampled_from([8, 16])
    inner = tuple(draw(st.lists(dims, min_size=1, max_size=2)))
    if draw(st.integers(0, 2)) == 0:  # a narrow last dimension (a few heads, a gate)
        inner = (*inner[:-1], draw(NARROW))
    size = draw(st.integers(0, 11))
    if size == 0:  # above the host part's default 16 KiB in float32
        inner = draw(st.sampled_from([(64, 128), (1024, 5), (2048, 4)]))
    elif size == 1:
        inner = ()  # a scalar variable
    stack = draw(st.sampled_from([2, 4])) if wrapper in STACKED else 1
    shape = ((stack,) if stack > 1 else ()) + inner
    leaf = draw(leaves(dtype, len(inner)))
    return Var(
        name=name,
        shape=shape,
        dtype=dtype,
        leaf=leaf,
        keys=draw(key_chains()),
        ops=draw(op_lists(dtype, leaf)),
        wrapper=wrapper,
        stack=stack,
        vary=draw(st.booleans()),
        axes=_axes_for(draw, shape, meshes()[mesh]) if placed else None,
        mesh=mesh,
    )


LOW_HOST_BOUND = 64
"""The host bound of most examples (``meshinit.options(host_eval_bytes=...)``): every
key array the constructors draw (at most 7 threefry keys, from equinox's split per
variable) stays on the host, and every variable of more than 64 bytes goes through the
compiled programs. Not lower: a slice that hashes a key twice in a row with meshinit's
straight-line threefry (``split(split(k)[1])``) took over 15 minutes to compile on
jaxlib 0.12.0.1 (under a second on 0.10.2)."""

MEMORIES = ("pinned_host", "unpinned_host", "device")
"""The memory kinds of jax's CPU devices (``jax.devices()[0].addressable_memories()``)."""


@st.composite
def configs(draw, refusing: bool) -> Config:
    """jax's configuration for one init; ``refusing``: the framework's adapter refuses a
    key implementation other than threefry and unpartitionable threefry (linen, eqx),
    so those are drawn less often."""
    rare = st.sampled_from([True] + [False] * (5 if refusing else 2))
    impls = st.sampled_from(["rbg", "unsafe_rbg"])
    return Config(
        partitionable=not draw(rare),
        x64=draw(st.sampled_from([False, False, True])),
        prng_impl=draw(impls) if draw(rare) else THREEFRY,
        host_eval_bytes=draw(st.sampled_from([LOW_HOST_BOUND] * 3 + [None])),
    )


@st.composite
def constructors(
    draw,
    mesh_names: tuple[str, ...],
    linear: bool = True,
    memory: bool = False,
    refusing: bool = False,
    **framework: st.SearchStrategy,
) -> Constructor:
    """2-6 variables in all (per layer, times 1-3 layers; 7 with a twin), one framework's
    options, and jax's configuration. ``memory``: the framework places variables in
    memory kinds; ``refusing``: as for :func:`configs`."""
    layers = draw(st.sampled_from([1, 1, 2, 3]))
    n = draw(st.integers(2, 6)) if layers == 1 else draw(st.integers(1, 6 // layers))
    vs = [draw(variables(f"v{i}", mesh_names, linear)) for i in range(n)]
    if memory:  # a memory kind for some placed variables, in every layer or in even ones
        kinds = st.sampled_from((None, None, *MEMORIES))
        vs = [
            dataclasses.replace(v, memory=draw(kinds), memory_even=draw(st.booleans())) for v in vs
        ]
    sources = [v for v in vs if _is_float(v.dtype) and v.leaf.kind != "linear"]
    if sources and len(vs) < 6 and draw(st.integers(0, 4)) == 0:  # a tied / derived variable
        src = draw(st.sampled_from(sources))
        mesh = draw(st.sampled_from(mesh_names))
        axes = _axes_for(draw, src.shape, meshes()[mesh]) if draw(st.booleans()) else None
        tie = Leaf("tie", src.dtype, (src.name, draw(scalars())))
        vs.append(Var(f"v{len(vs)}", src.shape, src.dtype, tie, axes=axes, mesh=mesh, vary=True))
    placed = [v for v in vs if v.axes is not None and v.leaf.kind != "tie"]
    if placed and draw(st.integers(0, 3)) == 0:
        # a twin: the same code and placement, so the same signature, maybe in another
        # memory; only the key it is given differs
        src = draw(st.sampled_from(placed))
        other = draw(st.sampled_from([k for k in (None, *MEMORIES) if k != src.memory]))
        vs.append(dataclasses.replace(src, name=f"v{len(vs)}", memory=other if memory else None))
    options = tuple((k, draw(s)) for k, s in framework.items())
    # a seed of more than 32 bits: its high bits count under x64 only
    seed = draw(st.integers(0, 2**31 - 1) | st.integers(2**32, 2**40))
    return Constructor(tuple(vs), layers, seed, options, draw(configs(refusing)))


# ----------------------------------------------------------------------------- comparing


def check_placement(plan: Any, outputs: dict[str, Any], expected: dict[str, Any]) -> None:
    """Every output sits exactly on its plan entry's sharding, by path, and the plan is
    what the code asked for (``expected``: path -> NamedSharding)."""
    planned = {e.path: e.sharding for e in plan.entries}
    assert set(planned) == set(outputs), (
        f"the plan lists {sorted(planned)}, the engine returned arrays at {sorted(outputs)}"
    )
    for path, sharding in planned.items():
        x = outputs[path]
        got = x.sharding
        if _is_key(x) and got != sharding:
            got = jax.random.key_data(x).sharding  # a plan may be written for the key data
        assert got == sharding, (
            f"{path}: the plan places it on {sharding}, the engine returned {x.sharding}"
        )
    for path, want in expected.items():
        # the same placement: P(None,) and P() place alike (flax spells a spec by its
        # annotation's length, the plan may spell it shorter); the engine's output is
        # held to the plan with == above
        same = planned[path] == want or planned[path].is_equivalent_to(want, len(want.spec) or 1)
        assert same, f"{path}: the code asks for {want}, the plan says {planned[path]}"


@contextlib.contextmanager
def cut_per_variable(allowed: str | None = None) -> Iterator[None]:
    """Asserts that the engine cut every variable: nothing these constructors hold (no
    callbacks, no side effects) may fall back to the whole-constructor program, which
    the engine says with a ``meshinit.FallbackWarning``; but for one whose message
    matches ``allowed`` (a regex), a fallback the engine documents."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", meshinit.FallbackWarning)
        yield
    fell = [str(w.message) for w in caught if issubclass(w.category, meshinit.FallbackWarning)]
    fell = [m for m in fell if allowed is None or not re.search(allowed, m)]
    assert not fell, f"the engine fell back to the whole-constructor program: {fell}"


OUTSIDE_KEY = "key made outside the factory"
"""The fallback of a variable that reads a key made outside the factory, of another
implementation than threefry: only threefry keys have host data to pass in."""


def outside_key(closes_over_a_key: bool, config: Config) -> str | None:
    """The fallback allowed for a constructor that reads a key it closes over, made under
    ``config`` (None: none allowed)."""
    return OUTSIDE_KEY if closes_over_a_key and config.prng_impl != THREEFRY else None


def refusal(c: Constructor, config: Config) -> str | None:
    """What ``meshinit.linen`` and ``meshinit.eqx`` say when they refuse ``c``'s key under
    ``config``: they take the key as an argument, and refuse one whose values would
    depend on the sharding (docs/faq.md); None where they accept it."""
    impl = THREEFRY if c.option("key_kind") == "threefry" else config.prng_impl
    if impl != THREEFRY:
        return f"key implementation '{impl}' generates values that depend on the sharding"
    if not config.partitionable:
        return "jax_threefry_partitionable is off, so random values would depend on the sharding"
    return None


def check_refused(why: str, *calls: Callable[[], Any]) -> None:
    """Each of ``calls`` (plan, init) refuses with a ValueError saying ``why``."""
    for call in calls:
        with pytest.raises(ValueError, match=re.escape(why)):
            call()


def configurations(c: Constructor) -> list[Config]:
    """The configurations ``c`` is built under, in turn: ``c.config``, then ``c.again``
    (the same code, so the same fingerprints: a cache keyed without the configuration
    would return the first one's values)."""
    return [config for config in (c.config, c.again) if config is not None]


ALWAYS_JIT = False
"""Whether to run the jit reference and the terms even where the engine gave eager's bits
(the measuring runs set it; the contract needs them only where it did not)."""


def compare_values(
    got: dict[str, Any],
    eager: dict[str, Any],
    jit: Callable[[], dict[str, Any]],
    recipes: dict[str, tuple],
    record: list | None = None,
    model: Callable[[str, Any], tuple[Any, Any]] | None = None,
) -> None:
    """:func:`assert_matches` on every path. ``jit()`` builds the jit reference and
    ``recipes`` (path -> variable, layer, eager's key, the source path of a tie) gives
    the terms, both only where needed: a value with eager's bits meets the contract
    whatever jit gives. ``model(path, eager)`` gives (terms, dtype) from the value alone
    for the paths with no recipe (framework layers, stacked layers)."""
    assert set(got) == set(eager), (
        f"eager construction makes {sorted(eager)}, the engine made {sorted(got)}"
    )
    jitted: list[dict[str, Any]] = []
    memo: dict[str, Any] = {}

    def terms(path):
        if path not in memo:
            var, layer, key, src = recipes[path]
            memo[path] = terms_of(var, layer, key, terms(src)[0] if src else None)
        return memo[path]

    for path in sorted(got):
        g, e = got[path], eager[path]
        same = _is_key(g) == _is_key(e) and g.shape == e.shape and g.dtype == e.dtype
        lazy = not ALWAYS_JIT and same and np.array_equal(_bits(g), _bits(e))
        if not lazy and not jitted:
            jitted.append(jit())
        j = e if lazy else jitted[0][path]
        s, eps_dtype = None, None
        if not lazy and path in recipes:
            s, eps_dtype = terms(path)
        elif not lazy and model is not None:
            s, eps_dtype = model(path, e)
        how = assert_matches(g, e, j, terms=s, eps_dtype=eps_dtype, path=path)
        if record is not None:
            record.append((path, "eager" if lazy else how, g, e, j, s, eps_dtype))


def _recipes(c: Constructor, paths: dict[tuple[str, int], str], keys: dict) -> dict:
    """path -> (variable, layer, eager's key, tie source path) for the value variables."""
    by_name = {v.name: v for v in c.vars}
    out = {}
    for (name, layer), path in paths.items():
        var = by_name[name]
        if _is_float(var.dtype) and var.leaf.kind != "linear" and (name, layer) in keys:
            src = paths.get((var.leaf.args[0], layer)) if var.leaf.kind == "tie" else None
            out[path] = (var, layer, keys[name, layer], src)
    return out


def value_model(c: Constructor, framework: str) -> Callable[[str, Any], tuple[Any, Any]]:
    """(path, eager value) -> (terms, dtype) of the values no recipe describes: a
    framework layer's parameters (:func:`linear_terms`), and a sampler's value left as
    drawn, stacked or not (:func:`sampler_terms`); else (None, None), for ``|eager|``."""
    by_name = {v.name: v for v in c.vars}

    def model(path: str, eager: Any) -> tuple[Any, Any]:
        parts = path.split(".")
        names = [p for p in parts if p in by_name]
        if not names or not _floating(eager.dtype):
            return None, None
        var = by_name[names[-1]]
        v = np.asarray(eager, np.float64)
        dtypes = [jnp.dtype(d) for d in (var.dtype, var.leaf.dtype) if _is_float(d)]
        least = min(dtypes, key=lambda d: jnp.finfo(d).nmant)
        if var.leaf.kind == "linear":
            return linear_terms(framework, var, parts[-1], v), least
        if var.ops or var.wrapper not in ("none", "checkpoint", "scan", "vmap"):
            return None, None
        inner = _inner(var)
        if v.ndim - len(inner) > (var.stack > 1):  # stacked layers lead: one per layer
            per = [sampler_terms(var.leaf, x, i, var.vary, inner) for i, x in enumerate(v)]
            return np.stack(per), least
        numbers = [int(n) for p in parts for n in re.findall(r"^(?:layers_)?(\d+)$", p)]
        return sampler_terms(var.leaf, v, numbers[0] if numbers else 0, var.vary, inner), least

    return model


def _key_str(k: Any) -> str:
    for attr in ("name", "key", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def _tree_flat(tree: Any) -> dict[str, Any]:
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {".".join(map(_key_str, kp)): v for kp, v in flat if eqx.is_array(v)}


def _paths(c: Constructor, layer_prefix: Callable[[int], str]) -> dict[tuple[str, int], str]:
    """(variable, layer) -> path for the variables of unstacked layers; a linear layer's
    path is that of its module (``.kernel`` / ``.weight`` below it)."""
    return {(v.name, i): f"{layer_prefix(i)}{v.name}" for v in c.vars for i in range(c.layers)}


def _stageable(c: Constructor) -> bool:
    """Whether ``v1`` may move to the ``stage`` mesh with ``meshes=``: its axes (if any)
    are axes of that mesh, and its dimensions divide."""
    v1 = [v for v in c.vars if v.name == "v1"]
    return bool(v1) and (v1[0].axes is None or v1[0].mesh in ("ab", "ab_explicit", "stage"))


LOOPS = ("cond", "fori", "fori_closure", "while")


def staged(draw: Callable[..., Any], c: Constructor) -> Constructor:
    """``c``, with ``v1`` moved to the ``stage`` mesh by ``meshes=`` a third of the time
    it can be; then half of the time ``v1`` is made inside a loop or a branch, whose
    body is traced under the context mesh (when there is one) and compiled for the
    stage mesh, which has other devices and another size."""
    stage = _stageable(c) and draw(st.integers(0, 2)) == 0
    vs = c.vars
    if stage and draw(st.booleans()):
        loop = draw(st.sampled_from(LOOPS))
        vs = tuple(
            dataclasses.replace(v, wrapper=loop)
            if v.name == "v1" and v.wrapper == "none" and v.leaf.kind not in ("linear", "tie")
            else v
            for v in vs
        )
    return dataclasses.replace(c, vars=vs, framework=c.framework + (("stage", stage),))


STAGE_PATTERNS = {"nnx": r"(layers\.(\d+\.)?)?v1(\..*)?", "linen": r"params\.\w+\.v1(\..*)?"}
"""``meshes=`` patterns that move every copy of ``v1`` to the ``stage`` mesh."""


def _stage_meshes(c: Constructor, framework: str) -> list | None:
    return [(STAGE_PATTERNS[framework], meshes()["stage"])] if c.option("stage") else None


def _expected(
    c: Constructor,
    paths: dict[tuple[str, int], str],
    mesh_of: Callable[[Var], Mesh],
    kernel: str,
    stacked: str | None,
) -> dict[str, NamedSharding]:
    """path -> the NamedSharding the code's annotations name; ``stacked``: the prefix of
    the variables a framework transform stacked (their leading axis is replicated)."""
    by_name = {v.name: v for v in c.vars}
    if c.option("stage"):  # meshes= moves v1 to the stage mesh, keeping its axes
        unstaged = mesh_of

        def mesh_of(var):
            return meshes()["stage"] if var.name == "v1" else unstaged(var)

    out = {}
    if stacked is not None:
        paths = {(v.name, 0): f"{stacked}{v.name}" for v in c.vars}
    for (name, layer), path in paths.items():
        var = by_name[name]
        if var.axes is None:
            continue
        axes = var.axes
        if var.leaf.kind == "linear":
            path = f"{path}.{kernel}"
            if kernel == "weight":  # equinox's Linear keeps (out, in)
                axes = axes[::-1]
        if stacked is not None and axes:  # flax adds no axis to an empty out_sharding
            axes = (None, *axes)
        out[path] = NamedSharding(mesh_of(var), P(*axes), memory_kind=var.memory_in(layer))
    return out


# ----------------------------------------------------------------------------- nnx


class Mask(nnx.Variable):
    """An integer or bool Variable (a dropout mask, a counter)."""


def nnx_factory(c: Constructor, annotate: bool = True, keys: dict | None = None):
    """The constructor as nnx code: ``factory() -> Module``."""
    under_context = c.option("context_mesh") is not None
    stacking = c.option("stacking")
    stream = c.option("stream")
    closed_key = jax.random.key(c.seed)  # made outside the factory, closed over

    def metadata(var: Var, layer: int) -> dict[str, Any]:
        if not annotate or var.axes is None:
            return {}
        meta: dict[str, Any] = {"out_sharding": var.axes}
        if c.option("logical"):
            meta["out_sharding"] = tuple(None if a is None else LOGICAL[a] for a in var.axes)
            meta["sharding_rules"] = FUZZ_RULES
        if not under_context:
            meta["mesh"] = meshes()[var.mesh]
        if var.memory_in(layer) is not None:
            meta["memory_kind"] = var.memory_in(layer)
        return meta

    def variable(var: Var, rngs: nnx.Rngs, layer: int, env: dict) -> Any:
        if var.leaf.kind == "linear":
            init, bias = var.leaf.args
            kw = {"kernel_init": linear_init(init)} if init != "default" else {}
            return nnx.Linear(
                *var.shape,
                use_bias=bias,
                param_dtype=jnp.dtype(var.leaf.dtype),
                kernel_metadata=metadata(var, layer),
                rngs=rngs,
                **kw,
            )
        key = rngs() if stream == "call" else getattr(rngs, stream)()
        env[var.name] = value = value_fn(var, layer, keys)(key, env)
        return (nnx.Param if _is_float(var.dtype) else Mask)(value, **metadata(var, layer))

    class Layer(nnx.Module):
        def __init__(self, rngs: nnx.Rngs, layer: int = 0):
            env: dict = {}
            for var in c.vars:
                setattr(self, var.name, variable(var, rngs, layer, env))

    def layer_fn(i: int) -> Callable[[nnx.Rngs], Layer]:
        return lambda r: Layer(r, i)  # nnx.remat would trace a defaulted i

    class Model(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            if c.option("keep_rngs"):
                self.rngs = rngs
            if c.layers == 1:
                env: dict = {}
                for var in c.vars:
                    setattr(self, var.name, variable(var, rngs, 0, env))
            elif stacking == "list":
                self.layers = nnx.List([Layer(rngs, i) for i in range(c.layers)])
            elif stacking == "remat":
                self.layers = nnx.List([nnx.remat(layer_fn(i))(rngs) for i in range(c.layers)])
            else:
                transform = nnx.vmap if stacking == "vmap" else nnx.scan

                @nnx.split_rngs(splits=c.layers)
                @transform(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
                def create(r):
                    return Layer(r)

                self.layers = create(rngs)

    def rngs() -> nnx.Rngs:
        seed = c.option("seed_kind")
        if seed == "int":
            return nnx.Rngs(c.seed)
        if seed == "streams":
            return nnx.Rngs(c.seed, noise=c.seed + 1)  # default (params falls back to it), noise
        if seed == "key":
            return nnx.Rngs(jax.random.key(c.seed))
        if seed == "threefry":  # whatever the default implementation
            return nnx.Rngs(jax.random.key(c.seed, impl=THREEFRY))
        if seed == "closed_key":
            return nnx.Rngs(closed_key)
        return nnx.Rngs(jax.random.PRNGKey(c.seed))

    return lambda: Model(rngs())


def _nnx_flat(module: nnx.Module) -> dict[str, Any]:
    return {
        ".".join(map(str, p)): v.get_value()
        for p, v in nnx.to_flat_state(nnx.state(module))
        if isinstance(v.get_value(), jax.Array | np.ndarray)  # eager remat of a constant: numpy
    }


def _nnx_paths(c: Constructor) -> dict[tuple[str, int], str]:
    if c.layers == 1:
        return _paths(c, lambda i: "")
    if c.option("stacking") in ("list", "remat"):
        return _paths(c, lambda i: f"layers.{i}.")
    return {}  # stacked by nnx.vmap / nnx.scan


def nnx_expected(c: Constructor) -> dict[str, NamedSharding]:
    context = c.option("context_mesh")
    stacked = "layers." if c.layers > 1 and not _nnx_paths(c) else None
    return _expected(c, _nnx_paths(c), lambda v: meshes()[context or v.mesh], "kernel", stacked)


@st.composite
def nnx_constructors(draw) -> Constructor:
    context = draw(st.sampled_from([None, None, "ab", "ab_explicit"]))
    names = (context,) if context else AUTO_MESHES + ("ab_explicit",)
    c = draw(
        constructors(
            names,
            memory=True,
            seed_kind=st.sampled_from(
                ["int", "int", "streams", "key", "closed_key", "legacy", "threefry"]
            ),
            stream=st.sampled_from(["params", "params", "noise", "call"]),
            keep_rngs=st.booleans(),
            logical=st.booleans(),
            context_mesh=st.just(context),
            stacking=st.sampled_from(["list", "list", "remat", "vmap", "scan"]),
        )
    )
    if draw(st.integers(0, 2)) == 0:  # built again with partitionable threefry flipped
        c = dataclasses.replace(
            c, again=dataclasses.replace(c.config, partitionable=not c.config.partitionable)
        )
    return staged(draw, c)


def run_nnx(c: Constructor, config: Config = Config(), record: list | None = None) -> None:
    """Builds ``c`` as nnx code with meshinit.nnx.init, eagerly and under jax.jit, all
    under ``config`` (in force: :func:`configured`). nnx.init takes every key
    implementation and either setting of partitionable threefry: the keys are the
    factory's own."""
    released()
    factory = nnx_factory(c)
    context = c.option("context_mesh")
    with contextlib.ExitStack() as stack:
        if context is not None:
            stack.enter_context(jax.set_mesh(meshes()[context]))
        plan = meshinit.nnx.plan(factory, meshes=_stage_meshes(c, "nnx"))
        with cut_per_variable(outside_key(c.option("seed_kind") == "closed_key", config)):
            model = meshinit.nnx.init(factory, meshes=_stage_meshes(c, "nnx"))
    got = _nnx_flat(model)
    check_placement(plan, got, nnx_expected(c))
    keys: dict = {}
    with nnx.use_eager_sharding(False):
        eager = _nnx_flat(nnx_factory(c, annotate=False, keys=keys)())

    def jit():
        with nnx.use_eager_sharding(False):
            return jax.jit(lambda: _nnx_flat(nnx_factory(c, annotate=False)()))()

    compare_values(got, eager, jit, _recipes(c, _nnx_paths(c), keys), record, value_model(c, "nnx"))


@given(nnx_constructors())
@_settings(0.4)
def test_nnx_init_matches_eager_and_jit_and_places_exactly(c):
    for config in configurations(c):
        with configured(config):
            run_nnx(c, config)


# ----------------------------------------------------------------------------- linen


def linen_module(c: Constructor, annotate: bool = True, keys: dict | None = None) -> nn.Module:
    """The constructor as linen code: ``self.param(name, init_fn, shape)`` per variable,
    ``nn.Dense`` for the linear layers."""
    logical = c.option("logical")
    box_mesh = c.option("box_mesh")

    def boxed(var: Var, fn: Callable[..., Any]) -> Callable[..., Any]:
        if not annotate or var.axes is None:
            return fn
        mesh = meshes()[var.mesh] if box_mesh else None
        if logical:
            names = tuple(None if a is None else LOGICAL[a] for a in var.axes)
            return nn.with_logical_partitioning(fn, names, mesh=mesh)
        return nn.with_partitioning(fn, var.axes, mesh=mesh)

    class Layer(nn.Module):
        index: int = 0

        @nn.compact
        def __call__(self, x, _=None):
            env: dict = {}
            for var in c.vars:
                if var.leaf.kind == "linear":
                    init, bias = var.leaf.args
                    kernel_init = linear_init(init) or nn.initializers.lecun_normal()
                    nn.Dense(
                        var.shape[1],
                        use_bias=bias,
                        param_dtype=jnp.dtype(var.leaf.dtype),
                        kernel_init=boxed(var, kernel_init),
                        name=var.name,
                    )(jnp.ones((1, var.shape[0])))
                    continue
                make = value_fn(var, self.index, keys)

                def fn(key, shape, make=make):
                    return make(key, env)

                env[var.name] = self.param(var.name, boxed(var, fn), var.shape)
            return x, None

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            stacking = c.option("stacking")
            if c.layers == 1:
                Layer(name="body")(x)
            elif stacking == "list":
                for i in range(c.layers):
                    Layer(i, name=f"layers_{i}")(x)
            elif stacking == "remat":
                for i in range(c.layers):
                    nn.remat(Layer)(i, name=f"layers_{i}")(x)
            else:
                nn.scan(
                    Layer,
                    variable_axes={"params": 0},
                    split_rngs={"params": True},
                    length=c.layers,
                    metadata_params={nn.PARTITION_NAME: None},
                )(name="layers")(x, None)
            return x

    return Model()


def _values(variables: Any) -> Any:
    """The arrays in linen's boxes as they are (``nn.unbox`` would also constrain each to
    its box's sharding, under the context mesh when there is one)."""
    return jax.tree_util.tree_map(
        lambda x: x.value if isinstance(x, nn.meta.AxisMetadata) else x,
        variables,
        is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata),
    )


def _linen_paths(c: Constructor) -> dict[tuple[str, int], str]:
    if c.layers == 1:
        return _paths(c, lambda i: "params.body.")
    if c.option("stacking") in ("list", "remat"):
        return _paths(c, lambda i: f"params.layers_{i}.")
    return {}  # nn.scan


def linen_expected(c: Constructor) -> dict[str, NamedSharding]:
    stacked = "params.layers." if c.layers > 1 and not _linen_paths(c) else None
    init_mesh = c.option("init_mesh")
    return _expected(
        c,
        _linen_paths(c),
        lambda v: meshes()[v.mesh if c.option("box_mesh") else init_mesh],
        "kernel",
        stacked,
    )


@st.composite
def linen_constructors(draw) -> Constructor:
    box_mesh = draw(st.booleans())
    init_mesh = draw(st.sampled_from(["ab", "ab_explicit"]))
    # A box's own mesh must have Auto axes (as in flax); linen.init's mesh may be Explicit.
    names = AUTO_MESHES if box_mesh else (init_mesh,)
    c = draw(
        constructors(
            names,
            refusing=True,
            key_kind=st.sampled_from(["legacy", "key", "int", "threefry"]),
            logical=st.booleans(),
            box_mesh=st.just(box_mesh),
            init_mesh=st.just(init_mesh),
            context=st.booleans(),
            stacking=st.sampled_from(["list", "list", "remat", "scan"]),
        )
    )
    return staged(draw, c)


def _key(c: Constructor) -> tuple[Any, Any]:
    """The key meshinit gets, and the one eager construction gets."""
    kind = c.option("key_kind")
    if kind == "legacy":
        return jax.random.PRNGKey(c.seed), jax.random.PRNGKey(c.seed)
    if kind == "key":
        return jax.random.key(c.seed), jax.random.key(c.seed)
    if kind == "threefry":  # whatever the default implementation
        return jax.random.key(c.seed, impl=THREEFRY), jax.random.key(c.seed, impl=THREEFRY)
    return c.seed, jax.random.key(c.seed)


def run_linen(c: Constructor, config: Config = Config(), record: list | None = None) -> None:
    """Builds ``c`` as linen code with meshinit.linen.init, eagerly and under jax.jit, all
    under ``config`` (in force); or checks that plan and init refuse its key there."""
    released()
    module = linen_module(c)
    key, ref_key = _key(c)
    x = jnp.ones((1, 8), jnp.float32)
    kw: dict[str, Any] = {"default": "replicated", "meshes": _stage_meshes(c, "linen")}
    if c.option("logical"):
        kw["rules"] = FUZZ_RULES
    with contextlib.ExitStack() as stack:
        if c.option("context"):  # the mesh comes from jax.set_mesh instead of mesh=
            stack.enter_context(jax.set_mesh(meshes()[c.option("init_mesh")]))
        else:
            kw["mesh"] = meshes()[c.option("init_mesh")]
        why = refusal(c, config)
        if why is not None:
            check_refused(
                why,
                lambda: meshinit.linen.plan(module, key, x, **kw),
                lambda: meshinit.linen.init(module, key, x, **kw),
            )
            return
        plan = meshinit.linen.plan(module, key, x, **kw)
        with cut_per_variable():
            got = _tree_flat(_values(meshinit.linen.init(module, key, x, **kw)))
    check_placement(plan, got, linen_expected(c))
    keys: dict = {}
    # The boxes change where values go, not what they are: the references go without.
    eager = _tree_flat(linen_module(c, annotate=False, keys=keys).init(ref_key, x))

    def jit():
        return _tree_flat(jax.jit(linen_module(c, annotate=False).init)(ref_key, x))

    compare_values(
        got, eager, jit, _recipes(c, _linen_paths(c), keys), record, value_model(c, "linen")
    )


@given(linen_constructors())
@_settings(0.3)
def test_linen_init_matches_eager_and_jit_and_places_exactly(c):
    for config in configurations(c):
        with configured(config):
            run_linen(c, config)


# ----------------------------------------------------------------------------- equinox


class Bag(eqx.Module):
    """An equinox Module holding the drawn variables, with a static field."""

    vars: dict
    label: str = eqx.field(static=True, default="bag")


def eqx_factory(c: Constructor, keys: dict | None = None) -> Callable[[Any], Any]:
    """The constructor as an equinox factory: ``factory(key) -> Bag or [Bag, ...]``."""

    closed = jax.random.key(c.seed + 1)  # made outside the factory, closed over

    def layer(key, i):
        env: dict = {}
        if c.option("closed_key"):  # keys from a closed-over key, not the argument
            key = jax.random.fold_in(closed, i)
        for var, k in zip(c.vars, jax.random.split(key, len(c.vars)), strict=True):
            if var.leaf.kind == "linear":
                d_in, d_out = var.shape
                dt = jnp.dtype(var.leaf.dtype)
                env[var.name] = eqx.nn.Linear(
                    d_in, d_out, use_bias=var.leaf.args[1], key=k, dtype=dt
                )
            else:
                env[var.name] = value_fn(var, i, keys)(k, env)
        return Bag(env)

    def factory(key):
        if c.layers == 1:
            return layer(key, 0)
        return [layer(k, i) for i, k in enumerate(jax.random.split(key, c.layers))]

    return factory


def _eqx_paths(c: Constructor) -> dict[tuple[str, int], str]:
    return _paths(c, lambda i: "vars." if c.layers == 1 else f"{i}.vars.")


def run_eqx(c: Constructor, config: Config = Config(), record: list | None = None) -> None:
    """Builds ``c`` as an equinox factory with meshinit.eqx.init, eagerly and under jit,
    all under ``config`` (in force); or checks that plan and init refuse its key there."""
    released()
    factory = eqx_factory(c)
    key, ref_key = _key(c)
    own = c.option("own_mesh")
    init_mesh = meshes()[c.option("init_mesh")]
    expected = _expected(
        c, _eqx_paths(c), lambda v: meshes()[v.mesh] if own else init_mesh, "weight", None
    )
    placements: list[tuple] = []
    for path, sharding in expected.items():
        entry = (re.escape(path), tuple(sharding.spec), sharding.mesh if own else None)
        if sharding.memory_kind is not None:
            entry += (sharding.memory_kind,)
        placements.append(entry)
    placements.append((r".*", None))
    with contextlib.ExitStack() as stack:
        if c.option("context"):  # traced under a context mesh, as with linen and nnx
            stack.enter_context(jax.set_mesh(init_mesh))
        why = refusal(c, config)
        if why is not None:
            check_refused(
                why,
                lambda: meshinit.eqx.plan(factory, key, placements, mesh=init_mesh),
                lambda: meshinit.eqx.init(factory, key, placements, mesh=init_mesh),
            )
            return
        plan = meshinit.eqx.plan(factory, key, placements, mesh=init_mesh)
        with cut_per_variable(outside_key(c.option("closed_key"), config)):
            got = _tree_flat(meshinit.eqx.init(factory, key, placements, mesh=init_mesh))
    check_placement(plan, got, expected)
    keys: dict = {}
    eager = _tree_flat(eqx_factory(c, keys)(ref_key))

    def jit():
        return _tree_flat(eqx.filter_jit(factory)(ref_key))

    compare_values(got, eager, jit, _recipes(c, _eqx_paths(c), keys), record, value_model(c, "eqx"))


@st.composite
def eqx_constructors(draw) -> Constructor:
    own_mesh = draw(st.booleans())
    init_mesh = draw(st.sampled_from(["ab", "ab_explicit", "xyz"]))
    names = AUTO_MESHES + ("ab_explicit",) if own_mesh else (init_mesh,)
    c = draw(
        constructors(
            names,
            memory=True,
            refusing=True,
            key_kind=st.sampled_from(["legacy", "key", "int", "threefry"]),
            closed_key=st.sampled_from([False, False, False, True]),
            own_mesh=st.just(own_mesh),
            init_mesh=st.just(init_mesh),
            context=st.booleans(),
        )
    )
    return c


@given(eqx_constructors())
@_settings(0.3)
def test_eqx_init_matches_eager_and_jit_and_places_exactly(c):
    for config in configurations(c):
        with configured(config):
            run_eqx(c, config)


# ----------------------------------------------------------------------------- the helper itself


def test_assert_matches_rejects_what_the_contract_forbids():
    x = jnp.asarray([1.0, -2.0, 1e-6], jnp.float32)
    one_ulp = jnp.nextafter(x, jnp.inf)
    assert assert_matches(x, one_ulp, x) == "jit"
    assert assert_matches(one_ulp, one_ulp, x) == "eager"
    # 10% of the value, yet 1e-7 < 8 eps * S when the terms were of magnitude 1
    near, small = jnp.asarray([1e-6 + 1e-7]), jnp.asarray([1e-6])
    assert assert_matches(near, small, jnp.asarray([0.0]), terms=1.0) == "tolerance"
    with pytest.raises(AssertionError, match="neither jax.jit's bits nor within"):
        assert_matches(near, small, jnp.asarray([0.0]))
    b = jnp.asarray([1.0, 2.0], jnp.bfloat16)
    with pytest.raises(AssertionError, match="neither jax.jit's bits nor within"):
        assert_matches(b * 1.5, b, b * 2)  # bfloat16 values are compared as floats
    ints = jnp.arange(4)
    with pytest.raises(AssertionError, match="integers, bools and keys must be bit-identical"):
        assert_matches(ints + 1, ints, ints + 1)
    k = jax.random.key(0)
    with pytest.raises(AssertionError, match="eager construction gives key<fry>"):
        assert_matches(jax.random.key_data(k), k, k)
    with pytest.raises(AssertionError, match="integers, bools and keys must be bit-identical"):
        assert_matches(jax.random.key(1), k, jax.random.key(1))
    with pytest.raises(AssertionError, match="eager construction gives float32"):
        assert_matches(x.astype(jnp.bfloat16), x, x)


def test_configured_puts_jax_configuration_back_even_when_the_block_fails():
    before = (
        jax.config.jax_threefry_partitionable,
        jax.config.jax_enable_x64,
        str(jax.config.jax_default_prng_impl),
    )
    changed = Config(not before[0], not before[1], "rbg", host_eval_bytes=8)
    with pytest.raises(RuntimeError, match="inside"):
        with configured(changed):
            assert jax.config.jax_threefry_partitionable is changed.partitionable
            assert jax.config.jax_enable_x64 is changed.x64
            assert jax.random.key_impl(jax.random.key(0)) == jax.random.key_impl(
                jax.random.key(0, impl="rbg")
            )
            assert _trace.host_bound() == 8
            raise RuntimeError("inside")
    after = (
        jax.config.jax_threefry_partitionable,
        jax.config.jax_enable_x64,
        str(jax.config.jax_default_prng_impl),
    )
    assert after == before
    assert _trace.host_bound() == _trace.SMALL_BYTES


def test_the_adapters_refuse_what_refusal_says_they_refuse():
    factory = eqx_factory(Constructor((Var("v0", (8,), "float32", Leaf("normal", "float32")),)))
    mesh = meshes()["ab"]
    for config in (Config(prng_impl="rbg"), Config(prng_impl="unsafe_rbg"), Config(False)):
        c = Constructor((), framework=(("key_kind", "int"),))
        with configured(config):
            why = refusal(c, config)
            assert why is not None
            check_refused(why, lambda: meshinit.eqx.init(factory, 0, [(".*", None)], mesh=mesh))
    assert (
        refusal(Constructor((), framework=(("key_kind", "threefry"),)), Config(prng_impl="rbg"))
        is None
    )


def test_cut_per_variable_fails_on_a_fallback():
    def factory(key):
        w = jax.random.normal(key, (8, 8))
        return {"w": jax.pure_callback(lambda a: a, jax.ShapeDtypeStruct((8, 8), w.dtype), w)}

    with pytest.raises(AssertionError, match="fell back to the whole-constructor program"):
        with cut_per_variable():
            meshinit.eqx.init(factory, 0, [(r".*", None)], mesh=meshes()["ab"])


def test_the_terms_of_jax_samplers_are_those_of_their_uniform_draws():
    # jax's normal is sqrt(2) * erfinv(u * 2 - 1): a value near 0 is the difference of
    # two terms of magnitude 1, carried through erfinv's slope sqrt(pi) / 2
    near_zero = sampler_terms(Leaf("normal", "float32"), np.array([0.0, 1e-6]), 0, False)
    np.testing.assert_allclose(near_zero, 2 * math.sqrt(math.pi / 2), rtol=1e-5)
    # far out, erfinv's slope grows as exp(v**2 / 2)
    assert sampler_terms(Leaf("normal", "float32"), np.array([4.0]), 0, False)[0] > 1e3
    # uniform in [lo, hi): u * (hi - lo) + lo
    u = sampler_terms(Leaf("uniform", "float32", (-1.0, 2.0)), np.array([0.0, 1.5]), 0, False)
    np.testing.assert_allclose(u, [2.0, 3.5])
    # lecun_normal on (8, 16): a truncated normal scaled by sqrt(1 / 8) / 0.8796...
    c = math.sqrt(1 / 8) / 0.87962566103423978
    lecun = sampler_terms(Leaf("lecun_normal", "float32"), np.zeros((8, 16)), 0, False)
    np.testing.assert_allclose(lecun, c * math.sqrt(math.pi / 2) * 2 * math.erf(math.sqrt(2)))
    # equinox's Linear(8, 4): uniform in +-1/sqrt(8), weight and bias alike
    var = Var("v0", (8, 4), "float32", Leaf("linear", "float32", ("default", True)))
    lim = 1 / math.sqrt(8)
    np.testing.assert_allclose(linear_terms("eqx", var, "bias", np.zeros(4)), 2 * lim)


def test_the_terms_of_a_scalar_variable_are_a_scalar():
    got = sampler_terms(Leaf("normal", "float32"), np.asarray(1.0), 0, False)
    assert np.shape(got) == () and float(got) > 1.0
