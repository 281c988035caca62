"""``meshinit.safetensors.save``: a load followed by a save with the same ``names=``
gives back the files' tensors byte for byte, for every layout the export can undo; what
it cannot undo is refused by name before a byte is written; the files follow Hugging
Face's conventions."""

import json
import os
import re
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import xy_mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from storage_servers import s3_server_fixture  # noqa: F401

import meshinit
from meshinit.safetensors import Concat, Fill, Pad, Tensor

safetensors_numpy = pytest.importorskip("safetensors.numpy")
save_file, load_file = safetensors_numpy.save_file, safetensors_numpy.load_file

MESHES = pytest.mark.parametrize("explicit", [True, False], ids=["explicit", "auto"])


def _random(shape, dtype, seed):
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return x.astype(dtype)


def _bits(x):
    x = np.ascontiguousarray(x)
    return x.view(f"u{x.dtype.itemsize}") if x.dtype.itemsize in (1, 2, 4, 8) else x


_RAW = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "BF16": ml_dtypes.bfloat16, "F32": "<f4", "I32": "<i4"}


def _read(path):
    """A file's tensors, its header first checked by the safetensors package (whose
    numpy reader knows no float8): the bytes as stored."""
    import safetensors

    with safetensors.safe_open(path, "np") as f:
        names = set(f.keys())
    data = open(path, "rb").read()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        raw = data[8 + n + a : 8 + n + b]
        out[name] = np.frombuffer(raw, _RAW[info["dtype"]]).reshape(info["shape"])
    assert set(out) == names
    return out


def _same_files(got_dir, want):
    got = {}
    for f in sorted(os.listdir(got_dir)):
        if f.endswith(".safetensors"):
            got.update(_read(os.path.join(got_dir, f)))
    assert sorted(got) == sorted(want)
    for name, x in want.items():
        assert got[name].dtype == x.dtype and got[name].shape == x.shape, name
        np.testing.assert_array_equal(_bits(got[name]), _bits(x), err_msg=name)


def _round_trip(tmp_path, stored, planned, names, mesh, specs, **kw):
    """``stored`` written as a checkpoint, loaded onto ``planned`` through ``names``,
    then saved through the same ``names``: the export's tensors are the stored ones."""
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    save_file(stored, str(src / "model.safetensors"))
    plan = meshinit.plan(
        {
            p: meshinit.param(s, jax.nn.initializers.zeros, dtype=d, mesh=mesh, axes=specs.get(p))
            for p, (s, d) in planned.items()
        }
    )
    loaded = meshinit.safetensors.load(plan, src, names=names)
    report = meshinit.safetensors.save(loaded, out, names=names, **kw)
    _same_files(out, stored)
    return loaded, report


