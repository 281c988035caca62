"""Differential: random valid files written by the ``safetensors`` package, and random
corruptions of them, loaded by meshinit and by ``safetensors`` itself. meshinit loads
exactly what ``safetensors`` loads, bit for bit, and refuses exactly what it refuses,
with a PlanError that names the file.

One difference is by design: a name twice in a header. The format forbids it;
``safetensors`` keeps the last entry silently when the duplicates tile the data, and
meshinit refuses it. The test checks that case apart.

``MESHINIT_FUZZ_EXAMPLES`` (default 200) sets the examples, as for the engine's fuzzer.
"""

import json
import os
import struct
import tempfile
import warnings

import jax
import ml_dtypes
import numpy as np
import pytest
from helpers import examples, mesh8
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import meshinit

save_file = pytest.importorskip("safetensors.numpy").save_file
safetensors = pytest.importorskip("safetensors")

EXAMPLES = int(os.environ.get("MESHINIT_FUZZ_EXAMPLES", examples(200, 50)))

# What both read with numpy (safetensors 0.4.5 cannot give numpy its float8 types),
# and jax holds without x64.
DTYPES = {
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I8": np.int8,
    "I16": np.int16,
    "I32": np.int32,
    "U8": np.uint8,
    "U16": np.uint16,
    "BOOL": np.bool_,
}
NAMES = st.text(alphabet="ab._é", min_size=1, max_size=4)


@st.composite
def files(draw):
    """A dict of tensors, as ``save_file`` takes it."""
    out = {}
    for name in draw(st.lists(NAMES, min_size=0, max_size=4, unique=True)):
        dtype = DTYPES[draw(st.sampled_from(sorted(DTYPES)))]
        shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
        raw = draw(
            st.binary(min_size=np.dtype(dtype).itemsize * int(np.prod(shape)), max_size=4096)
        )
        value = np.frombuffer(raw[: np.dtype(dtype).itemsize * int(np.prod(shape))], np.uint8)
        if dtype is np.bool_:
            value = value % 2
        out[name] = value.view(dtype).reshape(shape).copy()
    return out


def _split(blob):
    (n,) = struct.unpack("<Q", blob[:8])
    return n, blob[8 : 8 + n], blob[8 + n :]


def _join(header_text, data, pad=True):
    if pad:
        header_text += b" " * (-len(header_text) % 8)
    return struct.pack("<Q", len(header_text)) + header_text + data


@st.composite
def corrupted(draw, blob):
    """``blob`` as written, or broken in one of the ways files break."""
    kind = draw(
        st.sampled_from(
            ["none", "byte", "truncate", "append", "length", "entry", "duplicate", "metadata"]
        )
    )
    n, header, data = _split(blob)
    if kind == "none":
        return kind, blob
    if kind == "byte":  # a flipped byte: in the data it is still a valid file
        in_data = data and draw(st.booleans())
        at = draw(st.integers(8 + n if in_data else 0, len(blob) - 1))
        return kind, blob[:at] + bytes([draw(st.integers(0, 255))]) + blob[at + 1 :]
    if kind == "truncate":
        return kind, blob[: draw(st.integers(0, len(blob) - 1))]
    if kind == "append":
        return kind, blob + draw(st.binary(min_size=1, max_size=16))
    if kind == "length":
        lie = draw(st.one_of(st.integers(-16, 16).map(lambda d: n + d), st.integers(0, 2**64 - 1)))
        return kind, struct.pack("<Q", max(0, lie)) + blob[8:]
    parsed = json.loads(header)
    tensors = [k for k in parsed if k != "__metadata__"]
    if kind == "metadata":
        parsed["__metadata__"] = draw(
            st.sampled_from([{"k": "v"}, {"k": 1}, [], "x", None, {"k": None}])
        )
        return kind, _join(json.dumps(parsed).encode(), data)
    if not tensors:
        return "none", blob
    name = draw(st.sampled_from(tensors))
    if kind == "duplicate":  # the entry again, as it is or with other offsets
        entry = dict(parsed[name])
        if draw(st.booleans()):
            entry["data_offsets"] = [0, entry["data_offsets"][1] - entry["data_offsets"][0]]
        text = json.dumps(parsed)[:-1] + f", {json.dumps(name)}: {json.dumps(entry)}}}"
        return kind, _join(text.encode(), data)
    entry = parsed[name]
    field = draw(st.sampled_from(["dtype", "shape", "begin", "end", "drop", "extra", "swap"]))
    if field == "dtype":
        entry["dtype"] = draw(st.sampled_from([*DTYPES, "Q7", "f32", 3]))
    elif field == "shape":
        entry["shape"] = draw(
            st.one_of(st.lists(st.integers(-1, 6), max_size=3), st.just(["2"]), st.just([1.0]))
        )
    elif field in ("begin", "end"):
        i = 0 if field == "begin" else 1
        entry["data_offsets"][i] += draw(st.integers(-9, 9))
    elif field == "drop":
        del entry[draw(st.sampled_from(["dtype", "shape", "data_offsets"]))]
    elif field == "extra":
        entry["x"] = draw(st.sampled_from([1, "y", None, [1]]))
    elif len(tensors) > 1:  # swap two tensors' offsets
        other = parsed[draw(st.sampled_from([t for t in tensors if t != name]))]
        entry["data_offsets"], other["data_offsets"] = other["data_offsets"], entry["data_offsets"]
    return kind, _join(json.dumps(parsed).encode(), data, pad=draw(st.booleans()))


