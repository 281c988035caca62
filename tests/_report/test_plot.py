"""Heatmaps of per-device bytes, one panel per mesh."""

import jax
import pytest
from helpers import overlapping_mesh_specs

import meshinit


def test_heatmap_draws_each_mesh_grid_with_per_device_bytes():
    pytest.importorskip("matplotlib")
    plan = meshinit.plan(overlapping_mesh_specs())
    fig = plan.heatmap()
    per_device = plan.bytes_per_device()
    images = [ax for ax in fig.axes if ax.get_images()]
    assert len(images) == 3 and len(fig.axes) == 4  # one colorbar, shared
    top = max(per_device.values())
    for ax, group in zip(images, plan.groups, strict=True):
        assert ax.get_images()[0].get_clim() == (0, top)  # one colour scale across panels
        grid = ax.get_images()[0].get_array()
        expected = [per_device[d] for d in group.mesh.devices.flat]
        assert grid.flatten().tolist() == expected
        assert ax.get_title().startswith(f"mesh {plan.groups.index(group)}: Mesh(")
    # (2, 2, 2): data as rows, fsdp x tensor flattened into 4 columns, and the title says so
    assert images[1].get_images()[0].get_array().shape == (2, 4)
    assert "rows: data; columns: fsdp×tensor flattened row-major" in images[1].get_title()
    assert images[1].get_xlabel() == "fsdp×tensor" and images[1].get_ylabel() == "data"
    assert images[2].get_images()[0].get_array().shape == (1, 2)  # one axis: one row
    # devices 6 and 7 hold all three meshes' shards
    assert per_device[jax.devices()[7]] == sum(g.device_bytes for g in plan.groups)


def test_heatmap_of_an_empty_plan_says_so():
    pytest.importorskip("matplotlib")
    with pytest.raises(ValueError, match="the plan has no parameters"):
        meshinit.plan({}).heatmap()
