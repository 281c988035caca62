"""The files of an export as Hugging Face writes them: sizes read as transformers
reads them, tensors cut in order within max_shard_size, each file given to one of its
tensors' writers for balance, headers the safetensors package reads, the index."""

import json

import ml_dtypes
import numpy as np
import pytest

from meshinit._checkpoint.write.files import Stored, plan, shard_size


@pytest.mark.parametrize(
    ("given", "want"),
    [
        (123, 123),
        ("5GB", 5 * 10**9),
        ("5GiB", 5 * 2**30),
        ("500MB", 500 * 10**6),
        ("100KiB", 100 * 1024),
        ("5Gb", 5 * 10**9 // 8),  # a lowercase b counts bits, as transformers reads it
        (" 2 GB ", 2 * 10**9),
    ],
)
def test_max_shard_size_reads_as_transformers_reads_it(given, want):
    assert shard_size(given) == want


@pytest.mark.parametrize("bad", ["5", "5 XB", "-1GB", "", 0, -3])
def test_a_size_that_is_not_one_is_refused_saying_how_to_write_it(bad):
    with pytest.raises(ValueError, match="max_shard_size"):
        shard_size(bad)
    with pytest.raises(TypeError, match="max_shard_size"):
        shard_size(2.5)


def _t(name, rows, writers=(0,), dtype=np.float32):
    return Stored(name, np.dtype(dtype), (rows, 4), tuple(writers))


def test_one_file_is_model_safetensors_with_no_index():
    files = plan([_t("a", 2), _t("b", 3)], None, 1)
    assert [f.name for f in files.files] == ["model.safetensors"] and files.index is None


def test_tensors_are_cut_in_order_within_the_size_unless_one_is_larger():
    tensors = [_t("a", 4), _t("b", 4), _t("big", 100), _t("c", 4)]  # 64, 64, 1600, 64 bytes
    files = plan(tensors, 128, 1)
    assert [[t.name for t in f.tensors] for f in files.files] == [["a", "b"], ["big"], ["c"]]
    assert [f.name for f in files.files] == [
        f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)
    ]
    index = json.loads(files.index)
    assert index["weight_map"] == {
        "a": files.files[0].name,
        "b": files.files[0].name,
        "big": files.files[1].name,
        "c": files.files[2].name,
    }
    assert index["metadata"] == {"total_size": 64 * 3 + 1600, "total_parameters": 4 * 112}


def test_files_are_shared_out_for_balance_among_their_tensors_writers():
    tensors = [_t(f"w{i}", 8, (0, 1, 2, 3)) for i in range(16)]
    files = plan(tensors, None, 4)  # the default: about four files a process
    shares = files.bytes_by_process(4)
    assert len(files.files) >= 4 and min(shares) > 0
    assert max(shares) <= 1.5 * min(shares)
    # a tensor whose parameters live on process 3 alone is written by process 3
    alone = plan([_t("x", 4, (0, 1)), _t("y", 4, (3,))], 10, 4)
    assert {f.tensors[0].name: f.writer for f in alone.files}["y"] == 3


def test_a_header_is_padded_to_8_bytes_and_its_offsets_tile_the_data():
    tensors = [_t("a", 3, dtype=ml_dtypes.bfloat16), _t("bb", 1)]
    (f,) = plan(tensors, None, 1).files
    n = int.from_bytes(f.header[:8], "little")
    assert len(f.header) == 8 + n and n % 8 == 0
    header = json.loads(f.header[8:])
    assert header["__metadata__"] == {"format": "pt"}
    assert header["a"] == {"dtype": "BF16", "shape": [3, 4], "data_offsets": [0, 24]}
    assert header["bb"] == {"dtype": "F32", "shape": [1, 4], "data_offsets": [24, 40]}
