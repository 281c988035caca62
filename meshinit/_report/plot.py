"""Pictures of a plan, drawn from the plan's record (``meshinit._plan.record.record``):
each mesh's per-device bytes as a heatmap over its grid, and which devices each mesh
(each pipeline stage) covers.

matplotlib is optional (``pip install 'meshinit[plot]'``) and imported only here, only
when a picture is asked for. Figures are built without pyplot, so they draw headless
and never touch the global backend.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .._format import human_bytes, some

MISSING = "drawing a plan needs matplotlib: pip install 'meshinit[plot]'"
_ANNOTATE_UP_TO = 64  # cells; beyond that the numbers would not fit


def require_matplotlib() -> None:
    """Raises ImportError naming the ``plot`` extra when matplotlib is not installed."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise ImportError(MISSING) from e


def _grid(values: np.ndarray, names: tuple[str, ...], sizes: tuple[int, ...]):
    """A mesh's values as 2-D, with row and column labels and a note on flattening."""
    if not sizes:
        return values.reshape(1, 1), "", "", ""
    if len(sizes) == 1:
        return values.reshape(1, sizes[0]), "", names[0], ""
    cols = "×".join(names[1:])
    note = f"rows: {names[0]}; columns: {cols} flattened row-major" if len(sizes) > 2 else ""
    return values.reshape(sizes[0], -1), names[0], cols, note


