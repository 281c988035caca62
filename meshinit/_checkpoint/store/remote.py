"""Checkpoints where they live: object storage and the Hugging Face Hub, by ranges.

``s3://bucket/prefix/``, ``gs://bucket/prefix/``, ``hf://org/model`` (``@revision``
as the Hub's client spells it, then an optional folder) and ``http(s)://`` URLs of
single files. Every object is reached through ``obstore`` (the Rust ``object_store``
crate: one client for S3, GCS and HTTP, with retries and backoff on transient
failures, conditional reads, and concurrency outside the GIL); the Hub's listing
and revision through ``huggingface_hub``. Each is an optional extra, named where it
is missing. Every request runs on :mod:`.aio`'s loop, bounded by its deadline and
cancelled on Ctrl-C.

An object is known by what it was when listed: its ETag; where the store gives none,
its version, or else its Last-Modified time. Every later read is conditional on that
(``If-Match``, the version itself, ``If-Unmodified-Since``) and every reply is
compared with it, so an object replaced between the check and the read is refused,
as a rewritten local file is; an object the store gives none of is refused. A Hub
revision is resolved to its commit first, and the files are read at that commit.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import io
import mmap
import os
import re
import struct
import tempfile
import urllib.parse
from collections.abc import Mapping
from typing import Any, ClassVar

from ..._errors import Problem
from . import aio as _aio
from . import clients as _clients
from . import header as _header
from .source import CONFIG, INDEX, Source, Stored

URL = re.compile(r"^(s3|gs|hf|https?)://", re.IGNORECASE)
SCHEMES = {"s3": "s3", "gs": "gcs", "hf": "hf", "https": "remote", "http": "remote"}

FIRST_READ = 1 << 16
"""The header's first ranged read: the length field and, for most checkpoints, the
whole header; a longer header takes a second read of the rest."""

ATTEMPTS = 4
"""Reads of one range before a transient failure (a dropped connection mid-body, a
short reply) is final; obstore itself retries 5xx replies and failed connections.
All of them within one deadline (:func:`meshinit._checkpoint.store.aio.deadline`)."""

CONCURRENCY = 16
"""Ranged reads in flight at once, per process."""


def is_url(files: Any) -> bool:
    return isinstance(files, str) and URL.match(files) is not None


@dataclasses.dataclass(frozen=True)
class Remote(Source):
    """One object: where it is, and who it was when listed (its ETag; else its
    version; else its Last-Modified time). Its header is read by range, its data
    fetched ahead of placement into anonymous mappings (:mod:`.fetch`), every read
    conditional on who it was."""

    url: str  # as messages name it
    key: str  # its path in the store ("" for a plain http(s) URL: the store is the file)
    size: int
    etag: str | None
    store: Any = dataclasses.field(compare=False, hash=False, repr=False)
    name: str = ""  # the file's name: the key's last part, or the URL path's
    version: str | None = None
    modified: datetime.datetime | None = None

    fetched: ClassVar[bool] = True

    def __str__(self) -> str:
        return self.url

    @property
    def shown(self) -> str:
        return self.url

    @property
    def identity(self) -> tuple[Any, ...]:
        return (self.etag, self.version, self.modified, self.size)

    def check(self) -> tuple[Any, dict[str, Stored], list[str]]:
        tensors, problems = _check(self)
        if problems:
            return None, {}, problems
        return self.identity, tensors, []

    def contents(self, limit: int, what: str) -> tuple[bytes | None, str | None]:
        if self.size > limit:
            return None, f"is over {limit} bytes: not {what}"
        try:
            return (bytes(read(self, 0, self.size)) if self.size else b""), None
        except Permanent as e:
            return None, str(e)

    def changed(self, checked: Any) -> str | None:
        return None  # every read is conditional on what it was when listed

    def mapping(self, checked: Any, start: int, end: int) -> Any:
        return mmap.mmap(-1, end - start, flags=mmap.MAP_PRIVATE)

    async def fetch(self, start: int, end: int) -> Any:
        return await fetch(self, start, end)

    def conditions(self) -> dict[str, Any]:
        """The read options that make a read of another object fail."""
        if self.etag:
            return {"if_match": self.etag}
        if self.version:
            return {"version": self.version}
        if self.modified is not None:
            return {"if_unmodified_since": self.modified}
        return {}


def _remote(url: str, key: str, meta: Mapping[str, Any], store: Any, name: str = "") -> Remote:
    return Remote(
        url,
        key,
        int(meta["size"]),
        meta.get("e_tag") or None,
        store,
        name or key.rsplit("/", 1)[-1],
        meta.get("version") or None,
        _modified(meta),
    )


def _modified(meta: Mapping[str, Any]) -> datetime.datetime | None:
    """The reply's Last-Modified time; None where it had none (obstore says 1970)."""
    t = meta.get("last_modified")
    return t if t is not None and t.timestamp() > 0 else None


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
    config: Remote | None = None  # the folder's config.json, where the listing saw one


