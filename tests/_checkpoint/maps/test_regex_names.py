"""A regex map's stored names written back (``meshinit._checkpoint.maps.regex_names``):
the name each regex matches for the groups a key gives, checked by the map's own
matcher; whatever is not one name is refused, naming the regex."""

import re

import pytest

from meshinit._checkpoint.maps import regex_names
from meshinit._checkpoint.maps.regex_names import Unwritten


def match(key_map, name):
    """tunix's ``torch_key_to_jax_key``: the one entry whose regex matches the name's
    start, its template substituted (the rest of the name kept)."""
    subs = [(re.sub(p, r, name), t) for p, (r, t) in key_map.items() if re.match(p, name)]
    if len(subs) != 1:
        raise ValueError(f"Only one key should be found. Found: {subs} for {name}")
    return subs[0]


def entry(regex, template, transform=None):
    (found,), unwritable = regex_names.entries({regex: (template, transform)}, "unused.")
    assert unwritable == {}
    return found


def test_a_key_s_groups_write_the_stored_name_the_regex_matches():
    e = entry(r"model\.layers\.([0-9]+)\.self_attn\.q_proj\.weight", r"layers.\1.attn.q_proj.w")
    m = e.keys.fullmatch("layers.12.attn.q_proj.w")
    assert m is not None and e.keys.fullmatch("layers.x.attn.q_proj.w") is None
    values = {int(g[1:]): v for g, v in m.groupdict().items()}
    name = regex_names.written(e, values)
    assert name == "model.layers.12.self_attn.q_proj.weight"
    assert re.fullmatch(e.regex, name) and e.key(values) == "layers.12.attn.q_proj.w"


def test_an_optional_group_is_left_out_and_an_unused_group_takes_its_first_alternative():
    # tunix's Gemma 3: three spellings of one norm, with or without language_model.
    e = entry(
        r"(?:language_model\.)?model\.layers\.([0-9]+)\."
        r"(post_feedforward_layernorm|post_ffn_layernorm)\.weight",
        r"layers.\1.post_ffw_norm.scale",
    )
    assert regex_names.written(e, {1: "3"}) == "model.layers.3.post_feedforward_layernorm.weight"


def test_groups_inside_a_non_capturing_group_keep_their_numbers():
    e = entry(r"(?:a\.([0-9]+)\.)b\.(up|down)", r"x.\2.\1")
    assert [g.number for g in e.groups().values()] == [1, 2]
    m = e.keys.fullmatch("x.down.7")
    assert regex_names.written(e, {int(g[1:]): v for g, v in m.groupdict().items()}) == "a.7.b.down"


@pytest.mark.parametrize(
    ("regex", "why"),
    [
        (r"model\.layers\.([0-9]+)\.rotary\..*", r"'\.' outside a group, not a name"),
        (r"model\.layers\.\d+\.w", r"has \\d, a class, not a name"),
        (r"model\.[ab]\.w", r"'\[' outside a group"),
        (r"model\.(?=x)w", r"has \(\?=x\), not a name"),
        (r"model\.(a)?\.w", r"has \(a\)\?, not a name"),
    ],
)
def test_a_regex_that_is_not_one_name_is_named_with_why(regex, why):
    found, unwritable = regex_names.entries({regex: ("w", None), r"b\.w": ("b", None)}, "x.")
    assert [e.regex for e in found] == [r"b\.w"]
    assert list(unwritable) == [regex] and re.search(why, unwritable[regex]), unwritable


def test_the_dropped_names_and_a_template_of_a_missing_group_are_not_entries():
    key_map = {r"lm_head\.weight": ("unused.lm_head", None), r"a\.([0-9]+)": (r"x.\2", None)}
    found, unwritable = regex_names.entries(key_map, "unused.")
    assert found == []
    assert unwritable == {r"a\.([0-9]+)": r"its template 'x.\\2' uses \2, a group its regex lacks"}


def test_a_group_the_template_does_not_use_and_that_is_no_name_is_refused():
    e = entry(r"model\.(.*)\.weight", "w")
    with pytest.raises(Unwritten, match=r"group \(\.\*\) is not in its template"):
        regex_names.written(e, {})
    with pytest.raises(Unwritten, match=r"'x' is not \(\[0-9\]\+\)"):
        regex_names.written(entry(r"a\.([0-9]+)", r"k.\1"), {1: "x"})


def test_a_name_the_map_reads_back_otherwise_is_refused():
    # the second regex also matches the name's start: tunix's matcher finds two entries
    key_map = {
        r"model\.norm\.weight": ("final_norm.w", None),
        r"model\.norm\.weigh": ("other", None),
        r"model\.embed\.weight": ("embedder", None),
    }
    found, _ = regex_names.entries(key_map, "unused.")
    assert regex_names.checked(found[2], {}, "embedder", key_map, match) == "model.embed.weight"
    with pytest.raises(Unwritten, match=r"reads model\.norm\.weight .* as no entry, or several"):
        regex_names.checked(found[0], {}, "final_norm.w", key_map, match)
