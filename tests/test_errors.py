"""meshinit._errors: ``PlanError`` and ``Problem`` (every problem with its path, raised
once), ``printable`` (text a terminal cannot act on), and the warnings and errors the
package raises, with the classes they subclass and the data they carry."""

import warnings

import pytest
from hypothesis import given
from hypothesis import strategies as st

import meshinit
from meshinit._errors import RenamedWarning, printable


def test_plan_error_is_a_value_error_with_problems():
    err = meshinit.PlanError([meshinit.Problem("a.b", "bad"), meshinit.Problem("", "tree")])
    assert isinstance(err, ValueError)
    assert str(err) == "2 problems found while planning:\n  a.b: bad\n  tree"


def test_one_problem_is_counted_in_the_singular_and_a_header_replaces_the_count():
    problems = (p for p in [meshinit.Problem("w", "bad")])  # any iterable, read once
    err = meshinit.PlanError(problems)
    assert str(err) == "1 problem found while planning:\n  w: bad"
    assert err.problems == [meshinit.Problem("w", "bad")]  # kept as a list
    err = meshinit.PlanError([meshinit.Problem("w", "bad")], header="cannot load:")
    assert str(err) == "cannot load:\n  w: bad"


@pytest.mark.parametrize(
    "text",
    ["layers.3.mlp.up", "", "embed tokens", "çà.日本.é", "emoji.😀", "a/b[0]['x']"],
)
def test_printable_text_is_returned_unchanged(text):
    assert printable(text) == text


@pytest.mark.parametrize(
    "text, want",
    [
        ("a\nb", "a\\nb"),
        ("a\tb\r", "a\\tb\\r"),
        ("\x1b[31mred", "\\x1b[31mred"),  # a colour escape cannot recolour a table
        ("nul\x00", "nul\\x00"),
        ("bad\udcff", "bad\\udcff"),  # a lone surrogate, as os.fsdecode makes them
        ("del\x7f", "del\\x7f"),
        ("zero\u200bwidth", "zero\\u200bwidth"),
    ],
)
def test_printable_escapes_what_a_terminal_would_act_on_or_cannot_show(text, want):
    assert printable(text) == want


@given(st.text())
def test_printable_output_is_always_printable_and_keeps_every_printable_character(text):
    got = printable(text)
    assert got.isprintable()
    rest = iter(got)  # every printable character kept, in order (a subsequence)
    assert all(c in rest for c in text if c.isprintable())
    if text.isprintable():
        assert got == text


def test_a_problem_escapes_its_path_but_not_its_message():
    problem = meshinit.Problem("layer\n0", "no rule;\nknown: embed")
    assert str(problem) == "layer\\n0: no rule;\nknown: embed"
    assert str(meshinit.Problem("", "the tree is empty")) == "the tree is empty"


@pytest.mark.parametrize(
    "warning",
    [meshinit.UnusedPatternWarning, meshinit.UnusedTensorWarning, meshinit.FallbackWarning],
)
def test_the_warnings_are_user_warnings_that_a_filter_silences_or_raises(warning):
    assert issubclass(warning, UserWarning)  # shown by default
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", category=warning)
        warnings.warn(warning("quiet"), stacklevel=1)
    assert said == []
    with warnings.catch_warnings():
        warnings.simplefilter("error", warning)
        with pytest.raises(warning, match="loud"):
            warnings.warn(warning("loud"), stacklevel=1)


def test_an_unused_tensor_warning_carries_the_unused_names():
    warning = meshinit.UnusedTensorWarning("2 tensors unused: a, b", ["a", "b"])
    assert warning.tensors == ("a", "b") and str(warning) == "2 tensors unused: a, b"
    assert meshinit.UnusedTensorWarning("none named").tensors == ()


def test_a_renamed_method_warns_as_a_deprecation_and_a_peer_failure_is_a_runtime_error():
    assert issubclass(RenamedWarning, DeprecationWarning)  # hidden outside __main__ and tests
    assert not issubclass(RenamedWarning, UserWarning)
    assert issubclass(meshinit.PeerFailure, RuntimeError)
    assert str(meshinit.PeerFailure("process 1 failed")) == "process 1 failed"


def test_the_same_problem_in_repeated_layers_is_one_line_naming_the_layers():
    problems = [
        meshinit.Problem(f"layers.{i}.mlp.up", "logical axis 'mlpp' has no rule") for i in range(32)
    ] + [meshinit.Problem("layers.7.mlp.down", "dimension 0 is not divisible")]
    err = meshinit.PlanError(problems)
    assert str(err) == (
        "33 problems found while planning (2 after collapsing repeated layers):\n"
        "  layers.{0..31}.mlp.up: logical axis 'mlpp' has no rule\n"
        "  layers.7.mlp.down: dimension 0 is not divisible"
    )
    assert err.problems == problems  # the data keeps every path
    # A header of the caller's own is kept; the lines collapse all the same.
    err = meshinit.PlanError(problems[:3], header="cannot load:")
    assert str(err) == "cannot load:\n  layers.{0..2}.mlp.up: logical axis 'mlpp' has no rule"


def test_layers_with_other_messages_or_gaps_are_not_claimed():
    problems = [meshinit.Problem(f"layers.{i}.w", "bad") for i in (0, 1, 2, 5)]
    problems.append(meshinit.Problem("layers.3.w", "other"))
    assert str(meshinit.PlanError(problems)).splitlines()[1:] == [
        "  layers.{0..2,5}.w: bad",
        "  layers.3.w: other",
    ]


def test_a_plan_of_32_layers_with_one_typo_raises_one_line():
    import jax

    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"))
    rules = (("embed", "fsdp"), ("mlp", "tensor"))
    specs = {
        "layers": [
            {"up": meshinit.param((8, 16), jax.nn.initializers.zeros, axes=("embed", "mlpp"),
                                  mesh=mesh, rules=rules)}
            for _ in range(32)
        ]
    }  # fmt: skip
    with pytest.raises(
        meshinit.PlanError,
        match=r"^32 problems found while planning \(1 after collapsing repeated layers\):\n"
        r"  layers\.\{0\.\.31\}\.up: logical axis 'mlpp' has no rule; did you mean 'mlp'\?[^\n]*$",
    ) as exc:
        meshinit.plan(specs)
    assert [p.path for p in exc.value.problems] == [f"layers.{i}.up" for i in range(32)]
