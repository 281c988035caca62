"""The storage servers the remote-loading tests stand on (tests/storage_servers.py):
ranged reads return exactly the asked bytes with the headers clients read, the
counters count what went out, and each fault fires as many times as asked, then
clears. Every client here is the real one (http.client, boto3, obstore,
huggingface_hub)."""

import http.client
import os
import urllib.parse

import pytest
from storage_http import Unsatisfiable, parse_range
from storage_servers import (  # noqa: F401
    FileServer,
    S3Server,
    file_server_fixture,
    https_server_fixture,
    s3_server_fixture,
)

DATA = os.urandom(1000)


def request(url, method="GET", headers=None, conn=None):
    """``(status, headers, body)`` of one request; headers' names lowercased."""
    parts = urllib.parse.urlsplit(url)
    own = conn is None
    conn = conn or http.client.HTTPConnection(parts.netloc, timeout=30)
    try:
        conn.request(method, parts.path + (f"?{parts.query}" if parts.query else ""),
                     headers=headers or {})  # fmt: skip
        reply = conn.getresponse()
        return reply.status, {k.lower(): v for k, v in reply.getheaders()}, reply.read()
    finally:
        if own:
            conn.close()


# --- Range parsing ------------------------------------------------------------------


@pytest.mark.parametrize(
    "header, span",
    [
        (None, None),
        ("bytes=2-4", (2, 5)),
        ("bytes=2-", (2, 10)),
        ("bytes=-3", (7, 10)),
        ("bytes=-30", (0, 10)),
        ("bytes=5-100", (5, 10)),
        ("bytes=0-1,4-5", None),  # several ranges: the whole object, as S3 answers
        ("items=0-1", None),
        ("bytes=4-2", None),
        ("bytes=a-b", None),
    ],
)
def test_a_range_header_names_the_half_open_span_it_asks_for(header, span):
    assert parse_range(header, 10) == span


@pytest.mark.parametrize("header", ["bytes=10-", "bytes=12-20", "bytes=-0"])
def test_a_range_at_or_past_the_end_is_unsatisfiable(header):
    with pytest.raises(Unsatisfiable):
        parse_range(header, 10)


# --- the file server ----------------------------------------------------------------


def test_a_range_request_returns_exactly_those_bytes_with_the_headers_clients_read(
    file_server,
):
    file_server.put("w/f.bin", DATA)
    url = file_server.url_for("w/f.bin")
    status, headers, body = request(url, headers={"Range": "bytes=100-199"})
    assert (status, body) == (206, DATA[100:200])
    assert headers["content-range"] == "bytes 100-199/1000"
    assert headers["content-length"] == "100"
    assert headers["accept-ranges"] == "bytes"
    etag = headers["etag"]
    assert etag.startswith('"') and etag.endswith('"') and len(etag) > 10
    status, headers, body = request(url, "HEAD")
    assert (status, body, headers["content-length"], headers["etag"]) == (200, b"", "1000", etag)
    c = file_server.counters
    assert (c.requests, c.bytes_sent, c.bytes_for("w/f.bin")) == (2, 100, 100)
    assert c.ranges == [("w/f.bin", 100, 200)]


def test_whole_suffix_past_the_end_and_several_ranges(file_server):
    file_server.put("f.bin", DATA)
    url = file_server.url_for("f.bin")
    assert request(url)[::2] == (200, DATA)
    assert request(url, headers={"Range": "bytes=-10"})[::2] == (206, DATA[-10:])
    assert request(url, headers={"Range": "bytes=990-5000"})[::2] == (206, DATA[990:])
    status, headers, _ = request(url, headers={"Range": "bytes=1000-"})
    assert (status, headers["content-range"]) == (416, "bytes */1000")
    assert request(url, headers={"Range": "bytes=0-1,5-6"})[::2] == (200, DATA)
    assert request(file_server.url_for("missing.bin"))[0] == 404
    assert request(file_server.url + "/../../etc/passwd")[0] == 404
    assert file_server.counters.bytes_for("f.bin") == 1000 + 10 + 10 + 1000


def test_conditions_on_the_etag(file_server):
    file_server.put("f.bin", DATA)
    url = file_server.url_for("f.bin")
    etag = request(url, "HEAD")[1]["etag"]
    assert request(url, headers={"If-Match": '"other"'})[0] == 412
    assert request(url, headers={"If-Match": etag, "Range": "bytes=0-1"})[::2] == (206, DATA[:2])
    assert request(url, headers={"If-None-Match": etag})[0] == 304
    ranged_if = {"Range": "bytes=0-1", "If-Range": etag}
    assert request(url, headers=ranged_if)[::2] == (206, DATA[:2])
    stale = {"Range": "bytes=0-1", "If-Range": '"other"'}
    assert request(url, headers=stale)[::2] == (200, DATA)


