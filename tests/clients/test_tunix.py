"""meshinit on google-tunix's own models, unchanged, against tunix's own answers.

tunix (0.1.7, Python 3.12) builds its models with the older ``sharding=`` metadata over
mesh axes ``('fsdp', 'tp')``, and importing it turns flax's eager sharding off. Its
loaders place a model where ``nnx.get_named_sharding(nnx.state(nnx.eval_shape(f)),
mesh)`` says. For tiny configs of tunix's Llama3, Qwen3 (dense and MoE), Qwen2, Gemma3
and a qwix-LoRA Llama3 (tests/tunix_models.py), on tunix's own (fsdp=2, tp=4) mesh of
the 8 CPU devices, each check below runs for the rows of tests/conformance.py that
claim it:

- shardings: every leaf's sharding ``==`` tunix's;
- values: every leaf bit-identical to the eager construction of the same factory;
- metadata: every Variable's type and flax metadata as eager, and the same graph;
- stages: two disjoint stages by ``meshes=`` (embedder and layer 0 on devices 0-3, the
  rest on 4-7), each leaf with tunix's spelling on its stage's mesh, values as eager;
- abstract: ``meshinit.nnx.abstract`` as the restore target of a checkpoint tunix's own
  ``CheckpointManager`` saved, with tunix's shardings, restoring the saved values.

And a safetensors round trip through tunix's own name maps, with ``existing=``.

Skipped where tunix is not installed; ``.ci/run`` installs it in ``.venv-tunix`` and
fails if this module is skipped there.
"""

import functools
import re

import pytest

pytest.importorskip("tunix", reason="google-tunix is not installed (it needs Python 3.12)")

import conformance  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import tunix_models as tm  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402
from tunix.sft.checkpoint_manager import CheckpointManager  # noqa: E402
from tunix.utils import torch_utils  # noqa: E402

import meshinit  # noqa: E402

pytestmark = pytest.mark.slow


def stage_of(path: str) -> int:
    """Stage 0: the embedder and layer 0; stage 1: the rest."""
    return 0 if re.match(r"(embedder|layers\.0)\.", path) else 1


def stage_table(stages):
    return [(r"(embedder|layers\.0)\..*", stages[0]), (r".*", stages[1])]


def placement_problems(got: dict, want: dict) -> list[str]:
    """Every leaf of ``got`` (path -> array) whose sharding is not ``==`` ``want``'s."""
    assert sorted(got) == sorted(want), (
        f"paths differ: only meshinit has {sorted(set(got) - set(want))}, "
        f"only tunix has {sorted(set(want) - set(got))}"
    )
    return [
        f"{p}: meshinit {got[p].sharding.spec} on {dict(got[p].sharding.mesh.shape)} "
        f"devices {sorted(d.id for d in got[p].sharding.device_set)}, "
        f"tunix {want[p].spec} on {dict(want[p].mesh.shape)} "
        f"devices {sorted(d.id for d in want[p].device_set)}"
        for p in sorted(got)
        if got[p].sharding != want[p]
    ]


def value_problems(got: dict, want: dict) -> list[str]:
    """Every leaf of ``got`` whose dtype, shape or bits differ from ``want``'s."""
    assert sorted(got) == sorted(want), sorted(set(got) ^ set(want))
    problems = []
    for p in sorted(got):
        g, w = tm.bits(got[p]), tm.bits(want[p])
        if (g.dtype, g.shape) != (w.dtype, w.shape):
            problems.append(f"{p}: meshinit {g.dtype}{g.shape}, eager {w.dtype}{w.shape}")
        elif g.tobytes() != w.tobytes():
            problems.append(f"{p} {g.dtype}{g.shape}: {how_far(g, w)} from eager")
    return problems


