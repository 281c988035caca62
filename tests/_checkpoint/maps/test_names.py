"""``names=`` of ``meshinit.safetensors.load`` in every form users write (a callable, a
Mapping, a rule table with backreferences), ``Tensor`` as numpy reads its shape and
axes, and every stored tensor accounted for (``unused=``, ``inventory``)."""

import dataclasses
import re
import warnings

import jax
import numpy as np
import pytest
from helpers import mesh8, plan_for

import meshinit
from meshinit.safetensors import Stack, Tensor

save_file = pytest.importorskip("safetensors.numpy").save_file

D, HEADS, HEAD_DIM, MLP, LAYERS = 8, 2, 4, 16, 3


def specs():
    """A Llama-ish spec tree: per layer q (d, heads, head_dim), o (heads, head_dim, d),
    up (d, mlp), down (mlp, d), norm (d,); an embedding; a new head."""
    zeros, m = jax.nn.initializers.zeros, mesh8()

    def p(shape, axes=None):
        return meshinit.param(shape, zeros, axes=axes, mesh=m)

    layer = {
        "q": p((D, HEADS, HEAD_DIM), ("fsdp", None, None)),
        "o": p((HEADS, HEAD_DIM, D), (None, None, "fsdp")),
        "up": p((D, MLP), ("fsdp", "tensor")),
        "down": p((MLP, D), ("tensor", "fsdp")),
        "norm": p((D,)),
    }
    return {"embed": p((32, D), (None, "tensor")), "layers": [layer] * LAYERS, "head": p((D, 32))}


def weights():
    """Plan path -> the parameter's value, and the checkpoint Hugging Face would store."""
    rng = np.random.default_rng(0)
    params, stored = {}, {}
    params["embed"] = rng.standard_normal((32, D), np.float32)
    stored["model.embed_tokens.weight"] = params["embed"]
    for i in range(LAYERS):
        q = rng.standard_normal((D, HEADS, HEAD_DIM), np.float32)
        o = rng.standard_normal((HEADS, HEAD_DIM, D), np.float32)
        up = rng.standard_normal((D, MLP), np.float32)
        down = rng.standard_normal((MLP, D), np.float32)
        norm = rng.standard_normal((D,), np.float32)
        params.update({f"layers.{i}.q": q, f"layers.{i}.o": o, f"layers.{i}.up": up})
        params.update({f"layers.{i}.down": down, f"layers.{i}.norm": norm})
        h = f"model.layers.{i}"
        # torch (out, in): q_proj (heads * head_dim, d), o_proj (d, heads * head_dim)
        stored[f"{h}.self_attn.q_proj.weight"] = q.reshape(D, -1).T
        stored[f"{h}.self_attn.o_proj.weight"] = o.reshape(-1, D).T
        stored[f"{h}.mlp.up_proj.weight"] = up.T
        stored[f"{h}.mlp.down_proj.weight"] = down.T
        stored[f"{h}.input_layernorm.weight"] = norm
    return params, {k: np.ascontiguousarray(v) for k, v in stored.items()}


TABLE = [
    (r"embed", "model.embed_tokens.weight"),
    # (heads * head_dim, d) -> (heads, head_dim, d) -> (d, heads, head_dim)
    (r"layers\.(\d+)\.q",
     Tensor(r"model.layers.\1.self_attn.q_proj.weight",
            shape=(HEADS, HEAD_DIM, -1), permute=(-1, 0, 1))),
    # tunix: transpose (d, hd) -> (hd, d), then reshape (heads, head_dim, d); here the
    # reshape comes first: (d, heads, head_dim), then the axes (1, 2, 0)
    (r"layers\.(\d+)\.o",
     Tensor(r"model.layers.\1.self_attn.o_proj.weight", shape=(D, HEADS, -1), permute=(1, 2, 0))),
    (r"layers\.(\d+)\.(up|down)", Tensor(r"model.layers.\1.mlp.\2_proj.weight", permute=(-1, -2))),
    (r"layers\.(?P<i>\d+)\.norm", r"model.layers.\g<i>.input_layernorm.weight"),
    (r"head", None),
]  # fmt: skip


def _names_as(form):
    if form == "table":
        return TABLE
    if form == "compiled table":
        return [(re.compile(r), t) for r, t in TABLE]

    def by_table(path):
        for regex, target in TABLE:
            if m := re.fullmatch(regex, path):
                if target is None or isinstance(target, str):
                    return None if target is None else m.expand(target)
                return Tensor(m.expand(target.name), shape=target.shape, permute=target.permute)
        return path

    if form == "callable":
        return by_table
    paths = [e.path for e in meshinit.plan(specs()).entries]
    return {p: by_table(p) for p in paths}  # "mapping"


