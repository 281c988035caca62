"""8 simulated CPU devices, set once for the whole suite, before any backend starts;
and the test tiers (``MESHINIT_TESTS``, see :data:`helpers.TIER`)."""

import jax

jax.config.update("jax_num_cpu_devices", 8)

import contextlib  # noqa: E402
import os  # noqa: E402
import pathlib  # noqa: E402
import signal  # noqa: E402
import weakref  # noqa: E402

import pytest  # noqa: E402
from helpers import FUZZ_PART, SLOW_PART, STACK_NEUTRAL, TIER, TIERS, slow_part  # noqa: E402

_compiles: list[str] = []


def _on_duration(event: str, duration: float, **kwargs) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _compiles.append(event)


jax.monitoring.register_event_duration_secs_listener(_on_duration)


class CompileCount:
    """How many XLA backend compilations ran inside one ``with`` block."""

    count = 0


@contextlib.contextmanager
def _count_compiles():
    counted = CompileCount()
    start = len(_compiles)
    try:
        yield counted
    finally:
        counted.count = len(_compiles) - start


@pytest.fixture
def count_compiles():
    """``with count_compiles() as c: ...`` then ``c.count``; each block counts apart."""
    return _count_compiles


class NewArrays(list):
    """The jax arrays created inside one ``with`` block and still alive at its end."""


@contextlib.contextmanager
def _new_arrays():
    # Each array alive before, by a weak reference: one that earlier tests left to the
    # cycle collector and that is freed inside the block cannot hide a new array given
    # its id. (A gc.collect() here instead took about 1 s a test late in the suite.)
    before = {id(a): weakref.ref(a) for a in jax.live_arrays()}
    made = NewArrays()
    try:
        yield made
    finally:
        made.extend(a for a in jax.live_arrays() if _new(a, before))


def _new(array, before) -> bool:
    ref = before.get(id(array))
    return ref is None or ref() is not array


@pytest.fixture
def ctrl_c():
    """``ctrl_c()`` sends this process SIGINT, which raises KeyboardInterrupt as at a
    terminal, however pytest was started: a shell starts a background job (``cmd &``)
    with SIGINT ignored, and Python then leaves it ignored. The test's handler is
    Python's default until it ends."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield lambda: os.kill(os.getpid(), signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, before)


@pytest.fixture
def new_arrays():
    """``with new_arrays() as made: ...`` then ``made`` lists arrays the block allocated."""
    return _new_arrays


@pytest.fixture
def fail_group():
    """``made = fail_group(plan, error)``: the call's strategy raises ``error("injected
    fault")`` when it reaches ``plan.groups[1]``, while generating (default) or, with
    ``when="compile"``, while preparing it; ``made`` lists every array it made before.
    The failing strategy is set with ``meshinit.options`` until the test ends."""
    import meshinit
    from meshinit._run import strategies as _strategies

    with contextlib.ExitStack() as stack:

        def inject(plan, error, *, when="generate"):
            real = _strategies.chosen()
            target = plan.groups[1].mesh
            made = []

            class FailsInSecondGroup:
                builds, work = real.builds, real.work

                def prepare(self, group, impl):
                    if when == "compile" and group.mesh is target:
                        raise error("injected fault")
                    run = real.prepare(group, impl)

                    def wrapped(*args):
                        if group.mesh is target:
                            raise error("injected fault")
                        for pos, array in run(*args):
                            made.append(array)
                            yield pos, array

                    return wrapped

            stack.enter_context(meshinit.options(strategy=FailsInSecondGroup()))
            return made

        yield inject


def pytest_configure(config):
    if TIER not in TIERS:
        raise pytest.UsageError(
            f"MESHINIT_TESTS={TIER!r} is not a test tier; use one of {', '.join(TIERS)} "
            f"(unset means fast)"
        )


def pytest_report_header(config):
    k, n = FUZZ_PART
    part = f"; the engine fuzzer draws part {k} of {n} (MESHINIT_FUZZ_PART)" if n > 1 else ""
    if TIER == "all":
        k, n = SLOW_PART
        if n > 1:
            part += (
                f"; the slow tests of {len(STACK_NEUTRAL)} stack-neutral modules "
                f"(helpers.STACK_NEUTRAL): part {k} of {n} (MESHINIT_SLOW_PART)"
            )
        return f"meshinit tests: all tiers (MESHINIT_TESTS=all){part}"
    return (
        "meshinit tests: the fast tier; tests marked slow are deselected and the fuzzers "
        f"run small (MESHINIT_TESTS=all runs everything, as CI does){part}"
    )


def _named(config) -> bool:
    """Whether the command line chose tests itself: a marker expression, or a module or
    test named (a folder, such as ``tests``, chooses nothing)."""
    if config.option.markexpr:
        return True
    return any(
        not pathlib.Path(arg.split("::")[0]).is_dir() for arg in config.option.file_or_dir or []
    )


def pytest_collection_modifyitems(config, items):
    # The fast tier is the default run of the whole suite; a run that names what it wants
    # (`-m slow`, tests/guarantees/test_multihost.py) gets exactly that.
    if _named(config):
        return
    if TIER == "all":
        k, n = SLOW_PART
        if n > 1:  # CI's stacks: each stack-neutral slow test on one of them
            other = [
                item
                for item in items
                if item.get_closest_marker("slow")
                and item.nodeid.split("::")[0] in STACK_NEUTRAL
                and slow_part(item.nodeid, n) != k
            ]
            if other:
                config.hook.pytest_deselected(items=other)
                gone = set(other)
                items[:] = [item for item in items if item not in gone]
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow")]
