"""The loader: pretrained weights in, arrays on a plan's shardings out.

Its public face is :mod:`meshinit.safetensors` (``load`` and ``inventory``); a load
runs :mod:`.load` from start to end (:mod:`.survey` first, then :mod:`.read`). Its steps:

- :mod:`.source`: where a checkpoint's bytes live, one type (:mod:`.local` for files
  on disk, :mod:`.remote` for object storage and the Hub);
- :mod:`.file`: ``files=`` turned into sources (only those the checkpoint's index
  lists), each checked (by :mod:`.header`, as the safetensors format requires, and by
  the ``safetensors`` package) before a byte of data is read;
- :mod:`.names` and :mod:`.parts`: ``names=``, which stored tensors fill each plan
  path, and how (:class:`~meshinit.safetensors.Tensor`,
  :class:`~meshinit.safetensors.Stack`, :class:`~meshinit.safetensors.Concat`,
  :class:`~meshinit.safetensors.Fill`, :class:`~meshinit.safetensors.Pad`);
- :mod:`.layout`: each path's target checked against the stored tensors (:mod:`.reshape`
  for the views), and :mod:`.blocks`: a device's block of the parameter read from the
  parts it reaches;
- :mod:`.read`: the checked files read block by block onto the plan's shardings, each
  process reading only what its devices hold; nothing left alive on failure;
- :mod:`.keys`: a plan's typed PRNG keys, read as their stored key data and wrapped
  shard by shard onto the planned sharding;
- :mod:`.unused`: the stored tensors that no load reads, and how they are named;
- :mod:`.fetch`: of fetched sources (:mod:`.remote`'s objects in S3, GCS, the Hub or
  at https URLs), each process's byte runs fetched ahead of placement, within a budget
  of bytes.

It needs no framework: it sits above the run stage (agreement between processes) and
below the adapters.
"""
