"""URLs split as stores name objects, and ``storage_options=`` checked before any
request."""

import pytest

from meshinit._checkpoint.store import clients


@pytest.mark.parametrize(
    ("url", "want"),
    [
        ("s3://bucket/a/b.safetensors", ("s3", "bucket", "a/b.safetensors")),
        ("GS://bucket/dir with space/x?y", ("gs", "bucket", "dir with space/x?y")),
        ("hf://org/model@v1/sub", ("hf", "org", "model@v1/sub")),
    ],
)
def test_a_key_keeps_every_character(url, want):
    assert clients.split(url) == want


def test_an_unknown_option_is_named_with_the_known_ones_before_any_request():
    pytest.importorskip("obstore")
    assert clients.problems("s3", {"region": "us-east-1"}) == []
    (wrong,) = clients.problems("s3", {"regoin": "us-east-1"})
    assert "regoin" in wrong and "region" in wrong