@pytest.mark.parametrize("form", ["table", "compiled table", "callable", "mapping"])
def test_every_names_form_loads_the_same_values_onto_the_plan(form, tmp_path):
    params, stored = weights()
    save_file(stored, str(tmp_path / "model.safetensors"))
    plan = meshinit.plan(specs())
    loaded = meshinit.safetensors.load(plan, tmp_path, names=_names_as(form))
    assert set(loaded) == set(params)  # head: None, left to the init
    for entry in plan.entries:
        if entry.path in loaded:
            assert loaded[entry.path].sharding == entry.sharding, entry.path
            assert np.asarray(loaded[entry.path]).tobytes() == params[entry.path].tobytes()


def test_a_mapping_names_only_what_differs_and_a_typo_is_named(tmp_path):
    save_file(
        {"embed": np.ones((32, D), np.float32), "w": np.ones(D, np.float32)},
        str(tmp_path / "m.safetensors"),
    )
    plan = meshinit.plan({"embed": specs()["embed"], "norm": specs()["layers"][0]["norm"]})
    loaded = meshinit.safetensors.load(plan, tmp_path, names={"norm": "w"})  # embed as itself
    assert set(loaded) == {"embed", "norm"}
    with pytest.raises(
        meshinit.PlanError,
        match=r"nrom: names maps it, but it is not a plan path; did you mean 'norm'",
    ):
        meshinit.safetensors.load(plan, tmp_path, names={"nrom": "w"}, unused="ignore")


def test_a_mapping_key_of_a_layer_the_plan_lacks_gets_no_other_layer_as_a_guess(tmp_path):
    # difflib's ratio named layers.2.up for layers.7.up: following it would load
    # the tensor meant for layer 7 into layer 1
    save_file({"w": np.ones(D, np.float32)}, str(tmp_path / "m.safetensors"))
    plan = meshinit.plan(specs())
    with pytest.raises(meshinit.PlanError, match=r"layers\.7\.up: names maps it, but") as raised:
        meshinit.safetensors.load(plan, tmp_path, names={"layers.7.up": "w"}, unused="ignore")
    [problem] = [p for p in raised.value.problems if p.path == "layers.7.up"]
    assert problem.message == "names maps it, but it is not a plan path"


def test_a_malformed_rule_table_is_one_plan_error_naming_each_rule(tmp_path):
    save_file({"w": np.ones(D, np.float32)}, str(tmp_path / "m.safetensors"))
    plan = meshinit.plan({"w": specs()["layers"][0]["norm"]})
    table = [("w", "w"), ("(", "x"), ("a", 3), ("b",), (7, "c")]
    with pytest.raises(meshinit.PlanError) as raised:
        meshinit.safetensors.load(plan, tmp_path, names=table)
    message = str(raised.value)
    assert "names[1]: regex '(' does not compile" in message
    assert "names[2]: the target must be a tensor name" in message
    assert "names[3] must be a (regex, target) pair" in message
    assert "names[4]: the regex must be a str or re.Pattern" in message
    assert len(raised.value.problems) == 4


def test_a_backreference_to_no_group_is_named_with_its_rule_and_path(tmp_path):
    save_file({"w": np.ones(D, np.float32)}, str(tmp_path / "m.safetensors"))
    plan = meshinit.plan({"w": specs()["layers"][0]["norm"]})
    with pytest.raises(meshinit.PlanError, match=r'w: names\[0\] r"w": its target does not expand'):
        meshinit.safetensors.load(plan, tmp_path, names=[(r"w", r"model.\1")])


def test_a_backreference_to_no_group_is_one_problem_per_path(tmp_path):
    # it was reported twice per path: the rule's problem, then the path looked up
    # under its own name as "not in the files"
    save_file({"model.w": np.ones(D, np.float32)}, str(tmp_path / "m.safetensors"))
    norm = specs()["layers"][0]["norm"]
    plan = meshinit.plan({"v": norm, "w": norm})
    with pytest.raises(meshinit.PlanError, match="its target does not expand") as raised:
        meshinit.safetensors.load(plan, tmp_path, names=[(r"(w|v)", r"model.\2")])
    assert [str(p) for p in raised.value.problems] == [
        f'{p}: names[0] r"(w|v)": its target does not expand: invalid group reference 2 '
        "at position 7"
        for p in ("v", "w")
    ]


