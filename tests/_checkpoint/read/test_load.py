"""A load from start to end (``meshinit._checkpoint.read.load``): the policy of ``missing=`` and
``unused=`` decided before a byte is read, every problem raised at once, the read onto
the plan's shardings, typed keys wrapped, and nothing left alive when it fails."""

import jax
import numpy as np
import pytest
from helpers import mesh8, plan_of, stored
from jax.sharding import AbstractMesh, AxisType

import meshinit
from meshinit._checkpoint.read import load as loader

WHAT = "meshinit.safetensors.load"
SHAPES = {"a": ((8, 16), ("fsdp", "tensor")), "b": ((16,), ("tensor",))}


def load(plan, files, *, names=None, missing="error", unused="warn"):
    return loader.load(plan, files, names, missing, unused, WHAT, None, 1 << 30, False)


def tensors(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "a": rng.standard_normal((8, 16)).astype(np.float32),
        "b": np.arange(16.0, dtype=np.float32),
    }


def test_every_path_is_read_onto_its_planned_sharding(tmp_path):
    plan, want = plan_of(SHAPES), tensors()
    arrays = load(plan, stored(tmp_path, want))
    for e in plan.entries:
        assert arrays[e.path].sharding == e.sharding
        np.testing.assert_array_equal(np.asarray(arrays[e.path]), want[e.path])


def test_a_missing_tensor_fails_everything_before_a_read_or_is_skipped(tmp_path, new_arrays):
    files = stored(tmp_path, {"a": tensors()["a"]})
    with (
        new_arrays() as made,
        pytest.raises(meshinit.PlanError, match=f"{WHAT}: nothing was read") as e,
    ):
        load(plan_of(SHAPES), files)
    assert "b" in str(e.value) and made == []
    arrays = load(plan_of(SHAPES), files, missing="skip")
    assert sorted(arrays) == ["a"]


def test_unused_tensors_are_warned_refused_or_ignored_as_asked(tmp_path, new_arrays):
    files = stored(tmp_path, {**tensors(), "extra": np.zeros(3, np.float32)})
    plan = plan_of(SHAPES)
    with pytest.warns(meshinit.UnusedTensorWarning, match="extra"):
        assert sorted(load(plan, files)) == ["a", "b"]
    with new_arrays() as made, pytest.raises(meshinit.PlanError, match="extra"):
        load(plan, files, unused="error")
    assert made == []
    assert sorted(load(plan, files, unused="ignore")) == ["a", "b"]


def test_every_problem_is_raised_at_once(tmp_path):
    # a missing tensor and an unused one, in one PlanError
    files = stored(tmp_path, {"a": tensors()["a"], "extra": np.zeros(3, np.float32)})
    with pytest.raises(meshinit.PlanError) as e:
        load(plan_of(SHAPES), files, unused="error")
    assert len(e.value.problems) == 2, e.value.problems


def test_a_plan_on_an_abstract_mesh_is_refused_naming_each_path(tmp_path):
    abstract = AbstractMesh((2, 4), ("fsdp", "tensor"), axis_types=(AxisType.Auto,) * 2)
    with pytest.raises(meshinit.PlanError, match="AbstractMesh: load needs devices") as e:
        load(plan_of(SHAPES, mesh=abstract), stored(tmp_path, tensors()))
    assert sorted(p.path for p in e.value.problems) == ["a", "b"]


def test_a_typed_key_is_read_as_its_key_data_and_wrapped_on_its_planned_sharding(tmp_path):
    from flax import nnx

    class Holder(nnx.Module):
        def __init__(self):
            self.rngs = nnx.Rngs(params=jax.random.key(7))

    factory = Holder

    with jax.set_mesh(mesh8()):
        plan = meshinit.nnx.plan(factory)
    (entry,) = [e for e in plan.entries if jax.dtypes.issubdtype(e.spec.dtype, jax.dtypes.prng_key)]
    data = np.asarray(jax.random.key_data(jax.random.key(11)))
    arrays = load(plan, stored(tmp_path, {entry.path: data}), missing="skip", unused="error")
    key = arrays[entry.path]
    assert jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) and key.shape == ()
    assert key.sharding == entry.sharding
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(key)), data)


def test_the_processes_agree_while_the_first_bytes_are_fetched(tmp_path, monkeypatch, request):
    # a small load's agreement on what shapes the collectives waits for the slowest
    # process: the fetches (and the reshards' compiles) start before it, and only the
    # first collective waits for it
    pytest.importorskip("obstore")
    import threading

    from storage_servers import FileServer

    from meshinit._checkpoint.read import loop
    from meshinit._run import agree

    root = tmp_path / "served"
    root.mkdir()
    fetching = threading.Event()
    made = loop._made

    def fetch(*args, **kwargs):
        fetching.set()
        return made(*args, **kwargs)

    seen = []

    def checkpoint(what, at="", facts=None):
        if at == "inputs":  # as a slow peer would: the fetch goes on meanwhile
            seen.append(fetching.wait(timeout=10))

    monkeypatch.setattr(loop, "_made", fetch)
    monkeypatch.setattr(agree, "checkpoint", checkpoint)
    with FileServer(root) as server:
        server.put("m.safetensors", stored(tmp_path, tensors()).read_bytes())
        got = load(plan_of(SHAPES), server.url_for("m.safetensors"))
    assert seen == [True], "the inputs were agreed before any byte was fetched"
    np.testing.assert_array_equal(np.asarray(got["b"]), tensors()["b"])
