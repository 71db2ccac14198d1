"""A Kubernetes API server stand-in for the DRA tests: HTTP/1.1 on 127.0.0.1, objects kept in memory.

It answers what the publisher and the claim source ask, the way the real server does on the wire:
GET, LIST (with ``fieldSelector``), WATCH (``?watch=true``: a chunked stream of JSON events, from a
``resourceVersion`` or, without one, starting with an ADDED event for each object there), POST,
PUT, PATCH (server-side apply only), DELETE, and DELETE on a collection (kubelet's DeleteCollection,
with ``fieldSelector``) on any ``/api/v1/...`` or ``/apis/<group>/<version>/...`` collection,
namespaced or not. It fills
``metadata.uid``, ``metadata.resourceVersion`` and ``metadata.creationTimestamp``, refuses a create of
an existing name (409 AlreadyExists) and a PUT with a stale resourceVersion (409 Conflict), answers a
missing object with 404 NotFound, and an apply that changes nothing leaves the object (and its
resourceVersion) as it was. Errors are ``Status`` objects in ``application/json``, as a client expects.

Every request is recorded (:attr:`FakeApiServer.requests`: method, path, query, headers, body), and the
server can be told to fail the next N requests with a status code, or to hang them (no answer until the
server closes), to drive a client's retries and timeouts; to stop listening (every connection, open
watches too, dropped; new ones refused) and to listen again on the same port; and to keep changes
out of the watch streams (:attr:`FakeApiServer.deliver_watch_events`), as a watch that missed them.
The parsing is our own, plain asyncio: request line, headers and a ``Content-Length`` body, several
requests on one kept-alive connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import json
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import yaml

# The resources this fake knows: plural -> (kind, apiVersion).
KINDS = {
    "nodes": ("Node", "v1"),
    "resourceslices": ("ResourceSlice", "resource.k8s.io/v1"),
    "resourceclaims": ("ResourceClaim", "resource.k8s.io/v1"),
    "deviceclasses": ("DeviceClass", "resource.k8s.io/v1"),
}
SLICES = "/apis/resource.k8s.io/v1/resourceslices"
NODES = "/api/v1/nodes"
APPLY = "application/apply-patch+yaml"
TOKEN = "fake-token-for-tests"
_REASONS = {
    200: "OK",
    201: "Created",
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    409: "Conflict",
    415: "Unsupported Media Type",
    422: "Unprocessable Entity",
    500: "Internal Server Error",
    503: "Service Unavailable",
}
_STATUS_REASONS = {
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    409: "Conflict",
    415: "UnsupportedMediaType",
    500: "InternalError",
    503: "ServiceUnavailable",
}


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]  # names lower-cased
    body: Any  # the parsed JSON body, or None


@dataclass
class _Fault:
    remaining: int
    status: int | None  # None: hang
    path_contains: str


@dataclass
class FakeApiServer:
    """Start with :meth:`start`; ``async with`` does start and close."""

    requests: list[Request] = field(default_factory=list)
    # collection path (e.g. "/apis/resource.k8s.io/v1/resourceslices") -> name -> object
    objects: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    require_token: bool = True
    _faults: list[_Fault] = field(default_factory=list)
    _versions: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    _last_version: int = 0
    # Every change, for the watches: (resourceVersion, collection, event type, object).
    _events: list[tuple[int, str, str, dict[str, Any]]] = field(default_factory=list)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)
    deliver_watch_events: bool = True
    watches: int = 0  # watch requests answered
    # A watch from a resourceVersion below this gets the API server's "too old resource version"
    # (an ERROR event carrying a 410 Expired Status), as after etcd compacted that history.
    expired_below: int = 0
    _watch_epoch: int = 0
    _server: asyncio.Server | None = None
    _closing: asyncio.Event = field(default_factory=asyncio.Event)
    _handlers: set[asyncio.Task[None]] = field(default_factory=set)
    port: int = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop_listening(self) -> None:
        """The API server goes away: every connection (open watches too) dropped, new ones refused."""
        await self.close()
        self._server = None
        self._closing = asyncio.Event()

    async def listen_again(self) -> None:
        """Back, on the same port, with the same objects."""
        await self.start()

    async def close(self) -> None:
        self._closing.set()
        if self._server is not None:
            self._server.close()
        self._wake()
        for task in list(self._handlers):
            task.cancel()
        for task in list(self._handlers):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._server is not None:
            await self._server.wait_closed()

    async def __aenter__(self) -> FakeApiServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def write_kubeconfig(self, path: Path) -> Path:
        """A kubeconfig that points at this server with a bearer token, as a file."""
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {"token": TOKEN}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
            "current-context": "fake",
        }
        path.write_text(yaml.safe_dump(config))
        return path

    # -- seeding and reading the store -------------------------------------------------------------

    def add_node(self, name: str) -> str:
        """A Node object; its uid is returned."""
        return str(
            self._create(NODES, {"metadata": {"name": name}, "status": {}}, "nodes")["metadata"]["uid"]
        )

    def remove_node(self, name: str) -> None:
        del self.objects[NODES][name]

    def add_claim(
        self,
        namespace: str,
        name: str,
        *,
        results: list[dict[str, Any]] | None,
        uid: str | None = None,
        requests: list[dict[str, Any]] | None = None,
        reserved_for: list[str] = (),  # type: ignore[assignment]
    ) -> str:
        """A ResourceClaim asking `requests` (default: one request "shared" of exactly one device),
        allocated with `results` (driver, pool, device, request, maybe adminAccess), or not allocated
        when `results` is None, reserved for the pods with uids `reserved_for` (the scheduler's
        status.reservedFor). Its uid is returned."""
        if requests is None:
            requests = [{"name": "shared", "exactly": {"deviceClassName": "x"}}]
        obj: dict[str, Any] = {
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"devices": {"requests": requests}},
        }
        if results is not None:
            obj["status"] = {"allocation": {"devices": {"results": results}}}
            if reserved_for:
                obj["status"]["reservedFor"] = [
                    {"resource": "pods", "name": f"pod-{uid}", "uid": uid} for uid in reserved_for
                ]
        created = self._create(
            f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims", obj, "resourceclaims"
        )
        if uid is not None:
            created["metadata"]["uid"] = uid
        return str(created["metadata"]["uid"])

    def slices(self) -> list[dict[str, Any]]:
        """The stored ResourceSlices, by name."""
        stored = self.objects.get(SLICES, {})
        return [copy.deepcopy(stored[name]) for name in sorted(stored)]

    def writes(self) -> list[Request]:
        """The requests that could change something (all but GET)."""
        return [request for request in self.requests if request.method != "GET"]

    # -- faults ------------------------------------------------------------------------------------

    def fail_next(self, count: int, status: int = 500, path_contains: str = "") -> None:
        """Answer the next `count` requests (whose path contains `path_contains`) with `status`."""
        self._faults.append(_Fault(count, status, path_contains))

    def hang_next(self, count: int, path_contains: str = "") -> None:
        """Never answer the next `count` requests (until the server closes)."""
        self._faults.append(_Fault(count, None, path_contains))

    def _take_fault(self, path: str) -> _Fault | None:
        for fault in self._faults:
            if fault.remaining > 0 and fault.path_contains in path:
                fault.remaining -= 1
                return fault
        return None

    # -- the wire ----------------------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            while not self._closing.is_set():
                request = await self._read_request(reader)
                if request is None:
                    break
                self.requests.append(request)
                fault = self._take_fault(request.path)
                if fault is not None and fault.status is None:
                    await self._closing.wait()
                    break
                if fault is None and self._is_watch(request):
                    await self._watch(request, writer)
                    break
                if fault is not None and fault.status is not None:
                    status, body = fault.status, _status(fault.status, "injected failure")
                else:
                    status, body = self._answer(request)
                payload = json.dumps(body).encode()
                head = (
                    f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}\r\n"
                    "Content-Type: application/json\r\n"
                    f"Content-Length: {len(payload)}\r\n\r\n"
                )
                writer.write(head.encode() + payload)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self._handlers.discard(task)
            writer.close()
            with contextlib.suppress(ConnectionError, asyncio.CancelledError):
                await writer.wait_closed()

    @staticmethod
    async def _read_request(reader: asyncio.StreamReader) -> Request | None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return None  # the client closed the connection between requests
        lines = head.decode("latin-1").split("\r\n")
        method, target, _version = lines[0].split(" ", 2)
        headers = {}
        for line in lines[1:]:
            if line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        length = int(headers.get("content-length", "0"))
        raw = await reader.readexactly(length) if length else b""
        parts = urlsplit(target)
        body = json.loads(raw) if raw else None  # an apply body is YAML, but lightkube sends JSON
        return Request(method, parts.path, dict(parse_qsl(parts.query)), headers, body)

    # -- the API -----------------------------------------------------------------------------------

    def _answer(self, request: Request) -> tuple[int, dict[str, Any]]:
        if self.require_token and request.headers.get("authorization") != f"Bearer {TOKEN}":
            return 401, _status(401, "no or wrong bearer token")
        located = _locate(request.path)
        if located is None:
            return 404, _status(404, f"the server could not find the requested resource ({request.path})")
        collection, plural, name = located
        stored = self.objects.setdefault(collection, {})
        method = request.method
        if name is None:
            if method == "GET":
                return 200, self._list(collection, plural, request.query.get("fieldSelector", ""))
            if method == "POST":
                return self._post(collection, plural, request.body)
            if method == "DELETE":
                self.delete_collection(collection, request.query.get("fieldSelector", ""))
                return 200, {"kind": "Status", "apiVersion": "v1", "status": "Success", "code": 200}
            return 405, _status(405, f"{method} on a collection")
        current = stored.get(name)
        if method == "PATCH":
            return self._apply(collection, plural, name, request)
        if current is None:
            return 404, _status(404, f'{plural} "{name}" not found', reason="NotFound")
        if method == "GET":
            return 200, copy.deepcopy(current)
        if method == "PUT":
            return self._put(collection, name, current, request.body)
        if method == "DELETE":
            self._delete(collection, name)
            return 200, {"kind": "Status", "apiVersion": "v1", "status": "Success", "code": 200}
        return 405, _status(405, f"{method} on an object")

    def _create(self, collection: str, obj: dict[str, Any], plural: str) -> dict[str, Any]:
        kind, api_version = KINDS[plural]
        obj = copy.deepcopy(obj)
        obj["kind"], obj["apiVersion"] = kind, api_version
        metadata = obj.setdefault("metadata", {})
        metadata["uid"] = str(uuid.uuid4())
        metadata["resourceVersion"] = self._next_version()
        metadata["creationTimestamp"] = "2026-01-01T00:00:00Z"
        self.objects.setdefault(collection, {})[metadata["name"]] = obj
        self._record(collection, "ADDED", obj)
        return obj

    def delete_collection(self, collection: str, selector: str = "") -> list[str]:
        """Delete what `selector` matches in `collection`, as DeleteCollection does; the names."""
        stored = self.objects.get(collection, {})
        gone = [name for name, obj in sorted(stored.items()) if _matches(obj, selector)]
        for name in gone:
            self._delete(collection, name)
        return gone

    def end_watches(self) -> None:
        """End every open watch stream cleanly, as the API server does at a watch's timeout."""
        self._watch_epoch += 1
        self._wake()

    def replace_object(self, collection: str, obj: dict[str, Any]) -> None:
        """Another writer's update of a stored object (a new resourceVersion, a MODIFIED event)."""
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = self._next_version()
        self.objects[collection][obj["metadata"]["name"]] = obj
        self._record(collection, "MODIFIED", obj)

    def _delete(self, collection: str, name: str) -> None:
        gone = self.objects[collection].pop(name)
        gone["metadata"]["resourceVersion"] = self._next_version()
        self._record(collection, "DELETED", gone)

    def _next_version(self) -> str:
        self._last_version = next(self._versions)
        return str(self._last_version)

    def _record(self, collection: str, kind: str, obj: dict[str, Any]) -> None:
        if self.deliver_watch_events:
            version = int(obj["metadata"]["resourceVersion"])
            self._events.append((version, collection, kind, copy.deepcopy(obj)))
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _list(self, collection: str, plural: str, selector: str) -> dict[str, Any]:
        items = [
            copy.deepcopy(obj)
            for _, obj in sorted(self.objects.get(collection, {}).items())
            if _matches(obj, selector)
        ]
        kind, api_version = KINDS[plural]
        return {
            "kind": f"{kind}List",
            "apiVersion": api_version,
            "metadata": {"resourceVersion": str(self._last_version)},
            "items": items,
        }

    @staticmethod
    def _is_watch(request: Request) -> bool:
        return request.method == "GET" and request.query.get("watch") in ("true", "1")

    async def _watch(self, request: Request, writer: asyncio.StreamWriter) -> None:
        """A watch stream: chunked JSON lines until timeoutSeconds, the client leaves, or we close."""
        located = _locate(request.path)
        if (self.require_token and request.headers.get("authorization") != f"Bearer {TOKEN}") or (
            located is None or located[2] is not None
        ):
            status, body = (
                (401, _status(401, "no or wrong bearer token")) if located else (404, _status(404, "?"))
            )
            payload = json.dumps(body).encode()
            writer.write(
                f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(payload)}\r\n\r\n".encode()
                + payload
            )
            await writer.drain()
            return
        collection, _plural, _ = located
        self.watches += 1
        selector = request.query.get("fieldSelector", "")
        since = request.query.get("resourceVersion", "")
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        if since in ("", "0"):
            cursor = self._last_version
            for _, obj in sorted(self.objects.get(collection, {}).items()):
                if _matches(obj, selector):
                    _chunk(writer, {"type": "ADDED", "object": obj})
        elif int(since) < self.expired_below:
            expired = _status(410, f"too old resource version: {since} ({self.expired_below})", "Expired")
            _chunk(writer, {"type": "ERROR", "object": expired})
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            return
        else:
            cursor = int(since)
        timeout = float(request.query.get("timeoutSeconds") or 0) or None
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._stream(writer, collection, selector, cursor), timeout)
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async def _stream(
        self, writer: asyncio.StreamWriter, collection: str, selector: str, cursor: int
    ) -> None:
        epoch = self._watch_epoch
        while not self._closing.is_set() and epoch == self._watch_epoch:
            for version, where, kind, obj in self._events:
                if version > cursor and where == collection and _matches(obj, selector):
                    _chunk(writer, {"type": kind, "object": obj})
                cursor = max(cursor, version)
            await writer.drain()
            await self._changed.wait()

    def _post(self, collection: str, plural: str, body: Any) -> tuple[int, dict[str, Any]]:
        name = body["metadata"]["name"]
        if name in self.objects[collection]:
            return 409, _status(409, f'{plural} "{name}" already exists', reason="AlreadyExists")
        return 201, copy.deepcopy(self._create(collection, body, plural))

    def _put(
        self, collection: str, name: str, current: dict[str, Any], body: Any
    ) -> tuple[int, dict[str, Any]]:
        version = body.get("metadata", {}).get("resourceVersion")
        if version is not None and version != current["metadata"]["resourceVersion"]:
            return 409, _status(409, "the object has been modified; please apply your changes again")
        replaced = copy.deepcopy(body)
        for key in ("uid", "creationTimestamp"):
            replaced["metadata"][key] = current["metadata"][key]
        replaced["metadata"]["resourceVersion"] = self._next_version()
        self.objects[collection][name] = replaced
        self._record(collection, "MODIFIED", replaced)
        return 200, copy.deepcopy(replaced)

    def _apply(self, collection: str, plural: str, name: str, request: Request) -> tuple[int, dict[str, Any]]:
        if request.headers.get("content-type") != APPLY:
            return 415, _status(415, "this fake takes server-side apply patches only")
        if not request.query.get("fieldManager"):
            return 400, _status(400, "fieldManager is required for apply patch")
        body = request.body
        if body.get("metadata", {}).get("name") != name:
            return 400, _status(400, "the name of the object does not match the name on the URL")
        current = self.objects[collection].get(name)
        if current is None:
            return 201, copy.deepcopy(self._create(collection, body, plural))
        merged = copy.deepcopy(current)
        for key, value in body.items():
            if key == "metadata":
                merged["metadata"].update(
                    {
                        k: v
                        for k, v in value.items()
                        if k not in ("uid", "resourceVersion", "creationTimestamp")
                    }
                )
            else:
                merged[key] = copy.deepcopy(value)
        if merged != current:
            merged["metadata"]["resourceVersion"] = self._next_version()
            self.objects[collection][name] = merged
            self._record(collection, "MODIFIED", merged)
        return 200, copy.deepcopy(merged)


