"""What every encoding shares: the protocol's defaults, and a decoding program compiled by
one thread at a time."""

import threading

from meshinit._checkpoint.encodings import base


def test_one_program_is_called_by_one_thread_at_a_time():
    program = object()
    lock = base.alone(program)
    assert base.alone(program) is lock and base.alone(object()) is not lock
    order = []

    def call(name):
        with base.alone(program):
            order.append(name)

    with lock:
        worker = threading.Thread(target=call, args=("worker",))
        worker.start()
        worker.join(0.2)
        assert worker.is_alive() and order == []  # waits for the first call
    worker.join()
    assert order == ["worker"]


def test_an_encoding_without_virtual_tensors_offers_and_claims_none():
    plain = base.Encoding(name="plain", pair=lambda jobs, stored, offered, config: (jobs, [], {}))
    assert plain.offer({"w": object()}) == base.Offered()
    assert plain.claimed([], {"w_scale_inv": object()}) == set()