def _reference(path):
    """What ``safetensors`` reads: every tensor, or the error it refuses the file with."""
    try:
        with safetensors.safe_open(str(path), "numpy") as f:
            return {k: f.get_tensor(k) for k in f.keys()}
    except safetensors.SafetensorError as e:
        return e


def _plan(tensors):
    """One replicated parameter per tensor (sharded over fsdp where it divides)."""
    specs = {}
    for name, value in tensors.items():
        axes = (
            ("fsdp",) + (None,) * (value.ndim - 1)
            if value.ndim and value.shape[0] % 2 == 0
            else None
        )
        specs[name] = meshinit.param(
            value.shape, jax.nn.initializers.zeros, dtype=value.dtype, axes=axes, mesh=mesh8()
        )
    return meshinit.plan(specs)


def _top_level_duplicates(blob):
    """Whether the header, read as JSON, names a tensor twice."""
    try:
        items = json.loads(_split(blob)[1], object_pairs_hook=lambda items: items)
    except Exception:  # not JSON (or too short to have a header): not this case
        return False
    if not isinstance(items, list) or not all(isinstance(i, tuple) for i in items):
        return False
    names = [k for k, _ in items]
    return len(names) != len(set(names))


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,  # the same draws on every run: CI is repeatable
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(st.data())
def test_meshinit_loads_what_safetensors_loads_and_refuses_what_it_refuses(data):
    tensors = data.draw(files())
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.safetensors")
        save_file(tensors, path)
        with open(path, "rb") as f:
            kind, blob = data.draw(corrupted(f.read()))
        with open(path, "wb") as f:
            f.write(blob)
        reference = _reference(path)
        event(f"{kind}: {'refused' if isinstance(reference, Exception) else 'loaded'}")
        if _top_level_duplicates(blob):  # the format forbids it; safetensors may keep one
            with pytest.raises(meshinit.PlanError, match="twice"):
                meshinit.safetensors.load(_plan(tensors), path, missing="skip", unused="ignore")
            return
        if isinstance(reference, Exception):
            with pytest.raises(meshinit.PlanError) as raised:
                meshinit.safetensors.load(_plan(tensors), path, missing="skip", unused="ignore")
            assert any(p.path == path for p in raised.value.problems), (
                kind,
                reference,
                raised.value,
            )
            return
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # every stored tensor claimed: no warning
            got = meshinit.safetensors.load(_plan(reference), path)
        assert got.keys() == reference.keys(), kind
        for name, want in reference.items():
            have = np.asarray(got[name])
            assert have.dtype == want.dtype and have.shape == want.shape, (kind, name)
            if want.dtype == np.bool_:  # a byte other than 0 or 1 is True either way
                assert np.array_equal(have, want), (kind, name)
            else:
                assert have.tobytes() == want.tobytes(), (kind, name)