@MESHES
def test_renames_transposes_and_a_reshaped_split_round_trip(explicit, tmp_path):
    mesh = xy_mesh((2, 4), explicit)
    stored = {
        "model.embed_tokens.weight": _random((64, 16), np.float32, 0),
        "model.layers.0.self_attn.q_proj.weight": _random((4 * 8, 16), ml_dtypes.bfloat16, 1),
        "model.layers.0.mlp.up_proj.weight": _random((32, 16), np.float32, 2),
        "model.norm.weight": _random((16,), np.float32, 3),
    }
    planned = {
        "embed": ((64, 16), jnp.float32),
        "q": ((16, 4, 8), jnp.bfloat16),
        "up": ((16, 32), jnp.float32),
        "norm": ((16,), jnp.float32),
    }
    names = {
        "embed": "model.embed_tokens.weight",
        "q": Tensor("model.layers.0.self_attn.q_proj.weight", shape=(4, 8, -1), permute=(2, 0, 1)),
        "up": Tensor("model.layers.0.mlp.up_proj.weight", permute=(1, 0)),
        "norm": "model.norm.weight",
    }
    specs = {"embed": ("x", "y"), "q": ("x", "y", None), "up": ("y", "x"), "norm": ("x",)}
    loaded, report = _round_trip(tmp_path, stored, planned, names, mesh, specs)
    assert report.files == ("model.safetensors",)
    assert report.bytes_by_process == (os.path.getsize(tmp_path / "out" / "model.safetensors"),)
    with open(tmp_path / "out" / "model.safetensors", "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert header["__metadata__"] == {"format": "pt"}


@MESHES
def test_one_fused_tensor_split_into_parameters_and_a_concat_round_trip(explicit, tmp_path):
    mesh = xy_mesh((2, 4), explicit)
    stored = {
        "qkv.weight": _random((8 + 4 + 4, 16), np.float32, 0),  # q, k, v rows
        "gate.weight": _random((24, 16), np.float32, 1),
        "up.weight": _random((24, 16), np.float32, 2),
    }
    names = {
        "q": Tensor("qkv.weight", index=np.s_[:8], permute=(1, 0)),
        "k": Tensor("qkv.weight", index=np.s_[8:12], permute=(1, 0)),
        "v": Tensor("qkv.weight", index=np.s_[12:], permute=(1, 0)),
        "gate_up": Concat(
            [
                Tensor("gate.weight", shape=(24, -1), permute=(1, 0)),
                Tensor("up.weight", permute=(1, 0)),
            ],
            axis=1,
        ),
    }
    planned = {
        "q": ((16, 8), jnp.float32),
        "k": ((16, 4), jnp.float32),
        "v": ((16, 4), jnp.float32),
        "gate_up": ((16, 48), jnp.float32),
    }
    specs = {"q": ("x", "y"), "k": ("x", "y"), "v": (None, "y"), "gate_up": ("x", "y")}
    _round_trip(tmp_path, stored, planned, names, mesh, specs)


@MESHES
def test_a_pad_drops_its_padding_and_out_shape_is_undone(explicit, tmp_path):
    mesh = xy_mesh((2, 4), explicit)
    heads, half, d = 4, 2, 8
    stored = {
        "embed.weight": _random((60, 8), ml_dtypes.bfloat16, 0),
        "q.weight": _random((heads * 2 * half, d), np.float32, 1),
    }
    names = {  # a vocabulary padded to 64; MaxText's interleaved rotary layout
        "embed": Pad(Tensor("embed.weight", shape=(60, -1)), shape=(64, 8)),
        "q": Tensor(
            "q.weight",
            shape=(heads, 2, half, -1),
            permute=(3, 0, 2, 1),
            out_shape=(d, heads, 2 * half),
        ),
        "bias": Fill(0.0),
    }
    planned = {
        "embed": ((64, 8), jnp.bfloat16),
        "q": ((d, heads, 2 * half), jnp.float32),
        "bias": ((8,), jnp.float32),
    }
    specs = {"embed": ("x", "y"), "q": ("x", "y", None), "bias": ("y",)}
    _round_trip(tmp_path, stored, planned, names, mesh, specs)


def test_each_refusal_names_the_tensor_and_writes_nothing(tmp_path):
    mesh = xy_mesh((2, 4), False)
    s = NamedSharding(mesh, P("x", "y"))
    arrays = {
        "a": jax.device_put(jnp.ones((8, 8)), s),
        "b": jax.device_put(jnp.ones((8, 8)), s),
        "c": jax.device_put(jnp.ones((8, 8)), s),
        "d": jax.device_put(jnp.ones((8, 8)), s),
        "e": jax.device_put(jnp.ones((8, 4)), s),
        "none": None,
    }
    names = {
        "a": Tensor("twice", index=np.s_[:8]),
        "b": Tensor("twice", index=np.s_[4:12]),  # overlaps a's rows
        "c": Tensor("part", index=np.s_[2:10]),  # rows 0-1 written by none
        "d": Tensor("scaled", scale=0.5),
        "e": "same",
        "none": "same",
    }
    out = tmp_path / "out"
    with pytest.raises(meshinit.PlanError) as raised:
        meshinit.safetensors.save(arrays, out, names=names)
    text = str(raised.value)
    assert "nothing was written" in text
    assert "twice: is written twice" in text
    assert "part: is covered only in part" in text
    assert "scale=0.5, which has no saving hook" in text
    assert "none: has no array to write" in text
    assert not out.exists()  # a refused export leaves no folder either


def test_two_parameters_that_write_one_name_are_refused(tmp_path):
    mesh = xy_mesh((2, 4), False)
    s = NamedSharding(mesh, P())
    arrays = {"a": jax.device_put(jnp.ones((4,)), s), "b": jax.device_put(jnp.ones((4,)), s)}
    with pytest.raises(meshinit.PlanError, match=r"one: is written twice, by a and b"):
        meshinit.safetensors.save(arrays, tmp_path / "out", names={"a": "one", "b": "one"})
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_dtype_casts_on_the_devices_rounding_to_nearest_even(tmp_path):
    mesh = xy_mesh((2, 4), True)
    x = _random((16, 8), np.float32, 0)
    x[0, 0] = np.float32(1.0 + 2**-8)  # halfway between two bf16: to even (1.0)
    x[0, 1] = np.float32(1.0 + 3 * 2**-8)  # halfway: to even (1.0 + 2**-6)
    arrays = {
        "w": jax.device_put(x, NamedSharding(mesh, P("x", "y"))),
        "i": jax.device_put(np.arange(8, dtype=np.int32), NamedSharding(mesh, P("y"))),
    }
    meshinit.safetensors.save(arrays, tmp_path / "out", dtype=jnp.bfloat16)
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert got["w"].dtype == ml_dtypes.bfloat16 and got["i"].dtype == np.int32
    np.testing.assert_array_equal(_bits(got["w"]), _bits(x.astype(ml_dtypes.bfloat16)))
    assert float(got["w"][0, 0]) == 1.0 and float(got["w"][0, 1]) == 1.0 + 2**-6


def test_sharded_files_have_an_index_and_stay_within_max_shard_size(tmp_path):
    mesh = xy_mesh((2, 4), False)
    s = NamedSharding(mesh, P("x"))
    arrays = {f"w{i}": jax.device_put(_random((8, 16), np.float32, i), s) for i in range(5)}
    arrays["big"] = jax.device_put(_random((32, 16), np.float32, 9), s)  # larger than a file
    report = meshinit.safetensors.save(arrays, tmp_path / "out", max_shard_size="1KB")
    out = tmp_path / "out"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    n = len(files)
    assert n > 1 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert set(index["weight_map"]) == set(arrays) and set(index["weight_map"].values()) == set(
        files
    )
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in arrays.values())
    assert index["metadata"]["total_parameters"] == sum(a.size for a in arrays.values())
    for f in files:
        tensors = load_file(str(out / f))
        assert sum(t.nbytes for t in tensors.values()) <= 1000 or len(tensors) == 1
    assert report.files[-1] == "model.safetensors.index.json"
    _same_files(out, {k: np.asarray(v) for k, v in arrays.items()})


