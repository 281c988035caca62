"""Helpers the test modules share (no test module imports another)."""

import math
import os
import zlib

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

import meshinit

TIERS = ("fast", "all")
TIER = os.environ.get("MESHINIT_TESTS", "fast")
"""Which tests run (``MESHINIT_TESTS``): ``fast``, the default, leaves out the tests
marked ``slow`` and runs the fuzzers and large property tests at a smaller size;
``all`` (what CI sets) runs every test at full size. ``tests/conftest.py`` refuses any
other value."""


def _part(variable: str) -> tuple[int, int]:
    """``(k, n)`` from the environment variable ``variable`` (``k/n``; unset: 1/1)."""
    text = os.environ.get(variable, "1/1")
    k, _, n = text.partition("/")
    if not (k.isdigit() and n.isdigit() and 1 <= int(k) <= int(n)):
        raise ValueError(f"{variable}={text!r} is not k/n with 1 <= k <= n; e.g. 1/2")
    return int(k), int(n)


FUZZ_PART = _part("MESHINIT_FUZZ_PART")
"""Which share of the engine fuzzer's draws this run makes (``MESHINIT_FUZZ_PART=k/n``):
``(1, 1)``, the default, is every draw, derandomized; part ``k`` of ``n`` draws
``1/n`` of the examples from its own fixed seed, so that ``n`` runs (CI's two stacks)
draw different constructors, each run repeatable."""


SLOW_PART = _part("MESHINIT_SLOW_PART")
"""Which share of the stack-neutral slow tests this run makes
(``MESHINIT_SLOW_PART=k/n``, with ``MESHINIT_TESTS=all``): ``(1, 1)``, the default, is
all of them. The slow tests of :data:`STACK_NEUTRAL`'s modules each belong to one part
(:func:`slow_part`); CI's two stacks run parts 1/2 and 2/2, so each of those runs once
per CI run, on one stack, and every other test runs on both."""

STACK_NEUTRAL = frozenset(
    {
        # the benchmarks' scripts, run as a user runs them (subprocesses, --quick): what
        # they measure is the library's, which the modules below test on both stacks
        "tests/guarantees/test_benchmarks.py",
        # examples/ run as scripts: their library calls are tested on both stacks
        "tests/guarantees/test_examples.py",
        # many objects and requests against a local S3 server (obstore's client)
        "tests/_checkpoint/store/test_fetch.py",
        # the docs site's build (mkdocs)
        "tests/guarantees/test_docs.py",
        # the command line's subprocesses and its image
        "tests/_cli/test_cli.py",
        "tests/_cli/test_png.py",
        "tests/_cli/test_demo.py",
    }
)
"""Test modules whose slow tests run on one of CI's stacks (:data:`SLOW_PART`): what
they run depends on no jax or flax version beyond what the tests of the other modules,
which run on both stacks, cover (values, tiles, multi-process runs on jax's distributed
runtime, the adapters). Their fast tests run on both."""


def slow_part(nodeid: str, n: int) -> int:
    """The part (1 to ``n``) of :data:`SLOW_PART` a test belongs to, by its node id:
    fixed, so a test runs on the same stack in every CI run, and the parts split the
    tests, each in exactly one."""
    return zlib.crc32(nodeid.encode()) % n + 1


def examples(full: int, fast: int) -> int:
    """A property test's ``max_examples``: ``full`` with ``MESHINIT_TESTS=all``,
    ``fast`` (at most ``full``) by default."""
    return full if TIER == "all" else min(full, fast)


lecun = jax.nn.initializers.lecun_normal
RULES = (("embed", "fsdp"), ("mlp", "tensor"), ("vocab", "tensor"))


def three_meshes(explicit: bool):
    if explicit:
        make = jax.make_mesh  # Explicit axes by default
    else:

        def make(shape, names):
            return Mesh(np.array(jax.devices()).reshape(shape), names)  # Auto axes

    return make((2, 4), ("a", "b")), make((2, 2, 2), ("x", "y", "z")), make((8,), ("c",))


