"""Checkpoint folders and files as they are found, not as they were written:
hidden files, a missing file, an index naming an absent shard, a stale shard beside an
index, a dangling cache link, a FIFO, more shards than the open-file limit, an
unreadable folder and a header of 200,000 entries. Each either loads exactly what the
``safetensors`` package reads or is one PlanError naming the file and the fix; none
hangs."""

import contextlib
import json
import os
import resource
import signal

import numpy as np
import pytest
from helpers import load_refused, plan_for

import meshinit
from meshinit import safetensors as st

save_file = pytest.importorskip("safetensors.numpy").save_file
safetensors = pytest.importorskip("safetensors")


def package_reads(*files):
    """Every tensor of ``files`` as the ``safetensors`` package reads it."""
    out = {}
    for f in files:
        with safetensors.safe_open(str(f), framework="numpy") as opened:
            out.update({n: opened.get_tensor(n) for n in opened.keys()})
    return out


@contextlib.contextmanager
def within(seconds):
    """Fails (rather than hangs) a call that blocks past ``seconds``: the alarm's
    exception interrupts a blocking ``open()`` of a FIFO."""

    def late(*_):
        raise TimeoutError(f"blocked for more than {seconds} s")

    before = signal.signal(signal.SIGALRM, late)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, before)


def refused(call, *needles):
    with pytest.raises(meshinit.PlanError) as raised:
        call()
    for needle in needles:
        assert needle in str(raised.value), str(raised.value)
    return str(raised.value)


# ------------------------------------------------- what the index lists


