"""Agreement between processes, on one process: a collective call keeps what it made,
deletes it when the call fails, and nests into the outer call."""

import jax.numpy as jnp
import pytest

from meshinit._errors import PeerFailure
from meshinit._run import agree


def test_a_failing_call_deletes_what_it_kept_and_raises_its_own_error():
    a, b = jnp.ones(3), jnp.zeros(2)
    with pytest.raises(RuntimeError, match="boom"), agree.collective("test call"):
        agree.keep([a, b])
        raise RuntimeError("boom")
    assert a.is_deleted() and b.is_deleted()


def test_a_successful_call_keeps_its_arrays():
    a = jnp.ones(3)
    with agree.collective("test call"):
        agree.keep([a])
    assert not a.is_deleted()
    assert float(a.sum()) == 3.0


def test_an_inner_call_leaves_the_outcome_to_the_outer_one():
    a = jnp.ones(3)
    with pytest.raises(ValueError, match="later"), agree.collective("outer"):
        with agree.collective("inner"):
            agree.keep([a])
        assert not a.is_deleted(), "the inner call ended well: nothing deleted yet"
        raise ValueError("later")
    assert a.is_deleted(), "the outer call failed: the inner call's arrays go too"


def test_keep_outside_a_call_does_nothing():
    a = jnp.ones(3)
    agree.keep([a])
    assert not a.is_deleted()


def outcomes(monkeypatch, failing_at=None):
    """Stand-in for the gather: records each agreement's error; the one numbered
    ``failing_at`` learns that another process failed."""
    seen = []

    def gathered(what, error):
        seen.append(error)
        if len(seen) == failing_at and error is None:
            raise PeerFailure("process 1 failed: OSError: 503")

    monkeypatch.setattr(agree, "agree", gathered)
    return seen


def test_a_checkpoint_that_meets_a_failure_settles_the_call(monkeypatch):
    seen = outcomes(monkeypatch, failing_at=2)
    a = jnp.ones(3)
    with pytest.raises(PeerFailure, match="process 1 failed"), agree.collective("load"):
        agree.keep([a])
        agree.checkpoint("load")
        agree.checkpoint("load")  # another process failed before this one
    # every process has agreed twice: the call's own agreement at its end would wait
    # for a process that already agreed its last
    assert seen == [None, None] and a.is_deleted()


def test_a_call_with_checkpoints_agrees_at_its_end_too(monkeypatch):
    seen = outcomes(monkeypatch)
    with agree.collective("load"):
        agree.checkpoint("load")
    assert seen == [None, None]


def test_a_failure_between_checkpoints_is_agreed_once_at_the_end(monkeypatch):
    # the others meet it at their next checkpoint, which settles their call
    seen = outcomes(monkeypatch)
    with pytest.raises(OSError, match="503"), agree.collective("load"):
        agree.checkpoint("load")
        raise OSError("503")
    assert seen[0] is None and isinstance(seen[1], OSError) and len(seen) == 2
