"""Block scales of remote float8 weights: of a scale in object storage, only the rows
and columns that cover the process's blocks are fetched (moto's S3 on localhost), and
a failed read names the object, the bytes and the scale."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import Reads, plan_for
from storage_servers import s3_server_fixture  # noqa: F401

import meshinit
from meshinit import safetensors as st

pytest.importorskip("obstore")
pytest.importorskip("moto")
safetensors_numpy = pytest.importorskip("safetensors.numpy")


def saved(tensors):
    data = safetensors_numpy.save(tensors)
    return data, 8 + int.from_bytes(data[:8], "little")


def test_a_scale_in_its_own_object_is_fetched_where_the_blocks_read_it(s3_server):
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((640, 520)) * 40).astype(ml_dtypes.float8_e4m3fn)
    s = rng.uniform(1e-3, 1e-2, (5, 5)).astype(np.float32)
    weights, first = saved({"w": w})
    scales, header = saved({"w_scale_inv": s})
    bucket = s3_server.bucket()
    s3_server.put(f"{bucket}/a.safetensors", weights)
    s3_server.put(f"{bucket}/b.safetensors", scales)
    urls = [f"s3://{bucket}/a.safetensors", f"s3://{bucket}/b.safetensors"]
    plan = plan_for({"p": (300, 260)}, dtype=jnp.bfloat16, axes=("fsdp", "tensor"))
    names = {"p": st.Tensor("w", index=np.s_[100:400, 130:390])}  # scale rows 0-3, cols 1-3
    s3_server.reset()
    with Reads() as reads:
        got = st.load(plan, urls, names=names)["p"]
    wide = np.repeat(np.repeat(s, 128, 0), 128, 1)[:640, :520]
    want = (w.astype(np.float32) * wide).astype(ml_dtypes.bfloat16)[100:400, 130:390]
    assert (np.asarray(got).view(np.uint16) == want.view(np.uint16)).all()
    served = [r for r in s3_server.counters.log if r.method == "GET" and r.range]
    from_scales = [r for r in served if r.path.endswith("b.safetensors") and r.range[0] >= header]
    # rows 0-3 of the scale, columns 1-3 of each: four runs of 12 bytes, 8 apart
    assert sorted(r.range for r in from_scales) == [
        (header + (5 * i + 1) * 4, header + (5 * i + 4) * 4) for i in range(4)
    ]
    weights_sent = [r for r in served if r.path.endswith("a.safetensors") and r.range[0] >= first]
    assert reads.values == [48 + sum(r.sent for r in weights_sent)]  # what was fetched


def test_a_failed_scale_read_names_the_object_the_bytes_and_the_scale(s3_server, new_arrays):
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((256, 256)) * 40).astype(ml_dtypes.float8_e4m3fn)
    s = rng.uniform(1e-3, 1e-2, (2, 2)).astype(np.float32)
    bucket = s3_server.bucket()
    s3_server.put(f"{bucket}/a.safetensors", saved({"w": w})[0])
    s3_server.put(f"{bucket}/b.safetensors", saved({"w_scale_inv": s})[0])
    urls = [f"s3://{bucket}/a.safetensors", f"s3://{bucket}/b.safetensors"]
    plan = plan_for({"w": (256, 256)}, dtype=jnp.bfloat16)
    s3_server.fail("*b.safetensors", 403, times=100, after=1)  # its header read passes
    # new arrays only: a count of jax.live_arrays() also drops when the load happens to
    # collect arrays that earlier tests left to the garbage collector (it did, 55 to 38)
    with new_arrays() as made, pytest.raises(meshinit.PlanError, match="a read failed") as e:
        st.load(plan, urls)
    said = str(e.value)
    assert f"s3://{bucket}/b.safetensors" in said
    assert "(the block scale 'w_scale_inv' of w)" in said and "access is denied" in said
    assert made == [], f"half-loaded arrays left alive: {made}"
