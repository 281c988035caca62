"""The conformance table (docs/conformance.md) is what the real-client tests check.

tests/conformance.py declares each client model's claimed checks and renders the table.
Here, on every stack (the clients themselves need not be installed): the page shows
exactly that table, and each claimed cell is selected by a ``@conformance.parametrize``
decorator in its client's test module. In the client's own venv, that module also
checks at run time that every claimed cell was collected into a test.
"""

import pathlib
import re

import conformance
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def page_table() -> str:
    text = (ROOT / "docs" / "conformance.md").read_text()
    # the registry's table is the one headed "| Client | Model |" (the page also lists
    # MaxText's families, a table of its own)
    tables = re.findall(r"^\| Client \| Model \|.*\|\n(?:\|.*\|\n)+", text, re.M)
    assert len(tables) == 1, f"docs/conformance.md shows {len(tables)} client tables, want one"
    return tables[0]


def test_the_page_shows_the_table_the_registry_renders():
    assert page_table() == conformance.render(), (
        "docs/conformance.md's table is not tests/conformance.py's: paste "
        "conformance.render() into the page\n" + conformance.render()
    )


def test_the_rendered_table_has_a_row_per_model_and_a_cell_per_claim():
    lines = conformance.render().splitlines()
    assert len(lines) == 2 + len(conformance.ROWS)
    for row, line in zip(conformance.ROWS, lines[2:], strict=True):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[:2] == [conformance.CLIENTS[row.client], row.model], line
        marks = dict(zip(conformance.CHECKS, cells[2:], strict=True))
        assert {c for c, m in marks.items() if m == "✓"} == row.checks, line


@pytest.mark.parametrize("client", sorted(conformance.CLIENTS))
def test_every_claimed_cell_has_a_test_in_its_client_module(client):
    source = (ROOT / "tests" / "clients" / f"test_{client}.py").read_text()
    declared = {(case, check) for c, case, check in conformance.declared(source) if c == client}
    claimed = conformance.claimed(client)
    assert claimed, f"tests/conformance.py claims nothing for {client}"
    missing = sorted(claimed - declared)
    assert not missing, f"claimed for {client} but no test in test_{client}.py runs it: {missing}"


def test_the_declaration_check_finds_a_cell_without_a_test():
    source = """
import conformance

@conformance.parametrize("tunix", "shardings", "values", case="llama3|qwen2")
def test_a(row):
    pass

def test_b():
    pass
"""
    declared = conformance.declared(source)
    assert declared == {
        ("tunix", case, check) for case in ("llama3", "qwen2") for check in ("shardings", "values")
    }
    assert ("tunix", "gemma3", "shardings") not in declared  # claimed, and not run there
    assert ("tunix", "gemma3", "shardings") in {
        ("tunix", case, check) for case, check in conformance.claimed("tunix")
    }


def test_parametrize_refuses_an_unknown_check_or_client():
    with pytest.raises(ValueError, match="unknown {'shardings=='}"):
        conformance.parametrize("tunix", "shardings==")
    with pytest.raises(ValueError, match="client 'flaxformer'"):
        conformance.parametrize("flaxformer", "values")
