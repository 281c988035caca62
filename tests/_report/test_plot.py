"""Pictures of a plan: per-device bytes, one panel per mesh, and which devices each
mesh covers. Read from what the figures draw (image arrays, patches, texts), not pixels."""

import jax
import numpy as np
import pytest
from helpers import overlapping_mesh_specs
from jax.sharding import AbstractMesh

import meshinit

zeros = jax.nn.initializers.zeros


def _drawn(fig):
    """The figure laid out as a saved PNG would be (the Agg canvas, headless)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig).draw()
    return fig


def test_heatmap_draws_each_mesh_grid_with_its_own_bytes_per_device():
    pytest.importorskip("matplotlib")
    plan = meshinit.plan(overlapping_mesh_specs())
    fig = plan.heatmap()
    images = [ax for ax in fig.axes if ax.get_images()]
    assert len(images) == 3 and len(fig.axes) == 4  # one colorbar, shared
    top = max(g.device_bytes for g in plan.groups)
    for ax, group in zip(images, plan.groups, strict=True):
        assert ax.get_images()[0].get_clim() == (0, top)  # one colour scale across panels
        grid = ax.get_images()[0].get_array()
        assert grid.flatten().tolist() == [group.device_bytes] * group.mesh.size
        assert ax.get_title().startswith(f"mesh {plan.groups.index(group)}: Mesh(")
    # (2, 2, 2): data as rows, fsdp x tensor flattened into 4 columns, and the title says so
    assert images[1].get_images()[0].get_array().shape == (2, 4)
    assert "rows: data; columns: fsdp×tensor flattened row-major" in images[1].get_title()
    assert images[1].get_xlabel() == "fsdp×tensor" and images[1].get_ylabel() == "data"
    assert images[2].get_images()[0].get_array().shape == (1, 2)  # one axis: one row
    # devices 6 and 7 hold all three meshes' shards: their cells say what the others add
    total = plan.bytes_per_device()[jax.devices()[7]]
    assert total == sum(g.device_bytes for g in plan.groups)
    others = total - plan.groups[2].device_bytes
    texts = [t.get_text() for t in images[2].texts]
    assert texts[1] == (
        f"device 7\n{plan.groups[2].device_bytes} B\n+{meshinit._format.human_bytes(others)}\n"
        f"other meshes"
    )


def test_each_panel_is_its_meshs_share_not_the_devices_total():
    pytest.importorskip("matplotlib")
    devices = jax.devices()
    small = jax.make_mesh((2, 4), ("fsdp", "tensor"), devices=devices)
    big = jax.make_mesh((8,), ("x",), devices=devices)  # the same 8 devices
    plan = meshinit.plan(
        {
            "a": meshinit.param((16, 32), zeros, axes=("fsdp", "tensor"), mesh=small),
            "b": meshinit.param((64, 64), zeros, axes=("x", None), mesh=big),
        }
    )
    shares = [g.device_bytes for g in plan.groups]
    assert shares == [16 * 32 * 4 // 8, 64 * 64 * 4 // 8]  # 256 B and 2 KiB
    fig = plan.heatmap()
    drawn = [ax.get_images()[0].get_array() for ax in fig.axes if ax.get_images()]
    assert [np.unique(np.asarray(a)).tolist() for a in drawn] == [[shares[0]], [shares[1]]]
    assert all(a.size == 8 for a in drawn)


@pytest.mark.parametrize(
    "shape, names",
    [((4, 512), ("a", "b")), ((256,), ("x",)), ((8,), ("x",)), ((2, 2, 64), ("d", "f", "t"))],
)
def test_the_colour_bar_label_lies_inside_the_figure(shape, names):
    pytest.importorskip("matplotlib")
    mesh = AbstractMesh(shape, names)
    spec = meshinit.param((64 * shape[-1], 64), zeros, axes=(names[-1], None), mesh=mesh)
    fig = _drawn(meshinit.plan({"w": spec}).heatmap())
    [bar] = [ax for ax in fig.axes if not ax.get_images()]
    label = bar.yaxis.label
    assert label.get_text().startswith("bytes per device")
    box, inside = label.get_window_extent(), fig.bbox
    assert inside.x0 <= box.x0 and box.x1 <= inside.x1, (box, inside)
    assert inside.y0 <= box.y0 and box.y1 <= inside.y1, (box, inside)


def test_heatmap_of_an_empty_plan_says_so():
    pytest.importorskip("matplotlib")
    with pytest.raises(ValueError, match="the plan has no parameters"):
        meshinit.plan({}).heatmap()
    with pytest.raises(ValueError, match="the plan has no parameters"):
        meshinit.plan({}).devices_figure()


def _coverage(fig) -> tuple[dict[str, set[int]], list[str]]:
    """What a devices figure draws: each cell's label and the meshes of its bands (by
    their colour in the legend), and the legend's texts."""
    from matplotlib.colors import to_hex

    [legend] = fig.legends
    texts = [t.get_text() for t in legend.get_texts()]
    mesh_of = {to_hex(h.get_facecolor()): i for i, h in enumerate(legend.legend_handles)}
    [ax] = fig.axes
    labels = {(int(t.get_position()[0]), int(t.get_position()[1])): t.get_text() for t in ax.texts}
    [bands] = [c for c in ax.collections if c.get_gid() == "bands"]
    covered: dict[str, set[int]] = {}
    for path, face in zip(bands.get_paths(), bands.get_facecolors(), strict=True):
        x0, y0 = path.get_extents().x0, path.get_extents().y0
        cell = labels[(int(np.floor(x0 + 1e-9)), int(np.floor(y0 + 1e-9)))]
        covered.setdefault(cell, set()).add(mesh_of[to_hex(face)])
    return covered, texts


