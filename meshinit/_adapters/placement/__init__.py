"""``placements=``, the sharding kept outside the model, read alike for nnx, linen and
eqx: one placement checked (:mod:`.parsed`), what every form offers the adapters
(:mod:`.forms`), tables of patterns (:mod:`.table`), trees of shardings (:mod:`.tree`),
rule functions (:mod:`.rule`), any form read into one (:mod:`.read`), and where
replicated variables without a mesh go (:mod:`.replicas`)."""