def three_mesh_specs(explicit: bool):
    """The flax #5127 model: three params, each on its own mesh with its own rules."""
    m1, m2, m3 = three_meshes(explicit)
    return {
        "small_linear1": meshinit.param(
            (16, 16), lecun(), axes=("A", "B"), mesh=m1, rules=(("A", "a"), ("B", "b"))
        ),
        "small_linear2": meshinit.param(
            (16, 16, 16),
            lecun(),
            axes=("X", "Y", "Z"),
            mesh=m2,
            rules=(("X", "x"), ("Y", "y"), ("Z", "z")),
        ),
        "small_linear3": meshinit.param(
            (16, 16), lecun(), axes=("C", None), mesh=m3, rules=(("C", "c"),)
        ),
    }, (m1, m2, m3)


def assert_exact(plan, tree):
    leaves = jax.tree_util.tree_leaves(tree)
    arrays = [leaves_i for leaves_i in leaves if isinstance(leaves_i, jax.Array)]
    assert len(arrays) == len(plan.entries)
    by_path = dict(zip((e.path for e in plan.entries), arrays, strict=True))
    for e in plan.entries:
        s = by_path[e.path].sharding
        assert isinstance(s, NamedSharding), (e.path, s)
        assert s == e.sharding, (e.path, s, e.sharding)
        assert s.mesh is e.sharding.mesh, e.path
    return by_path


def plan_for(shapes, dtype=np.float32, axes=None):
    """A plan of one zeros parameter per name of ``shapes``, replicated (or sharded by
    ``axes``) on the (2, 4) mesh ``("fsdp", "tensor")`` of the 8 devices."""
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("fsdp", "tensor"))
    return meshinit.plan(
        {
            n: meshinit.param(s, jax.nn.initializers.zeros, dtype=dtype, axes=axes, mesh=mesh)
            for n, s in shapes.items()
        }
    )


def plan_of(shapes, dtype=np.float32, mesh=None):
    """A plan of zeros-initialized params: ``{path: (shape, axes)}``, on ``mesh`` (by
    default the (2, 4) mesh ``("fsdp", "tensor")`` of the 8 devices)."""
    mesh = mesh or Mesh(np.array(jax.devices()).reshape(2, 4), ("fsdp", "tensor"))
    init = jax.nn.initializers.zeros
    return meshinit.plan(
        {p: meshinit.param(s, init, axes=a, mesh=mesh, dtype=dtype) for p, (s, a) in shapes.items()}
    )


def stored(tmp_path, tensors, name="model.safetensors"):
    """``tensors`` saved as one safetensors file in ``tmp_path``; its path."""
    from safetensors.numpy import save_file

    save_file(tensors, str(tmp_path / name))
    return tmp_path / name


def quantized_folder(tmp_path, tensors, config):
    """``tensors`` saved in ``tmp_path`` as one shard, with a config.json stating
    ``config`` as its ``quantization_config`` (none where ``config`` is None)."""
    import json

    tmp_path.mkdir(parents=True, exist_ok=True)
    stored(tmp_path, tensors, "model-00001-of-00001.safetensors")
    if config is not None:
        (tmp_path / "config.json").write_text(json.dumps({"quantization_config": config}))
    return tmp_path


def xy_mesh(shape, explicit):
    """The 8 devices as a mesh ``("x", "y")`` of ``shape``: Explicit (jax.make_mesh) or
    Auto."""
    if explicit:
        return jax.make_mesh(shape, ("x", "y"))
    return Mesh(np.array(jax.devices()).reshape(shape), ("x", "y"))


def plan_on(mesh, shapes, dtype, spec=("x", "y")):
    """A plan of one zeros parameter per name of ``shapes``, on ``mesh`` by ``spec``."""
    return meshinit.plan(
        {
            n: meshinit.param(s, jax.nn.initializers.zeros, dtype=dtype, mesh=mesh, axes=spec)
            for n, s in shapes.items()
        }
    )


def submesh(ids, shape, names, explicit=False):
    devices = [jax.devices()[i] for i in ids]
    if explicit:
        return jax.make_mesh(shape, names, devices=devices)
    return Mesh(np.array(devices).reshape(shape), names)


def mesh8(names=("fsdp", "tensor"), explicit=False):
    """All 8 devices as one ``(2, 4)`` mesh with axes ``names``: Auto axes, or Explicit
    ones with ``explicit``. Every test that wants "the 8-device mesh" builds it here."""
    return submesh(range(8), (2, 4), names, explicit=explicit)