def test_one_connection_carries_many_requests(file_server):
    file_server.put("f.bin", DATA)
    conn = http.client.HTTPConnection(file_server.url.removeprefix("http://"), timeout=30)
    for start in (0, 10, 500):
        got = request(file_server.url_for("f.bin"), conn=conn,
                      headers={"Range": f"bytes={start}-{start + 9}"})  # fmt: skip
        assert got[::2] == (206, DATA[start : start + 10])
    assert request(file_server.url_for("f.bin"), "HEAD", conn=conn)[0] == 200
    conn.close()


def test_a_503_fires_as_many_times_as_asked_then_clears(file_server):
    file_server.put("f.bin", DATA)
    fault = file_server.fail("f.bin", 503, times=2)
    url = file_server.url_for("f.bin")
    other = file_server.url_for("g.bin")
    assert request(other)[0] == 404  # another path: the fault does not fire
    assert [request(url)[0] for _ in range(3)] == [503, 503, 200]
    assert (fault.fired, fault.done) == (2, True)
    assert [s.status for s in file_server.counters.log] == [404, 503, 503, 200]


def test_a_403_and_a_fault_after_some_requests(file_server):
    file_server.put("f.bin", DATA)
    file_server.fail("f.bin", 403, after=1)
    url = file_server.url_for("f.bin")
    assert [request(url)[0] for _ in range(3)] == [200, 403, 200]
    file_server.fail("f.bin", 403, method="HEAD")
    assert [request(url, m)[0] for m in ("GET", "HEAD", "HEAD")] == [200, 403, 200]


def test_a_dropped_connection_cuts_the_body_then_clears(file_server):
    file_server.put("f.bin", DATA)
    fault = file_server.drop("f.bin", keep=30)
    url = file_server.url_for("f.bin")
    with pytest.raises(http.client.IncompleteRead) as cut:
        request(url, headers={"Range": "bytes=100-299"})
    assert cut.value.partial == DATA[100:130] and cut.value.expected == 170
    assert request(url, headers={"Range": "bytes=100-299"})[::2] == (206, DATA[100:300])
    assert fault.fired == 1
    assert [s.sent for s in file_server.counters.log] == [30, 200]


def test_an_object_replaced_between_two_requests_has_a_new_etag(file_server):
    file_server.put("f.bin", DATA)
    new = DATA[::-1]
    file_server.replace_after("f.bin", new, after=1)
    url = file_server.url_for("f.bin")
    first = request(url, headers={"Range": "bytes=0-9"})
    second = request(url, headers={"Range": "bytes=0-9"})
    assert (first[2], second[2]) == (DATA[:10], new[:10])
    assert first[1]["etag"] != second[1]["etag"]
    assert request(url, headers={"If-Match": first[1]["etag"]})[0] == 412


def test_a_truncated_object_is_shorter_with_a_new_etag(file_server):
    file_server.put("f.bin", DATA)
    url = file_server.url_for("f.bin")
    before = request(url, "HEAD")[1]
    file_server.truncate("f.bin", 600)
    after = request(url, "HEAD")[1]
    assert (after["content-length"], after["etag"] != before["etag"]) == ("600", True)
    assert request(url, headers={"Range": "bytes=700-799"})[0] == 416


# --- the Hub ------------------------------------------------------------------------


def hub(file_server):
    file_server.put("org/model/model.safetensors", DATA)
    file_server.put("org/model/sub/config.json", b'{"a": 1}')
    from huggingface_hub import HfFileSystem

    return HfFileSystem(skip_instance_cache=True, **file_server.hf_options())


def test_hffilesystem_lists_and_reads_ranges_through_the_hub_routes(file_server):
    fs = hub(file_server)
    assert fs.ls("org/model", detail=False) == ["org/model/model.safetensors", "org/model/sub"]
    assert fs.find("hf://org/model") == ["org/model/model.safetensors", "org/model/sub/config.json"]
    assert fs.info("org/model/model.safetensors")["size"] == 1000
    got = fs.cat_file("org/model/model.safetensors", start=10, end=20, cache_type="none")
    assert got == DATA[10:20]
    assert file_server.counters.ranges == [("org/model/model.safetensors", 10, 20)]
    paths = {s.path for s in file_server.counters.log}
    assert {"/api/models/org/model", "/api/models/org/model/tree/main"} <= paths


