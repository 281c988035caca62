"""One process of the fan-out test in ``tests/guarantees/test_fanout.py`` (issue 58); not
collected by pytest.

Run: python tests/fanout_worker.py PROCESS_ID PORT FOLDER SOURCE

Each process joins ``jax.distributed`` on 127.0.0.1 with 2 CPU devices (4 processes),
then runs every case of :data:`CASES` in turn: it loads the case's safetensors object
(``FOLDER/<case>.safetensors``, or ``SOURCE/<case>.safetensors`` where SOURCE is an
``s3://`` prefix, each process signing with its own access key id ``proc-<id>``), checks
every addressable shard against the numpy values in ``FOLDER/expected.npz`` bit for bit,
and reports what the load recorded (``/meshinit/safetensors/bytes_read`` and
``bytes_from_peers``), the bytes of its own distinct blocks, and how many processes
hold each block. Then the compile count at two depths, a permanent failure on one
process (S3 only), and one more load that must agree. It prints one ``RESULT {json}``
line and exits 0 unless something other than a check failed.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import helpers
import jax
import numpy as np
from jax.sharding import AxisType, Mesh

import meshinit

NUM_PROCESSES = 4
LOCAL_DEVICES = 2
STORE_BYTES = "/meshinit/safetensors/bytes_read"
PEER_BYTES = "/meshinit/safetensors/bytes_from_peers"
COMPILE = "/jax/core/compile/backend_compile_duration"


@dataclasses.dataclass(frozen=True)
class Param:
    """A plan parameter loaded from stored tensors: one (``Tensor``, ``permute`` where
    given) or several (a ``Stack`` of them along axis 0), each of ``shape`` and
    ``dtype`` as stored; placed on the named mesh (:func:`meshes`) with ``axes``.
    ``holders``: how many processes hold each of its blocks (R), so each fetches
    about 1/R of its blocks' rows under fan-out."""

    mesh: str
    axes: tuple[str | None, ...]
    tensors: tuple[str, ...]
    shape: tuple[int, ...]
    holders: int
    dtype: str = "float32"
    permute: tuple[int, ...] | None = None
    layout: str | None = None  # one of LAYOUTS: the other targets of names=

    @property
    def stack(self) -> bool:
        return len(self.tensors) > 1

    @property
    def plan_shape(self) -> tuple[int, ...]:
        if self.layout is not None:
            return LAYOUTS[self.layout][2](self.shape)
        if self.stack:
            return (len(self.tensors), *self.shape)
        if self.permute is not None:
            return tuple(self.shape[i] for i in self.permute)
        return self.shape

    def expected(self, stored: dict[str, np.ndarray]) -> np.ndarray:
        """The plan's value from the stored tensors, in numpy."""
        if self.layout is not None:
            return LAYOUTS[self.layout][1]([stored[t] for t in self.tensors])
        if self.stack:
            return np.stack([stored[t] for t in self.tensors], axis=0)
        value = stored[self.tensors[0]]
        return value if self.permute is None else np.transpose(value, self.permute)

    def names(self) -> Any:
        from meshinit import safetensors as st

        if self.layout is not None:
            return LAYOUTS[self.layout][0](self.tensors)
        if self.stack:
            return st.Stack([st.Tensor(t) for t in self.tensors], axis=0)
        return st.Tensor(self.tensors[0], permute=self.permute)


def _sliced(x: np.ndarray) -> np.ndarray:
    # meshinit's scale then offset, each in float32 (read.scaled, read.offset)
    return x[4:28] * np.float32(2.0) + np.float32(0.5)


def _st() -> Any:
    from meshinit import safetensors as st

    return st


