"""Fan-out's reshard step in one process: a staged load's values, placement and
compiles against the plain load's. The fsdp axis is made to count as one that spans
processes (``fsdp_spans_processes``, this folder's conftest.py), so the whole path runs
here; the multi-process tests (tests/guarantees/test_fanout.py,
tests/guarantees/test_processes.py) run it under jax.distributed."""

import jax
import ml_dtypes
import numpy as np
import pytest
from helpers import mesh8, plan_of, same_bits

import meshinit
from meshinit import safetensors as st
from meshinit._checkpoint.read import reshard

save_file = pytest.importorskip("safetensors.numpy").save_file


def loaded(path, plan, names=None, fan_out=None):
    scalars = {}

    def listen(name, value, **_):
        scalars[name] = value

    jax.monitoring.register_scalar_listener(listen)
    try:
        arrays = st.load(plan, path, names=names, fan_out=fan_out, unused="ignore")
    finally:
        jax.monitoring.unregister_scalar_listener(listen)
    return arrays, scalars


@pytest.mark.parametrize("explicit", [False, True])
def test_a_staged_load_has_the_plain_loads_bits_placement_and_one_compile_per_signature(
    tmp_path, fsdp_spans_processes, count_compiles, explicit
):
    rng = np.random.default_rng(58)
    tensors = {f"l.{i}": rng.standard_normal((7, 8)).astype(np.float32) for i in range(4)}
    tensors["n"] = rng.standard_normal((5,)).astype(ml_dtypes.bfloat16)
    tensors["t"] = rng.standard_normal((8, 6)).astype(np.float32)
    save_file(tensors, str(tmp_path / "m.safetensors"))
    mesh = mesh8(explicit=explicit)
    shapes = {f"l.{i}": ((7, 8), (None, "tensor")) for i in range(4)}
    shapes |= {"t": ((6, 8), (None, "tensor"))}
    plan = plan_of(shapes, mesh=mesh)
    names = {"t": st.Tensor("t", permute=(1, 0))}
    meshinit.clear_cache()
    with count_compiles() as c:
        staged, scalars = loaded(tmp_path / "m.safetensors", plan, names)
    # the four layers share one program, the transposed one has another (XLA's cache
    # may serve the second variant's from the first's, the same program)
    assert len(reshard._reshards) == 2 and c.count <= 2
    assert scalars[reshard.BYTES_FROM_PEERS] == 0  # one process: every byte read here
    plain, _ = loaded(tmp_path / "m.safetensors", plan, names, fan_out=False)
    for e in plan.entries:
        assert staged[e.path].sharding == e.sharding == plain[e.path].sharding
        same_bits(staged[e.path], plain[e.path], e.path)
        want = tensors["t"].T if e.path == "t" else tensors[e.path]
        same_bits(staged[e.path], want, e.path)


def test_an_fp8_parameter_is_staged_as_its_float8_bytes_and_has_the_plain_loads_bits(
    tmp_path, fsdp_spans_processes, monkeypatch
):
    from helpers import quantized_folder

    rng = np.random.default_rng(67)
    f8 = ml_dtypes.float8_e4m3fn
    shapes = {"w": (256, 384), "e.0": (64, 256), "e.1": (64, 256), "c0": (96, 256)}
    tensors = {}
    for name, shape in shapes.items():
        tensors[name] = (rng.standard_normal(shape) * 40).astype(f8)
        grid = tuple(-(-n // 128) for n in shape)
        tensors[f"{name}_scale_inv"] = rng.uniform(1e-4, 1e-2, grid).astype(np.float32)
    config = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    folder = quantized_folder(tmp_path, tensors, config)
    plan = plan_of(
        {
            "w": ((256, 384), (None, "tensor")),  # one tensor (decode.QuantParts)
            "experts": ((2, 64, 256), (None, None, "tensor")),  # a Stack of two
            "cat": ((160, 256), (None, "tensor")),  # a Concat (joins.TileParts)
        },
        dtype=ml_dtypes.bfloat16,
        mesh=mesh8(),
    )
    names = {
        "experts": st.Stack(["e.0", "e.1"], axis=0),
        "cat": st.Concat([st.Tensor("c0", index=np.s_[:64]), "c0"], axis=0),
    }
    gathered = []
    enter = reshard.enter

    def recording(compiled, staged):
        gathered.append(staged.dtype)
        return enter(compiled, staged)

    monkeypatch.setattr(reshard, "enter", recording)
    staged, scalars = loaded(folder, plan, names)
    # each read as its stored float8 bytes on the staging sharding, then gathered
    assert gathered == [np.dtype(np.uint8)] * 3  # as bytes: XLA CPU widens float8
    plain, _ = loaded(folder, plan, names, fan_out=False)

    def dequantized(name):
        s = tensors[f"{name}_scale_inv"]
        w = tensors[name]
        wide = np.repeat(np.repeat(s, 128, 0), 128, 1)[: w.shape[0], : w.shape[1]]
        return (w.astype(np.float32) * wide).astype(ml_dtypes.bfloat16)

    want = {
        "w": dequantized("w"),
        "experts": np.stack([dequantized("e.0"), dequantized("e.1")]),
        "cat": np.concatenate([dequantized("c0")[:64], dequantized("c0")]),
    }
    for e in plan.entries:
        assert staged[e.path].sharding == e.sharding == plain[e.path].sharding
        same_bits(staged[e.path], plain[e.path], e.path)
        same_bits(staged[e.path], want[e.path], e.path)


def test_the_reshards_compile_on_a_worker_thread_while_the_shares_are_read(
    tmp_path, fsdp_spans_processes, monkeypatch
):
    import threading

    rng = np.random.default_rng(67)
    tensors = {f"l.{i}": rng.standard_normal((7, 8)).astype(np.float32) for i in range(3)}
    tensors["n"] = rng.standard_normal((6,)).astype(np.float32)
    save_file(tensors, str(tmp_path / "m.safetensors"))
    shapes = {f"l.{i}": ((7, 8), (None, "tensor")) for i in range(3)}
    plan = plan_of(shapes | {"n": ((6,), (None,))}, mesh=mesh8())
    threads, program = [], reshard.program

    def recording(entry, stage, staged):
        threads.append((entry.path, threading.current_thread().name))
        return program(entry, stage, staged)

    monkeypatch.setattr(reshard, "program", recording)
    meshinit.clear_cache()
    staged, _ = loaded(tmp_path / "m.safetensors", plan)
    # every staged parameter's program, compiled (or found) ahead, off the read's thread
    assert sorted(path for path, _ in threads) == ["l.0", "l.1", "l.2", "n"]
    assert {name.rsplit("_", 1)[0] for _, name in threads} == {"meshinit-reshards"}, threads
    for path, want in tensors.items():
        same_bits(staged[path], want, path)
