"""``meshinit.safetensors.load``: a plan's parameters read from safetensors files,
through renames, reshapes, transposes and casts, onto their planned shardings."""

import gc
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from helpers import mesh8, plan_of
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import meshinit
from meshinit.safetensors import Tensor

save_file = pytest.importorskip("safetensors.numpy").save_file

D, HEADS, HEAD_DIM, MLP = 16, 4, 4, 32


def stages():
    d = np.array(jax.devices())
    return Mesh(d[:4].reshape(2, 2), ("fsdp", "tensor")), Mesh(
        d[4:].reshape(2, 2), ("fsdp", "tensor")
    )


def _p(init, names):
    return nnx.with_partitioning(init, names)


class Layer(nnx.Module):
    """Llama-style: q as (d, heads, head_dim), the MLP as (in, out) kernels."""

    def __init__(self, rngs):
        init = nnx.initializers.lecun_normal()
        self.q = nnx.Param(
            init(rngs.params(), (D, HEADS, HEAD_DIM)), out_sharding=("fsdp", "tensor", None)
        )
        self.up = nnx.Linear(
            D, MLP, use_bias=False, kernel_init=_p(init, ("fsdp", "tensor")), rngs=rngs
        )
        self.down = nnx.Linear(
            MLP, D, use_bias=False, kernel_init=_p(init, ("tensor", "fsdp")), rngs=rngs
        )
        self.norm = nnx.RMSNorm(D, rngs=rngs)


class Llama(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(64, D, rngs=rngs)
        self.layers = nnx.List([Layer(rngs) for _ in range(2)])
        self.head = nnx.Linear(D, 64, use_bias=False, rngs=rngs)  # new: not in the files


def factory():
    return Llama(nnx.Rngs(0))


HF = {"up.kernel": "mlp.up_proj", "down.kernel": "mlp.down_proj", "norm.scale": "input_layernorm"}


def hf_names(path):
    if path == "embed.embedding":
        return "model.embed_tokens.weight"
    if path == "head.kernel":
        return "lm_head.weight"
    layer, rest = re.fullmatch(r"layers\.(\d+)\.(.*)", path).groups()
    prefix = f"model.layers.{layer}"
    if rest == "q":  # stored flat as (heads * head_dim, d): torch's (out, in)
        return Tensor(
            f"{prefix}.self_attn.q_proj.weight", shape=(HEADS, HEAD_DIM, D), permute=(2, 0, 1)
        )
    if rest == "norm.scale":
        return f"{prefix}.{HF[rest]}.weight"
    return Tensor(f"{prefix}.{HF[rest]}.weight", permute=(1, 0))


def _hf_checkpoint(model, dtype=np.float32):
    """The model's weights as a Hugging Face checkpoint would store them."""
    out = {"model.embed_tokens.weight": np.asarray(model.embed.embedding[...])}
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}"
        q = np.asarray(layer.q[...])  # (d, heads, head_dim) -> (heads * head_dim, d)
        out[f"{p}.self_attn.q_proj.weight"] = q.transpose(1, 2, 0).reshape(HEADS * HEAD_DIM, D)
        out[f"{p}.mlp.up_proj.weight"] = np.asarray(layer.up.kernel[...]).T
        out[f"{p}.mlp.down_proj.weight"] = np.asarray(layer.down.kernel[...]).T
        out[f"{p}.input_layernorm.weight"] = np.asarray(layer.norm.scale[...])
    return {k: np.ascontiguousarray(v).astype(dtype) for k, v in out.items()}


def _write(tensors, path, parts=1):
    names = sorted(tensors)
    for i in range(parts):
        chunk = {n: tensors[n] for n in names[i::parts]}
        save_file(chunk, str(path / f"model-{i + 1:05d}-of-{parts:05d}.safetensors"))
    return path


def _flat(module):
    return {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(module))}


