"""The loader's event loop: a deadline per request, and nothing left running once the
last session ends."""

import asyncio
import threading

import pytest

from meshinit._checkpoint.store import aio


def _loops():
    return [t for t in threading.enumerate() if t.name == "meshinit-io"]


def test_a_request_past_its_deadline_is_cancelled_and_named():
    async def slow():
        await asyncio.sleep(10)

    with aio.session(0.05), pytest.raises(aio.TimedOut):
        aio.run(slow)
    assert aio.deadline() == aio.TIMEOUT


def test_requests_run_on_one_loop_that_ends_with_its_session():
    async def name():
        return threading.current_thread().name

    with aio.session(None):
        assert aio.deadline() is None
        assert aio.run(name) == "meshinit-io"
        assert len(_loops()) == 1
    assert _loops() == []
