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


@pytest.mark.slow
@pytest.mark.parametrize(
    "script, loaded, refused",
    [
        (
            "fp8_checkpoint.py",
            "loaded 5/5 parameters bit for bit",
            "with weight_block_size [64, 64] in config.json: refused",
        ),
        (
            "mxfp4_checkpoint.py",
            "loaded 2/2 parameters bit for bit",
            "with no quantization_config in config.json: refused",
        ),
    ],
    ids=["fp8", "mxfp4"],
)
def test_quantized_examples_load_the_reference_bits_and_read_the_config_beside_the_files(
    script, loaded, refused, tmp_path
):
    """Each writes its checkpoint (config.json included), loads it onto a (2, 4) mesh
    checked shard by shard against the reference dequantization, then shows that the
    config.json beside the files decides: changed, the load is refused."""
    folder = tmp_path / "checkpoint"
    r = run_python(str(ROOT / "examples" / script), str(folder))
    assert r.returncode == 0, r.stdout + r.stderr
    assert loaded in r.stdout and refused in r.stdout
    assert str(folder / "config.json") in r.stdout  # the refusal names the file it read
    assert (folder / "model.safetensors").is_file()


@pytest.mark.slow
def test_fanout_example_launches_two_processes_that_read_each_block_once():
    """1 MiB replicated over both processes and 2 x 256 KiB split between them: with
    fan-out each process reads half the replicated rows and gets the rest from its peer,
    so the files serve the checkpoint once; without, 1.67x."""
    r = run_python(str(ROOT / "examples" / "fanout_two_processes.py"), timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "--- worker 0: ok" in r.stdout and "--- worker 1: ok" in r.stdout
    for i in range(2):
        assert (
            f"process {i} (devices " in r.stdout
            and "fan_out=True: read 786,432 bytes from the files, 524,288 from its peer" in r.stdout
        )
    assert "fan_out=True: the files served 1,572,864 bytes, 1.00x the checkpoint" in r.stdout
    assert "fan_out=False: the files served 2,621,440 bytes, 1.67x the checkpoint" in r.stdout


def test_fanout_example_launcher_kills_its_workers_when_they_run_out_of_time(tmp_path, capsys):
    """The launcher never leaves a worker behind: past its deadline (here 1 s, before
    the workers have joined) it kills both and exits non-zero, saying so."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "fanout_two_processes", ROOT / "examples" / "fanout_two_processes.py"
    )
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    example.TIMEOUT_S = 1
    assert example.launch(tmp_path) == 1
    shown = capsys.readouterr().out
    assert "--- worker 0: FAILED (exit -9)" in shown and "--- worker 1: FAILED (exit -9)" in shown
