"""Checked files read block by block: each distinct block of this process's devices
once, and no array left holding the loader's memory, after an interrupt too."""

import gc
import weakref

import jax
import ml_dtypes
import numpy as np
import pytest
from helpers import plan_for, plan_of

from meshinit import safetensors as st
from meshinit._checkpoint.layout import host

save_file = pytest.importorskip("safetensors.numpy").save_file


def test_an_interrupt_mid_load_leaves_nothing_alive_while_the_exception_is_held(
    tmp_path, monkeypatch
):
    # bf16 stored, f32 planned: every block is a cast copy on the host
    tensors = {f"t{i}": np.ones((8, 8), ml_dtypes.bfloat16) for i in range(3)}
    save_file(tensors, str(tmp_path / "m.safetensors"))
    plan = plan_for({k: (8, 8) for k in tensors}, axes=("fsdp", "tensor"))
    made, blocks = [], []
    put = jax.device_put

    def interrupted(x, *args, **kwargs):
        if len(made) == 13:  # the second tensor's sixth shard
            raise KeyboardInterrupt
        out = put(x, *args, **kwargs)
        made.append(out)
        if isinstance(x, np.ndarray):
            blocks.append(weakref.ref(x))
        return out

    monkeypatch.setattr(jax, "device_put", interrupted)
    with pytest.raises(KeyboardInterrupt) as held:
        st.load(plan, tmp_path)
    gc.collect()
    assert held.value.__traceback__ is not None  # held, as a notebook holds it
    assert len(made) == 13 and all(a.is_deleted() for a in made)
    assert blocks and all(b() is None for b in blocks)


# ------------------------------------------------- a local load's progress


def progress_checkpoint(tmp_path):
    w = np.arange(512 * 256, dtype=np.float32).reshape(512, 256)  # 512 KiB
    save_file({"w": w, "b": w[:8].copy()}, str(tmp_path / "model.safetensors"))
    return plan_of({"w": ((512, 256), ("fsdp", None)), "b": ((8, 256), (None, "tensor"))})


def test_progress_true_draws_a_bar_of_the_bytes_a_local_load_reads(tmp_path, capfd):
    # progress=True was ignored for local files: no bar, whatever the load's size
    plan = progress_checkpoint(tmp_path)
    st.load(plan, tmp_path, progress=True)
    err = capfd.readouterr().err
    assert "meshinit: reading" in err and "520k/520k" in err, err  # 512 KiB + 8 KiB, in KiB
    st.load(plan, tmp_path, progress=False)
    assert capfd.readouterr().err == ""


def test_by_default_a_bar_shows_on_a_terminal_for_a_large_or_slow_load_only(
    tmp_path, capfd, monkeypatch
):
    from meshinit._run import progress

    plan = progress_checkpoint(tmp_path)
    monkeypatch.setattr(progress, "_stderr_is_terminal", lambda: True)
    st.load(plan, tmp_path)  # small and quick: nothing
    assert capfd.readouterr().err == ""
    monkeypatch.setattr(progress, "MIN_BYTES", 64 << 10)  # as if 1 GiB: at once
    st.load(plan, tmp_path)
    assert "meshinit: reading" in capfd.readouterr().err
    monkeypatch.setattr(progress, "MIN_BYTES", 1 << 30)
    monkeypatch.setattr(progress, "SLOW_SECONDS", 0.05)  # a slow filesystem: once it lasts
    block = host.Part.block

    def slow(self, index):
        import time

        time.sleep(0.1)
        return block(self, index)

    monkeypatch.setattr(host.Part, "block", slow)
    st.load(plan, tmp_path)
    assert "meshinit: reading" in capfd.readouterr().err
    monkeypatch.setattr(progress, "_stderr_is_terminal", lambda: False)
    st.load(plan, tmp_path)  # not a terminal: never by default
    assert capfd.readouterr().err == ""
