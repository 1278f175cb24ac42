"""Abuse of the training routes of `art serve` (issue 18), over HTTP on 127.0.0.1.

A real `create_server_app` (the app `art serve` runs) with the tiny random model registered, served
by uvicorn in a thread, its body limit lowered to `LIMIT` so an oversized upload is cheap to send:

- an upload over the limit is a 413 `request_too_large` on every training route, whether its
  `Content-Length` says so (refused before the body is read) or it comes chunked; `RemoteBackend`
  raises `RemoteRequestTooLargeError`; the default limit is `MAX_BODY_BYTES`;
- a malformed trajectory (or any field of a train or register body) is a 400 whose message starts
  with the field's path and whose `param` is that path;
- a project or model name with a path escape (`..`, `/`, `\\`, a leading `.`, NUL, ...) is a 400
  `invalid_name` on every route, and nothing is created outside the storage folder;
- a missing, wrong or wrong-length API key is a 401 with `WWW-Authenticate: Bearer`, checked before
  the body's size, and compared as SHA-256 digests with `hmac.compare_digest` (equal lengths
  whatever the key given: no timing signal of where or how long it differs);
- a property-based run of `EXAMPLES` requests over every training route (listed from the router)
  gets no 5xx, every error in OpenAI's shape, and `/health` answers after each.

The chat routes have their own fuzzing in tests/server/test_server_fuzz.py.
"""

from __future__ import annotations

import hmac
import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from fastapi.routing import APIRoute
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from art_core.backends.remote import RemoteBackend, RemoteRequestTooLargeError
from art_core.engine.config import EngineConfig
from art_core.host.records import WIRE_PREFIX, ModelSpec
from art_core.host.routes import create_server_app, training_router
from art_core.host.service import ModelService
from art_core.host.serving import TorchServing
from art_core.rollouts.groups import TrajectoryGroup
from art_core.rollouts.records import Trajectory
from art_core.server import middleware
from art_core.server.app import ServerHandle, serve_in_thread
from art_core.server.middleware import MAX_BODY_BYTES, keys_match
from art_core.training.config import TrainConfig

API_KEY = "abuse-key-0123456789"
PROJECT = MODEL = "abuse"
LIMIT = 64 * 1024
"""The test server's body limit (bytes)."""
EXAMPLES = 520
"""Fuzz requests over the training routes (the requirement is at least 500)."""
REPLAYED_KEY = "abuse-replayed-step-1"
"""The idempotency key of step 1 (trained by the fixture): a valid train body with it is answered
from the checkpoint, so the fuzz's valid bodies rarely train."""
AUTH = {"Authorization": f"Bearer {API_KEY}"}
JSON_TYPE = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding only the server's storage folder `art` (so an escape would show beside it)."""
    return tmp_path_factory.mktemp("abuse")


@pytest.fixture(scope="module")
def service(root: Path) -> Iterator[ModelService]:
    service = ModelService(root / "art", TorchServing(EngineConfig(max_context=64, batch_wait_s=0)))
    service.register(ModelSpec(project=PROJECT, name=MODEL, base_model="tiny-random"))
    yield service
    service.close()


@pytest.fixture(scope="module")
def server(service: ModelService) -> Iterator[ServerHandle]:
    handle = serve_in_thread(create_server_app(service, api_key=API_KEY, max_body_bytes=LIMIT))
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def http(server: ServerHandle) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def trained(http: httpx.Client) -> int:
    """Step 1, trained once with `REPLAYED_KEY`; returns the step."""
    response = post_train(http, train_body(request_key=REPLAYED_KEY))
    assert response.status_code == 200, response.text
    return int(json.loads(response.text.splitlines()[-1])["result"]["step"])


# -- helpers ---------------------------------------------------------------------------------------


def trajectory(reward: float = 1.0, **fields: Any) -> dict[str, Any]:
    turn = {"prompt_ids": [1, 2, 3], "completion_ids": [5, 6], "logprobs": [-1.0, -2.0]}
    return {"messages": [], "reward": reward, "turns": [turn], **fields}


