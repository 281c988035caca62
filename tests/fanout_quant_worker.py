"""One process of ``tests/guarantees/test_fanout_quant.py`` (issue 67): FP8 and MXFP4
parameters through fan-out; not collected by pytest.

Run: python tests/fanout_quant_worker.py PROCESS_ID PORT FOLDER PROCESSES

Each process joins ``jax.distributed`` on 127.0.0.1 with 2 CPU devices (PROCESSES of
them), plans :data:`PARAMS` on a (data=PROCESSES, tensor=2) mesh, data across the
processes, and loads the FP8 checkpoint in FOLDER (float8_e4m3fn weights, float32
``*_scale_inv`` per 128 x 128 block) dequantized to bfloat16, with fan-out and
without. Of each load it reports the bytes read and from peers (the load's
``jax.monitoring`` scalars), the stored bytes of its own distinct blocks and of the
scales its blocks read, and which of its shards differ from ``FOLDER/expected.npz``
(DeepSeek's ``weight_dequant`` in numpy, as bfloat16 bits); then the same of the
MXFP4 checkpoint in ``FOLDER/mxfp4`` (:data:`MX_PARAMS`, against transformers'
``convert_moe_packed_tensors`` in numpy: ``FOLDER/mxfp4/expected.npz``). It prints one
``RESULT {json}`` line.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from typing import Any

import fanout_worker
import helpers
import jax
import numpy as np

LOCAL_DEVICES = 2
STORE_BYTES, PEER_BYTES = fanout_worker.STORE_BYTES, fanout_worker.PEER_BYTES
BLOCK = 128


@dataclasses.dataclass(frozen=True)
class Param:
    """A bfloat16 parameter dequantized from the FP8 ``tensors`` (each of ``shape``
    as stored), one, a ``Stack`` along 0 (``stack``), a ``Concat`` along 0
    (``concat``) or transposed (``permute``), placed with ``axes``; ``holders``: how
    many processes hold each of its blocks (``"all"``: every one)."""

    axes: tuple[str | None, ...]
    tensors: tuple[str, ...]
    shape: tuple[int, ...]
    holders: str
    how: str = "one"  # one, stack, concat, permute

    def names(self) -> Any:
        from meshinit import safetensors as st

        parts = [st.Tensor(t) for t in self.tensors]
        if self.how == "stack":
            return st.Stack(parts, axis=0)
        if self.how == "concat":
            return st.Concat(parts, axis=0)
        if self.how == "permute":
            return st.Tensor(self.tensors[0], permute=(1, 0))
        return parts[0]

    def expected(self, values: dict[str, np.ndarray]) -> np.ndarray:
        got = [values[t] for t in self.tensors]
        if self.how == "stack":
            return np.stack(got)
        if self.how == "concat":
            return np.concatenate(got)
        return got[0].T if self.how == "permute" else got[0]


def _experts(n: int) -> tuple[str, ...]:
    return tuple(f"experts.{i}.w" for i in range(n))


PARAMS = {
    # replicated over data (every process): rows split 64 a process (4), or 86, 86, 84
    "rep": Param((None, "tensor"), ("rep",), (256, 384), "all"),
    # 12 experts stacked: whole experts a process (3 or 4 of them)
    "experts": Param((None, None, "tensor"), _experts(12), (64, 256), "all", "stack"),
    # transposed: split along the stored rows (plan dimension 1)
    "t": Param(("tensor", None), ("t",), (128, 256), "all", "permute"),
    # two tensors joined (their parts' tiles: encodings.fp8.joins)
    "cat": Param((None, "tensor"), ("c0", "c1"), (96, 256), "all", "concat"),
    # every block on one device: nothing to share
    "split": Param(("data", "tensor"), ("split",), (240, 128), "one"),
}


MX_GROUP = 32
MX_PARAMS = {
    # gpt-oss's experts X [E, K, R] (X_blocks [E, R, K/32, 16], X_scales [E, R, K/32]),
    # replicated over data, K split by tensor: 12 experts, 3 or 4 a process's share
    "mx_rep": Param((None, "tensor", None), ("mx_rep",), (12, 64, 32), "all"),
    # two layers stacked, R split by tensor
    "mx_layers": Param(
        (None, None, None, "tensor"), ("mx_l0", "mx_l1"), (12, 64, 16), "all", "stack"
    ),
    # permuted to [E, R, K], K split by tensor
    "mx_t": Param((None, None, "tensor"), ("mx_t",), (12, 64, 16), "all", "permute"),
    # every block on one device: nothing to share
    "mx_split": Param(("data", "tensor", None), ("mx_split",), (12, 64, 16), "one"),
    # K's blocks of 48 values cut a group of 32: read by each holder (a fallback)
    "mx_cut": Param((None, "tensor", None), ("mx_cut",), (12, 96, 16), "all"),
}
"""MXFP4 parameters (each tensor's shape: transformers' ``X``, ``[E, K, R]``), from
their own checkpoint (``FOLDER/mxfp4``: its config declares ``mxfp4``)."""


def mx_checkpoint(seed: int = 68) -> dict[str, np.ndarray]:
    """The MXFP4 checkpoint: each ``X`` as ``X_blocks`` (every nibble) and ``X_scales``
    (exponents about 2^+-10)."""
    rng = np.random.default_rng(seed)
    out = {}
    for p in MX_PARAMS.values():
        e, k, r = p.shape
        for t in p.tensors:
            out[f"{t}_blocks"] = rng.integers(0, 256, (e, r, k // MX_GROUP, 16), dtype=np.uint8)
            out[f"{t}_scales"] = rng.integers(117, 137, (e, r, k // MX_GROUP), dtype=np.uint8)
    return out


def mx_dequantized(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each ``X`` as transformers' ``convert_moe_packed_tensors`` gives it in bfloat16
    (a table value times 2^(byte - 127), rounded once), as bfloat16 bits."""
    import ml_dtypes

    table = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
    out = {}
    for name, blocks in tensors.items():
        if not name.endswith("_blocks"):
            continue
        x = name.removesuffix("_blocks")
        values = np.stack([table[blocks & 0x0F], table[blocks >> 4]], axis=-1)
        exps = tensors[f"{x}_scales"].astype(np.int32)[..., None, None] - 127
        values = np.ldexp(values, exps).astype(ml_dtypes.bfloat16)
        e, r, g, b = blocks.shape
        out[x] = values.reshape(e, r, g * 2 * b).swapaxes(1, 2).view(np.uint16)
    return out


