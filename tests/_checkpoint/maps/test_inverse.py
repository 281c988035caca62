"""A regex map written for loading, read from the parameters' side
(``meshinit._checkpoint.maps.inverse``): on a map of tunix's form (a regex -> a key
template and ``(permute, reshape)``, then a jax preprocess step stacking experts), the
stored names and shapes an export writes are the ones the map reads into the same
parameters; what the parameters do not say is refused by path, never guessed."""

import math
import re

import jax.numpy as jnp
import numpy as np
import pytest

from meshinit._checkpoint.maps import inverse, trace, traced
from meshinit._checkpoint.maps.regex_names import Unwritten
from meshinit._checkpoint.write import reverse
from meshinit.safetensors import Stack, Tensor

D, F, HEADS, HEAD_DIM, EXPERTS, LAYERS, VOCAB = 8, 12, 2, 4, 3, 2, 32

# tunix's qwen3 map in small: a split q projection, a router, experts the preprocess
# stacks, a k projection the preprocess renames, and a name tunix drops
KEY_MAP = {
    r"model\.embed_tokens\.weight": ("embedder.input_embedding", None),
    r"model\.layers\.([0-9]+)\.self_attn\.q_proj\.weight": (
        r"layers.\1.attn.q_proj.w",
        ((1, 0), (D, HEADS, HEAD_DIM)),
    ),
    r"model\.layers\.([0-9]+)\.self_attn\.k_proj\.weight": (
        r"tmp.layers.\1.attn.k",
        ((1, 0), (D, HEADS, HEAD_DIM)),
    ),
    r"model\.layers\.([0-9]+)\.mlp\.gate\.weight": (r"layers.\1.mlp.router.kernel", ((1, 0), None)),
    r"model\.layers\.([0-9]+)\.mlp\.experts\.([0-9]+)\.(gate|up|down)_proj\.weight": (
        r"layers.\1.mlp.experts.\2.\3_proj.kernel",
        ((1, 0), None),
    ),
    r"lm_head\.weight": ("unused.lm_head", None),
}
COUNTS = {"layers": LAYERS, "experts": EXPERTS}


def preprocess(params):
    """As tunix's ``_stack_experts`` (and Gemma's renaming of its temporary keys)."""
    out = dict(params)
    for key in [k for k in out if k.startswith("tmp.")]:
        out[key.removeprefix("tmp.").replace(".attn.k", ".attn.k_proj.w")] = out.pop(key)
    for layer in range(LAYERS):
        for kw in ("gate", "up", "down"):
            keys = [f"layers.{layer}.mlp.experts.{e}.{kw}_proj.kernel" for e in range(EXPERTS)]
            if all(k in out for k in keys):
                out[f"layers.{layer}.mlp.{kw}_proj"] = jnp.stack([out.pop(k) for k in keys], 0)
    return out


def match(key_map, name):
    """tunix's ``torch_key_to_jax_key``."""
    subs = [(re.sub(p, r, name), t) for p, (r, t) in key_map.items() if re.match(p, name)]
    if len(subs) != 1:
        raise ValueError(f"Only one key should be found. Found: {subs} for {name}")
    return subs[0]


def planned(router=True, k=True):
    f32 = np.dtype(np.float32)
    out = {"embedder.input_embedding": ((VOCAB, D), f32)}
    for i in range(LAYERS):
        out[f"layers.{i}.attn.q_proj.w"] = ((D, HEADS, HEAD_DIM), f32)
        if k:
            out[f"layers.{i}.attn.k_proj.w"] = ((D, HEADS, HEAD_DIM), f32)
        if router:
            out[f"layers.{i}.mlp.router.kernel"] = ((D, EXPERTS), f32)
        out[f"layers.{i}.mlp.gate_proj"] = ((EXPERTS, D, F), f32)
        out[f"layers.{i}.mlp.up_proj"] = ((EXPERTS, D, F), f32)
        out[f"layers.{i}.mlp.down_proj"] = ((EXPERTS, F, D), f32)
    return out


def solved(params, key_map=KEY_MAP, step=preprocess):
    return inverse.stored(
        key_map,
        params,
        width=D,
        counts=COUNTS,
        preprocess=lambda: step,
        match=match,
        dropped="unused.",
        family="the test's map",
    )