# The other targets of names=, each: (the target of the tensors' names, its value in
# numpy from the stored tensors, the plan shape from the stored one).
LAYOUTS: dict[str, tuple[Any, Any, Any]] = {
    "concat": (
        lambda ts: _st().Concat([_st().Tensor(t) for t in ts], axis=0),
        lambda xs: np.concatenate(xs, axis=0),
        lambda s: (2 * s[0], *s[1:]),
    ),
    "sliced": (  # a Tensor's index, scale and offset
        lambda ts: _st().Tensor(ts[0], index=np.s_[4:28], scale=2.0, offset=0.5),
        lambda xs: _sliced(xs[0]),
        lambda s: (24, *s[1:]),
    ),
    "merged": (  # out_shape: the stored (4, 8, 16) read as (32, 16)
        lambda ts: _st().Tensor(ts[0], out_shape=(32, 16)),
        lambda xs: xs[0].reshape(32, 16),
        lambda s: (32, 16),
    ),
    "padded": (  # 30 stored rows padded to 40: the last share is all padding
        lambda ts: _st().Pad(_st().Tensor(ts[0]), shape=(40, 16)),
        lambda xs: np.pad(xs[0], ((0, 10), (0, 0))),
        lambda s: (40, *s[1:]),
    ),
}


# the share of its stored tensors' bytes a layout reads (the rest: every byte)
LAYOUT_READS = {"sliced": 24 / 32}


@dataclasses.dataclass(frozen=True)
class Case:
    """A load of the object ``<object>.safetensors`` (the case's name where not given)
    onto ``params``, with ``fan_out``."""

    params: dict[str, Param]
    fan_out: bool | None = None
    object: str | None = None
    # local files: fan_out=None reads each block by each holder on one host (the page
    # cache serves them all), so the cases pass fan_out=True there, but this one
    local_default: bool = False


def _layers(prefix: str, n: int) -> tuple[str, ...]:
    return tuple(f"{prefix}.{i}" for i in range(n))


# Meshes (see :func:`meshes`): "auto" and "explicit" are (data=4, tensor=2) in device
# order, data across processes, tensor within one; "replicas" is (replica=4, tensor=2)
# where process 0 holds (r0, t0) and (r1, t0), process 1 (r0, t1) and (r1, t1), ...: one
# process holds two replicas of a block.
CASES: dict[str, Case] = {
    # every block on one device: nothing to share, nothing changes
    "sharded": Case(
        {
            "w": Param("auto", ("data", "tensor"), ("w",), (64, 32), holders=1),
            "e": Param("explicit", ("tensor", "data"), ("e",), (32, 16), 1, "bfloat16"),
        }
    ),
    # replicated over data, which spans the processes: each column half on all four
    "replicated_data": Case(
        {
            "w": Param("auto", (None, "tensor"), ("w",), (64, 32), holders=4),
            "v": Param("explicit", (None, "tensor"), ("v",), (40, 16), 4, "bfloat16"),
        }
    ),
    "replicated": Case(
        {
            "norm": Param("explicit", (None,), ("norm",), (64,), holders=4),
            "m": Param("auto", (None, None), ("m",), (36, 8), holders=4),
        }
    ),
    # leading sizes that 4 does not divide: 13 rows as 4 + 3 + 3 + 3, 7 as 2 + 2 + 2 + 1
    "odd": Case(
        {
            "o": Param("auto", (None, "tensor"), ("o",), (13, 24), holders=4),
            "p": Param("explicit", (None, None), ("p",), (7, 8), holders=4),
        }
    ),
    # a Stack of three layers: the split runs along each stored layer's rows (plan
    # dimension 1), 6 of 24 a process; not along the 3 layers, which 4 cannot share
    "stack": Case(
        {"stack": Param("auto", (None, None, "tensor"), _layers("layer", 3), (24, 16), 4)}
    ),
    # a transposed tensor: the split runs along plan dimension 1, the stored rows
    "transposed": Case(
        {"t": Param("explicit", ("tensor", None), ("wt",), (48, 32), 4, permute=(1, 0))}
    ),
    # the other layouts of names= (Fill reads nothing: never staged, tests/_checkpoint)
    "layouts": Case(
        {
            "cat": Param("auto", (None, "tensor"), ("c0", "c1"), (12, 16), 4, layout="concat"),
            "sl": Param("explicit", (None, "tensor"), ("sl",), (32, 16), 4, layout="sliced"),
            "mg": Param("auto", (None, "tensor"), ("mg",), (4, 8, 16), 4, layout="merged"),
        }
    ),
    "padded": Case({"pd": Param("auto", (None, "tensor"), ("pd",), (30, 16), 4, layout="padded")}),
    "two_replicas": Case(
        {
            "w2": Param("replicas", (None, "tensor"), ("w2",), (32, 16), holders=2),
            "r2": Param("replicas", (None,), ("r2",), (24,), holders=4),
        }
    ),
}
# today's reads, on the same objects
CASES["no_fan_out"] = dataclasses.replace(
    CASES["replicated_data"], fan_out=False, object="replicated_data"
)
CASES["odd_fan_out_true"] = dataclasses.replace(CASES["odd"], fan_out=True, object="odd")
CASES["local_default"] = dataclasses.replace(
    CASES["replicated_data"], object="replicated_data", local_default=True
)
CASES["sharded_no_fan_out"] = dataclasses.replace(CASES["sharded"], fan_out=False, object="sharded")
# One process's fetches fail for good (S3: a fault on its access key id): every process
# raises, none hangs, nothing is left alive; then a load that must agree again.
FAILING = Case({"f": Param("auto", (None, "tensor"), ("f",), (64, 32), holders=4)})
AFTER = "replicated_data"
FAILING_PROCESS = 2
# Identical unrolled layers at two depths: the load compiles as many programs at both.
DEPTHS = (2, 6)
DEPTH_LAYER = Param("explicit", (None, "tensor"), ("",), (32, 16), holders=4)


