"""What the real-client tests check, model by model: the table in docs/conformance.md.

Each row names a client's model and the checks its tests claim for it. The client's
test module takes its cases from here: a test decorated with
``@conformance.parametrize(client, *checks)`` runs once per row of that client that
claims every one of ``checks``, and records that it did. So a row's claimed cell is
backed by a test that runs it, and the page's table is rendered from these rows:

- in the client's own module (which runs only where the client is installed, and must
  run in CI), ``unchecked(client)`` lists the claimed cells no collected test runs;
- everywhere, ``declared(source)`` reads the same decorators from the module's source
  text, and tests/guarantees/test_conformance.py checks both the page and the declarations.

A column is claimed only where a test asserts it for every leaf of the model:

- ``shardings``: each leaf's sharding ``==`` the client's own answer (not only
  equivalent);
- ``values``: each leaf bit-identical to the client's own init (typed keys as key data);
- ``metadata``: each Variable's type (and its flax metadata), or linen box, as the
  client's own init gives it;
- ``stages``: on two disjoint stage meshes by ``meshes=``, each leaf on its stage with
  the client's spelling on that mesh, values as above;
- ``abstract``: ``meshinit.nnx.abstract`` is the restore target of a checkpoint the
  client saved, with the client's shardings, and restores its values.
"""

from __future__ import annotations

import ast
import dataclasses
import re

import pytest

CHECKS = {  # check -> the table's column header
    "shardings": "shardings `==`",
    "values": "values bit-identical",
    "metadata": "metadata kept",
    "stages": "stages",
    "abstract": "abstract",
}
CLIENTS = {  # client (its test module is tests/test_<client>.py) -> as the table names it
    "maxtext": "MaxText 0.2.5",
    "tunix": "google-tunix 0.1.7",
}


@dataclasses.dataclass(frozen=True)
class Row:
    """One model of one client, and the checks its tests claim.

    Attributes:
      client: a key of ``CLIENTS``.
      case: the test id, and what the client's module builds (``nnx-scanned``).
      model: the model as the table names it.
      checks: keys of ``CHECKS``.
    """

    client: str
    case: str
    model: str
    checks: frozenset[str]


def _row(client: str, case: str, model: str, *checks: str) -> Row:
    unknown = set(checks) - set(CHECKS)
    assert client in CLIENTS and not unknown, (client, unknown)
    return Row(client, case, model, frozenset(checks))


_ALL = tuple(CHECKS)
_MAXTEXT = ("shardings", "values", "metadata")  # its tests build no stages, no abstract
ROWS = (
    _row("maxtext", "nnx-scanned", "NNX Transformer, scanned", *_MAXTEXT),
    _row("maxtext", "nnx-unrolled", "NNX Transformer, unrolled", *_MAXTEXT),
    _row("maxtext", "linen-scanned", "linen Transformer, scanned", *_MAXTEXT),
    _row("maxtext", "linen-unrolled", "linen Transformer, unrolled", *_MAXTEXT),
    _row("tunix", "llama3", "Llama3", *_ALL),
    _row("tunix", "qwen3", "Qwen3", *_ALL),
    _row("tunix", "qwen3-moe", "Qwen3-MoE", *_ALL),
    _row("tunix", "qwen2", "Qwen2", *_ALL),
    _row("tunix", "gemma3", "Gemma3", *_ALL),
    _row("tunix", "lora-llama3", "Llama3 with qwix LoRA", *_ALL),
)

_ran: set[tuple[str, str, str]] = set()  # (client, case, check) a decorated test runs


def select(client: str, checks: tuple[str, ...], case: str = ".*") -> list[Row]:
    """The rows of ``client`` whose case full-matches ``case`` and that claim every
    one of ``checks``."""
    unknown = set(checks) - set(CHECKS)
    if client not in CLIENTS or unknown or not checks:
        raise ValueError(f"conformance: client {client!r}, checks {checks}: unknown {unknown}")
    return [
        r
        for r in ROWS
        if r.client == client and re.fullmatch(case, r.case) and set(checks) <= r.checks
    ]


def parametrize(client: str, *checks: str, case: str = ".*"):
    """``pytest.mark.parametrize("row", ...)`` over ``select(client, checks, case)``,
    recording that a test runs each of those cells."""
    rows = select(client, checks, case)
    _ran.update((client, r.case, c) for r in rows for c in checks)
    return pytest.mark.parametrize("row", rows, ids=[r.case for r in rows])


def claimed(client: str) -> set[tuple[str, str]]:
    """Every ``(case, check)`` the rows of ``client`` claim."""
    return {(r.case, c) for r in ROWS if r.client == client for c in r.checks}


def unchecked(client: str) -> list[str]:
    """The claimed cells of ``client`` that no decorated test in this process runs."""
    ran = {(case, check) for c, case, check in _ran if c == client}
    return sorted(f"{case}: {check}" for case, check in claimed(client) - ran)


def declared(source: str) -> set[tuple[str, str, str]]:
    """``(client, case, check)`` cells that ``@conformance.parametrize(...)`` decorators
    in a test module's source select; their arguments must be literals."""
    cells = set()
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef):
            continue
        for deco in node.decorator_list:
            if not (
                isinstance(deco, ast.Call)
                and isinstance(deco.func, ast.Attribute)
                and deco.func.attr == "parametrize"
                and isinstance(deco.func.value, ast.Name)
                and deco.func.value.id == "conformance"
            ):
                continue
            client, *checks = (ast.literal_eval(a) for a in deco.args)
            kwargs = {k.arg: ast.literal_eval(k.value) for k in deco.keywords}
            for r in select(client, tuple(checks), **kwargs):
                cells.update((client, r.case, c) for c in checks)
    return cells


def render() -> str:
    """The table of docs/conformance.md, as markdown."""
    header = ["Client", "Model", *CHECKS.values()]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in ROWS:
        cells = ["✓" if c in r.checks else "—" for c in CHECKS]
        lines.append("| " + " | ".join([CLIENTS[r.client], r.model, *cells]) + " |")
    return "\n".join(lines) + "\n"
