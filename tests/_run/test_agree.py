"""Agreement between processes, on one process: a collective call keeps what it made,
deletes it when the call fails, and nests into the outer call."""

import jax.numpy as jnp
import pytest

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
