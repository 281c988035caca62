"""An export's local folder: files written in order without copies, aborted, refused,
listed, renamed and deleted."""

import os
import tracemalloc

import numpy as np
import pytest
from helpers import upload_chunks

import meshinit
from meshinit._checkpoint.store.sink import Sink

INDEX = "model.safetensors.index.json"


# ------------------------------------------------- a local folder


def test_a_local_file_is_written_in_order_from_every_kind_of_chunk(tmp_path):
    out = Sink(tmp_path / "new" / "folder", None)  # made where absent
    chunks, whole = upload_chunks()
    upload = out.open("model.safetensors")
    for chunk in chunks:
        upload.write(chunk)
    assert upload.written == len(whole)
    assert upload.close() == len(whole)
    assert upload.close() == len(whole)  # again: nothing more
    assert (tmp_path / "new" / "folder" / "model.safetensors").read_bytes() == whole
    assert str(out) == str(tmp_path / "new" / "folder")


def test_a_numpy_array_is_written_without_a_copy(tmp_path):
    # 64 MiB: tracemalloc counts every thread, and a test before this one may leave a
    # thread allocating a few MiB (CI saw 10 MB); a copy would be the whole 64 MiB.
    array = np.ones((4096, 4096), np.float32)
    upload = Sink(tmp_path, None).open("a.safetensors")
    tracemalloc.start()
    try:
        upload.write(array)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    upload.close()
    assert peak < array.nbytes // 4, f"writing copied the array: {peak} bytes allocated"
    assert (tmp_path / "a.safetensors").stat().st_size == array.nbytes


def test_abort_removes_the_partial_file_and_ends_the_upload(tmp_path):
    out = Sink(tmp_path, None)
    upload = out.open("a.safetensors")
    upload.write(b"x" * 1000)
    upload.abort()
    upload.abort()  # again: nothing
    assert not (tmp_path / "a.safetensors").exists()
    with pytest.raises(ValueError, match="the upload is aborted"):
        upload.write(b"y")
    with pytest.raises(ValueError, match="the upload is aborted"):
        upload.close()
    with pytest.raises(RuntimeError, match="boom"), out.open("b.safetensors") as b:
        b.write(b"partial")
        raise RuntimeError("boom")
    assert os.listdir(tmp_path) == []


def test_a_full_disk_is_a_plan_error_naming_the_file_and_abort_cleans_up(tmp_path):
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full (Linux), a device that is always full")
    (tmp_path / "a.safetensors").symlink_to("/dev/full")
    upload = Sink(tmp_path, None).open("a.safetensors")
    with pytest.raises(meshinit.PlanError, match="the disk is full") as raised:
        upload.write(np.zeros(1 << 16, np.uint8))
    assert str(tmp_path / "a.safetensors") in str(raised.value)
    assert "meshinit.safetensors.save: a file could not be written" in str(raised.value)
    with pytest.raises(ValueError, match=r"the upload is failed; abort\(\) it"):
        upload.write(b"more")
    upload.abort()
    assert os.listdir(tmp_path) == []


def test_a_file_that_cannot_be_created_is_a_plan_error(tmp_path):
    (tmp_path / "a.safetensors").mkdir()
    with pytest.raises(meshinit.PlanError, match="a.safetensors: cannot be created: Is a dir"):
        Sink(tmp_path, None).open("a.safetensors")


def test_checkpoint_files_are_the_safetensors_and_the_index_not_hidden_or_other_files(tmp_path):
    for name in ("b.safetensors", "a.safetensors", INDEX, ".a.safetensors", "config.json",
                 "notes.txt", "a.safetensors.tmp"):  # fmt: skip
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / "dir.safetensors").mkdir()
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.safetensors").write_bytes(b"x")
    assert Sink(tmp_path, None).checkpoint_files() == ["a.safetensors", "b.safetensors", INDEX]


def test_put_rename_and_delete_in_a_folder(tmp_path):
    out = Sink(tmp_path, None)
    out.put("a.tmp", b"new")
    out.put("a.safetensors", np.arange(3, dtype=np.uint8))
    out.rename("a.tmp", "a.safetensors")  # replaces it
    assert (tmp_path / "a.safetensors").read_bytes() == b"new"
    assert not (tmp_path / "a.tmp").exists()
    with pytest.raises(meshinit.PlanError, match="a.tmp: cannot be renamed to a.safetensors"):
        out.rename("a.tmp", "a.safetensors")
    (tmp_path / "d").mkdir()
    problems = out.delete(["a.safetensors", "absent.safetensors", "d"])
    assert not (tmp_path / "a.safetensors").exists()
    assert len(problems) == 1 and problems[0].startswith(f"{tmp_path / 'd'}: cannot be deleted")
    assert out.delete([]) == []


def test_a_folder_is_made_at_the_first_write_not_before(tmp_path):
    sink = Sink(tmp_path / "a" / "b")
    assert sink.checkpoint_files() == [] and not (tmp_path / "a").exists()
    sink.put("config.json", b"{}")
    assert (tmp_path / "a" / "b" / "config.json").read_bytes() == b"{}"
    (tmp_path / "file").write_text("")
    with pytest.raises(meshinit.PlanError, match="file: is not a folder"):
        Sink(tmp_path / "file")