def how_far(got: np.ndarray, want: np.ndarray) -> str:
    """How many elements differ, and for floats by how many units in the last place."""
    uint = np.dtype(f"u{got.dtype.itemsize}")
    a, b = got.reshape(-1).view(uint), want.reshape(-1).view(uint)
    differ = int(np.sum(a != b))
    if not (np.issubdtype(got.dtype, np.floating) or got.dtype.kind == "V"):  # V: bfloat16
        return f"{differ} of {a.size} elements differ"
    ulp = np.abs(a.astype(np.int64) - b.astype(np.int64)).max()  # same sign: ulps apart
    return f"{differ} of {a.size} elements differ, by up to {ulp} ulp"


def eager_arrays(case: str) -> dict:
    return {p: v.get_value() for p, v in tm.eager(case).items()}


@functools.cache
def init_on_mesh(case: str):
    """``meshinit.nnx.init`` of the case's factory as a tunix user calls it: under
    ``jax.set_mesh`` of tunix's mesh, the model's own metadata naming the axes."""
    with jax.set_mesh(tm.mesh()):
        return meshinit.nnx.init(tm.FACTORIES[case])


# -- one mesh ----------------------------------------------------------------------------


@conformance.parametrize("tunix", "shardings")
def test_init_places_every_leaf_exactly_as_tunix_does(row):
    got = tm.arrays(init_on_mesh(row.case))
    want = tm.tunix_shardings(tm.FACTORIES[row.case], tm.mesh())
    placed = placement_problems(got, want)
    assert not placed, "placed unlike tunix:\n" + "\n".join(placed)


@conformance.parametrize("tunix", "values")
def test_init_gives_every_leaf_the_bits_of_eager_construction(row):
    got = tm.arrays(init_on_mesh(row.case))
    values = value_problems(got, eager_arrays(row.case))
    assert not values, "values unlike eager construction:\n" + "\n".join(values)


@conformance.parametrize("tunix", "metadata")
def test_init_keeps_every_variable_type_metadata_and_the_graph(row):
    model = init_on_mesh(row.case)
    got, eager = tm.variables(model), tm.eager(row.case)
    assert sorted(got) == sorted(eager), sorted(set(got) ^ set(eager))
    kept = [
        f"{p}: meshinit {type(v).__name__} {v.get_metadata()}, "
        f"eager {type(eager[p]).__name__} {eager[p].get_metadata()}"
        for p, v in got.items()
        if type(v) is not type(eager[p]) or v.get_metadata() != eager[p].get_metadata()
    ]
    assert not kept, "metadata unlike eager construction:\n" + "\n".join(kept)
    # as nnx prints it: qwix makes a new class per call, so graphdefs never compare ==
    graph, eager_graph = repr(nnx.graphdef(model)), repr(nnx.graphdef(tm.FACTORIES[row.case]()))
    assert graph == eager_graph, f"{row.model}: meshinit's graph is not eager construction's"


# -- two disjoint stages ---------------------------------------------------------------------


@conformance.parametrize("tunix", "stages")
def test_two_disjoint_stages_by_meshes_place_each_leaf_as_tunix_would_on_its_stage(row):
    factory = tm.FACTORIES[row.case]
    stages = tm.stage_meshes()
    got = tm.arrays(meshinit.nnx.init(factory, meshes=stage_table(stages)))

    per_stage = [tm.tunix_shardings(factory, m) for m in stages]
    want = {p: per_stage[stage_of(p)][p] for p in per_stage[0]}
    assert {stage_of(p) for p in want} == {0, 1}, "one stage is empty: the test checks nothing"
    placed = placement_problems(got, want)
    assert not placed, "placed unlike tunix on its stage:\n" + "\n".join(placed)
    values = value_problems(got, eager_arrays(row.case))
    assert not values, "values unlike eager construction:\n" + "\n".join(values)


