"""Initializer fingerprints, and the abstract init check run once per signature."""

import jax
import numpy as np
from helpers import lecun
from jax.sharding import AbstractMesh

import meshinit
from meshinit._spec import fingerprints as _signature

ones = jax.nn.initializers.ones


def test_abstract_init_check_runs_once_per_distinct_signature_at_10000_specs(monkeypatch):
    calls = []
    real = jax.eval_shape

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(jax, "eval_shape", counting)
    _signature._CHECKS.clear()
    m = AbstractMesh((2, 4), ("fsdp", "tensor"))
    with meshinit.defaults(mesh=m, rules=(("embed", "fsdp"), ("mlp", "tensor"))):
        tree = [
            {
                "up": meshinit.param((256, 1024), lecun(), axes=("embed", "mlp")),
                "down": meshinit.param((1024, 256), lecun(), axes=("mlp", "embed")),
                "n": meshinit.param((256,), jax.nn.initializers.ones, axes=("embed",)),
                "s": meshinit.param((256,), jax.nn.initializers.normal(0.1), axes=(None,)),
            }
            for _ in range(2500)
        ]
    p = meshinit.plan(tree)
    assert len(p.entries) == 10_000
    # lecun_normal() is a fresh closure per call; still one check per (init, shape, dtype).
    assert len(calls) == 4
    assert len({e.signature for e in p.entries}) == 4


def test_fingerprint_tells_apart_initializers_that_compute_differently():
    fp = _signature.initializer_fingerprint
    assert fp(lecun()) == fp(lecun())
    assert fp(jax.nn.initializers.normal(0.1)) != fp(jax.nn.initializers.normal(0.2))
    assert fp(jax.nn.initializers.normal(1)) != fp(jax.nn.initializers.normal(1.0))
    assert fp(lecun()) != fp(jax.nn.initializers.he_normal())
    arr = np.ones(3)
    f = lambda k, s, d: arr  # noqa: E731  (closure over an array: by its contents)
    g = lambda k, s, d: arr + 0  # noqa: E731
    assert fp(f)[0] == "fp" and fp(f) != fp(g)
    big = np.ones(1 << 19)  # over _MAX_ARRAY_BYTES: identity, never equal to another call's
    h = lambda k, s, d: big  # noqa: E731
    assert fp(h)[:2] == ("call", h) and fp(h) != fp(h)