def _byte_ticks(top: float, locator: Any) -> list[float]:
    """Round ticks in the unit ``human_bytes`` shows (``0, 128 KiB, 256 KiB, ...``)."""
    unit = 1024 ** max(0, min(4, int(np.log(max(top, 1)) // np.log(1024))))
    ticks = locator(nbins=5, steps=[1, 2, 2.5, 4, 5, 8, 10]).tick_values(0, top / unit) * unit
    return [float(t) for t in ticks if 0 <= t <= top]


def _meshes(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The record's meshes, or ValueError: a plan of no parameters draws nothing."""
    if not record["meshes"]:
        raise ValueError("the plan has no parameters: there is nothing to draw")
    return record["meshes"]


def heatmap(record: dict[str, Any]) -> Any:
    """See ``Plan.heatmap``; ``record`` is the plan's record."""
    require_matplotlib()
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    meshes = _meshes(record)
    n = len(meshes)
    fig = Figure(figsize=(9, 0.6 + 3.0 * n), layout="constrained")
    axes = fig.subplots(n, 1, squeeze=False)[:, 0]
    fmt = FuncFormatter(lambda x, _: human_bytes(int(round(x))))
    # Each panel is its own mesh's share: every device of a mesh holds the same bytes of
    # it (shardings divide evenly). One colour scale: the same colour is the same bytes.
    top = float(max(max(m["device_bytes"] for m in meshes), 1))
    for i, (mesh, ax) in enumerate(zip(meshes, axes, strict=True)):
        size = len(mesh["bytes_per_device"])
        values = np.full(size, float(mesh["device_bytes"]))
        # what the devices hold from the other meshes of the plan, beside this one's
        others: np.ndarray = np.array(mesh["bytes_per_device"], dtype=np.float64) - values
        grid, rows, cols, note = _grid(values, tuple(mesh["axis_names"]), tuple(mesh["axis_sizes"]))
        image = ax.imshow(
            grid, cmap="viridis", vmin=0, vmax=top, aspect="auto", interpolation="nearest"
        )
        k, device_bytes = mesh["params"], mesh["device_bytes"]
        title = [
            f"mesh {i}: {mesh['description']}",
            f"its {k} param{'s' if k != 1 else ''}: {human_bytes(device_bytes)} per device",
        ]
        if others.max() > 0:
            title[1] += (
                f"; with other meshes' params: up to {human_bytes(int((values + others).max()))}"
            )
        if note:
            title.append(note)
        ax.set_title("\n".join(title), fontsize=9)
        ax.set_ylabel(rows)
        ax.set_xlabel(cols)
        if grid.shape[1] <= 16:
            ax.set_xticks(range(grid.shape[1]))
        if grid.shape[0] <= 16:
            ax.set_yticks(range(grid.shape[0]))
        if not rows:
            ax.set_yticks([])
        if grid.size <= _ANNOTATE_UP_TO:
            ids = None if mesh["abstract"] else np.asarray(mesh["device_ids"]).reshape(grid.shape)
            extra = others.reshape(grid.shape)
            for (r, c), v in np.ndenumerate(grid):
                text = human_bytes(int(v))
                if ids is not None:
                    text = f"device {ids[r, c]}\n{text}"
                if extra[r, c] > 0:
                    text += f"\n+{human_bytes(int(extra[r, c]))}\nother meshes"
                color = "white" if v < top / 2 else "black"  # readable on viridis
                size = 7 if grid.shape[1] <= 4 else 6  # eight columns of text still fit
                ax.text(c, r, text, ha="center", va="center", fontsize=size, color=color)
    bar = fig.colorbar(image, ax=list(axes), format=fmt)
    bar.set_ticks(_byte_ticks(top, MaxNLocator))
    # Short lines: a label longer than one panel is tall would be cut off at the edges.
    bar.set_label("bytes per device,\none scale for all meshes", fontsize=9)
    fig.suptitle("bytes each device holds of each mesh's parameters", fontsize=10)
    return fig


def _mesh_label(paths: list[str]) -> str:
    """What a mesh holds, short: ``stages.0.*`` for one subtree, else its top names."""
    if not paths:
        return "no params"
    parts = [p.split(".") for p in paths]
    common: list[str] = []
    for names in zip(*parts, strict=False):
        if len(set(names)) > 1:
            break
        common.append(names[0])
    if common and len(paths) > 1:
        return ".".join(common) + ".*"
    if common:
        return paths[0]
    return some(list(dict.fromkeys(p[0] for p in parts)), 3)


def device_cells(record: dict[str, Any]) -> list[tuple[str, list[int]]]:
    """Every device of the plan's meshes, and the meshes (their indices) that cover it.

    A concrete mesh's devices are named by id (``"device 5"``), in id order, and shared
    with every other mesh over them. An abstract mesh has no devices: its cells are its
    own (``"mesh 2 #5"``, its flat row-major position), after the concrete ones, as
    ``Plan.bytes_per_device`` counts them.
    """
    concrete: dict[int, list[int]] = {}
    abstract: list[tuple[str, list[int]]] = []
    for i, mesh in enumerate(record["meshes"]):
        if mesh["abstract"]:
            size = int(np.prod(mesh["axis_sizes"], dtype=np.int64))
            abstract += [(f"mesh {i} #{k}", [i]) for k in range(size)]
        else:
            for d in np.asarray(mesh["device_ids"]).flat:
                concrete.setdefault(int(d), []).append(i)
    return [(f"device {d}", concrete[d]) for d in sorted(concrete)] + abstract


def devices(record: dict[str, Any]) -> Any:
    """See ``Plan.devices_figure``; ``record`` is the plan's record."""
    require_matplotlib()
    from matplotlib import colormaps
    from matplotlib.collections import PatchCollection
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch, Rectangle

    meshes = _meshes(record)
    cells = device_cells(record)
    n = len(cells)
    cols = min(n, 2 ** math.ceil(math.log2(math.sqrt(n)))) if n > 1 else 1
    rows = math.ceil(n / cols)
    cmap = colormaps["tab10" if len(meshes) <= 10 else "tab20"]
    colour = [cmap(i % cmap.N) for i in range(len(meshes))]
    side = min(1.1, 10.0 / cols)  # inches a cell: at most 10 wide, however many devices
    fig = Figure(figsize=(max(4.0, side * cols) + 4.5, 1.2 + side * rows), layout="constrained")
    ax = fig.subplots()
    bands, faces, outlines = [], [], []
    for k, (name, covering) in enumerate(cells):
        r, c = divmod(k, cols)
        height = 1.0 / len(covering)
        for j, i in enumerate(covering):  # a band per mesh on the device, top to bottom
            bands.append(Rectangle((c, r + j * height), 1.0, height))
            faces.append(colour[i])
        outlines.append(Rectangle((c, r), 1.0, 1.0))
        if n <= _ANNOTATE_UP_TO:
            label = name.removeprefix("device ")
            box = {"boxstyle": "round,pad=0.15", "fc": "white", "alpha": 0.8, "lw": 0}
            ax.text(c + 0.5, r + 0.5, label, ha="center", va="center", fontsize=8, bbox=box)
    # Collections, not a patch per band: a plan over 2048 devices draws in a second.
    ax.add_collection(
        PatchCollection(bands, facecolors=faces, edgecolors="white", linewidths=0.3, gid="bands")
    )
    if n <= 256:  # beyond, the outlines would be all there is to see
        ax.add_collection(
            PatchCollection(outlines, facecolors="none", edgecolors="black", linewidths=0.8)
        )
    ax.set_xlim(0, cols)
    ax.set_ylim(rows, 0)  # the first device top left, row by row
    ax.set_aspect("equal")
    ax.set_xticks([])
    ax.set_yticks([])
    for spine in ax.spines.values():
        spine.set_visible(False)
    paths: list[list[str]] = [[] for _ in meshes]
    for p in record["params"]:
        paths[p["mesh"]].append(p["path"])
    handles = [
        Patch(
            facecolor=colour[i],
            label=f"mesh {i}: {_mesh_label(paths[i])} ({m['params']} "
            f"param{'s' if m['params'] != 1 else ''})\n{m['description']}",
        )
        for i, m in enumerate(meshes)
    ]
    fig.legend(handles=handles, loc="outside right upper", fontsize=8, frameon=False)
    what = "a cell per device, a band per mesh that covers it"
    if any(m["abstract"] for m in meshes):
        what += "; abstract meshes share no devices (cells: mesh #position)"
    ax.set_title(f"which devices each mesh covers\n{what}", fontsize=10)
    return fig
