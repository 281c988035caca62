"""The load flow, in the order a parameter goes through it, each step handing to the next:

1. survey (:mod:`.survey`): every file checked, every path resolved, nothing read;
2. plan the reads (:mod:`.staging`): which parameters are read onto a staging sharding
   (fan-out), and in which batches their reshards run; every process agrees on it
   before the first collective (in :mod:`.load`, the driver);
3. fetch (:mod:`meshinit._checkpoint.store.fetch`, or the local files' mappings),
   place (:func:`meshinit._checkpoint.layout.host.array`), finish (:mod:`.ahead`),
   reshard (:mod:`.reshard`; where spanning axes were moved, by :mod:`.route`),
   composed per parameter by the read loop (:mod:`.loop`).

Following ``load``'s ``fan_out`` argument through a staged load of one parameter (the
calls of functions of meshinit/_checkpoint that receive ``fan_out`` or what it decides:
a staged job, a ``Stage``, the resharder; a ``Stage``'s own methods, the value answering
about itself, left out; a stay is a run of such calls in one module), the flow stays 7
times in 6 modules: load, staging, loop, reshard (made, with the batches' last paths),
host (mapped and placed), ahead, reshard. The one return is the resharder made before
the first parameter; before this cut it stayed 8 times in 5 modules, returning 3 times
(fanout 3 times: staging, the resharder made, the reshard called from ahead; host
twice: placed, then let go after the reshard).
"""
