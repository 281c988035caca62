"""Object storage on localhost for the tests: an S3 server (moto behind a counting
proxy) and a ranged HTTP file server that also answers as the Hugging Face Hub. Both
count what they send and inject faults (see :mod:`storage_http`); both start and stop
inside the tests.

Use the fixtures by importing them into a test module or a conftest (pytest finds them
by their names, ``s3_server`` and ``file_server``)::

    from storage_servers import file_server_fixture, s3_server_fixture  # noqa: F401

- ``s3_server``: one :class:`S3Server` for the session, its counters and faults reset
  and its environment (``AWS_ENDPOINT_URL``, fake keys, ...) set for each test.
- ``file_server``: a :class:`FileServer` over a fresh folder (``file_server.root``) per
  test, ``HF_ENDPOINT`` set to it.
- ``https_server``: the same over HTTPS, its certificate signed by a test authority
  that ``SSL_CERT_FILE`` names for the test (what obstore's client trusts then).
- ``gcs``: the ``s3_server`` as GCS's XML API for ``gs://`` (:meth:`S3Server.gcs_env`).

huggingface_hub reads ``HF_ENDPOINT`` once, when imported: in-process clients get it as
``HfFileSystem(endpoint=file_server.url)`` (:meth:`FileServer.hf_options`).
"""

from __future__ import annotations

import dataclasses
import email.utils
import hashlib
import json
import logging
import os
import re
import ssl
import threading
import urllib.parse
import uuid
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

import pytest
from storage_http import Handler, Served, Server

# --- the ranged file server and the Hub ---------------------------------------------

_RESOLVE = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")
_API = re.compile(r"^/api/models/([^/]+/[^/]+)(?:/(revision|tree|paths-info)/([^/]+)(/.*)?)?$")


class _FileHandler(Handler):
    def route(self, method):
        url = urllib.parse.urlsplit(self.path)
        path = urllib.parse.unquote(url.path)
        body = self.read_body()
        owner: FileServer = self.owner  # type: ignore[assignment]
        if m := _API.match(url.path):
            return self.api(method, url, m, body)
        if url.path.startswith("/api/"):  # what the Hub says of a repo id it does not know
            return self.error(method, url.path, 404, "RepoNotFound", url.path)
        repo = None
        if m := _RESOLVE.match(url.path):
            repo, revision, file = (urllib.parse.unquote(g) for g in m.groups())
            if (problem := owner.check_repo(repo, revision)) is not None:
                return self.error(method, path, 404, problem, f"{repo}@{revision}")
            path = f"{repo}/{file}"
            if owner.lfs_redirect and file.endswith(".safetensors") and owner.file(path):
                return self.redirect(method, path, repo)
        else:
            path = path.lstrip("/")
        if method not in ("GET", "HEAD"):
            return self.error(method, path, 405, "MethodNotAllowed", method)
        if self.answer_fault(method, path):
            return
        file = owner.file(path)
        if file is None or not file.is_file():
            return self.error(method, path, 404, "EntryNotFound", path)
        extra = [("Content-Type", "application/octet-stream")]
        if repo is not None:
            extra.append(("X-Repo-Commit", owner.commit(repo)))
        fd = os.open(file, os.O_RDONLY)
        try:
            st = os.fstat(fd)
            etag = owner.etag(path, st) if owner.etags else None
            if owner.last_modified:
                modified = email.utils.formatdate(st.st_mtime, usegmt=True)
                extra.append(("Last-Modified", modified))
            self.send_object(method, path, st.st_size, etag, lambda o, n: os.pread(fd, n, o), extra)
        finally:
            os.close(fd)

    def redirect(self, method, path, repo):
        """302 to the plain URL, with the headers the Hub sends with its CDN redirects."""
        owner: FileServer = self.owner  # type: ignore[assignment]
        st = owner.file(path).stat()
        self.send(method, path, 302, [
            ("Location", owner.url_for(path, cdn=True)),
            ("X-Repo-Commit", owner.commit(repo)),
            ("X-Linked-Etag", owner.etag(path, st)),
            ("X-Linked-Size", str(st.st_size)),
        ])  # fmt: skip

    def api(self, method, url, m, body):
        owner: FileServer = self.owner  # type: ignore[assignment]
        repo, what, revision, sub = m.groups()
        revision = urllib.parse.unquote(revision or "main")
        if (problem := owner.check_repo(repo, revision)) is not None:
            return self.error(method, url.path, 404, problem, f"{repo}@{revision}")
        if self.answer_fault(method, url.path):
            return
        if what in (None, "revision"):
            files = owner.entries(repo, "", recursive=True)
            out = {
                "id": repo,
                "modelId": repo,
                "sha": owner.commit(repo),
                "private": False,
                "siblings": [{"rfilename": e["path"]} for e in files if e["type"] == "file"],
            }
        elif what == "tree":
            query = urllib.parse.parse_qs(url.query)
            recursive = query.get("recursive", ["False"])[0].lower() == "true"
            sub = urllib.parse.unquote(sub or "").strip("/")
            if owner.file(f"{repo}/{sub}") is None or not owner.file(f"{repo}/{sub}").is_dir():
                return self.error(method, url.path, 404, "EntryNotFound", sub)
            out = owner.entries(repo, sub, recursive=recursive)
        else:
            form = urllib.parse.parse_qs(body.decode())
            if "json" in self.headers.get("Content-Type", ""):
                form = {"paths": json.loads(body)["paths"]}
            out = [e for p in form.get("paths", []) if (e := owner.entry(repo, p)) is not None]
        data = json.dumps(out).encode()
        headers = [("Content-Type", "application/json")]
        self.send(method, url.path, 200, headers, b"" if method == "HEAD" else data)