def test_hub_revisions_main_and_the_commit_and_a_put_makes_a_new_commit(file_server):
    fs = hub(file_server)
    sha = file_server.commit("org/model")
    assert fs.cat_file(f"org/model@{sha}/sub/config.json") == b'{"a": 1}'
    assert fs.cat_file("org/model@main/sub/config.json") == b'{"a": 1}'
    with pytest.raises(FileNotFoundError, match="revision not found"):
        fs.info("org/model@nope/sub/config.json")
    with pytest.raises(FileNotFoundError, match="repository not found"):
        fs.info("org/other/config.json")
    file_server.put("org/model/sub/config.json", b"{}")
    assert file_server.commit("org/model") != sha
    status, headers, _ = request(file_server.hf_url("org/model", "sub/config.json"), "HEAD")
    assert (status, headers["x-repo-commit"]) == (200, file_server.commit("org/model"))
    assert request(file_server.hf_url("org/model", "sub/config.json", sha))[0] == 404


def test_hub_paths_info_and_hf_hub_download_through_a_cdn_redirect(tmp_path):
    from huggingface_hub import HfApi, hf_hub_download

    (tmp_path / "org" / "model").mkdir(parents=True)
    (tmp_path / "org" / "model" / "model.safetensors").write_bytes(DATA)
    with FileServer(tmp_path, lfs_redirect=True) as server:
        api = HfApi(endpoint=server.url, token=False)
        [info] = api.get_paths_info("org/model", ["model.safetensors"])
        assert (info.path, info.size) == ("model.safetensors", 1000)
        got = hf_hub_download("org/model", "model.safetensors", endpoint=server.url,
                              token=False, cache_dir=tmp_path / "cache")  # fmt: skip
        assert open(got, "rb").read() == DATA
        statuses = [(s.method, s.status) for s in server.counters.log if "model.s" in s.path]
        assert statuses == [("HEAD", 302), ("GET", 200)]  # GET goes straight to the "CDN"
        assert server.counters.bytes_for("org/model/model.safetensors") == 1000


def test_hffilesystem_retries_a_503_from_the_hub(file_server):
    fs = hub(file_server)
    fault = file_server.fail("org/model/model.safetensors", 503)
    got = fs.cat_file("org/model/model.safetensors", start=0, end=8, cache_type="none")
    assert (got, fault.fired) == (DATA[:8], 1)
    assert [s.status for s in file_server.counters.log if s.path.endswith("tensors")] == [503, 206]


def test_obstore_reads_ranges_of_plain_and_resolve_urls_and_follows_the_cdn_redirect(tmp_path):
    import obstore
    from obstore.store import HTTPStore

    for redirect in (False, True):
        with FileServer(tmp_path, lfs_redirect=redirect) as server:
            server.put("org/model/model.safetensors", DATA)
            store = HTTPStore.from_url(server.url, client_options={"allow_http": True})
            got = obstore.get_ranges(store, "org/model/resolve/main/model.safetensors",
                                     starts=[0, 600], ends=[8, 700], coalesce=0)  # fmt: skip
            assert [bytes(b) for b in got] == [DATA[:8], DATA[600:700]]
            got = obstore.get_range(store, "org/model/model.safetensors", start=5, end=9)
            assert bytes(got) == DATA[5:9]
            assert sorted(server.counters.ranges) == [
                ("org/model/model.safetensors", a, b) for a, b in [(0, 8), (5, 9), (600, 700)]
            ]
            redirects = [s.status for s in server.counters.log].count(302)
            assert redirects == (2 if redirect else 0)


def test_the_https_server_is_trusted_through_ssl_cert_file_and_logs_each_target(https_server):
    import ssl

    import obstore
    from obstore.store import HTTPStore

    https_server.put("w/f.bin", DATA)
    url = https_server.url_for("w/f.bin")
    assert url.startswith("https://127.0.0.1:"), url
    # obstore (rustls) trusts the test authority that SSL_CERT_FILE names: no options
    store = HTTPStore.from_url(url)
    assert bytes(obstore.get_range(store, "", start=100, end=200)) == DATA[100:200]
    # and so does Python's ssl (OpenSSL reads SSL_CERT_FILE too), on a doubled slash
    context = ssl.create_default_context()
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPSConnection(parts.netloc, timeout=30, context=context)
    conn.request("GET", "/w//f.bin?x=1", headers={"Range": "bytes=0-9"})
    reply = conn.getresponse()
    assert (reply.status, reply.read()) == (206, DATA[:10])
    conn.close()
    targets = [(s.method, s.path, s.target, s.range) for s in https_server.counters.log]
    assert targets == [
        ("GET", "w/f.bin", "/w/f.bin", (100, 200)),
        ("GET", "w//f.bin", "/w//f.bin?x=1", (0, 10)),  # as sent, not normalized
    ], targets


