"""Dequantized parameters finished on worker threads while the next are read: each
program compiles once however many parameters share it, the arrays come back in the
plan's order with their bits, and a failure on a worker leaves no array alive."""

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import plan_for, stored

import meshinit
from meshinit import safetensors as st
from meshinit._checkpoint.encodings.fp8 import decode as dequant
from meshinit._checkpoint.read import ahead

pytest.importorskip("safetensors.numpy")

F8 = ml_dtypes.float8_e4m3fn


def fp8_folder(tmp_path, count, scale=1e-2):
    rng = np.random.default_rng(count)
    tensors, want = {}, {}
    for i in range(count):
        w = (rng.standard_normal((128, 256)) * 40).astype(F8)
        s = np.full((1, 2), scale, np.float32)
        tensors[f"w{i}"], tensors[f"w{i}_scale_inv"] = w, s
        want[f"w{i}"] = (w.astype(np.float32) * np.float32(scale)).astype(ml_dtypes.bfloat16)
    stored(tmp_path, tensors)
    quantization = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": quantization}))
    return tmp_path, want


def test_parameters_of_one_program_compile_it_once_and_come_back_in_order(tmp_path, count_compiles):
    folder, want = fp8_folder(tmp_path, 2 * ahead.AHEAD + 1)
    plan = plan_for({n: (128, 256) for n in want}, dtype=jnp.bfloat16, axes=("fsdp", "tensor"))
    dequant.program.cache_clear()
    with count_compiles() as compiled:
        got = st.load(plan, folder)
    assert list(got) == [e.path for e in plan.entries]
    for name, array in got.items():
        assert (np.asarray(array).view(np.uint16) == want[name].view(np.uint16)).all()
    # one dequantization program (and the few that place the blocks), not one a thread
    assert dequant.program.cache_info().misses == 1
    with count_compiles() as again:
        st.load(plan, folder)
    assert again.count == 0 and compiled.count >= 1


def test_a_failure_on_a_worker_leaves_no_array_alive(tmp_path, new_arrays):
    folder, want = fp8_folder(tmp_path, 3, scale=1000.0)  # 448 x 1000 overflows float16
    plan = plan_for({n: (128, 256) for n in want}, dtype=jnp.float16, axes=("fsdp", "tensor"))
    with new_arrays() as made, pytest.raises(meshinit.PlanError, match="overflows float16"):
        st.load(plan, folder)
    assert not made, made


def test_a_plain_array_passes_through_and_callables_settle_in_order():
    job = lambda path: type("Job", (), {"entry": type("E", (), {"path": path}), "stage": None})  # noqa: E731
    queue = ahead.Ahead()
    plain, a = jax.numpy.zeros(2), job("a")
    assert queue.add(a, plain) == [(a, plain)]  # handed on as it came
    made = {f"b{i}": jax.numpy.full(2, i) for i in range(ahead.AHEAD + 2)}
    jobs = {path: job(path) for path in made}
    ready = []
    for path, array in made.items():
        ready += queue.add(jobs[path], lambda array=array: array)
    assert [j.entry.path for j, _ in ready] == ["b0", "b1"]  # the oldest, once more than
    ready += queue.settle(0)  # AHEAD are on their way; each with its own job
    assert [(j.entry.path, m) for j, m in ready] == [(p, made[p]) for p in made]
