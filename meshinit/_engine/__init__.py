"""The constructor engine: unchanged model code (nnx, linen, equinox constructors),
traced once, cut per variable, and compiled per signature onto the plan's meshes.

Adapters call it through :mod:`.entry` only. Its steps, in order:

- :mod:`.trace`: trace the constructor once; cut each variable's slice out of the trace;
- :mod:`.jaxpr`: the trace as a flat program, and fingerprints of its slices;
- :mod:`.host_eval` (with :mod:`.host_numeric`): the small part (keys, counters,
  scalars), evaluated exactly on the host;
- :mod:`.run`: the slices grouped by signature, compiled and called per mesh group;
- :mod:`.threefry`: every piece of threefry code the host and the programs share;
- :mod:`.compat`: every jax internal the engine uses.

This ``__init__`` imports nothing: :mod:`meshinit._paths` needs :mod:`.threefry` before
the rest of the engine can load.
"""
