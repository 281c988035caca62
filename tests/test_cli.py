import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run(*args, timeout=300):
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


@pytest.mark.slow
def test_demo_places_every_parameter_exactly_and_exits_zero():
    r = run("-m", "meshinit", "demo")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "13/13 placements exact" in r.stdout
    assert "WRONG" not in r.stdout
    # the plan table lists the disjoint stage meshes and every full path
    assert "devices 0,2,4,6" in r.stdout and "devices 1,3,5,7" in r.stdout
    assert "stages.1.mlp.down" in r.stdout


def test_demo_rejects_a_device_count_it_cannot_lay_out():
    r = run("-m", "meshinit", "demo", "--devices", "6")
    assert r.returncode == 2
    assert "--devices must be a multiple of 4" in r.stderr


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
        "placements_table.py",
    ],
)
def test_examples_run(script):
    r = run(str(ROOT / "examples" / script))
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip()  # each example prints what it placed and asserts it


@pytest.mark.slow
def test_checkpoint_example_runs_again_and_again_into_the_same_directory(tmp_path):
    script = str(ROOT / "examples" / "checkpoint_restore.py")
    first = run(script, str(tmp_path))
    assert first.returncode == 0, first.stdout + first.stderr
    assert "initialized: no checkpoint" in first.stdout
    assert "saved step 0; 4/4 exact" in first.stdout
    # The second run restores step 0 into another layout and saves the next step.
    second = run(script, str(tmp_path), "--mesh", "4x2")
    assert second.returncode == 0, second.stdout + second.stderr
    assert "restored step 0" in second.stdout
    assert "saved step 1; 4/4 exact" in second.stdout
    assert "WRONG" not in first.stdout + second.stdout


@pytest.mark.slow
def test_train_state_example_runs_again_and_again_into_the_same_directory(tmp_path):
    script = str(ROOT / "examples" / "train_state.py")
    first = run(script, str(tmp_path))
    assert first.returncode == 0, first.stdout + first.stderr
    assert "initialized params and adamw state: no checkpoint" in first.stdout
    assert "train step 0:" in first.stdout and "saved step 0" in first.stdout
    # The second run restores params and optimizer state, trains one more step and
    # saves the next step number.
    second = run(script, str(tmp_path))
    assert second.returncode == 0, second.stdout + second.stderr
    assert "restored step 0 from" in second.stdout
    assert "adam count 2" in second.stdout and "saved step 1" in second.stdout
    for r in (first, second):
        assert "WRONG" not in r.stdout and "DIFFER" not in r.stdout
        assert "all shardings exact" in r.stdout
