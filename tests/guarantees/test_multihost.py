"""meshinit under jax.distributed: 2 processes x 4 CPU devices, gloo on 127.0.0.1.

The test spawns ``multihost_worker.py`` twice. Each worker plans and materializes the
same tree on a mesh over all 8 devices (Auto and Explicit), on a stage mesh of its own
4 devices, and on the other process's stage mesh, which it does not address at all.
It checks every addressable shard against values computed here, in one process on
one device, so the value contract is checked across process boundaries.
"""

import contextlib
import json
import math
import time
from pathlib import Path

import helpers
import jax
import multihost_worker as worker
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import meshinit

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 240
# Once one worker fails, its peer waits in a barrier or a collective: stop it soon.
PEER_GRACE_S = 10
PARAMS_PER_MESH = len(worker.layout(None))


def write_reference(path: Path) -> None:
    """Single-process values for every path and seed, as float32, each made on a mesh
    of this process's devices shaped as the workers' mesh of that name (so each device
    holds a block of the workers' shape: XLA's CPU code may round a block otherwise
    than the whole array).

    ``single``: meshinit, which the workers must match bit for bit.
    ``reference``: ``init(param_key(key, path), shape, dtype)``, ``jax.jit`` with the
    planned out_shardings, which they must match bit for bit too.
    """
    devices = np.array(jax.devices())
    shaped = {
        "global_auto": Mesh(devices.reshape(2, 4), worker.AXES),
        "global_explicit": jax.make_mesh((2, 4), worker.AXES),
        "stage0": jax.make_mesh((2, 2), worker.AXES, devices=list(devices[:4])),
        "stage1": Mesh(devices[4:].reshape(2, 2), worker.AXES),
    }
    assert set(shaped) == set(worker.MESH_NAMES)
    plan = meshinit.plan(worker.specs(shaped))
    arrays = {}
    for seed in worker.SEEDS:
        leaves = jax.tree_util.tree_leaves(meshinit.materialize(plan, seed))
        for e in plan.entries:
            fn = jax.jit(lambda k, s=e.spec: s.init(k, s.shape, s.dtype), out_shardings=e.sharding)
            ref = fn(meshinit.param_key(seed, e.path))
            arrays[f"single-{seed}-{e.path}"] = np.asarray(leaves[e.leaf_index], np.float32)
            arrays[f"reference-{seed}-{e.path}"] = np.asarray(ref, np.float32)
    # The second materialize must not just repeat the first.
    assert not np.array_equal(arrays["single-0-stage1.w"], arrays["single-1-stage1.w"])
    from flax import nnx

    with nnx.use_eager_sharding(False):  # eager construction on one device
        eager = worker.nnx_model()(nnx.Rngs(3))
    for p, var in nnx.to_flat_state(nnx.state(eager)):
        arrays["nnx-" + ".".join(map(str, p))] = np.asarray(var.get_value())
    from safetensors.numpy import save_file

    tensors = {
        worker.ST_TENSORS[p][0]: worker.as_stored(p, arrays[f"single-0-{p}"])
        for p in worker.ST_TENSORS
    }
    save_file(tensors, str(path.with_name("weights.safetensors")))
    # issue 48's layouts: whole rows and a whole tensor, at 64-byte-aligned offsets
    rng = np.random.default_rng(48)
    layouts = {
        name: rng.standard_normal(shape).astype(np.float32)
        for name, (shape, _) in worker.REMOTE_LAYOUTS.items()
    }
    np.savez(path, **arrays, **{f"layouts-{n}": v for n, v in layouts.items()})
    path.with_name("layouts.safetensors").write_bytes(aligned(layouts))


def aligned(tensors: dict) -> bytes:
    """The safetensors file of ``tensors`` (of sizes that are multiples of 64 bytes),
    its header padded so that every tensor starts at a 64-byte-aligned offset."""
    from safetensors.numpy import save

    for pad in range(64):
        data = save(tensors, metadata={"pad": "." * pad})
        start = 8 + int.from_bytes(data[:8], "little")
        if start % 64 == 0:
            break
    header = json.loads(data[8:start])
    offsets = {n: start + h["data_offsets"][0] for n, h in header.items() if n in tensors}
    assert all(o % 64 == 0 for o in offsets.values()), f"not 64-byte-aligned: {offsets}"
    return data


