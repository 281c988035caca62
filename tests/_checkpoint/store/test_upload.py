"""What every upload refuses before writing a byte."""

import numpy as np
import pytest

from meshinit._checkpoint.store.sink import Sink

INDEX = "model.safetensors.index.json"


def test_a_strided_array_or_a_bufferless_object_is_refused(tmp_path):
    upload = Sink(tmp_path, None).open("a.safetensors")
    with pytest.raises(ValueError, match=r"not C-contiguous .*np.ascontiguousarray"):
        upload.write(np.ones((4, 6), np.float32)[:, :3])
    with pytest.raises(TypeError, match="bytes, a memoryview or a numpy array, got str"):
        upload.write("text")
    upload.write(b"ok")  # still usable: nothing was written
    assert upload.close() == 2
