"""The progress bar (decided once per call, tqdm on stderr) and the "meshinit" log lines."""

import io
import logging
import sys

import jax
import numpy as np
import pytest
from helpers import Boom, assert_exact, two_stage_specs

import meshinit
from meshinit._run import progress as _progress

# two_stage_specs: 5 params in 2 mesh groups; the rounds strategy needs one executable
# per group (each group's signatures have one parameter each), called once.
SUMMARY = "materialize: 5 params, 2 mesh groups, 2 executables"


def work(**kw):
    base = dict(params=1, placed=0, groups=1, executables=1, to_compile=0, calls=1, nbytes=4)
    return _progress.Work(**{**base, **kw})


class Terminal(io.StringIO):
    """A stderr that says it is a terminal."""

    def isatty(self):
        return True


def info_records(caplog):
    return [r for r in caplog.records if r.name == "meshinit" and r.levelno == logging.INFO]


# ------------------------------------------------------------------------ the bar


def test_forced_bar_shows_compile_and_generate_steps_on_stderr(capsys):
    meshinit.clear_cache()
    plan = meshinit.plan(two_stage_specs())
    out = meshinit.materialize(plan, 0, progress=True)
    assert_exact(plan, out)
    captured = capsys.readouterr()
    assert captured.out == ""  # the bar never writes to stdout
    err = captured.err
    assert "meshinit: compiling" in err and "2/2" in err
    assert "mesh group 0, Mesh(fsdp=2, tensor=2; Auto; devices 0-3)" in err
    assert "mesh group 1, Mesh(fsdp=2, tensor=2; Auto; devices 4-7)" in err
    assert "meshinit: generating" in err and "5/5" in err
    assert err.index("meshinit: compiling") < err.index("meshinit: generating")
    assert err.rstrip().endswith("ready]")  # ends when the arrays are ready


def test_forced_bar_with_everything_cached_shows_only_generating(capsys):
    plan = meshinit.plan(two_stage_specs())
    meshinit.materialize(plan, 0)  # compiles and caches
    capsys.readouterr()
    meshinit.init(two_stage_specs(), 1, progress=True)  # init passes progress through
    err = capsys.readouterr().err
    assert "meshinit: compiling" not in err
    assert "meshinit: generating" in err and "5/5" in err


def test_progress_false_writes_nothing_even_on_a_terminal(capfd, monkeypatch):
    meshinit.clear_cache()  # 2 compiles: auto would show a bar on a terminal
    monkeypatch.setattr(sys, "stderr", Terminal())
    meshinit.materialize(meshinit.plan(two_stage_specs()), 0, progress=False)
    assert sys.stderr.getvalue() == ""
    captured = capfd.readouterr()
    assert captured.out == "" and captured.err == ""


def test_auto_writes_nothing_when_stderr_is_not_a_terminal(capfd):
    meshinit.clear_cache()  # 2 compiles: enough for a bar on a terminal
    assert not sys.stderr.isatty()
    meshinit.materialize(meshinit.plan(two_stage_specs()), 0)
    captured = capfd.readouterr()
    assert captured.out == "" and captured.err == ""


def test_auto_on_a_terminal_shows_the_bar_only_when_the_rule_says_so(monkeypatch):
    plan = meshinit.plan(two_stage_specs())
    meshinit.clear_cache()
    monkeypatch.setattr(sys, "stderr", Terminal())
    meshinit.materialize(plan, 0)  # 2 executables to compile: shown
    assert "meshinit: compiling" in sys.stderr.getvalue()
    monkeypatch.setattr(sys, "stderr", Terminal())
    meshinit.materialize(plan, 1)  # all cached, 2 calls, 32 KiB: not shown
    assert sys.stderr.getvalue() == ""


@pytest.mark.parametrize(
    ("kw", "shown"),
    [
        ({}, False),
        ({"to_compile": _progress.MIN_COMPILES - 1}, False),
        ({"to_compile": _progress.MIN_COMPILES}, True),
        ({"calls": _progress.MIN_CALLS - 1}, False),
        ({"calls": _progress.MIN_CALLS}, True),
        ({"nbytes": _progress.MIN_BYTES - 1}, False),
        ({"nbytes": _progress.MIN_BYTES}, True),
        ({"to_compile": 1, "calls": 999, "nbytes": (1 << 30) - 1}, False),
    ],
)
def test_the_auto_rule_is_the_documented_one(monkeypatch, kw, shown):
    monkeypatch.setattr(sys, "stderr", Terminal())
    assert _progress.show_bar(None, work(**kw)) is shown
    assert _progress.show_bar(True, work(**kw)) is True
    assert _progress.show_bar(False, work(**kw)) is False
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # not a terminal: never in auto
    assert _progress.show_bar(None, work(**kw)) is False


def test_the_docstrings_state_the_thresholds_the_code_uses():
    assert (_progress.MIN_COMPILES, _progress.MIN_CALLS, _progress.MIN_BYTES) == (2, 1000, 1 << 30)
    doc = " ".join(meshinit.materialize.__doc__.split())
    assert (
        "a bar is shown when stderr is a terminal and the call will compile at least 2 "
        "executables, make at least 1000 compiled calls, or generate at least 1 GiB of "
        "parameters" in doc
    )
    assert "progress:" in meshinit.init.__doc__


def test_progress_must_be_a_bool_or_none():
    plan = meshinit.plan(two_stage_specs())
    with pytest.raises(TypeError, match="progress must be True, False or None"):
        meshinit.materialize(plan, 0, progress="yes")