def spawn(reference: Path, logs: Path, extra: dict | None = None) -> list[dict]:
    return helpers.run_workers(
        worker.__file__, worker.NUM_PROCESSES, (reference,), logs, extra, TIMEOUT_S, PEER_GRACE_S
    )


SERVED: dict = {}  # the S3 server's log of the workers' remote loads, where they ran


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("multihost")
    start = time.monotonic()
    write_reference(tmp / "reference.npz")
    middle = time.monotonic()
    with contextlib.ExitStack() as stack:
        extra = {}
        try:  # the workers also load from S3 (issues 43 and 48), where they can
            import obstore  # noqa: F401
            from storage_servers import S3Server
        except ImportError:
            S3Server = None  # noqa: N806
        if S3Server is not None:
            server = stack.enter_context(S3Server())
            bucket = server.bucket()
            data = (tmp / "weights.safetensors").read_bytes()
            server.put(f"{bucket}/weights.safetensors", data)
            server.put(f"{bucket}/layouts.safetensors", (tmp / "layouts.safetensors").read_bytes())
            server.reset()
            extra = {
                **server.env,
                "MESHINIT_TEST_S3_URL": f"s3://{bucket}/weights.safetensors",
                "MESHINIT_TEST_S3_LAYOUTS_URL": f"s3://{bucket}/layouts.safetensors",
            }
            SERVED["header"] = 8 + int.from_bytes(data[:8], "little")
            SERVED["objects"] = {n: f"{bucket}/{n}.safetensors" for n in ("weights", "layouts")}
        results = spawn(tmp / "reference.npz", tmp, extra)
        if S3Server is not None:
            SERVED["log"] = list(server.counters.log)
    print(f"reference {middle - start:.1f} s, 2 workers {time.monotonic() - middle:.1f} s")
    return results


describe = helpers.describe_worker