def follow(shapes):
    """The load's side: each stored tensor keyed and transformed as tunix does, then
    the preprocess step followed on stand-ins."""
    syms = {}
    for name, shape in shapes.items():
        key, transform = match(KEY_MAP, name)
        sym = trace.stand_in(name, shape, np.float32)
        if transform is not None:
            permute, reshape = transform
            sym = sym.transpose(permute) if permute else sym
            sym = sym.reshape(reshape) if reshape else sym
        syms[key] = sym
    return traced.trace(preprocess, syms, dict.fromkeys(syms, np.float32))


# ------------------------------------------------------------------- stored shapes


@pytest.mark.parametrize(
    ("shape", "transform", "want"),
    [
        ((D, HEADS, HEAD_DIM), ((1, 0), (D, HEADS, HEAD_DIM)), (HEADS * HEAD_DIM, D)),  # q
        ((HEADS, HEAD_DIM, D), ((1, 0), (HEADS, HEAD_DIM, D)), (D, HEADS * HEAD_DIM)),  # o
        ((D, F), ((1, 0), None), (F, D)),  # a plain transpose
        ((HEADS, HEAD_DIM), (None, (HEADS, HEAD_DIM)), (HEADS * HEAD_DIM,)),  # a bias
        ((D, HEADS, HEAD_DIM), ((1, 0), (D, -1, HEAD_DIM)), (HEADS * HEAD_DIM, D)),
        ((3, 4, 5, 6), ((2, 3, 1, 0), None), (6, 5, 3, 4)),  # a conv kernel
        ((D,), None, (D,)),
    ],
)
def test_the_stored_shape_is_the_transform_undone(shape, transform, want):
    assert inverse.stored_shape(shape, transform, D) == want
    # the map's own transform of the stored shape gives the parameter back
    x = np.zeros(want)
    if transform is not None:
        x = x.transpose(transform[0]) if transform[0] else x
        x = x.reshape(transform[1]) if transform[1] else x
    assert x.shape == shape


def test_a_reshape_whose_stored_axes_are_not_known_is_refused():
    # head_dim equal to the width: (D, heads, D) splits a (heads * D, D) or (D, D * heads)
    with pytest.raises(Unwritten, match="which stored axes it split is not known"):
        inverse.stored_shape((D, HEADS, D), ((1, 0), (D, HEADS, D)), D)
    with pytest.raises(Unwritten, match=r"reshapes it to \(8, 2, 4\), the parameter is"):
        inverse.stored_shape((D, 4, 2), ((1, 0), (D, HEADS, HEAD_DIM)), D)


@pytest.mark.parametrize(
    ("given", "stored_shape", "want"),
    [
        ((HEADS, HEAD_DIM, D), (HEADS * HEAD_DIM, D), (HEADS, HEAD_DIM, -1)),
        ((D, HEADS, HEAD_DIM), (D, HEADS * HEAD_DIM), (-1, HEADS, HEAD_DIM)),
        ((HEADS, HEAD_DIM), (HEADS * HEAD_DIM,), (HEADS, HEAD_DIM)),
        ((HEADS, -1, D), (HEADS * HEAD_DIM, D), (HEADS, HEAD_DIM, -1)),
    ],
)
def test_shape_is_spelled_as_runs_of_the_stored_axes(given, stored_shape, want):
    t = Stack([Tensor("w", shape=given, permute=tuple(range(len(given))))], axis=0)
    (part,) = inverse.respelled(t, {"w": stored_shape}).parts
    assert part.shape == want and part.permute == t.parts[0].permute
    # the export reads the runs as the stored axes (all given sizes: one axis)
    param = (1, *np.zeros(stored_shape).reshape(given).shape)
    cases = [(part, stored_shape)]
    if -1 not in given:
        cases.append((t.parts[0], (math.prod(stored_shape),)))
    for target, shape in cases:
        (made,), problems = reverse.recipes({"p": Stack([target], axis=0)}, {"p": (param, "f4")})
        assert problems == [] and made.shape == shape


def test_a_split_no_spelling_with_one_minus_one_says_is_refused():
    with pytest.raises(Unwritten, match="no spelling with one -1"):
        inverse.respelled(Tensor("w", shape=(2, 3, 4, 5)), {"w": (2, 12, 5)})
    with pytest.raises(Unwritten, match="does not split the stored"):
        inverse.respelled(Tensor("w", shape=(4, 6)), {"w": (6, 4)})