@pytest.mark.parametrize("layout", ["one mesh", "two stages"])
@pytest.mark.parametrize("parts", [1, 3])
def test_load_renames_reshapes_and_transposes_onto_the_plan(layout, parts, tmp_path):
    meshes = (
        [(r".*", mesh8())]
        if layout == "one mesh"
        else [(r"layers\.0\..*|embed\..*", stages()[0]), (r".*", stages()[1])]
    )
    reference = meshinit.nnx.init(factory, meshes=meshes)
    files = _write(_hf_checkpoint(reference), tmp_path, parts)
    plan = meshinit.nnx.plan(factory, meshes=meshes)
    loaded = meshinit.safetensors.load(
        plan, files if parts > 1 else next(files.iterdir()), names=hf_names, missing="skip"
    )
    entries = {e.path: e for e in plan.entries}
    assert "head.kernel" not in loaded  # not in the files: left to the init
    want = _flat(reference)
    assert set(loaded) == set(entries) - {"head.kernel"}
    for path, array in loaded.items():
        assert array.sharding == entries[path].sharding, path
        assert np.array_equal(np.asarray(array), np.asarray(want[path])), path
    model = meshinit.nnx.init(factory, meshes=meshes, existing=loaded)
    got = _flat(model)
    for path in loaded:
        assert got[path] is loaded[path]
    assert np.array_equal(np.asarray(got["head.kernel"]), np.asarray(want["head.kernel"]))


def test_load_reads_each_local_block_once_and_holds_one_at_a_time(tmp_path, monkeypatch):
    # P("fsdp", None) on a (2, 4) mesh: 8 devices, 2 distinct blocks. Each is read once
    # and put on its 4 devices; the block before it is dropped by then, so the host
    # never holds more than one block beside the arrays.
    import gc
    import weakref

    from meshinit._checkpoint.layout import host as _read

    value = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
    save_file({"w": value}, str(tmp_path / "w.safetensors"))
    spec = meshinit.param((8, 6), jax.nn.initializers.zeros, axes=("fsdp", None), mesh=mesh8())
    plan = meshinit.plan({"w": spec})
    reads, alive = [], []
    reader = _read.parts

    def counting(*args):
        source = reader(*args)
        block = source.block

        def read(index):
            gc.collect()
            alive.append(sum(r() is not None for r in reads))
            out = block(index)
            reads.append(weakref.ref(out))
            return out

        source.block = read
        return source

    monkeypatch.setattr(_read, "parts", counting)
    (array,) = meshinit.safetensors.load(plan, tmp_path).values()
    assert len(reads) == 2, len(reads)  # not 8: one read per distinct block
    assert alive == [0, 0], alive  # block 0 was gone when block 1 was read
    assert array.sharding == plan.entries[0].sharding
    for shard in array.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), value[shard.index])


def test_load_casts_bf16_f16_and_ints_to_the_planned_dtype(tmp_path):
    tensors = {
        "a": np.arange(32, dtype=np.float32).reshape(4, 8).astype(ml_dtypes.bfloat16),
        "b": np.linspace(-1, 1, 32).astype(np.float16).reshape(4, 8),
        "c": np.arange(32, dtype=np.int32).reshape(4, 8),
        "d": (np.arange(32) % 2 == 0).reshape(4, 8),
    }
    save_file(tensors, str(tmp_path / "x.safetensors"))
    m = mesh8()
    specs = {
        "a": meshinit.param(
            (4, 8), jax.nn.initializers.zeros, dtype=jnp.float32, axes=("fsdp", "tensor"), mesh=m
        ),
        "b": meshinit.param(
            (4, 8), jax.nn.initializers.zeros, dtype=jnp.bfloat16, axes=(None, "tensor"), mesh=m
        ),
        "c": meshinit.param(
            (4, 8), jax.nn.initializers.zeros, dtype=jnp.int32, axes=("fsdp", None), mesh=m
        ),
        "d": meshinit.param((4, 8), jax.nn.initializers.zeros, dtype=jnp.bool_, mesh=m),
    }
    loaded = meshinit.safetensors.load(meshinit.plan(specs), tmp_path)
    for name, array in loaded.items():
        assert array.dtype == specs[name].dtype
        np.testing.assert_array_equal(np.asarray(array), tensors[name].astype(specs[name].dtype))


def test_missing_and_mismatched_tensors_are_one_plan_error_naming_each(tmp_path):
    reference = meshinit.nnx.init(factory, meshes=[(r".*", mesh8())])
    tensors = _hf_checkpoint(reference)
    tensors["model.layers.1.mlp.up_proj.weight"] = np.zeros((3, 3), np.float32)
    del tensors["model.layers.0.input_layernorm.weight"]
    files = _write(tensors, tmp_path)
    plan = meshinit.nnx.plan(factory, meshes=[(r".*", mesh8())])

    def names(path):
        return None if path.startswith("rngs") else hf_names(path)

    with pytest.raises(meshinit.PlanError) as raised:
        meshinit.safetensors.load(plan, files, names=names)
    message = str(raised.value)
    assert "layers.0.norm.scale" in message and "model.layers.0.input_layernorm.weight" in message
    assert "lm_head.weight" in message  # the head: missing too, with missing="error"
    assert "layers.1.up.kernel" in message and "(3, 3)" in message and "(16, 32)" in message
    # skip leaves the absent ones out, and still refuses the mismatched one
    with pytest.raises(meshinit.PlanError, match=r"layers\.1\.up\.kernel") as raised:
        meshinit.safetensors.load(plan, files, names=names, missing="skip")
    assert "lm_head" not in str(raised.value)


