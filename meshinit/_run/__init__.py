"""Stage 3, run: a plan made into arrays, per mesh group, with exact ``out_shardings``.
:mod:`.materialize` checks (:mod:`.checks`), compiles (:mod:`.compile`), and calls the
programs a strategy (:mod:`.strategies`, :mod:`.options`) builds, with a progress bar
(:mod:`.progress`), agreed between processes (:mod:`.agree`)."""
