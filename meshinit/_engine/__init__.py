"""The constructor engine: unchanged model code (nnx, linen, equinox constructors),
traced once, cut per variable, and compiled per signature onto the plan's meshes.

Adapters call it through :mod:`.entry` only. Its steps, in order:

- :mod:`.trace`: trace the constructor once; cut each variable's slice out of the trace;
- :mod:`.host_eval` (with :mod:`.host_numeric`): the small part (keys, counters,
  scalars), evaluated exactly on the host;
- :mod:`.run`: the slices grouped by signature, compiled and called per mesh group.

The jax-facing pieces it shares with every other stage (the flat program and its
fingerprints, the threefry code, jax's internals) are the base layer,
:mod:`meshinit._jax`.
"""
