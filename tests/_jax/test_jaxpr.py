"""A trace as a flat program, and the structural fingerprints of its slices."""

import jax
import numpy as np

from meshinit._jax import jaxpr as _jaxpr


def test_a_scan_inside_a_jitted_helper_fingerprints_without_recursion():
    # jax 0.11 made ClosedJaxpr and Jaxpr one type, whose .jaxpr is itself: a walker
    # that recursed through .jaxpr looped forever (RecursionError on every scan).
    def f(k):
        return jax.jit(lambda k: jax.lax.scan(lambda c, kk: (c, jax.random.normal(kk)), 0, k))(
            jax.random.split(k, 3)
        )[1]

    prog = _jaxpr.flatten(jax.make_jaxpr(f)(jax.random.key(0)))
    digest = _jaxpr.slice_fingerprint(prog, range(len(prog.nodes)), [0], prog.outputs[0], {})
    assert isinstance(digest, str) and len(digest) == 32


def test_equal_computations_fingerprint_alike_and_others_do_not():
    def digest(f):
        prog = _jaxpr.flatten(jax.make_jaxpr(f)(np.zeros(4, np.float32)))
        nodes = range(len(prog.nodes))
        return _jaxpr.slice_fingerprint(prog, nodes, list(prog.inputs), prog.outputs[0], {})

    assert digest(lambda x: x * 2.0 + 1) == digest(lambda y: y * 2.0 + 1)
    assert digest(lambda x: x * 2.0 + 1) != digest(lambda x: x * 3.0 + 1)


def test_reads_names_only_the_inputs_each_output_depends_on():
    closed = jax.make_jaxpr(lambda a, b, c: (a + 1, b * c))(
        np.float32(0), np.float32(0), np.float32(0)
    )
    assert _jaxpr.reads(closed) == [frozenset({0}), frozenset({1, 2})]