def test_one_jit_onto_two_disjoint_stages_fails_where_meshinit_places_them():
    """The one-jit recipe (the factory jitted with every leaf's sharding as its output
    sharding) cannot place two disjoint stages: one jit, one device set."""
    factory = tm.FACTORIES["llama3"]
    stages = tm.stage_meshes()
    per_stage = [tm.tunix_shardings(factory, m) for m in stages]
    paths = sorted(per_stage[0])  # nnx's flat order: sorted paths
    shardings = [per_stage[stage_of(p)][p] for p in paths]
    assert {s.mesh for s in shardings} == set(stages), "not two stages: the test checks nothing"

    def leaves():
        return [v.get_value() for _, v in nnx.to_flat_state(nnx.state(factory()))]

    with pytest.raises(ValueError, match="incompatible devices"):
        jax.jit(leaves, out_shardings=shardings)()


# -- abstract: the restore target of tunix's own checkpoints ------------------------------


@conformance.parametrize("tunix", "abstract")
def test_abstract_restores_a_checkpoint_tunix_saved_onto_tunix_shardings(row, tmp_path):
    factory = tm.FACTORIES[row.case]
    saver = CheckpointManager(str(tmp_path))  # what tunix's PEFT trainer saves with
    assert saver.save(1, factory(), force=True), "tunix saved no checkpoint"
    saver.close()

    with jax.set_mesh(tm.mesh()):
        target = meshinit.nnx.abstract(factory)
    want = tm.tunix_shardings(factory, tm.mesh())
    abstract = {p: v.get_value() for p, v in tm.variables(target).items()}
    assert all(isinstance(a, jax.ShapeDtypeStruct) for a in abstract.values()), abstract
    placed = placement_problems(abstract, want)
    assert not placed, "abstract shardings unlike tunix's:\n" + "\n".join(placed)

    step, _ = CheckpointManager(str(tmp_path)).maybe_restore(target)  # tunix's restore
    assert step == 1, f"tunix restored step {step}"
    restored = tm.arrays(target)
    assert not placement_problems(restored, want), placement_problems(restored, want)
    values = value_problems(restored, eager_arrays(row.case))
    assert not values, "restored values unlike the saved ones:\n" + "\n".join(values)


# -- safetensors: a round trip through tunix's own name maps -----------------------------------


@pytest.mark.parametrize("case", sorted(tm.FACTORIES))
def test_tunix_shardings_as_a_placement_table_place_each_leaf_as_its_metadata_does(case):
    """tunix's own answer written as an EasyDeL-style table (``placements=``, one
    ``(path, PartitionSpec)`` entry per leaf) places every leaf ``==`` tunix's, with
    eager's bits; and an entry overrides a leaf's metadata, which then says so."""
    mesh = tm.mesh()
    factory = tm.FACTORIES[case]
    want = tm.tunix_shardings(factory, mesh)
    table = [(re.escape(p), s.spec) for p, s in want.items()]
    got = tm.arrays(meshinit.nnx.init(factory, placements=table, mesh=mesh))
    placed = placement_problems(got, want)
    assert not placed, "placed unlike tunix:\n" + "\n".join(placed)
    values = value_problems(got, eager_arrays(case))
    assert not values, "values unlike eager construction:\n" + "\n".join(values)
    # one sharded leaf replicated by a table entry; every other leaf keeps tunix's
    moved = next(p for p, s in want.items() if any(a is not None for a in s.spec))
    model = meshinit.nnx.init(factory, placements=[(re.escape(moved), P())], mesh=mesh)
    got = tm.arrays(model)
    assert got[moved].sharding == jax.sharding.NamedSharding(mesh, P())
    reported = nnx.get_named_sharding(nnx.state(model), mesh)
    assert tm.arrays(reported)[moved] == got[moved].sharding  # flax reports the move
    rest = {p: a for p, a in got.items() if p != moved}
    assert not placement_problems(rest, {p: s for p, s in want.items() if p != moved})


