"""Plan tables drawn from the plan's record: the full table, the summary, the compact
view (repeated layers collapsed) and the HTML of notebooks."""

import html.parser
import re

import jax
import jax.numpy as jnp
from helpers import auto_abstract_mesh, cli_factory_specs, lecun, overlapping_mesh_specs
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import AbstractMesh

import meshinit
from meshinit._report import report as _report

ones = jax.nn.initializers.ones


def test_str_plan_lists_every_full_path_with_specs_and_totals():
    m = AbstractMesh((2, 4), ("fsdp", "tensor"))
    with meshinit.defaults(mesh=m, rules=(("embed", "fsdp"), ("mlp", "tensor"))):
        tree = {
            "layers": [
                {"mlp": {"up": meshinit.param((256, 1024), lecun(), axes=("embed", "mlp"))}}
                for _ in range(3)
            ]
        }
    text = str(meshinit.plan(tree))
    for i in range(3):
        assert f"layers.{i}.mlp.up" in text
    assert "P('fsdp', 'tensor')" in text and "(embed, mlp)" in text
    assert "fsdp=2,tensor=4" in text  # the mesh axes used, with sizes
    assert "128.0 KiB" in text  # 256*1024*4 bytes / 8 devices
    assert "3 params, 3.0 MiB in all, 384.0 KiB per device" in text


def llama_like(mesh, layers=3):
    rules = (("embed", "fsdp"), ("mlp", "tensor"), ("vocab", "tensor"))
    lecun = jax.nn.initializers.lecun_normal()
    with meshinit.defaults(mesh=mesh, rules=rules, dtype=jnp.bfloat16):
        return {
            "embed": meshinit.param((4096, 256), lecun, axes=("vocab", "embed")),
            "layers": [
                {
                    "mlp": {
                        "a_rather_long_name_for_the_up_projection": meshinit.param(
                            (256, 1024), lecun, axes=("embed", "mlp")
                        ),
                        "odd": meshinit.param((3, 5), lecun, axes=(None, None)),
                    },
                    "norm": meshinit.param((256,), ones, axes=("embed",)),
                }
                for _ in range(layers)
            ],
        }


def test_table_marks_params_that_an_unused_axis_could_shard_and_totals_them():
    mesh = AbstractMesh((2, 2, 2), ("data", "fsdp", "tensor"))
    plan = meshinit.plan(llama_like(mesh))
    text = str(plan)
    rows = {line.split()[0]: line for line in text.splitlines() if line.startswith("  layers.")}
    assert rows["layers.0.norm"].endswith("!")  # (256,) on fsdp: data and tensor could shard
    assert not rows["layers.0.mlp.odd"].endswith("!")  # (3, 5): nothing divides
    # every param but the 3 odd ones is replicated across data, which could shard it
    flagged = plan.groups[0].shardable_entries
    assert len(flagged) == 1 + 2 * 3
    nbytes = plan.groups[0].replicated_bytes
    assert nbytes == sum(e.device_bytes for e in flagged)
    # bf16: embed and up on fsdp and tensor (4 ways), the norms on fsdp (2 ways)
    assert nbytes == (4096 * 256 + 3 * 256 * 1024) * 2 // 4 + 3 * 256 * 2 // 2
    human = meshinit._format.human_bytes
    lines = text.splitlines()
    assert (
        f"  ! 7 params replicated across an axis that could shard them: {human(nbytes)} per device"
        in lines
    )
    # the second path would pass 100 columns: one path, then a count
    assert f"    data=2 could shard 7 ({human(nbytes)} per device): embed and 6 more" in lines
    assert (
        "    tensor=2 could shard 3 (768 B per device): layers.0.norm, layers.1.norm, layers.2.norm"
        in lines
    )
    assert "fsdp=2 could" not in text  # fsdp shards every parameter that it could
    footer = lines[-6:]  # the rows are as wide as the paths; the totals fit in 100 columns
    assert footer[0] == "  10 params, 3.5 MiB in all, 896.8 KiB per device"
    assert all(len(line) <= 100 for line in footer)