def listing(url: str, options: Mapping[str, Any] | None) -> Folder:
    """The ``*.safetensors`` objects ``url`` names (one file, or a folder's), hidden
    ones left out, and the folder's ``model.safetensors.index.json``; ``options``
    checked before any request."""
    scheme = url.split("://", 1)[0].lower()
    options = dict(options or {})
    _import("obstore", scheme)
    wrong = _clients.problems(scheme, options)
    if wrong:
        return Folder([], None, [Problem(url, f"{w} (nothing was requested)") for w in wrong])
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
        return Folder([], None, [Problem(url, f"cannot be listed: {_why(e, scheme)}")])


def _said(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:300]}"


def _bucket(url: str, scheme: str, options: dict[str, Any]) -> Folder:
    import obstore

    _, name, prefix = _clients.split(url)
    root = f"{scheme}://{name}"
    store = _clients.bucket(scheme, name, options)
    if prefix.endswith(".safetensors"):
        meta = _aio.run(lambda: _head(store, prefix, scheme))
        return Folder([_remote(f"{root}/{prefix}", prefix, meta, store)], None, [])
    prefix = prefix.rstrip("/")
    listed = _aio.run(lambda: obstore.list(store, prefix=prefix or None).collect_async())
    found: list[Remote] = []
    for meta in listed:
        key = str(meta["path"])
        rest = key[len(prefix) :].lstrip("/") if prefix else key
        if "/" in rest or rest.startswith("."):
            continue
        if rest in (INDEX, CONFIG) or rest.endswith(".safetensors"):
            found.append(_remote(f"{root}/{key}", key, meta, store))
    return _folder(url, found, "holds no *.safetensors object: check the URL")


def _folder(url: str, found: list[Remote], empty: str) -> Folder:
    """The folder's files, its index apart; a folder with neither is a problem."""
    index = next((r for r in found if r.name == INDEX), None)
    config = next((r for r in found if r.name == CONFIG), None)
    files = sorted((r for r in found if r.name not in (INDEX, CONFIG)), key=lambda r: r.key)
    return Folder(files, index, [] if files or index else [Problem(url, empty)], config)


def sibling(url: str, name: str, options: Mapping[str, Any] | None) -> Remote | None:
    """The object ``name`` beside the one ``url`` names (``config.json`` beside a
    ``.safetensors`` URL), or None where there is none; :class:`Permanent` where it
    cannot be asked."""
    scheme = url.split("://", 1)[0].lower()
    options = dict(options or {})
    head, _, _ = url.split("?", 1)[0].split("#", 1)[0].rpartition("/")
    there = f"{head}/{name}"
    try:
        if scheme in ("http", "https"):
            store = _clients.http(there, options)
            meta = _aio.run(lambda: _head(store, "", scheme))
            return _remote(there, "", meta, store, name)
        _, bucket, key = _clients.split(there)
        store = _clients.bucket(scheme, bucket, options)
        meta = _aio.run(lambda: _head(store, key, scheme))
        return _remote(there, key, meta, store)
    except Permanent as e:
        if "does not exist" in str(e):
            return None
        raise
    except Exception as e:  # noqa: BLE001 - the client's own error, named
        raise Permanent(_why(e, scheme)) from e


async def _head(store: Any, key: str, scheme: str) -> Mapping[str, Any]:
    import obstore

    try:
        return await obstore.head_async(store, key)
    except Exception as e:  # noqa: BLE001
        raise Permanent(_why(e, scheme)) from e