def test_config_is_written_and_a_tied_head_is_dropped(tmp_path):
    s = NamedSharding(xy_mesh((2, 4), False), P())
    arrays = {
        "model.embed_tokens.weight": jax.device_put(jnp.ones((8, 4)), s),
        "lm_head.weight": jax.device_put(jnp.ones((8, 4)), s),
    }

    class Config:
        def to_dict(self):
            return {"model_type": "llama", "tie_word_embeddings": True}

    report = meshinit.safetensors.save(arrays, tmp_path / "out", config=Config())
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "llama"
    assert list(load_file(str(tmp_path / "out" / "model.safetensors"))) == [
        "model.embed_tokens.weight"
    ]
    assert report.files == ("model.safetensors", "config.json")


def test_a_destination_with_a_checkpoint_is_refused_unless_overwrite(tmp_path):
    s = NamedSharding(xy_mesh((2, 4), False), P())
    arrays = {"w": jax.device_put(jnp.ones((4,)), s)}
    out = tmp_path / "out"
    out.mkdir()
    save_file({"old": np.zeros(2, np.float32)}, str(out / "model-00001-of-00002.safetensors"))
    with pytest.raises(meshinit.PlanError, match="already holds a checkpoint .*overwrite=True"):
        meshinit.safetensors.save(arrays, out)
    (out / "config.json").write_text('{"quantization_config": {"quant_method": "fp8"}}')
    meshinit.safetensors.save(arrays, out, overwrite=True)
    assert sorted(os.listdir(out)) == ["model.safetensors"]  # the old config.json too


