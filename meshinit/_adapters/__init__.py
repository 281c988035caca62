"""The adapt stage's internals. Each framework's trace-and-plan lives under its name
(:mod:`.nnx`, :mod:`.linen`, :mod:`.eqx`) and returns one :class:`.prepared.Prepared`,
which :func:`.prepared.init` runs for every public ``init``; what the adapters share
(:mod:`.common`); ``placements=`` in every form (:mod:`.placement`); how each reads its
framework's sharding metadata (:mod:`.nnx_meta`, :mod:`.linen_meta`); and the nnx
optimizer (:mod:`.nnx_optimizer`). The pretrained-weights loader is a stage of its own,
:mod:`meshinit._checkpoint`."""
