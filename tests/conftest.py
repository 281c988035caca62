"""8 simulated CPU devices, set once for the whole suite, before any backend starts."""

import jax

jax.config.update("jax_num_cpu_devices", 8)

import contextlib  # noqa: E402

import pytest  # noqa: E402

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