def same_bits(got, want, what):
    """``got`` is ``want`` bit for bit: dtype, shape and every byte; the message counts
    the elements that differ."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, (
        f"{what}: {got.dtype}{got.shape}, want {want.dtype}{want.shape}"
    )
    if got.tobytes() != want.tobytes():
        off = (
            int(
                (got.view(np.uint8) != want.view(np.uint8)).reshape(got.shape + (-1,)).any(-1).sum()
            )
            if got.ndim
            else 1
        )
        raise AssertionError(f"{what}: {off} of {got.size} elements differ")


def on_one_device(tree):
    """Every leaf of ``tree`` copied whole onto the first device: the single-device
    reference a placed result is compared with."""
    return jax.tree.map(lambda x: jax.device_put(np.asarray(x), jax.devices()[0]), tree)


def assert_placed(array, sharding, what):
    """``array`` sits on exactly ``sharding`` (``==``, the same mesh and spec as
    written, not only an equivalent one)."""
    assert array.sharding == sharding, f"{what}: placed on {array.sharding}, want {sharding}"


def two_stage_specs():
    """Two disjoint pipeline stages: mesh group 0 on devices 0-3, group 1 on 4-7."""
    stages = [
        submesh(range(0, 4), (2, 2), ("fsdp", "tensor")),
        submesh(range(4, 8), (2, 2), ("fsdp", "tensor")),
    ]
    with meshinit.defaults(rules=RULES):
        return {
            "stage0": {
                "embed": meshinit.param((64, 32), lecun(), axes=("vocab", "embed"), mesh=stages[0]),
                "up": meshinit.param((32, 64), lecun(), axes=("embed", "mlp"), mesh=stages[0]),
                "scale": meshinit.param(
                    (32,), jax.nn.initializers.ones, axes=("embed",), mesh=stages[0]
                ),
            },
            "stage1": {
                "down": meshinit.param((64, 32), lecun(), axes=("mlp", "embed"), mesh=stages[1]),
                "head": meshinit.param((32, 64), lecun(), axes=("embed", "vocab"), mesh=stages[1]),
            },
        }


class Boom(RuntimeError):
    pass


BYTES_READ = "/meshinit/safetensors/bytes_read"


class Reads:
    """The bytes-read scalars (:data:`BYTES_READ`) the loads of one ``with`` block
    recorded, in ``values``."""

    def __enter__(self):
        self.values = []

        def on(event, value, **kwargs):
            if event == BYTES_READ:
                self.values.append(value)

        self._on = on
        jax.monitoring.register_scalar_listener(on)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_scalar_listener(self._on)


def owned_bytes(plan, itemsize, paths=None):
    """The bytes of this process's distinct blocks of every entry (of ``paths``, where
    given), at ``itemsize`` bytes an element."""
    total = 0
    for e in plan.entries:
        if paths is not None and e.path not in paths:
            continue
        blocks = {
            tuple(s.indices(n)[:2] for s, n in zip(index, e.spec.shape, strict=True))
            for index in e.sharding.addressable_devices_indices_map(e.spec.shape).values()
        }
        total += sum(math.prod(b - a for a, b in block) for block in blocks) * itemsize
    return total


def owned(arrays):
    """Bytes this process's devices hold of ``arrays`` (path -> array), each distinct
    block once."""
    seen = {}
    for path, array in arrays.items():
        for shard in array.addressable_shards:
            key = (path, tuple((s.start, s.stop) for s in shard.index))
            seen[key] = shard.data.nbytes
    return sum(seen.values())


def layered_specs(mesh, layers, rules, order=None, extra=False):
    """An embedding and ``layers`` layers of four specs (two initializers, a bf16 one);
    ``extra`` adds one more parameter."""
    import jax.numpy as jnp

    with meshinit.defaults(mesh=mesh, rules=rules):
        tree = {
            "embed": meshinit.param((512, 64), lecun(), axes=("vocab", "embed")),
            "layers": [
                {
                    "q": meshinit.param((64, 64), lecun(), axes=("embed", "heads")),
                    "up": meshinit.param((64, 256), lecun(), axes=("embed", "mlp")),
                    "n": meshinit.param((64,), jax.nn.initializers.ones, axes=("embed",)),
                    "u": meshinit.param(
                        (64, 8),
                        jax.nn.initializers.uniform(),
                        axes=("embed", None),
                        dtype=jnp.bfloat16,
                    ),
                }
                for _ in range(layers)
            ],
        }
        if extra:
            tree["extra"] = meshinit.param((8, 8), lecun(), axes=(None, None))
    return tree


LAYERED_RULES = (("vocab", "tensor"), ("embed", "fsdp"), ("heads", "tensor"), ("mlp", "tensor"))


def flat_values(tree):
    """Dot-joined path -> numpy value of every leaf."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {meshinit._paths.path_str(kp): np.asarray(v) for kp, v in flat}


