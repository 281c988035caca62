"""Pattern tables (``meshes=``, ``placements=``, ``names=``): regexes compiled or named as
problems, idle patterns found and named, ``meshinit.searched`` tables."""

import re

import pytest

import meshinit
from meshinit import _patterns
from meshinit._errors import Problem


def test_a_regex_compiles_or_says_why_not():
    assert _patterns.compile_regex("meshes[0]", r"layers\..*").pattern == r"layers\..*"
    given = re.compile("w")
    assert _patterns.compile_regex("meshes[0]", given) is given
    bad = _patterns.compile_regex("meshes[1]", "(")
    assert isinstance(bad, Problem) and bad.message.startswith("meshes[1]: regex '(' does not")
    as_bytes = _patterns.compile_regex("names[0]", b"a.b")
    assert as_bytes.message == "names[0]: the regex is bytes b'a.b'; give a str: r'a.b'"
    number = _patterns.compile_regex("names[2]", 3)
    assert number.message == "names[2]: the regex must be a str or re.Pattern, got int 3"


def test_idle_patterns_are_those_that_fullmatch_no_path():
    patterns = [re.compile(r"layers\.\d+\.w"), re.compile("layers"), re.compile("head")]
    paths = ["layers.0.w", "layers.1.w", "head"]
    assert _patterns.idle_patterns(patterns, paths) == [1]  # "layers" only searches
    table = meshinit.searched([("layers", None)])
    assert _patterns.idle_patterns(patterns[1:2], paths, table) == []
    name = _patterns.pattern_name("meshes", 1, patterns[1])
    assert name == 'meshes[1] r"layers"'


def test_searched_tables_join_paths_with_their_separator():
    table = meshinit.searched([(".*/mlp/up", None)])
    assert table.sep == "/" and table.path("model.mlp.up") == "model/mlp/up"
    assert meshinit.searched([], sep="::").path("a.b") == "a::b"
    with pytest.raises(TypeError, match="sep must be a non-empty str, got ''"):
        meshinit.searched([], sep="")
