"""Stage 4's internals: what the public adapters (:mod:`meshinit.nnx`,
:mod:`meshinit.linen`, :mod:`meshinit.eqx`) share (:mod:`.common`), and how each reads
its framework's sharding metadata (:mod:`.nnx_meta`, :mod:`.linen_meta`) or builds its
optimizer (:mod:`.nnx_optimizer`)."""