@MESHES
def test_fp8_export_has_deepgemms_bits_and_loads_back_as_weight_dequant(explicit, tmp_path):
    from _checkpoint.encodings.fp8.test_encode import (
        cast_stacked,
        per_block_cast_to_fp8,
        weight_dequant,
    )

    mesh = xy_mesh((2, 4), explicit)
    rng = np.random.default_rng(8)
    w = (rng.standard_normal((200, 300)) * 0.05).astype(ml_dtypes.bfloat16)  # ragged blocks
    experts = rng.standard_normal((4, 130, 260)).astype(np.float32)
    norm = rng.standard_normal((300,)).astype(np.float32)
    embed = rng.standard_normal((50, 300)).astype(np.float32)
    place = {  # 200 rows over 2 and 300 columns over 4: shards cut 128 x 128 blocks
        "w": P("x", "y"),
        "experts": P(None, "x", "y"),
        "norm": P("y"),
        "embed": P(None, "y"),
    }
    given = {"w": w, "experts": experts, "norm": norm, "embed": embed}
    arrays = {k: jax.device_put(v, NamedSharding(mesh, place[k])) for k, v in given.items()}
    names = {
        "w": "model.layers.0.mlp.down_proj.weight",
        "experts": "model.layers.0.mlp.experts.gate_up_proj.weight",
        "norm": "model.norm.weight",
        "embed": "model.embed_tokens.weight",
    }
    out = tmp_path / "fp8"
    meshinit.safetensors.save(arrays, out, names=names, quantize="fp8", config={"model_type": "x"})
    got = _read(str(out / "model.safetensors"))
    w8, ws = per_block_cast_to_fp8(w)
    e8, es = cast_stacked(experts)
    want = {
        "model.layers.0.mlp.down_proj.weight": w8,
        "model.layers.0.mlp.down_proj.weight_scale_inv": ws,
        "model.layers.0.mlp.experts.gate_up_proj.weight": e8,
        "model.layers.0.mlp.experts.gate_up_proj.weight_scale_inv": es,
        "model.norm.weight": norm,
        "model.embed_tokens.weight": embed,
    }
    _same_files(out, want)
    assert got["model.layers.0.mlp.down_proj.weight_scale_inv"].shape == (2, 3)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "x"
    assert config["quantization_config"] == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": ["model.embed_tokens"],
    }
    # meshinit's own FP8 load of the export: weight_dequant of the written bytes
    plan = meshinit.plan(
        {
            "w": meshinit.param(
                (200, 300),
                jax.nn.initializers.zeros,
                dtype=jnp.bfloat16,
                mesh=mesh,
                axes=("x", "y"),
            ),
        }
    )
    loaded = meshinit.safetensors.load(
        plan, out, names={"w": "model.layers.0.mlp.down_proj.weight"}, unused="ignore"
    )
    np.testing.assert_array_equal(
        _bits(np.asarray(loaded["w"])), _bits(weight_dequant(w8, ws, dtype=ml_dtypes.bfloat16))
    )


