"""Stage 2's outputs for people and tools: plan tables (:mod:`.report`), the plan as
plain data (:mod:`.records`) and per-device heatmaps (:mod:`.plot`)."""
