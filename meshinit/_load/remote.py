"""Checkpoints where they live: object storage and the Hugging Face Hub, by ranges.

``s3://bucket/prefix/``, ``gs://bucket/prefix/``, ``hf://org/model`` (``@revision``
as the Hub's client spells it, then an optional folder) and ``https://`` URLs of
single files. Every object is reached through ``obstore`` (the Rust ``object_store``
crate: one client for S3, GCS and HTTP, with retries and backoff on transient
failures, conditional reads, and concurrency outside the GIL); the Hub's listing
and revision through ``huggingface_hub``. Each is an optional extra, named where it
is missing.

An object is known by its size and its ETag (or version) when listed; every later
read is conditional on that ETag (``If-Match``), and every reply's ETag and size are
compared with it, so an object replaced between the check and the read is refused,
as a rewritten local file is. A Hub revision is resolved to its commit first, and
the files are read at that commit.
"""

from __future__ import annotations

import dataclasses
import io
import os
import re
import struct
import tempfile
import time
import urllib.parse
from collections.abc import Mapping
from typing import Any

from .._errors import Problem
from . import header as _header

URL = re.compile(r"^(s3|gs|hf|https?)://", re.IGNORECASE)
SCHEMES = {"s3": "s3", "gs": "gcs", "hf": "hf", "https": "remote", "http": "remote"}

FIRST_READ = 1 << 16
"""The header's first ranged read: the length field and, for most checkpoints, the
whole header; a longer header takes a second read of the rest."""

ATTEMPTS = 4
"""Reads of one range before a transient failure (a dropped connection mid-body, a
short reply) is final; obstore itself retries 5xx replies and failed connections."""

CONCURRENCY = 16
"""Ranged reads in flight at once, per process."""


def is_url(files: Any) -> bool:
    return isinstance(files, str) and URL.match(files) is not None


@dataclasses.dataclass(frozen=True)
class Remote:
    """One object: where it is, and who it was when listed."""

    url: str  # as messages name it
    key: str  # its path in the store
    size: int
    etag: str | None
    store: Any = dataclasses.field(compare=False, hash=False, repr=False)

    @property
    def name(self) -> str:
        return self.key.rsplit("/", 1)[-1]

    def __str__(self) -> str:
        return self.url


class Permanent(Exception):
    """A read that another try would not mend: what is wrong, and the fix."""


def _import(module: str, scheme: str) -> Any:
    try:
        return __import__(module, fromlist=["_"])
    except ImportError as e:
        extra = SCHEMES.get(scheme, "remote")
        raise ImportError(
            f"meshinit.safetensors reads {scheme}:// URLs with {module.split('.')[0]}: "
            f"pip install 'meshinit[{extra}]'"
        ) from e


@dataclasses.dataclass
class Folder:
    """What a URL names: its objects, and the folder's index where it has one."""

    objects: list[Remote]
    index: Remote | None
    problems: list[Problem]


def listing(url: str, options: Mapping[str, Any] | None) -> Folder:
    """The ``*.safetensors`` objects ``url`` names (one file, or a folder's), hidden
    ones left out, and the folder's ``model.safetensors.index.json``."""
    scheme = url.split("://", 1)[0].lower()
    options = dict(options or {})
    try:
        if scheme == "hf":
            return _hub(url, options)
        if scheme in ("http", "https"):
            return _single_http(url, options)
        return _bucket(url, scheme, options)
    except ImportError:
        raise
    except Permanent as e:
        return Folder([], None, [Problem(url, str(e))])
    except Exception as e:  # noqa: BLE001 - the client's own error, named
        return Folder([], None, [Problem(url, f"cannot be listed: {_said(e)}")])


def _said(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:300]}"