def test_summary_has_the_totals_without_the_rows():
    devices = jax.devices()
    m1 = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), devices=devices)
    m2 = jax.make_mesh((8,), ("fsdp",), devices=devices)
    tree = {"one": llama_like(m1, layers=40), "two": llama_like(m2, layers=1)}
    plan = meshinit.plan(tree)
    summary = plan.summary()
    assert "PartitionSpec" not in summary and "layers.0.mlp.odd" not in summary
    g1, g2 = plan.groups
    assert f"  121 params, {meshinit._format.human_bytes(g1.nbytes)} in all" in summary
    assert summary.count("mesh 0: Mesh(data=2, fsdp=2, tensor=2; Explicit; devices 0-7)") == 1
    assert "mesh 1: Mesh(fsdp=8; Explicit; devices 0-7)" in summary
    # both meshes use all 8 devices: the totals add up, replicated bytes too
    most = meshinit._format.human_bytes(g1.device_bytes + g2.device_bytes)
    assert f"total: 125 params, {meshinit._format.human_bytes(plan.nbytes)}, 2 meshes, " in summary
    assert summary.splitlines()[-2].endswith(f"most on one device {most}")
    repl = meshinit._format.human_bytes(g1.replicated_bytes + g2.replicated_bytes)
    assert summary.splitlines()[-1] == (
        f"! replicated across an axis that could shard them: up to {repl} on one device"
    )
    assert set(summary.splitlines()) <= set(str(plan).splitlines())
    assert all(len(line) <= 100 for line in summary.splitlines())


def stacked_tree(mesh, indices):
    """``stages.S.layers.L.w`` for each (S, L) in ``indices``."""
    tree: dict = {"stages": {}}
    for s, i in indices:
        tree["stages"].setdefault(str(s), {"layers": {}})["layers"][str(i)] = {
            "w": meshinit.param((8, 8), ones, axes=("x", None), mesh=mesh)
        }
    return tree


def compact_rows(plan):
    rows = [line.split() for line in plan.compact().splitlines()]
    return {r[0]: r for r in rows if r and r[0].startswith("stages")}


def test_compact_collapses_a_full_product_into_one_row():
    plan = meshinit.plan(stacked_tree(M2, [(s, i) for s in range(2) for i in range(4)]))
    assert list(compact_rows(plan)) == ["stages.{0,1}.layers.{0..3}.w"]
    assert compact_rows(plan)["stages.{0,1}.layers.{0..3}.w"][1] == "8"


def test_compact_keeps_indices_that_are_not_a_product_apart():
    # stage 0 holds layers 0-3, stage 1 layers 4-7: not stages {0,1} x layers {0..7}
    plan = meshinit.plan(
        stacked_tree(M2, [(0, i) for i in range(4)] + [(1, i) for i in range(4, 8)])
    )
    rows = compact_rows(plan)
    assert list(rows) == ["stages.0.layers.{0..3}.w", "stages.1.layers.{4..7}.w"]
    assert [r[1] for r in rows.values()] == ["4", "4"]


def test_compact_does_not_collapse_different_shardings_and_shows_gaps():
    def w(i):
        return meshinit.param((8, 8), ones, axes=(None, "x") if i == 3 else ("x", None), mesh=M2)

    plan = meshinit.plan({"layers": [w(i) for i in (0, 1, 2, 3, 4, 5, 7)]})
    rows = [line.split() for line in plan.compact().splitlines() if line.startswith("  layers")]
    # list positions: 0..5 and 6; position 3 shards the other dimension
    assert [(r[0], r[1], r[4]) for r in rows] == [
        ("layers.{0..2,4..6}", "6", "x,None"),
        ("layers.3", "1", "None,x"),
    ]


@settings(max_examples=100, deadline=None)
@given(st.sets(st.tuples(st.integers(0, 5), st.integers(0, 5)), min_size=1, max_size=20))
def test_collapsed_rows_cover_each_path_exactly_once(points):
    paths = [f"s.{a}.l.{b}.w" for a, b in sorted(points)]
    rows = _report.collapse_paths(paths, [None] * len(paths))
    covered = [k for _, positions in rows for k in positions]
    assert sorted(covered) == list(range(len(paths)))  # every path in exactly one row
    for path, positions in rows:
        # each row's index sets multiply out to exactly its paths
        expanded = _expand(path)
        assert sorted(expanded) == sorted(paths[k] for k in positions)


