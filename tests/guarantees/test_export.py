"""``meshinit.safetensors.save`` under ``jax.distributed`` (issue 66): 4 processes x 2
CPU devices (gloo) export one model to a shared local folder and to S3 (moto), each
process writing its own files; the files hold the model bit for bit, the server saw
each process send its share once (counted by access key), and a failed write on one
process fails every process and leaves nothing under the destination."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import export_worker as worker
import helpers
import numpy as np
import pytest

pytestmark = pytest.mark.slow
TIMEOUT_S = 240


def spawn(tmp_path: Path, scenario: str, s3: bool, fault=None):
    with contextlib.ExitStack() as stack:
        env, dest = None, tmp_path / "export"
        server = None
        if s3:
            pytest.importorskip("obstore")
            from storage_servers import S3Server

            server = stack.enter_context(S3Server())
            dest, env = f"s3://{server.bucket()}/export", server.env
            if fault is not None:
                fault(server)
        results = helpers.run_workers(
            worker.__file__,
            worker.NUM_PROCESSES,
            (dest, scenario),
            tmp_path / "logs",
            env,
            TIMEOUT_S,
            30,
        )
        files = _listing(server, dest) if s3 else _local(dest)
        served = server.counters.log if s3 else []
    for i, r in enumerate(results):
        assert r["returncode"] == 0 and "DONE" in r["stdout"], helpers.describe_worker(i, r)
    steps = [
        json.loads(next(x for x in r["stdout"].splitlines() if x.startswith("STEP "))[5:])
        for r in results
    ]
    return steps, files, served


def _local(dest: Path) -> dict[str, bytes]:
    if not dest.exists():
        return {}
    return {f: (dest / f).read_bytes() for f in os.listdir(dest)}


def _listing(server, dest: str) -> dict[str, bytes]:
    """Every object under ``dest``, read straight from moto (not counted)."""
    bucket, _, prefix = dest.removeprefix("s3://").partition("/")
    listed = server.client.list_objects_v2(Bucket=bucket, Prefix=prefix + "/").get("Contents", [])
    out = {}
    for item in listed:
        body = server.client.get_object(Bucket=bucket, Key=item["Key"])["Body"].read()
        out[item["Key"].removeprefix(prefix + "/")] = body
    uploads = server.client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
    assert uploads == [], uploads  # none left open
    return out


def _tensors(files: dict[str, bytes], folder: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file  # (its load() of bytes knows no BF16)

    folder.mkdir()
    out = {}
    for name, data in files.items():
        if name.endswith(".safetensors"):
            (folder / name).write_bytes(data)
            out.update(load_file(str(folder / name)))
    return out


def _exact(files, folder):
    got, want = _tensors(files, folder), worker.expected()
    assert sorted(got) == sorted(want)
    for name, x in want.items():
        assert got[name].dtype == x.dtype and got[name].shape == x.shape, name
        np.testing.assert_array_equal(
            got[name].view(np.uint8), np.ascontiguousarray(x).view(np.uint8)
        )
    index = json.loads(files["model.safetensors.index.json"])
    assert set(index["weight_map"]) == set(want)
    assert json.loads(files["config.json"]) == {"model_type": "test"}


@pytest.mark.parametrize("s3", [False, True], ids=["folder", "s3"])
def test_every_process_writes_its_own_files_and_the_export_is_exact(tmp_path, s3):
    steps, files, served = spawn(tmp_path, "ok", s3)
    for i, step in enumerate(steps):
        assert step["outcome"] == "ok" and step["leaked"] == 0, (i, step)
    _exact(files, tmp_path / "read")
    shares = steps[0]["bytes_by_process"]
    assert all(s > 0 for s in shares), shares  # every process wrote files of its own
    data = {f: len(b) for f, b in files.items() if f.endswith(".safetensors")}
    assert sum(shares) == sum(data.values())
    if s3:  # what each process uploaded, counted at the server by its access key
        sent = {f"proc-{i}": 0 for i in range(worker.NUM_PROCESSES)}
        for r in served:
            if r.method == "PUT" and r.client in sent:
                sent[r.client] += r.received
        small = len(files["model.safetensors.index.json"]) + len(files["config.json"])
        assert sent["proc-0"] == shares[0] + small, (sent, shares)
        for i in range(1, worker.NUM_PROCESSES):
            assert sent[f"proc-{i}"] == shares[i], (i, sent, shares)


def _fail_uploads(server):
    server.fail("*", 503, method="PUT", times=1 << 30, client=f"proc-{worker.FAILING}")


@pytest.mark.parametrize("s3", [False, True], ids=["folder", "s3"])
def test_a_failed_write_on_one_process_fails_every_process_and_leaves_nothing(tmp_path, s3):
    steps, files, _ = spawn(tmp_path, "fail", s3, _fail_uploads if s3 else None)
    for i, step in enumerate(steps):
        assert step["outcome"] != "ok" and step["leaked"] == 0, (i, step)
        if i == worker.FAILING:
            assert step["outcome"].startswith(("PlanError", "OSError")), step["outcome"]
        else:
            assert step["outcome"].startswith("PeerFailure"), (i, step["outcome"])
    assert [f for f in files if not f.startswith(".")] == [], sorted(files)
