"""``PlanError`` and ``Problem``: every problem with its path, raised once."""

import meshinit


def test_plan_error_is_a_value_error_with_problems():
    err = meshinit.PlanError([meshinit.Problem("a.b", "bad"), meshinit.Problem("", "tree")])
    assert isinstance(err, ValueError)
    assert str(err) == "2 problems found while planning:\n  a.b: bad\n  tree"
