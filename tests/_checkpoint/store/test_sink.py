"""A Sink: what it can be, said before anything is written."""

import os

import pytest

import meshinit
from meshinit._checkpoint.store.sink import Sink

INDEX = "model.safetensors.index.json"


def test_what_a_sink_cannot_be_is_said_before_anything_is_written(tmp_path):
    with pytest.raises(TypeError, match=r"not hf:// .*upload_folder"):
        Sink("hf://org/model", None)
    with pytest.raises(TypeError, match="not https://"):
        Sink("https://example.com/x", None)
    with pytest.raises(TypeError, match="dest must be a folder's path"):
        Sink(3, None)
    with pytest.raises(TypeError, match="storage_options must be a mapping"):
        Sink(tmp_path, "x")
    with pytest.raises(meshinit.PlanError, match=r"\(secret_access_key\) are for s3://") as e:
        Sink(tmp_path, {"secret_access_key": "hunter2"})
    assert "hunter2" not in str(e.value)
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(meshinit.PlanError, match="file: is not a folder"):
        Sink(tmp_path / "file", None)
    for bad in ("", "a/b", "..", None):
        with pytest.raises(ValueError, match="a plain name"):
            Sink(tmp_path, None).open(bad)
    with pytest.raises(ValueError, match="size is the file's bytes"):
        Sink(tmp_path, None).open("a.safetensors", size=-1)
    assert os.listdir(tmp_path) == ["file"]


# ------------------------------------------------- S3 and GCS
