"""The plan's record as JSON text: one mesh or param record a line, and ``json.loads``
gives the record back."""

import json

from meshinit._report.json_text import to_json

RECORD = {
    "schema": "meshinit.plan/1",
    "meshes": [{"index": 0, "axis_names": ["x"]}],
    "params": [{"path": "a", "shape": [2]}, {"path": "b", "shape": []}],
    "totals": {"params": 2},
}


def test_each_record_is_one_line_and_the_text_loads_back():
    text = to_json(RECORD)
    assert text.splitlines() == [
        "{",
        '  "schema": "meshinit.plan/1",',
        '  "meshes": [',
        '    {"index": 0, "axis_names": ["x"]}',
        "  ],",
        '  "params": [',
        '    {"path": "a", "shape": [2]},',
        '    {"path": "b", "shape": []}',
        "  ],",
        '  "totals": {"params": 2}',
        "}",
    ]
    assert json.loads(text) == RECORD


def test_indent_none_is_one_line_and_indent_sets_the_padding():
    assert to_json(RECORD, indent=None) == json.dumps(RECORD)
    assert to_json(RECORD, indent=4).splitlines()[3] == '        {"index": 0, "axis_names": ["x"]}'
    assert json.loads(to_json({**RECORD, "params": []}, indent=1))["params"] == []