def test_compact_keeps_names_with_leading_zeros():
    tree = {k: meshinit.param((2,), ones, mesh=M2) for k in ("07", "08", "7")}
    text = meshinit.plan(tree).compact()
    paths = [line.split()[0] for line in text.splitlines()[4:7]]
    assert paths == ["07", "08", "7"]


def test_compact_sums_to_the_group_total_and_counts_every_param():
    plan = meshinit.plan(cli_factory_specs("mixed"))
    lines = plan.compact().splitlines()
    # the header says what a row's n and per device mean
    assert (
        lines[0]
        == "a row stands for the n parameters its path pattern names; per device sums all n"
    )
    assert lines[3].split() == ["path", "n", "array", "logical", "PartitionSpec", "per", "device"]
    rows = {line.split()[0]: line.split() for line in lines if line.startswith("  layers")}
    assert rows["layers.{0..3}.up"][1:5] == ["4", "f32[64,256]", "embed,mlp", "fsdp,tensor"]
    assert rows["layers.{0..3}.norm"][3:5] == ["norm", "replicated"]
    assert rows["layers.{0..3}.norm"][-1] == "!"  # replicated where fsdp or tensor could shard
    # the flagged paths are named collapsed too
    assert "    fsdp=2 could shard 4 (1.0 KiB per device): layers.{0..3}.norm" in lines
    group_lines = lines[4 : lines.index("  13 params, 641.0 KiB in all, 81.0 KiB per device")]
    assert sum(int(line.split()[1]) for line in group_lines) == 13


class _Tags(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.stack: list[str] = []
        self.tables: list[list[list[str]]] = []
        self.texts: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.stack.append(tag)
        if tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self.tables[-1].append([])
        elif tag in ("td", "th"):
            self.tables[-1][-1].append("")

    def handle_endtag(self, tag):
        assert self.stack.pop() == tag, f"</{tag}> closes something else"

    def handle_data(self, data):
        if self.stack and self.stack[-1] in ("td", "th"):
            self.tables[-1][-1][-1] += data
        self.texts.append(data)


def test_repr_html_has_one_table_per_mesh_with_escaped_paths_and_the_totals():
    tree = overlapping_mesh_specs()
    tree["<b>&x"] = meshinit.param((4,), ones, mesh=auto_abstract_mesh((2,), ("x",)))
    plan = meshinit.plan(tree)
    text = plan._repr_html_()
    assert "<b>&x" not in text and "&lt;b&gt;&amp;x" in text
    parser = _Tags()
    parser.feed(text)
    parser.close()
    assert parser.stack == []  # every tag closed, in order
    assert len(parser.tables) == len(plan.groups) == 4
    for table, group in zip(parser.tables, plan.groups, strict=True):
        head, *rows = table
        assert head[:7] == [
            "path", "shape", "dtype", "logical axes", "mesh axes", "PartitionSpec", "per device",
        ]  # fmt: skip
        assert [r[0] for r in rows] == [e.path for e in group.entries]
    assert any(t.startswith("total: 4 params") for t in parser.texts)
    assert "<b>mesh 0</b>: AbstractMesh(x=2; Auto): 1 param, 16 B in all" in text


M2 = AbstractMesh((2,), ("x",))


def _expand(path):
    """``s.{0,1}.l.{2..4}.w`` -> every path it stands for."""
    out = [""]
    for part in re.findall(r"\{[^}]*\}|[^.]+", path):
        if part.startswith("{"):
            values = []
            for run in part[1:-1].split(","):
                lo, _, hi = run.partition("..")
                values += range(int(lo), int(hi or lo) + 1)
        else:
            values = [part]
        out = [f"{o}.{v}" if o else str(v) for o in out for v in values]
    return out
