"""``meshinit plan --rules``: the rule table read inline or from a file
(:mod:`meshinit._cli.rules`). The command line's own use of it: ``test_cli.py``."""

import pytest

import meshinit
from meshinit._cli.rules import RulesError, parse_rules

TABLE = (("embed", "fsdp"), ("mlp", ("tensor", "expert")), ("norm", None))


def test_inline_pairs_give_the_table_flax_and_meshinit_take():
    rules = parse_rules("embed=fsdp, mlp=tensor+expert ,norm=")
    assert rules == TABLE
    # the planner's own normalization leaves it as it is: the same table
    assert meshinit.logical_to_mesh_axes(("embed", "mlp"), rules) == ("fsdp", ("tensor", "expert"))


def test_a_json_list_and_maxtexts_yaml_give_the_same_table(tmp_path):
    (tmp_path / "r.json").write_text(
        '[["embed", "fsdp"], ["mlp", ["tensor", "expert"]], ["norm", null]]'
    )
    (tmp_path / "base.yaml").write_text(
        "base_emb_dim: 64\n"
        "logical_axis_rules: [['embed', 'fsdp'], ['mlp', ['tensor', 'expert']], ['norm', null]]\n"
    )
    assert parse_rules(str(tmp_path / "r.json")) == TABLE
    assert parse_rules(str(tmp_path / "base.yaml")) == TABLE


def test_a_file_without_a_suffix_is_read_when_it_exists(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rules").write_text('[["embed", "fsdp"]]')
    assert parse_rules("rules") == (("embed", "fsdp"),)


def test_several_problems_are_named_at_once():
    with pytest.raises(
        RulesError, match=r"'a' is not NAME=AXES; 'b=x y': 'x y' is not a mesh axis"
    ):
        parse_rules("a,b=x y,c=fsdp")
