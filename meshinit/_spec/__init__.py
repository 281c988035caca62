"""Stage 1, declare: lazy parameter specs (:mod:`.spec`), the logical-axis rules that
resolve them (:mod:`.rules`), what planning refuses before resolving anything
(:mod:`.input`), and initializer fingerprints (:mod:`.fingerprints`)."""