def _single_http(url: str, options: dict[str, Any]) -> Folder:
    path = url.split("://", 1)[1].partition("/")[2].split("?", 1)[0].split("#", 1)[0]
    name = path.rsplit("/", 1)[-1]
    if not name.endswith(".safetensors"):
        raise Permanent(
            "an http(s):// URL names one .safetensors file (a folder cannot be listed over "
            "plain HTTP); give each file's URL, or an hf:// or bucket URL"
        )
    store = _clients.http(url, options)
    meta = _aio.run(lambda: _head(store, "", "https"))
    return Folder([_remote(url, "", meta, store, name)], None, [])


def _hub(url: str, options: dict[str, Any]) -> Folder:
    """``hf://org/model[@revision][/folder]``: the revision resolved to its commit,
    then its files read at that commit through the Hub's resolve URLs."""
    hub = _import("huggingface_hub", "hf")
    _, org, rest = _clients.split(url)
    pieces = [org, *rest.split("/")]
    if len(pieces) < 2 or not pieces[0] or not pieces[1]:
        raise Permanent("an hf:// URL names a repository: hf://org/model[@revision]")
    model, revision = pieces[1], None
    if "@" in model:
        model, revision = model.split("@", 1)
        revision = urllib.parse.unquote(revision)
    folder = "/".join(p for p in pieces[2:] if p)
    endpoint = options.pop("endpoint", None) or os.environ.get("HF_ENDPOINT")
    endpoint = (endpoint or "https://huggingface.co").rstrip("/")
    # huggingface_hub's meaning: False sends no token (not even HF_TOKEN's), None
    # the one it finds, a string that one
    token = options.pop("token", None)
    api = hub.HfApi(endpoint=endpoint, token=token)
    repo = f"{pieces[0]}/{model}"
    try:
        commit = api.model_info(repo, revision=revision).sha or revision or "main"
        tree = list(api.list_repo_tree(repo, path_in_repo=folder or None, revision=commit))
    except Exception as e:  # noqa: BLE001
        raise Permanent(f"the Hub does not give {repo}@{revision or 'main'}: {_said(e)}") from e
    headers = dict(options.pop("headers", {}) or {})
    if token is None:
        token = hub.get_token()
    if token:
        headers.setdefault("authorization", f"Bearer {token}")
    client: Any = dict(options.pop("client_options", {}) or {})
    if headers:
        client["default_headers"] = {**client.get("default_headers", {}), **headers}
    # the resolve URLs: {endpoint}/{repo}/resolve/{commit}/{path}, the store's base
    # without a trailing slash (the client adds one before each path)
    base = f"{endpoint}/{repo}/resolve/{commit}"
    store = _clients.http(base, {**options, "client_options": client})
    paths = []
    for entry in tree:
        path = getattr(entry, "path", "")
        name = path.rsplit("/", 1)[-1]
        if getattr(entry, "size", None) is None or name.startswith("."):
            continue  # a folder, or a hidden file
        if name in (INDEX, CONFIG) or name.endswith(".safetensors"):
            paths.append(path)

    async def heads() -> list[Mapping[str, Any]]:  # the ETags resolve gives, at once
        return await asyncio.gather(*(_head(store, path, "hf") for path in paths))

    found = [
        _remote(f"hf://{repo}@{commit}/{path}", path, meta, store)
        for path, meta in zip(paths, _aio.run(heads), strict=True)
    ]
    return _folder(url, found, f"holds no *.safetensors file at commit {commit}")


_NO_CREDENTIALS = {
    "s3": (
        "no AWS credentials were found: the client looked in the environment "
        "(AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, "
        "AWS_WEB_IDENTITY_TOKEN_FILE with AWS_ROLE_ARN, AWS_CONTAINER_CREDENTIALS_*), "
        "then asked the instance metadata service (169.254.169.254), which gave none. "
        "Set those variables, give storage_options={'access_key_id': ..., "
        "'secret_access_key': ...}, or 'skip_signature': True for a public bucket"
    ),
    "gs": (
        "no Google credentials were found: the client looked for a service account "
        "(GOOGLE_SERVICE_ACCOUNT, GOOGLE_APPLICATION_CREDENTIALS, the gcloud default) "
        "and asked the instance metadata service, which gave none. Set one, or give "
        "storage_options={'skip_signature': True} for a public bucket"
    ),
}


def _no_credentials(e: BaseException, scheme: str) -> bool:
    """Whether the client failed for want of credentials: it found none where it
    looks first, and asking the instance metadata service (its last resort) failed."""
    text = str(e)
    return scheme in _NO_CREDENTIALS and any(
        mark in text for mark in ("latest/api/token", "169.254.169.254", "metadata.google.internal")
    )


