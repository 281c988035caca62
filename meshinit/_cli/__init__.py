"""The command line (:mod:`.cli`): ``meshinit demo`` (:mod:`.demo`) and ``meshinit plan``."""
