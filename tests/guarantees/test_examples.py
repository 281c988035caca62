"""Every example in ``examples/`` runs and checks what it placed; the checkpoint
examples run again into the same directory."""

import json
import pathlib

import pytest
from helpers import run_python

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize(
    "script",
    [
        "multi_mesh.py",
        "pipeline_stages.py",
        "nnx_multi_mesh.py",
        "nnx_stacked.py",
        "nnx_llama.py",
        "stages_unchanged.py",
        "eqx_mlp.py",
        "eqx_stacked.py",
        "capacity_405b.py",
        "checkpoint_restore.py",
        "train_state.py",
        "zero1_offload.py",
        "finetune_safetensors.py",
        "export_from_orbax.py",
        "placements_table.py",
    ],
)
def test_examples_run(script):
    r = run_python(str(ROOT / "examples" / script))
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip()  # each example prints what it placed and asserts it


@pytest.mark.slow
def test_checkpoint_example_runs_again_and_again_into_the_same_directory(tmp_path):
    script = str(ROOT / "examples" / "checkpoint_restore.py")
    first = run_python(script, str(tmp_path))
    assert first.returncode == 0, first.stdout + first.stderr
    assert "initialized: no checkpoint" in first.stdout
    assert "saved step 0; 4/4 exact" in first.stdout
    # The second run restores step 0 into another layout and saves the next step.
    second = run_python(script, str(tmp_path), "--mesh", "4x2")
    assert second.returncode == 0, second.stdout + second.stderr
    assert "restored step 0" in second.stdout
    assert "saved step 1; 4/4 exact" in second.stdout
    assert "WRONG" not in first.stdout + second.stdout


@pytest.mark.slow
def test_export_example_restores_onto_its_plan_exports_and_reads_the_export_back(tmp_path):
    r = run_python(str(ROOT / "examples" / "export_from_orbax.py"), str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "restored step 0: 39 arrays, each on its planned sharding" in r.stdout
    assert "loaded back onto 2 stages: 39/39 bit for bit" in r.stdout
    assert "safetensors opened 39 tensors" in r.stdout
    assert "DIFFER" not in r.stdout
    # what a Hugging Face loader finds in the folder: the index, its files, the config
    folder = tmp_path / "hf-export"
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    assert index["weight_map"]["model.layers.3.self_attn.q_proj.weight"].startswith("model-")
    assert json.loads((folder / "config.json").read_text())["model_type"] == "llama"
    assert not [p.name for p in folder.iterdir() if p.name.startswith(".")]  # nothing partial


@pytest.mark.slow
def test_train_state_example_runs_again_and_again_into_the_same_directory(tmp_path):
    script = str(ROOT / "examples" / "train_state.py")
    first = run_python(script, str(tmp_path))
    assert first.returncode == 0, first.stdout + first.stderr
    assert "initialized params and adamw state: no checkpoint" in first.stdout
    assert "train step 0:" in first.stdout and "saved step 0" in first.stdout
    # The second run restores params and optimizer state, trains one more step and
    # saves the next step number.
    second = run_python(script, str(tmp_path))
    assert second.returncode == 0, second.stdout + second.stderr
    assert "restored step 0 from" in second.stdout
    assert "adam count 2" in second.stdout and "saved step 1" in second.stdout
    for r in (first, second):
        assert "WRONG" not in r.stdout and "DIFFER" not in r.stdout
        assert "all shardings exact" in r.stdout