def depth_case(depth: int) -> Case:
    return Case(
        {
            f"layers.{i}.w": dataclasses.replace(DEPTH_LAYER, tensors=(f"layers.{i}.w",))
            for i in range(depth)
        },
        object="depth",
    )


def stacked_case(depth: int) -> Case:
    """The same layers as one ``Stack`` (a parameter ``stack<depth>``)."""
    layers = tuple(f"layers.{i}.w" for i in range(depth))
    stack = dataclasses.replace(DEPTH_LAYER, axes=(None, *DEPTH_LAYER.axes), tensors=layers)
    return Case({f"stack{depth}": stack}, object="depth")


def objects() -> dict[str, dict[str, Param]]:
    """Each object's tensors (by the params that read them): the cases', the failing
    one's and the deepest stack's."""
    out: dict[str, dict[str, Param]] = {}
    for name, case in {
        **CASES,
        "fail": FAILING,
        **{f"depth-{d}": depth_case(d) for d in DEPTHS},
        **{f"stacked-{d}": stacked_case(d) for d in DEPTHS},
    }.items():
        out.setdefault(case.object or name, {}).update(case.params)
    return out


def stored_tensors(seed: int = 58) -> dict[str, dict[str, np.ndarray]]:
    """Each object's stored tensors, seeded random values (bf16 through ml_dtypes)."""
    import ml_dtypes

    rng = np.random.default_rng(seed)
    out: dict[str, dict[str, np.ndarray]] = {}
    for obj, params in objects().items():
        tensors: dict[str, np.ndarray] = {}
        for p in params.values():
            dtype = ml_dtypes.bfloat16 if p.dtype == "bfloat16" else np.dtype(p.dtype)
            for t in p.tensors:
                if t not in tensors:  # a tensor several params read (the depth cases)
                    tensors[t] = rng.standard_normal(p.shape).astype(dtype)
        out[obj] = tensors
    return out


