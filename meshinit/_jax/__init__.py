"""The base layer: the jax-facing primitives every stage may use, and nothing above it.

- :mod:`.compat`: every jax internal meshinit uses, per jax version;
- :mod:`.jaxpr`: a traced computation as a flat program, and structural fingerprints
  (the constructor engine's slices, optax's state initializers);
- :mod:`.explicit`: the sharding constraints jit lowers under an Explicit mesh, for
  meshinit's programs traced on its Auto twin;
- :mod:`.threefry`: every piece of threefry code the host, the key derivation of
  :mod:`meshinit._paths` and the compiled programs share.

It imports only the shared leaves (``_errors``, ``_format``, ``_caches``), jax and numpy.
"""
