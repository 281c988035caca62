"""The source type: every kind of file answers the same questions, and a tensor of a
checked file holds the source it was read from."""

import asyncio
import pathlib

import numpy as np
import pytest
from helpers import stored

from meshinit._checkpoint.store.local import LocalFile
from meshinit._checkpoint.store.remote import Remote
from meshinit._checkpoint.store.source import Source


def test_local_and_remote_files_are_sources_and_only_remote_ones_are_fetched():
    local = LocalFile(pathlib.Path("/x/m.safetensors"))
    remote = Remote("s3://b/m.safetensors", "m.safetensors", 8, '"e"', None, "m.safetensors")
    assert isinstance(local, Source) and isinstance(remote, Source)
    assert (local.fetched, remote.fetched) == (False, True)
    assert (local.name, remote.name) == ("m.safetensors", "m.safetensors")
    assert (str(local), str(remote)) == ("/x/m.safetensors", "s3://b/m.safetensors")
    assert local.shown == local.path and remote.shown == "s3://b/m.safetensors"


def test_a_source_must_answer_every_question():
    class Partial(Source):  # no check, contents, changed or mapping
        name = "m.safetensors"

    with pytest.raises(TypeError, match="abstract"):
        Partial()  # type: ignore[abstract]


async def _fetch_of(source):
    return await source.fetch(0, 1)


def test_a_mapped_source_is_never_fetched(tmp_path):
    local = LocalFile(stored(tmp_path, {"a": np.ones(2, np.float32)}))
    with pytest.raises(NotImplementedError, match="read from its mapping, not fetched"):
        asyncio.run(_fetch_of(local))


def test_each_stored_tensor_holds_its_source(tmp_path):
    local = LocalFile(stored(tmp_path, {"a": np.ones(2, np.float32), "b": np.zeros(3, np.int8)}))
    identity, tensors, problems = local.check()
    assert problems == [] and identity is not None
    assert {n: (t.file, t.dtype, t.shape) for n, t in tensors.items()} == {
        "a": (local, "F32", (2,)),
        "b": (local, "I8", (3,)),
    }
