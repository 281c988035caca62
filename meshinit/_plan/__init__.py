"""Stage 2, plan: specs resolved to exact ``NamedSharding`` s and grouped per mesh
(:mod:`.planner`), the plan as data (:mod:`.plan`, of :mod:`.entries`), optimizer
state placed beside its parameters (:mod:`.state`), sharding trees (:mod:`.shardings`),
and old method names (:mod:`.renamed`)."""
