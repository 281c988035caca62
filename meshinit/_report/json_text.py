"""The plan's record as JSON text (``Plan.to_json``, ``meshinit plan --json``)."""

from __future__ import annotations

import json
from typing import Any


def to_json(data: dict[str, Any], indent: int | None = 2) -> str:
    """See ``Plan.to_json``: one record a line, so the text greps and diffs well.

    ``data`` is the ``meshinit.plan/1`` dict (``Plan.to_dict``).
    """
    if indent is None:
        return json.dumps(data)
    pad = " " * indent

    def value(v: Any) -> str:
        if isinstance(v, list) and v and isinstance(v[0], dict):
            return "[\n" + ",\n".join(pad * 2 + json.dumps(r) for r in v) + f"\n{pad}]"
        return json.dumps(v)

    fields = [f"{pad}{json.dumps(k)}: {value(v)}" for k, v in data.items()]
    return "{\n" + ",\n".join(fields) + "\n}"