def train_body(**fields: Any) -> dict[str, Any]:
    return {"groups": [{"trajectories": [trajectory(1.0), trajectory(0.0)]}], "config": {}, **fields}


def post_train(http: httpx.Client, body: Any, name: str = MODEL) -> httpx.Response:
    return http.post(f"{WIRE_PREFIX}/{name}/train", content=json.dumps(body).encode(), headers=JSON_TYPE)


def training_routes() -> list[tuple[str, str]]:
    """(method, path) of every training route, from the router itself."""
    routes = []
    for route in training_router(ModelService()).routes:
        assert isinstance(route, APIRoute)
        routes.extend((method, route.path) for method in sorted(route.methods))
    return sorted(routes)


ROUTES = training_routes()
NAMED_ROUTES = [route for route in ROUTES if "{name}" in route[1]]


def route_path(path: str, name: str = MODEL) -> str:
    return path.replace("{name}", name)


def check_error(response: httpx.Response, status: int) -> dict[str, Any]:
    """`response` is `status` with an OpenAI error body; returns the `error` object."""
    assert response.status_code == status, (response.status_code, response.text[:500])
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    return dict(error)


def raw_request(url: str, head: bytes, body: bytes = b"") -> tuple[int, dict[str, Any]]:
    """Send `head` (request line and headers, no final blank line) and `body` as they are; return the
    status and JSON body of the answer. For what httpx will not send: a `Content-Length` that the
    body does not have, dot segments (`/../`) that it would resolve away."""
    parsed = httpx.URL(url)
    with socket.create_connection((parsed.host, parsed.port or 80), timeout=30) as sock:
        sock.sendall(head + b"\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n" + body)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    status_line, _, rest = data.partition(b"\r\n")
    _, _, payload = rest.partition(b"\r\n\r\n")
    return int(status_line.split()[1]), json.loads(payload) if payload else {}


def auth_line(key: str = API_KEY) -> bytes:
    return f"\r\nAuthorization: Bearer {key}".encode()


# -- oversized uploads: 413 ------------------------------------------------------------------------


def padded(size: int) -> bytes:
    """A JSON train body of exactly `size` bytes: a bad config (so it never trains) and padding."""
    start = b'{"groups": [], "config": {"learning_rate": -1}, "pad": "'
    return start + b"x" * (size - len(start) - 2) + b'"}'


@pytest.mark.parametrize(("method", "path"), ROUTES)
def test_an_upload_over_the_limit_is_a_413_on_every_training_route(
    http: httpx.Client, method: str, path: str
) -> None:
    response = http.request(method, route_path(path), content=padded(LIMIT + 1), headers=JSON_TYPE)
    error = check_error(response, 413)
    assert error["code"] == "request_too_large"
    assert f"{LIMIT + 1} bytes, over this server's limit of {LIMIT} bytes" in error["message"]


def test_a_body_at_the_limit_is_read(http: httpx.Client) -> None:
    body = padded(LIMIT)
    assert len(body) == LIMIT
    response = http.post(f"{WIRE_PREFIX}/{MODEL}/train", content=body, headers=JSON_TYPE)
    assert "learning_rate must be a positive finite number" in check_error(response, 400)["message"]


def test_a_chunked_upload_over_the_limit_is_a_413(http: httpx.Client) -> None:
    chunks = iter([padded(LIMIT + 1)[i : i + 4096] for i in range(0, LIMIT + 1, 4096)])
    response = http.post(f"{WIRE_PREFIX}/{MODEL}/train", content=chunks, headers=JSON_TYPE)
    assert "transfer-encoding" in response.request.headers  # no Content-Length: counted as it came
    error = check_error(response, 413)
    assert error["code"] == "request_too_large" and f"more than {LIMIT} bytes" in error["message"]


def test_a_declared_length_over_the_limit_is_refused_before_the_body_comes(server: ServerHandle) -> None:
    # A terabyte announced and none sent: the answer comes at once (the socket would time out otherwise).
    head = (
        f"POST {WIRE_PREFIX}/{MODEL}/train HTTP/1.1".encode()
        + auth_line()
        + b"\r\nContent-Length: 10000000000000"
    )
    status, body = raw_request(server.url, head)
    assert status == 413 and body["error"]["code"] == "request_too_large"


