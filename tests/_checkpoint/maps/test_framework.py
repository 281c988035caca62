"""``names=`` built by a framework's own map (``meshinit._checkpoint.maps.framework``): the map
is given the checkpoint's ``config.json`` and tensor headers, from a local folder, a
file beside it, a bucket or the Hub, before a byte of data is read; its table is
what the load reads and what ``Inventory.table`` shows; a problem refuses all of it."""

import json

import numpy as np
import pytest
from helpers import plan_for
from safetensors.numpy import save, save_file

import meshinit
from meshinit import safetensors as st

SHAPES = {"layers.0.w": (8, 16), "layers.1.w": (8, 16), "head": (16, 4)}


class Layers(st.FrameworkMap):
    """A toy framework: plan ``layers.{i}.w`` is stored ``blk.{i}.weight``,
    transposed, for ``num_hidden_layers`` layers (from config.json); ``head`` is
    left to the init. Records what it was given."""

    def __init__(self, problems=(), leave_out=()):
        self.seen = []
        self.problems = list(problems)
        self.leave_out = set(leave_out)

    @property
    def family(self):
        return "the toy framework's map"

    def table(self, checkpoint):
        self.seen.append(checkpoint)
        n = checkpoint.config["num_hidden_layers"]
        table = {f"layers.{i}.w": st.Tensor(f"blk.{i}.weight", permute=(1, 0)) for i in range(n)}
        table["head"] = None
        return {p: t for p, t in table.items() if p not in self.leave_out}, self.problems


def block_tensors(seed=0):
    rng = np.random.default_rng(seed)
    return {f"blk.{i}.weight": rng.standard_normal((16, 8)).astype(np.float32) for i in range(2)}


def write(folder, tensors, config={"num_hidden_layers": 2}):  # noqa: B006 - read only
    folder.mkdir(exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))


def exact(loaded, tensors):
    assert sorted(loaded) == ["layers.0.w", "layers.1.w"]
    for i in range(2):
        want = tensors[f"blk.{i}.weight"].T
        assert np.asarray(loaded[f"layers.{i}.w"]).tobytes() == want.tobytes()


@pytest.mark.parametrize("named", ["folder", "file", "list"])
def test_the_map_gets_config_and_headers_and_its_table_is_loaded(tmp_path, named):
    tensors = block_tensors()
    write(tmp_path / "m", tensors)
    files = {
        "folder": tmp_path / "m",
        "file": tmp_path / "m" / "model.safetensors",
        "list": [str(tmp_path / "m" / "model.safetensors")],
    }[named]
    plan = plan_for(SHAPES, axes=("fsdp", "tensor"))
    names = Layers()
    exact(st.load(plan, files, names=names), tensors)
    (given,) = names.seen
    assert given.config == {"num_hidden_layers": 2}
    assert given.where == str(tmp_path / "m" / "config.json")
    assert given.tensors == {"blk.0.weight": ((16, 8), "F32"), "blk.1.weight": ((16, 8), "F32")}
    assert given.planned == {p: (s, np.dtype(np.float32)) for p, s in SHAPES.items()}

    found = st.inventory(plan, files, names=Layers())
    assert found.table == {
        "layers.0.w": st.Tensor("blk.0.weight", permute=(1, 0)),
        "layers.1.w": st.Tensor("blk.1.weight", permute=(1, 0)),
        "head": None,
    }
    assert found.skipped == ("head",)
    shown = str(found)
    assert "table (built by the framework's map):" in shown
    assert "layers.1.w <- Tensor(name='blk.1.weight'" in shown
    assert "head <- None" in shown
    # a table given as is has none to show
    assert st.inventory(plan, files, names=found.table).table is None