def sharded(tmp_path):
    """A two-shard checkpoint with its index, as transformers writes one."""
    a, b = np.arange(8, dtype=np.float32), np.arange(8, 16, dtype=np.float32)
    save_file({"a": a}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"b": b}, str(tmp_path / "model-00002-of-00002.safetensors"))
    index = {
        "weight_map": {
            "a": "model-00001-of-00002.safetensors",
            "b": "model-00002-of-00002.safetensors",
        }
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    return package_reads(*sorted(tmp_path.glob("model-*.safetensors")))


def test_a_shard_the_index_does_not_list_is_not_read(tmp_path):
    # a stale shard of an earlier download into the same --local-dir: transformers
    # reads only what the index lists; so does meshinit, and it says what it left
    want = sharded(tmp_path)
    save_file({"c": np.full(8, 7, np.float32)}, str(tmp_path / "model-00003-of-00003.safetensors"))
    plan = plan_for({"a": (8,), "b": (8,), "c": (8,)})
    with pytest.warns(
        UserWarning, match="does not list 'model-00003-of-00003.safetensors'"
    ) as said:
        loaded = st.load(plan, tmp_path, missing="skip")
    assert {w.filename for w in said} == {__file__}  # the warning points at the caller's line
    assert sorted(loaded) == ["a", "b"]  # c is left to the init, not read from the stale file
    for name in ("a", "b"):
        np.testing.assert_array_equal(np.asarray(loaded[name]), want[name])
    with pytest.warns(UserWarning, match="does not list"):
        found = st.inventory(plan, tmp_path, names=None)
    assert [f.name for f in found.files] == sorted(
        ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    )
    assert found.missing == {"c": "c"}


def test_an_unlisted_file_beside_an_index_is_read_when_named_in_a_list(tmp_path):
    sharded(tmp_path)
    extra = tmp_path / "consolidated.safetensors"
    save_file({"c": np.full(8, 7, np.float32)}, str(extra))
    (loaded,) = st.load(plan_for({"c": (8,)}), [extra]).values()
    np.testing.assert_array_equal(np.asarray(loaded), np.full(8, 7, np.float32))


# ------------------------------------------------- dangling cache links


def test_a_dangling_link_in_a_folder_is_an_incomplete_download(tmp_path):
    # the Hugging Face cache links each file to a blob; a link whose blob is gone
    # would leave its weights to the init under missing="skip"
    save_file({"a": np.ones(8, np.float32)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    (tmp_path / "model-00002-of-00002.safetensors").symlink_to(tmp_path / "blobs" / "9f3a")
    plan = plan_for({"a": (8,), "b": (8,)})
    for call in (
        lambda: st.load(plan, tmp_path, missing="skip"),
        lambda: st.inventory(plan, tmp_path),
    ):
        refused(call, "model-00002-of-00002.safetensors", "blobs/9f3a", "does not exist")


def test_links_to_blobs_load_as_the_files_they_name(tmp_path):
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    want = np.arange(8, dtype=np.float32)
    save_file({"a": want}, str(blobs / "9f3a"))
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    (snapshot / "model.safetensors").symlink_to(blobs / "9f3a")
    (loaded,) = st.load(plan_for({"a": (8,)}), snapshot).values()
    np.testing.assert_array_equal(np.asarray(loaded), want)


# ------------------------------------------------- FIFOs do not block


def test_a_fifo_given_as_a_file_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    plan = plan_for({"a": (8,)})
    with within(20):
        refused(lambda: st.load(plan, [fifo]), str(fifo), "FIFO", "not a regular file")
        refused(lambda: st.inventory(plan, fifo), "FIFO")


def test_a_fifo_in_a_folder_is_named_not_opened(tmp_path):
    save_file({"a": np.ones(8, np.float32)}, str(tmp_path / "a.safetensors"))
    os.mkfifo(tmp_path / "b.safetensors")
    plan = plan_for({"a": (8,)})
    with within(20):
        refused(lambda: st.load(plan, tmp_path), "b.safetensors", "FIFO")
        refused(lambda: st.inventory(plan, tmp_path), "b.safetensors", "FIFO")


# ------------------------------------------------- the open-file limit


def test_more_shards_than_the_open_file_limit_load(tmp_path):
    # 241-shard checkpoints meet macOS's default limit of 256; here, 100 shards under
    # a limit 40 above what the process holds open already
    want = {f"w{i}": np.full(8, i, np.float32) for i in range(100)}
    for i, (name, value) in enumerate(want.items()):
        save_file({name: value}, str(tmp_path / f"model-{i:05d}-of-00100.safetensors"))
    plan = plan_for(dict.fromkeys(want, (8,)), axes=("tensor",))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = len(os.listdir("/proc/self/fd")) + 40
    resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
    try:
        loaded = st.load(plan, tmp_path)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert sorted(loaded) == sorted(want)
    for name, value in want.items():
        np.testing.assert_array_equal(np.asarray(loaded[name]), value)


def test_a_stack_of_many_parts_holds_one_descriptor_per_file(tmp_path):
    # 64 layers in one file: one mapping for the parameter, not one per part
    layers = [np.full((2, 8), i, np.float32) for i in range(64)]
    save_file({f"l{i}": v for i, v in enumerate(layers)}, str(tmp_path / "m.safetensors"))
    plan = plan_for({"w": (64, 2, 8)}, axes=(None, None, "tensor"))
    names = {"w": st.Stack([f"l{i}" for i in range(64)], axis=0)}
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 16, hard))
    try:
        (loaded,) = st.load(plan, tmp_path, names=names).values()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    np.testing.assert_array_equal(np.asarray(loaded), np.stack(layers))


@contextlib.contextmanager
def open_files_above_held(n):
    """The process's limit of open files set so that ``n + 1`` more can be opened (one
    to list a folder with). The limit bounds descriptor numbers, not their count:
    numbers freed below the highest one held (an event loop's, closed by an earlier
    test) count as room."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    listing = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY)
    try:
        held = {int(fd) for fd in os.listdir(listing)} - {listing}
    finally:
        os.close(listing)
    limit, free = 0, 0
    while limit in held or free < n + 1:
        free += limit not in held
        limit += 1
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_stack_over_more_files_than_the_limit_loads_and_a_full_table_is_named(tmp_path):
    # a scanned parameter of 100 layers, one file each: its files are
    # mapped in turn as its blocks reach them, not all at once
    layers = [np.full((4, 8), i, np.float32) for i in range(100)]
    for i, layer in enumerate(layers):
        save_file({f"l{i}": layer}, str(tmp_path / f"m-{i:03d}.safetensors"))
    plan = plan_for({"w": (100, 4, 8)}, axes=(None, "fsdp", "tensor"))
    names = {"w": st.Stack([f"l{i}" for i in range(100)], axis=0)}
    with open_files_above_held(40):
        (loaded,) = st.load(plan, tmp_path, names=names).values()
    np.testing.assert_array_equal(np.asarray(loaded), np.stack(layers))
    # no descriptor left to map one: the file, the limit and the fix, not a bare EMFILE
    with open_files_above_held(0), pytest.raises(meshinit.PlanError) as raised:
        st.load(plan, tmp_path, names=names)
    said = str(raised.value)
    assert ".safetensors: cannot be opened: this process has reached its limit" in said
    assert "ulimit -n" in said


def test_the_package_check_names_a_full_descriptor_table_not_an_absent_file(tmp_path):
    # the safetensors package answers "No such file or directory" for any error
    # opening a file: a load that reached the limit between meshinit's own open and
    # the package's must say so, not that a file it just read is absent
    from meshinit._checkpoint.store import header

    path = tmp_path / "a.safetensors"
    save_file({"a": np.ones((2, 2), np.float32)}, str(path))
    with open(path, "rb") as f:
        tensors, problems = header.parse(f, path.stat().st_size, path)
    assert problems == []
    assert header.package_agrees(path, tensors) == []
    with open_files_above_held(0), contextlib.ExitStack() as held:
        with contextlib.suppress(OSError):  # every descriptor under the limit taken
            while True:
                held.enter_context(open(os.devnull))
        said = header.package_agrees(path, tensors)
    assert len(said) == 1
    assert said[0].startswith("cannot be opened: this process has reached its limit")
    assert "ulimit -n" in said[0]


# ------------------------------------------------- an unreadable folder


def test_an_unreadable_folder_is_named_not_reported_empty(tmp_path, monkeypatch):
    save_file({"a": np.ones(8, np.float32)}, str(tmp_path / "a.safetensors"))
    scandir = os.scandir

    def denied(path=".", *args):
        if os.fspath(path) == os.fspath(tmp_path):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return scandir(path, *args)

    monkeypatch.setattr(os, "scandir", denied)  # tests run as root: chmod denies nothing
    plan = plan_for({"a": (8,)})
    for call in (lambda: st.load(plan, tmp_path), lambda: st.inventory(plan, tmp_path)):
        refused(call, str(tmp_path), "cannot be listed (Permission denied)", "read access")


# ------------------------------------------------- a config.json that cannot be read


@pytest.mark.parametrize(
    "text, said",
    [
        (b'{"model_type": "deepseek_v3", "quantiz', "is not JSON (Unterminated string "),
        (b'{"a": 1}\n{"b": 2}', "is not JSON (Extra data: line 2 column 1 (char 9))"),
        (b"\x80{}", "is not JSON ("),
        (b'"fp8"', "holds a JSON str, not an object: not a model's config.json; put the model's"),
        (None, "is a directory, not a regular file"),
        (b"{}" + b" " * 64, "is over 64 bytes: not a config.json"),
    ],
)
def test_a_config_json_that_cannot_be_read_is_a_problem_naming_it(
    tmp_path, text, said, monkeypatch
):
    from meshinit._checkpoint.store import listing as file

    monkeypatch.setattr(file, "MAX_CONFIG", 64)
    save_file({"a": np.ones(8, np.float32)}, str(tmp_path / "a.safetensors"))
    if text is None:
        (tmp_path / "config.json").mkdir()
    else:
        (tmp_path / "config.json").write_bytes(text)
    for files in (tmp_path, tmp_path / "a.safetensors", [tmp_path / "a.safetensors"]):
        config, where, problems = file.read_config(file.listing(files))
        assert config is None and where == str(tmp_path / "config.json")
        assert [p.path for p in problems] == [where] and said in problems[0].message, problems
    if text is not None and text.startswith(b"{") and not text.endswith(b" "):
        assert "a truncated or damaged copy? Download it again" in problems[0].message
    # a load that consults no config reads none: a float32 tensor, planned float32
    assert st.load(plan_for({"a": (8,)}), tmp_path)["a"].shape == (8,)


# ------------------------------------------------- a header of 200,000 entries


def many(path, n):
    """A file of ``n`` one-element tensors, written as the package writes them."""
    save_file(
        {
            f"model.layers.{i // 100}.experts.{i % 100}.scale": np.ones(1, np.float32)
            for i in range(n)
        },
        str(path),
    )
    return path


def test_a_large_header_is_checked_without_a_call_into_the_package_per_tensor(
    tmp_path, monkeypatch
):
    # the check's cost grew with the header squared on safetensors < 0.7 (each
    # get_slice copies the header): a 200,000-entry header took hours there
    path = many(tmp_path / "m.safetensors", 5000)
    calls = []
    real = safetensors.safe_open

    class Counting:
        def __init__(self, *args, **kwargs):
            self._f = real(*args, **kwargs)

        def __getattr__(self, name):
            calls.append(name)
            return getattr(self._f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self._f.__exit__(*exc)

    monkeypatch.setattr(safetensors, "safe_open", Counting)
    plan = plan_for({"model.layers.0.experts.7.scale": (1,)})
    found = st.inventory(plan, path)
    assert found.loaded and len(found.unused) == 4999
    assert len(calls) <= 3, sorted(set(calls))  # keys(), not get_slice() per tensor


def test_hidden_files_in_a_checkpoint_directory_are_skipped(tmp_path):
    # macOS's AppleDouble file beside the real one once broke the load with MemoryError
    save_file({"w": np.arange(8, dtype=np.float32)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "._model.safetensors").write_bytes(b"\x00\x05\x16\x07" + b"\xff" * 200)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "sub.safetensors").mkdir()
    (loaded,) = st.load(plan_for({"w": (8,)}), tmp_path).values()
    np.testing.assert_array_equal(np.asarray(loaded), np.arange(8, dtype=np.float32))
    # named explicitly, it is checked like any file, and named
    load_refused(plan_for({"w": (8,)}), [tmp_path / "._model.safetensors"], "._model.safetensors")


def test_a_missing_file_in_a_list_is_named(tmp_path):
    load_refused(
        plan_for({"w": (8,)}),
        [tmp_path / "nope.safetensors"],
        "nope.safetensors",
        "cannot be opened",
    )


def test_an_index_naming_an_absent_shard_is_an_incomplete_download(tmp_path):
    # with missing="skip", the absent shard's tensors would otherwise be made at random
    save_file({"a": np.ones(4, np.float32)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    index = {
        "weight_map": {
            "a": "model-00001-of-00002.safetensors",
            "b": "model-00002-of-00002.safetensors",
        }
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    load_refused(
        plan_for({"a": (4,), "b": (4,)}),
        tmp_path,
        "model-00002-of-00002.safetensors",
        "incomplete download",
        missing="skip",
    )
