"""The encodings the read flow asks, in order, and the flow asking them without a name:
an encoding added to the registry is offered, paired and claimed as the others are."""

import numpy as np
from helpers import plan_for, stored

from meshinit._checkpoint.encodings import base, registry
from meshinit._checkpoint.encodings.fp8 import pairing as fp8
from meshinit._checkpoint.encodings.mxfp4 import pairing as mxfp4
from meshinit._checkpoint.layout import blocks
from meshinit._checkpoint.read import survey
from meshinit._checkpoint.store.header import READABLE
from meshinit._checkpoint.store.source import Stored


def test_the_registry_lists_fp8_then_mxfp4_each_module_s_own():
    # the order is the inventory's and the pairing's: float8 first, as before the registry
    assert registry.ENCODINGS == (fp8.ENCODING, mxfp4.ENCODING)
    assert [e.name for e in registry.ENCODINGS] == ["fp8", "mxfp4"]


def test_a_virtual_dtype_is_no_stored_dtype_and_names_one_encoding():
    # the flow finds a virtual tensor's encoding by its dtype: no file may carry it
    dtypes = [e.virtual.dtype for e in registry.ENCODINGS if e.virtual is not None]
    assert dtypes == ["MXFP4"]
    assert set(dtypes).isdisjoint(READABLE)


def _halves(index):
    """A stand-in encoding's virtual tensors: ``X`` of ``X_lo`` and ``X_hi``."""
    tensors, behind = {}, {}
    for name, lo in index.items():
        if name.endswith("_lo") and name[:-3] + "_hi" in index:
            x = name[:-3]
            tensors[x] = Stored(lo.file, x, "HALVES", lo.shape, lo.start, lo.nbytes)
            behind[x] = (name, x + "_hi")
    return base.Offered(tensors, behind, behind)


def _paired(jobs, stored, offered, config):
    described = {
        j.entry.path: "halves"
        for j in jobs
        if any(leaf.stored.name in offered.pairs for leaf in blocks.leaves(j.node))
    }
    return jobs, [], described


HALVES = base.Encoding(
    name="halves",
    pair=_paired,
    claimed=lambda jobs, stored: {"aux"} & set(stored),
    virtual=base.Virtual(
        dtype="HALVES",
        seen_as="F32",
        offer=_halves,
        why_not=lambda planned: None if planned == np.float32 else "is HALVES; plan float32",
    ),
)


def test_an_encoding_added_to_the_registry_is_asked_by_the_flow(tmp_path, monkeypatch):
    monkeypatch.setattr(registry, "ENCODINGS", (*registry.ENCODINGS, HALVES))
    half = np.ones(4, np.float32)
    path = stored(
        tmp_path, {"w_lo": half, "w_hi": half, "aux": half, "extra": np.ones(2, np.float32)}
    )
    found = survey.survey(plan_for({"w": (4,)}), path, None, "what")
    assert found.problems == []
    assert list(found.inventory.loaded) == ["w"] and found.inventory.reads == {"w": ("w",)}
    assert found.inventory.dequantized == {"w": "halves"}
    assert found.inventory.unused == ("extra",)  # its pair and its claimed tensor are read
    refused = survey.survey(plan_for({"w": (4,)}, dtype=np.float16), path, None, "what")
    assert [(p.path, p.message) for p in refused.problems] == [
        ("w", "tensor 'w' in model.safetensors, stored HALVES (4,), is HALVES; plan float32")
    ]
