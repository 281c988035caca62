"""The likely name behind a typo: what every "did you mean" of the package suggests."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshinit._typos import closest, edits

LOGICAL = ("embed", "heads", "kv_heads", "mlp", "mlp_out", "vocab", "fsdp", "tensor", "tp")


@pytest.mark.parametrize(
    "typo, meant",
    [("mpl", "mlp"), ("embde", "embed"), ("haeds", "heads"), ("vocb", "vocab"),
     ("mlpp", "mlp"), ("tensr", "tensor"), ("MLP", "mlp"), ("emebd", "embed"),
     ("kv_haeds", "kv_heads")],
)  # fmt: skip
def test_a_swap_of_neighbours_is_one_edit_like_any_typo(typo, meant):
    # difflib's ratio put mpl -> mlp at 0.67 and MLP -> mlp at 0 (the rules' cutoff was
    # 0.75), so those got no suggestion and the user only the replicate rule
    assert closest(typo, LOGICAL) == meant


@pytest.mark.parametrize("name", ["dp", "q", "ffw", "xyz", "layers", "heads_kv", "mlp_in"])
def test_nothing_is_suggested_for_a_short_or_another_name(name):
    # 'dp' is one edit from 'tp' and 'mlp_in' two from 'mlp_out': other axes, not typos
    assert closest(name, LOGICAL) is None


@pytest.mark.parametrize(
    "name, meant",
    [
        # a word of a path mistyped, a component added or dropped in one place
        ("model.layers.0.mlp.up_porj.weight", "model.layers.0.mlp.up_proj.weight"),
        ("layers.0.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight"),
        ("model.layers.0.mlp.up_proj", "model.layers.0.mlp.up_proj.weight"),
        ("model.language_model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight"),
        # another weight: difflib's ratio suggested each of these (0.67 to 0.97)
        ("model.layers.1.mlp.up_proj.weight", None),
        ("model.layers.0.mlp.down_proj.weight", None),
        ("model.layers.0.self_attn.q_proj.weight", None),
        ("model.layers.0.input_layernorm.weight", None),
        ("model.embed_tokens.weight", None),
        ("embed.weight", None),
    ],
)
def test_a_path_gets_the_path_it_mistypes_and_never_another_weight(name, meant):
    stored = ["lm_head.weight", "model.layers.0.mlp.up_proj.weight", "model.norm.weight"]
    assert closest(name, stored) == meant


def test_the_fewest_edits_win_then_the_earlier_candidate():
    assert closest("layers.0.upp", ["model.layers.0.upp", "layers.0.up"]) == "layers.0.up"
    assert closest("mlpx", ["mlp1", "mlp2"]) == "mlp1"
    assert closest("mlp", ["mlp", "MLP"]) == "MLP"  # never the name itself


def _osa(a: str, b: str) -> int:
    """Optimal string alignment, the whole table: the reference for edits()."""
    d = [[i + j if i * j == 0 else 0 for j in range(len(b) + 1)] for i in range(len(a) + 1)]
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            sub = d[i - 1][j - 1] + (a[i - 1] != b[j - 1])
            d[i][j] = min(d[i - 1][j] + 1, d[i][j - 1] + 1, sub)
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                d[i][j] = min(d[i][j], d[i - 2][j - 2] + 1)
    return d[-1][-1]


@given(st.text("abc.", max_size=9), st.text("abc.", max_size=9), st.integers(0, 9))
def test_edits_is_the_whole_table_cut_at_most(a, b, most):
    # the shared prefix and suffix, the band and the early end change no count
    assert edits(a, b, most) == min(_osa(a, b), most + 1)