def test_bad_arguments_are_clear_errors(tmp_path):
    plan = meshinit.nnx.plan(factory, meshes=[(r".*", mesh8())])
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors file"):
        meshinit.safetensors.load(plan, tmp_path)
    save_file({"x": np.zeros(2, np.float32)}, str(tmp_path / "a.safetensors"))
    with pytest.raises(TypeError, match='missing must be "error" or "skip"'):
        meshinit.safetensors.load(plan, tmp_path, missing="ignore")
    with pytest.raises(TypeError, match="names"):
        meshinit.safetensors.load(plan, tmp_path, names=lambda p: 3)
    with pytest.raises(meshinit.PlanError, match="reshaped"):
        meshinit.safetensors.load(
            plan, tmp_path, names=lambda p: Tensor("x", shape=(3,)), missing="skip"
        )


@pytest.mark.parametrize("bad", [1, "yes", 0.5])
def test_fan_out_is_none_true_or_false(tmp_path, bad):
    save_file({"a": np.zeros(4, np.float32)}, str(tmp_path / "m.safetensors"))
    with pytest.raises(TypeError, match="fan_out must be None, True or False"):
        meshinit.safetensors.load(plan_of({"a": ((4,), None)}), tmp_path, fan_out=bad)


def _aligned_file(path, shape=(1024, 64)):
    """A file whose tensor ``w`` starts 64-byte aligned in memory (where jax's CPU
    client would use a view of it in place instead of copying), and its values."""
    from safetensors.numpy import save_file

    want = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    for pad in range(16):
        save_file({"a": np.zeros(pad, np.float32), "w": want}, str(path))
        length = int.from_bytes(path.read_bytes()[:8], "little")
        if (8 + length + 4 * pad) % 64 == 0:
            return want, 8 + length + 4 * pad
    raise AssertionError("no padding aligns w")


def test_a_loaded_array_keeps_none_of_the_files_memory(tmp_path):
    # jax's CPU client may use an aligned, contiguous view of the file's mapping in
    # place: the array would then change when the file is rewritten in place (and
    # keep the file mapped). Each block lives in memory of its own.
    path = tmp_path / "m.safetensors"
    want, start = _aligned_file(path)
    mesh = Mesh(np.array(jax.devices()), ("d",))
    zeros = jax.nn.initializers.zeros
    plan = meshinit.plan({"w": meshinit.param(want.shape, zeros, axes=("d", None), mesh=mesh)})
    loaded = meshinit.safetensors.load(plan, path, unused="ignore")
    with open(path, "r+b") as f:  # rewritten in place: same inode, new bytes
        f.seek(start)
        f.write(b"\xff" * want.nbytes)
    for shard in loaded["w"].addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index])
    del loaded
    gc.collect()  # the loader's own cycles; the arrays held none of the file
    assert not [line for line in open("/proc/self/maps") if str(path) in line]


# ----------------------------------------------------- typed keys, stored as key data


class Scan(nnx.Module):
    def __init__(self, rngs):
        self.rngs = rngs


class Drop(nnx.Module):
    """An nnx model that holds RNG state: a dropout's stream, the model's ``Rngs``, and,
    made under ``nnx.vmap``, a key per layer (a key array of shape (8,))."""

    def __init__(self, rngs):
        kernel = _p(nnx.initializers.lecun_normal(), ("fsdp", "tensor"))
        self.up = nnx.Linear(D, MLP, kernel_init=kernel, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)

        @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
        def make(key):
            return Scan(nnx.Rngs(aqt=key))

        self.layers = make(jax.random.split(rngs.aqt(), 8))
        self.rngs = rngs


def drop_factory(impl):
    def factory():
        seeds = {"default": 0, "aqt": 1, "dropout": 2}
        return Drop(nnx.Rngs(**{k: jax.random.key(s, impl=impl) for k, s in seeds.items()}))

    return factory