class FileServer(Server):
    """Serves the folder ``root`` over HTTP, honouring ``Range`` (206 with
    ``Content-Range``, 416 past the end), ``If-Match``, ``If-None-Match`` and
    ``If-Range``, with a strong ``ETag`` per file version, on GET and HEAD:

    - ``{url}/{path}``: the file ``root/{path}`` (:meth:`url_for`);
    - ``{url}/{org}/{name}/resolve/{revision}/{file}``: the file ``root/{org}/{name}/
      {file}``, as the Hub's file servers answer (``X-Repo-Commit`` set);
    - the Hub API that ``huggingface_hub.HfFileSystem`` calls (``HfApi.repo_info``,
      ``list_repo_tree``, ``get_paths_info``): ``/api/models/{repo}``,
      ``.../revision/{rev}``, ``.../tree/{rev}[/{path}]`` and ``.../paths-info/{rev}``
      (POST), one page, no ``xetHash`` (so the client reads over HTTP).

    Every answer carries ``Last-Modified`` (none with ``last_modified=False``); with
    ``etags=False`` no ``ETag`` (and no condition on one).

    With ``lfs_redirect=True`` a resolve URL of a ``*.safetensors`` file answers 302 to
    its plain URL on a second port (another origin, as the Hub's CDN is: its client
    does not follow it on HEAD) with ``X-Linked-Etag`` and ``X-Linked-Size``.

    A repo is a two-level folder ``org/name`` under ``root``. Its revisions are
    ``main`` and its current commit (:meth:`commit`, a new one after each
    :meth:`put` in it); others are 404 ``RevisionNotFound``, a missing repo
    ``RepoNotFound``, a missing file ``EntryNotFound`` (the ``X-Error-Code`` the Hub's
    client reads). Counters and faults use the path under ``root`` for file reads, the
    URL path for the API.

    With ``tls`` (a server-side ``ssl.SSLContext``, see :func:`tls_context`) it speaks
    HTTPS.
    """

    handler = _FileHandler

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        lfs_redirect: bool = False,
        etags: bool = True,
        last_modified: bool = True,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.root = Path(root).resolve()
        self.lfs_redirect = lfs_redirect
        self.etags = etags  # False: no ETag (Last-Modified only), as some servers answer
        self.last_modified = last_modified
        self._versions: dict[str, int] = {}
        self._lock = threading.Lock()
        super().__init__(ports=2 if lfs_redirect else 1, tls=tls)

    def url_for(self, path: str, *, cdn: bool = False) -> str:
        """The plain URL of ``root/path``; ``cdn=True``: at the CDN port (see above)."""
        return f"{self.urls[-1 if cdn else 0]}/{urllib.parse.quote(path)}"

    def hf_url(self, repo: str, file: str, revision: str = "main") -> str:
        rev = urllib.parse.quote(revision, safe="")
        return f"{self.url}/{repo}/resolve/{rev}/{urllib.parse.quote(file)}"

    def hf_options(self) -> dict:
        """Keyword arguments for ``HfFileSystem``: this endpoint, no token."""
        return {"endpoint": self.url, "token": False}

    @property
    def env(self) -> dict[str, str]:
        """For a fresh process's huggingface_hub: this endpoint, offline from the Hub."""
        return {"HF_ENDPOINT": self.url, "HF_HUB_DISABLE_TELEMETRY": "1"}

    def file(self, path: str) -> Path | None:
        """``root/path`` if it stays inside ``root``."""
        file = (self.root / path).resolve()
        return file if file == self.root or self.root in file.parents else None

    def put(self, path: str, data: bytes) -> None:
        """Write ``root/path`` as a new file (renamed into place, so a new ETag)."""
        file = self.file(path)
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_name(f".{file.name}.{uuid.uuid4().hex}")
        tmp.write_bytes(data)
        with self._lock:
            self._versions[path] = self._versions.get(path, 0) + 1
            repo = "/".join(Path(path).parts[:2])
            self._versions[repo] = self._versions.get(repo, 0) + 1
            os.replace(tmp, file)

    def truncate(self, path: str, size: int) -> None:
        """Keep the first ``size`` bytes of ``root/path`` (a new ETag)."""
        self.put(path, self.file(path).read_bytes()[:size])

    def etag(self, path: str, st: os.stat_result) -> str:
        key = f"{path}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}:{self._versions.get(path, 0)}"
        return '"' + hashlib.sha256(key.encode()).hexdigest() + '"'

    def commit(self, repo: str) -> str:
        return hashlib.sha1(f"{repo}@{self._versions.get(repo, 0)}".encode()).hexdigest()

    def check_repo(self, repo: str, revision: str) -> str | None:
        """``None``, or the Hub's error code for a missing repo or revision."""
        folder = self.file(repo)
        if folder is None or not folder.is_dir():
            return "RepoNotFound"
        if revision not in ("main", self.commit(repo)):
            return "RevisionNotFound"
        return None

    def entry(self, repo: str, path: str) -> dict | None:
        """The Hub's tree entry of ``path`` in ``repo``."""
        file = self.file(f"{repo}/{path}")
        if file is None or not file.exists():
            return None
        if file.is_dir():
            oid = hashlib.sha1(f"{repo}/{path}".encode()).hexdigest()
            return {"type": "directory", "oid": oid, "path": path}
        etag = self.etag(f"{repo}/{path}", file.stat())
        out = {"type": "file", "oid": etag[1:41], "size": file.stat().st_size, "path": path}
        if path.endswith(".safetensors"):
            out["lfs"] = {"oid": etag[1:-1], "size": out["size"], "pointerSize": 134}
        return out

    def entries(self, repo: str, sub: str, *, recursive: bool) -> list[dict]:
        folder = self.file(f"{repo}/{sub}" if sub else repo)
        found = folder.rglob("*") if recursive else folder.iterdir()
        names = sorted(p.relative_to(self.file(repo)).as_posix() for p in found)
        return [self.entry(repo, n) for n in names if not Path(n).name.startswith(".")]

    def error_body(self, status, code, message):
        body = json.dumps({"error": f"{code}: {message}"}).encode()
        return "application/json", body, [("X-Error-Code", code)]


