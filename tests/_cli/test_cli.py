"""``meshinit plan MODULE:FACTORY`` and the reports it prints: compact, JSON, PNG, HTML."""

import json
import pathlib
import re
import subprocess
import sys

import jax
import pytest
from helpers import auto_abstract_mesh, cli_factory_specs, run_python

import meshinit
from meshinit._cli.cli import main

ROOT = pathlib.Path(__file__).resolve().parents[2]
F = str(ROOT / "tests" / "cli_factories.py")
MESH = ["--abstract-mesh", "fsdp=2,tensor=4"]
ones = jax.nn.initializers.ones


def plan_cli(capsys, *args):
    """Runs ``meshinit plan ARGS`` in this process: (exit status, stdout, stderr)."""
    rc = main(["plan", *args])
    out, err = capsys.readouterr()
    return rc, out, err


# The plan command


@pytest.mark.parametrize("view", [[], ["--compact"], ["--json"]])
def test_plan_prints_the_plan_and_allocates_nothing(capsys, new_arrays, view):
    with new_arrays() as made:
        rc, out, err = plan_cli(capsys, f"{F}:mixed", *MESH, *view)
    assert rc == 0, err
    assert made == []  # planning only: no parameter, no key, nothing
    assert err == ""
    if view == ["--json"]:
        assert json.loads(out)["totals"]["params"] == 14
    else:
        assert "mesh 0: AbstractMesh(fsdp=2, tensor=4; Auto)  (mesh from --abstract-mesh)" in out
        assert "mesh 1: AbstractMesh(tensor=4; Auto)  (mesh from spec)" in out
        assert out.rstrip().endswith(
            "most on one device 81.0 KiB\n! replicated across an "
            "axis that could shard them: up to 1.0 KiB on one device"
        )


def test_table_lists_every_path_and_equals_print_plan(capsys):
    rc, out, _ = plan_cli(capsys, f"{F}:specs", *MESH)
    assert rc == 0
    plan = meshinit.plan(cli_factory_specs("specs"))
    # the same table print(plan) shows, with the mesh's source in its heading
    assert out.rstrip("\n") == str(plan).replace(
        "mesh 0: AbstractMesh(fsdp=2, tensor=4; Auto)",
        "mesh 0: AbstractMesh(fsdp=2, tensor=4; Auto)  (mesh from --abstract-mesh)",
    )
    for e in plan.entries:
        assert f"  {e.path}  " in out


def test_a_spec_binding_an_equal_abstract_mesh_shares_the_group(capsys):
    # jax interns AbstractMesh: AbstractMesh((2,), ("x",)) is the mesh --abstract-mesh x=2
    # builds, so both specs land in one group, labelled as from --abstract-mesh.
    rc, out, _ = plan_cli(capsys, f"{F}:same_mesh_twice", "--abstract-mesh", "x=2")
    assert rc == 0
    assert out.count("mesh 0: AbstractMesh(x=2; Auto)  (mesh from --abstract-mesh)") == 1
    assert "mesh 1" not in out


def test_without_abstract_mesh_concrete_meshes_print_unlabelled(capsys):
    rc, out, _ = plan_cli(capsys, f"{F}:stages", "--compact")
    assert rc == 0
    assert "mesh 0: Mesh(fsdp=2, tensor=2; Explicit; devices 0-3)\n" in out
    assert "mesh 1: Mesh(fsdp=2, tensor=2; Explicit; devices 4-7)\n" in out
    assert "0.layers.{0..3}.up" in out and "1.layers.{4..7}.up" in out
    assert "mesh from" not in out


