"""CI runs the benchmark suite at smoke size: it must run and place everything exactly.

Times are never asserted here (the machines are shared); the suite itself exits
non-zero when a meshinit case crashes, misplaces an array or breaks the value contract.
"""

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_script(name, *args, timeout=600):
    """``benchmarks/<name>`` in a subprocess on CPU only; asserts it exits 0."""
    r = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / name), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={"JAX_PLATFORMS": "cpu", "PATH": ""},
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


@pytest.mark.slow
def test_benchmark_suite_smoke_runs_and_places_exactly():
    r = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "suite.py"), "--smoke"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "meshinit" in r.stdout and "jax.jit" in r.stdout
    assert (
        not (ROOT / "docs" / "performance.md").exists()
        or "smoke" not in (ROOT / "docs" / "performance.md").read_text()
    )


def test_gpu_script_exits_cleanly_without_a_gpu():
    r = run_script("gpu.py", timeout=300)
    assert "no GPU" in r.stdout + r.stderr


def test_gpu_script_code_path_runs_on_cpu_and_places_exactly():
    # The GPU comparison's own code (specs, plan, fused recipe, warm re-inits, the
    # table) on 8 simulated CPU devices with a tiny model: a GPU run only swaps the
    # model and the devices.
    r = run_script("gpu.py", "--cpu-check", "--repeats", "2")
    assert "| meshinit cold (specs + plan + materialize) |" in r.stdout
    assert "| jax.jit fused warm re-init (new key) |" in r.stdout
    assert ", re-init 0;" in r.stdout  # the warm re-init compiled nothing
    assert "NOT exact" not in r.stdout


def test_launches_script_runs_every_case():
    r = run_script("launches.py", "--params", "4", "--outputs", "1", "2", "--repeats", "1")
    rows = [line for line in r.stdout.splitlines() if line.startswith("| ") and "ms |" in line]
    assert [row.split(" | ")[:2] for row in rows] == [
        ["| 4", "1"],
        ["| 2", "2"],
        ["| 32 single-device", "1 shard"],
    ]


def test_report_lists_every_process_of_a_cold_case_fastest_first():
    import importlib.util

    spec = importlib.util.spec_from_file_location("report", ROOT / "benchmarks" / "report.py")
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    case = {"compile_s": 1.0, "compiles": 3, "problems": [], "strategy": "rounds"}
    results = {
        "cold": {
            "meshinit": {
                "8": case | {"seconds": 1.4, "runs": [1.7, None, 1.4]},
                "32": case | {"seconds": 2.0},  # a result from before runs were kept
            }
        }
    }
    text = report._cold_tables(results)
    assert "| meshinit (rounds) | 1.40 s | 2.00 s |" in text  # the best of each case
    assert "| meshinit (rounds) | 1.40, 1.70 s (1 failed) | 2.00 s |" in text
