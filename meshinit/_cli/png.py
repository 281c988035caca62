"""``--png FILE`` of ``meshinit plan`` and ``meshinit demo``: checked before any work,
drawn after it. FILE gets each mesh's bytes per device (``Plan.heatmap``), and
``FILE-devices.png`` beside it which devices each mesh or pipeline stage covers
(``Plan.devices_figure``)."""

from __future__ import annotations

import pathlib
from typing import Any

HELP = (
    "also draw each mesh's bytes per device in FILE, and which devices each mesh (each "
    "pipeline stage) covers in FILE-devices.png beside it (matplotlib)"
)


class Unwritable(Exception):
    """A picture cannot be drawn or written; the message says which and why."""


def check(png: str) -> None:
    """Refuses ``png`` before any work: matplotlib missing, or no such folder.

    Raises:
      Unwritable: naming the ``plot`` extra, or the missing folder.
    """
    from .._report.plot import require_matplotlib

    try:
        require_matplotlib()
    except ImportError as e:
        raise Unwritable(str(e)) from None
    folder = pathlib.Path(png).resolve().parent
    if not folder.is_dir():
        raise Unwritable(f"cannot write {png}: no directory {folder}")


def devices_path(png: str) -> str:
    """Where the devices each mesh covers are drawn: ``plan-devices.png`` for ``plan.png``."""
    path = pathlib.Path(png)
    return str(path.with_name(f"{path.stem}-devices{path.suffix or '.png'}"))


def write(plan: Any, png: str) -> list[str]:
    """Draws ``plan``'s heatmap into ``png`` and its devices figure beside it.

    Returns:
      The paths written, in that order.

    Raises:
      Unwritable: a file cannot be written.
    """
    written = []
    for figure, path in ((plan.heatmap, png), (plan.devices_figure, devices_path(png))):
        try:
            figure().savefig(path)
        except OSError as e:
            raise Unwritable(f"cannot write {path}: {e.strerror or e}") from None
        written.append(path)
    return written
