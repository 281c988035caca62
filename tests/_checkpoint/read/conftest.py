"""What the read flow's tests share: a single process made to look like two to fan-out."""

import pytest

from meshinit._checkpoint.read import staging


@pytest.fixture
def fsdp_spans_processes(monkeypatch):
    """Every block counts as held by two processes, and fsdp as the axis between them."""
    monkeypatch.setattr(staging, "shared", lambda entry: True)
    monkeypatch.setattr(staging, "spanning", lambda mesh: ("fsdp",))
    monkeypatch.setattr(staging, "processes", lambda: 2)
