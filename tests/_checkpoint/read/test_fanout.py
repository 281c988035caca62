"""Fan-out in one process: the staging a parameter held by several processes is read
onto, its blocks' parts of the planned array, the axis split, and the reshard's
values, placement and compiles. The fsdp axis is made to count as one that spans
processes (``spanning``), so the whole path runs here; the multi-process tests
(tests/guarantees/test_fanout.py) run it under jax.distributed."""

import jax
import ml_dtypes
import numpy as np
import pytest
from helpers import mesh8, plan_of, same_bits
from jax.sharding import PartitionSpec as P

import meshinit
from meshinit import safetensors as st
from meshinit._checkpoint.layout import blocks
from meshinit._checkpoint.read import fanout

save_file = pytest.importorskip("safetensors.numpy").save_file


@pytest.fixture
def fsdp_spans_processes(monkeypatch):
    """Every block counts as held by two processes, and fsdp as the axis between them."""
    monkeypatch.setattr(fanout, "shared", lambda entry: True)
    monkeypatch.setattr(fanout, "spanning", lambda mesh: ("fsdp",))
    monkeypatch.setattr(fanout, "processes", lambda: 2)


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


def test_a_staging_block_is_its_part_of_the_planned_array_then_padding():
    # 6 rows in 2 planned blocks of 3, each padded to 4 for 2 shares
    stage = fanout.Stage(None, (8, 5), 0, shards=2, rows=3, padded=4, added=("fsdp",))
    cases = {(0, 2): ((0, 2), 0), (2, 4): ((2, 3), 1), (4, 6): ((3, 5), 0), (6, 8): ((5, 6), 1)}
    for (a, b), ((c, d), pad) in cases.items():
        real, padding = stage.real((slice(a, b), slice(0, 5)))
        assert (real[0].start, real[0].stop, padding) == (c, d, pad)
        assert real[1] == slice(0, 5)


def test_the_split_axis_is_the_stored_outer_axis_through_transposes_and_stacks(tmp_path):
    tensors = {"w": np.zeros((12, 10), np.float32), "l.0": np.zeros((5, 4), np.float32)}
    tensors["l.1"] = tensors["l.0"]
    save_file(tensors, str(tmp_path / "m.safetensors"))
    plan = plan_of({"k": ((10, 12), None), "s": ((2, 5, 4), None), "c": ((5, 8), None)})
    names = {
        "k": st.Tensor("w", permute=(1, 0)),  # stored rows are the kernel's columns
        "s": st.Stack(["l.0", "l.1"], axis=0),
        "c": st.Concat(["l.0", "l.1"], axis=1),  # the parts' rows: the result's rows
    }
    inventory = st.inventory(plan, tmp_path, names=names)
    assert inventory.loaded  # resolved; the nodes themselves, from the survey:
    from meshinit._checkpoint.read import survey

    jobs = {j.entry.path: j for j in survey.survey(plan, tmp_path, names, "t").jobs}
    assert fanout.outer_axes(jobs["k"].node) == [1]
    assert fanout.outer_axes(jobs["s"].node) == [0, 1]  # the layers, then each one's rows
    assert fanout.outer_axes(jobs["c"].node) == [0]
    assert fanout.outer_axes(blocks.Const(0, (3,), "")) == []


def test_staging_adds_the_spanning_axes_to_the_outer_axis(fsdp_spans_processes):
    plan = plan_of({"w": ((6, 8), (None, "tensor")), "b": ((3,), None)})
    leaf = lambda shape: blocks.Leaf(st.Tensor("x"), None, (), shape, (0, 1)[: len(shape)], "")  # noqa: E731
    w, b = plan.entries if plan.entries[0].path == "w" else plan.entries[::-1]
    stage = fanout.stage(w, leaf((6, 8)))
    assert stage.sharding.spec == P("fsdp", "tensor") and stage.shape == (6, 8)
    assert stage.padded == stage.rows == 6 and stage.shards == 1  # 2 shares of 3 rows
    tiny = fanout.stage(b, leaf((3,)))  # 3 rows in 2 shares: padded to 4
    assert tiny.shape == (4,) and tiny.sharding.spec == P("fsdp")
    assert fanout.stage(w, blocks.Const(0.0, (6, 8), "")) is None  # a Fill reads nothing
    scalar = plan_of({"s": ((), None)}).entries[0]
    assert fanout.stage(scalar, leaf(())) is None  # no axis to split: read by each holder


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
    assert len(fanout._reshards) == 2 and c.count <= 2
    assert scalars[fanout.BYTES_FROM_PEERS] == 0  # one process: every byte read here
    plain, _ = loaded(tmp_path / "m.safetensors", plan, names, fan_out=False)
    for e in plan.entries:
        assert staged[e.path].sharding == e.sharding == plain[e.path].sharding
        same_bits(staged[e.path], plain[e.path], e.path)
        want = tensors["t"].T if e.path == "t" else tensors[e.path]
        same_bits(staged[e.path], want, e.path)


def test_the_batches_keep_the_busiest_process_within_the_budget():
    plan = plan_of({f"l.{i}": ((64, 16), (None, "tensor")) for i in range(5)})
    # each: 64 x 4 f32 per device, 4 devices per process (one process: 8): 8 KiB x 2
    cost = 2 * 8 * 64 * 4 * 4
    assert fanout.batches(plan.entries, 2 * cost) == [0, 0, 1, 1, 2]
    assert fanout.batches(plan.entries, 1) == [0, 1, 2, 3, 4]  # at least one each


@pytest.mark.parametrize("bad", [1, "yes", 0.5])
def test_fan_out_is_none_true_or_false(tmp_path, bad):
    save_file({"a": np.zeros(4, np.float32)}, str(tmp_path / "m.safetensors"))
    with pytest.raises(TypeError, match="fan_out must be None, True or False"):
        st.load(plan_of({"a": ((4,), None)}), tmp_path, fan_out=bad)


def test_a_stack_of_layers_the_shares_do_not_divide_is_split_along_each_layers_rows(
    tmp_path, fsdp_spans_processes
):
    from meshinit._checkpoint.read import survey

    save_file({f"l.{i}": np.zeros((4, 8), np.float32) for i in range(3)}, str(tmp_path / "m.st"))
    names = {"s": st.Stack(["l.0", "l.1", "l.2"], axis=0), "e": st.Stack(["l.0", "l.1"], axis=0)}
    plan = plan_of({"s": ((3, 4, 8), None), "e": ((2, 4, 8), None)})
    jobs = {j.entry.path: j for j in survey.survey(plan, tmp_path / "m.st", names, "t").jobs}
    # 3 layers in 2 shares would be 2 and 1; each layer's 4 rows split evenly: 2 and 2
    assert fanout.stage(jobs["s"].entry, jobs["s"].node).axis == 1
    assert fanout.stage(jobs["e"].entry, jobs["e"].node).axis == 0  # 2 layers: 1 each


def test_a_load_reshards_in_about_sixteen_batches_so_its_fetches_overlap_them():
    # each entry: 1 MiB replicated on 8 devices of this process, 16 MiB planned and staged
    plan = plan_of({f"l.{i:02d}": ((1024, 256), None) for i in range(32)})
    found = fanout.batches(plan.entries, 1 << 30)
    assert found == [i // 2 for i in range(32)]  # 512 MiB in all: 32 MiB a batch
    assert fanout.batches(plan.entries, 16 << 20) == list(range(32))  # the budget bounds