def tls_context(folder: str | os.PathLike) -> tuple[ssl.SSLContext, Path]:
    """A server-side TLS context for 127.0.0.1 and the file of the authority that
    signed its certificate (written in ``folder``): a client trusts the server where
    ``SSL_CERT_FILE`` names that file (obstore's, through rustls's native roots;
    Python's ``ssl`` with ``cafile=``). Needs ``cryptography``."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def certificate(subject, issuer, key, signer, *, authority):
        made = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=7))
            .add_extension(x509.BasicConstraints(ca=authority, path_length=None), critical=True)
        )
        if not authority:  # rustls refuses an authority's certificate as the server's
            address = x509.IPAddress(ipaddress.ip_address("127.0.0.1"))
            made = made.add_extension(x509.SubjectAlternativeName([address]), critical=False)
        return made.sign(signer, hashes.SHA256())

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = certificate("meshinit test authority", "meshinit test authority", ca_key, ca_key,
                     authority=True)  # fmt: skip
    leaf = certificate("127.0.0.1", "meshinit test authority", key, ca_key, authority=False)
    folder = Path(folder)
    pem = serialization.Encoding.PEM
    (folder / "ca.pem").write_bytes(ca.public_bytes(pem))
    (folder / "server.pem").write_bytes(leaf.public_bytes(pem))
    (folder / "server.key").write_bytes(
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(folder / "server.pem", folder / "server.key")
    return context, folder / "ca.pem"


# --- S3: moto behind a counting proxy -------------------------------------------------

_HOP = {"connection", "keep-alive", "transfer-encoding", "expect", "te", "upgrade"}
_OWN = {"content-length", "server", "date"}  # what the proxy's answer sets itself
# conditions the proxy leaves to moto (botocore's x-amz-checksum-mode: ENABLED is served:
# an answer without a checksum header is not checked)
_NO_FAST = ("if-modified-since", "if-unmodified-since")


class _S3Handler(Handler):
    def route(self, method):
        owner: S3Server = self.owner  # type: ignore[assignment]
        url = urllib.parse.urlsplit(self.path)
        path = urllib.parse.unquote(url.path).lstrip("/")
        body = self.read_body()
        if self.answer_fault(method, path):
            return
        query = {k for k in urllib.parse.parse_qs(url.query, keep_blank_values=True)}
        fast = (
            owner.fast_reads
            and method in ("GET", "HEAD")
            and "/" in path.strip("/")
            and query <= {"x-id"}
            and not any(h in self.headers for h in _NO_FAST)
        )
        if fast and (obj := owner.cached(path)) is not None:
            headers, data = obj
            self.send_object(method, path, len(data), headers["etag"], _slicer(data), [
                (k, v) for k, v in headers.items()
                if k not in {"etag", "accept-ranges", "content-range", *_OWN}
                and not k.startswith("x-amz-checksum")
            ])  # fmt: skip
            return
        self.forward(method, url, path, body)
        if method in ("PUT", "POST", "DELETE"):
            owner.forget(path)

    def forward(self, method, url, path, body):
        owner: S3Server = self.owner  # type: ignore[assignment]
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
        if body or method in ("PUT", "POST"):
            headers["Content-Length"] = str(len(body))
        _as_s3(headers)
        # "%2D" is "-" (RFC 3986's unreserved characters), as GCS's client spells a
        # bucket name; moto compares names as sent
        path_ = _UNRESERVED.sub(lambda m: chr(int(m[1], 16)), url.path)
        target = path_ + (f"?{url.query}" if url.query else "")
        status, reply, data = owner.moto_request(method, target, body, headers)
        owner.record_received(Received(method, path, url.query, status, len(body)))
        span = None
        if status == 206 and (m := re.match(r"bytes (\d+)-(\d+)/", reply.get("content-range", ""))):
            span = (int(m[1]), int(m[2]) + 1)
        out = [(k, v) for k, v in reply.items() if k not in _HOP | _OWN]
        length = int(reply["content-length"]) if method == "HEAD" else None
        if span is not None:
            self.send(method, path, status, out, read=_slicer(data, span[0]), span=span)
        else:
            self.send(method, path, status, out, data, length=length)


def _as_s3(headers: dict) -> None:
    """GCS's XML API as moto takes it: the empty ``Bearer`` token that GCS's client
    sends with ``disable_oauth`` dropped (moto reads any Authorization as SigV4 and
    fails), and ``x-goog-`` copy headers given as S3's ``x-amz-`` ones."""
    for name in list(headers):
        if name.lower() == "authorization" and headers[name].startswith("Bearer"):
            del headers[name]
        elif name.lower().startswith("x-goog-copy-source"):
            headers["x-amz-" + name[len("x-goog-") :]] = headers.pop(name)


