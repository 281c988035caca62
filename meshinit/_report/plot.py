"""Pictures of a plan: per-device bytes as a heatmap over each mesh's grid, drawn from
the plan's record (``meshinit._plan.record.record``).

matplotlib is optional (``pip install 'meshinit[plot]'``) and imported only here, only
when a picture is asked for. Figures are built without pyplot, so they draw headless
and never touch the global backend.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._format import human_bytes

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


def heatmap(record: dict[str, Any]) -> Any:
    """See ``Plan.heatmap``; ``record`` is the plan's record."""
    require_matplotlib()
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    meshes = record["meshes"]
    if not meshes:
        raise ValueError("the plan has no parameters: there is nothing to draw")
    n = len(meshes)
    fig = Figure(figsize=(9, 0.6 + 3.0 * n), layout="constrained")
    axes = fig.subplots(n, 1, squeeze=False)[:, 0]
    fmt = FuncFormatter(lambda x, _: human_bytes(int(round(x))))
    # One colour scale for every panel: the same colour is the same bytes on any mesh.
    top = max(max((b for m in meshes for b in m["bytes_per_device"]), default=0), 1.0)
    for i, (mesh, ax) in enumerate(zip(meshes, axes, strict=True)):
        # a plain ndarray: numpy 2.5's float64 overloads of max() fail mypy for Python 3.11
        values: np.ndarray = np.array(mesh["bytes_per_device"], dtype=np.float64)
        grid, rows, cols, note = _grid(values, tuple(mesh["axis_names"]), tuple(mesh["axis_sizes"]))
        image = ax.imshow(
            grid, cmap="viridis", vmin=0, vmax=top, aspect="auto", interpolation="nearest"
        )
        k, device_bytes = mesh["params"], mesh["device_bytes"]
        title = [
            f"mesh {i}: {mesh['description']}",
            f"its {k} param{'s' if k != 1 else ''}: {human_bytes(device_bytes)} per device",
        ]
        if values.max() > device_bytes:
            title[1] += f"; with other meshes' params: up to {human_bytes(int(values.max()))}"
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
            for (r, c), v in np.ndenumerate(grid):
                text = human_bytes(int(v))
                if ids is not None:
                    text = f"device {ids[r, c]}\n{text}"
                color = "white" if v < top / 2 else "black"  # readable on viridis
                ax.text(c, r, text, ha="center", va="center", fontsize=7, color=color)
    bar = fig.colorbar(image, ax=list(axes), format=fmt)
    bar.set_ticks(_byte_ticks(top, MaxNLocator))
    bar.set_label("parameter bytes per device, one scale for all meshes")
    fig.suptitle("bytes each device holds, all meshes' parameters counted", fontsize=10)
    return fig
