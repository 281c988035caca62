"""Meshes, byte counts, axes and lists as text: the one spelling of every table and
message."""

import jax
from jax.sharding import AbstractMesh, AxisType

from meshinit._format import axes_text, collapse_paths, describe_mesh, human_bytes, some


def test_human_bytes_uses_binary_units_and_whole_bytes():
    assert human_bytes(0) == "0 B"
    assert human_bytes(1023) == "1023 B"
    assert human_bytes(1536) == "1.5 KiB"
    assert human_bytes(3 * 2**30) == "3.0 GiB"
    assert human_bytes(2**50) == "1024.0 TiB"  # TiB is the largest unit


def test_describe_mesh_names_axes_types_and_devices():
    abstract = AbstractMesh((2, 4), ("fsdp", "tensor"), axis_types=(AxisType.Auto,) * 2)
    assert describe_mesh(abstract) == "AbstractMesh(fsdp=2, tensor=4; Auto)"
    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"))
    assert describe_mesh(mesh) == "Mesh(fsdp=2, tensor=4; Explicit; devices 0-7)"
    odd = jax.make_mesh((2,), ("x",), devices=jax.devices()[::4])
    assert describe_mesh(odd) == "Mesh(x=2; Explicit; devices 0,4)"


def test_axes_text_spells_names_nones_and_groups():
    assert axes_text(("embed", None, ("fsdp", "data"))) == "(embed, None, (fsdp,data))"
    assert axes_text(("embed", None), tight=True) == "embed,None"
    assert axes_text(None) == "replicated"
    assert axes_text((None, None), tight=True) == "replicated"
    assert axes_text((None, None)) == "(None, None)"


def test_some_shows_the_first_items_and_counts_the_rest():
    assert some(["a", "b"]) == "a, b"
    assert some(list("abcdefg")) == "a, b, c and 4 more"
    assert some(list("abc"), n=1) == "a and 2 more"


def test_a_path_repeated_with_one_key_collapses_without_claiming_other_paths():
    # the same problem said twice at each of two layers: two rows, never l.{0,1}.{0,1}
    paths = ["l.0.0", "l.0.0", "l.1.1", "l.1.1"]
    assert collapse_paths(paths, ["x"] * 4) == [("l.0.0", [0, 1]), ("l.1.1", [2, 3])]
    paths = ["l.0.w", "l.1.w", "l.1.w", "l.2.w"]
    assert collapse_paths(paths, ["x"] * 4) == [("l.{0..2}.w", [0, 1, 2, 3])]


def test_irregular_layers_split_into_exact_rows_holding_every_position():
    paths = [f"stages.{s}.layers.{i}.w" for s, i in [(0, 0), (0, 1), (1, 4), (1, 5), (0, 2)]]
    assert collapse_paths(paths, [None] * 5) == [
        ("stages.0.layers.{0..2}.w", [0, 1, 4]),
        ("stages.1.layers.{4,5}.w", [2, 3]),
    ]
