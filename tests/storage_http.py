"""What both test storage servers share (tests/storage_servers.py): the counters, the
faults, and one HTTP/1.1 handler that serves an object's bytes honouring ``Range``,
``If-Match``, ``If-None-Match`` and ``If-Range`` as S3 and the Hub's file servers do.

Nothing here listens by itself: :class:`Server` runs a handler class on 127.0.0.1 in a
background thread, and the two servers subclass it.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
import ssl
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# The largest piece of an object read into memory at once while answering.
CHUNK = 8 << 20


@dataclasses.dataclass(frozen=True)
class Served:
    """One answered request.

    ``path`` is the object's path (``bucket/key`` on S3, the file's path under the
    served folder on the file server) for object reads, else the URL path; ``sent`` the
    body bytes written (headers not counted; a dropped answer counts what went out,
    and a client that went away what reached the socket);
    ``range`` the half-open byte range a 206 answer carried; ``target`` the request's
    target as the client sent it (path and query, not decoded: a doubled slash shows);
    ``authorization`` the credentials it sent, if any; ``client`` the access key id
    of a SigV4-signed request (:func:`client_of`), which tells apart processes that
    each sign with their own key; ``received`` the bytes of the request's body (what an
    upload sent).
    """

    method: str
    path: str
    status: int
    sent: int
    range: tuple[int, int] | None = None
    target: str | None = None
    authorization: str | None = None  # the request's Authorization header
    client: str | None = None
    received: int = 0  # the request's body bytes (an upload's)

    @property
    def span(self) -> tuple[int, int] | None:
        """The object's bytes this answer sent, half-open: a 206's range (cut to what
        went out), ``(0, sent)`` for a 200 of a whole object, None for anything else."""
        if self.status == 206 and self.range is not None:
            return self.range[0], self.range[0] + self.sent
        if self.status == 200 and self.method == "GET":
            return 0, self.sent
        return None


_CREDENTIAL = re.compile(r"Credential=([^/,\s]+)/")


def client_of(authorization: str | None) -> str | None:
    """The access key id of a SigV4 ``Authorization`` header (``AWS4-HMAC-SHA256
    Credential=<key id>/<date>/<region>/s3/aws4_request, ...``), else None."""
    found = _CREDENTIAL.search(authorization or "")
    return found[1] if found else None


class Counters:
    """What a server sent, request by request (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._log: list[Served] = []

    def record(self, served: Served) -> int:
        """Log an answer; returns its place for :meth:`amend`."""
        with self._lock:
            self._log.append(served)
            return len(self._log) - 1

    def amend(self, at: int, sent: int) -> None:
        """Correct the bytes an answer sent (a write that failed part way)."""
        with self._lock:
            if at < len(self._log):
                self._log[at] = dataclasses.replace(self._log[at], sent=sent)

    def reset(self) -> None:
        with self._lock:
            self._log.clear()

    @property
    def log(self) -> list[Served]:
        """Every answer so far, in the order they finished."""
        with self._lock:
            return list(self._log)

    @property
    def requests(self) -> int:
        return len(self.log)

    @property
    def bytes_sent(self) -> int:
        """Body bytes of every answer, error bodies and listings included."""
        return sum(s.sent for s in self.log)

    @property
    def ranges(self) -> list[tuple[str, int, int]]:
        """``(path, start, stop)`` of every 206 answer, half-open, in order."""
        return [(s.path, *s.range) for s in self.log if s.range is not None]

    def bytes_for(self, path: str) -> int:
        """Body bytes of the 200 and 206 answers for one object."""
        return sum(s.sent for s in self.log if s.path == path and s.status in (200, 206))

    @property
    def clients(self) -> set[str | None]:
        """The access key ids that sent requests (None: an unsigned request)."""
        return {s.client for s in self.log}

    def spans(self, client: str | None = None) -> list[tuple[str, int, int]]:
        """``(path, start, stop)`` of the object bytes each GET answer sent (200 and
        206, what went out), in order; given ``client``, only that key id's."""
        return [
            (s.path, *s.span)
            for s in self.log
            if s.span is not None and (client is None or s.client == client)
        ]

    def bytes_by_client(
        self, data_from: Mapping[str, int] | None = None, *, header_reads: bool = True
    ) -> dict[str | None, int]:
        """Object bytes sent to each client (200 and 206 GETs). With ``data_from``
        (an object's path to the offset where its data starts, e.g. a safetensors
        file's ``8 + header length``), only the bytes at or past that offset, of those
        objects only. ``header_reads=False`` leaves out the answers that start at
        offset 0: a safetensors header read, which may run on into the data (a
        reader guesses the header's length), where a read of tensor data never
        starts. Both give the tensor data each client fetched, without its header
        reads."""
        out: dict[str | None, int] = {}
        for s in self.log:
            if s.span is None or (not header_reads and s.span[0] == 0):
                continue
            start, stop = s.span
            if data_from is not None:
                if s.path not in data_from:
                    continue
                start = max(start, data_from[s.path])
            out[s.client] = out.get(s.client, 0) + max(stop - start, 0)
        return out


@dataclasses.dataclass(eq=False)
class Fault:
    """A fault a server injects into requests matching ``method`` and ``path`` (an
    fnmatch pattern on the object's path), skipping the first ``after`` of them and then
    firing ``times`` times; ``fired`` counts how often it did. Kinds:

    - ``status``: answer ``status`` with the protocol's error body, touching nothing;
    - ``drop``: send the headers and ``keep`` body bytes (default half the body), then
      cut the connection;
    - ``replace``: store ``data`` as the object before answering (a new ETag), once;
    - ``stall``: answer nothing for ``seconds``, then close the connection (a server
      that accepted the request and hangs).

    With ``client`` (an access key id), only that client's requests match (and
    count toward ``after``).
    """

    kind: str
    path: str = "*"
    method: str = "GET"
    times: int = 1
    after: int = 0
    status: int = 503
    keep: int | None = None
    data: bytes | None = None
    seconds: float = 0.0
    client: str | None = None
    seen: int = 0
    fired: int = 0

    @property
    def done(self) -> bool:
        return self.fired >= self.times


class Unsatisfiable(Exception):
    """A ``Range`` that starts at or past the object's end (answered 416)."""


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """The half-open byte range ``Range: bytes=a-b`` asks of an object of ``size``
    bytes, or ``None`` to send the whole object: no header, one that does not parse, or
    several ranges (S3 answers those with the whole object too). ``bytes=a-`` runs to
    the end, ``bytes=-n`` is the last n bytes, and an end past the object is clamped.

    Raises:
        Unsatisfiable: the range starts at or past the end, or asks for the last 0 bytes.
    """
    if not header or not header.strip().startswith("bytes=") or "," in header:
        return None
    first, _, last = header.strip()[len("bytes=") :].partition("-")
    try:
        start = int(first) if first.strip() else None
        end = int(last) if last.strip() else None
    except ValueError:
        return None
    if start is None:
        if end is None:
            return None
        if end == 0:
            raise Unsatisfiable
        return max(size - end, 0), size
    if start >= size:
        raise Unsatisfiable
    if end is not None and end < start:
        return None
    return start, size if end is None else min(end + 1, size)


def _etags(header: str) -> list[str]:
    return [t.strip().removeprefix("W/") for t in header.split(",")]


class Handler(BaseHTTPRequestHandler):
    """HTTP/1.1 with keep-alive; subclasses implement ``route(method)``."""

    protocol_version = "HTTP/1.1"
    timeout = 60  # an idle keep-alive connection's thread ends after this

    @property
    def owner(self) -> Server:
        return self.server.owner  # type: ignore[attr-defined]

    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        pass

    def handle_one_request(self):
        try:
            super().handle_one_request()
        except (ConnectionError, TimeoutError, ssl.SSLError):
            self.close_connection = True

    def do_GET(self):
        self.route("GET")

    def do_HEAD(self):
        self.route("HEAD")

    def do_PUT(self):
        self.route("PUT")

    def do_POST(self):
        self.route("POST")

    def do_DELETE(self):
        self.route("DELETE")

    def route(self, method: str) -> None:
        raise NotImplementedError

    def read_body(self) -> bytes:
        """The request's body, by ``Content-Length`` or chunked transfer coding."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            parts = []
            while size := int(self.rfile.readline().split(b";")[0], 16):
                parts.append(self.rfile.read(size))
                self.rfile.readline()
            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                pass
            self.received = sum(map(len, parts))
            return b"".join(parts)
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.received = len(body)
        return body

    def send(
        self,
        method: str,
        path: str,
        status: int,
        headers: Iterable[tuple[str, str]],
        body: bytes | memoryview = b"",
        *,
        length: int | None = None,
        read: Callable[[int, int], bytes] | None = None,
        span: tuple[int, int] | None = None,
    ) -> None:
        """Answer: the status, the headers, a ``Content-Length`` (``length``, else the
        body's), and on GET the body, either ``body`` or ``read(offset, n)`` over
        ``span``; a matching ``drop`` fault cuts it short. Records the answer. Waits
        the server's :attr:`~Server.latency` first."""
        if self.owner.latency:
            time.sleep(self.owner.latency)
        total = len(body) if read is None else span[1] - span[0]
        length = total if length is None else length
        drop = self.take("drop", method, path) if method == "GET" and total else None
        keep = total if drop is None else min(total // 2 if drop.keep is None else drop.keep, total)
        # Recorded before anything goes out, so a client that has its answer finds it
        # counted; a write that fails corrects the count.
        keep = 0 if method == "HEAD" else keep
        ranged = span if status == 206 else None
        auth = self.headers.get("Authorization")
        at = self.owner.counters.record(
            Served(
                method,
                path,
                status,
                keep,
                ranged,
                self.path,
                auth,
                client_of(auth),
                getattr(self, "received", 0),
            )
        )
        self.received = 0
        sent = 0
        try:
            self.send_response(status)
            for name, value in headers:
                self.send_header(name, value)
            self.send_header("Content-Length", str(length))
            self.end_headers()
            while sent < keep:
                n = min(CHUNK, keep - sent)
                piece = (
                    memoryview(body)[sent : sent + n] if read is None else read(span[0] + sent, n)
                )
                self.wfile.write(piece)
                sent += len(piece)
        finally:
            if sent != keep:
                self.owner.counters.amend(at, sent)
        if drop is not None:
            self.close_connection = True  # the server closes the socket after this answer

    def send_object(
        self,
        method: str,
        path: str,
        size: int,
        etag: str,
        read: Callable[[int, int], bytes],
        headers: Iterable[tuple[str, str]] = (),
    ) -> None:
        """Answer a GET or HEAD of an object of ``size`` bytes and strong ``etag`` (with
        its quotes), its bytes by ``read(offset, n)``: ``If-Match`` that fails is 412,
        ``If-None-Match`` that matches is 304, ``Range`` gives 206 with
        ``Content-Range`` (416 past the end), and ``If-Range`` with another ETag sends
        the whole object."""
        if etag is None:  # a server that gives no ETag: no condition on one holds
            return self.send_unconditional(method, path, size, read, headers)
        headers = [("ETag", etag), ("Accept-Ranges", "bytes"), *headers]
        if (want := self.headers.get("If-Match")) and "*" not in want:
            if etag not in _etags(want):
                return self.error(method, path, 412, "PreconditionFailed", "ETag differs")
        if (want := self.headers.get("If-None-Match")) and ("*" in want or etag in _etags(want)):
            return self.send(method, path, 304, headers)
        try:
            span = parse_range(self.headers.get("Range"), size)
        except Unsatisfiable:
            return self.error(
                method, path, 416, "InvalidRange", "The requested range is not satisfiable",
                [("Content-Range", f"bytes */{size}")],
            )  # fmt: skip
        if (cond := self.headers.get("If-Range")) and cond.strip() != etag:
            span = None
        if span is None:
            return self.send(method, path, 200, headers, read=read, span=(0, size))
        start, stop = span
        headers.append(("Content-Range", f"bytes {start}-{stop - 1}/{size}"))
        self.send(method, path, 206, headers, read=read, span=span)

    def send_unconditional(self, method, path, size, read, headers) -> None:
        """A GET or HEAD answered with ``Range`` honoured and no ETag (``If-*`` on one
        ignored, as such a server ignores them)."""
        headers = [("Accept-Ranges", "bytes"), *headers]
        try:
            span = parse_range(self.headers.get("Range"), size)
        except Unsatisfiable:
            return self.error(method, path, 416, "InvalidRange", "not satisfiable")
        if span is None:
            return self.send(method, path, 200, headers, read=read, span=(0, size))
        headers.append(("Content-Range", f"bytes {span[0]}-{span[1] - 1}/{size}"))
        self.send(method, path, 206, headers, read=read, span=span)

    def error(
        self,
        method: str,
        path: str,
        status: int,
        code: str,
        message: str,
        headers: Iterable[tuple[str, str]] = (),
    ) -> None:
        """An error answer in the server's own dialect (:meth:`Server.error_body`)."""
        content_type, body, extra = self.owner.error_body(status, code, message)
        headers = [("Content-Type", content_type), *extra, *headers]
        self.send(method, path, status, headers, b"" if method == "HEAD" else body)

    def take(self, kind: str, method: str, path: str) -> Fault | None:
        """:meth:`Server.take` for this request, its client (key id) included."""
        client = client_of(self.headers.get("Authorization"))
        return self.owner.take(kind, method, path, client)

    def answer_fault(self, method: str, path: str) -> bool:
        """Apply a ``replace`` fault, then answer a ``status`` one; True if answered."""
        if (fault := self.take("replace", method, path)) is not None:
            self.owner.put(path, fault.data)
        if (fault := self.take("stall", method, path)) is not None:
            time.sleep(fault.seconds)
            self.close_connection = True
            return True
        if (fault := self.take("status", method, path)) is not None:
            codes = {403: "AccessDenied", 404: "NoSuchKey", 416: "InvalidRange"}
            code = codes.get(fault.status, "SlowDown" if fault.status == 503 else "InternalError")
            self.error(method, path, fault.status, code, f"injected fault {fault.status}")
            return True
        return False


class _HTTPServer(ThreadingHTTPServer):
    # socketserver's default backlog of 5 drops the SYNs of a client that opens 10 or
    # more connections at once, and each dropped one costs the client a second
    request_queue_size = 128
    tls: ssl.SSLContext | None = None

    def finish_request(self, request, client_address):
        if self.tls is not None:  # the handshake in the request's own thread
            try:
                request = self.tls.wrap_socket(request, server_side=True)
            except (ssl.SSLError, ConnectionError, TimeoutError):
                return  # a client that refuses the certificate: nothing to answer
        super().finish_request(request, client_address)


class Server:
    """A ``Handler`` subclass served on 127.0.0.1 (a free port) from a background
    thread, with its :class:`Counters` and faults; a context manager. With ``tls``
    (a server-side ``ssl.SSLContext``) it speaks HTTPS."""

    handler: type[Handler] = Handler
    latency = 0.0
    """Seconds each answer waits before its first byte (an object store's time to
    first byte is tens of milliseconds; localhost's is well under one)."""

    def __init__(self, *, ports: int = 1, tls: ssl.SSLContext | None = None) -> None:
        self.tls = tls
        self.counters = Counters()
        self.faults: list[Fault] = []
        self._fault_lock = threading.Lock()
        self._httpds = []
        for _ in range(ports):  # more than one: the same server at other origins
            httpd = _HTTPServer(("127.0.0.1", 0), self.handler)
            httpd.daemon_threads = True
            httpd.owner = self  # type: ignore[attr-defined]
            httpd.tls = tls
            threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True).start()
            self._httpds.append(httpd)

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT`` (``https://`` with ``tls``), no trailing slash."""
        return self.urls[0]

    @property
    def urls(self) -> list[str]:
        scheme = "https" if self.tls is not None else "http"
        return [f"{scheme}://{h.server_address[0]}:{h.server_address[1]}" for h in self._httpds]

    def stop(self) -> None:
        for httpd in self._httpds:
            httpd.shutdown()
            httpd.server_close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

    def reset(self) -> None:
        """Zero the counters and remove every fault."""
        self.counters.reset()
        with self._fault_lock:
            self.faults.clear()

    # faults

    def inject(self, kind: str, path: str = "*", **fields) -> Fault:
        """Add a :class:`Fault` (see its fields) and return it."""
        fault = Fault(kind, path, **fields)
        with self._fault_lock:
            self.faults.append(fault)
        return fault

    def fail(self, path: str = "*", status: int = 503, *, times: int = 1, **fields) -> Fault:
        """The next ``times`` matching requests get ``status`` (S3's error body)."""
        return self.inject("status", path, status=status, times=times, **fields)

    def drop(self, path: str = "*", *, keep: int | None = None, times: int = 1, **fields):
        """The next ``times`` matching GETs are cut after ``keep`` body bytes (default
        half the body), after the headers promised all of it."""
        return self.inject("drop", path, keep=keep, times=times, **fields)

    def stall(self, path: str = "*", *, seconds: float = 30.0, times: int = 1, **fields) -> Fault:
        """The next ``times`` matching requests get no answer for ``seconds``."""
        return self.inject("stall", path, seconds=seconds, times=times, **fields)

    def replace_after(self, path: str, data: bytes, after: int = 1, **fields) -> Fault:
        """The object at ``path`` becomes ``data`` (a new ETag) before the matching
        request that follows the first ``after`` (GET by default; ``method="*"`` counts
        HEADs too)."""
        return self.inject("replace", path, data=data, after=after, **fields)

    def take(self, kind: str, method: str, path: str, client: str | None = None) -> Fault | None:
        """The first live fault of ``kind`` this request (from the key id ``client``)
        triggers, counted as fired."""
        with self._fault_lock:
            for fault in self.faults:
                if fault.kind != kind or fault.done:
                    continue
                if not fnmatch.fnmatchcase(method, fault.method):
                    continue
                if not fnmatch.fnmatchcase(path, fault.path):
                    continue
                if fault.client is not None and fault.client != client:
                    continue
                fault.seen += 1
                if fault.seen > fault.after:
                    fault.fired += 1
                    return fault
        return None

    # what subclasses provide

    def put(self, path: str, data: bytes) -> None:
        raise NotImplementedError

    def error_body(self, status: int, code: str, message: str):
        """``(content_type, body, extra_headers)`` of an error answer."""
        return "text/plain", f"{code}: {message}".encode(), []
