"""``meshinit demo``: a multi-mesh model planned, materialized and checked."""

import pytest
from helpers import run_python


@pytest.mark.slow
def test_demo_places_every_parameter_exactly_and_exits_zero():
    r = run_python("-m", "meshinit", "demo")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "13/13 placements exact" in r.stdout
    assert "WRONG" not in r.stdout
    # the plan table lists the disjoint stage meshes and every full path
    assert "devices 0,2,4,6" in r.stdout and "devices 1,3,5,7" in r.stdout
    assert "stages.1.mlp.down" in r.stdout


def test_demo_rejects_a_device_count_it_cannot_lay_out():
    r = run_python("-m", "meshinit", "demo", "--devices", "6")
    assert r.returncode == 2
    assert "--devices must be a multiple of 4" in r.stderr
