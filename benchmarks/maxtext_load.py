"""A Hugging Face Llama checkpoint into MaxText's scanned model: MaxText's own route
against ``meshinit.safetensors.load``, on the same file, in fresh processes (issue 41).

The checkpoint is one ``model.safetensors`` in Hugging Face's names and layouts, bf16,
of a Llama of ``--layers`` layers (default 36, 2.01 GB: emb 1536, 12 query heads and 4 kv heads
of 128, mlp 4096, vocab 32000; with its ``config.json``). MaxText's model is its NNX ``Transformer``
on that config (``weight_dtype=bfloat16``, ``scan_layers=True``) on MaxText's own mesh
(fsdp=4, tensor=2) of 8 simulated CPU devices, with MaxText's own logical axis rules.

- ``maxtext``: MaxText's own route, the one ``from_pretrained`` takes when it converts:
  ``to_maxtext.main`` (its lazy loader, its Llama mapping and hooks, its stacking, then
  the orbax save through its checkpoint manager, 8 simulated devices), in one process;
  then ``from_pretrained`` with ``load_parameters_path`` (the sharded model, then the
  orbax restore of its params) in a second, as MaxText runs them. The only patch: the
  entry ``HF_MODEL_CONFIGS["llama3.1-8b"]``, so that MaxText's mapping sees this
  model's layers and head size rather than the 8B's.
- ``meshinit``: ``meshinit.nnx.plan`` of MaxText's own factory, ``meshinit.safetensors
  .load`` with the ``names=`` table of tests/maxtext_models.py (``Stack`` over the
  layers), then ``meshinit.nnx.init(factory, existing=loaded)``: the same model.

Each process times its work from after its imports and config until every array is
ready, and reports its peak RSS (``ru_maxrss``, the whole process) and its RSS when the
work began. A route's time is the sum of its processes' times, its peak RSS the largest
of theirs. On simulated CPU devices the placed arrays are the process's own memory, so
each process also reports its overhead beyond them (issue 57): its peak RSS less its
RSS when the work began less the bytes of the model's placed shards (every shard on
every device, a replicated parameter once per device); a route's overhead is the
largest of its processes'. Afterwards each route's model is fingerprinted: every Param's bytes and
sharding must be the same in both, or the run fails. Best of ``--repeats`` rounds, the
routes taking turns; the file is read once first, so the page cache is warm for both.

Goals (issue 41): meshinit at most 0.2x MaxText's time and at most 0.5x its peak RSS.
Issue 49 adds a fourth process, ``framework``: the same load with
``names=meshinit.maxtext.names(config)`` (MaxText's own map and hooks, followed at
load time against the checkpoint's ``config.json``) in place of the hand-written table;
goals: at most 0.2x MaxText's time and 0.4x its peak RSS, within 1.2x of the
hand-written table's time, bytes read / owned 1.000 (printed for both tables).

MaxText needs Python 3.12 and jax >= 0.11.1 (``pip install 'maxtext[tpu]==0.2.5'`` in a
venv of its own). Where it is not installed, this prints a note and exits 0.

Run: python benchmarks/maxtext_load.py [--layers 16] [--repeats 2] [--dir DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MODEL = "llama3.1-8b"  # MaxText's Llama family: its mapping and hooks; sizes below
SIZE = {
    "base_emb_dim": 1536,
    "base_num_query_heads": 12,
    "base_num_kv_heads": 4,
    "head_dim": 128,
    "base_mlp_dim": 4096,
    "vocab_size": 32000,
}


def config_for(layers: int, **extra):
    from maxtext.configs import pyconfig
    from maxtext.utils.globals import MAXTEXT_CONFIGS_DIR

    args = {
        "model_name": MODEL,
        "override_model_config": True,
        **SIZE,
        "base_num_decoder_layers": layers,
        "weight_dtype": "bfloat16",
        "scan_layers": True,
        "max_target_length": 16,
        "per_device_batch_size": 1,
        "ici_fsdp_parallelism": 4,
        "ici_tensor_parallelism": 2,
        "dcn_data_parallelism": 1,
        "hardware": "cpu",
        "dataset_type": "synthetic",
        "skip_jax_distributed_system": True,
        "jax_cache_dir": "",  # base.yml turns jax's persistent cache on: cold means cold
        "log_config": False,
        **extra,
    }
    argv = ["", os.path.join(MAXTEXT_CONFIGS_DIR, "base.yml")]
    return pyconfig.initialize(argv + [f"{k}={v}" for k, v in args.items()]), argv, args


def tests_helpers():
    sys.path.insert(0, str(ROOT / "tests"))
    import maxtext_models

    return maxtext_models


def write(directory: Path, layers: int) -> int:
    """The Hugging Face checkpoint: every tensor of ``hf_shapes``, bf16, one file."""
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import save_file

    config, _, _ = config_for(layers)
    rng = np.random.default_rng(0)
    tensors = {
        name: (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16)
        for name, shape in tests_helpers().hf_shapes(config).items()
    }
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(hf_config(layers).to_dict()))
    return sum(a.nbytes for a in tensors.values())


def hf_config(layers: int):
    """The Hugging Face config of the checkpoint: its config.json, and the entry MaxText's
    own conversion looks the model up in."""
    import transformers

    return transformers.LlamaConfig(
        num_hidden_layers=layers,
        head_dim=SIZE["head_dim"],
        hidden_size=SIZE["base_emb_dim"],
        num_attention_heads=SIZE["base_num_query_heads"],
        num_key_value_heads=SIZE["base_num_kv_heads"],
        intermediate_size=SIZE["base_mlp_dim"],
        vocab_size=SIZE["vocab_size"],
    )


def fingerprint(params: dict) -> dict[str, str]:
    """Each Param's bytes (sha256) and sharding, by MaxText's path."""
    import numpy as np

    out = {}
    for path, array in sorted(params.items()):
        digest = hashlib.sha256()
        for shard in sorted(array.addressable_shards, key=lambda s: s.device.id):
            digest.update(str(shard.index).encode())
            digest.update(np.asarray(shard.data).tobytes())
        s = array.sharding
        out[path] = f"{digest.hexdigest()} {s.spec} {s.mesh.axis_names} {s.mesh.devices.shape}"
    return out


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def params_of(model) -> dict:
    from flax import nnx

    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    return {".".join(map(str, p)): v.get_value() for p, v in flat}


def case(step: str, directory: str, layers: int) -> dict:
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    from maxtext.utils import maxtext_utils, model_creation_utils

    out = Path(directory) / "maxtext"
    if step == "convert":  # MaxText's to_maxtext, as its __main__ runs it
        from maxtext.checkpoint_conversion import to_maxtext

        jax.config.update("jax_default_prng_impl", "unsafe_rbg")
        config, argv, args = config_for(layers, base_output_directory=out)
        to_maxtext.HF_MODEL_CONFIGS[MODEL] = hf_config(layers)
        start_rss, start = rss(), time.perf_counter()
        to_maxtext.main(
            argv + [f"{k}={v}" for k, v in args.items()],
            lazy_load_tensors=True,
            hf_model_path=directory,
            simulated_cpu_devices_count=8,
        )
        return {"seconds": time.perf_counter() - start, "rss": start_rss, "peak": peak_rss()}

    if step == "restore":  # from_pretrained of the converted checkpoint
        config, _, _ = config_for(layers, load_parameters_path=out / "0" / "items")
        mesh = maxtext_utils.get_mesh_from_config(config)
        start_rss, start = rss(), time.perf_counter()
        model = model_creation_utils.from_pretrained(config, mesh)
    else:  # meshinit: plan, load, init with the loaded weights
        import meshinit

        config, _, _ = config_for(layers)
        mesh = maxtext_utils.get_mesh_from_config(config)
        start_rss, start = rss(), time.perf_counter()
        if step == "framework":  # MaxText's own map, built at load time
            table = meshinit.maxtext.names(config)
        else:  # the hand-written table of tests/maxtext_models.py
            table = tests_helpers().names_table(config)
        read = []
        jax.monitoring.register_scalar_listener(
            lambda name, value, **_: read.append(value) if name == BYTES_READ else None
        )
        factory = model_creation_utils.get_nnx_create_model_fn(config, mesh)
        rules = config.logical_axis_rules
        with jax.set_mesh(mesh):
            plan = meshinit.nnx.plan(factory, rules=rules)
        loaded = meshinit.safetensors.load(plan, directory, names=table)
        with jax.set_mesh(mesh):
            model = meshinit.nnx.init(factory, rules=rules, existing=loaded)
    params = params_of(model)
    jax.block_until_ready(params)
    seconds, peak = time.perf_counter() - start, peak_rss()
    nbytes = sum(a.nbytes for a in params.values())
    prints = fingerprint(params)
    out = {"seconds": seconds, "rss": start_rss, "peak": peak, "nbytes": nbytes, "params": prints}
    out["placed"] = placed(params)
    if step not in ("convert", "restore"):
        out["read"], out["owned"] = sum(read), owned(loaded)
    return out


BYTES_READ = "/meshinit/safetensors/bytes_read"


def placed(params: dict) -> int:
    """The bytes of every shard of every array on every device: on simulated CPU
    devices, the process memory the placed model takes."""
    return sum(s.data.nbytes for a in params.values() for s in a.addressable_shards)


def overhead(run: dict, model_bytes: int) -> int:
    """A process's peak RSS beyond its RSS at the start of its work and the model."""
    return run["peak"] - run["rss"] - model_bytes


