"""The encodings the read flow asks, in order: float8 with block scales, then MXFP4.
The flow names none of them (:class:`~.base.Encoding`); an encoding is added here, one
line, and nowhere else.

The order is the flow's: each pairs the jobs the one before left (a job paired once is
its encoding's), and the inventory lists what each dequantizes in this order.
"""

from __future__ import annotations

from .base import Encoding
from .fp8 import pairing as _fp8
from .mxfp4 import pairing as _mxfp4

ENCODINGS: tuple[Encoding, ...] = (_fp8.ENCODING, _mxfp4.ENCODING)
