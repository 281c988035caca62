"""The checkpoint stage: pretrained weights in, arrays on a plan's shardings out.

Its public faces are :mod:`meshinit.safetensors` (``load`` and ``inventory``),
:mod:`meshinit.maxtext` and :mod:`meshinit.tunix`. It is cut by concern, as
tensorstore cuts storage, each folder a set of siblings, imports pointing down only:

- :mod:`.store`: where bytes live (a local file, an object in S3, GCS, the Hub or at
  an https URL): one ``Source`` type, listing, header checks, ranged fetches;
- :mod:`.layout`: how a plan path maps to stored tensors (``names=``'s targets, their
  views, which stored bytes a device's block reads) and the host side of a
  parameter's read (:mod:`.layout.host`);
- :mod:`.encodings`: how stored bytes encode values (float8 with block scales, MXFP4,
  typed PRNG keys), each encoding a sibling that imports no other;
- :mod:`.maps`: framework names (``names=`` tables, MaxText's and tunix's maps read
  through stand-ins, the stored tensors no path claims);
- :mod:`.read`: the load flow, in its order: survey, plan the reads, fetch and place,
  finish, reshard.

It needs no framework: it sits above the run stage (agreement between processes) and
below the adapters.
"""