# --- S3 -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fast_s3():
    with S3Server(fast_reads=True) as server:
        yield server


@pytest.fixture(params=[False, True], ids=["moto", "fast_reads"])
def s3(request, s3_server):
    """Each S3 test against moto's own answers and against ``fast_reads``."""
    if not request.param:
        return s3_server
    server = request.getfixturevalue("fast_s3")
    server.reset()
    return server


def client(server, attempts=1):
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3", endpoint_url=server.url, region_name=server.region,
        aws_access_key_id=server.key_id, aws_secret_access_key=server.secret,
        config=Config(retries={"mode": "standard", "max_attempts": attempts}),
    )  # fmt: skip


def put_object(server, data=DATA):
    bucket = server.bucket()
    server.put(f"{bucket}/dir/obj.bin", data)
    return bucket, "dir/obj.bin", f"{bucket}/dir/obj.bin"


def test_s3_ranged_get_returns_exactly_those_bytes_and_is_counted(s3):
    bucket, key, path = put_object(s3)
    c = client(s3)
    got = c.get_object(Bucket=bucket, Key=key, Range="bytes=100-199")
    assert got["Body"].read() == DATA[100:200]
    assert got["ContentRange"] == "bytes 100-199/1000"
    assert got["ETag"] == s3.etag(path)
    assert c.head_object(Bucket=bucket, Key=key)["ContentLength"] == 1000
    assert c.get_object(Bucket=bucket, Key=key)["Body"].read() == DATA
    assert s3.counters.ranges == [(path, 100, 200)]
    assert s3.counters.bytes_for(path) == 1100
    assert [(s.method, s.status) for s in s3.counters.log] == [
        ("GET", 206), ("HEAD", 200), ("GET", 200)
    ]  # fmt: skip


def test_s3_503s_are_retried_by_boto3_until_the_fault_clears(s3):
    bucket, key, path = put_object(s3)
    fault = s3.fail(path, 503, times=1)
    got = client(s3, attempts=3).get_object(Bucket=bucket, Key=key, Range="bytes=0-9")
    assert (got["Body"].read(), fault.fired) == (DATA[:10], 1)
    assert [s.status for s in s3.counters.log] == [503, 206]


def test_s3_403_is_access_denied_and_then_clears(s3):
    from botocore.exceptions import ClientError

    bucket, key, path = put_object(s3)
    s3.fail(path, 403)
    c = client(s3, attempts=3)
    with pytest.raises(ClientError, match="AccessDenied"):
        c.get_object(Bucket=bucket, Key=key)
    assert c.get_object(Bucket=bucket, Key=key)["Body"].read() == DATA


def test_s3_a_dropped_connection_mid_range_fails_the_read_once(s3):
    from botocore.exceptions import IncompleteReadError, ResponseStreamingError

    bucket, key, path = put_object(s3)
    s3.drop(path, keep=50)
    c = client(s3)
    with pytest.raises((IncompleteReadError, ResponseStreamingError)):
        c.get_object(Bucket=bucket, Key=key, Range="bytes=0-199")["Body"].read()
    assert c.get_object(Bucket=bucket, Key=key, Range="bytes=0-199")["Body"].read() == DATA[:200]
    assert [s.sent for s in s3.counters.log] == [50, 200]


def test_s3_an_object_replaced_between_two_reads_has_a_new_etag(s3):
    from botocore.exceptions import ClientError

    bucket, key, path = put_object(s3)
    s3.replace_after(path, b"new" * 400, after=1)
    c = client(s3)
    first = c.get_object(Bucket=bucket, Key=key, Range="bytes=0-2")
    second = c.get_object(Bucket=bucket, Key=key, Range="bytes=0-2")
    assert (first["Body"].read(), second["Body"].read()) == (DATA[:3], b"new")
    assert first["ETag"] != second["ETag"]
    with pytest.raises(ClientError, match="PreconditionFailed"):
        c.get_object(Bucket=bucket, Key=key, IfMatch=first["ETag"])


def test_s3_a_truncated_object_is_shorter(s3):
    bucket, key, path = put_object(s3)
    etag = s3.etag(path)
    s3.truncate(path, 600)
    head = client(s3).head_object(Bucket=bucket, Key=key)
    assert (head["ContentLength"], head["ETag"] != etag) == (600, True)