def test_the_error_of_a_path_no_rule_matched_names_the_rule_that_matched_nothing(tmp_path):
    # the idle rule was only a warning, apart from the error it caused
    save_file({"model.w": np.ones(D, np.float32)}, str(tmp_path / "m.safetensors"))
    norm = specs()["layers"][0]["norm"]
    plan = meshinit.plan({"w": norm, "v": norm})
    table = [(r"model\.w", "model.w"), (r"v", None)]
    with pytest.warns(meshinit.UnusedPatternWarning, match=r'names\[0\] r"model\\\.w"'):
        with pytest.raises(meshinit.PlanError, match="is not in the files") as raised:
            meshinit.safetensors.load(plan, tmp_path, names=table)
    (problem,) = raised.value.problems
    assert problem.path == "w"
    assert problem.message.endswith(
        r'; no rule of names= matched the path, and names[0] r"model\.w" matched no plan '
        "path (the UnusedPatternWarning): fix that regex to match it"
    )
    # a path no rule matched is not linked where every rule matched something
    with pytest.raises(meshinit.PlanError, match="is not in the files") as raised:
        meshinit.safetensors.load(plan, tmp_path, names=[(r"v", None)])
    assert "no rule of names=" not in str(raised.value)


def test_a_rule_that_matches_no_path_is_an_unused_pattern_warning(tmp_path):
    save_file({"w": np.ones(D, np.float32)}, str(tmp_path / "m.safetensors"))
    plan = meshinit.plan({"w": specs()["layers"][0]["norm"]})
    with pytest.warns(
        meshinit.UnusedPatternWarning, match=r'names\[0\] r"layer\\.\*" matched no plan path'
    ) as caught:
        meshinit.safetensors.load(plan, tmp_path, names=[(r"layer\.*", "x"), (r"w", "w")])
    assert caught[0].filename == __file__  # points at the caller's line


@pytest.mark.parametrize("names", [3, "w", b"w", {"w"}])
def test_names_of_another_kind_is_a_type_error_naming_the_forms(names, tmp_path):
    # a dict once gave a raw "TypeError: 'dict' object is not callable"; now a dict is a
    # Mapping form, and anything else says what names accepts
    save_file({"w": np.ones(D, np.float32)}, str(tmp_path / "m.safetensors"))
    plan = meshinit.plan({"w": specs()["layers"][0]["norm"]})
    with pytest.raises(
        TypeError, match=r"names must be a callable .*, a Mapping of plan paths .* or a rule table"
    ):
        meshinit.safetensors.load(plan, tmp_path, names=names)


def test_targets_of_another_kind_are_one_type_error_naming_the_paths(tmp_path):
    save_file({"w": np.ones(D, np.float32)}, str(tmp_path / "m.safetensors"))
    plan = meshinit.plan({"a": specs()["layers"][0]["norm"], "b": specs()["layers"][0]["norm"]})
    with pytest.raises(TypeError, match=r"names\('a'\) returned int; names\('b'\) returned int"):
        meshinit.safetensors.load(plan, tmp_path, names=lambda p: 7)
    with pytest.raises(TypeError, match=r"names\['a'\] is list"):
        meshinit.safetensors.load(plan, tmp_path, names={"a": ["w"]})


# ------------------------------------------------------------------------ Tensor


@pytest.mark.parametrize(
    "tensor,want",
    [
        (Tensor("w", shape=(2, -1)), (2, 12)),
        (Tensor("w", shape=(-1,)), (24,)),
        (Tensor("w", permute=(-1, -2, 0)), (4, 3, 2)),
        (Tensor("w", shape=(6, -1), permute=(-1, 0)), (4, 6)),
        (Tensor("w", shape=[3, 8], permute=[1, -2]), (8, 3)),
    ],
)
def test_tensor_reads_shape_and_axes_as_numpy_does(tensor, want, tmp_path):
    # Tensor("w", shape=(2, -1)) and permute=(-1, -2) were refused, though the
    # docstring defines the result "as numpy" does
    value = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    save_file({"w": value}, str(tmp_path / "m.safetensors"))
    spec = meshinit.param(want, jax.nn.initializers.zeros, mesh=mesh8())
    (got,) = meshinit.safetensors.load(
        meshinit.plan({"p": spec}), tmp_path, names=lambda p: tensor
    ).values()
    expect = value.reshape(tensor.shape or value.shape)
    expect = expect if tensor.permute is None else expect.transpose(tensor.permute)
    np.testing.assert_array_equal(np.asarray(got), expect)


