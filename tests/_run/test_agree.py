"""Agreement between processes, on one process: a collective call keeps what it made,
deletes it when the call fails, and nests into the outer call; and the protocol over
the coordination service's key-value store, with the other processes' posts written
into an in-memory store by the test (the 4-process runs are in
``tests/guarantees/test_fanout.py`` and ``test_processes.py``)."""

import json
import signal

import jax
import jax.numpy as jnp
import pytest

from meshinit._errors import PeerFailure, PlanError
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


class Store:
    """The coordination service's key-value store, as jax's client speaks to it."""

    def __init__(self):
        self.data: dict[str, str] = {}
        self.deleted: list[str] = []

    def key_value_set(self, key, value, allow_overwrite=False):
        assert allow_overwrite or key not in self.data, key
        self.data[key] = value

    def key_value_dir_get(self, prefix):
        return [(k, v) for k, v in self.data.items() if k.startswith(prefix)]

    def key_value_delete(self, key):
        self.deleted.append(key)
        self.data.pop(key, None)


@pytest.fixture
def store(monkeypatch):
    """This process as process 0 of 2, with a fresh store and no broken collectives."""
    found = Store()
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "process_index", lambda: 0)
    monkeypatch.setattr(agree._compat, "distributed_client", lambda: found)
    monkeypatch.setattr(agree, "_broken", [])
    monkeypatch.setattr(agree, "_stale", [])
    return found


def peer(store, call, k, at, facts=None, process=1):
    """Process ``process``'s post at agreement ``k`` of the call numbered ``call``."""
    post = json.dumps({"at": at, "facts": facts or {}})
    store.data[f"{agree.PREFIX}/{call}/{k}/{process}"] = post


def peer_failed(store, call, error, left=False, process=1):
    post = json.dumps({"error": error, "peer": False, "left": left})
    store.data[f"{agree.PREFIX}/{call}/failed/{process}"] = post


def number():
    """The number the next collective call gets (every process counts alike)."""
    n = next(agree._numbers)
    agree._numbers = iter(range(n + 1, 1 << 62))  # type: ignore[assignment]
    return n + 1


def test_an_agreement_waits_for_the_same_point_on_every_process(store):
    n = number()
    peer(store, n, 0, "load: inputs", {"fan_out": "True"})
    peer(store, n, 1, "load: end")
    with agree.collective("load"):
        agree.checkpoint("load", "inputs", {"fan_out": "True"})
    mine = json.loads(store.data[f"{agree.PREFIX}/{n}/0/0"])
    assert mine == {"at": "load: inputs", "facts": {"fan_out": "True"}}
    # the next call's first agreement lets this process's keys of this one go
    peer(store, n + 1, 0, "load: end")
    with agree.collective("load"):
        pass
    assert f"{agree.PREFIX}/{n}/0/0" in store.deleted and f"{agree.PREFIX}/{n}/1/0" in store.deleted


def test_a_fact_that_differs_is_a_plan_error_naming_every_process_value(store):
    n = number()
    peer(store, n, 0, "load: inputs", {"fan_out": "False", "max_inflight_bytes": "1048576"})
    a = jnp.ones(3)
    with pytest.raises(PlanError, match="disagree") as info, agree.collective("load"):
        agree.keep([a])
        agree.checkpoint("load", "inputs", {"fan_out": "True", "max_inflight_bytes": "1073741824"})
    text = str(info.value)
    assert "fan_out: differs between the processes: process 0: True, process 1: False" in text
    assert "process 0: 1073741824, process 1: 1048576" in text
    assert a.is_deleted()
    # and this process posted its failure: a peer still waiting somewhere learns of it
    failed = json.loads(store.data[f"{agree.PREFIX}/{n}/failed/0"])
    assert failed["error"].startswith("PlanError") and failed["left"] is False


def test_a_peer_that_refused_the_facts_between_two_reads_gives_the_plan_error(store):
    # The interleaving CI met with 4 processes: this process reads the posts before the
    # peer's, the peer then posts its facts, compares, fails with the PlanError, and
    # posts that failure, which this process reads next. Every post is in by then, so
    # this process raises the same PlanError, not a PeerFailure quoting it.
    n = number()
    first = f"{agree.PREFIX}/{n}/0/"
    read = store.key_value_dir_get
    late: list[str] = []

    def arrives_after_the_first_read(prefix):
        found = read(prefix)
        if prefix == first and not late:
            late.append(prefix)
            peer(store, n, 0, "load: inputs", {"max_inflight_bytes": "1048576"})
            peer_failed(store, n, "PlanError: load: the processes disagree on ...")
        return found

    store.key_value_dir_get = arrives_after_the_first_read
    with pytest.raises(PlanError, match="process 0: 1073741824, process 1: 1048576"):
        with agree.collective("load"):
            agree.checkpoint("load", "inputs", {"max_inflight_bytes": "1073741824"})
    assert late, "the peer's post came after this process's first read"


def test_processes_at_different_agreements_are_refused(store):
    n = number()
    peer(store, n, 0, "load: batch 3 (2 items, sha256 ab)")
    with pytest.raises(PlanError, match="process 1 at 'load: batch 3"), agree.collective("load"):
        agree.checkpoint("load", "inputs")


def test_a_peer_failure_is_raised_at_the_next_agreement_naming_the_process(store):
    n = number()
    peer_failed(store, n, "TypeError: fan_out must be None, True or False, got 'yes'")
    a = jnp.ones(3)
    with pytest.raises(PeerFailure, match="process 1 failed: TypeError: fan_out") as info:
        with agree.collective("load"):
            agree.keep([a])
            agree.checkpoint("load", "inputs")
    assert "process 0" in str(info.value) and a.is_deleted()


def test_a_failure_is_posted_at_once_and_the_call_agrees_no_further(store):
    n = number()
    with pytest.raises(OSError, match="503"), agree.collective("load"):
        raise OSError("503 Service Unavailable")
    assert set(store.data) == {f"{agree.PREFIX}/{n}/failed/0"}
    post = json.loads(store.data[f"{agree.PREFIX}/{n}/failed/0"])
    assert post == {"error": "OSError: 503 Service Unavailable", "peer": False, "left": False}


def test_a_collective_whose_peer_left_it_raises_and_breaks_every_later_call(store):
    n = number()

    class Pending:  # a collective's output that a peer never joins
        def is_ready(self):
            return False

    peer_failed(store, n, "RuntimeError: could not start the reshard", left=True)
    with pytest.raises(PeerFailure, match="lost a peer inside a collective at batch 0"):
        with agree.collective("load"):
            agree.settle(Pending(), "batch 0")  # type: ignore[arg-type]
    assert "RuntimeError: could not start the reshard" in agree.broken()
    assert f"{agree.PREFIX}/broken/0" in store.data
    # every later call, on this process and (through the store) on the others, raises
    with pytest.raises(PeerFailure, match="restart the job"), agree.collective("init"):
        pass


def test_a_broken_mark_of_another_process_stops_the_next_call(store):
    n = number()
    store.data[f"{agree.PREFIX}/broken/1"] = "RuntimeError: gone"
    peer(store, n, 0, "init: end")
    with pytest.raises(PeerFailure, match="process 1: RuntimeError: gone"):
        with agree.collective("init"):
            pass


def test_ctrl_c_inside_a_batch_is_delivered_when_it_ends(ctrl_c):
    ran = []
    with pytest.raises(KeyboardInterrupt):
        with agree.uninterrupted():
            ctrl_c()
            ran.append("after the signal")  # the batch runs on, whole
    assert ran == ["after the signal"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