def _locate(path: str) -> tuple[str, str, str | None] | None:
    """(collection path, plural, object name or None) of an API path, or None if it is none."""
    segments = path.strip("/").split("/")
    if segments[:2] == ["api", "v1"]:
        start = 2
    elif segments[:1] == ["apis"] and len(segments) >= 3:
        start = 3
    else:
        return None
    rest = segments[start:]
    if len(rest) >= 3 and rest[0] == "namespaces":
        start += 2
        rest = rest[2:]
    if not rest or rest[0] not in KINDS or len(rest) > 2:
        return None
    collection = "/" + "/".join(segments[: start + 1])
    return collection, rest[0], rest[1] if len(rest) == 2 else None


def _matches(obj: dict[str, Any], selector: str) -> bool:
    """Whether `obj` passes a field selector of ``path=value`` terms joined by commas."""
    wanted = [term.split("=", 1) for term in selector.split(",") if term]
    return all(_field(obj, path) == value for path, value in wanted)


def _chunk(writer: asyncio.StreamWriter, event: dict[str, Any]) -> None:
    """One watch event as one chunk of a chunked response: a JSON line."""
    data = json.dumps(event).encode() + b"\n"
    writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")


def _field(obj: dict[str, Any], dotted: str) -> str:
    value: Any = obj
    for key in dotted.split("."):
        value = value.get(key) if isinstance(value, dict) else None
    return "" if value is None else str(value)


def _status(code: int, message: str, reason: str | None = None) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason or _STATUS_REASONS.get(code, "Unknown"),
        "code": code,
    }
