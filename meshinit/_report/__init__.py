"""Stage 2's outputs for people and tools, each drawn from a plan's record (built by
``meshinit._plan.record``; nothing here reads a ``Plan``): plan tables and HTML
(:mod:`.report`), the record as JSON text (:mod:`.json_text`) and per-device heatmaps
(:mod:`.plot`)."""
