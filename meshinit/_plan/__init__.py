"""Stage 2, plan: specs resolved to exact ``NamedSharding`` s and grouped per mesh
(:mod:`.planner`), the plan as data (:mod:`.plan`, of :mod:`.entries`), the plan's
record that every report renders (:mod:`.record`), optimizer state placed beside its
parameters (:mod:`.state`), sharding trees (:mod:`.shardings`), and old method names
(:mod:`.renamed`)."""