def _bucket(url: str, scheme: str, options: dict[str, Any]) -> Folder:
    obstore = _import("obstore", scheme)
    from obstore.store import from_url

    parts = urllib.parse.urlsplit(url)
    root = f"{parts.scheme}://{parts.netloc}"
    prefix = parts.path.lstrip("/")
    store = from_url(root, **options)
    if prefix.endswith(".safetensors"):
        return Folder([_head(obstore, store, root, prefix)], None, [])
    prefix = prefix.rstrip("/")
    found: list[Remote] = []
    for batch in obstore.list(store, prefix=prefix or None):
        for meta in batch:
            key = str(meta["path"])
            rest = key[len(prefix) :].lstrip("/") if prefix else key
            if "/" in rest or rest.startswith("."):
                continue
            if rest == _INDEX or rest.endswith(".safetensors"):
                size, etag = int(meta["size"]), meta.get("e_tag")
                found.append(Remote(f"{root}/{key}", key, size, etag, store))
    return _folder(url, found, "holds no *.safetensors object: check the URL")


def _folder(url: str, found: list[Remote], empty: str) -> Folder:
    """The folder's files, its index apart; a folder with neither is a problem."""
    index = next((r for r in found if r.name == _INDEX), None)
    files = sorted((r for r in found if r.name != _INDEX), key=lambda r: r.key)
    return Folder(files, index, [] if files or index else [Problem(url, empty)])


_INDEX = "model.safetensors.index.json"


def _head(obstore: Any, store: Any, root: str, key: str) -> Remote:
    try:
        meta = obstore.head(store, key)
    except Exception as e:  # noqa: BLE001
        raise Permanent(_why(e)) from e
    return Remote(f"{root}/{key}", key, int(meta["size"]), meta.get("e_tag"), store)


def _single_http(url: str, options: dict[str, Any]) -> Folder:
    obstore = _import("obstore", "https")
    from obstore.store import HTTPStore

    base, _, name = url.rpartition("/")
    if not name.endswith(".safetensors"):
        raise Permanent(
            "an https:// URL names one .safetensors file (a folder cannot be listed over "
            "plain HTTP); give each file's URL, or an hf:// or bucket URL"
        )
    store = HTTPStore.from_url(base + "/", **options)
    made = _head(obstore, store, base, name)
    return Folder([dataclasses.replace(made, url=url)], None, [])


def _hub(url: str, options: dict[str, Any]) -> Folder:
    """``hf://org/model[@revision][/folder]``: the revision resolved to its commit,
    then its files read at that commit through the Hub's resolve URLs."""
    hub = _import("huggingface_hub", "hf")
    obstore = _import("obstore", "hf")
    from obstore.store import HTTPStore

    rest = url.split("://", 1)[1]
    pieces = rest.split("/")
    if len(pieces) < 2 or not pieces[0] or not pieces[1]:
        raise Permanent("an hf:// URL names a repository: hf://org/model[@revision]")
    org, model = pieces[0], pieces[1]
    revision = None
    if "@" in model:
        model, revision = model.split("@", 1)
        revision = urllib.parse.unquote(revision)
    folder = "/".join(p for p in pieces[2:] if p)
    endpoint = options.pop("endpoint", None) or os.environ.get("HF_ENDPOINT")
    endpoint = (endpoint or "https://huggingface.co").rstrip("/")
    token = options.pop("token", None)
    api = hub.HfApi(endpoint=endpoint, token=token)
    repo = f"{org}/{model}"
    try:
        commit = api.model_info(repo, revision=revision).sha or revision or "main"
        tree = list(api.list_repo_tree(repo, path_in_repo=folder or None, revision=commit))
    except Exception as e:  # noqa: BLE001
        raise Permanent(f"the Hub does not give {repo}@{revision or 'main'}: {_said(e)}") from e
    headers = dict(options.pop("headers", {}) or {})
    token = token or hub.get_token()
    if token:
        headers.setdefault("authorization", f"Bearer {token}")
    client: Any = dict(options.pop("client_options", {}) or {})
    if headers:
        client["default_headers"] = {**client.get("default_headers", {}), **headers}
    if endpoint.startswith("http://"):
        client.setdefault("allow_http", True)
    base = f"{endpoint}/{repo}/resolve/{commit}/"
    store = HTTPStore.from_url(base, client_options=client, **options)
    found: list[Remote] = []
    for entry in tree:
        path = getattr(entry, "path", "")
        name = path.rsplit("/", 1)[-1]
        if getattr(entry, "size", None) is None or name.startswith("."):
            continue  # a folder, or a hidden file
        if not (name == _INDEX or name.endswith(".safetensors")):
            continue
        made = _head(obstore, store, base.rstrip("/"), path)  # the ETag resolve gives
        found.append(dataclasses.replace(made, url=f"hf://{repo}@{commit}/{path}"))
    return _folder(url, found, f"holds no *.safetensors file at commit {commit}")