def test_s3_a_write_through_the_proxy_is_read_back(s3):
    bucket, key, path = put_object(s3)
    c = client(s3)
    assert c.get_object(Bucket=bucket, Key=key)["Body"].read() == DATA
    c.put_object(Bucket=bucket, Key=key, Body=b"second")
    assert c.get_object(Bucket=bucket, Key=key)["Body"].read() == b"second"


def test_boto3_and_obstore_find_the_server_from_the_environment_alone(s3_server):
    import boto3
    import obstore
    from obstore.store import S3Store

    bucket, key, path = put_object(s3_server)
    c = boto3.client("s3")  # AWS_ENDPOINT_URL, the keys and the region from the fixture
    assert [o["Key"] for o in c.list_objects_v2(Bucket=bucket)["Contents"]] == [key]
    got = c.get_object(Bucket=bucket, Key=key, Range="bytes=500-509")["Body"].read()
    assert got == DATA[500:510]
    store = S3Store.from_url(f"s3://{bucket}/")
    assert [o["path"] for o in obstore.list(store).collect()] == [key]
    got = obstore.get_ranges(store, key, starts=[1, 900], ends=[3, 1000])
    assert [bytes(b) for b in got] == [DATA[1:3], DATA[900:]]
    # obstore merges ranges less than 1 MiB apart (its get_ranges' coalesce=)
    assert sorted(r[1:] for r in s3_server.counters.ranges) == [(1, 1000), (500, 510)]
    assert [s.path for s in s3_server.counters.log].count(bucket) == 2  # the two listings


# --- per-client attribution ---------------------------------------------------------


def test_client_of_reads_the_access_key_id_from_a_sigv4_authorization_header():
    from storage_http import client_of

    header = (
        "AWS4-HMAC-SHA256 Credential=proc-3/20261206/us-east-1/s3/aws4_request, "
        "SignedHeaders=host;range;x-amz-date, Signature=abc"
    )
    assert client_of(header) == "proc-3"
    assert client_of(None) is None
    assert client_of("Bearer hf_token") is None


def test_s3_counts_object_bytes_per_access_key_and_a_fault_fires_for_one_key_only(s3):
    import obstore
    from obstore.store import S3Store

    bucket, key, path = put_object(s3)
    stores = {
        k: S3Store(bucket, **s3.obstore_options(k), retry_config={"max_retries": 0})
        for k in ("proc-0", "proc-1")
    }
    got = obstore.get_range(stores["proc-0"], key, start=0, end=100)  # "the header"
    assert bytes(got) == DATA[:100]
    assert bytes(obstore.get_range(stores["proc-0"], key, start=100, end=400)) == DATA[100:400]
    assert bytes(obstore.get_range(stores["proc-1"], key, start=400, end=1000)) == DATA[400:]
    c = client(s3)  # signs with the server's own key id, "testing"
    assert c.get_object(Bucket=bucket, Key=key)["Body"].read() == DATA
    c.head_object(Bucket=bucket, Key=key)  # sends no object bytes
    counters = s3.counters
    assert counters.clients == {"proc-0", "proc-1", "testing"}
    assert counters.bytes_by_client() == {"proc-0": 400, "proc-1": 600, "testing": 1000}
    # the data from offset 100 on: proc-0's first read was all "header"
    assert counters.bytes_by_client({path: 100}) == {"proc-0": 300, "proc-1": 600, "testing": 900}
    assert counters.bytes_by_client({"other/obj": 0}) == {}
    # a read from offset 0 (a header read that runs on into the data) left out
    assert counters.bytes_by_client({path: 50}, header_reads=False) == {
        "proc-0": 300,
        "proc-1": 600,
    }
    assert counters.spans("proc-0") == [(path, 0, 100), (path, 100, 400)]
    assert counters.spans("testing") == [(path, 0, 1000)]
    assert [(s.method, s.client) for s in counters.log][-1] == ("HEAD", "testing")

    # a permanent fault for proc-1's requests: proc-0 and the others read on
    s3.reset()
    fault = s3.fail(path, 503, times=1 << 30, client="proc-1")
    with pytest.raises(Exception, match="503|Service Unavailable|SlowDown"):
        obstore.get_range(stores["proc-1"], key, start=0, end=10)
    assert bytes(obstore.get_range(stores["proc-0"], key, start=0, end=10)) == DATA[:10]
    assert c.get_object(Bucket=bucket, Key=key, Range="bytes=0-9")["Body"].read() == DATA[:10]
    assert fault.fired == 1
    assert [(s.client, s.status) for s in counters.log] == [
        ("proc-1", 503), ("proc-0", 206), ("testing", 206)
    ]  # fmt: skip