_UNRESERVED = re.compile(r"%(2[DdEe]|5[Ff]|7[Ee]|3[0-9]|[46][1-9A-Fa-f]|[57][0-9Aa])")


@dataclasses.dataclass(frozen=True)
class Received:
    """One request the proxy passed to moto, with the body it carried: ``path`` is
    ``bucket/key`` (decoded), ``query`` the raw query (``partNumber=1&uploadId=...``
    for a part of a multipart upload), ``status`` moto's answer, ``size`` the body's
    bytes. Requests a fault answered never reach moto and are not here."""

    method: str
    path: str
    query: str
    status: int
    size: int

    @property
    def part(self) -> int | None:
        """The part number of a multipart upload's part, else None."""
        found = re.search(r"(?:^|&)partNumber=(\d+)", self.query)
        return int(found[1]) if found and self.method == "PUT" else None


def _slicer(data: bytes, base: int = 0):
    view = memoryview(data)
    return lambda offset, n: view[offset - base : offset - base + n]


class S3Server(Server):
    """moto's S3 (``moto.server.ThreadedMotoServer``) on 127.0.0.1, reached through a
    proxy that counts and injects faults: clients talk to :attr:`url` (the proxy),
    which forwards every request to moto unchanged; paths are path-style
    (``bucket/key``), as s3fs and obstore send them to an endpoint URL.

    moto answers a ranged GET by copying the whole object (``FakeKey.value``): about
    0.15 s per request at 256 MiB here, whatever the range. With ``fast_reads=True``
    the proxy answers plain GETs and HEADs of objects itself, from one copy per object
    version fetched from moto on first read (moto's headers, ``Range``/``If-*`` as in
    :meth:`Handler.send_object`); writes through the proxy or :meth:`put` drop the copy.
    Requests with a query (``versionId``, ``partNumber``, listings) or other
    conditions always go to moto. Benchmarks want it; tests keep moto's own answers.
    """

    handler = _S3Handler
    region = "us-east-1"
    key_id = "testing"
    secret = "testing"

    def __init__(self, *, fast_reads: bool = False) -> None:
        import boto3
        from moto.server import ThreadedMotoServer

        self.fast_reads = fast_reads
        # moto's werkzeug logs a line per request to stderr; its warnings stay
        logging.getLogger("werkzeug").setLevel(logging.WARNING)
        self._moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._moto.start()
        host, port = self._moto.get_host_and_port()
        self.moto_url = f"http://{host}:{port}"
        self.client = boto3.client(
            "s3",
            endpoint_url=self.moto_url,
            region_name=self.region,
            aws_access_key_id=self.key_id,
            aws_secret_access_key=self.secret,
        )  # straight to moto: what the tests set up is not counted
        self._local = threading.local()
        self._cache: dict[str, tuple[dict, bytes]] = {}
        self._cache_lock = threading.Lock()
        self._received: list[Received] = []
        self._received_lock = threading.Lock()
        super().__init__()

    def reset(self) -> None:
        """Zero the counters (:attr:`received` too) and remove every fault."""
        super().reset()
        with self._received_lock:
            self._received.clear()

    def record_received(self, received: Received) -> None:
        with self._received_lock:
            self._received.append(received)

    @property
    def received(self) -> list[Received]:
        """Every request that reached moto, with the bytes of its body, in order."""
        with self._received_lock:
            return list(self._received)

    def bytes_received(self, path: str) -> int:
        """Body bytes of the writes of one object that moto accepted (2xx): a whole
        object's PUT and its multipart upload's parts."""
        return sum(
            r.size
            for r in self.received
            if r.path == path and r.method == "PUT" and 200 <= r.status < 300
        )

    def stop(self) -> None:
        super().stop()
        self._moto.stop()

    @property
    def env(self) -> dict[str, str]:
        """Where boto3, s3fs and obstore find the endpoint and the fake keys."""
        return {
            "AWS_ENDPOINT_URL": self.url,
            "AWS_ACCESS_KEY_ID": self.key_id,
            "AWS_SECRET_ACCESS_KEY": self.secret,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_REGION": self.region,
            "AWS_ALLOW_HTTP": "true",  # obstore refuses http:// endpoints otherwise
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def s3fs_options(self) -> dict:
        """``s3fs.S3FileSystem(**...)`` for this server."""
        return {"endpoint_url": self.url, "key": self.key_id, "secret": self.secret}

    def obstore_options(self, key_id: str | None = None) -> dict:
        """``obstore.store.S3Store(bucket, **...)`` for this server, signing with
        ``key_id`` (moto takes any access key id with any secret) where given: the
        counters then tell this client's requests apart (``Served.client``)."""
        return {
            "endpoint": self.url,
            "access_key_id": key_id or self.key_id,
            "secret_access_key": self.secret,
            "region": self.region,
            "client_options": {"allow_http": True},
        }

    def bucket(
        self, name: str | None = None, *, public: bool = False, writable: bool = False
    ) -> str:
        """Create a bucket (a fresh name by default) and return its name; ``public``:
        anyone may read its objects without credentials (a bucket policy);
        ``writable``: anyone may also write and delete them (what a ``gs://`` client
        without a token needs to write, :meth:`gcs_env`)."""
        name = name or f"test-{uuid.uuid4().hex[:12]}"
        self.client.create_bucket(Bucket=name)
        if public or writable:
            # moto asks a HEAD for s3:HeadObject, which S3 itself folds into GetObject
            actions = ["s3:GetObject", "s3:HeadObject"]
            if writable:
                actions += ["s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"]
            read = {"Effect": "Allow", "Principal": "*", "Action": actions}
            read["Resource"] = f"arn:aws:s3:::{name}/*"
            policy = {"Version": "2012-10-17", "Statement": [read]}
            self.client.put_bucket_policy(Bucket=name, Policy=json.dumps(policy))
        return name

    def gcs_env(self, folder: str | os.PathLike) -> dict[str, str]:
        """Where obstore's GCS client (``gs://``) finds this server: a service account
        file (written in ``folder``) whose ``gcs_base_url`` is this proxy and whose
        ``disable_oauth`` sends no token, as for a public bucket. GCS's XML API, which
        that client speaks (``?list-type=2`` listings, HEAD, ranged GETs with
        ``If-Match``), is S3's interoperable API, and moto answers it; read from
        :meth:`bucket` ``(public=True)``; writes (PUT, XML multipart uploads, copies
        with ``x-goog-copy-source``, DELETE) go to a :meth:`bucket` ``(writable=True)``.
        The client percent-encodes ``-`` in names, which the proxy decodes."""
        file = Path(folder) / "gcs-service-account.json"
        fields = {"gcs_base_url": self.url, "disable_oauth": True}
        key = {"client_email": "", "private_key": "", "private_key_id": ""}  # unused
        file.write_text(json.dumps({**fields, **key}))
        return {"GOOGLE_SERVICE_ACCOUNT": str(file), "GOOGLE_ALLOW_HTTP": "true"}

    def put(self, path: str, data: bytes) -> None:
        """Store ``data`` at ``bucket/key`` straight in moto (not counted)."""
        bucket, _, key = path.partition("/")
        self.client.put_object(Bucket=bucket, Key=key, Body=data)
        self.forget(path)

    def truncate(self, path: str, size: int) -> None:
        """Keep the object's first ``size`` bytes (a new ETag, as a re-upload)."""
        bucket, _, key = path.partition("/")
        data = self.client.get_object(Bucket=bucket, Key=key)["Body"].read()
        self.put(path, data[:size])

    def etag(self, path: str) -> str:
        bucket, _, key = path.partition("/")
        return self.client.head_object(Bucket=bucket, Key=key)["ETag"]

    def forget(self, path: str) -> None:
        with self._cache_lock:
            bucket = path.split("/")[0]
            for cached in [p for p in self._cache if p == path or p.split("/")[0] == bucket]:
                del self._cache[cached]

    def cached(self, path: str) -> tuple[dict, bytes] | None:
        """moto's headers and bytes of the object at ``path``, or None if it has none."""
        with self._cache_lock:
            if path not in self._cache:
                bucket, _, key = path.partition("/")
                try:
                    got = self.client.get_object(Bucket=bucket, Key=key)
                except self.client.exceptions.ClientError:
                    return None
                headers = dict(got["ResponseMetadata"]["HTTPHeaders"])
                self._cache[path] = headers, got["Body"].read()
            return self._cache[path]

    def moto_request(self, method, target, body, headers):
        """One request to moto on this thread's connection: status, headers, body."""
        import http.client

        for attempt in (0, 1):
            conn = getattr(self._local, "conn", None)
            if conn is None:
                conn = self._local.conn = http.client.HTTPConnection(
                    self.moto_url.removeprefix("http://"), timeout=60
                )
            try:
                conn.request(method, target, body=body or None, headers=headers)
                reply = conn.getresponse()
                data = reply.read()
                return reply.status, {k.lower(): v for k, v in reply.getheaders()}, data
            except (ConnectionError, http.client.HTTPException):
                conn.close()
                self._local.conn = None
                if attempt:
                    raise

    def error_body(self, status, code, message):
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{escape(code)}</Code><Message>{escape(message)}</Message>"
            f"<RequestId>{uuid.uuid4().hex}</RequestId></Error>"
        ).encode()
        return "application/xml", body, []


