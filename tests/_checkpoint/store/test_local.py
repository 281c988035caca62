"""A local file as a source: opened only once known to be a regular file, identified
by device, inode, size and mtime, refused once it changed, and mapped again as the
file that was checked."""

import mmap
import os

import numpy as np
import pytest
from helpers import load_refused, plan_for, stored

import meshinit
from meshinit._checkpoint.read import survey as _survey
from meshinit._checkpoint.store import local

save_file = pytest.importorskip("safetensors.numpy").save_file


def test_a_checked_file_maps_as_the_bytes_it_holds(tmp_path):
    want = np.arange(4096, dtype=np.float32)
    source = local.LocalFile(stored(tmp_path, {"a": want}))
    identity, tensors, problems = source.check()
    assert problems == []
    a = tensors["a"]
    mapped = source.mapping(identity, 0, a.start + a.nbytes)
    got = np.frombuffer(mapped, np.float32, 4096, a.start)
    np.testing.assert_array_equal(got, want)
    assert source.changed(identity) is None


def test_a_file_rewritten_after_its_check_is_changed_and_not_mapped(tmp_path):
    path = stored(tmp_path, {"a": np.ones(4, np.float32)})
    source = local.LocalFile(path)
    identity, _, _ = source.check()
    os.utime(path, ns=(1, 1))
    assert source.changed(identity) == "changed since it was checked; load again"
    with pytest.raises(meshinit.PlanError, match="a file changed while it was read"):
        source.mapping(identity, 0, mmap.ALLOCATIONGRANULARITY)


def test_a_fifo_is_named_without_being_opened(tmp_path):
    fifo = tmp_path / "m.safetensors"
    os.mkfifo(fifo)
    f, st, why = local.open_regular(fifo)
    assert (f, st, why) == (None, None, "is a FIFO (named pipe), not a regular file")
    assert local.LocalFile(fifo).check() == (None, {}, [why])


@pytest.mark.parametrize(
    ("text", "want"),
    [(None, (None, None)), ("{}", (b"{}", None)), ("x" * 20, (None, "is over 10 bytes: not X"))],
)
def test_a_small_file_is_read_whole_or_named_or_absent(tmp_path, text, want):
    path = tmp_path / "config.json"
    if text is not None:
        path.write_text(text)
    assert local.LocalFile(path).contents(10, "X") == want


def test_a_file_changed_after_its_check_is_refused_before_reading(tmp_path, monkeypatch):
    f = tmp_path / "m.safetensors"
    save_file({"a": np.ones(4, np.float32)}, str(f))
    survey = _survey.survey

    def then_rewritten(*args):
        out = survey(*args)
        save_file({"a": np.zeros(4, np.float32)}, str(f))  # a download finishing, say
        os.utime(f, ns=(1, 1))
        return out

    monkeypatch.setattr(_survey, "survey", then_rewritten)
    load_refused(plan_for({"a": (4,)}), f, str(f), "changed since it was checked")