def test_an_oversized_upload_without_the_key_is_a_401(http: httpx.Client) -> None:
    response = http.post(
        f"{WIRE_PREFIX}/{MODEL}/train", content=padded(LIMIT + 1), headers={"Authorization": "Bearer x"}
    )
    assert check_error(response, 401)["code"] == "invalid_api_key"


def test_the_default_limit_is_128_mib(service: ModelService) -> None:
    assert MAX_BODY_BYTES == 128 * 2**20
    handle = serve_in_thread(create_server_app(service, api_key=API_KEY))
    try:
        head = f"POST {WIRE_PREFIX}/{MODEL}/train HTTP/1.1\r\nContent-Type: application/json".encode()
        head += auth_line()
        status, answer = raw_request(handle.url, head + f"\r\nContent-Length: {MAX_BODY_BYTES + 1}".encode())
        assert status == 413 and f"limit of {MAX_BODY_BYTES} bytes" in answer["error"]["message"]
        status, answer = raw_request(
            handle.url, head + f"\r\nContent-Length: {LIMIT + 1}".encode(), padded(LIMIT + 1)
        )
        assert status == 400 and "learning_rate" in answer["error"]["message"]  # read: under this limit
    finally:
        handle.stop()


async def test_remote_backend_raises_request_too_large(server: ServerHandle, trained: int) -> None:
    words = " ".join(["fruit"] * (LIMIT // 6))  # one message over the limit on its own
    big = Trajectory.model_validate(trajectory(messages=[{"role": "user", "content": words}]))
    groups = [TrajectoryGroup([big, Trajectory.model_validate(trajectory(0.0))])]
    async with RemoteBackend(server.url, api_key=API_KEY, train_retries=0) as backend:
        with pytest.raises(RemoteRequestTooLargeError) as caught:
            await backend.train(MODEL, groups, TrainConfig())
        assert caught.value.status == 413 and f"limit of {LIMIT} bytes" in caught.value.message
        assert await backend.get_step(MODEL) == trained  # nothing trained; the server still answers


# -- malformed bodies: 400 naming the field --------------------------------------------------------


def _with_trajectory(index: int, **fields: Any) -> dict[str, Any]:
    body = train_body()
    body["groups"][0]["trajectories"][index].update(fields)
    return body


def _without(body: dict[str, Any], *path: Any) -> dict[str, Any]:
    target = body
    for part in path[:-1]:
        target = target[part]
    del target[path[-1]]
    return body


TURN = {"prompt_ids": [1], "completion_ids": [5, 6], "logprobs": [-1.0, -1.0]}
MALFORMED_TRAIN = [
    ({}, "groups", "Field required"),
    ({"groups": "not a list"}, "groups", "valid list"),
    ({"groups": [{"trajectories": "x"}]}, "groups.0.trajectories", "valid list"),
    # These three were a 500 (TypeError: 'int' object is not iterable, in TrajectoryGroup.__init__):
    ({"groups": [{"trajectories": 5}]}, "groups.0.trajectories", "valid list"),
    ({"groups": [{"trajectories": None}]}, "groups.0.trajectories", "valid list"),
    ({"groups": [{"pending": 5}]}, "groups.0.pending", "valid list"),
    # A trajectory that is not an object was "groups.0.pending.0: ... instance of Awaitable":
    ({"groups": [{"trajectories": [trajectory(), 5]}]}, "groups.0.trajectories.1", "instance of Trajectory"),
    ({"groups": [7]}, "groups.0", ""),
    (_with_trajectory(1, reward="x"), "groups.0.trajectories.1.reward", "valid number"),
    (_with_trajectory(0, turns="x"), "groups.0.trajectories.0.turns", "valid list"),
    (
        _with_trajectory(0, turns=[{**TURN, "prompt_ids": "a"}]),
        "groups.0.trajectories.0.turns.0.prompt_ids",
        "",
    ),
    (
        _with_trajectory(1, turns=[TURN, {**TURN, "completion_ids": [5, 1.5]}]),
        "groups.0.trajectories.1.turns.1.completion_ids.1",
        "valid integer",
    ),
    (
        _with_trajectory(0, turns=[_without(dict(TURN), "logprobs")]),
        "groups.0.trajectories.0.turns.0.logprobs",
        "Field required",
    ),
    (
        _with_trajectory(1, turns=[{**TURN, "logprobs": [-1.0]}]),
        "groups.0.trajectories.1.turns.0",
        "2 completion ids but 1 logprobs",
    ),
    (_with_trajectory(0, messages="hi"), "groups.0.trajectories.0.messages", ""),
    (_with_trajectory(0, metrics={"a": "b"}), "groups.0.trajectories.0.metrics.a", ""),
    ({**train_body(), "request_key": "not a key!"}, "request_key", "pattern"),
    ({**train_body(), "config": "fast"}, "config", "valid dictionary"),
]


@pytest.mark.parametrize(("body", "path", "reason"), MALFORMED_TRAIN, ids=[c[1] for c in MALFORMED_TRAIN])
def test_a_malformed_train_body_is_a_400_naming_the_field(
    http: httpx.Client, trained: int, body: Any, path: str, reason: str
) -> None:
    error = check_error(post_train(http, body), 400)
    assert error["param"].startswith(path) and error["message"].startswith(path), error
    assert reason in error["message"]
    assert check_step(http) == trained  # nothing trained


def check_step(http: httpx.Client) -> int:
    response = http.get(f"{WIRE_PREFIX}/{MODEL}/step")
    assert response.status_code == 200, response.text
    return int(response.json()["step"])


def test_several_problems_are_listed_and_counted(http: httpx.Client) -> None:
    bad = [trajectory(reward="x") for _ in range(5)]
    error = check_error(post_train(http, {"groups": [{"trajectories": bad}]}), 400)
    shown = [f"groups.0.trajectories.{i}.reward: Input should be a valid number" for i in range(3)]
    assert all(part in error["message"] for part in shown) and "(and 2 more problems)" in error["message"]


def test_invalid_json_is_a_400_about_the_body(http: httpx.Client) -> None:
    response = http.post(f"{WIRE_PREFIX}/{MODEL}/train", content=b'{"groups": [', headers=JSON_TYPE)
    error = check_error(response, 400)
    assert error["message"].startswith("body: invalid JSON at character ") and error["param"] is None


@pytest.mark.parametrize(
    ("spec", "path"),
    [
        ({"lora": {"r": "x"}}, "lora.r"),
        ({"lora_rank": -(2**70)}, "lora"),  # LoRAConfig's own check: "lora: LoRA rank r must be >= 1"
        ({"trust_remote_code": "maybe"}, "trust_remote_code"),
        ({"base_model": None}, "base_model"),
    ],
)
def test_a_malformed_model_spec_is_a_400_naming_the_field(http: httpx.Client, spec: Any, path: str) -> None:
    body = {"project": PROJECT, "name": "never-loaded", "base_model": "tiny-random", **spec}
    error = check_error(http.post(WIRE_PREFIX, json=body), 400)
    assert error["param"] == path and error["message"].startswith(f"{path}: "), error


# -- names with a path escape ----------------------------------------------------------------------

ESCAPES = [
    "..",
    ".",
    "../escape",
    "../../../../tmp/escape",
    "/tmp/escape",
    "/",
    "a/b",
    "a\\b",
    "..\\escape",
    "C:\\escape",
    ".hidden",
    "a..b",
    "a\x00b",
    "a\nb",
    "",
    " ",
    "~",
    "x" * 129,
    "ünïcode",
    "%2e%2e",
]


@pytest.mark.parametrize("field", ["project", "name"])
@pytest.mark.parametrize("bad", ESCAPES, ids=[ascii(n)[1:-1][:20] or "empty" for n in ESCAPES])
def test_register_refuses_a_name_with_a_path_escape(
    http: httpx.Client, service: ModelService, root: Path, field: str, bad: str
) -> None:
    body = {"project": PROJECT, "name": "escape", "base_model": "tiny-random", field: bad}
    error = check_error(http.post(WIRE_PREFIX, json=body), 400)
    assert error["param"] == field and error["code"] == "invalid_name", error
    assert "escape" not in service.model_names()  # refused before the model was loaded
    assert sorted(p.name for p in root.iterdir()) == ["art"]
    assert sorted(p.name for p in (root / "art").iterdir()) == [PROJECT]
    assert sorted(p.name for p in (root / "art" / PROJECT / "models").iterdir()) == [MODEL]


@pytest.mark.parametrize(("method", "path"), NAMED_ROUTES)
def test_every_route_with_a_name_refuses_a_path_escape(server: ServerHandle, method: str, path: str) -> None:
    body = json.dumps({"groups": []}).encode()
    for bad in ESCAPES:
        for segment in {bad, quote(bad, safe="")}:  # as sent (dot segments kept) and percent-encoded
            if not (segment.isascii() and segment.isprintable()) or " " in segment or "\\" in segment:
                continue  # not a valid request target; its encoded form is tried
            head = f"{method} {route_path(path, segment)} HTTP/1.1\r\nContent-Type: application/json"
            head += f"\r\nContent-Length: {len(body)}"
            status, answer = raw_request(server.url, head.encode() + auth_line(), body)
            if bad and "/" not in bad:  # one path segment: the route's own check
                assert status == 400, (bad, segment, answer)
                assert answer["error"]["param"] == "name" and answer["error"]["code"] == "invalid_name"
            else:  # "" or a "/" in it: no route matches (the name never reaches a handler)
                assert status in (404, 405), (bad, segment, status, answer)


# -- API key: 401 ----------------------------------------------------------------------------------

WRONG_KEYS = {
    "missing": None,
    "empty": "",
    "scheme only": "Bearer",
    "no scheme": API_KEY,
    "basic": f"Basic {API_KEY}",
    "first char": f"Bearer X{API_KEY[1:]}",
    "last char": f"Bearer {API_KEY[:-1]}X",
    "shorter": f"Bearer {API_KEY[:-1]}",
    "longer": f"Bearer {API_KEY}0",
    "much longer": f"Bearer {API_KEY * 100}",
    "one char": "Bearer a",
    "latin-1": "Bearer ÿÿÿ",
}


@pytest.mark.parametrize(("method", "path"), ROUTES)
@pytest.mark.parametrize("header", WRONG_KEYS.values(), ids=list(WRONG_KEYS))
def test_a_wrong_api_key_is_a_401(
    server: ServerHandle, service: ModelService, method: str, path: str, header: str | None
) -> None:
    headers = {} if header is None else {"Authorization": header.encode("latin-1")}
    body = {"project": PROJECT, "name": "intruder", "base_model": "tiny-random"}
    response = httpx.request(method, server.url + route_path(path), json=body, headers=headers, timeout=30)
    error = check_error(response, 401)
    assert error["code"] == "invalid_api_key" and response.headers["www-authenticate"] == "Bearer"
    expected = "Missing API key" if header is None else "Incorrect API key provided"
    assert error["message"].startswith(expected) and "Authorization: Bearer <key>" in error["message"]
    assert "intruder" not in service.model_names()


def test_the_key_is_compared_as_equal_length_digests_with_compare_digest(
    server: ServerHandle, monkeypatch: pytest.MonkeyPatch
) -> None:
    compared: list[tuple[int, int]] = []
    real = hmac.compare_digest

    def recording(a: bytes, b: bytes) -> bool:
        compared.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(middleware.hmac, "compare_digest", recording)
    sent = [*(k for k in WRONG_KEYS.values() if k is not None), f"Bearer {API_KEY}"]
    for header in sent:
        response = httpx.get(
            f"{server.url}{WIRE_PREFIX}/{MODEL}/step", headers={"Authorization": header.encode("latin-1")}
        )
        assert response.status_code == (200 if header == f"Bearer {API_KEY}" else 401)
    # One constant-time comparison per request, always of two SHA-256 digests: the time taken does not
    # depend on the key given, its length or where it differs.
    assert compared == [(32, 32)] * len(sent)


def test_keys_match() -> None:
    assert keys_match("Bearer k", "Bearer k") and keys_match("", "")
    assert not keys_match("Bearer k", "Bearer K") and not keys_match("Bearer k", "Bearer k ")
    assert keys_match("Bearer ключ\ud800", "Bearer ключ\ud800") and not keys_match("\ud800", "\ud801")


# -- property-based fuzzing of every training route ------------------------------------------------


def mostly(
    usual: st.SearchStrategy[Any], rare: st.SearchStrategy[Any], one_in: int = 10
) -> st.SearchStrategy[Any]:
    """`usual` about `one_in - 1` times in `one_in`, else `rare`. The choice is a hash of a drawn
    integer: Hypothesis favours small and boundary integers, which would make `rare` far likelier."""
    return st.integers(0, 2**32 - 1).flatmap(
        lambda i: rare if ((i * 2654435761 + 2**31) % 2**32) * one_in < 2**32 else usual
    )


TEXT = st.text(st.characters(exclude_categories=()), max_size=24)
"""Any text, lone surrogates and NUL included."""
HUGE = st.sampled_from([2**31, 2**63, -(2**63) - 1, 2**64, 10**30, 10**400, 1e308, -1e308, 5e-324])
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 50),
    HUGE,
    st.floats(allow_nan=True, allow_infinity=True),
    TEXT,
)
JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=8,
)
"""Any JSON value (NaN and infinities too: Python's json writes and reads them)."""


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in a JSON value, itself included."""
    found = [prefix]
    if isinstance(value, dict):
        for key, item in value.items():
            found += _paths(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found += _paths(item, (*prefix, index))
    return found


_DELETE = object()


def _mutate(data: st.DataObject, value: Any) -> Any:
    """`value` with one change at a random place: replaced (any JSON, a huge number, text, a
    container of the wrong kind), deleted, repeated, or given an unknown key."""
    path = data.draw(st.sampled_from(_paths(value)), label="place")
    op = data.draw(st.sampled_from(["replace", "replace", "huge", "delete", "repeat", "extra"]), label="op")
    new: Any = {
        "replace": lambda old: data.draw(JSON, label="value"),
        "huge": lambda old: data.draw(HUGE | st.just("x" * 5000) | st.just([0] * 2000), label="huge"),
        "delete": lambda old: _DELETE,
        "repeat": lambda old: [old] * data.draw(st.integers(0, 40), label="times"),
        "extra": lambda old: (
            {**old, data.draw(TEXT, label="key"): data.draw(JSON)} if isinstance(old, dict) else old
        ),
    }[op]
    if not path:
        result = new(value)
        return {} if result is _DELETE else result
    parent = value
    for part in path[:-1]:
        parent = parent[part]
    replacement = new(parent[path[-1]])
    if replacement is _DELETE:
        del parent[path[-1]]
    else:
        parent[path[-1]] = replacement
    return value


def _register_body(data: st.DataObject) -> Any:
    body: Any = {"project": PROJECT, "name": MODEL, "base_model": "tiny-random"}  # the registered spec
    for _ in range(data.draw(st.integers(1, 3), label="changes")):
        body = _mutate(data, body)
    if isinstance(body, dict) and body.get("name") != MODEL and isinstance(body.get("base_model"), str):
        body["base_model"] = "no-such-model"  # a new valid spec would load a model per example
    return body


def _train_body(data: st.DataObject) -> Any:
    body = train_body(request_key=REPLAYED_KEY)
    if data.draw(st.integers(0, 9), label="keeps a valid config") != 0:
        body["config"] = {"learning_rate": -1.0}  # most bodies stop at the config (after validation)
    for _ in range(data.draw(st.integers(1, 3), label="changes")):
        body = _mutate(data, body)
    return body


RAW_BODIES = st.one_of(
    st.binary(max_size=64),
    st.just(b""),
    st.just(b'{"groups": [' * 3),  # truncated
    st.integers(1, 3000).map(lambda d: b"[" * d + b"]" * d),  # deep nesting
    st.just(b'{"groups": ' + b"9" * 5000 + b"}"),  # past Python's int digits limit
    st.just(b'{"groups": [], "groups": 1}'),  # duplicate key
    st.just(b"\xff\xfe{}"),  # not UTF-8
)
NAMES = mostly(
    st.just(MODEL),
    st.one_of(st.sampled_from(ESCAPES), st.sampled_from(["nope", f"{MODEL}@1", MODEL.upper()]), TEXT),
    one_in=5,
)
AUTHS = mostly(
    st.just(f"Bearer {API_KEY}".encode()),
    st.one_of(
        st.sampled_from([k.encode("latin-1") for k in WRONG_KEYS.values() if k]), st.binary(max_size=40)
    ),
    one_in=15,
)
CONTENT_TYPES = mostly(
    st.just(b"application/json"),
    st.sampled_from([b"text/plain", b"application/x-www-form-urlencoded", b"multipart/form-data", b""]),
)
QUERY = st.lists(
    st.tuples(mostly(st.just("keep"), TEXT), st.one_of(st.integers(-3, 5).map(str), HUGE.map(str), TEXT)),
    max_size=3,
)


def _header(value: bytes) -> bytes:
    """`value` as a header value HTTP allows (no control characters, no surrounding whitespace)."""
    return bytes(b for b in value if b >= 0x20 and b != 0x7F).strip(b" ")


def _text(value: str) -> str:
    return value.encode("utf-8", "backslashreplace").decode()


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_fuzz_every_training_route(http: httpx.Client, trained: int, data: st.DataObject) -> None:
    method, path = data.draw(st.sampled_from(ROUTES), label="route")
    method = data.draw(mostly(st.just(method), st.sampled_from(["GET", "POST", "PUT", "PATCH", "DELETE"])))
    name = data.draw(NAMES, label="name")
    target = route_path(path, quote(name.encode("utf-8", "surrogatepass"), safe="") or "x")
    shaped = data.draw(st.integers(0, 9), label="shaped body") != 0  # else any JSON value
    if path == WIRE_PREFIX and shaped:
        body = _register_body(data)
    elif path.endswith("/train") and shaped:
        body = _train_body(data)
    else:
        body = data.draw(mostly(st.none(), JSON, one_in=4), label="body")
    content = b"" if body is None else json.dumps(body, allow_nan=True).encode()
    content = data.draw(mostly(st.just(content), RAW_BODIES, one_in=8), label="bytes")
    params = [(_text(k), _text(v)) for k, v in data.draw(QUERY, label="query")]
    headers = {"Authorization": _header(data.draw(AUTHS, label="auth"))}
    headers["Content-Type"] = data.draw(CONTENT_TYPES, label="content type")
    response = http.request(method, target, content=content, params=params, headers=headers)

    event(f"{path.removeprefix(WIRE_PREFIX) or '/'}: {response.status_code}")  # --hypothesis-show-statistics
    assert response.status_code < 500, (response.status_code, response.text[:2000])
    if response.status_code >= 400:
        check_error(response, response.status_code)
    if response.headers.get("content-type", "").startswith("application/x-ndjson"):
        for line in response.text.splitlines():  # a train stream's own error line too
            assert json.loads(line).get("status", 200) < 500, line
    assert http.get("/health").status_code == 200


def test_the_fuzz_covers_every_training_route_with_at_least_500_requests() -> None:
    assert EXAMPLES >= 500
    assert {path for _, path in ROUTES} == {
        WIRE_PREFIX,
        f"{WIRE_PREFIX}/{{name}}/train",
        f"{WIRE_PREFIX}/{{name}}/step",
        f"{WIRE_PREFIX}/{{name}}/checkpoints",
        f"{WIRE_PREFIX}/{{name}}/history",
    }


async def test_the_server_still_trains_and_serves_after_the_abuse(http: httpx.Client, trained: int) -> None:
    before = check_step(http)
    assert before >= trained
    response = post_train(http, train_body())
    assert response.status_code == 200, response.text
    assert json.loads(response.text.splitlines()[-1])["result"]["step"] == before + 1
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert http.post("/v1/chat/completions", json=chat).status_code == 200
    async with RemoteBackend(str(http.base_url), api_key=API_KEY) as backend:
        assert await backend.get_step(MODEL) == before + 1
