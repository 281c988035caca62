"""MXFP4 parameters through fan-out, in one process made to look like several (each
device pair a process): the image of a parameter's stored bytes, its staging, where a
group would be cut (read by each holder instead), and a load whose values are the
bits of the load without fan-out. tests/guarantees/test_fanout_quant.py runs it under
jax.distributed."""

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import quantized_folder, submesh

import meshinit
from meshinit import safetensors as st
from meshinit._checkpoint.encodings.mxfp4 import packed
from meshinit._checkpoint.read import reshard, staging, survey

pytest.importorskip("safetensors.numpy")

MXFP4 = {"quant_method": "mxfp4"}
READ = "/meshinit/safetensors/bytes_read"


@pytest.fixture
def four_processes(monkeypatch):
    """Devices 2p and 2p + 1 as process p of 4."""
    monkeypatch.setattr(staging, "process_of", lambda d: d.id // 2)
    monkeypatch.setattr(staging, "processes", lambda: 4)
    meshinit.clear_cache()  # spanning() is memoized by mesh
    yield
    meshinit.clear_cache()


def pair(rng, e, k, r):
    blocks = rng.integers(0, 256, (e, r, k // 32, 16), dtype=np.uint8)
    return blocks, rng.integers(120, 134, (e, r, k // 32), dtype=np.uint8)


def checkpoint(tmp_path, shapes):
    rng = np.random.default_rng(5)
    tensors = {}
    for name, shape in shapes.items():
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = pair(rng, *shape)
    return quantized_folder(tmp_path, tensors, MXFP4)


def jobs_of(tmp_path, shapes, axes, names=None, explicit=False, grid=(4, 2)):
    """The staged jobs of bf16 parameters ``{name: planned shape}`` on a (4, 2) mesh
    (data, tensor) of 4 processes (or ``grid``), each placed by ``axes``."""
    mesh = submesh(range(math.prod(grid)), grid, ("data", "tensor"), explicit=explicit)
    zeros = jax.nn.initializers.zeros
    plan = meshinit.plan(
        {
            n: meshinit.param(s, zeros, dtype=jnp.bfloat16, axes=axes[n], mesh=mesh)
            for n, s in shapes.items()
        }
    )
    jobs = survey.survey(plan, tmp_path, names, "t").jobs
    return plan, {j.entry.path: j for j in staging.staged(jobs, True)}


def test_the_image_holds_each_group_as_its_bytes_then_its_exponent(tmp_path, four_processes):
    checkpoint(tmp_path, {"w": (4, 64, 8)})
    names = {"t": st.Tensor("w", permute=(0, 2, 1))}
    _, jobs = jobs_of(tmp_path, {"w": (4, 64, 8), "t": (4, 8, 64)}, {"w": None, "t": None}, names)
    image = packed.image(jobs["w"])
    assert image.spec.shape == (4, 34, 8) and image.spec.dtype == np.uint8  # 2 groups of 17
    assert image.sharding == jobs["w"].entry.sharding
    assert packed.image(jobs["t"]).spec.shape == (4, 8, 34)  # K where the view puts it
    assert packed.k_axis(jobs["t"].node, 3) == 2


@pytest.mark.parametrize(
    "shape, axes, index, why",
    [
        ((4, 96, 8), (None, "tensor", None), None, "blocks of 48 values cut a group"),
        ((4, 48, 8), (None, None, None), np.s_[:, 16:64], "the view starts mid-group"),
        ((4, 32, 8), (None, None, None), np.s_[:, :32], None),
    ],
)
def test_a_parameter_whose_blocks_or_view_cut_a_group_is_read_by_each_holder(
    tmp_path, four_processes, shape, axes, index, why
):
    checkpoint(tmp_path, {"w": (4, 96, 8) if index is not None else shape})
    names = {"w": st.Tensor("w", index=index)} if index is not None else None
    _, jobs = jobs_of(tmp_path, {"w": shape}, {"w": axes}, names)
    assert (packed.image(jobs["w"]) is None) == (why is not None), why
    assert (jobs["w"].stage is None) == (why is not None), why


def test_a_share_that_would_end_inside_a_group_is_read_by_each_holder(tmp_path, four_processes):
    # one expert: fan-out splits K (3 groups, 51 bytes) in 4 shares of 13 bytes
    checkpoint(tmp_path, {"w": (1, 96, 8), "v": (1, 128, 8)})
    shapes = {"w": (1, 96, 8), "v": (1, 128, 8)}
    _, jobs = jobs_of(tmp_path, shapes, {"w": None, "v": None})
    assert packed.image(jobs["w"]) is not None and jobs["w"].stage is None
    assert jobs["v"].stage.axis == 1  # 4 groups: a group a share


@pytest.mark.parametrize("explicit", [False, True], ids=["auto", "explicit"])
def test_a_staged_load_reads_each_stored_byte_once_and_has_the_bits_of_one_without(
    tmp_path, four_processes, explicit
):
    shapes = {"rep": (8, 64, 16), "t": (8, 16, 64), "cut": (8, 96, 16)}
    checkpoint(tmp_path, {"rep": (8, 64, 16), "t": (8, 64, 16), "cut": (8, 96, 16)})
    names = {"t": st.Tensor("t", permute=(0, 2, 1))}
    axes = {
        "rep": (None, "tensor", None),
        "t": (None, None, "tensor"),
        "cut": (None, "tensor", None),
    }
    plan, jobs = jobs_of(tmp_path, shapes, axes, names, explicit)
    assert [p for p, j in jobs.items() if j.stage is not None] == ["rep", "t"]
    got, seen = {}, []

    def on(event, value, **kwargs):
        if event in (reshard.BYTES_FROM_PEERS, READ):
            seen.append((event, value))

    jax.monitoring.register_scalar_listener(on)
    try:
        for fan_out in (True, False):
            got[fan_out] = st.load(plan, tmp_path, names=names, fan_out=fan_out)
    finally:
        jax.monitoring.unregister_scalar_listener(on)
    for path in shapes:
        fanned, plain = (np.asarray(got[f][path]).view(np.uint16) for f in (True, False))
        assert (fanned == plain).all(), path
        assert got[True][path].sharding == got[False][path].sharding
    fanned, plain = dict(seen[:2]), dict(seen[2:])
    # one process reads every share here: each stored byte once, with fan-out or not
    assert fanned[READ] == plain[READ] and plain[reshard.BYTES_FROM_PEERS] == 0
    # what the devices of "process 0" hold beyond their staging share (a quarter of
    # the experts), in stored bytes: of rep and t, two blocks of 8 experts x 16 rows
    # x one group of 17 bytes each
    assert fanned[reshard.BYTES_FROM_PEERS] == 2 * 2 * (8 * 16 * 17) * 3 // 4, seen


def test_the_values_are_transformers_bits(tmp_path, four_processes):
    rng = np.random.default_rng(5)
    blocks, scales = pair(rng, 8, 64, 16)
    table = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
    values = np.stack([table[blocks & 0x0F], table[blocks >> 4]], axis=-1)
    want = np.ldexp(values, scales.astype(np.int32)[..., None, None] - 127)
    want = want.astype(ml_dtypes.bfloat16).reshape(8, 16, 64).swapaxes(1, 2)
    checkpoint(tmp_path, {"rep": (8, 64, 16)})
    plan, jobs = jobs_of(tmp_path, {"rep": (8, 64, 16)}, {"rep": (None, "tensor", None)})
    assert jobs["rep"].stage is not None
    got = st.load(plan, tmp_path, fan_out=True)["rep"]
    assert (np.asarray(got).view(np.uint16) == want.view(np.uint16)).all()


def test_the_progress_bar_counts_a_staged_images_bytes(tmp_path, four_processes):
    # the bar's total (loop._owned) is the stored bytes the shares read: one process
    # here reads every share, so each byte of _blocks and _scales once
    from meshinit._checkpoint.read import loop

    checkpoint(tmp_path, {"rep": (8, 64, 16)})
    _, jobs = jobs_of(tmp_path, {"rep": (8, 64, 16)}, {"rep": (None, "tensor", None)})
    assert jobs["rep"].stage is not None
    assert loop._owned(jobs["rep"]) == 8 * 16 * 2 * 17  # [E, R, G] x (16 + 1)


def test_a_staged_load_with_tensor_across_processes_and_a_stepped_view(tmp_path, monkeypatch):
    # (2, 3) on 3 processes of 2 devices: tensor crosses processes (moved onto the
    # experts for the read, moved back by the reshard); gpt-oss's interleaved
    # wi_0 = gate_up[..., 0::2] steps along R
    monkeypatch.setattr(staging, "process_of", lambda d: d.id // 2)
    monkeypatch.setattr(staging, "processes", lambda: 3)
    meshinit.clear_cache()
    checkpoint(tmp_path, {"gu": (6, 192, 16)})
    shapes = {"k": (6, 192, 16), "wi": (6, 192, 8)}
    names = {"k": st.Tensor("gu"), "wi": st.Tensor("gu", index=np.s_[:, :, 0::2])}
    axes = {"k": (None, "tensor", None), "wi": (None, "tensor", None)}
    plan, jobs = jobs_of(tmp_path, shapes, axes, names, grid=(2, 3))
    assert jobs["k"].stage.moved == ("tensor",) and jobs["wi"].stage is not None
    fanned = st.load(plan, tmp_path, names=names, fan_out=True)
    plain = st.load(plan, tmp_path, names=names, fan_out=False)
    for path in shapes:
        assert (
            np.asarray(fanned[path]).view(np.uint16) == np.asarray(plain[path]).view(np.uint16)
        ).all()
    meshinit.clear_cache()


def test_a_bad_exponent_in_a_share_is_refused_naming_the_path_and_scales(tmp_path, four_processes):
    # the share that reads it refuses it, as a load without fan-out does
    rng = np.random.default_rng(5)
    blocks, scales = pair(rng, 8, 64, 16)
    blocks[5, 3, 1] = 0x77
    scales[5, 3, 1] = 255
    quantized_folder(tmp_path, {"w_blocks": blocks, "w_scales": scales}, MXFP4)
    plan, jobs = jobs_of(tmp_path, {"w": (8, 64, 16)}, {"w": (None, "tensor", None)})
    assert jobs["w"].stage is not None
    for fan_out in (True, False):
        with pytest.raises(
            meshinit.PlanError, match=r"(?s)w:.*'w_scales' holds the exponent byte 255"
        ):
            st.load(plan, tmp_path, fan_out=fan_out)