def test_no_bar_means_no_tqdm_import(monkeypatch, caplog):
    caplog.set_level(logging.DEBUG, logger="meshinit")
    monkeypatch.setitem(sys.modules, "tqdm", None)  # any `import tqdm` now fails
    plan = meshinit.plan(two_stage_specs())
    meshinit.clear_cache()
    assert_exact(plan, meshinit.materialize(plan, 0, progress=False))
    assert_exact(plan, meshinit.materialize(plan, 1))  # auto, stderr not a terminal
    assert not [r for r in caplog.records if "progress bar disabled" in r.getMessage()]
    # The check can fail: a forced bar does import tqdm; without it the bar is dropped
    # (a bar is decoration) and the arrays are still made.
    assert_exact(plan, meshinit.materialize(plan, 2, progress=True))
    assert [
        r for r in caplog.records if "progress bar disabled: ModuleNotFoundError" in r.getMessage()
    ]


def test_a_broken_stderr_drops_the_bar_not_the_arrays(monkeypatch):
    class Broken(io.StringIO):
        def write(self, s):
            raise OSError("stderr is gone")

    monkeypatch.setattr(sys, "stderr", Broken())
    plan = meshinit.plan(two_stage_specs())
    meshinit.clear_cache()
    assert_exact(plan, meshinit.materialize(plan, 0, progress=True))


def test_the_bar_allocates_no_device_memory(new_arrays):
    plan = meshinit.plan(two_stage_specs())
    meshinit.clear_cache()
    with new_arrays() as made:
        out = meshinit.materialize(plan, 0, progress=True)
    assert {id(a) for a in made} == {id(a) for a in jax.tree_util.tree_leaves(out)}


# -------------------------------------------------------------------- failure


@pytest.mark.parametrize("phase", ["compile", "generate"])
def test_on_failure_the_bar_closes_and_the_error_propagates_with_its_notes(
    capsys, caplog, fail_group, phase
):
    tqdm = pytest.importorskip("tqdm")
    caplog.set_level(logging.INFO, logger="meshinit")
    plan = meshinit.plan(two_stage_specs())
    meshinit.clear_cache()
    made = fail_group(plan, Boom, when=phase)
    with pytest.raises(Boom, match="injected fault") as info:
        meshinit.materialize(plan, 1, progress=True)
    assert type(info.value) is Boom and info.value.args == ("injected fault",)  # unchanged
    assert len(tqdm.tqdm._instances) == 0  # every bar closed
    assert _progress._current.get() is None  # no tracker left behind
    err = capsys.readouterr().err
    assert "failed: mesh group 1" in err
    assert not info_records(caplog)  # the summary line is for calls that finished
    notes = "\n".join(getattr(info.value, "__notes__", []))
    if phase == "compile":
        assert made == [] and notes == ""  # nothing allocated: nothing to delete or say
        assert "meshinit: generating" not in err
    else:
        assert len(made) == 3 and all(a.is_deleted() for a in made)
        assert "mesh group 1" in notes and "making stage1.down, stage1.head" in notes
        assert "deleted the 3 arrays" in notes


# -------------------------------------------------------------------- logging


def test_one_info_line_per_call_with_compiled_and_cached_counts(caplog, count_compiles):
    caplog.set_level(logging.INFO, logger="meshinit")
    plan = meshinit.plan(two_stage_specs())
    meshinit.clear_cache()
    with count_compiles() as cold:
        meshinit.materialize(plan, 0)
    meshinit.materialize(plan, 1)
    first, second = info_records(caplog)
    assert cold.count == 2  # what the first line reports is what XLA did
    assert first.getMessage().startswith(f"{SUMMARY} (2 compiled, 0 cached), 2 calls, 32.1 KiB, ")
    assert second.getMessage().startswith(f"{SUMMARY} (0 compiled, 2 cached), 2 calls, ")
    assert first.getMessage().endswith(" s")
    stats = second.meshinit
    assert (stats["compiled"], stats["cached"], stats["calls"], stats["groups"]) == (0, 2, 2, 2)
    assert (
        stats["params"] == 5
        and stats["nbytes"] == sum(e.spec.nbytes for e in plan.entries) == 32896
        and stats["seconds"] > 0
    )


def test_the_info_line_counts_existing_arrays_apart(caplog):
    caplog.set_level(logging.INFO, logger="meshinit")
    plan = meshinit.plan(two_stage_specs())
    restored = np.zeros((64, 32), np.float32)
    meshinit.materialize(plan, 0, existing={"stage1.down": restored})
    (record,) = info_records(caplog)
    assert "5 params (1 from existing), 2 mesh groups" in record.getMessage()
    assert record.meshinit["placed"] == 1 and record.meshinit["nbytes"] == 32896 - 64 * 32 * 4


def test_debug_logs_each_compile_with_its_mesh_group_and_time(caplog):
    caplog.set_level(logging.DEBUG, logger="meshinit")
    plan = meshinit.plan(two_stage_specs())
    meshinit.clear_cache()
    meshinit.materialize(plan, 0)
    meshinit.materialize(plan, 1)
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    compiled = [m for m in messages if m.startswith("compiled an executable for mesh group")]
    assert len(compiled) == 2
    assert "mesh group 1, Mesh(fsdp=2, tensor=2; Auto; devices 4-7) in " in compiled[1]
    assert sum(m.startswith("reused a cached executable") for m in messages) == 2


def test_the_library_adds_no_handler_that_prints():
    handlers = logging.getLogger("meshinit").handlers
    assert all(isinstance(h, logging.NullHandler) for h in handlers)