# --- fixtures -----------------------------------------------------------------------


class ServedElsewhere:
    """A :class:`FileServer` over ``root`` in a child process, so that its threads (one
    per open connection) are not this process's, as a real server's are not: what a
    test counts of this process's threads is then the client's alone. Faults are set
    by a line on the child's stdin (:meth:`fail_data`); a context manager."""

    def __init__(self, root: str | os.PathLike) -> None:
        import subprocess
        import sys

        here = os.path.dirname(os.path.abspath(__file__))
        code = (
            f"import sys; sys.path.insert(0, {here!r}); "
            f"import storage_servers as s; s._serve({str(root)!r})"
        )
        self._child = subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._child.stdout is not None
        self.url = self._child.stdout.readline().strip()
        assert self.url.startswith("http://"), self.url

    def url_for(self, path: str) -> str:
        return f"{self.url}/{urllib.parse.quote(path)}"

    def _say(self, line: str) -> None:
        assert self._child.stdin is not None and self._child.stdout is not None
        self._child.stdin.write(line + "\n")
        self._child.stdin.flush()
        assert self._child.stdout.readline().strip() == "ok"

    def fail_data(self, path: str) -> None:
        """From now on, every GET of ``path`` after the next one (a load's header read)
        is answered 403: a load that fails mid-fetch."""
        self._say(f"fail {path}")

    def stall_data(self, path: str) -> None:
        """From now on, every GET of ``path`` after the next one gets no answer (for 30
        s): a load that hangs mid-fetch, until Ctrl-C."""
        self._say(f"stall {path}")

    def reset(self) -> None:
        self._say("reset")

    def __enter__(self) -> ServedElsewhere:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._child.kill()
        self._child.wait(timeout=10)


