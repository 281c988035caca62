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


def _all_gathers(compiled):
    """The element types the compiled program's all-gathers move (``u16``, ``f32``)."""
    import re

    return re.findall(r"= (\w+)\[[^\]]*\]\S* all-gather\(", compiled.as_text())


@pytest.mark.parametrize("explicit", [False, True])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float8_e4m3fn", "float32"])
def test_the_reshard_moves_the_stored_bits_of_every_float_dtype(
    tmp_path, fsdp_spans_processes, explicit, dtype
):
    # XLA's CPU all-gather widens bf16 to f32 (twice the bytes between processes):
    # the reshard gathers bf16's and float8's bits, every dtype crosses at its width,
    # and every pattern (NaNs with payloads, -0, subnormals) arrives as stored
    kind = np.dtype(getattr(ml_dtypes, dtype, dtype))
    width = 8 * kind.itemsize
    rng = np.random.default_rng(67)
    count = 1 << min(width, 16)  # every pattern of the narrow dtypes, 64 Ki of f32's
    bits = np.arange(count, dtype=np.uint64).astype(f"uint{width}")
    if width == 32:
        bits = rng.integers(0, 1 << 32, count, dtype=np.uint64).astype(np.uint32)
    stored = bits.reshape(-1, 64).view(kind)
    save_file({"w": stored}, str(tmp_path / "m.safetensors"))
    plan = plan_of(
        {"w": (stored.shape, (None, "tensor"))}, dtype=kind, mesh=mesh8(explicit=explicit)
    )
    reshard._reshards.clear()
    arrays, _ = loaded(tmp_path / "m.safetensors", plan)
    array = arrays["w"]
    assert array.dtype == kind and array.sharding == plan.entries[0].sharding
    for shard in array.addressable_shards:
        got = np.asarray(shard.data).view(f"uint{width}")
        assert (got == bits.reshape(stored.shape)[shard.index]).all(), (dtype, shard.index)
    (compiled,) = [c for c in reshard._reshards.values() if c is not None]
    # bf16 and float8 as their bits (XLA widens them); f16 and f32 as themselves
    own = {"bfloat16": "u16", "float16": "f16", "float8_e4m3fn": "u8", "float32": "f32"}
    assert _all_gathers(compiled) == [own[dtype]], compiled.as_text()[:2000]


@pytest.mark.parametrize("explicit", [False, True])
def test_a_block_whose_rows_other_processes_share_is_read_as_whole_rows_then_resharded(
    tmp_path, fsdp_spans_processes, explicit
):
    # fsdp spans the processes and splits the columns: each process would read a piece
    # of every stored row; staged, it reads whole rows, moved back by the reshard
    rng = np.random.default_rng(67)
    tensors = {"c": rng.standard_normal((12, 16)).astype(ml_dtypes.bfloat16)}
    tensors["o"] = rng.standard_normal((10, 6)).astype(np.float32)  # rows 4 don't divide
    save_file(tensors, str(tmp_path / "m.safetensors"))
    mesh = mesh8(explicit=explicit)
    shapes = {"c": ((12, 16), ("tensor", "fsdp")), "o": ((10, 6), (None, "fsdp"))}
    plan = plan_of(shapes, mesh=mesh)
    from meshinit._checkpoint.read import staging

    for e in plan.entries:
        stage = staging.stage(e, blocks_leaf(e.spec.shape))
        assert stage.moved == ("fsdp",) and stage.added == (), (e.path, stage)
    staged, _ = loaded(tmp_path / "m.safetensors", plan)
    for e in plan.entries:
        assert staged[e.path].sharding == e.sharding
        same_bits(staged[e.path], tensors[e.path].astype(e.spec.dtype), e.path)


def blocks_leaf(shape):
    from meshinit._checkpoint.layout import blocks

    return blocks.Leaf(st.Tensor("x"), None, (), shape, tuple(range(len(shape))), "")


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


def test_the_reshards_compile_with_the_callers_compiler_options(tmp_path, fsdp_spans_processes):
    # compiled as every compile of meshinit's (compile_lowered), on the worker thread
    # with the options of the block that called load: XLA is handed the option it
    # names, and rejects it
    rng = np.random.default_rng(70)
    tensors = {f"l.{i}": rng.standard_normal((7, 8)).astype(np.float32) for i in range(2)}
    save_file(tensors, str(tmp_path / "m.safetensors"))
    plan = plan_of({f"l.{i}": ((7, 8), (None, "tensor")) for i in range(2)}, mesh=mesh8())
    meshinit.clear_cache()
    with meshinit.options(compiler_options={"xla_meshinit_no_such_option": True}):
        with pytest.raises(Exception, match="xla_meshinit_no_such_option"):
            loaded(tmp_path / "m.safetensors", plan)
    assert len(reshard._reshards) == 0
    staged, _ = loaded(tmp_path / "m.safetensors", plan)  # outside the block: meshinit's
    for path, want in tensors.items():
        same_bits(staged[path], want, path)
