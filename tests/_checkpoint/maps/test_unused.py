"""The stored tensors no load reads, and the messages that name them."""

import pathlib

from meshinit._checkpoint.maps import unused
from meshinit._checkpoint.store.local import LocalFile
from meshinit.safetensors import Stack, Tensor


def test_tensors_no_path_claims_are_unused_and_those_of_missing_paths_stranded():
    targets = {
        "a": Tensor("a"),
        "s": Stack([Tensor("l0"), Tensor("l1")], axis=0),
        "skip": None,
    }
    held = {"a": 1, "l0": 1, "extra": 1}  # l1 is missing: s cannot load
    names, stranded = unused.find(targets, {"s": "l1"}, held)
    assert names == ("extra", "l0")
    assert stranded == {"l0": ["s"]}


def test_the_warning_and_the_problems_name_every_tensor_and_its_file():
    files = {"extra": str(LocalFile(pathlib.Path("/ckpt/m.safetensors")))}
    message = unused.warning("meshinit.safetensors.load", ("extra",), {}, {})
    assert message.startswith(
        "meshinit.safetensors.load: 1 tensor of the checkpoint went unused (no plan path "
        "claims them): 'extra'."
    )
    assert 'unused="ignore"' in message
    (problem,) = unused.problems(("extra",), {}, {}, files)
    assert problem.path == "/ckpt/m.safetensors" and "'extra'" in problem.message
