"""Fan-out's route where spanning axes were moved (a ``(2, 3)`` mesh of 3 processes x
2 devices, one process in both rows): each piece crosses to a process once, so the
bytes between processes are the bytes due, and the values are the file's. Processes are
simulated in one process (``process_of``: two devices a process, in mesh order); the
multi-process tests (tests/guarantees/test_fanout_three.py) run it under
jax.distributed."""

import math
import re

import jax
import ml_dtypes
import numpy as np
import pytest
from helpers import plan_of, same_bits, submesh

import meshinit
from meshinit import safetensors as st
from meshinit._checkpoint.layout import blocks
from meshinit._checkpoint.layout.host import resolved
from meshinit._checkpoint.read import reshard, route, staging

GRIDS = [((2, 3), 3), ((2, 4), 4), ((3, 2), 3)]
AXES = [("data", "tensor"), (None, "tensor"), ("tensor", None), None]


@pytest.fixture
def simulated(monkeypatch):
    """Devices 2k and 2k+1 count as process k's; this process is process 0."""
    monkeypatch.setattr(staging, "process_of", lambda d: d.id // 2)
    monkeypatch.setattr(staging, "processes", lambda: 3)
    meshinit.clear_cache()  # spanning() and the routes are memoized by mesh
    yield
    meshinit.clear_cache()


def _staged(grid, processes, axes, shape=(48, 24), names=("data", "tensor")):
    mesh = submesh(range(2 * processes), grid, names)
    (entry,) = plan_of({"w": (shape, axes)}, mesh=mesh).entries
    node = blocks.Leaf(st.Tensor("x"), None, (), shape, (0, 1), "")
    return entry, staging.stage(entry, node)


def _due(entry, stage):
    """Elements due to the processes: of each process's distinct planned blocks, what
    none of its staging blocks holds (bytes_from_peers, summed, in elements)."""
    shape, total = entry.spec.shape, 0
    read: dict = {}
    for device, index in stage.sharding.devices_indices_map(stage.shape).items():
        real = stage.real(resolved(index, stage.shape))[0]
        mine = read.setdefault(staging.process_of(device), set())
        mine.add(tuple((s.start, s.stop) for s in real))
    held: dict = {}
    for device, index in entry.sharding.devices_indices_map(shape).items():
        block = tuple((s.start, s.stop) for s in resolved(index, shape))
        held.setdefault(staging.process_of(device), set()).add(block)
    for p, wanted in held.items():
        for want in wanted:
            have = sum(_common(want, r) for r in read.get(p, ()))
            total += math.prod(b - a for a, b in want) - have
    return total


def _common(a, b):
    return math.prod(max(0, min(x[1], y[1]) - max(x[0], y[0])) for x, y in zip(a, b, strict=True))


def _permuted(compiled):
    """Elements the compiled program's collectives move between simulated processes:
    its collective permutes' pairs (device positions in the mesh), and whether it runs
    any other collective (an all-gather or all-to-all moves whole shares)."""
    text = compiled.as_text()
    others = re.findall(r" (all-gather|all-to-all|all-reduce)(?:-start)?\(", text)
    moved = 0
    permute = r"= \w+\[([\d,]*)\][^=]*? collective-permute(?:-start)?\("
    for shape, pairs in re.findall(permute + r".*?source_target_pairs=\{(.*?)\}\}", text):
        size = math.prod(int(n) for n in shape.split(",") if n)
        for a, b in re.findall(r"\{(\d+),(\d+)", pairs + "}"):
            moved += size * (int(a) // 2 != int(b) // 2)
    return moved, others


MOVED = AXES[:2]  # on (2, 3), 'tensor' splits the columns: moved onto the rows


@pytest.mark.parametrize("axes", MOVED, ids=str)
def test_on_a_mesh_where_a_process_sits_in_both_rows_each_piece_crosses_once(simulated, axes):
    # (2, 3): 'tensor' crosses processes, so fan-out reads whole rows and moves them
    # back; as XLA's all-to-all then all-gather, a piece read by process 1 went to
    # process 0 and back (1.06-1.07x the bytes due at the sockets)
    entry, stage = _staged((2, 3), 3, axes)
    assert stage.moved == ("tensor",)
    spec = jax.ShapeDtypeStruct(stage.shape, np.float32, sharding=stage.sharding)
    compiled = reshard.program(entry, stage, spec)
    moved, others = _permuted(compiled)
    assert others == [], f"the reshard runs {others}: whole shares cross"
    assert moved == _due(entry, stage) > 0, (moved, _due(entry, stage))


@pytest.mark.parametrize("grid, processes", GRIDS, ids=str)
@pytest.mark.parametrize("axes", AXES, ids=str)
def test_a_routes_crossing_elements_are_the_elements_due(simulated, grid, processes, axes):
    entry, stage = _staged(grid, processes, axes)
    if not route.routes(stage, entry.sharding, entry.spec.shape):
        return  # nothing moved: reshard's all-gather
    found = route.sends(stage, entry.sharding, entry.spec.shape)
    assert route.crossing(found, entry.sharding.mesh) == _due(entry, stage)
    for step in route.rounds(found):  # each a permutation of one piece shape
        assert len({s.src for s in step}) == len({s.dst for s in step}) == len(step)
        assert len({(s.shape, s.forward) for s in step}) == 1


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("axes", AXES, ids=str)
def test_the_routed_reshard_gives_the_files_bits(simulated, tmp_path, axes, dtype):
    kind = np.dtype(getattr(ml_dtypes, dtype, dtype))
    # 50 rows where they are not split 3 ways: the staging blocks are padded
    shape = (48, 24) if axes and axes[0] == "tensor" else (50, 24)
    values = np.random.default_rng(23).standard_normal(shape).astype(kind)
    st_file = tmp_path / "m.safetensors"
    pytest.importorskip("safetensors.numpy").save_file({"w": values}, str(st_file))
    mesh = submesh(range(6), (2, 3), ("data", "tensor"))
    plan = plan_of({"w": (shape, axes)}, mesh=mesh, dtype=kind)
    reshard._reshards.clear()
    got = st.load(plan, st_file, fan_out=True)["w"]
    (compiled,) = reshard._reshards.values()
    routed = not _permuted(compiled)[1]  # no all-gather, no all-to-all
    assert routed == (axes in MOVED), "moved axes are routed, the rest all-gathered"
    assert got.sharding == plan.entries[0].sharding
    same_bits(got, values, "w")


@pytest.mark.parametrize("axes", [(None, "tensor"), ("data", "tensor")], ids=str)
def test_a_piece_two_devices_of_a_process_hold_crosses_to_it_once(
    simulated, monkeypatch, tmp_path, axes
):
    # (data=2, tensor=2, local=2), a process per (data, tensor): both its devices hold
    # the same block, so a piece crosses to one of them and is handed on to the other
    monkeypatch.setattr(staging, "processes", lambda: 4)
    names = ("data", "tensor", "local")
    entry, stage = _staged((2, 2, 2), 4, axes, shape=(50, 24), names=names)
    found = route.sends(stage, entry.sharding, entry.spec.shape)
    assert any(s.forward for s in found)
    assert route.crossing(found, entry.sharding.mesh) == _due(entry, stage)
    values = np.random.default_rng(67).standard_normal((50, 24)).astype(np.float32)
    pytest.importorskip("safetensors.numpy").save_file({"w": values}, str(tmp_path / "m.st"))
    plan = plan_of({"w": ((50, 24), axes)}, mesh=entry.sharding.mesh)
    same_bits(st.load(plan, tmp_path / "m.st", fan_out=True)["w"], values, "w")
