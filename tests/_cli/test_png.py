"""``--png FILE`` of ``meshinit plan`` and ``meshinit demo``: each mesh's bytes per device
in FILE, which devices each mesh covers beside it, headless; refused before any work."""

import pathlib

import pytest
from helpers import run_python

from meshinit._cli import png as _png
from meshinit._cli.cli import main

ROOT = pathlib.Path(__file__).resolve().parents[2]
F = str(ROOT / "tests" / "cli_factories.py")
MESH = ["--abstract-mesh", "fsdp=2,tensor=4"]
PNG = b"\x89PNG\r\n\x1a\n"


def _plan(capsys, *args):
    rc = main(["plan", *args])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize(
    "given, want",
    [("out/plan.png", "out/plan-devices.png"), ("plan", "plan-devices.png"),
     ("a.b.svg", "a.b-devices.svg")],
)  # fmt: skip
def test_the_devices_figure_goes_beside_the_file(given, want):
    assert _png.devices_path(given) == want


def test_png_writes_the_heatmap_and_the_devices_headless(capsys, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    monkeypatch.delenv("DISPLAY", raising=False)
    target = tmp_path / "plan.png"
    rc, out, err = _plan(capsys, f"{F}:mixed", *MESH, "--compact", "--png", str(target))
    assert rc == 0
    devices = tmp_path / "plan-devices.png"
    assert err == f"meshinit plan: wrote {target} and {devices}\n"
    assert "layers.{0..3}.up" in out  # the table still prints
    assert target.read_bytes()[:8] == PNG and devices.read_bytes()[:8] == PNG


def test_a_devices_file_that_cannot_be_written_is_named(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    (tmp_path / "plan-devices.png").mkdir()  # a folder where the file would go
    rc, out, err = _plan(capsys, f"{F}:mixed", *MESH, "--png", str(tmp_path / "plan.png"))
    assert rc == 2
    assert err == f"meshinit plan: cannot write {tmp_path / 'plan-devices.png'}: Is a directory\n"


def test_demo_refuses_a_png_it_cannot_write_before_any_work(capsys):
    pytest.importorskip("matplotlib")
    assert main(["demo", "--png", "/no/such/dir/demo.png"]) == 2
    out, err = capsys.readouterr()
    assert out == ""  # nothing planned or made
    assert err == "meshinit demo: cannot write /no/such/dir/demo.png: no directory /no/such/dir\n"


@pytest.mark.slow
def test_demo_draws_its_interleaved_stages(tmp_path):
    pytest.importorskip("matplotlib")
    r = run_python("-m", "meshinit", "demo", "--png", str(tmp_path / "demo.png"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"wrote {tmp_path / 'demo.png'} and {tmp_path / 'demo-devices.png'}" in r.stdout
    assert (tmp_path / "demo-devices.png").read_bytes()[:8] == PNG
