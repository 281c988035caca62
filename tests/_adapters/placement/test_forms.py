"""What every form of ``placements=`` offers the adapters: a form that places nothing
more than it matches refuses nothing, lacks no path and finishes with no problem;
each form (table, tree, rule) is one of them."""

from jax.sharding import PartitionSpec as P

from meshinit._adapters.placement import forms, read


class Nothing(forms.Placements):
    def match(self, path, struct=None):
        return None


def test_the_defaults_refuse_nothing_and_lack_no_path():
    form = Nothing()
    assert bool(form)  # a form given is a form, even one that matches nothing
    assert form.match("w") is None and not form.lacks("w")
    assert form.refuse([("step", 3)], ["w"]) == []
    assert form.finish("test", ["w"], "metadata", [("step", 3)]) == []


def test_every_form_read_is_a_placements():
    for given in ([(r".*", None)], {"w": P()}, lambda path, struct: None):
        form, problems = read.parse(given)
        assert isinstance(form, forms.Placements) and problems == []