# A tiny Llama in MaxText's own model, on MaxText's mesh of (data=4, tensor=2): every
# weight replicated over data. Its checkpoint: seeded values of the Hugging Face tensors.
MAXTEXT_MODEL = "llama3.1-8b"


@functools.cache
def maxtext_config() -> Any:
    """MaxText's base.yml with ``MAXTEXT_MODEL`` made tiny, data=4 x tensor=2."""
    from maxtext_models import tiny_config

    mesh = dict(ici_data_parallelism=4, ici_fsdp_parallelism=1)
    return tiny_config(True, 2, model_name=MAXTEXT_MODEL, **mesh)


def maxtext_plan(config: Any) -> meshinit.Plan:
    """``meshinit.nnx.plan`` of MaxText's own NNX model of ``config``, on its mesh."""
    from maxtext.utils import maxtext_utils, model_creation_utils

    import meshinit.nnx

    mesh = maxtext_utils.get_mesh_from_config(config)
    factory = model_creation_utils.get_nnx_create_model_fn(config, mesh)
    with jax.set_mesh(mesh):
        return meshinit.nnx.plan(factory, rules=config.logical_axis_rules)


def write_maxtext_checkpoint(folder: str, seed: int = 58) -> None:
    """``folder/model.safetensors`` (seeded values of each Hugging Face tensor of the
    tiny Llama) and ``folder/config.json`` (its sizes)."""
    import maxtext_models
    from safetensors.numpy import save_file

    config = maxtext_config()
    rng = np.random.default_rng(seed)
    shapes = maxtext_models.hf_shapes(config)
    tensors = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    hf = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": config.emb_dim,
        "intermediate_size": config.mlp_dim,
        "num_attention_heads": config.num_query_heads,
        "num_key_value_heads": config.num_kv_heads,
        "num_hidden_layers": config.num_decoder_layers,
        "head_dim": config.head_dim,
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": False,
    }
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(hf, f)