@pytest.mark.parametrize("case", sorted(tm.NAME_MAPS))
def test_weights_round_trip_through_tunix_name_map_into_existing(case, tmp_path):
    """The eager model's weights, written as Hugging Face writes them under tunix's own
    name map, come back bit for bit on tunix's shardings: through tunix's loader, and
    through ``meshinit.safetensors.load`` with a rule table read off the same map and
    ``meshinit.nnx.init(existing=)``, which makes only what the files lack (LoRA's
    adapters) with eager's values."""
    params, config = tm.NAME_MAPS[case]
    factory = tm.FACTORIES[case]
    mesh = tm.mesh()
    key_map = params._get_key_and_transform_mapping(config)
    with jax.set_mesh(mesh):
        plan = meshinit.nnx.plan(factory)
    paths = [e.path for e in plan.entries]
    table = [
        rule
        for rule in tm.names_from_tunix(key_map, config.embed_dim)
        if any(re.fullmatch(rule[0], p) for p in paths)  # the map covers the whole family
    ]
    if case.startswith("lora"):  # not in a base checkpoint: the init makes them
        table.append((r".*_lora_[ab]", None))
    eager = eager_arrays(case)
    stored = tm.stored_tensors(table, eager)
    # the written names are tunix's: its own map sends each back to its parameter
    back = {name: torch_utils.torch_key_to_jax_key(key_map, name)[0] for name in stored}
    base = [p for p in paths if "lora" not in p]
    assert sorted(back.values()) == sorted(base), sorted(set(back.values()) ^ set(base))
    names = sorted(stored)  # two files, as a sharded checkpoint comes
    for i, part in enumerate((names[::2], names[1::2])):
        save_file({n: stored[n] for n in part}, str(tmp_path / f"model-{i + 1}.safetensors"))

    want = tm.tunix_shardings(factory, mesh)
    theirs = tm.arrays(params.create_model_from_safe_tensors(str(tmp_path), config, mesh=mesh))
    assert not value_problems(theirs, {p: eager[p] for p in theirs}), "tunix read other values"

    loaded = meshinit.safetensors.load(plan, tmp_path, names=table, unused="error")
    assert sorted(loaded) == sorted(base), sorted(set(loaded) ^ set(base))
    with jax.set_mesh(mesh):
        got = tm.arrays(meshinit.nnx.init(factory, existing=loaded))
    placed = placement_problems(got, want)
    assert not placed, "placed unlike tunix:\n" + "\n".join(placed)
    values = value_problems(got, eager)
    assert not values, "values unlike the written weights:\n" + "\n".join(values)
    assert all(got[p] is loaded[p] for p in base), "existing= arrays were not used as loaded"
    placed = placement_problems(theirs, {p: want[p] for p in theirs})
    assert not placed, "tunix's own loader placed unlike its answer:\n" + "\n".join(placed)


def test_the_name_table_has_teeth():
    """A split of the other axis (q's stored (heads * head_dim, width) as (width, ...))
    reads other values: the round trip above cannot pass by symmetry."""
    key_map = tm.llama3_params._get_key_and_transform_mapping(tm.LLAMA3)
    table = dict(tm.names_from_tunix(key_map, tm.LLAMA3.embed_dim))
    q = table[r"layers\.(?P<g1>[0-9]+)\.attn\.q_proj\.w"]
    assert (q.shape, q.permute) == ((8, 16, 64), (2, 0, 1)), q
    stored = np.arange(128 * 64, dtype=np.float32).reshape(128, 64)  # (heads * head_dim, d)
    tunix = stored.transpose(1, 0).reshape(64, 8, 16)
    assert np.array_equal(stored.reshape(q.shape).transpose(q.permute), tunix)
    assert not np.array_equal(stored.reshape(64, 8, 16), tunix)


# -- the registry's claims are all run here ----------------------------------------------


def test_every_conformance_cell_claimed_for_tunix_is_checked_here():
    assert conformance.claimed("tunix"), "tests/conformance.py claims nothing for tunix"
    missing = conformance.unchecked("tunix")
    assert not missing, f"claimed in tests/conformance.py but run by no test: {missing}"