def mx_names(p: Param) -> Any:
    from meshinit import safetensors as st

    if p.how == "permute":
        return st.Tensor(p.tensors[0], permute=(0, 2, 1))
    return p.names()


def mx_expected(p: Param, values: dict[str, np.ndarray]) -> np.ndarray:
    got = [values[t] for t in p.tensors]
    if p.how == "permute":
        return got[0].transpose(0, 2, 1)
    return p.expected(values)


def mx_plan_shape(p: Param) -> tuple[int, ...]:
    if p.how == "permute":
        return (p.shape[0], p.shape[2], p.shape[1])
    return plan_shape(p)


def mx_bytes(p: Param) -> int:
    """The stored bytes of ``p``'s tensors: half a byte a value, and an exponent a group."""
    return len(p.tensors) * math.prod(p.shape) * (16 + 1) // (2 * 16)


def plan_shape(p: Param) -> tuple[int, ...]:
    if p.how == "stack":
        return (len(p.tensors), *p.shape)
    if p.how == "concat":
        return (len(p.tensors) * p.shape[0], *p.shape[1:])
    return p.shape[::-1] if p.how == "permute" else p.shape


def checkpoint(seed: int = 67) -> dict[str, np.ndarray]:
    """The checkpoint's tensors: each weight in float8_e4m3fn, its scales in float32."""
    import ml_dtypes

    rng = np.random.default_rng(seed)
    out = {}
    for p in PARAMS.values():
        for t in p.tensors:
            out[t] = (rng.standard_normal(p.shape) * 40).astype(ml_dtypes.float8_e4m3fn)
            grid = tuple(-(-n // BLOCK) for n in p.shape)
            out[f"{t}_scale_inv"] = rng.uniform(1e-4, 1e-2, grid).astype(np.float32)
    return out


def dequantized(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each weight as DeepSeek's ``weight_dequant`` gives it, in bfloat16 bits."""
    import ml_dtypes

    out = {}
    for name, w in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        s = tensors[f"{name}_scale_inv"]
        wide = np.repeat(np.repeat(s, BLOCK, 0), BLOCK, 1)[: w.shape[0], : w.shape[1]]
        value = w.astype(np.float32) * wide
        out[name] = value.astype(ml_dtypes.bfloat16).view(np.uint16)
    return out


def scale_bytes(p: Param) -> int:
    """The bytes of the scales a process whose devices hold a block of ``p`` reads (a
    local file's: whole)."""
    return len(p.tensors) * 4 * math.prod(-(-n // BLOCK) for n in p.shape)


def _mx_load(plan: Any, folder: str, names: Any, fan_out: bool, want: Any) -> dict[str, Any]:
    """One load of the MXFP4 checkpoint: its bytes read and from peers, each
    parameter's stored bytes of this process's distinct blocks, and its wrong shards."""
    from meshinit import safetensors as st

    with fanout_worker.recorded() as got:
        loaded = st.load(plan, folder, names=names, fan_out=fan_out)
    wrong, owned = [], {}
    for path, p in MX_PARAMS.items():
        expect = mx_expected(p, want)
        distinct = {}
        for shard in loaded[path].addressable_shards:
            bits = np.asarray(shard.data).view(np.uint16)
            if not (bits == expect[shard.index]).all():
                wrong.append(f"{path} {shard.index}")
            distinct[tuple((s.start, s.stop) for s in shard.index)] = bits.size
        owned[path] = sum(distinct.values()) * 17 // 32  # stored: 17 bytes a 32 values
        loaded[path].delete()
    return {"read": got[STORE_BYTES], "from_peers": got[PEER_BYTES], "owned": owned, "wrong": wrong}


def main(process_id: int, port: int, folder: str, processes: int) -> int:
    helpers.join_cpu_job(process_id, port, processes, LOCAL_DEVICES)
    import jax.numpy as jnp
    from jax.sharding import Mesh

    import meshinit
    from meshinit import safetensors as st

    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = Mesh(np.array(devices).reshape(processes, LOCAL_DEVICES), ("data", "tensor"))
    zeros = jax.nn.initializers.zeros
    plan = meshinit.plan(
        {
            path: meshinit.param(plan_shape(p), zeros, dtype=jnp.bfloat16, axes=p.axes, mesh=mesh)
            for path, p in PARAMS.items()
        }
    )
    names = {path: p.names() for path, p in PARAMS.items()}
    expected = np.load(f"{folder}/expected.npz")
    results: dict[str, Any] = {}
    mx_plan = meshinit.plan(
        {
            path: meshinit.param(
                mx_plan_shape(p), zeros, dtype=jnp.bfloat16, axes=p.axes, mesh=mesh
            )
            for path, p in MX_PARAMS.items()
        }
    )
    mx_want = dict(np.load(f"{folder}/mxfp4/expected.npz"))
    mx_names_ = {path: mx_names(p) for path, p in MX_PARAMS.items()}
    for mode, fan_out in (("mx_fan_out", True), ("mx_no_fan_out", False)):
        results[mode] = _mx_load(mx_plan, f"{folder}/mxfp4", mx_names_, fan_out, mx_want)
    # True, not None: these are local files and every process runs on this one host,
    # where fan_out=None lets each holder read them (the page cache serves them all)
    for mode, fan_out in (("fan_out", True), ("no_fan_out", False)):
        with fanout_worker.recorded() as got:
            loaded = st.load(plan, folder, names=names, fan_out=fan_out)
        wrong, owned, scales = [], {}, 0
        for path, p in PARAMS.items():
            want = p.expected(dict(expected))
            distinct = {}
            for shard in loaded[path].addressable_shards:
                bits = np.asarray(shard.data).view(np.uint16)
                if not (bits == want[shard.index]).all():
                    wrong.append(f"{path} {shard.index}")
                distinct[tuple((s.start, s.stop) for s in shard.index)] = bits.size
            owned[path] = sum(distinct.values())  # stored: one byte an element
            scales += scale_bytes(p) if distinct else 0
        for a in loaded.values():
            a.delete()
        results[mode] = {
            "read": got[STORE_BYTES],
            "from_peers": got[PEER_BYTES],
            "owned": owned,
            "scales": scales,
            "wrong": wrong,
        }
    print("RESULT " + json.dumps({"process": process_id, "results": results}), flush=True)
    return 0


if __name__ == "__main__":
    helpers.finish_worker(
        lambda: main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
    )