def owned(loaded: dict) -> int:
    """The bytes of this process's distinct blocks of every loaded array."""
    total = 0
    for array in loaded.values():
        blocks = {str(s.index): s.data.nbytes for s in array.addressable_shards}
        total += sum(blocks.values())
    return total


def spawn(step: str, directory: str, layers: int, timeout: float) -> dict:
    command = [sys.executable, __file__, "--case", step, directory, str(layers)]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}  # this checkout
    try:
        r = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    for line in reversed(r.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line.removeprefix("RESULT "))
    tail = [line for line in r.stderr.splitlines() if line.strip()][-3:]
    return {"error": f"exit {r.returncode}: " + " | ".join(tail)[-600:]}


def gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dir", help="where to write the checkpoint (default: a temporary folder)")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--case", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:
        step, directory, layers = args.case
        print("RESULT " + json.dumps(case(step, directory, int(layers))))
        return 0
    if importlib.util.find_spec("maxtext") is None:
        print(
            "benchmarks/maxtext_load.py: skipped: maxtext is not installed here (it needs "
            "Python 3.12: pip install 'maxtext[tpu]==0.2.5' in a venv of its own)"
        )
        return 0
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        nbytes = write(Path(tmp), args.layers)
        Path(tmp, "model.safetensors").read_bytes()  # the page cache is warm for both
        print(f"checkpoint: {gb(nbytes)} in {tmp}", file=sys.stderr)
        best: dict[str, dict] = {}
        failed, compared = [], 0
        for _ in range(args.repeats):
            runs = {}
            for step in ("convert", "restore", "meshinit", "framework"):
                r = runs[step] = spawn(step, tmp, args.layers, args.timeout)
                shown = r.get("error") or f"{r['seconds']:.2f} s, peak RSS {gb(r['peak'])}"
                print(f"{step}: {shown}", file=sys.stderr)
            if any("error" in r for r in runs.values()):
                failed += [f"{s}: {r['error']}" for s, r in runs.items() if "error" in r]
                continue
            model = runs["restore"]["placed"]  # the same model in every route (checked)
            route = {
                "maxtext": {
                    "seconds": runs["convert"]["seconds"] + runs["restore"]["seconds"],
                    "peak": max(runs["convert"]["peak"], runs["restore"]["peak"]),
                    "rss": runs["restore"]["rss"],
                    "over": max(overhead(runs[s], model) for s in ("convert", "restore")),
                },
                "meshinit": runs["meshinit"] | {"over": overhead(runs["meshinit"], model)},
                "framework": runs["framework"] | {"over": overhead(runs["framework"], model)},
            }
            for step in ("convert", "restore"):
                runs[step]["over"] = overhead(runs[step], model)
            theirs = runs["restore"].pop("params")
            for name in ("meshinit", "framework"):
                ours = runs[name].pop("params")
                if theirs != ours:  # every round: the same model, or the run fails
                    differ = [p for p in theirs if theirs[p] != ours.get(p)] or sorted(ours)
                    failed.append(f"{name}: the models differ (bytes or sharding) at {differ[:5]}")
            compared = len(ours)
            for name, r in route.items():
                if name not in best or r["seconds"] < best[name]["seconds"]:
                    best[name] = r | {"parts": runs}
    if "maxtext" in best:
        m, t = best["meshinit"], best["maxtext"]
        parts = t["parts"]
        model = parts["restore"]["placed"]
        print(
            f"| {args.layers}-layer Llama, {gb(nbytes)} bf16 | time | peak RSS | RSS at start "
            f"| peak beyond the start and the {gb(model)} placed |"
        )
        print("|---|---|---|---|---|")
        for name, r in (("convert", parts["convert"]), ("restore", parts["restore"])):
            print(
                f"| MaxText: {name} | {r['seconds']:.2f} s | {gb(r['peak'])} | {gb(r['rss'])} "
                f"| {gb(r['over'])} |"
            )
        print(f"| MaxText's route | {t['seconds']:.2f} s | {gb(t['peak'])} | | {gb(t['over'])} |")
        f = best["framework"]
        for name, r in (("meshinit, hand-written table", m), ("meshinit, maxtext.names", f)):
            print(
                f"| {name} | {r['seconds']:.2f} s | {gb(r['peak'])} | {gb(r['rss'])} "
                f"| {gb(r['over'])} |"
            )
        print(
            f"| hand-written / MaxText | {m['seconds'] / t['seconds']:.3f}x (goal 0.2x) | "
            f"{m['peak'] / t['peak']:.3f}x (goal 0.5x) | | {m['over'] / t['over']:.3f}x |"
        )
        print(
            f"| maxtext.names / MaxText | {f['seconds'] / t['seconds']:.3f}x (goal 0.2x) | "
            f"{f['peak'] / t['peak']:.3f}x (goal 0.4x) | | {f['over'] / t['over']:.3f}x |"
        )
        ratio = f["seconds"] / m["seconds"]
        print(f"| maxtext.names / hand-written | {ratio:.3f}x (goal 1.2x) | | | |")
        for name, r in (("hand-written", m), ("maxtext.names", f)):
            print(f"{name}: bytes read / owned = {r['read'] / r['owned']:.3f}")
        if compared and not any("differ" in line for line in failed):
            print(f"every Param of the three models: same bytes, same sharding ({compared})")
    for line in failed:
        print(f"FAILED: {line}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