def two_stage_plan():
    """A plan over two disjoint 2x2 stages of two parameters each."""
    stages = [submesh(range(0, 4), (2, 2), ("x", "y")), submesh(range(4, 8), (2, 2), ("x", "y"))]
    return meshinit.plan(
        {
            f"s{i}": {
                "w": meshinit.param((64, 32), lecun(), axes=("x", "y"), mesh=m),
                "b": meshinit.param((32,), jax.nn.initializers.ones, axes=("y",), mesh=m),
            }
            for i, m in enumerate(stages)
        }
    )


def break_compiles_on(monkeypatch, bad):
    """Every compile for the mesh ``bad`` fails, naming an XLA option that does not
    exist (not one of meshinit's, so it is not dropped); returns the real options."""
    from meshinit._run import compile as _compile

    real = _compile.compiler_options
    monkeypatch.setattr(
        _compile,
        "compiler_options",
        lambda mesh: {"xla_no_such_option_here": 1} if mesh is bad else real(mesh),
    )
    return real


def reference(spec, key, path, sharding=None):
    """The value contract's jitted reference for one parameter: ``jax.jit`` of
    ``spec.init(param_key(key, path), shape, dtype)``, with ``out_shardings=sharding``
    where given (the planned sharding: XLA's CPU code may round a block otherwise than
    the whole array, and meshinit's values are jit's on the planned sharding)."""
    fn = jax.jit(lambda k: spec.init(k, spec.shape, spec.dtype), out_shardings=sharding)
    return np.asarray(fn(meshinit.param_key(key, path)))


CPU_ONLY = {"JAX_PLATFORMS": "cpu", "PATH": ""}
"""The environment of a bare interpreter: CPU only, nothing of the caller's (no
``jax_num_cpu_devices``, no MESHINIT_* switches)."""


def run_python(*args, timeout=300, env=None):
    """``python ARGS`` in a subprocess from the repository root, output captured; in
    ``env`` where given (e.g. :data:`CPU_ONLY`), else in the caller's environment."""
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=root, env=env
    )


def auto_abstract_mesh(sizes, names):
    """An AbstractMesh with Auto axes, the mesh ``meshinit plan --abstract-mesh`` builds,
    on every jax: AbstractMesh's own default is Auto on jax 0.10 and Explicit from 0.11."""
    from jax.sharding import AbstractMesh, AxisType

    return AbstractMesh(sizes, names, axis_types=(AxisType.Auto,) * len(names))


def cli_factory_specs(name, mesh=None):
    """What ``meshinit plan`` plans for ``tests/cli_factories.py:NAME`` under
    ``--abstract-mesh fsdp=2,tensor=4`` (or ``mesh``)."""
    import cli_factories

    with meshinit.defaults(mesh=mesh or auto_abstract_mesh((2, 4), ("fsdp", "tensor"))):
        return getattr(cli_factories, name)()


def overlapping_mesh_specs():
    """Three params on three concrete meshes over shared devices: a (2, 4) and a
    (2, 2, 2) mesh over all 8, and a (2,) mesh over devices 6 and 7."""
    devices = jax.devices()
    ones = jax.nn.initializers.ones
    return {
        "a": meshinit.param(
            (16, 32), ones, axes=("fsdp", "tensor"),
            mesh=jax.make_mesh((2, 4), ("fsdp", "tensor"), devices=devices),
        ),
        "b": meshinit.param(
            (8, 8, 8), ones, axes=("data", None, None),
            mesh=jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), devices=devices),
        ),
        "c": meshinit.param(
            (64,), ones, axes=("tensor",),
            mesh=jax.make_mesh((2,), ("tensor",), devices=devices[6:]),
        ),
    }  # fmt: skip