def _serve(root: str) -> None:
    """The child of :class:`ServedElsewhere`: serves ``root`` until its stdin closes."""
    import sys

    with FileServer(root) as server:
        print(server.url, flush=True)
        for line in sys.stdin:
            command, _, path = line.strip().partition(" ")
            server.reset()
            if command == "fail":
                server.fail(path, 403, times=1 << 30, after=1)
            elif command == "stall":
                server.stall(path, seconds=30, times=1 << 30, after=1)
            print("ok", flush=True)


_CLEARED = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_ENDPOINT_URL_S3")
_shared: dict[str, Any] = {}


@pytest.fixture(name="s3_server")
def s3_server_fixture(request, monkeypatch):
    """The session's :class:`S3Server` (moto's own answers), counters and faults reset,
    its :attr:`~S3Server.env` set for this test; make buckets with ``.bucket()``."""
    if "s3" not in _shared:
        _shared["s3"] = S3Server()
        request.config.add_cleanup(lambda: _shared.pop("s3").stop())
    server = _shared["s3"]
    server.reset()
    for name in _CLEARED:
        monkeypatch.delenv(name, raising=False)
    for name, value in server.env.items():
        monkeypatch.setenv(name, value)
    yield server
    server.reset()


@pytest.fixture(name="file_server")
def file_server_fixture(tmp_path, monkeypatch):
    """A :class:`FileServer` over a fresh folder (``.root``), ``HF_ENDPOINT`` set to it."""
    root = tmp_path / "served"
    root.mkdir()
    with FileServer(root) as server:
        for name, value in server.env.items():
            monkeypatch.setenv(name, value)
        yield server