def test_devices_figure_draws_each_device_with_the_meshes_that_cover_it():
    pytest.importorskip("matplotlib")
    plan = meshinit.plan(overlapping_mesh_specs())
    covered, texts = _coverage(plan.devices_figure())
    # meshes 0 and 1 cover all 8 devices, mesh 2 only devices 6 and 7
    assert covered == {str(d): {0, 1} for d in range(6)} | {"6": {0, 1, 2}, "7": {0, 1, 2}}
    assert texts[2] == "mesh 2: c (1 param)\nMesh(tensor=2; Explicit; devices 6-7)"


def test_devices_figure_shows_interleaved_pipeline_stages():
    pytest.importorskip("matplotlib")
    from meshinit._cli.demo import _demo_specs

    specs, _ = _demo_specs(jax.devices())
    plan = meshinit.plan(specs)
    covered, texts = _coverage(plan.devices_figure())
    stage = {i: t.split(":")[1].split()[0] for i, t in enumerate(texts)}
    assert stage[3] == "stages.0.*" and stage[4] == "stages.1.*"
    for d in range(8):  # even devices are stage 0's, odd ones stage 1's
        assert covered[str(d)] == {0, 1, 2, 3 if d % 2 == 0 else 4}, (d, covered[str(d)])
    assert "(5 params)" in texts[3] and "devices 0,2,4,6" in texts[3]


def test_abstract_meshes_get_cells_of_their_own():
    pytest.importorskip("matplotlib")
    a, b = AbstractMesh((2,), ("x",)), AbstractMesh((2, 2), ("x", "y"))
    plan = meshinit.plan(
        {
            "a": meshinit.param((4,), zeros, axes=("x",), mesh=a),
            "b": meshinit.param((4, 4), zeros, axes=("x", "y"), mesh=b),
        }
    )
    covered, _ = _coverage(plan.devices_figure())
    assert covered == {"mesh 0 #0": {0}, "mesh 0 #1": {0}} | {f"mesh 1 #{k}": {1} for k in range(4)}