@pytest.mark.parametrize(
    "tensor,said",
    [
        (Tensor("w", shape=(5, -1)), r"cannot be reshaped from \(2, 3, 4\) to \(5, -1\)"),
        (Tensor("w", shape=(0, -1)), r"cannot be reshaped"),
        (Tensor("w", shape=(4, 4)), r"cannot be reshaped"),
        (Tensor("w", permute=(0, 0, 1)), r"permute=\(0, 0, 1\) is not an order of 3 axes"),
        (Tensor("w", permute=(0, 1, 3)), r"is not an order of 3 axes"),
        (Tensor("w", permute=(0, 1)), r"is not an order of 3 axes"),
    ],
)
def test_a_tensor_numpy_would_refuse_is_a_plan_error_naming_the_path(tensor, said, tmp_path):
    save_file({"w": np.zeros((2, 3, 4), np.float32)}, str(tmp_path / "m.safetensors"))
    spec = meshinit.param((24,), jax.nn.initializers.zeros, mesh=mesh8())
    with pytest.raises(
        meshinit.PlanError,
        match=rf"p: tensor 'w' in m.safetensors, stored F32 \(2, 3, 4\), .*{said}",
    ):
        meshinit.safetensors.load(meshinit.plan({"p": spec}), tmp_path, names=lambda p: tensor)


@pytest.mark.parametrize(
    "kwargs,error",
    [
        ({"shape": (-1, -1)}, ValueError),
        ({"shape": (2, -3)}, ValueError),
        ({"shape": (2, True)}, TypeError),
        ({"shape": (2.0, 3)}, TypeError),
        ({"permute": "01"}, TypeError),
        ({"permute": 1}, TypeError),
    ],
)
def test_a_malformed_tensor_is_refused_when_made(kwargs, error):
    with pytest.raises(error, match="Tensor (shape|permute)"):
        Tensor("w", **kwargs)


# ------------------------------------------------------------------------ unused


def _tunix_like(tmp_path):
    """The new user's case: a name map that returns None by mistake for one layer."""
    params, stored = weights()
    save_file(stored, str(tmp_path / "model.safetensors"))
    forgot = [*TABLE[:-1], (r"layers\.1\..*", None), (r"head", None)]
    forgot.insert(0, forgot.pop(-2))  # the mistake comes first: it wins for layer 1
    return (
        meshinit.plan(specs()),
        forgot,
        sorted(k for k in stored if k.startswith("model.layers.1.")),
    )


def test_unused_tensors_warn_by_default_naming_the_count_and_every_name(tmp_path):
    plan, names, layer1 = _tunix_like(tmp_path)
    with pytest.warns(meshinit.UnusedTensorWarning) as caught:
        loaded = meshinit.safetensors.load(plan, tmp_path, names=names)
    (warning,) = caught
    message = str(warning.message)
    assert "5 tensors of the checkpoint went unused" in message, message
    assert all(repr(name) in message for name in layer1), message
    assert warning.message.tensors == tuple(layer1)
    assert warning.filename == __file__
    assert not any(p.startswith("layers.1.") for p in loaded)  # what the init would make


def test_unused_error_refuses_before_reading_anything(tmp_path, monkeypatch, new_arrays):
    from meshinit._checkpoint.layout import host as _read

    plan, names, layer1 = _tunix_like(tmp_path)
    monkeypatch.setattr(_read, "parts", lambda *a: pytest.fail("read"))
    with new_arrays() as made, pytest.raises(meshinit.PlanError) as raised:
        meshinit.safetensors.load(plan, tmp_path, names=names, unused="error")
    assert made == []
    assert [p.message.split(":")[0] for p in raised.value.problems] == [
        f"tensor {n!r}" for n in layer1
    ]
    assert "model.safetensors" in raised.value.problems[0].path