def eqx_mlp(key):
    """A small equinox MLP (16 in, 8 out, width 32, depth 2): what the eqx tests place."""
    import equinox as eqx

    return eqx.nn.MLP(16, 8, 32, 2, key=key)


def eqx_linear(key):
    """An equinox Linear (16 in, 32 out) with a bias."""
    import equinox as eqx

    return eqx.nn.Linear(16, 32, key=key)


def boxes_by_path(variables):
    """A linen variables tree as dot-joined path -> leaf, ``nn.Partitioned`` boxes
    (logical ones included) kept whole."""
    import flax.linen as nn

    flat, _ = jax.tree_util.tree_flatten_with_path(
        variables, is_leaf=lambda x: isinstance(x, nn.Partitioned)
    )
    return {meshinit._paths.path_str(kp): v for kp, v in flat}


class OnesMaker:
    """A group maker (meshinit._run.maker.GroupMaker) with no executables: each entry
    is placed from the host as ones; ``events`` records ``("prepare", i)`` and
    ``("run", i)`` by group index of ``plan``, in the order run_plan asks."""

    def __init__(self, plan=None):
        self.index = {} if plan is None else {id(g): i for i, g in enumerate(plan.groups)}
        self.events = []

    def builds(self, group):
        return []

    def work(self, group):
        return [(None, 1)]

    def prepare(self, group):
        from meshinit._run.place import place

        i = self.index.get(id(group))
        self.events.append(("prepare", i))

        def run():
            self.events.append(("run", i))
            for pos, e in enumerate(group.entries):
                yield pos, place(np.ones(e.spec.shape, e.spec.dtype), e.sharding)

        return run


def load_refused(plan, files, *needles, **kwargs):
    """The PlanError of ``meshinit.safetensors.load(plan, files, **kwargs)``, whose
    message must name every one of ``needles``."""
    import pytest

    from meshinit import safetensors

    with pytest.raises(meshinit.PlanError) as raised:
        safetensors.load(plan, files, **kwargs)
    message = str(raised.value)
    for needle in needles:
        assert needle in message, f"{needle!r} not in:\n{message}"
    return raised.value


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a jax.distributed coordinator)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_workers(script, count, args, logs, env=None, timeout_s=240, grace_s=10):
    """Runs ``python SCRIPT PROCESS_ID PORT *ARGS`` once per process, ``count`` of them,
    on one free coordinator port, from the repository root with it first on
    ``PYTHONPATH`` and ``JAX_PLATFORMS=cpu`` (and ``env`` added); each one's output in
    ``logs``. All get ``timeout_s``; once one fails, the others ``grace_s`` more (they
    wait for it in a barrier or a collective). Returns each one's ``returncode``,
    ``stdout``, ``stderr`` and ``ended`` (the ``time.time()`` at which it was seen to
    end, to 0.2 s); a worker still running at the end is killed (-9)."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    port = free_port()
    env = {
        **os.environ,
        **(env or {}),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
        "JAX_PLATFORMS": "cpu",
    }
    logs = Path(logs)
    logs.mkdir(parents=True, exist_ok=True)
    procs, files, ended = [], [], {}
    try:
        for i in range(count):
            out, err = open(logs / f"{i}.out", "w+"), open(logs / f"{i}.err", "w+")
            files += [out, err]
            cmd = [sys.executable, str(script), str(i), str(port), *map(str, args)]
            procs.append(subprocess.Popen(cmd, cwd=root, env=env, stdout=out, stderr=err))
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            for i, p in enumerate(procs):
                if p.poll() is not None:
                    ended.setdefault(i, time.time())
            if any(p.poll() not in (None, 0) for p in procs):
                deadline = min(deadline, time.monotonic() + grace_s)
            time.sleep(0.2)
    finally:
        for i, p in enumerate(procs):
            if p.poll() is None:
                p.kill()
                p.wait()
            ended.setdefault(i, time.time())
        for f in files:
            f.close()
    return [
        {
            "returncode": p.returncode,
            "stdout": (logs / f"{i}.out").read_text(),
            "stderr": (logs / f"{i}.err").read_text(),
            "ended": ended[i],
        }
        for i, p in enumerate(procs)
    ]


def write_fanout_objects(worker, folder, expected):
    """Each object of a fan-out worker module's ``objects()`` as a safetensors file in
    ``folder`` (from its ``stored_tensors()``), and ``expected.npz``: the plan value
    of each case's parameter (``<object>/<path>``; bf16 as its uint16 bits), with
    ``expected``. Returns each object's header length (where its data starts)."""
    from safetensors.numpy import save

    stored = worker.stored_tensors()
    headers = {}
    for obj, params in worker.objects().items():
        data = save(stored[obj])
        (folder / f"{obj}.safetensors").write_bytes(data)
        headers[obj] = 8 + int.from_bytes(data[:8], "little")
        for path, p in params.items():
            value = p.expected(stored[obj])
            expected[f"{obj}/{path}"] = value.view(np.uint16) if value.itemsize == 2 else value
    np.savez(folder / "expected.npz", **expected)
    return headers