@pytest.fixture(name="https_server")
def https_server_fixture(tmp_path, tmp_path_factory, monkeypatch):
    """A :class:`FileServer` over HTTPS (a fresh folder, ``.root``), its test authority
    (one for the session) trusted through ``SSL_CERT_FILE``, ``HF_ENDPOINT`` set to it."""
    pytest.importorskip("cryptography")
    if "tls" not in _shared:
        _shared["tls"] = tls_context(tmp_path_factory.mktemp("tls"))
    context, authority = _shared["tls"]
    monkeypatch.setenv("SSL_CERT_FILE", str(authority))
    root = tmp_path / "served"
    root.mkdir()
    with FileServer(root, tls=context) as server:
        for name, value in server.env.items():
            monkeypatch.setenv(name, value)
        yield server


@pytest.fixture(name="gcs")
def gcs_fixture(s3_server, tmp_path, monkeypatch):
    """The S3 server as GCS's XML API for ``gs://`` (see :meth:`S3Server.gcs_env`): read
    from a ``bucket(public=True)``, write to a ``bucket(writable=True)``."""
    for name, value in s3_server.gcs_env(tmp_path).items():
        monkeypatch.setenv(name, value)
    return s3_server


__all__ = [
    "FileServer",
    "Received",
    "S3Server",
    "Served",
    "ServedElsewhere",
    "file_server_fixture",
    "gcs_fixture",
    "https_server_fixture",
    "s3_server_fixture",
    "tls_context",
]