def test_unused_ignore_is_silent_and_bad_values_are_type_errors(tmp_path):
    plan, names, _ = _tunix_like(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        meshinit.safetensors.load(plan, tmp_path, names=names, unused="ignore")
    with pytest.raises(TypeError, match='unused must be "warn", "error" or "ignore"'):
        meshinit.safetensors.load(plan, tmp_path, names=names, unused="skip")


def test_the_parts_of_a_skipped_stack_are_unused_and_named_with_its_path(tmp_path):
    # missing="skip" leaves out 's', whose 'l2' is absent: 'l0' is then read by
    # nothing ('l1' still is, by 't'), and is named with the path it belongs to.
    part = np.ones((8, 16), np.float32)
    save_file({"l0": part, "l1": part, "extra": part}, str(tmp_path / "m.safetensors"))
    plan = plan_for({"s": (3, 8, 16), "t": (8, 16)})
    names = {"s": Stack(["l0", "l1", "l2"], axis=0), "t": "l1"}
    found = meshinit.safetensors.inventory(plan, tmp_path, names=names)
    assert found.missing == {"s": "l2"} and found.unused == ("extra", "l0")
    with pytest.raises(meshinit.PlanError) as raised:
        meshinit.safetensors.load(plan, tmp_path, names=names, missing="skip", unused="error")
    assert [p.message for p in raised.value.problems] == [
        "tensor 'extra': no plan path claims it; map a path to it with names=, or pass "
        'unused="ignore"',
        "tensor 'l0': nothing reads it: it is a part of 's' (which lacks 'l2'), skipped "
        '(missing="skip") for a part not in the files; add the missing part to the files, '
        'or pass unused="ignore"',
    ]
    with pytest.warns(meshinit.UnusedTensorWarning) as caught:
        loaded = meshinit.safetensors.load(plan, tmp_path, names=names, missing="skip")
    (warning,) = caught
    assert warning.message.tensors == ("extra", "l0")
    assert (
        "2 tensors of the checkpoint went unused (no plan path claims them): 'extra', 'l0'. "
        "Of these, 'l0' is a part of 's' (which lacks 'l2'), skipped (missing=\"skip\") for "
        "a part not in the files." in str(warning.message)
    ), warning.message
    assert set(loaded) == {"t"}
    # missing="error": the path fails the load and its problem names it; its parts
    # are not unused besides
    with pytest.raises(meshinit.PlanError) as raised:
        meshinit.safetensors.load(plan, tmp_path, names=names, unused="error")
    messages = [p.message for p in raised.value.problems]
    assert len(messages) == 2 and messages[1].startswith("tensor 'extra': no plan path claims")
    assert messages[0].startswith("Stack part [2] tensor 'l2' is not in the files"), messages


def test_inventory_accounts_for_every_path_and_tensor_without_reading(tmp_path, monkeypatch):
    from meshinit._checkpoint.layout import host as _read

    plan, names, layer1 = _tunix_like(tmp_path)
    monkeypatch.setattr(_read, "parts", lambda *a: pytest.fail("read"))
    late = [*names, (r"layers\.2\.norm", "gone")]  # an earlier rule takes the path
    with pytest.warns(meshinit.UnusedPatternWarning, match=r"names\[7\] .* It maps nothing"):
        found = meshinit.safetensors.inventory(plan, tmp_path, names=late)
    assert found.unused == tuple(layer1)
    assert set(found.skipped) == {f"layers.1.{n}" for n in ("q", "o", "up", "down", "norm")} | {
        "head"
    }
    assert found.missing == {}  # layers.2.norm matched an earlier rule
    assert found.loaded["layers.0.o"] == Tensor(
        "model.layers.0.self_attn.o_proj.weight", shape=(D, HEADS, -1), permute=(1, 2, 0)
    )
    assert len(found.loaded) + len(found.skipped) == len(plan.entries)
    text = str(found)
    assert "1 file: 11 plan paths loaded" in text and "unused (no plan path claims them): 5" in text


def test_inventory_works_on_abstract_meshes_and_lists_missing(tmp_path):
    params, stored = weights()
    del stored["model.layers.2.mlp.up_proj.weight"]
    save_file(stored, str(tmp_path / "model.safetensors"))
    abstract = jax.sharding.AbstractMesh((2, 4), ("fsdp", "tensor"))
    tree = jax.tree.map(
        lambda s: dataclasses.replace(s, mesh=abstract),
        specs(),
        is_leaf=lambda x: isinstance(x, meshinit.ParamSpec),
    )
    plan = meshinit.plan(tree)
    found = meshinit.safetensors.inventory(plan, tmp_path, names=TABLE)
    assert found.missing == {"layers.2.up": "model.layers.2.mlp.up_proj.weight"}
    with pytest.raises(
        meshinit.PlanError,
        match="layers.2.up: tensor 'model.layers.2.mlp.up_proj.weight' is not in the files",
    ) as raised:
        meshinit.safetensors.load(plan, tmp_path, names=TABLE)
    assert "is planned on an AbstractMesh" in str(raised.value)  # with the missing one