def test_a_table_is_respelled_path_by_path_each_refusal_naming_its_path():
    table = {
        "q": Tensor("q", shape=(HEADS, HEAD_DIM, D), permute=(2, 0, 1)),
        "rng": None,
        "odd": Tensor("odd", shape=(2, 3, 4, 5)),
    }
    shapes = {"q": (HEADS * HEAD_DIM, D), "odd": (2, 12, 5)}
    out, problems = inverse.spelled(table, shapes, "the map")
    assert out["q"] == Tensor("q", shape=(HEADS, HEAD_DIM, -1), permute=(2, 0, 1))
    assert out["rng"] is None and "odd" not in out
    assert [p.path for p in problems] == ["odd"]
    assert problems[0].message.startswith("the map: shape=(2, 3, 4, 5) of the stored")


# ------------------------------------------------------------------- stored tensors


def test_every_stored_tensor_of_the_parameters_is_found_with_its_shape():
    params = planned()
    made, problems = solved(params)
    assert problems == []
    fed = inverse.fed(made, params, follow)
    want = {"model.embed_tokens.weight": (VOCAB, D)}
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        want |= {
            f"{p}.self_attn.q_proj.weight": (HEADS * HEAD_DIM, D),
            f"{p}.self_attn.k_proj.weight": (HEADS * HEAD_DIM, D),
            f"{p}.mlp.gate.weight": (EXPERTS, D),
        }
        for e in range(EXPERTS):
            want |= {
                f"{p}.mlp.experts.{e}.gate_proj.weight": (F, D),
                f"{p}.mlp.experts.{e}.up_proj.weight": (F, D),
                f"{p}.mlp.experts.{e}.down_proj.weight": (D, F),
            }
    assert {n: s for n, (s, _) in fed.items()} == want
    # and the load's side reads them into the parameters' shapes
    keyed = follow({n: s for n, (s, _) in fed.items()})
    assert {k: v.shape for k, v in keyed.items()} == {p: s for p, (s, _) in params.items()}
    assert trace.target(keyed["layers.1.mlp.down_proj"]) == Stack(
        [Tensor(f"model.layers.1.mlp.experts.{e}.down_proj.weight", permute=(1, 0))
         for e in range(EXPERTS)],
        axis=0,
    )  # fmt: skip


def test_inputs_of_the_step_that_feed_no_parameter_are_left_out():
    # a dense model: no router (its shape unknown: never written), no k projection (its
    # shape stated: written, then left out as it feeds no parameter)
    params = planned(router=False, k=False)
    made, problems = solved(params)
    assert problems == []
    assert not any(".mlp.gate.weight" in c.name for c in made)
    assert any(".k_proj." in c.name for c in made)
    fed = inverse.fed(made, params, follow)
    assert not any(".k_proj." in n or ".mlp.gate.weight" in n for n in fed)
    assert fed["model.layers.0.mlp.experts.2.up_proj.weight"] == ((F, D), np.float32)


def test_each_parameter_the_map_does_not_write_is_named():
    params = planned() | {"layers.0.attn.q_proj.w_lora_a": ((D, 4), np.dtype(np.float32))}
    key_map = dict(KEY_MAP)
    key_map[r"model\.layers\.([0-9]+)\.rotary\..*"] = (r"layers.\1.rotary", None)
    _, problems = solved(params, key_map)
    assert [p.path for p in problems] == ["layers.0.attn.q_proj.w_lora_a"]
    assert problems[0].message.startswith(
        "the test's map: no entry of its map writes it (no template makes this path, nor its "
        "preprocess step from the entries written); export it with a table of your own"
    )
    assert r"'.' outside a group, not a name" in problems[0].message


def test_an_output_of_the_step_unlike_the_parameter_is_named():
    params = planned()
    params["layers.1.mlp.up_proj"] = ((EXPERTS + 1, D, F), np.dtype(np.float32))
    _, problems = solved(params)
    assert [p.path for p in problems] == ["layers.1.mlp.up_proj"]
    assert "its preprocess step makes it (3, ?, ?) of its inputs, the parameter is (4, 8, 12)" in (
        problems[0].message
    )


def test_a_step_that_fails_on_the_parameters_shapes_names_each_parameter_it_makes():
    def failing(params):
        raise ValueError("unexpected q shape")

    _, problems = solved(planned(), step=failing)
    assert len(problems) == 4 * LAYERS  # k, gate, up and down: made by the step
    assert all("failed on the parameters' shapes (ValueError" in p.message for p in problems)