def _why(e: BaseException, scheme: str = "") -> str:
    """What a client's error means for the user, and the fix."""
    try:
        from obstore import exceptions as ox
    except ImportError:  # pragma: no cover - obstore raised it
        return _said(e)
    if isinstance(e, _aio.TimedOut):
        return str(e)
    if _no_credentials(e, scheme):
        return f"{_NO_CREDENTIALS[scheme]} ({_said(e)[:160]})"
    if isinstance(e, ox.NotFoundError | FileNotFoundError):
        return f"does not exist (404): check the URL ({_said(e)})"
    if isinstance(e, ox.PermissionDeniedError | ox.UnauthenticatedError | PermissionError):
        return (
            f"access is denied: give credentials as the client reads them (environment, "
            f"config files) or in storage_options= ({_said(e)})"
        )
    if isinstance(e, ox.PreconditionError):
        return "changed since it was checked (it is another version now); load again"
    return _said(e)


def _changed(obj: Remote, meta: Mapping[str, Any]) -> str | None:
    """Why the object a reply describes is not the one listed, or None."""
    if obj.etag and meta.get("e_tag") and meta["e_tag"] != obj.etag:
        return "changed since it was checked (its ETag differs); load again"
    if obj.version and meta.get("version") and meta["version"] != obj.version:
        return "changed since it was checked (its version differs); load again"
    if not obj.etag and not obj.version:
        if obj.modified is None or _modified(meta) is None:
            return (
                "the store gives it neither an ETag, a version nor a Last-Modified time: "
                "meshinit cannot know that it reads the object it checked; serve it with "
                "an ETag"
            )
        # HTTP dates are whole seconds; listings may carry milliseconds
        if _seconds(meta["last_modified"]) != _seconds(obj.modified):
            return "changed since it was checked (its Last-Modified time differs); load again"
    if int(meta["size"]) != obj.size:
        return f"is {meta['size']} bytes now, {obj.size} when checked: it changed; load again"
    return None


def _seconds(t: datetime.datetime) -> int:
    return int(t.timestamp())


_FINAL: tuple[type[BaseException], ...] = (FileNotFoundError, PermissionError)


async def fetch(obj: Remote, start: int, end: int) -> Any:
    """Bytes ``[start, end)`` of ``obj``, as it was listed (a buffer, not copied): a
    transient failure is tried again (with backoff, :data:`ATTEMPTS` in all), anything
    else raises :class:`Permanent`. The caller bounds it with a deadline."""
    import obstore
    from obstore import exceptions as ox

    options: Any = {"range": (start, end), **obj.conditions()}
    final: tuple[type[BaseException], ...] = (
        *_FINAL,
        ox.NotFoundError,
        ox.PermissionDeniedError,
        ox.UnauthenticatedError,
        ox.PreconditionError,
        ox.NotModifiedError,
    )
    scheme = obj.url.split("://", 1)[0]
    for attempt in range(ATTEMPTS):
        try:
            got = await obstore.get_async(obj.store, obj.key, options=options)
            why = _changed(obj, got.meta)
            if why is not None:
                raise Permanent(why)
            data = await got.bytes_async()
            if len(data) != end - start:
                raise ConnectionError(f"{len(data)} of {end - start} bytes came")
            return data
        except Permanent:
            raise
        except final as e:
            raise Permanent(_why(e, scheme)) from e
        except Exception as e:  # noqa: BLE001 - transient: a cut body, a reset
            if _no_credentials(e, scheme):
                raise Permanent(_why(e, scheme)) from e
            if attempt == ATTEMPTS - 1:
                raise Permanent(f"failed {ATTEMPTS} times: {_said(e)}") from e
            await asyncio.sleep(0.05 * 2**attempt)
    raise AssertionError("unreachable")


def read(obj: Remote, start: int, end: int) -> Any:
    """:func:`fetch` from the calling thread, within the deadline; :class:`Permanent`
    on a timeout too."""
    try:
        return _aio.run(lambda: fetch(obj, start, end))
    except _aio.TimedOut as e:
        raise Permanent(str(e)) from e


def _check(obj: Remote) -> tuple[dict[str, Stored], list[str]]:
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