def test_fp8_of_a_tensor_holding_nan_or_inf_is_refused_naming_it_and_leaves_nothing(tmp_path):
    mesh = xy_mesh((2, 4), True)
    x = np.ones((256, 256), np.float32)
    x[3, 200] = np.inf
    arrays = {
        "ok": jax.device_put(np.ones((128, 128), np.float32), NamedSharding(mesh, P("x"))),
        "bad": jax.device_put(x, NamedSharding(mesh, P("x", "y"))),
    }
    names = {"ok": "a.weight", "bad": "b.weight"}
    with pytest.raises(meshinit.PlanError, match=r"b\.weight: holds NaN or inf \(from bad\)"):
        meshinit.safetensors.save(arrays, tmp_path / "out", names=names, quantize="fp8")
    assert [f for f in os.listdir(tmp_path / "out") if not f.startswith(".")] == []
    meshinit.safetensors.save(arrays, tmp_path / "plain", names=names)  # unquantized: as is


def test_parameters_on_two_disjoint_stage_meshes_are_written_from_their_own_devices(tmp_path):
    from helpers import submesh

    first, second = submesh(range(4), (2, 2), ("x", "y")), submesh(range(4, 8), (2, 2), ("x", "y"))
    a, b = _random((8, 6), np.float32, 0), _random((4, 10), np.float32, 1)
    arrays = {
        "stage0.w": jax.device_put(a, NamedSharding(first, P("x", "y"))),
        "stage1.w": jax.device_put(b, NamedSharding(second, P("y", "x"))),
    }
    meshinit.safetensors.save(arrays, tmp_path / "out", max_shard_size=64)
    _same_files(tmp_path / "out", {"stage0.w": a, "stage1.w": b})


def test_the_writer_holds_at_most_half_the_budget_and_records_its_bytes(tmp_path, monkeypatch):
    from meshinit._checkpoint.write import writer as _writer

    mesh = xy_mesh((2, 4), False)
    arrays = {
        f"w{i}": jax.device_put(_random((16, 16), np.float32, i), NamedSharding(mesh, P("x")))
        for i in range(12)
    }  # 1 KiB each
    held, recorded = [], []
    real = _writer.Writer.hand

    def hand(self, name, array):
        real(self, name, array)
        held.append(self._held)

    monkeypatch.setattr(_writer.Writer, "hand", hand)
    monkeypatch.setattr(
        jax.monitoring, "record_scalar", lambda key, value, **kw: recorded.append((key, value))
    )
    from meshinit._checkpoint.store import sink_local

    send = sink_local.FileUpload._send  # a slow disk: the programs would run ahead

    def slow(self, view):
        time.sleep(0.01)
        send(self, view)

    monkeypatch.setattr(sink_local.FileUpload, "_send", slow)
    report = meshinit.safetensors.save(arrays, tmp_path / "out", max_inflight_bytes=4096)
    assert max(held) <= 2048  # half of max_inflight_bytes waits for the writer
    assert ("/meshinit/safetensors/bytes_written", float(report.bytes_written)) in recorded
    assert report.bytes_written == os.path.getsize(tmp_path / "out" / "model.safetensors")


def test_progress_shows_a_bar_of_the_bytes_written(tmp_path, capsys):
    s = NamedSharding(xy_mesh((2, 4), False), P())
    meshinit.safetensors.save(
        {"w": jax.device_put(jnp.ones((64,)), s)}, tmp_path / "a", progress=True
    )
    assert "meshinit: writing" in capsys.readouterr().err
    meshinit.safetensors.save({"w": jax.device_put(jnp.ones((64,)), s)}, tmp_path / "b")
    assert "meshinit: writing" not in capsys.readouterr().err  # progress=False by default