def _is_key(x):
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _stored(module):
    """Every Variable of ``module`` as safetensors can hold it: keys as their key data."""
    return {
        p: np.asarray(jax.random.key_data(v) if _is_key(v) else v) for p, v in _flat(module).items()
    }


KEYS = ["drop.rngs.key", "layers.rngs.aqt.key", "rngs.aqt.key", "rngs.default.key"]
SHARDED_KEYS = [(r"layers\.rngs\.aqt\.key", P(("fsdp", "tensor"))), (r".*", None)]


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
@pytest.mark.parametrize("placements", [None, SHARDED_KEYS], ids=["metadata", "keys sharded"])
def test_a_whole_nnx_state_loads_with_its_keys_as_keys_on_the_plan(tmp_path, impl, placements):
    factory = drop_factory(impl)
    with jax.set_mesh(mesh8()):
        reference = meshinit.nnx.init(factory, placements=placements)
        plan = meshinit.nnx.plan(factory, placements=placements)
    held = _stored(reference)
    save_file(held, str(tmp_path / "model.safetensors"))
    entries = {e.path: e for e in plan.entries}
    assert sorted(p for p, e in entries.items() if _is_key(e.spec)) == [*KEYS, "rngs.dropout.key"]
    loaded = meshinit.safetensors.load(plan, tmp_path, unused="error")
    want = _flat(reference)
    assert set(loaded) == set(entries)
    for path, array in loaded.items():
        assert (array.shape, array.dtype) == (want[path].shape, want[path].dtype), path
        assert array.sharding == entries[path].sharding == want[path].sharding, path
        if _is_key(array):
            assert jax.random.key_impl(array) == jax.random.key_impl(want[path]), path
            array = jax.random.key_data(array)
        assert np.asarray(array).tobytes() == held[path].tobytes(), path
    layer_keys = loaded["layers.rngs.aqt.key"]
    if placements:  # one layer's key on each device, wrapped where it lies
        assert layer_keys.sharding.spec == P(("fsdp", "tensor"))
        for shard in layer_keys.addressable_shards:
            assert shard.data.shape == (1,) and _is_key(shard.data)
            data = np.asarray(jax.random.key_data(shard.data))
            assert data.tobytes() == held["layers.rngs.aqt.key"][shard.index].tobytes()
    # what the load gives is the model's own state for existing=
    with jax.set_mesh(mesh8()):
        model = meshinit.nnx.init(factory, placements=placements, existing=loaded)
    assert {p: v.tobytes() for p, v in _stored(model).items()} == {
        p: v.tobytes() for p, v in held.items()
    }
    found = meshinit.safetensors.inventory(plan, tmp_path)
    assert set(found.loaded) == set(entries) and not found.missing and not found.unused
    assert found.reads["layers.rngs.aqt.key"] == ("layers.rngs.aqt.key",)


def test_key_data_of_another_shape_or_dtype_is_a_plan_error_naming_the_key(tmp_path):
    with jax.set_mesh(mesh8()):
        reference = meshinit.nnx.init(drop_factory("threefry2x32"))
        plan = meshinit.nnx.plan(drop_factory("threefry2x32"))
    held = _stored(reference)
    held["drop.rngs.key"] = np.zeros(4, np.uint32)  # an rbg key's data
    held["rngs.aqt.key"] = held["rngs.aqt.key"].astype(np.int32)
    held["rngs.default.key"] = np.zeros((8, 2), np.uint32)  # the data of 8 keys
    save_file(held, str(tmp_path / "model.safetensors"))
    with pytest.raises(meshinit.PlanError) as raised:
        meshinit.safetensors.inventory(plan, tmp_path)
    found = {p.path: p.message for p in raised.value.problems}
    key = "key<fry>[] (threefry2x32 keys, stored as their key data, uint32 (2,))"
    assert found == {
        "drop.rngs.key": "tensor 'drop.rngs.key' in model.safetensors, stored U32 (4,), "
        f"gives shape (4,), planned {key}",
        "rngs.aqt.key": "tensor 'rngs.aqt.key' in model.safetensors, stored I32 (2,), is I32, "
        f"planned {key}: a key is stored as jax.random.key_data of the keys, uint32, never "
        "cast; store the key data",
        "rngs.default.key": "tensor 'rngs.default.key' in model.safetensors, stored U32 "
        f"(8, 2), gives shape (8, 2), planned {key}",
    }