def test_module_name_form_imports_from_sys_path(capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tests"))
    rc, out, err = plan_cli(capsys, "cli_factories:specs", *MESH, "--compact")
    assert rc == 0, err
    assert "layers.{0..3}.up" in out


def test_nnx_module_paths_are_those_materialize_uses(capsys):
    rc, out, _ = plan_cli(capsys, f"{F}:nnx_model", *MESH, "--json")
    assert rc == 0
    params = json.loads(out)["params"]
    assert [p["path"] for p in params] == ["blocks.0.up", "blocks.1.up", "blocks.2.up", "head"]
    assert {p["path"]: p["partition_spec"] for p in params}["head"] == ["fsdp", "tensor"]
    # meshinit.nnx.materialize places the same module at exactly these paths and specs
    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"))
    model = meshinit.nnx.materialize(cli_factory_specs("nnx_model", mesh), 0)
    assert model.blocks[1].up.get_value().sharding.spec == jax.sharding.PartitionSpec(
        *params[1]["partition_spec"]
    )


def test_equinox_module_plans_directly(capsys):
    rc, out, _ = plan_cli(capsys, f"{F}:eqx_model", *MESH, "--compact")
    assert rc == 0
    lines = out.splitlines()
    assert any(line.split()[:2] == ["layers.{0,1}.up", "2"] for line in lines)
    assert any(line.split()[:2] == ["head", "1"] for line in lines)


# Ordinary nnx code: traced, never called, planned as meshinit.nnx.plan plans it


def factory(name):
    """``cli_factories.NAME`` itself, uncalled."""
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        import cli_factories
    finally:
        sys.path.remove(str(ROOT / "tests"))
    return getattr(cli_factories, name)


NNX_PATHS = [
    *(
        f"blocks.{i}.{name}"
        for i in range(3)
        for name in ("down.bias", "down.kernel", "norm.scale", "up.bias", "up.kernel")
    ),
    "dropout.rngs.count",
    "dropout.rngs.key",
]


@pytest.mark.parametrize("view", [[], ["--compact"], ["--json"]])
def test_ordinary_nnx_code_is_planned_without_calling_it(capsys, new_arrays, view):
    with pytest.raises(ValueError, match="mesh context or metadata is required"):
        factory("nnx_ordinary")()  # called eagerly, flax has no mesh for the kernels
    with new_arrays() as made:
        rc, out, err = plan_cli(capsys, f"{F}:nnx_ordinary", *MESH, *view)
    assert rc == 0, err
    assert made == []  # traced only: no parameter, no key, nothing
    assert err == ""
    if view == ["--json"]:
        d = json.loads(out)
        assert [m["mesh_from"] for m in d["meshes"]] == ["--abstract-mesh", "metadata"]
        specs = {p["path"]: (p["mesh"], p["partition_spec"]) for p in d["params"]}
        assert list(specs) == [*NNX_PATHS, "head"]  # nnx paths, as meshinit.nnx.init's
        assert specs["blocks.1.up.kernel"] == (0, ["fsdp", "tensor"])
        assert specs["blocks.2.down.kernel"] == (0, ["tensor", "fsdp"])
        assert specs["blocks.0.norm.scale"] == (0, [])  # no metadata: replicated, P()
        assert specs["head"] == (1, [None, "tensor"])  # its own mesh=
    else:
        heads = [line for line in out.splitlines() if line.startswith("mesh ")]
        assert heads == [
            "mesh 0: AbstractMesh(fsdp=2, tensor=4; Auto)  (mesh from --abstract-mesh)",
            "mesh 1: AbstractMesh(tensor=4; Auto)  (mesh from metadata)",
        ]
        rows = {line.split()[0]: line.split() for line in out.splitlines()[1:] if line[:3] == "  b"}
        if view == ["--compact"]:
            assert rows["blocks.{0..2}.up.kernel"][1:5] == ["3", "f32[64,256]", "-", "fsdp,tensor"]
        else:
            assert rows["blocks.0.up.kernel"][1:6] == [
                "(64,", "256)", "float32", "-", "fsdp=2,tensor=4"
            ]  # fmt: skip


def test_abstract_mesh_goes_where_jax_set_mesh_would_and_matches_nnx_plan(capsys):
    rc, out, _ = plan_cli(capsys, f"{F}:nnx_ordinary", *MESH, "--json")
    assert rc == 0
    d = json.loads(out)
    for m in d["meshes"]:
        del m["mesh_from"]
    # every Variable whose metadata names no mesh gets --abstract-mesh; head keeps its own
    mesh = auto_abstract_mesh((2, 4), ("fsdp", "tensor"))
    expected = meshinit.nnx.plan(factory("nnx_ordinary"), meshes=[(r"(?!head$).*", mesh)])
    assert d == expected.to_dict()


def test_ordinary_nnx_code_on_a_real_mesh_allocates_nothing(capsys, new_arrays):
    with pytest.raises(MemoryError, match="was called, not traced"):
        factory("nnx_ordinary_on_mesh")()  # it stands for a model too large to allocate
    with new_arrays() as made:
        rc, out, err = plan_cli(capsys, f"{F}:nnx_ordinary_on_mesh", "--json")
    assert rc == 0, err
    assert made == []  # called, it would have allocated every layer
    d = json.loads(out)
    assert "mesh_from" not in d["meshes"][0]  # no --abstract-mesh: no labels
    kernels = [p for p in d["params"] if p["path"].endswith("kernel")]
    assert [p["path"] for p in kernels] == [f"layers.{i}.kernel" for i in range(4)]
    assert {(p["partition_spec"][0], p["partition_spec"][1]) for p in kernels} == {
        ("fsdp", "tensor")
    }
    assert d["meshes"][kernels[0]["mesh"]]["device_ids"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert d == meshinit.nnx.plan(factory("nnx_ordinary_on_mesh")).to_dict()


def test_ordinary_nnx_code_without_a_mesh_names_each_variable_and_the_option(capsys, new_arrays):
    with new_arrays() as made:
        rc, out, err = plan_cli(capsys, f"{F}:nnx_ordinary", "--compact")
    assert rc == 2 and out == "" and made == []
    assert err.splitlines() == [
        "meshinit plan: 6 problems found while planning (2 after collapsing repeated layers):",
        "  blocks.{0..2}.down.kernel: has sharding metadata but no mesh: pass mesh= to "
        "meshinit.nnx.plan (or to the Variable), build it under jax.set_mesh, or give it one "
        "with meshes=",
        "  blocks.{0..2}.up.kernel: has sharding metadata but no mesh: pass mesh= to "
        "meshinit.nnx.plan (or to the Variable), build it under jax.set_mesh, or give it one "
        "with meshes=",
        "hint: --abstract-mesh data=16,fsdp=16,tensor=8 gives nnx Variables without a mesh "
        "one, as jax.set_mesh would",
    ]


ODD_FACTORIES = """
import jax, jax.numpy as jnp
import meshinit
from flax import nnx

RNGS = nnx.Rngs(0)


class Model(nnx.Module):
    def __init__(self, rngs):
        self.l = nnx.Linear(4, 8, rngs=rngs)


def outside_rngs():
    return Model(RNGS)


def reads_a_value():
    n = int(jnp.sum(jnp.ones(4)))  # concrete only when called, not when traced
    return {"w": meshinit.param((n, 8), jax.nn.initializers.ones,
                                mesh=jax.sharding.AbstractMesh((2,), ("x",)))}
"""


def test_a_spec_factory_that_cannot_be_traced_is_called_as_before(capsys, tmp_path):
    (tmp_path / "odd.py").write_text(ODD_FACTORIES)
    rc, out, err = plan_cli(capsys, f"{tmp_path / 'odd.py'}:reads_a_value", "--json")
    assert rc == 0, err
    assert [(p["path"], p["shape"]) for p in json.loads(out)["params"]] == [("w", [4, 8])]


def test_nnx_code_that_cannot_be_traced_says_why(capsys, tmp_path):
    (tmp_path / "odd.py").write_text(ODD_FACTORIES)
    rc, out, err = plan_cli(capsys, f"{tmp_path / 'odd.py'}:outside_rngs")
    assert rc == 2 and out == ""
    assert err.count("\n") == 1
    assert err.startswith(f"meshinit plan: meshinit.nnx.plan({tmp_path / 'odd.py'}:outside_rngs)")
    assert "must build its own nnx.Rngs" in err


# Bad input: one line on stderr, exit status 2, never a traceback


def bad(name):
    return f"{F}:{name}"


BAD = [
    (["nofile.py:model"], r"no such file: nofile\.py$"),
    (["examples/nope.py:model"], r"no such file: examples/nope\.py$"),
    (["no_such_module_xyz:model"], r"no module named 'no_such_module_xyz'; give an importable"),
    (["cli_factories"], r"'cli_factories': expected MODULE:FACTORY, e\.g\. "),
    (
        [bad("nope")],
        r"cli_factories\.py has no attribute 'nope'; it defines bad_axes, empty, .*, \.\.\.$",
    ),
    ([bad("NOT_A_FUNCTION")], r"NOT_A_FUNCTION is not callable \(int\); give a function"),
    ([bad("needs_arguments")], r"needs_arguments\(depth\) needs arguments; meshinit plan "),
    (
        [bad("raises")],
        r"cli_factories\.py:raises\(\) raised ValueError: vocab size 1000 is not a multiple "
        r"of 128$",
    ),
    ([bad("empty")], r"empty\(\) returned a dict with no meshinit\.param specs in it; return "),
    (
        [bad("specs"), "--abstract-mesh", "data=x"],
        r"--abstract-mesh 'data=x': the size 'x' of data is not a positive integer; "
        r"expected NAME=SIZE pairs joined by commas, e\.g\. data=16,fsdp=16,tensor=8$",
    ),
    ([bad("specs"), "--abstract-mesh", "data=0"], r"the size '0' of data is not a positive"),
    ([bad("specs"), "--abstract-mesh", "data"], r"'data' is not NAME=SIZE; expected NAME="),
    ([bad("specs"), "--abstract-mesh", "1a=2"], r"'1a' is not an axis name; expected NAME="),
    ([bad("specs"), "--abstract-mesh", "x=2,x=4"], r"axis 'x' appears twice; expected NAME="),
    ([bad("specs"), "--abstract-mesh", ""], r"'' is not NAME=SIZE; expected NAME="),
    ([bad("specs"), "--devices", "0"], r"--devices must be a positive number, got 0$"),
    (
        [bad("specs"), *MESH, "--png", "/no/such/dir/plan.png"],
        r"cannot write /no/such/dir/plan\.png: no directory /no/such/dir$",
    ),
]


@pytest.mark.parametrize("argv, message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    rc, out, err = plan_cli(capsys, *argv)
    assert rc == 2
    assert out == ""
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("meshinit plan: ")
    assert err.rstrip("\n") == err.strip()
    assert re.search(message, err.rstrip("\n")), err


def test_plan_error_prints_its_problems_collapsed(capsys):
    rc, out, err = plan_cli(capsys, bad("bad_axes"), *MESH)
    assert rc == 2 and out == ""
    assert err.splitlines() == [
        "meshinit plan: 7 problems found while planning (2 after collapsing repeated layers):",
        "  layers.{0..5}.up: logical axis 'mlpp' has no rule; did you mean 'mlp'? (known: "
        "embed, mlp, norm, vocab); fix the name, or add ('mlpp', None) to the rules to "
        "replicate it",
        "  odd: dimension 0 (logical 'vocab') of size 3 is not divisible by mesh axes 'tensor' "
        "of size 4; pad the dimension or map it to other mesh axes",
    ]


def test_specs_without_a_mesh_get_a_hint_about_abstract_mesh(capsys):
    rc, _, err = plan_cli(capsys, bad("specs"))
    assert rc == 2
    lines = err.splitlines()
    assert lines[0] == (
        "meshinit plan: 13 problems found while planning (4 after collapsing repeated layers):"
    )
    assert lines[2].startswith("  layers.{0..3}.down: no mesh given and no default")
    assert lines[-1] == (
        "hint: --abstract-mesh data=16,fsdp=16,tensor=8 gives specs without a mesh one"
    )


def test_many_problems_are_capped(capsys, tmp_path):
    source = tmp_path / "many.py"
    source.write_text(
        "import jax, meshinit\n"
        "def model():\n"
        "    return {f'p{i}': meshinit.param((3,), jax.nn.initializers.ones, axes=('x',))"
        " for i in range(30)}\n"
    )
    rc, _, err = plan_cli(capsys, f"{source}:model", "--abstract-mesh", "x=2")
    lines = err.splitlines()
    assert rc == 2 and len(lines) == 12  # heading, 10 problems, the rest counted
    assert lines[0] == "meshinit plan: 30 problems found while planning:"
    assert lines[-1] == "  +20 more"


@pytest.mark.parametrize(
    "body, message",
    [
        ("raise RuntimeError('no config file')", "RuntimeError: no config file"),
        ("import no_such_dependency_xyz", "ModuleNotFoundError: No module named 'no_such_"),
        ("def broken(:\n    pass", "SyntaxError: "),
        ("import sys\nsys.exit(3)", "SystemExit: 3"),
    ],
)
def test_a_module_that_fails_to_import_is_one_line(capsys, tmp_path, body, message):
    source = tmp_path / "failing.py"
    source.write_text(body + "\n")
    rc, _, err = plan_cli(capsys, f"{source}:model")
    assert rc == 2
    assert err.startswith(f"meshinit plan: importing {source} failed: {message}")
    assert err.count("\n") == 1


def test_devices_after_jax_started_is_an_error_not_a_crash(capsys):
    n = len(jax.devices())  # the backend is up, with the suite's 8 devices
    rc, _, err = plan_cli(capsys, bad("specs"), *MESH, "--devices", str(n + 1))
    assert rc == 2
    assert err == (
        f"meshinit plan: --devices {n + 1}: jax already started its backend with {n} devices "
        "in this process\n"
    )
    assert len(jax.devices()) == n


def test_png_without_matplotlib_names_the_extra(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    rc, out, err = plan_cli(capsys, bad("specs"), *MESH, "--png", str(tmp_path / "p.png"))
    assert rc == 2 and out == ""
    assert err == ("meshinit plan: drawing a plan needs matplotlib: pip install 'meshinit[plot]'\n")
    assert not (tmp_path / "p.png").exists()


def test_json_and_compact_cannot_be_combined(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", bad("specs"), "--json", "--compact"])
    assert e.value.code == 2
    assert "argument --compact: not allowed with argument --json" in capsys.readouterr().err


# As a new user runs it: a subprocess


@pytest.mark.slow
def test_subprocess_plans_405b_compactly_in_100_columns():
    r = run_python(
        "-m", "meshinit", "plan", "examples/capacity_405b.py:model",
        "--abstract-mesh", "data=16,fsdp=16,tensor=8", "--compact",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[2] == (
        "mesh 0: AbstractMesh(data=16, fsdp=16, tensor=8; Auto)  (mesh from --abstract-mesh)"
    )
    up = next(line for line in lines if "layers.{0..125}.mlp.up" in line).split()
    assert up == [
        "layers.{0..125}.mlp.up", "126", "bf16[16384,53248]", "embed,mlp",
        "(fsdp,data),tensor", "102.4", "MiB",
    ]  # fmt: skip
    assert lines[-1] == "total: 1137 params, 756.0 GiB, 1 mesh, most on one device 378.0 MiB"
    assert len(lines) == 21  # the header line, then 12 rows for 1137 params
    assert all(len(line) <= 100 for line in lines)


@pytest.mark.slow
def test_subprocess_devices_sets_the_simulated_device_count():
    # cli_factories.stages builds concrete meshes over 8 devices
    ok = run_python("-m", "meshinit", "plan", "tests/cli_factories.py:stages", "--devices", "8")
    assert ok.returncode == 0, ok.stderr
    assert "mesh 1: Mesh(fsdp=2, tensor=2; Explicit; devices 4-7)" in ok.stdout
    one = run_python("-m", "meshinit", "plan", "tests/cli_factories.py:stages")
    assert one.returncode == 2
    assert one.stderr.startswith(
        "meshinit plan: tests/cli_factories.py:stages() raised ValueError: Number of devices 1"
    )
    # the error, then one hint line naming --devices
    assert one.stderr.count("\n") == 2 and "Traceback" not in one.stderr
    assert "--devices N (N >= 4" in one.stderr


@pytest.mark.slow
def test_subprocess_bad_input_has_no_traceback():
    r = run_python("-m", "meshinit", "plan", "examples/capacity_405b.py:nope")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == (
        "meshinit plan: examples/capacity_405b.py has no attribute 'nope'; it defines "
        "layer, main, model, specs\n"
    )


@pytest.mark.slow
def test_subprocess_piped_into_head_ends_quietly():
    # the full 405B table (~130 KB) overflows the pipe once the reader stops reading
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshinit", "plan", "examples/capacity_405b.py:model"]
        + ["--abstract-mesh", "data=16,fsdp=16,tensor=8"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    assert proc.stdout.readline().startswith("mesh 0: AbstractMesh(data=16")
    proc.stdout.close()
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 1
    assert err == ""  # no BrokenPipeError traceback


# Compact view


# JSON


def test_json_has_one_record_a_line_and_says_where_meshes_came_from(capsys):
    rc, out, _ = plan_cli(capsys, f"{F}:mixed", *MESH, "--json")
    assert rc == 0
    d = json.loads(out)
    assert [m["mesh_from"] for m in d["meshes"]] == ["--abstract-mesh", "spec"]
    assert d["meshes"][0]["abstract"] is True and d["meshes"][0]["device_ids"] is None
    lines = out.splitlines()
    for p in d["params"]:
        assert sum(f'{{"path": "{p["path"]}"' in line for line in lines) == 1
    plan = meshinit.plan(cli_factory_specs("mixed"))
    assert [p["path"] for p in d["params"]] == [e.path for e in plan.entries]
    del d["meshes"][0]["mesh_from"], d["meshes"][1]["mesh_from"]
    assert d == plan.to_dict()


# HTML


def test_replicated_flag_quiets_the_hints_for_those_axes(capsys):
    rc, loud, _ = plan_cli(capsys, f"{F}:mixed", *MESH, "--compact")
    assert rc == 0 and "fsdp=2 could shard" in loud and "tensor=4 could shard" in loud
    rc, quiet, _ = plan_cli(capsys, f"{F}:mixed", *MESH, "--compact", "--replicated", "fsdp")
    assert rc == 0 and "fsdp=2 could shard" not in quiet and "tensor=4 could shard" in quiet
    rc, _, err = plan_cli(capsys, f"{F}:mixed", *MESH, "--replicated", "fsdpp")
    assert rc == 2 and "'fsdpp', which no mesh of the plan has" in err


# --rules: logical names to mesh axes, inline or from a file (issue 57)

LOGICAL_RULES = (("embed", "fsdp"), ("mlp", "tensor"))
RULES_FILES = {
    "rules.json": '[["embed", "fsdp"], ["mlp", ["tensor"]], ["unused", null]]',
    # MaxText's config style: the table under logical_axis_rules, among other keys
    "base.yml": (
        "model_name: tiny\n"
        "logical_axis_rules: [\n"
        "  ['embed', 'fsdp'],\n"
        "  ['mlp', ['tensor']],\n"
        "  ['unused', null],\n"
        "]\n"
    ),
}


def test_logical_nnx_code_needs_rules_and_the_error_names_the_option(capsys):
    rc, out, err = plan_cli(capsys, f"{F}:nnx_logical", *MESH)
    assert rc == 2 and out == ""
    assert "'embed', 'mlp'" in err or "'embed'" in err
    assert err.rstrip().endswith(
        "hint: --rules embed=fsdp,mlp=tensor maps logical names to mesh axes (or --rules "
        "FILE: a .json list of [name, axes] pairs, or MaxText's .yml)"
    )


@pytest.mark.parametrize("form", ["inline", "rules.json", "base.yml"])
def test_rules_plan_logical_nnx_code_as_nnx_plan_with_rules(capsys, tmp_path, form):
    if form == "inline":
        value = "embed=fsdp,mlp=tensor"
    else:
        (tmp_path / form).write_text(RULES_FILES[form])
        value = str(tmp_path / form)
    rc, out, err = plan_cli(capsys, f"{F}:nnx_logical", *MESH, "--rules", value, "--json")
    assert rc == 0, err
    d = json.loads(out)
    for m in d["meshes"]:
        del m["mesh_from"]
    mesh = auto_abstract_mesh((2, 4), ("fsdp", "tensor"))
    expected = meshinit.nnx.plan(factory("nnx_logical"), meshes=[(".*", mesh)], rules=LOGICAL_RULES)
    assert d == expected.to_dict()
    specs = {p["path"]: p["partition_spec"] for p in d["params"]}
    assert specs == {"up.kernel": ["fsdp", "tensor"], "down.kernel": ["tensor", "fsdp"]}


def test_rules_map_a_name_to_several_axes_or_to_none(capsys):
    rules = ["--rules", "embed=fsdp+tensor,mlp="]
    rc, out, err = plan_cli(capsys, f"{F}:nnx_logical", *MESH, *rules, "--json")
    assert rc == 0, err
    specs = {p["path"]: p["partition_spec"] for p in json.loads(out)["params"]}
    assert specs == {
        "up.kernel": [["fsdp", "tensor"], None],
        "down.kernel": [None, ["fsdp", "tensor"]],
    }


def test_rules_reach_specs_without_rules_of_their_own(capsys):
    rc, out, err = plan_cli(
        capsys, f"{F}:specs_logical", *MESH, "--rules", "embed=fsdp,mlp=tensor,norm="
    )
    assert rc == 0, err
    mesh = auto_abstract_mesh((2, 4), ("fsdp", "tensor"))
    with meshinit.defaults(mesh=mesh, rules=(*LOGICAL_RULES, ("norm", None))):
        expected = meshinit.plan(cli_factory_specs("specs_logical"))
    specs = {e.path: e.sharding.spec for e in expected.entries}
    assert specs["layers.1.up"] == jax.P("fsdp", "tensor") and specs["layers.1.norm"] == jax.P(None)
    assert out.rstrip("\n") == str(expected).replace(
        "mesh 0: AbstractMesh(fsdp=2, tensor=4; Auto)",
        "mesh 0: AbstractMesh(fsdp=2, tensor=4; Auto)  (mesh from --abstract-mesh)",
    )


def test_rules_with_a_real_mesh_of_the_factorys_own(capsys):
    # what --devices 8 gives a subprocess (test_subprocess_rules_with_devices); here the
    # tests' 8 simulated devices
    rc, out, err = plan_cli(capsys, f"{F}:nnx_logical_on_mesh", "--rules", "embed=fsdp,mlp=tensor")
    assert rc == 0, err
    expected = meshinit.nnx.plan(factory("nnx_logical_on_mesh"), rules=LOGICAL_RULES)
    assert [e.sharding.spec for e in expected.entries] == [
        jax.P("tensor", "fsdp"),
        jax.P("fsdp", "tensor"),
    ]
    assert out.rstrip("\n") == str(expected)


def test_a_rule_naming_an_axis_the_mesh_lacks_is_the_planners_error(capsys):
    rc, out, err = plan_cli(capsys, f"{F}:nnx_logical", *MESH, "--rules", "embed=fsdp,mlp=model")
    assert rc == 2 and out == "" and "Traceback" not in err
    assert "'model'" in err and "problem" in err
    assert "hint: --rules" not in err  # rules were given: the fix is in them


def test_a_yaml_rules_file_without_pyyaml_names_the_package(capsys, tmp_path, monkeypatch):
    (tmp_path / "base.yml").write_text(RULES_FILES["base.yml"])
    monkeypatch.setitem(sys.modules, "yaml", None)  # import yaml raises ImportError
    rc, out, err = plan_cli(
        capsys, f"{F}:nnx_logical", *MESH, "--rules", str(tmp_path / "base.yml")
    )
    assert rc == 2 and out == ""
    assert err == (
        f"meshinit plan: --rules {tmp_path / 'base.yml'}: reading a YAML file needs PyYAML, "
        f"which is not installed: pip install pyyaml (or give the rules as JSON)\n"
    )


BAD_RULES = [
    ("nope.json", r"--rules nope\.json: no such file; expected NAME=AXES pairs"),
    ("embed", r"--rules 'embed': no such file, and not NAME=AXES pairs; expected NAME=AXES"),
    ("embed=fsdp,mlp", r"--rules 'embed=fsdp,mlp': 'mlp' is not NAME=AXES; expected"),
    ("embed=fsdp,mlp=ten sor", r"'mlp=ten sor': 'ten sor' is not a mesh axis name; expected"),
    ("embed=fsdp+fsdp", r"'embed=fsdp\+fsdp' names a mesh axis twice; expected"),
    ("=fsdp", r"'' is not a logical axis name; expected"),
]


@pytest.mark.parametrize("value, message", BAD_RULES, ids=[v for v, _ in BAD_RULES])
def test_bad_rules_are_one_line_and_exit_2(capsys, value, message):
    rc, out, err = plan_cli(capsys, f"{F}:nnx_logical", *MESH, "--rules", value)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("meshinit plan: ")
    assert re.search(message, err), err


@pytest.mark.parametrize(
    "name, text, message",
    [
        (
            "r.json",
            '[["embed"], ["mlp", 3], ["ok", "fsdp"]]',
            r"entry 0 \[\"embed\"\], entry 1 \[\"mlp\", 3\]: each entry is \[name, axes\]",
        ),
        ("r.json", '{"embed": "fsdp"}', r"a dict, not a list of \[name, axes\] pairs"),
        ("r.json", "[[", r"not JSON: "),
        ("r.yml", "rules: []\n", r"no logical_axis_rules key \(found: rules\); a YAML rules file"),
        ("r.yaml", "a: [\n", r"not YAML: "),
    ],
)
def test_a_malformed_rules_file_names_the_file_and_entry(capsys, tmp_path, name, text, message):
    (tmp_path / name).write_text(text)
    rc, out, err = plan_cli(capsys, f"{F}:nnx_logical", *MESH, "--rules", str(tmp_path / name))
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith(f"meshinit plan: --rules {tmp_path / name}: ")
    assert re.search(message, err), err


@pytest.mark.slow
def test_subprocess_rules_with_devices():
    args = ["-m", "meshinit", "plan", "tests/cli_factories.py:nnx_logical_on_mesh"]
    ok = run_python(*args, "--devices", "8", "--rules", "embed=fsdp,mlp=tensor", "--compact")
    assert ok.returncode == 0, ok.stderr
    assert "mesh 0: Mesh(fsdp=2, tensor=4; Explicit; devices 0-7)" in ok.stdout
    rows = {line.split()[0]: line.split() for line in ok.stdout.splitlines() if "kernel" in line}
    assert rows["up.kernel"][4] == "fsdp,tensor" and rows["down.kernel"][4] == "tensor,fsdp"
    bare = run_python(*args, "--devices", "8")
    assert bare.returncode == 2 and "hint: --rules" in bare.stderr
