"""The clients remote objects are read with: URLs split as stores name objects, and
``storage_options=`` checked against the installed client before it is made.

A bucket URL's key is every character after the bucket's slash (``#``, ``?`` and
``%`` included: keys are not URLs). A plain ``http(s)://`` file is requested exactly
as written, its query (a presigned URL's signature) kept; ``http://`` is allowed
without options, since the URL chose it.

obstore takes options as keyword arguments that its Rust core parses: an unknown key
is its own error, but a client option given as a store option (``allow_http`` for
S3) panics in Rust (``pyo3_runtime.PanicException``, a ``BaseException``). So each
key is checked first, against the option names the installed obstore declares (its
type stubs, read with ``ast``: they move with obstore's releases), and each problem
names the key and the valid ones. Constructing a store sends no request.
"""

from __future__ import annotations

import ast
import importlib.util
import pathlib
from collections.abc import Mapping
from typing import Any

from ... import _caches
from ..._typos import closest

STORE_KEYS = ("config", "client_options", "retry_config", "credential_provider")
"""Keyword arguments of obstore's bucket stores beside their configuration keys."""

HTTP_KEYS = ("client_options", "retry_config")
HUB_KEYS = ("endpoint", "token", "headers")
"""``hf://`` only: the Hub's endpoint and token, and headers sent with every read."""

_PREFIX = {"s3": "aws_", "gs": "google_"}
_CONFIG = {"s3": ("_aws.pyi", "S3Config"), "gs": ("_gcs.pyi", "GCSConfig")}


def split(url: str) -> tuple[str, str, str]:
    """``(scheme, bucket, key)`` of ``s3://bucket/key`` or ``gs://...``, and ``hf://``'s
    ``(scheme, "org", "model[@rev]/folder")``: the key keeps every character."""
    scheme, _, rest = url.partition("://")
    bucket, _, key = rest.partition("/")
    return scheme.lower(), bucket, key


@_caches.memo(16)
def _declared(stub: str, name: str) -> frozenset[str]:
    """The keys of the TypedDict ``name`` in obstore's stub ``_store/<stub>`` (empty
    where the stub cannot be read: then only obstore itself judges)."""
    spec = importlib.util.find_spec("obstore")
    if spec is None or not spec.submodule_search_locations:
        return frozenset()
    file = pathlib.Path(next(iter(spec.submodule_search_locations))) / "_store" / stub
    try:
        tree = ast.parse(file.read_text())
    except (OSError, SyntaxError, ValueError):
        return frozenset()
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return frozenset(
                item.target.id
                for item in node.body
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
            )
    return frozenset()


def client_keys() -> frozenset[str]:
    return _declared("_client.pyi", "ClientConfig")


def _unknown(where: str, key: Any, valid: frozenset[str] | tuple[str, ...], fix: str = "") -> str:
    close = closest(str(key), sorted(valid))
    hint = f" (did you mean {close!r}?)" if close else ""
    known = ", ".join(sorted(valid)) or "none"
    return f"{where}[{key!r}] is not an option of the client{hint}{fix}; known: {known}"


def problems(scheme: str, options: Mapping[str, Any]) -> list[str]:
    """What is wrong with ``storage_options`` for a ``scheme://`` URL, every key named
    with the valid ones; sends nothing."""
    found: list[str] = []
    client = client_keys()
    if scheme in ("s3", "gs"):
        config = _declared(*_CONFIG[scheme])
        for key in options:
            if key in STORE_KEYS:
                continue
            name = str(key).lower().removeprefix(_PREFIX[scheme])
            if not isinstance(key, str):
                found.append(f"storage_options key {key!r} is not a string")
            elif name in client and name not in config:
                found.append(
                    f"storage_options[{key!r}] is an HTTP client option: give it as "
                    f"storage_options={{'client_options': {{{name!r}: ...}}}}"
                )
            elif config and name not in config and not _accepted(scheme, key, options[key]):
                found.append(_unknown("storage_options", key, (*config, *STORE_KEYS)))
    else:
        allowed = (*HTTP_KEYS, *(HUB_KEYS if scheme == "hf" else ()))
        found += [_unknown("storage_options", k, allowed) for k in options if k not in allowed]
    given = options.get("client_options") or {}
    if not isinstance(given, Mapping):
        found.append(f"storage_options['client_options'] must be a mapping, got {given!r}")
    elif client:
        found += [
            _unknown("storage_options['client_options']", k, client)
            for k in given
            if str(k).lower() not in client
        ]
    retry = options.get("retry_config") or {}
    if not isinstance(retry, Mapping):
        found.append(f"storage_options['retry_config'] must be a mapping, got {retry!r}")
    else:
        valid = _declared("_retry.pyi", "RetryConfig")
        found += [
            _unknown("storage_options['retry_config']", k, valid)
            for k in retry
            if valid and k not in valid
        ]
        backoff = retry.get("backoff") or {}
        valid = _declared("_retry.pyi", "BackoffConfig")
        if isinstance(backoff, Mapping):
            found += [
                _unknown("storage_options['retry_config']['backoff']", k, valid)
                for k in backoff
                if valid and k not in valid
            ]
    return found


def _accepted(scheme: str, key: str, value: Any) -> bool:
    """Whether obstore takes ``key`` (an alias its stubs do not list, ``endpoint_url``)
    as a store option: asked of obstore itself, which sends nothing to do it."""
    from obstore import exceptions as ox
    from obstore.store import from_url

    try:
        from_url(f"{scheme}://probe", **{key: value})
    except ox.UnknownConfigurationKeyError:
        return False
    except Exception:  # noqa: BLE001 - a known key with a value it refuses: said later
        return True
    return True


def bucket(scheme: str, name: str, options: Mapping[str, Any]) -> Any:
    """obstore's store for ``scheme://name`` with ``options`` (checked before)."""
    from obstore.store import from_url

    return from_url(f"{scheme}://{name}", **options)


def http(url: str, options: Mapping[str, Any]) -> Any:
    """An obstore HTTP store that requests ``url`` exactly as written (its key is
    ``""``); ``http://`` allowed, as the URL asks."""
    from obstore.store import HTTPStore

    options = dict(options)
    client: Any = dict(options.pop("client_options", None) or {})
    if url.lower().startswith("http://"):
        client.setdefault("allow_http", True)
    return HTTPStore.from_url(url, client_options=client, **options)
