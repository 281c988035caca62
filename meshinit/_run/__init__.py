"""Stage 3, run: a plan made into arrays, per mesh group, with exact ``out_shardings``.
:mod:`.materialize` is the public face; :mod:`.loop` the one run loop, which checks
(:mod:`.checks`), compiles (:mod:`.compile`), places (:mod:`.place`) and calls what a
group maker (:mod:`.maker`; the spec path's: :mod:`.strategies`, :mod:`.options`)
builds, with a progress bar (:mod:`.progress`), agreed between processes (:mod:`.agree`)."""