def _why(e: BaseException) -> str:
    """What a client's error means for the user, and the fix."""
    try:
        from obstore import exceptions as ox
    except ImportError:  # pragma: no cover - obstore raised it
        return _said(e)
    if isinstance(e, ox.NotFoundError | FileNotFoundError):
        return f"does not exist (404): check the URL ({_said(e)})"
    if isinstance(e, ox.PermissionDeniedError | ox.UnauthenticatedError | PermissionError):
        return (
            f"access is denied: give credentials as the client reads them (environment, "
            f"config files) or in storage_options= ({_said(e)})"
        )
    if isinstance(e, ox.PreconditionError):
        return "changed since it was checked (its ETag differs); load again"
    return _said(e)


def read(obj: Remote, start: int, end: int) -> Any:
    """Bytes ``[start, end)`` of ``obj``, as it was listed (a buffer, not copied): a
    transient failure is tried again (with backoff, :data:`ATTEMPTS` in all), anything
    else raises :class:`Permanent`."""
    import obstore
    from obstore import exceptions as ox

    options: Any = {"range": (start, end)}
    if obj.etag:
        options["if_match"] = obj.etag
    final = (
        FileNotFoundError,
        PermissionError,
        ox.NotFoundError,
        ox.PermissionDeniedError,
        ox.UnauthenticatedError,
        ox.PreconditionError,
        ox.NotModifiedError,
    )
    for attempt in range(ATTEMPTS):
        try:
            got = obstore.get(obj.store, obj.key, options=options)
            meta = got.meta
            if obj.etag and meta.get("e_tag") and meta["e_tag"] != obj.etag:
                raise Permanent("changed since it was checked (its ETag differs); load again")
            if int(meta["size"]) != obj.size:
                raise Permanent(
                    f"is {meta['size']} bytes now, {obj.size} when checked: it changed; load again"
                )
            data = got.bytes()
            if len(data) != end - start:
                raise ConnectionError(f"{len(data)} of {end - start} bytes came")
            return data
        except Permanent:
            raise
        except final as e:
            raise Permanent(_why(e)) from e
        except Exception as e:  # noqa: BLE001 - transient: a cut body, a reset
            if attempt == ATTEMPTS - 1:
                raise Permanent(f"failed {ATTEMPTS} times: {_said(e)}") from e
            time.sleep(0.05 * 2**attempt)
    raise AssertionError("unreachable")


def check(obj: Remote) -> tuple[dict[str, _header.Stored], list[str]]:
    """The object's tensors, checked as a local file's are, from its header alone:
    one ranged read (a second where the header is longer than the first guess),
    then the ``safetensors`` package's verdict on the header and the object's size."""
    try:
        head = bytes(read(obj, 0, min(obj.size, FIRST_READ))) if obj.size else b""
        if len(head) >= 8:
            (length,) = struct.unpack("<Q", head[:8])
            if len(head) < 8 + length <= min(obj.size, 8 + _header.MAX_HEADER):
                head += bytes(read(obj, len(head), 8 + length))
    except Permanent as e:
        return {}, [str(e)]
    tensors, problems = _header.parse(io.BytesIO(head), obj.size, obj)
    if problems:
        return {}, problems
    # The package checks a file on disk: the header in a sparse file of the object's
    # size (no data is written or read)
    with tempfile.NamedTemporaryFile(suffix=".safetensors") as f:
        f.write(head)
        f.truncate(obj.size)
        f.flush()
        problems = _header.package_agrees(f.name, tensors)
    return tensors, problems