def meshes() -> dict[str, Mesh]:
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    grid = np.array(devices).reshape(NUM_PROCESSES, LOCAL_DEVICES)
    # replica-major: process p's two devices are two replicas of the same tensor block
    replicas = np.array([[grid[2 * (r // 2) + t, r % 2] for t in range(2)] for r in range(4)])
    explicit = (AxisType.Explicit, AxisType.Explicit)
    return {
        "auto": Mesh(grid, ("data", "tensor")),
        "explicit": jax.make_mesh((4, 2), ("data", "tensor"), devices=list(grid.flat)),
        "replicas": Mesh(replicas, ("replica", "tensor"), axis_types=explicit),
    }


def case_plan(case: Case, named: dict[str, Mesh]) -> meshinit.Plan:
    zeros = jax.nn.initializers.zeros
    return meshinit.plan(
        {
            path: meshinit.param(
                p.plan_shape, zeros, axes=p.axes, mesh=named[p.mesh], dtype=p.dtype
            )
            for path, p in case.params.items()
        }
    )


@contextmanager
def recorded() -> Iterator[dict[str, list[float]]]:
    """The scalars the loads inside record: bytes read and bytes from peers, in order."""
    got: dict[str, list[float]] = {STORE_BYTES: [], PEER_BYTES: []}

    def on(event: str, value: float, **kwargs: Any) -> None:
        if event in got:
            got[event].append(value)

    jax.monitoring.register_scalar_listener(on)
    try:
        yield got
    finally:
        jax.monitoring.unregister_scalar_listener(on)


_compiles: list[str] = []


def _on_duration(event: str, duration: float, **kwargs: Any) -> None:
    if event == COMPILE:
        _compiles.append(event)


def blocks(array: jax.Array) -> dict[tuple, int]:
    """This process's distinct blocks of ``array`` (index -> bytes)."""
    return {
        tuple((i.start, i.stop) for i in s.index): s.data.nbytes for s in array.addressable_shards
    }


def holders(array: jax.Array) -> list[int]:
    """The fewest and most processes that hold one of this process's blocks."""
    by_block: dict[tuple, set[int]] = {}
    for device, index in array.sharding.devices_indices_map(array.shape).items():
        key = tuple((i.start, i.stop) for i in index)
        by_block.setdefault(key, set()).add(device.process_index)
    counts = [len(by_block[b]) for b in blocks(array)]
    return [min(counts), max(counts)]


class Runner:
    def __init__(self, process_id: int, folder: str, source: str) -> None:
        self.me = process_id
        self.folder = folder
        self.source = source
        self.named = meshes()
        self.expected = np.load(os.path.join(folder, "expected.npz"))

    def url(self, obj: str) -> str:
        return f"{self.source.rstrip('/')}/{obj}.safetensors"

    def options(self, **retry: Any) -> dict[str, Any] | None:
        if not self.source.startswith("s3://"):
            return None
        options: dict[str, Any] = {
            "access_key_id": f"proc-{self.me}",
            "secret_access_key": os.environ["AWS_SECRET_ACCESS_KEY"],
        }
        if retry:
            options["retry_config"] = retry
        return options

    def load(self, name: str, case: Case, **kwargs: Any) -> dict[str, jax.Array]:
        from meshinit import safetensors as st

        plan = case_plan(case, self.named)
        names = {path: p.names() for path, p in case.params.items()}
        given = case.fan_out
        if given is None and not self.source.startswith("s3://") and not case.local_default:
            given = True
        fan_out = {} if given is None else {"fan_out": given}
        kwargs.setdefault("storage_options", self.options())
        return st.load(
            plan, self.url(case.object or name), names=names, unused="ignore", **fan_out, **kwargs
        )

    def run_case(self, name: str, case: Case) -> dict[str, Any]:
        before = len(jax.live_arrays())
        with recorded() as got:
            loaded = self.load(name, case)
        dtypes = {path: p.dtype for path, p in case.params.items()}
        return self.check(name, case.object or name, loaded, dtypes, got, before)

    def check(
        self,
        name: str,
        obj: str,
        loaded: dict[str, jax.Array],
        dtypes: dict[str, str],
        got: dict[str, list[float]],
        before: int,
    ) -> dict[str, Any]:
        """Every addressable shard of ``loaded`` against ``expected.npz``'s
        ``<obj>/<path>`` (of ``dtypes``), bit for bit; what the load recorded; the
        bytes of this process's distinct blocks, on how many of its devices each is
        (``copies``), and how many processes hold each; and
        how many arrays are alive beyond the ``before`` count once they are deleted."""
        wrong: list[str] = []
        owned, copies, held, shards = {}, {}, {}, 0
        for path, array in loaded.items():
            want = self.expected[f"{obj}/{path}"]
            where = f"process {self.me}, {name}: {path}"
            if array.shape != want.shape or str(array.dtype) != dtypes[path]:
                wrong.append(
                    f"{where}: {array.dtype}{array.shape}, want {dtypes[path]}{want.shape}"
                )
                continue
            for s in array.addressable_shards:
                got_bytes = np.asarray(s.data).tobytes()
                if got_bytes != np.ascontiguousarray(want[s.index]).tobytes():
                    wrong.append(f"{where}: shard {s.index} on device {s.device.id} differs")
                shards += 1
            owned[path] = sum(blocks(array).values())
            copies[path] = sum(s.data.nbytes for s in array.addressable_shards) // owned[path]
            held[path] = holders(array)
        for array in loaded.values():
            array.delete()
        del loaded
        return {
            "read": got[STORE_BYTES],
            "from_peers": got[PEER_BYTES],
            "owned": owned,
            "copies": copies,
            "holders": held,
            "shards": shards,
            "wrong": wrong,
            "leaked": len(jax.live_arrays()) - before,
        }

    def maxtext(self) -> dict[str, Any]:
        """MaxText's tiny Llama (:func:`maxtext_plan`) from ``FOLDER/maxtext`` (a
        Hugging Face checkpoint) through ``meshinit.maxtext.names``."""
        import meshinit.maxtext

        plan = maxtext_plan(maxtext_config())
        before = len(jax.live_arrays())
        with recorded() as got:
            loaded = meshinit.safetensors.load(
                plan,
                os.path.join(self.folder, "maxtext"),
                names=meshinit.maxtext.names(maxtext_config()),
                fan_out=True,  # local files on one host: asked for
            )
        dtypes = {e.path: str(e.spec.dtype) for e in plan.entries}
        return self.check("maxtext", "maxtext", loaded, dtypes, got, before)

    def compiles(self) -> dict[str, Any]:
        """Programs compiled by the load of :data:`DEPTHS` identical layers, caches
        cleared before each: unrolled with fan-out and without, and as one ``Stack``;
        and what the loads' checks found."""
        out: dict[str, Any] = {"wrong": [], "leaked": 0}
        for label, make, fan_out in (
            ("fan_out", depth_case, None),
            ("no_fan_out", depth_case, False),
            ("stacked", stacked_case, None),
        ):
            counts = []
            for depth in DEPTHS:
                case = dataclasses.replace(make(depth), fan_out=fan_out)
                meshinit.clear_cache()
                jax.clear_caches()
                start = len(_compiles)
                result = self.run_case("depth", case)
                counts.append(len(_compiles) - start)
                out["wrong"] += result["wrong"]
                out["leaked"] += result["leaked"]
            out[label] = counts
        return out

    def failing(self) -> dict[str, Any]:
        """The failing object (S3: each fetch by process FAILING_PROCESS after its header
        read answers 503, for good): how each process ended, how long it took, and how
        many arrays it left alive."""
        before = len(jax.live_arrays())
        start = time.monotonic()
        quick = {
            "max_retries": 0,
            "backoff": {
                "init_backoff": datetime.timedelta(milliseconds=10),
                "max_backoff": datetime.timedelta(milliseconds=50),
                "base": 2.0,
            },
            "retry_timeout": datetime.timedelta(seconds=5),
        }
        try:
            loaded = self.load("fail", FAILING, storage_options=self.options(**quick))
            outcome = "returned"
            for array in loaded.values():
                array.delete()
        except meshinit.PeerFailure as e:
            outcome = "PeerFailure: " + str(e)
        except Exception as e:
            outcome = f"{type(e).__name__}: {e}"
        return {
            "outcome": outcome[:2000],
            "seconds": time.monotonic() - start,
            "leaked": len(jax.live_arrays()) - before,
        }


def main(process_id: int, port: int, folder: str, source: str) -> int:
    helpers.join_cpu_job(process_id, port, NUM_PROCESSES, LOCAL_DEVICES)
    jax.monitoring.register_event_duration_secs_listener(_on_duration)
    runner = Runner(process_id, folder, source)
    results: dict[str, Any] = {}
    timing: dict[str, float] = {}
    steps: list[tuple[str, Callable[[], Any]]] = [
        *((name, lambda c=case, n=name: runner.run_case(n, c)) for name, case in CASES.items()),
        ("compiles", runner.compiles),
    ]
    if os.path.isdir(os.path.join(folder, "maxtext")):  # written where maxtext imports
        steps.append(("maxtext", runner.maxtext))
    if source.startswith("s3://"):
        steps += [
            ("failing", runner.failing),
            ("after", lambda: runner.run_case(AFTER, CASES[AFTER])),
        ]
    for name, step in steps:
        start = time.monotonic()
        results[name] = step()
        timing[name] = round(time.monotonic() - start, 2)
    results["timing"] = timing
    print("RESULT " + json.dumps({"process": process_id, "results": results}), flush=True)
    return 0


if __name__ == "__main__":
    helpers.finish_worker(
        lambda: main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
    )