def test_to_s3_the_lone_file_appears_only_at_the_commit(s3_server, monkeypatch, tmp_path):
    pytest.importorskip("obstore")
    from meshinit._checkpoint.write import save as _save

    bucket = s3_server.bucket()
    s = NamedSharding(xy_mesh((2, 4), False), P("x"))
    arrays = {"w": jax.device_put(_random((8, 4), np.float32, 0), s)}
    seen = []
    real = _save._commit

    def commit(sink, plan, cfg, writer):
        listed = s3_server.client.list_objects_v2(Bucket=bucket).get("Contents", [])
        seen.append(sorted(o["Key"] for o in listed))
        return real(sink, plan, cfg, writer)

    monkeypatch.setattr(_save, "_commit", commit)
    report = meshinit.safetensors.save(arrays, f"s3://{bucket}/m", config={"a": 1})
    assert seen == [[]]  # every part sent, no object yet
    listed = s3_server.client.list_objects_v2(Bucket=bucket)["Contents"]
    assert sorted(o["Key"] for o in listed) == ["m/config.json", "m/model.safetensors"]
    assert report.files == ("model.safetensors", "config.json")
    data = s3_server.client.get_object(Bucket=bucket, Key="m/model.safetensors")["Body"].read()
    (tmp_path / "model.safetensors").write_bytes(data)
    _same_files(tmp_path, {"w": np.asarray(arrays["w"])})


@pytest.mark.parametrize(
    ("kwargs", "said"),
    [
        ({"quantize": "int8"}, 'quantize must be None or "fp8"'),
        ({"dtype": jnp.int32}, "dtype must be a floating dtype"),
        ({"dtype": "nonsense"}, "dtype must be a floating dtype"),
        ({"modules_to_not_convert": "lm_head", "quantize": "fp8"}, "modules_to_not_convert must"),
        ({"modules_to_not_convert": ["lm_head"]}, 'modules_to_not_convert is for quantize="fp8"'),
        ({"max_shard_size": 2.5}, "max_shard_size"),
        ({"config": ["not", "a", "dict"]}, "config must be a dict or have to_dict()"),
        ({"config": {"a": object()}}, "config must be JSON"),
        ({"max_inflight_bytes": 0}, "max_inflight_bytes must be a positive int"),
        ({"overwrite": "yes"}, "overwrite must be a bool"),
        ({"progress": "yes"}, "progress"),
        ({"storage_options": {"region": "x"}}, "storage_options"),
    ],
)
def test_a_bad_argument_is_refused_naming_it_before_anything_is_made(kwargs, said, tmp_path):
    s = NamedSharding(xy_mesh((2, 4), False), P())
    arrays = {"w": jax.device_put(jnp.ones((4,)), s)}
    with pytest.raises((TypeError, ValueError), match=re.escape(said)):
        meshinit.safetensors.save(arrays, tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()


def test_a_destination_that_is_no_folder_or_an_unknown_scheme_is_refused(tmp_path):
    s = NamedSharding(xy_mesh((2, 4), False), P())
    arrays = {"w": jax.device_put(jnp.ones((4,)), s)}
    (tmp_path / "file").write_text("")
    with pytest.raises(meshinit.PlanError, match="file: is not a folder"):
        meshinit.safetensors.save(arrays, tmp_path / "file")
    with pytest.raises(TypeError, match="not hf://"):
        meshinit.safetensors.save(arrays, "hf://org/model")


def test_the_export_compiles_with_the_callers_compiler_options(tmp_path):
    # compiled as every compile of meshinit's (compile_lowered): XLA is handed the
    # option the caller's block names, and rejects it; outside it, meshinit's own
    mesh = xy_mesh((2, 4), False)
    w = jax.device_put(_random((16, 32), np.float32, 7), NamedSharding(mesh, P("x", "y")))
    meshinit.clear_cache()
    with meshinit.options(compiler_options={"xla_meshinit_no_such_option": True}):
        with pytest.raises(Exception, match="xla_meshinit_no_such_option"):
            meshinit.safetensors.save({"w": w}, tmp_path / "refused", names={"w": "w"})
    meshinit.safetensors.save({"w": w}, tmp_path / "out", names={"w": "w"})
    _same_files(tmp_path / "out", {"w": np.asarray(w)})