def test_no_config_json_is_one_error_naming_where_it_was_looked_for(tmp_path):
    write(tmp_path, block_tensors(), config=None)
    plan = plan_for(SHAPES)
    with pytest.raises(
        meshinit.PlanError, match=r"the toy framework's map needs config\.json"
    ) as e:
        st.load(plan, tmp_path, names=Layers())
    assert str(tmp_path / "config.json") in str(e.value)
    assert "beside its .safetensors files" in str(e.value)


@pytest.mark.parametrize(
    "text, said",
    [("{", "is not JSON"), ("[1, 2]", "holds a JSON list, not an object")],
)
def test_a_config_json_that_is_no_json_object_is_named(tmp_path, text, said):
    write(tmp_path, block_tensors())
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(meshinit.PlanError, match=said):
        st.load(plan_for(SHAPES), tmp_path, names=Layers())


def test_the_maps_problems_refuse_all_of_it_before_any_read(tmp_path):
    write(tmp_path, block_tensors())
    bad = [meshinit.Problem("layers.1.w", "its hook reads values: cannot be followed")]
    with pytest.raises(meshinit.PlanError, match="its hook reads values") as e:
        st.load(plan_for(SHAPES), tmp_path, names=Layers(problems=bad))
    assert e.value.problems == bad  # only the map's: nothing else was resolved


def test_a_plan_path_the_map_leaves_out_is_refused_not_looked_up_by_its_own_name(tmp_path):
    tensors = block_tensors()
    tensors["layers.0.w"] = np.zeros((8, 16), np.float32)  # a tensor of the path's own name
    write(tmp_path, tensors)
    with pytest.raises(meshinit.PlanError, match="gives it no target") as e:
        st.load(plan_for(SHAPES), tmp_path, names=Layers(leave_out={"layers.0.w"}))
    assert [p.path for p in e.value.problems] == ["layers.0.w"]


# ------------------------------------------------- config.json over the wire

pytest.importorskip("obstore")
pytest.importorskip("moto")
from storage_servers import file_server_fixture, s3_server_fixture  # noqa: E402, F401


@pytest.mark.parametrize("named", ["folder", "object"])
def test_a_bucket_gives_the_map_its_config_json(s3_server, named):
    bucket = s3_server.bucket()
    tensors = block_tensors(1)
    s3_server.put(f"{bucket}/m/model.safetensors", save(tensors))
    s3_server.put(f"{bucket}/m/config.json", json.dumps({"num_hidden_layers": 2}).encode())
    url = f"s3://{bucket}/m/" if named == "folder" else f"s3://{bucket}/m/model.safetensors"
    names = Layers()
    exact(st.load(plan_for(SHAPES), url, names=names), tensors)
    assert names.seen[0].config == {"num_hidden_layers": 2}
    assert names.seen[0].where == f"s3://{bucket}/m/config.json"
    assert "config.json" not in [
        f.rsplit("/", 1)[-1] for f in st.inventory(plan_for(SHAPES), url, names=Layers()).files
    ]


def test_a_bucket_without_config_json_is_named(s3_server):
    bucket = s3_server.bucket()
    s3_server.put(f"{bucket}/m/model.safetensors", save(block_tensors()))
    with pytest.raises(meshinit.PlanError, match="needs config.json"):
        st.load(plan_for(SHAPES), f"s3://{bucket}/m/model.safetensors", names=Layers())


def test_the_hub_and_an_https_file_give_the_map_its_config_json(file_server):
    tensors = block_tensors(2)
    file_server.put("org/model/model.safetensors", save(tensors))
    file_server.put("org/model/config.json", json.dumps({"num_hidden_layers": 2}).encode())
    options = {"endpoint": file_server.url, "token": False}
    names = Layers()
    exact(
        st.load(plan_for(SHAPES), "hf://org/model", storage_options=options, names=names), tensors
    )
    assert names.seen[0].config == {"num_hidden_layers": 2}
    names = Layers()
    url = file_server.url_for("org/model/model.safetensors")
    exact(st.load(plan_for(SHAPES), url, names=names), tensors)
    assert names.seen[0].where == file_server.url_for("org/model/config.json")
