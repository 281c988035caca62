"""Fan-out's plan in one process: the staging a parameter held by several processes is
read onto, its blocks' parts of the planned array, the axis split, and the batches its
reshards run in. The fsdp axis is made to count as one that spans processes
(``spanning``: the fixture ``fsdp_spans_processes`` of this folder's conftest.py); the
multi-process tests (tests/guarantees/test_fanout.py) run it under jax.distributed."""

from types import SimpleNamespace

import numpy as np
import pytest
from helpers import plan_of
from jax.sharding import PartitionSpec as P

from meshinit import safetensors as st
from meshinit._checkpoint.layout import blocks
from meshinit._checkpoint.read import staging

save_file = pytest.importorskip("safetensors.numpy").save_file


def test_a_staging_block_is_its_part_of_the_planned_array_then_padding():
    # 6 rows in 2 planned blocks of 3, each padded to 4 for 2 shares
    stage = staging.Stage(None, (8, 5), 0, shards=2, rows=3, padded=4, added=("fsdp",))
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
    assert staging.outer_axes(jobs["k"].node) == [1]
    assert staging.outer_axes(jobs["s"].node) == [0, 1]  # the layers, then each one's rows
    assert staging.outer_axes(jobs["c"].node) == [0]
    assert staging.outer_axes(blocks.Const(0, (3,), "")) == []


def test_staging_adds_the_spanning_axes_to_the_outer_axis(fsdp_spans_processes):
    plan = plan_of({"w": ((6, 8), (None, "tensor")), "b": ((3,), None)})
    leaf = lambda shape: blocks.Leaf(st.Tensor("x"), None, (), shape, (0, 1)[: len(shape)], "")  # noqa: E731
    w, b = plan.entries if plan.entries[0].path == "w" else plan.entries[::-1]
    stage = staging.stage(w, leaf((6, 8)))
    assert stage.sharding.spec == P("fsdp", "tensor") and stage.shape == (6, 8)
    assert stage.padded == stage.rows == 6 and stage.shards == 1  # 2 shares of 3 rows
    tiny = staging.stage(b, leaf((3,)))  # 3 rows in 2 shares: padded to 4
    assert tiny.shape == (4,) and tiny.sharding.spec == P("fsdp")
    assert staging.stage(w, blocks.Const(0.0, (6, 8), "")) is None  # a Fill reads nothing
    scalar = plan_of({"s": ((), None)}).entries[0]
    assert staging.stage(scalar, leaf(())) is None  # no axis to split: read by each holder


def test_the_batches_keep_the_busiest_process_within_the_budget():
    plan = plan_of({f"l.{i}": ((64, 16), (None, "tensor")) for i in range(5)})
    # each: 64 x 4 f32 per device, 4 devices per process (one process: 8): 8 KiB x 2
    cost = 2 * 8 * 64 * 4 * 4
    assert staging.batches(plan.entries, 2 * cost) == [0, 0, 1, 1, 2]
    assert staging.batches(plan.entries, 1) == [0, 1, 2, 3, 4]  # at least one each


def test_a_stack_of_layers_the_shares_do_not_divide_is_split_along_each_layers_rows(
    tmp_path, fsdp_spans_processes
):
    from meshinit._checkpoint.read import survey

    save_file({f"l.{i}": np.zeros((4, 8), np.float32) for i in range(3)}, str(tmp_path / "m.st"))
    names = {"s": st.Stack(["l.0", "l.1", "l.2"], axis=0), "e": st.Stack(["l.0", "l.1"], axis=0)}
    plan = plan_of({"s": ((3, 4, 8), None), "e": ((2, 4, 8), None)})
    jobs = {j.entry.path: j for j in survey.survey(plan, tmp_path / "m.st", names, "t").jobs}
    # 3 layers in 2 shares would be 2 and 1; each layer's 4 rows split evenly: 2 and 2
    assert staging.stage(jobs["s"].entry, jobs["s"].node).axis == 1
    assert staging.stage(jobs["e"].entry, jobs["e"].node).axis == 0  # 2 layers: 1 each