def counts(i: int, r: dict) -> dict:
    assert r["returncode"] == 0, describe(i, r)
    lines = [line for line in r["stdout"].splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, describe(i, r)
    result = json.loads(lines[0].removeprefix("RESULT "))
    assert result["process"] == i
    return result["counts"]


def test_every_worker_materializes_and_checks_without_errors(workers):
    assert len(workers) == worker.NUM_PROCESSES
    # A worker that failed first, then a peer that was killed while waiting for it.
    failed = sorted(
        (i for i, r in enumerate(workers) if r["returncode"] != 0),
        key=lambda i: workers[i]["returncode"] == -9,
    )
    assert not failed, "\n\n".join(describe(i, workers[i]) for i in failed)


@pytest.mark.parametrize("process", [0, 1])
def test_each_process_checks_exactly_its_addressable_shards_for_both_keys(workers, process):
    got = counts(process, workers[process])
    local = PARAMS_PER_MESH * worker.LOCAL_DEVICES  # one shard per local device
    want = {
        "global_auto": local,
        "global_explicit": local,
        f"stage{process}": local,
        f"stage{1 - process}": 0,  # the other process's stage: nothing addressable here
    }
    for seed in worker.SEEDS:
        assert got[str(seed)]["shards"] == want, (seed, got)
    # materialize(plan, 0, existing={4 paths: numpy}) equals the seed-0 init everywhere
    assert got["existing"]["shards"] == want, got


@pytest.mark.parametrize("process", [0, 1])
def test_the_other_process_stage_gives_arrays_with_zero_addressable_shards(workers, process):
    got = counts(process, workers[process])
    for seed in worker.SEEDS:
        assert got[str(seed)]["remote_arrays"] == PARAMS_PER_MESH, (seed, got)


@pytest.mark.parametrize("process", [0, 1])
def test_safetensors_load_reads_only_the_shards_each_process_owns(workers, process):
    got = counts(process, workers[process])["safetensors"]
    # two global paths (4 local devices each) and this process's own stage's w; the
    # other stage's w has no shard here, and nothing of it is read
    assert got["shards"] == 3 * worker.LOCAL_DEVICES, got
    assert got["read"] == got["owned"], got  # each local block once, and nothing else
    # a Stack of three stored tensors over both processes: this process's rows of every
    # layer (half of them), as the loader reports it, once
    assert got["stack_read"] == [got["stack_owned"]] == [16 * 3 * 32 * 4 // 2], got
    # process 1's copy of the file is truncated: it refuses it, and process 0 fails too
    assert got["corrupt"] == ("PeerFailure" if process == 0 else "PlanError"), got


def test_a_remote_load_fetches_only_the_bytes_each_process_owns(workers):
    if "log" not in SERVED:
        pytest.skip("obstore or moto is not installed: pip install -e '.[test]'")
    got = [counts(i, r)["remote"] for i, r in enumerate(workers)]
    for one in got:  # each process reports its own fetches, once, within 5% of its own
        fetched = one["fetched"][0]  # the first load (process 0 loads again below)
        assert one["owned"] <= fetched <= 1.05 * one["owned"], got
    # and the server sent each process's header reads and those bytes, nothing more
    weights = SERVED["objects"]["weights"]
    gets = [r for r in SERVED["log"] if r.method == "GET" and r.status == 206 and r.path == weights]
    headers = [k for k, r in enumerate(gets) if r.range[0] == 0]  # two loads, process 0's third
    assert len(headers) == 3, [r.range for r in gets]
    # process 0's third load (process 1 fails its own) begins after both first loads
    # ended: what the server sent after its header is that load's. It starts fetching
    # before its agreement with process 1 fails it, so it may have fetched some of its
    # own blocks, and reports none (a failed load records no bytes)
    first, failed = gets[: headers[2]], gets[headers[2] + 1 :]
    sent = sum(r.sent for k, r in enumerate(first) if k not in headers)
    assert sent == sum(sum(one["fetched"]) for one in got), (sent, got)
    assert sum(r.sent for r in failed) <= got[0]["owned"], [r.range for r in failed]
    # an object absent for process 1: it refuses it, and process 0 fails too
    assert [one["absent"] for one in got] == ["PeerFailure", "PlanError"], got


def test_a_remote_load_of_whole_rows_and_a_replicated_tensor_is_exact_on_each_process(
    workers,
):
    # issue 48: blocks that jax's CPU client may use in place (whole rows per device, a
    # replicated tensor) at 64-byte-aligned offsets, on a mesh over both processes
    if "log" not in SERVED:
        pytest.skip("obstore or moto is not installed: pip install -e '.[test]'")
    got = [counts(i, r)["remote_layouts"] for i, r in enumerate(workers)]
    wrong = [line for one in got for line in one["wrong"]]
    assert not wrong, (
        f"the S3 load differs from the single-process values in {len(wrong)} shards:\n"
        + "\n".join(wrong[:6] + wrong[-6:] if len(wrong) > 12 else wrong)
    )
    for one in got:  # a shard on each local device, of each
        assert one["shards"] == dict.fromkeys(worker.REMOTE_LAYOUTS, worker.LOCAL_DEVICES), one
    rows, replicated = (math.prod(s) * 4 for s, _ in worker.REMOTE_LAYOUTS.values())
    for one in got:  # half the rows, and the whole replicated tensor once
        assert one["owned"] == rows // 2 + replicated, one
        assert len(one["fetched"]) == 1, one  # one load, reported once
        assert one["owned"] <= one["fetched"][0] <= 1.05 * one["owned"], got
    layouts = SERVED["objects"]["layouts"]
    gets = [r for r in SERVED["log"] if r.method == "GET" and r.status == 206 and r.path == layouts]
    headers = [r for r in gets if r.range[0] == 0]
    assert len(headers) == 2, [r.range for r in gets]  # one header read a process
    sent = sum(r.sent for r in gets) - sum(r.sent for r in headers)
    assert sent == sum(one["fetched"][0] for one in got), (sent, got)


def test_nnx_init_places_every_shard_with_eager_values_and_one_host_part(workers):
    # meshinit.nnx.init on unchanged nnx code across two processes: each process checks
    # its addressable shards against eager construction, and both computed the same
    # host part (keys, counters, small values) of the trace.
    got = [counts(i, r)["nnx"] for i, r in enumerate(workers)]
    assert got[0]["nnx_host_digest"] == got[1]["nnx_host_digest"], got
    # embed: 4 local shards each; layer 0 on stage0, layers 1-2 on stage1 (3 Variables
    # a layer: kernel, bias, scale), 4 devices each: only their own process sees them.
    assert got[0]["nnx_shards"] == 4 + 3 * 4, got
    assert got[1]["nnx_shards"] == 4 + 6 * 4, got


def test_a_failure_on_one_process_fails_every_process_and_keeps_no_array(workers):
    # Process 1 fails a materialize twice: its local memory check, then an
    # out-of-memory in a call. Process 0 succeeded locally both times, yet must not
    # return arrays missing process 1's shards: it raises, naming process 1.
    got = [counts(i, r)["agreement"] for i, r in enumerate(workers)]
    zero, one = got
    assert zero["memory_check"]["outcome"].startswith("PeerFailure"), zero
    assert (
        "process 1 failed: PlanError: the parameters do not fit" in zero["memory_check"]["outcome"]
    )
    assert one["memory_check"]["outcome"].startswith("PlanError: the parameters do not fit"), one
    assert zero["oom"]["outcome"].startswith("PeerFailure"), zero
    assert "process 1 failed: JaxRuntimeError: RESOURCE_EXHAUSTED" in zero["oom"]["outcome"]
    assert one["oom"]["outcome"].startswith("JaxRuntimeError: RESOURCE_EXHAUSTED"), one
    for outcomes in got:
        for case in ("memory_check", "oom"):
            assert outcomes[case]["leaked"] == 0, outcomes  # every array made was deleted
            assert outcomes[case]["seconds"] < 60, outcomes  # bounded: no collective deadline
        assert outcomes["after"] == len(worker.MESH_NAMES) * PARAMS_PER_MESH  # agreed again


def test_processes_given_other_seeds_refuse_before_anything_runs(workers):
    # each process makes its own shards: with their own seeds, the replicas of one
    # parameter would differ between processes, silently
    for i, r in enumerate(workers):
        seed = counts(i, r)["agreement"]["seed"]
        assert seed["outcome"].startswith("PlanError"), seed
        needle = "key: differs between the processes: process 0: threefry2x32 [0, 7], "
        assert needle + "process 1: threefry2x32 [0, 8]" in seed["outcome"], seed
        assert seed["leaked"] == 0, seed


@pytest.mark.parametrize("name", ["nnx seed", "eqx seed"])
def test_a_constructor_seeded_otherwise_on_each_process_is_refused_before_anything_runs(
    workers, name
):
    # nnx.Rngs(3 + process) or eqx's key from the process: the constructor's keys differ,
    # so every replica of a variable would; the engine compares them first
    for i, r in enumerate(workers):
        seeded = counts(i, r)["prepare"][name]
        assert seeded["outcome"].startswith("PlanError"), seeded
        assert "the constructor's keys: differs between the processes" in seeded["outcome"]
        assert seeded["leaked"] == 0, seeded


@pytest.mark.parametrize("adapter", ["nnx", "eqx", "linen", "optax"])
def test_a_factory_failing_on_one_process_before_anything_is_made_fails_every_process(
    workers, adapter
):
    # The factory raises on process 1 only, while it is traced: process 1 never plans
    # or allocates, yet it joins the agreement from its error path, so process 0 (which
    # made its arrays) raises quickly, naming process 1's error, not after a timeout.
    zero, one = (counts(i, r)["prepare"][adapter] for i, r in enumerate(workers))
    error = f"RuntimeError: injected {adapter} factory failure on process 1"
    assert one["outcome"] == error, one
    assert zero["outcome"].startswith("PeerFailure"), zero
    assert f"process 1 failed: {error}" in zero["outcome"], zero
    for outcome in (zero, one):
        assert outcome["seconds"] < 20, outcome  # well under the collectives' 30 s timeout
        assert outcome["leaked"] == 0, outcome  # process 0 deleted what it had made


# ------------------------------------------------ one agreement per call, in one process


def collective_calls(fail):
    """Each collective call, as a thunk; ``fail(where)`` raises when ``where`` is the
    stage the test fails ("prepare": while tracing or planning, "run": while making)."""
    import equinox as eqx
    import flax.linen as nn
    import optax
    from flax import nnx

    import meshinit.eqx
    import meshinit.linen
    import meshinit.nnx
    import meshinit.optax

    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"))

    def ones(key, shape, dtype):
        fail("prepare")  # planning checks each initializer abstractly
        return jax.numpy.ones(shape, dtype)

    class Linen(nn.Module):
        @nn.compact
        def __call__(self, x):
            fail("prepare")
            return nn.Dense(8)(x)

    def specs():
        return {"w": meshinit.param((8, 16), ones, axes=("fsdp", None), mesh=mesh)}

    plan = meshinit.plan(specs())  # before anything fails

    def factory():
        fail("prepare")
        return nnx.Linear(16, 8, rngs=nnx.Rngs(0))

    params = {"w": jax.device_put(np.ones((8, 16), np.float32), NamedSharding(mesh, P()))}
    model = meshinit.nnx.init(lambda: nnx.Linear(16, 8, rngs=nnx.Rngs(0)))  # made before
    adam = optax.adam(1e-3)
    tx = optax.GradientTransformation(lambda p: (fail("prepare"), adam.init(p))[1], adam.update)
    return {
        "materialize": lambda: meshinit.materialize(plan, 0),
        "init": lambda: meshinit.init(specs(), 0),
        "nnx.init": lambda: meshinit.nnx.init(factory),
        "eqx.init": lambda: meshinit.eqx.init(
            lambda k: (fail("prepare"), eqx.nn.Linear(16, 8, key=k))[1],
            0,
            [(".*", None)],
            mesh=mesh,
        ),
        "linen.init": lambda: meshinit.linen.init(
            Linen(), 0, np.ones((1, 16), np.float32), mesh=mesh, default="replicated"
        ),
        "optax.init": lambda: meshinit.optax.init(tx, params),
        "nnx.optimizer": lambda: meshinit.nnx.optimizer(model, tx),
    }


# (call, where it fails: None for not at all). optax's state goes through run_plan too,
# but its maker calls its own compiled steps, not strategies.call, where "run" is
# injected here (tests/test_optax.py fails a step); materialize's preparation is the
# caller's meshinit.plan, which is not collective (meshinit.init's is).
ENDINGS = [
    (name, where)
    for name in ("materialize", "init", "nnx.init", "eqx.init", "linen.init")
    for where in (None, "prepare", "run")
    if (name, where) != ("materialize", "prepare")
] + [(name, where) for name in ("optax.init", "nnx.optimizer") for where in (None, "prepare")]


@pytest.mark.parametrize(("name", "where"), ENDINGS)
def test_every_collective_call_agrees_exactly_once_however_it_ends(monkeypatch, name, where):
    # Every process must join the same number of agreements, in the same order: one per
    # call, whether it succeeds, fails before anything is made, or fails while making.
    from meshinit._run import agree as _agree
    from meshinit._run import strategies as _strategies

    armed = {"on": False}

    def fail(stage):
        if armed["on"] and stage == where:
            raise RuntimeError(f"injected {stage} failure")

    calls = collective_calls(fail)
    agreed = []
    real_call = _strategies.call

    def call(*args):
        fail("run")
        return real_call(*args)

    monkeypatch.setattr(_agree, "agree", lambda what, error: agreed.append((what, error)))
    monkeypatch.setattr(_strategies, "call", call)
    armed["on"] = True
    if where is None:
        calls[name]()
    else:
        with pytest.raises(Exception, match=f"injected {where} failure"):  # PlanError: init
            calls[name]()
    assert len(agreed) == 1, f"{name} agreed {len(agreed)} times: {agreed}"
    ((what, error),) = agreed
    assert (error is None) == (where is None), agreed
    assert what == {"materialize": "materialize"}.get(name, f"meshinit.{name}"), what
