"""One process of test_quantized.py's multi-process load: ``python quantized_worker.py
PROCESS_ID PORT FOLDER``. Two processes of 4 CPU devices join ``jax.distributed`` on
127.0.0.1; each loads the FP8 checkpoint in FOLDER dequantized onto a (2, 4) mesh over
all 8 devices, split across the processes, replicated across them, transposed, and
through a Concat whose boundary only one process's blocks cross, and prints, per
layout, whether each of its shards has ``weight_dequant``'s bits; and the MXFP4 pair
in FOLDER/mx (gpt-oss's layout) split and replicated alike, against the numpy port of
transformers' ``convert_moe_packed_tensors`` in FOLDER/mx/want.npy."""

import json
import sys

import jax


def main(process_id: int, port: int, folder: str) -> None:
    jax.config.update("jax_num_cpu_devices", 4)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
    import jax.numpy as jnp
    import ml_dtypes
    import numpy as np
    from jax.sharding import Mesh

    import meshinit
    from meshinit import safetensors as st

    w = np.load(f"{folder}/w.npy").view(ml_dtypes.float8_e4m3fn)
    s = np.load(f"{folder}/s.npy")
    wide = np.repeat(np.repeat(s, 128, 0), 128, 1)[: w.shape[0], : w.shape[1]]
    want = (w.astype(np.float32) * wide).astype(ml_dtypes.bfloat16).view(np.uint16)
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("x", "y"))
    rows, cols = w.shape
    layouts = {
        "split": (("x", "y"), (rows, cols), "w", want),
        "replicated": ((None, "y"), (rows, cols), "w", want),
        "transposed": (("y", "x"), (cols, rows), st.Tensor("w", permute=(1, 0)), want.T),
        # process 0's blocks cross the parts' boundary (two tiles), process 1's do not
        "fused": (
            ("x", "y"),
            (rows + 200, cols),
            st.Concat([st.Tensor("w", index=np.s_[:200]), "w"], axis=0),
            np.concatenate([want[:200], want]),
        ),
    }
    out = {}
    for name, (axes, shape, target, ref) in layouts.items():
        zeros = jax.nn.initializers.zeros
        param = meshinit.param(shape, zeros, dtype=jnp.bfloat16, axes=axes, mesh=mesh)
        got = st.load(meshinit.plan({"a": param}), folder, names={"a": target})["a"]
        out[name] = [
            bool((np.asarray(x.data).view(np.uint16) == ref[x.index]).all())
            for x in got.addressable_shards
        ]
    want = np.load(f"{folder}/mx/want.npy")  # [E, K, R] bfloat16 bits
    for name, axes in {
        "mxfp4 split": ("x", "y", None),
        "mxfp4 replicated": (None, "y", "x"),
    }.items():
        zeros = jax.nn.initializers.zeros
        param = meshinit.param(want.shape, zeros, dtype=jnp.bfloat16, axes=axes, mesh=mesh)
        got = st.load(meshinit.plan({"gate_up_proj": param}), f"{folder}/mx")["gate_up_proj"]
        out[name] = [
            bool((np.asarray(x.data).view(np.uint16) == want[x.index]).all())
            for x in got.addressable_shards
        ]
    print(json.dumps(out))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
