"""The adapt stage's internals: what the public adapters (:mod:`meshinit.nnx`,
:mod:`meshinit.linen`, :mod:`meshinit.eqx`) share (:mod:`.common`), ``placements=``
tables (:mod:`.placements`), how each reads its framework's sharding metadata
(:mod:`.nnx_meta`, :mod:`.linen_meta`), and the nnx optimizer (:mod:`.nnx_optimizer`).
The pretrained-weights loader is a stage of its own, :mod:`meshinit._load`."""