def test_a_load_reshards_in_about_sixteen_batches_so_its_fetches_overlap_them():
    # each entry: 1 MiB replicated on 8 devices of this process, 16 MiB planned and staged
    plan = plan_of({f"l.{i:02d}": ((1024, 256), None) for i in range(32)})
    found = staging.batches(plan.entries, 1 << 30)
    assert found == [i // 2 for i in range(32)]  # 512 MiB in all: 32 MiB a batch
    assert staging.batches(plan.entries, 16 << 20) == list(range(32))  # the budget bounds


def test_each_batch_ends_at_its_last_staged_path():
    plan = plan_of({f"l.{i}": ((64, 16), (None, "tensor")) for i in range(5)})
    cost = 2 * 8 * 64 * 4 * 4  # as above: batches [0, 0, 1, 1, 2] within 2 * cost
    jobs = [SimpleNamespace(entry=e, stage="staged") for e in plan.entries]
    jobs.insert(2, SimpleNamespace(entry=None, stage=None))  # read as planned: no batch
    assert staging.ends(jobs, 2 * cost) == {"l.1", "l.3", "l.4"}
    assert staging.ends(jobs[2:3], 2 * cost) == frozenset()  # nothing staged


def _fetched(entry, stage):
    """Each (simulated) process's distinct blocks it reads of ``entry``: its staging
    blocks' parts of the planned array, or its planned blocks where not staged."""
    from meshinit._checkpoint.layout.host import resolved

    shape = entry.spec.shape if stage is None else stage.shape
    sharding = entry.sharding if stage is None else stage.sharding
    out: dict[int, set] = {}
    for device, index in sharding.devices_indices_map(shape).items():
        index = resolved(index, shape)
        real = index if stage is None else stage.real(index)[0]
        out.setdefault(staging.process_of(device), set()).add(
            tuple((s.start, s.stop) for s in real)
        )
    return out


@pytest.mark.parametrize(
    "grid, processes",
    [((3, 2), 3), ((2, 3), 3), ((4, 2), 4), ((2, 4), 4)],
    ids=["3x2", "2x3", "4x2", "2x4"],
)
@pytest.mark.parametrize("axes", [("data", "tensor"), (None, "tensor"), ("tensor", None), None])
def test_each_process_reads_an_equal_share_of_whole_stored_rows_on_every_mesh(
    monkeypatch, grid, processes, axes
):
    # devices in process order, 2 a process: on (2, 3) process 1 sits in both rows, and
    # on (2, 4) every process's two devices are neighbours along 'tensor'. Each process
    # reads 1/P of the tensor (of each block that several hold, 1/R), once for the job,
    # and only whole stored rows: a piece of a row that another process's piece sits
    # beside is read through (the fetch joins its runs) or costs a request a row
    from helpers import submesh

    import meshinit

    monkeypatch.setattr(staging, "process_of", lambda d: d.id // 2)
    monkeypatch.setattr(staging, "processes", lambda: processes)
    meshinit.clear_cache()  # spanning() is memoized by mesh
    mesh = submesh(range(2 * processes), grid, ("data", "tensor"))
    shape = (48, 24)
    (entry,) = plan_of({"w": (shape, axes)}, mesh=mesh).entries
    node = blocks.Leaf(st.Tensor("x"), None, (), shape, (0, 1), "")
    fetched = _fetched(entry, staging.stage(entry, node))
    got = {p: sum((b - a) * (d - c) for (a, b), (c, d) in parts) for p, parts in fetched.items()}
    unique = shape[0] * shape[1]
    assert sum(got.values()) == unique, got  # each byte once for the whole job
    assert set(got.values()) == {unique // processes}, got  # an equal share each
    for p, parts in fetched.items():  # of each range of rows it reads, every column
        widths: dict = {}
        for rows, (c, d) in parts:
            widths[rows] = widths.get(rows, 0) + d - c
        assert set(widths.values()) == {shape[1]}, (p, sorted(parts))
    meshinit.clear_cache()


def test_local_files_on_one_host_are_read_by_each_process_unless_fan_out_is_true(
    tmp_path, fsdp_spans_processes
):
    # on one host the page cache serves every process: fan-out would add only loopback
    # traffic (fan_out=None); across hosts (a shared file system), or asked for, it fans out
    from meshinit._checkpoint.read import survey

    save_file({"w": np.zeros((8, 8), np.float32)}, str(tmp_path / "m.st"))
    plan = plan_of({"w": ((8, 8), (None, "tensor"))})
    jobs = survey.survey(plan, tmp_path / "m.st", None, "t").jobs
    assert [j.stage for j in staging.staged(jobs, None, one=True)] == [None]
    assert staging.staged(jobs, True, one=True)[0].stage is not None
    assert staging.staged(jobs, None, one=False)[0].stage is not None
    assert staging.staged(jobs, False, one=False)[0].stage is None


class _Store:
    """A stand-in for jax.distributed's key-value client: process 1's post is there."""

    def __init__(self, other):
        self.values = {f"{staging.HOSTS}/1": other}

    def key_value_set(self, key, value, allow_overwrite=False):
        self.values[key] = value

    def blocking_key_value_get(self, key, timeout_ms):
        return self.values[key]


@pytest.mark.parametrize("same", [True, False])
def test_one_host_compares_every_processs_host_name_and_boot_id(monkeypatch, same):
    from meshinit._jax import compat

    store = _Store(staging._host() if same else "elsewhere 0000")
    monkeypatch.setattr(compat, "distributed_client", lambda: store)
    monkeypatch.setattr(staging, "processes", lambda: 2)
    monkeypatch.setattr(staging, "_one_host", {})
    assert staging.one_host() is same
    assert store.values[f"{staging.HOSTS}/0"] == staging._host()  # posted for the others
    assert staging._host().split()[0]  # the host's name, then its boot id