def join_cpu_job(process_id, port, processes, local_devices, timeout_s=90, heartbeat_s=100):
    """This worker joins a jax.distributed job of ``processes`` on 127.0.0.1, with
    ``local_devices`` simulated CPU devices and gloo's collectives; a process that
    stops sending heartbeats for ``heartbeat_s`` makes jax abort every process."""
    jax.config.update("jax_num_cpu_devices", local_devices)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        f"127.0.0.1:{port}",
        num_processes=processes,
        process_id=process_id,
        initialization_timeout=timeout_s,
        heartbeat_timeout_seconds=heartbeat_s,
    )
    assert jax.process_count() == processes, jax.process_count()


def finish_worker(run):
    """Ends a worker process of :func:`run_workers`: ``run()`` returns its exit code
    (an exception's traceback is printed, code 1). On failure it leaves at once,
    skipping jax.distributed's shutdown barrier, which would wait for the peers."""
    import sys
    import traceback

    try:
        code = run()
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        os._exit(code)
    jax.distributed.shutdown()


def describe_worker(i, result):
    """What a :func:`run_workers` worker did, for a failed test's message."""
    killed = "killed (timed out, or a peer had failed)"
    status = killed if result["returncode"] == -9 else f"exit {result['returncode']}"
    return (
        f"worker {i}: {status}\n--- stderr (tail) ---\n{result['stderr'][-6000:]}"
        f"\n--- stdout (tail) ---\n{result['stdout'][-1500:]}"
    )


def upload_chunks():
    """Chunks of every kind write takes, and the bytes they make together."""
    floats = np.arange(300, dtype=np.float32).reshape(20, 15)
    chunks = [
        b"header" * 50,
        memoryview(bytes(range(256)) * 9),
        floats,
        np.arange(700, dtype=np.uint16)[::1],
        floats[3],  # a C-contiguous row
    ]
    whole = b"".join(c.tobytes() if isinstance(c, np.ndarray) else bytes(c) for c in chunks)
    return chunks, whole


def worker_exit(main, *args):
    """The end of a multi-process test's worker script: ``main(*args)``'s exit code (1,
    with the traceback printed, where it raised), the output flushed, and the process
    left without jax.distributed's shutdown barrier (a peer may be gone, or stranded)."""
    import sys
    import traceback

    code = 1
    try:
        code = main(*args)
    except BaseException:
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def leave_last(name, process_id, alive):
    """A worker's end: it says it is done; process 0, which serves jax's coordination
    (its exit makes jax abort the others), waits (up to 60 s) until every process of
    ``alive`` has said so."""
    import time

    from meshinit._jax import compat

    client = compat.distributed_client()
    client.key_value_set(f"{name}/done/{process_id}", "1")
    if process_id != 0:
        return
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done = {int(k.rsplit("/", 1)[1]) for k, _ in client.key_value_dir_get(f"{name}/done/")}
        if set(alive) <= done:
            return
        time.sleep(0.05)
