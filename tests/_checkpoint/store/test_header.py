"""``meshinit.safetensors.load`` on untrusted files: every file is checked as the format
requires before a byte of data is read or allocated; a bad one is one PlanError naming
the file, the tensor and what is wrong; nothing half-loaded outlives a failure."""

import json
import struct
import tracemalloc

import jax
import ml_dtypes
import numpy as np
import pytest
from helpers import load_refused, mesh8, plan_for

import meshinit
from meshinit import safetensors as st
from meshinit._checkpoint.layout import host as _read

save_file = pytest.importorskip("safetensors.numpy").save_file
safe_open = pytest.importorskip("safetensors").safe_open


def raw(path, header, data=b"", length=None):
    """A file of ``header`` (a dict as JSON, or bytes as they are) and ``data``; the
    length field says ``length`` where given (a lie), else the header's length."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    n = len(text) if length is None else length
    path.write_bytes(struct.pack("<Q", n) + text + data)
    return path


A_F32 = b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}'
F32_2 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
DATA = np.arange(4, dtype=np.float32).tobytes()


# ---------------------------------------------------------------- headers that lie


def test_overlapping_offsets_are_refused_not_read_as_a_copy(tmp_path):
    f = raw(tmp_path / "m.safetensors", {"a": F32_2, "b": F32_2}, DATA[:8])
    load_refused(plan_for({"a": (2,), "b": (2,)}), f, str(f), "'b'", "overlap", "'a'")


@pytest.mark.parametrize("offsets", [[-8, 0], [0.0, 8], [0, 8, 8], "0:8", [8, 0]])
def test_negative_fractional_or_malformed_offsets_are_refused(tmp_path, offsets):
    # a negative start once read the header's own JSON text as weights
    f = raw(tmp_path / "m.safetensors", {"a": {**F32_2, "data_offsets": offsets}}, DATA[:8])
    load_refused(plan_for({"a": (2,)}), f, str(f), "'a'", "data_offsets")


def test_a_start_offset_before_the_previous_end_is_an_overlap(tmp_path):
    header = {
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
    }
    f = raw(tmp_path / "m.safetensors", header, DATA[:12])
    load_refused(plan_for({"a": (2,), "b": (2,)}), f, "'b'", "overlap")


@pytest.mark.parametrize(
    "entry,said",
    [
        ({"dtype": "F64", "shape": [2], "data_offsets": [0, 8]}, "is 16 bytes"),
        ({"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}, "is 16 bytes"),
        ({"dtype": "F32", "shape": [1], "data_offsets": [0, 8]}, "is 4 bytes"),
    ],
)
def test_a_dtype_or_shape_that_disagrees_with_the_extent_is_refused(tmp_path, entry, said):
    # a larger dtype or shape once read the neighbouring tensor's bytes
    header = {"a": entry, "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}
    f = raw(tmp_path / "m.safetensors", header, DATA)
    load_refused(plan_for({"b": (2,)}), f, "'a'", said, "hold 8", unused="ignore")


def test_a_name_given_twice_is_refused(tmp_path):
    # safetensors itself keeps the last entry of a duplicate name silently; the format
    # forbids duplicates, and one of them would hide the other
    header = (
        b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
        b'"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'
    )
    f = raw(tmp_path / "m.safetensors", header, DATA[:8])
    with safe_open(str(f), "numpy") as reference:  # what the package does
        assert list(reference.keys()) == ["a"]
    load_refused(plan_for({"a": (2,)}), f, str(f), "'a' twice")


def test_a_gap_or_bytes_after_the_last_tensor_are_refused(tmp_path):
    gap = raw(
        tmp_path / "gap.safetensors",
        {
            "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
            "b": {**F32_2, "data_offsets": [8, 16]},
        },
        DATA,
    )
    load_refused(plan_for({"b": (2,)}), gap, "'b'", "no gap", unused="ignore")
    trailing = raw(tmp_path / "trailing.safetensors", {"a": F32_2}, DATA)
    load_refused(plan_for({"a": (2,)}), trailing, "8 bytes after its last tensor")


# ---------------------------------------------------------------- the header's length


@pytest.mark.parametrize("length,said", [(2**26, "only"), (2**32, "cap"), (2**60, "cap")])
def test_a_header_length_that_lies_allocates_nothing(tmp_path, length, said):
    # a 202-byte file whose length field said 2**32 once allocated 4 GiB; 2**60 gave a
    # bare MemoryError
    f = raw(tmp_path / "m.safetensors", {"a": F32_2}, DATA[:8], length=length)
    tracemalloc.start()
    try:
        load_refused(plan_for({"a": (2,)}), f, str(f), "header length", said)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak


@pytest.mark.parametrize("size", [0, 5])
def test_an_empty_or_tiny_file_is_named(tmp_path, size):
    f = tmp_path / "m.safetensors"
    f.write_bytes(b"\x01" * size)
    load_refused(plan_for({"a": (2,)}), f, str(f), f"is {size} bytes")


def test_a_truncated_download_is_named(tmp_path):
    full = raw(
        tmp_path / "full.safetensors", {"a": F32_2, "b": {**F32_2, "data_offsets": [8, 16]}}, DATA
    )
    cut = tmp_path / "m.safetensors"
    cut.write_bytes(full.read_bytes()[:-5])
    full.unlink()
    load_refused(plan_for({"a": (2,), "b": (2,)}), cut, str(cut), "truncated")


@pytest.mark.parametrize(
    "header,said",
    [
        (b'{"\xff": {}}', "not UTF-8"),
        (b'{"a": ', "not valid JSON"),
        (b"[1, 2]", "JSON list, not an object"),
        (b'{"a": {"shape": [2], "data_offsets": [0, 8]}}', "dtype, shape and data_offsets"),
        (b'{"a": 7}', "dtype, shape and data_offsets"),
        (b'{"a": {"dtype": "F32", "shape": ["2"], "data_offsets": [0, 8]}}', "shape"),
        (b'{"a": {"dtype": "F32", "shape": [true, 2], "data_offsets": [0, 8]}}', "shape"),
        (b'{"a": {"dtype": "Q7", "shape": [2], "data_offsets": [0, 8]}}', "dtype 'Q7'"),
        (b'{"a": {"dtype": 4, "shape": [2], "data_offsets": [0, 8]}}', "dtype 4"),
        (b'{"__metadata__": {"k": 1}, ' + A_F32[1:], "__metadata__"),
        (b'{"__metadata__": [], ' + A_F32[1:], "__metadata__"),
    ],
)
def test_a_malformed_header_is_one_plan_error_naming_the_file(tmp_path, header, said):
    # these were bare UnicodeDecodeError, JSONDecodeError, AttributeError, KeyError and
    # TypeError, naming nothing
    f = raw(tmp_path / "m.safetensors", header, DATA[:8])
    load_refused(plan_for({"a": (2,)}), f, str(f), said)


def test_every_bad_file_of_a_load_is_named_in_one_error_and_nothing_is_read(
    tmp_path, monkeypatch, new_arrays
):
    (tmp_path / "ckpt").mkdir()
    save_file({"good": np.ones(4, np.float32)}, str(tmp_path / "ckpt" / "a.safetensors"))
    raw(tmp_path / "ckpt" / "b.safetensors", {"x": {**F32_2, "data_offsets": [-8, 0]}}, DATA[:8])
    (tmp_path / "ckpt" / "c.safetensors").write_bytes(b"")
    reads = []
    monkeypatch.setattr(_read, "parts", lambda *a: reads.append(a))
    with new_arrays() as made:
        error = load_refused(
            plan_for({"good": (4,), "x": (2,)}), tmp_path / "ckpt", "b.safetensors", "c.safetensors"
        )
    assert len(error.problems) == 2, error.problems
    assert reads == [] and made == []


# ---------------------------------------------------------------- valid files


def test_an_empty_tensor_at_a_page_aligned_end_of_file_loads_as_safetensors_does(tmp_path):
    # the old reader mapped it at the end of the file: "mmap offset is greater than file size"
    import mmap

    n = mmap.ALLOCATIONGRANULARITY
    rest = n - 8 - 256  # the header padded to 256 bytes, then data up to a page boundary
    header = {
        "a": {"dtype": "U8", "shape": [rest], "data_offsets": [0, rest]},
        "e": {"dtype": "F32", "shape": [0, 3], "data_offsets": [rest, rest]},
    }
    text = json.dumps(header).encode().ljust(256)
    f = tmp_path / "m.safetensors"
    f.write_bytes(struct.pack("<Q", 256) + text + bytes(i % 251 for i in range(rest)))
    assert f.stat().st_size % n == 0
    with safe_open(str(f), "numpy") as reference:
        want = {k: reference.get_tensor(k) for k in reference.keys()}
    specs = {
        "a": meshinit.param((rest,), jax.nn.initializers.zeros, dtype=np.uint8, mesh=mesh8()),
        "e": meshinit.param((0, 3), jax.nn.initializers.zeros, mesh=mesh8()),
    }
    got = st.load(meshinit.plan(specs), f)
    for k in want:
        assert np.asarray(got[k]).tobytes() == want[k].tobytes() and got[k].shape == want[k].shape


def test_scalars_and_f8_load_bit_for_bit(tmp_path):
    tensors = {
        "s": np.array(3.5, np.float32),
        "f8": np.linspace(-2, 2, 16).astype(ml_dtypes.float8_e4m3fn),
    }
    save_file(tensors, str(tmp_path / "m.safetensors"))
    specs = {
        k: meshinit.param(v.shape, jax.nn.initializers.zeros, dtype=v.dtype, mesh=mesh8())
        for k, v in tensors.items()
    }
    got = st.load(meshinit.plan(specs), tmp_path)
    for k, v in tensors.items():
        assert np.asarray(got[k]).tobytes() == v.tobytes(), k


def test_without_the_safetensors_package_the_error_says_how_to_install_it(tmp_path, monkeypatch):
    save_file({"a": np.ones(4, np.float32)}, str(tmp_path / "m.safetensors"))
    monkeypatch.setitem(__import__("sys").modules, "safetensors", None)
    with pytest.raises(ImportError, match=r"pip install 'meshinit\[safetensors\]'"):
        st.load(plan_for({"a": (4,)}), tmp_path)
