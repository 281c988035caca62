"""One process of the two-process test in ``test_multihost.py``; not collected by pytest.

Run: python tests/multihost_worker.py PROCESS_ID PORT REFERENCE_NPZ

Each process joins ``jax.distributed`` on 127.0.0.1 with 4 CPU devices, plans and
materializes the same tree on four meshes (two spanning both processes, one per
process), and checks every addressable shard against single-process values from
``REFERENCE_NPZ``. It prints one ``RESULT {json}`` line, and exits 0 only if every
check passed. Its loads that count each process's bytes read pass ``fan_out=False``:
each process reads the blocks its own devices hold (fan-out, where the processes
share the reading, is tests/guarantees/test_fanout.py's).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator, Mapping
from typing import Any

import helpers
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

import meshinit

NUM_PROCESSES = 2
LOCAL_DEVICES = 4
AXES = ("fsdp", "tensor")
# The first materialize takes an int seed, the second a typed key of the next seed.
SEEDS = (0, 1)
MESH_NAMES = ("global_auto", "global_explicit", "stage0", "stage1")


def layout(mesh: Any) -> dict[str, meshinit.ParamSpec]:
    """The parameters declared on one mesh with axes ``("fsdp", "tensor")``."""
    lecun = jax.nn.initializers.lecun_normal
    return {
        "w": meshinit.param((16, 32), lecun(), axes=("fsdp", "tensor"), mesh=mesh),
        "embed": meshinit.param(
            (64, 8), jax.nn.initializers.normal(0.02), axes=("tensor", None), mesh=mesh
        ),
        "bias": meshinit.param((32,), jax.nn.initializers.zeros, axes=("tensor",), mesh=mesh),
        "scale": meshinit.param((8,), jax.nn.initializers.ones, mesh=mesh),  # replicated
        "u": meshinit.param(
            (8, 16),
            jax.nn.initializers.uniform(),
            axes=(None, "fsdp"),
            mesh=mesh,
            dtype=jnp.bfloat16,
        ),
        "layers": meshinit.stacked(
            3, meshinit.param((16, 16), lecun(), axes=("tensor", "fsdp"), mesh=mesh), axis=None
        ),
    }


def specs(meshes: Mapping[str, Any]) -> dict[str, dict[str, meshinit.ParamSpec]]:
    """The whole tree: ``layout`` on each named mesh, so paths read ``stage1.w``."""
    return {name: layout(meshes[name]) for name in MESH_NAMES}


def meshes() -> dict[str, Mesh]:
    """Two meshes over all 8 devices (Auto and Explicit) and one per process."""
    devices = jax.devices()
    own = [[d for d in devices if d.process_index == p] for p in range(NUM_PROCESSES)]
    return {
        "global_auto": Mesh(np.array(devices).reshape(2, 4), AXES),
        "global_explicit": jax.make_mesh((2, 4), AXES, devices=devices),
        "stage0": jax.make_mesh((2, 2), AXES, devices=own[0]),  # Explicit
        "stage1": Mesh(np.array(own[1]).reshape(2, 2), AXES),  # Auto
    }


def nnx_model() -> Any:
    """Ordinary nnx code (flax metadata, no specs) for ``meshinit.nnx.init``'s check."""
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.up = nnx.Linear(16, 32, rngs=rngs, kernel_metadata={"out_sharding": AXES})
            self.scale = nnx.Param(jnp.ones((32,)))  # no metadata: replicated

    class Model(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.embed = nnx.Embed(64, 16, rngs=rngs)
            self.layers = nnx.List([Block(rngs) for _ in range(3)])

    return Model


# Where each Variable goes: spanning both processes, and on each process's own stage.
NNX_MESHES = (("embed\\..*", "global_explicit"), ("layers\\.0\\..*", "stage0"), (".*", "stage1"))


def check_nnx(named: Mapping[str, Mesh], reference: Any) -> tuple[list[str], dict]:
    """``meshinit.nnx.init`` under jax.distributed: every addressable shard against the
    single-process eager values, and a digest of the host part of the trace."""
    import hashlib

    from flax import nnx

    from meshinit._adapters import nnx as nnx_prepare

    model = nnx_model()
    meshes = [(p, named[n]) for p, n in NNX_MESHES]
    factory = lambda: model(nnx.Rngs(3))  # noqa: E731
    out = meshinit.nnx.init(factory, meshes=meshes)
    traced = nnx_prepare.prepare(factory, meshes, None, what="meshinit.nnx.init").traced
    traced = meshinit._engine.trace.evaluate_host_part(traced, traced.program.outputs)
    digest = hashlib.blake2b(digest_size=8)
    for n in sorted(traced.host):
        v = traced.host[n]
        digest.update(np.asarray(getattr(v, "data", v)).tobytes())
    failures, shards = [], 0
    for path, var in nnx.to_flat_state(nnx.state(out)):
        name = ".".join(map(str, path))
        a = var.get_value()
        want = reference[f"nnx-{name}"]
        for s in a.addressable_shards:
            if not np.array_equal(np.asarray(s.data), want[s.index]):
                failures.append(f"process {jax.process_index()}, nnx {name}: shard {s.index}")
            shards += 1
    return failures, {"nnx_shards": shards, "nnx_host_digest": digest.hexdigest()}


# Tensors of the safetensors check, as a Hugging Face file stores them: ``w`` as
# torch's (out, in), ``embed`` flat. Other paths are not in the file.
ST_TENSORS = {
    "global_auto.w": ("w.global_auto", None, (1, 0)),
    "stage0.w": ("w.stage0", None, (1, 0)),
    "stage1.w": ("w.stage1", None, (1, 0)),
    "global_explicit.embed": ("embed", (64, 8), None),
}


def as_stored(path: str, value: np.ndarray) -> np.ndarray:
    """``value`` of plan path ``path`` as the file stores it."""
    _, shape, permute = ST_TENSORS[path]
    return np.ascontiguousarray(value.T if permute else value.reshape(-1))


def names(path: str) -> Any:
    """The stored tensor of a plan path (``names=`` of the loads below)."""
    from meshinit import safetensors as st

    if path not in ST_TENSORS:
        return None
    name, shape, permute = ST_TENSORS[path]
    return st.Tensor(name, shape=shape, permute=permute)


def check_safetensors(plan: meshinit.Plan, reference: Any, file: str) -> tuple[list[str], dict]:
    """``meshinit.safetensors.load`` under jax.distributed: every addressable shard
    against the single-process values, and the elements read against those owned."""
    from meshinit import safetensors as st
    from meshinit._checkpoint.layout import host as _read

    read: list[int] = []
    reader = _read.parts

    def counting(*args: Any) -> Any:  # counts what each shard's read returns
        source = reader(*args)
        block = source.block

        def counted(index: Any) -> Any:
            out = block(index)
            read.append(out.size)
            return out

        source.block = counted
        return source

    _read.parts = counting
    try:
        loaded = st.load(plan, file, names=names, fan_out=False)  # each its own blocks
    finally:
        _read.parts = reader
    failures, shards, owned = [], 0, 0
    for path, array in loaded.items():
        want = np.asarray(reference[f"single-0-{path}"])
        blocks = set()  # a block several local devices hold is read once
        for s in array.addressable_shards:
            if not np.array_equal(np.asarray(s.data, np.float32), want[s.index]):
                failures.append(f"process {jax.process_index()}, safetensors {path}: {s.index}")
            shards += 1
            block = tuple((i.start, i.stop) for i in s.index)
            owned += 0 if block in blocks else s.data.size
            blocks.add(block)
    for array in loaded.values():
        array.delete()
    # The three stored w's as the layers of one scanned parameter on the global mesh:
    # each process reads its own rows of every layer, as the loader reports it.
    stack_failures, stacked = check_stacked(plan, reference, file)
    failures += stack_failures
    # Each host's own copy of the weights, process 1's cut short (a download it lost):
    # process 1 refuses its file, and process 0 must not return arrays without
    # process 1's shards: it fails too.
    me = jax.process_index()
    with open(file, "rb") as f:
        blob = f.read()
    copy = os.path.join(os.path.dirname(file), f"weights-{me}.safetensors")
    with open(copy, "wb") as f:
        f.write(blob if me == 0 else blob[:-4])
    try:
        st.load(plan, copy, names=names, fan_out=False)
        corrupt = "returned"
    except (meshinit.PlanError, meshinit.PeerFailure) as e:
        corrupt = type(e).__name__
    found = {"shards": shards, "read": sum(read), "owned": owned, "corrupt": corrupt}
    return failures, found | stacked


def check_remote(plan: meshinit.Plan, reference: Any, url: str) -> tuple[list[str], dict]:
    """The same load from S3 (issue 43): every addressable shard against the
    single-process values, and the bytes this process reports it fetched against the
    bytes of its own distinct blocks."""
    from meshinit import safetensors as st

    with bytes_reported() as reported:  # until its own loads are done
        return _check_remote(st, plan, reference, url, reported)


def _check_remote(st: Any, plan: Any, reference: Any, url: str, reported: list[float]) -> Any:
    loaded = st.load(plan, url, names=names, fan_out=False)
    failures, owned, blocks = [], 0, set()
    for path, array in loaded.items():
        want = np.asarray(reference[f"single-0-{path}"])
        for s in array.addressable_shards:
            if not np.array_equal(np.asarray(s.data, np.float32), want[s.index]):
                failures.append(f"process {jax.process_index()}, remote {path}: {s.index}")
            block = (path, tuple((i.start, i.stop) for i in s.index))
            owned += 0 if block in blocks else s.data.nbytes
            blocks.add(block)
        array.delete()
    # process 1 is given an object that is not there: it fails, and so does process 0
    me = jax.process_index()
    try:
        st.load(
            plan, url if me == 0 else url.replace("weights", "absent"), names=names, fan_out=False
        )
        absent = "returned"
    except (meshinit.PlanError, meshinit.PeerFailure) as e:
        absent = type(e).__name__
    return failures, {"fetched": reported, "owned": owned, "absent": absent}


@contextlib.contextmanager
def bytes_reported() -> Iterator[list[float]]:
    """The bytes each load inside reports it read (``BYTES_READ``), in order."""
    from meshinit._checkpoint.read import loop as _read

    reported: list[float] = []

    def on(event: str, value: float, **kwargs: Any) -> None:
        if event == _read.BYTES_READ:
            reported.append(value)

    jax.monitoring.register_scalar_listener(on)
    try:
        yield reported
    finally:
        jax.monitoring.unregister_scalar_listener(on)


# Issue 48: blocks jax's CPU client may use in place (whole rows, a whole tensor) at
# 64-byte-aligned offsets of the object, on a 1-D mesh over both processes' devices.
REMOTE_LAYOUTS = {
    "rows": ((1024, 256), ("d", None)),  # 128 whole rows (128 KiB) a device
    "replicated": ((256, 256), (None, None)),  # 256 KiB on every device
}


def check_remote_layouts(url: str, reference: Any, local: str) -> tuple[list[str], dict]:
    """``REMOTE_LAYOUTS`` from S3: every addressable shard against the single-process
    values and the local load of the same file (``local``), bit for bit; the bytes this
    process reports it fetched against those of its own distinct blocks. Shards that
    differ are reported (``wrong``), not failed, so that the test names them."""
    from meshinit import safetensors as st

    mesh = Mesh(np.array(jax.devices()), ("d",))
    zeros = jax.nn.initializers.zeros
    plan = meshinit.plan(
        {
            name: meshinit.param(shape, zeros, axes=axes, mesh=mesh)
            for name, (shape, axes) in REMOTE_LAYOUTS.items()
        }
    )
    with bytes_reported() as reported:
        loaded = st.load(plan, url, fan_out=False)
    here = st.load(plan, local)
    me = jax.process_index()
    failures, wrong, owned, blocks = [], [], 0, set()
    shards = dict.fromkeys(REMOTE_LAYOUTS, 0)
    for entry in plan.entries:
        array = loaded[entry.path]
        if array.sharding != entry.sharding:
            failures.append(f"process {me}, remote {entry.path}: on {array.sharding}")
        want = np.asarray(reference[f"layouts-{entry.path}"])
        local_shards = {s.device: np.asarray(s.data) for s in here[entry.path].addressable_shards}
        for s in array.addressable_shards:
            got, expected = np.asarray(s.data), want[s.index]
            if (
                got.tobytes() != expected.tobytes()
                or got.tobytes() != local_shards[s.device].tobytes()
            ):
                bad = got != expected
                rows = f"{s.index[0].start or 0}:{s.index[0].stop or want.shape[0]}"
                wrong.append(
                    f"process {me}, {entry.path}[{rows}, :] on device {s.device.id}: "
                    f"{int(bad.sum())} of {bad.size} elements differ from the single-process "
                    f"values ({int((got[bad] == 0).sum())} of them 0.0)"
                )
            shards[entry.path] += 1
            block = (entry.path, tuple((i.start, i.stop) for i in s.index))
            owned += 0 if block in blocks else s.data.nbytes
            blocks.add(block)
    for array in [*loaded.values(), *here.values()]:
        array.delete()
    found = {"fetched": reported, "owned": owned, "shards": shards, "wrong": wrong}
    return failures, found


STACKED = ("global_auto", "stage0", "stage1")  # the stored w's, as layers (issue 41)


def check_stacked(plan: meshinit.Plan, reference: Any, file: str) -> tuple[list[str], dict]:
    """A ``Stack`` of stored tensors onto a mesh over both processes: every addressable
    shard against numpy's stack of the single-process values, and the bytes this
    process reports it read against the bytes of its own distinct blocks."""
    from meshinit import safetensors as st

    mesh = next(e.sharding.mesh for e in plan.entries if e.path == "global_auto.w")
    shape = (16, len(STACKED), 32)
    zeros = jax.nn.initializers.zeros
    spec = meshinit.param(shape, zeros, axes=("fsdp", None, "tensor"), mesh=mesh)
    stacked = meshinit.plan({"stack": spec})
    parts = [st.Tensor(f"w.{m}", permute=(1, 0)) for m in STACKED]
    with bytes_reported() as reported:
        loaded = st.load(stacked, file, names={"stack": st.Stack(parts, axis=1)}, unused="ignore")
    want = np.stack([np.asarray(reference[f"single-0-{m}.w"]) for m in STACKED], axis=1)
    failures, blocks, owned = [], set(), 0
    for s in loaded["stack"].addressable_shards:
        if not np.array_equal(np.asarray(s.data, np.float32), want[s.index]):
            failures.append(f"process {jax.process_index()}, stacked: shard {s.index}")
        block = tuple((i.start, i.stop) for i in s.index)
        owned += 0 if block in blocks else s.data.size * 4  # stored as f32
        blocks.add(block)
    loaded["stack"].delete()
    return failures, {"stack_read": reported, "stack_owned": owned}


def check(
    plan: meshinit.Plan, tree: Any, seed: int, reference: Any, named: Mapping[str, Mesh]
) -> tuple[list[str], dict]:
    """Compares every addressable shard with the single-process values.

    Returns:
      The failures, and counts of what was checked: shards per mesh, and arrays
      with no addressable shard here.
    """
    me = jax.process_index()
    names = {m: n for n, m in named.items()}
    leaves = jax.tree_util.tree_leaves(tree)
    failures: list[str] = []
    shards_checked = dict.fromkeys(MESH_NAMES, 0)
    remote = 0
    for e in plan.entries:
        a = leaves[e.leaf_index]
        where = f"process {me}, seed {seed}, {e.path}"
        if not isinstance(a, jax.Array):
            failures.append(f"{where}: got {type(a).__name__}, not a jax.Array")
            continue
        if a.sharding != e.sharding:
            failures.append(f"{where}: sharding {a.sharding} != planned {e.sharding}")
        if a.shape != e.spec.shape or a.dtype != e.spec.dtype:
            failures.append(f"{where}: {a.dtype}{a.shape} != planned {e.spec.dtype}{e.spec.shape}")
        local = {d for d in e.sharding.mesh.devices.flat if d.process_index == me}
        shards = a.addressable_shards
        if {s.device for s in shards} != local or len(shards) != len(local):
            failures.append(
                f"{where}: shards on devices {sorted(s.device.id for s in shards)}, "
                f"expected one on each of {sorted(d.id for d in local)}"
            )
        if not local:
            remote += 1
            if a.is_fully_addressable:
                failures.append(f"{where}: no local device, but is_fully_addressable")
            a.block_until_ready()  # must not raise for an array with no local shard
            jax.block_until_ready(a)
        single = reference[f"single-{seed}-{e.path}"]
        jitted = reference[f"reference-{seed}-{e.path}"]
        for s in shards:
            got = np.asarray(s.data).astype(np.float32)
            if got.shape != e.shard_shape or not np.array_equal(got, single[s.index]):
                diff = np.max(np.abs(got - single[s.index])) if got.shape == e.shard_shape else "-"
                failures.append(
                    f"{where}: shard {s.index} on device {s.device.id} differs from the "
                    f"single-process meshinit value (shape {got.shape}, max abs diff {diff})"
                )
                continue
            if not np.array_equal(got, jitted[s.index]):
                off = int((got != jitted[s.index]).sum())
                failures.append(
                    f"{where}: shard {s.index}: {off} elements differ from jax.jit of "
                    f"init(param_key(key, path)) on the planned sharding"
                )
                continue
            shards_checked[names[e.sharding.mesh]] += 1
    return failures, {"shards": shards_checked, "remote_arrays": remote}


def check_prepare_failures(named: Mapping[str, Mesh]) -> tuple[list[str], dict]:
    """A factory (a linen module, a ``tx.init``) that raises on process 1 only, while
    it is traced, before anything is made: process 1 raises its own error, process 0
    a ``PeerFailure`` naming it, within seconds (not the collectives' timeout), with
    no array kept, for each adapter's init."""
    import equinox as eqx
    import flax.linen as nn
    import optax
    from flax import nnx

    import meshinit.eqx
    import meshinit.linen
    import meshinit.nnx
    import meshinit.optax

    def fail(adapter: str) -> None:
        if jax.process_index() == 1:
            raise RuntimeError(f"injected {adapter} factory failure on process 1")

    class Linen(nn.Module):
        @nn.compact
        def __call__(self, x: Any) -> Any:
            fail("linen")
            return nn.Dense(8)(x)

    everywhere = named["global_auto"]
    model = nnx_model()
    meshes = [(p, named[n]) for p, n in NNX_MESHES]
    params = meshinit.init(
        {"w": meshinit.param((8, 16), jax.nn.initializers.ones, mesh=everywhere)}, 0
    )
    adam = optax.adam(1e-3)
    calls = {
        "nnx": lambda: meshinit.nnx.init(
            lambda: (fail("nnx"), model(nnx.Rngs(3)))[1], meshes=meshes
        ),
        "eqx": lambda: meshinit.eqx.init(
            lambda k: (fail("eqx"), eqx.nn.Linear(16, 32, key=k))[1],
            0,
            [(r".*", None)],
            mesh=everywhere,
        ),
        "linen": lambda: meshinit.linen.init(
            Linen(), 0, np.ones((1, 16), np.float32), mesh=everywhere, default="replicated"
        ),
        "optax": lambda: meshinit.optax.init(
            optax.GradientTransformation(lambda p: (fail("optax"), adam.init(p))[1], adam.update),
            params,
        ),
    }
    outcomes: dict[str, Any] = {}
    for adapter, call in calls.items():
        before = len(jax.live_arrays())
        start = time.monotonic()
        try:
            call()
            outcome = "returned"
        except meshinit.PeerFailure as e:
            outcome = "PeerFailure: " + str(e)
        except Exception as e:
            outcome = f"{type(e).__name__}: {str(e).splitlines()[0]}"
        outcomes[adapter] = {
            "outcome": outcome[:400],
            "seconds": time.monotonic() - start,
            "leaked": len(jax.live_arrays()) - before,
        }
    # each process seeds its own constructor: every replica would differ; both refuse
    me = jax.process_index()
    seeded = {
        "nnx seed": lambda: meshinit.nnx.init(lambda: model(nnx.Rngs(3 + me)), meshes=meshes),
        "eqx seed": lambda: meshinit.eqx.init(
            lambda k: eqx.nn.Linear(16, 32, key=k), me, [(r".*", None)], mesh=everywhere
        ),
    }
    for name, call in seeded.items():
        before = len(jax.live_arrays())
        try:
            jax.tree_util.tree_map(lambda a: a.delete(), jax.tree_util.tree_leaves(call()))
            outcome = "returned"
        except Exception as e:
            outcome = f"{type(e).__name__}: {e}"
        outcomes[name] = {"outcome": outcome[:800], "leaked": len(jax.live_arrays()) - before}
    for a in jax.tree_util.tree_leaves(params):
        a.delete()
    return [], outcomes


def check_agreement(process_id: int, plan: Any) -> tuple[list[str], dict]:
    """Process 1 fails two materialize calls, each in its own way; both processes must
    raise, process 0 naming process 1, within a bounded time, keeping no array. Then
    one more call must succeed on both (the processes still agree on the call count)."""
    from meshinit._run import checks as _checks
    from meshinit._run import strategies as _strategies

    failures: list[str] = []
    outcomes: dict[str, Any] = {}
    real_stats, real_call = _checks.memory_stats, _strategies.call

    def no_memory(device: Any) -> dict[str, int]:
        return {"bytes_limit": 1024, "bytes_in_use": 0}  # a local memory check fails

    def out_of_memory(*args: Any) -> Any:
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory (injected)")

    for case, patch in (
        ("memory_check", (_checks, "memory_stats", no_memory)),
        ("oom", (_strategies, "call", out_of_memory)),
    ):
        if process_id == 1:
            setattr(*patch)
        before = len(jax.live_arrays())
        start = time.monotonic()
        try:
            meshinit.materialize(plan, 7)
            outcome = "returned"
        except meshinit.PeerFailure as e:
            outcome = "PeerFailure: " + str(e)
        except Exception as e:
            outcome = f"{type(e).__name__}: {str(e).splitlines()[0]}"
        finally:
            _checks.memory_stats, _strategies.call = real_stats, real_call
        outcomes[case] = {
            "outcome": outcome[:400],
            "seconds": time.monotonic() - start,
            "leaked": len(jax.live_arrays()) - before,
        }
    # another seed on process 1: its replicas of a parameter would differ from process
    # 0's; both refuse before anything runs, naming the key
    before = len(jax.live_arrays())
    try:
        meshinit.materialize(plan, 7 + process_id)
        outcome = "returned"
    except Exception as e:
        outcome = f"{type(e).__name__}: {e}"
    outcomes["seed"] = {"outcome": outcome[:600], "leaked": len(jax.live_arrays()) - before}
    tree = meshinit.materialize(plan, 7)  # both processes agree again
    outcomes["after"] = len(jax.tree_util.tree_leaves(tree))
    for a in jax.tree_util.tree_leaves(tree):
        a.delete()
    return failures, outcomes


def main(process_id: int, port: int, reference_path: str) -> int:
    helpers.join_cpu_job(process_id, port, NUM_PROCESSES, LOCAL_DEVICES, timeout_s=60)
    assert len(jax.devices()) == NUM_PROCESSES * LOCAL_DEVICES, jax.devices()
    reference = np.load(reference_path)
    named = meshes()
    plan = meshinit.plan(specs(named))
    print(f"process {process_id}: devices {[(d.id, d.process_index) for d in jax.devices()]}")
    print(plan, flush=True)
    if [g.mesh for g in plan.groups] != [named[n] for n in MESH_NAMES]:
        print(f"process {process_id}: expected one group per mesh", file=sys.stderr)
        return 1

    failures: list[str] = []
    counts: dict[str, Any] = {}
    for seed, key in zip(SEEDS, (SEEDS[0], jax.random.key(SEEDS[1])), strict=True):
        tree = meshinit.materialize(plan, key)
        found, counts[str(seed)] = check(plan, tree, seed, reference, named)
        failures += found
        for a in jax.tree_util.tree_leaves(tree):
            a.delete()  # including arrays with no shard here
            if not a.is_deleted():
                failures.append(f"process {process_id}: an array survived delete()")
    # Partial init: numpy values (what a host-side restore gives) for params on a global
    # mesh and on each stage, the rest generated; all must equal the seed-0 init.
    given = ("global_auto.w", "global_explicit.embed", "stage0.layers", "stage1.w")
    existing = {p: np.asarray(reference[f"single-0-{p}"], dtype=np.float32) for p in given}
    tree = meshinit.materialize(plan, SEEDS[0], existing=existing)
    found, counts["existing"] = check(plan, tree, SEEDS[0], reference, named)
    failures += found
    jax.block_until_ready(tree)
    weights = os.path.join(os.path.dirname(reference_path), "weights.safetensors")
    found, counts["safetensors"] = check_safetensors(plan, reference, weights)
    failures += found
    if url := os.environ.get("MESHINIT_TEST_S3_URL"):
        found, counts["remote"] = check_remote(plan, reference, url)
        failures += found
    if url := os.environ.get("MESHINIT_TEST_S3_LAYOUTS_URL"):
        local = os.path.join(os.path.dirname(reference_path), "layouts.safetensors")
        found, counts["remote_layouts"] = check_remote_layouts(url, reference, local)
        failures += found
    found, counts["nnx"] = check_nnx(named, reference)
    failures += found
    found, counts["prepare"] = check_prepare_failures(named)
    failures += found
    found, counts["agreement"] = check_agreement(process_id, plan)
    failures += found
    print("RESULT " + json.dumps({"process": process_id, "counts": counts}), flush=True)
    if failures:
        print(f"process {process_id}: {len(failures)} checks failed", file=sys.stderr)
        for f in failures[:20]:
            print(f, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    helpers.finish_worker(lambda: main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]))
