"""Authentication (docs/operations/security.md): API keys on every route but GET /health, the upstream's own key, the
refusal to start open on a reachable address, and the SDK / slime drop-in sending the key.

Real gateway processes on 127.0.0.1; the simulator is the upstream, except where what the upstream receives is
checked header by header (``RawUpstream`` records every request).
"""

from __future__ import annotations

import base64
import hmac
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import httpx
import orjson
import pytest
from conftest import Service, run_gateway
from procs import REPO_ROOT, free_port, start_process
from raw_upstream import RawRequest, RawUpstream, Step, chunked, http_response, sglang_answer, sse_event
from safetensors.numpy import load

from gateway import auth
from gateway.auth import KeyRing, presented_key
from gateway.config import Settings, exposure_problem, is_loopback
from gateway.errors import Unauthorized
from slime_client import AuthenticationError, GatewayClient, Session
from slime_client import slime as dropin

KEYS = ("k1-0f3b9c2e7a5d4c18", "k2-rotated-9e8d7c6b5a49")  # a rotation: both are accepted
UPSTREAM_KEY = "sglang-own-key-5c1a"
PROMPT = [11, 12, 13, 14]
TURN = {"max_new_tokens": 3}


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


# ---- the route families --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Call:
    name: str
    method: str
    path: str
    body: Any = None
    ok: int = 200  # the status with a valid key


def route_calls(sid: str) -> list[Call]:
    """One call per route family, in an order that works with a valid key (delete last)."""
    s = f"/v1/sessions/{sid}"
    return [
        Call("list sessions", "GET", "/v1/sessions"),
        Call("create session", "POST", "/v1/sessions", {"prompt_ids": PROMPT}, ok=201),
        Call("view session", "GET", f"{s}?full=true"),
        Call("generate", "POST", f"{s}/generate", {"sampling_params": TURN}),
        Call("generate stream", "POST", f"{s}/generate", {"sampling_params": TURN, "stream": True}),
        Call("append", "POST", f"{s}/append", {"token_ids": [7, 8]}),
        Call("abort", "POST", f"{s}/abort"),
        Call("sample", "GET", f"{s}/sample"),
        Call("samples", "POST", "/v1/samples", {"session_ids": [sid]}),
        Call("passthrough generate", "POST", "/generate", {"input_ids": PROMPT, "sampling_params": TURN}),
        Call("passthrough abort_request", "POST", "/abort_request", {"abort_all": True}),
        Call("passthrough flush_cache", "POST", "/flush_cache"),
        Call("passthrough get_model_info", "GET", "/get_model_info"),
        Call("passthrough HEAD", "HEAD", "/get_model_info"),
        Call("passthrough health_generate", "GET", "/health_generate"),
        Call("openapi", "GET", "/openapi.json"),
        Call("unknown route", "GET", "/no/such/route", ok=404),  # the key comes first: no route discovery
        Call("health is open to reads only", "POST", "/health", ok=405),
        Call("delete session", "DELETE", s, ok=204),
    ]


# Refused credentials: (id, the Authorization header values sent, the reason the gateway gives).
REFUSED: list[tuple[str, list[str], str]] = [
    ("none", [], "missing"),
    ("wrong key", ["Bearer not-a-key"], "invalid_key"),
    ("key prefix", [f"Bearer {KEYS[0][:-1]}"], "invalid_key"),
    ("key plus a char", [f"Bearer {KEYS[0]}x"], "invalid_key"),
    ("both keys, comma", [f"Bearer {KEYS[0]},{KEYS[1]}"], "invalid_key"),
    ("both keys, space", [f"Bearer {KEYS[0]} {KEYS[1]}"], "malformed"),
    ("Bearer alone", ["Bearer"], "malformed"),
    ("tab separator", [f"Bearer\t{KEYS[0]}"], "malformed"),  # 1*SP only (RFC 9110 section 11.4)
    ("Basic", ["Basic " + base64.b64encode(f"user:{KEYS[0]}".encode()).decode()], "malformed"),
    ("other scheme", [f"Token {KEYS[0]}"], "malformed"),
    ("no scheme", [KEYS[0]], "malformed"),
    ("two headers", [f"Bearer {KEYS[0]}", f"Bearer {KEYS[0]}"], "malformed"),
]
# Accepted spellings: the scheme is case-insensitive (RFC 9110 section 11.1), 1*SP before the token.
ACCEPTED_SPELLINGS = ["Bearer {}", "bearer {}", "BEARER {}", "Bearer  {}"]


@pytest.fixture(scope="module")
def authed(simulator: Service) -> Iterator[Service]:
    with run_gateway(simulator.url, "--log-level", "warning", env={"GATEWAY_API_KEY": ",".join(KEYS)}) as service:
        yield service


@pytest.fixture
async def http(authed: Service) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=authed.url, timeout=30) as client:
        yield client


async def new_session(http: httpx.AsyncClient, key: str = KEYS[0]) -> str:
    response = await http.post("/v1/sessions", json={"prompt_ids": PROMPT}, headers=bearer(key))
    assert response.status_code == 201, response.text
    return str(response.json()["session_id"])


def decoded_sample(blob: bytes) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """A safetensors sample as comparable values: its metadata and its tensors (the header's key order varies)."""
    header = orjson.loads(blob[8 : 8 + int.from_bytes(blob[:8], "little")])
    return header.get("__metadata__", {}), {name: array.tolist() for name, array in load(blob).items()}


async def send(http: httpx.AsyncClient, call: Call, authorization: list[str]) -> httpx.Response:
    headers = [("authorization", value) for value in authorization]
    content = None if call.body is None else orjson.dumps(call.body)
    if content is not None:
        headers.append(("content-type", "application/json"))
    return await http.request(call.method, call.path, content=content, headers=headers)


# The WWW-Authenticate challenge per reason (RFC 6750 section 3.1: no error code when no credentials came).
CHALLENGES = {
    "missing": 'Bearer realm="slime-gateway"',
    "malformed": 'Bearer realm="slime-gateway", error="invalid_request"',
    "invalid_key": 'Bearer realm="slime-gateway", error="invalid_token"',
}


def assert_refused(response: httpx.Response, call: Call, reason: str) -> None:
    assert response.status_code == 401, (call.name, response.status_code, response.text)
    assert response.headers["www-authenticate"] == CHALLENGES[reason], call.name
    if call.method == "HEAD":
        return  # no body to a HEAD
    assert response.headers["content-type"] == "application/json", call.name
    error = response.json()["error"]
    assert error["type"] == "unauthorized" and error["reason"] == reason, (call.name, error)
    assert not any(key in response.text for key in KEYS), "a refusal must not echo a key"


# ---- every route refuses, and a refusal changes nothing ------------------------------------------------------------
@pytest.mark.parametrize(("authorization", "reason"), [(a, r) for _, a, r in REFUSED], ids=[i for i, _, _ in REFUSED])
async def test_every_route_refuses_bad_credentials_and_nothing_changes(
    http: httpx.AsyncClient, simulator: Service, authorization: list[str], reason: str
) -> None:
    sid = await new_session(http)
    await http.post(f"/v1/sessions/{sid}/generate", json={"sampling_params": TURN}, headers=bearer(KEYS[0]))

    async def snapshot() -> tuple[Any, ...]:
        view = await http.get(f"/v1/sessions/{sid}?full=true", headers=bearer(KEYS[0]))
        listing = await http.get("/v1/sessions", headers=bearer(KEYS[0]))
        sample = await http.get(f"/v1/sessions/{sid}/sample", headers=bearer(KEYS[0]))
        async with httpx.AsyncClient(base_url=simulator.url) as sim:
            stats = (await sim.get("/sim/stats")).json()
        return view.json(), listing.json(), decoded_sample(sample.content), stats

    before = await snapshot()
    for call in route_calls(sid):
        assert_refused(await send(http, call, authorization), call, reason)
    assert await snapshot() == before  # no session touched, created or deleted; nothing sent upstream

    await http.delete(f"/v1/sessions/{sid}", headers=bearer(KEYS[0]))


@pytest.mark.parametrize("key", KEYS, ids=["first key", "second key"])
async def test_every_route_accepts_each_key_of_the_rotation(http: httpx.AsyncClient, key: str) -> None:
    sid = await new_session(http, key)
    for call in route_calls(sid):
        response = await send(http, call, [f"Bearer {key}"])
        assert response.status_code == call.ok, (call.name, response.status_code, response.text)


@pytest.mark.parametrize("spelling", ACCEPTED_SPELLINGS)
async def test_bearer_scheme_is_case_insensitive(http: httpx.AsyncClient, spelling: str) -> None:
    response = await http.get("/v1/sessions", headers={"authorization": spelling.format(KEYS[1])})
    assert response.status_code == 200, response.text


async def test_refused_stream_is_a_plain_401(http: httpx.AsyncClient) -> None:
    sid = await new_session(http)
    body = {"sampling_params": TURN, "stream": True}
    async with http.stream("POST", f"/v1/sessions/{sid}/generate", json=body) as response:
        await response.aread()
    assert response.status_code == 401 and response.headers["content-type"] == "application/json"


async def test_refused_big_body_leaves_the_connection_usable(http: httpx.AsyncClient) -> None:
    """The 401 goes out without reading the body; the next request on the connection must still work."""
    big = b"[" + b"1," * 2_000_000 + b"1]"
    refused = await http.post("/generate", content=big, headers={"content-type": "application/json"})
    assert refused.status_code == 401
    assert (await http.get("/v1/sessions", headers=bearer(KEYS[0]))).status_code == 200


# ---- open routes ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("authorization", [[], ["Bearer wrong"], ["Basic eDp5"]], ids=["none", "wrong", "malformed"])
async def test_health_and_metrics_are_open_by_default(http: httpx.AsyncClient, authorization: list[str]) -> None:
    headers = [("authorization", value) for value in authorization]
    health = await http.get("/health", headers=headers)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    metrics = await http.get("/metrics", headers=headers)
    assert metrics.status_code == 200
    # Refusals are counted (the auth layer runs inside the metrics middleware), on no route.
    assert 'gateway_requests_total{method="GET",route="unmatched",status="401"}' in metrics.text


async def test_protected_metrics(simulator: Service) -> None:
    env = {"GATEWAY_API_KEY": KEYS[0], "GATEWAY_PROTECT_METRICS": "true"}
    with run_gateway(simulator.url, "--log-level", "warning", env=env) as gateway:
        async with httpx.AsyncClient(base_url=gateway.url) as http:
            refused = await http.get("/metrics")
            assert_refused(refused, Call("metrics", "GET", "/metrics"), "missing")
            assert (await http.get("/metrics", headers=bearer("wrong"))).status_code == 401
            assert (await http.get("/metrics", headers=bearer(KEYS[0]))).status_code == 200
            assert (await http.get("/health")).status_code == 200  # still open


# ---- what the upstream receives ------------------------------------------------------------------------------------
class Upstream:
    """A ``RawUpstream`` reply: SGLang answers, streamed when asked; ``hang`` keeps a stream open after one delta."""

    def __init__(self) -> None:
        self.hang = False

    def __call__(self, request: RawRequest) -> list[Step]:
        if request.path != "/generate":
            return [http_response(b"{}")]
        asked = request.json or {}
        if not asked.get("stream"):
            return [http_response(sglang_answer(request))]
        head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
        answer = sglang_answer(request)
        if not self.hang:
            return [head + chunked(sse_event(answer), sse_event(b"[DONE]"))]
        first = sse_event(first_chunk(answer))
        return [head + b"%x\r\n%s\r\n" % (len(first), first), 4.0]


def first_chunk(answer: bytes) -> bytes:
    """SGLang's first cumulative stream chunk of ``answer``: one token, not finished."""
    full = orjson.loads(answer)
    meta = full["meta_info"]
    partial = {
        "id": meta["id"],
        "finish_reason": None,
        "prompt_tokens": meta["prompt_tokens"],
        "completion_tokens": 1,
        "cached_tokens": 0,
        "output_token_logprobs": meta["output_token_logprobs"][:1],
    }
    return orjson.dumps(
        {"text": f" w{full['output_ids'][0]}", "output_ids": full["output_ids"][:1], "meta_info": partial}
    )


@pytest.fixture(scope="module")
def raw_upstream() -> Iterator[tuple[RawUpstream, Upstream]]:
    script = Upstream()
    with RawUpstream(script) as upstream:
        yield upstream, script


async def every_upstream_call(gateway: Service, client_key: str, script: Upstream) -> None:
    """Passthrough POST and GET, a unary and a streamed turn, and an abort, all with ``client_key``."""
    async with httpx.AsyncClient(base_url=gateway.url, headers=bearer(client_key), timeout=30) as http:
        passthrough = await http.post("/generate", json={"input_ids": PROMPT, "sampling_params": TURN})
        assert passthrough.status_code == 200, passthrough.text
        assert (await http.get("/get_model_info")).status_code == 200
        sid = (await http.post("/v1/sessions", json={"prompt_ids": PROMPT})).json()["session_id"]
        unary = await http.post(f"/v1/sessions/{sid}/generate", json={"sampling_params": TURN})
        assert unary.status_code == 200, unary.text
        streamed = await http.post(f"/v1/sessions/{sid}/generate", json={"sampling_params": TURN, "stream": True})
        assert streamed.status_code == 200 and b'"type":"turn"' in streamed.content, streamed.text

        script.hang = True
        try:
            body = {"sampling_params": TURN, "stream": True}
            async with http.stream("POST", f"/v1/sessions/{sid}/generate", json=body) as stream:
                async for line in stream.aiter_lines():
                    if '"type":"delta"' in line:
                        break  # the turn is running upstream
                aborted = await http.post(f"/v1/sessions/{sid}/abort")  # -> /abort_request upstream
                assert aborted.status_code == 200 and aborted.json()["aborted"], aborted.text
        finally:
            script.hang = False


async def test_upstream_gets_its_own_key_never_the_clients(raw_upstream: tuple[RawUpstream, Upstream]) -> None:
    upstream, script = raw_upstream
    env = {"GATEWAY_API_KEY": KEYS[0], "GATEWAY_UPSTREAM_API_KEY": UPSTREAM_KEY}
    with run_gateway(upstream.url, "--log-level", "warning", env=env) as gateway:
        upstream.requests.clear()
        await every_upstream_call(gateway, KEYS[0], script)
    paths = {request.path for request in upstream.requests}
    assert {"/generate", "/get_model_info", "/abort_request"} <= paths, paths
    assert len([r for r in upstream.requests if r.path == "/generate"]) == 4  # passthrough, unary, 2 streamed
    for request in upstream.requests:
        assert request.headers.get("authorization") == f"Bearer {UPSTREAM_KEY}", (request.path, request.headers)
        assert KEYS[0] not in str(request.headers) and KEYS[0].encode() not in request.body


async def test_client_authorization_is_not_forwarded(raw_upstream: tuple[RawUpstream, Upstream]) -> None:
    """A gateway without keys (loopback) still keeps the caller's Authorization to itself."""
    upstream, script = raw_upstream
    with run_gateway(upstream.url, "--log-level", "warning") as gateway:
        upstream.requests.clear()
        await every_upstream_call(gateway, "a-token-meant-for-someone-else", script)
    assert upstream.requests
    for request in upstream.requests:
        assert "authorization" not in request.headers, (request.path, request.headers)


# ---- start-up: no open gateway on a reachable address --------------------------------------------------------------
def gateway_argv(*extra: str) -> list[str]:
    return [sys.executable, "-m", "gateway", "--upstream-url", "http://127.0.0.1:9", *extra]


def clean_env(**extra: str) -> dict[str, str]:
    env = {name: value for name, value in os.environ.items() if not name.startswith("GATEWAY_")}
    env["PYTHONPATH"] = str(REPO_ROOT)
    return env | extra


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "gateway.example"])
def test_refuses_to_start_on_a_reachable_host_without_a_key(host: str) -> None:
    argv = gateway_argv("--host", host, "--port", str(free_port()))
    result = subprocess.run(argv, cwd=REPO_ROOT, env=clean_env(), capture_output=True, text=True, timeout=30)
    assert result.returncode != 0
    assert f"refusing to listen on {host!r} without an API key" in result.stderr
    assert "GATEWAY_API_KEY" in result.stderr and "GATEWAY_ALLOW_UNAUTHENTICATED=true" in result.stderr


def test_allow_unauthenticated_starts_open_with_a_warning() -> None:
    port = free_port()
    env = {"GATEWAY_ALLOW_UNAUTHENTICATED": "true", "GATEWAY_API_KEY": ""}
    with start_process(gateway_argv("--host", "0.0.0.0", "--port", str(port)), port, env=env) as proc:
        assert httpx.get(f"{proc.url}/v1/sessions").status_code == 200
        assert "WITHOUT authentication" in proc.output()


def test_a_key_lets_it_start_on_0000() -> None:
    port = free_port()
    argv = gateway_argv("--host", "0.0.0.0", "--port", str(port), "--api-key", KEYS[1])
    with start_process(argv, port, env={"GATEWAY_API_KEY": ""}) as proc:
        assert httpx.get(f"{proc.url}/v1/sessions").status_code == 401
        assert httpx.get(f"{proc.url}/v1/sessions", headers=bearer(KEYS[1])).status_code == 200


@pytest.mark.parametrize("bad", ["has space", "new\nline", "non-ascii-é"])
def test_invalid_key_exits_without_echoing_it(bad: str) -> None:
    secret = f"SECRET{bad}TAIL"
    result = subprocess.run(
        gateway_argv("--port", str(free_port())),
        cwd=REPO_ROOT,
        env=clean_env(GATEWAY_API_KEY=secret),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode != 0 and "api_key" in result.stderr
    assert "SECRET" not in result.stderr + result.stdout


def test_keys_never_reach_the_log(simulator: Service) -> None:
    port = free_port()
    argv = [sys.executable, "-m", "gateway", "--upstream-url", simulator.url, "--port", str(port)]
    env = {"GATEWAY_API_KEY": ",".join(KEYS), "GATEWAY_UPSTREAM_API_KEY": UPSTREAM_KEY, "GATEWAY_LOG_LEVEL": "debug"}
    near_miss = KEYS[0][:-1] + "z"
    with start_process(argv, port, env=env) as proc, httpx.Client(base_url=proc.url) as http:
        assert http.get("/v1/sessions", headers=bearer(near_miss)).status_code == 401
        assert http.get("/v1/sessions", headers={"authorization": f"Basic {near_miss}"}).status_code == 401
        assert http.get("/v1/sessions", headers=bearer(KEYS[1])).status_code == 200
        assert http.post("/generate", json={"input_ids": PROMPT}, headers=bearer(KEYS[0])).status_code == 200
        output = proc.output()
    assert "refused GET /v1/sessions" in output  # refusals are logged...
    for secret in (*KEYS, UPSTREAM_KEY, near_miss):
        assert secret not in output  # ...without any key, presented or configured


# ---- units ---------------------------------------------------------------------------------------------------------
def test_keyring_matches_each_key_and_nothing_else() -> None:
    ring = KeyRing(KEYS)
    for key in KEYS:
        assert ring.matches(key.encode())
    for other in (b"", b"k1", KEYS[0][:-1].encode(), KEYS[0].encode() + b"x", b"x" * 4096, ",".join(KEYS).encode()):
        assert not ring.matches(other)
    assert KEYS[0] not in repr(ring)
    with pytest.raises(ValueError):
        KeyRing([])


@pytest.mark.parametrize("presented", [KEYS[0], KEYS[1], "short", "x" * 1000], ids=["1st", "2nd", "short", "long"])
def test_keyring_compares_fixed_length_digests_against_every_key(
    monkeypatch: pytest.MonkeyPatch, presented: str
) -> None:
    """Constant time: whichever key matches (or none), every key is compared, always on 32-byte digests, so the
    time says neither which key matched nor any length."""
    compared: list[tuple[int, int]] = []
    compare_digest = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append((len(a), len(b)))
        return compare_digest(a, b)

    ring = KeyRing([*KEYS, "third-key"])
    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    ring.matches(presented.encode())
    assert compared == [(32, 32)] * 3


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([b"Bearer abc"], b"abc"),
        ([b"bearer abc"], b"abc"),
        ([b"BeArEr   abc  "], b"abc"),
        ([], "missing"),
        ([b"Bearer"], "malformed"),
        ([b"Bearer   "], "malformed"),
        ([b"Bearer a b"], "malformed"),
        ([b"Bearer a\tb"], "malformed"),
        ([b"Basic YTpi"], "malformed"),
        ([b"abc"], "malformed"),
        ([b"Bearer a", b"Bearer a"], "malformed"),
    ],
)
def test_presented_key(values: list[bytes], expected: bytes | str) -> None:
    headers = [(b"content-type", b"application/json"), *((b"authorization", value) for value in values)]
    if isinstance(expected, bytes):
        assert presented_key(headers) == expected
        return
    with pytest.raises(Unauthorized) as caught:
        presented_key(headers)
    assert caught.value.details["reason"] == expected and caught.value.status_code == 401


def test_settings_parse_and_hide_keys() -> None:
    settings = Settings(
        upstream_url="http://127.0.0.1:9", api_key=f" {KEYS[0]} , {KEYS[1]},", upstream_api_key=UPSTREAM_KEY
    )
    assert settings.api_keys == KEYS and settings.upstream_key == UPSTREAM_KEY
    for text in (repr(settings), str(settings), str(settings.model_dump())):
        assert KEYS[0] not in text and UPSTREAM_KEY not in text
    unset = Settings(upstream_url="http://127.0.0.1:9", api_key=" , ", upstream_api_key="")
    assert unset.api_keys == () and unset.api_key is None and unset.upstream_key is None


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.8.9.10", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("LOCALHOST", True),
        ("0.0.0.0", False),
        ("::", False),
        ("", False),
        ("192.168.1.5", False),
        ("my-host", False),
    ],
)
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_exposure_problem() -> None:
    base = {"upstream_url": "http://127.0.0.1:9"}
    assert exposure_problem(Settings(**base)) is None  # 127.0.0.1 by default
    assert exposure_problem(Settings(**base, host="0.0.0.0")) is not None
    assert exposure_problem(Settings(**base, host="0.0.0.0", api_key="k")) is None
    assert exposure_problem(Settings(**base, host="0.0.0.0", allow_unauthenticated=True)) is None


# ---- the SDK and the slime drop-in ---------------------------------------------------------------------------------
async def test_sdk_sends_the_key_on_every_call(authed: Service) -> None:
    async with GatewayClient(authed.url, api_key=KEYS[1], timeout=30) as gw:
        session = await gw.create_session(prompt_ids=PROMPT)
        await session.generate(TURN)
        async with session.generate(TURN, stream=True) as stream:
            streamed = await stream.final()
        assert streamed.completion_tokens > 0
        await session.append([5, 6])
        await session.abort()
        state = await session.state()
        assert state.total_tokens > len(PROMPT) + 2 and len((await session.fetch()).tokens) == state.total_tokens
        assert len(await gw.fetch_samples([session.session_id])) == 1
        assert any(s.session_id == session.session_id for s in await gw.list_sessions())
        await session.delete()


@pytest.mark.parametrize("api_key", ["", "wrong-key"], ids=["no key", "wrong key"])
async def test_sdk_401_is_authentication_error_and_not_retried(
    authed: Service, api_key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with GatewayClient(authed.url, api_key=api_key, max_retries=2) as gw:
        attempts = 0
        send = gw._pool.request

        async def count(*args: Any, **kwargs: Any) -> Any:
            nonlocal attempts
            attempts += 1
            return await send(*args, **kwargs)

        monkeypatch.setattr(gw._pool, "request", count)
        assert (await gw.health())["status"] == "ok"  # open
        attempts = 0
        with pytest.raises(AuthenticationError) as caught:
            await gw.list_sessions()
        assert attempts == 1
        assert caught.value.status == 401 and caught.value.error_type == "unauthorized"
        assert caught.value.details["reason"] == ("missing" if not api_key else "invalid_key")
        assert caught.value.headers["www-authenticate"].startswith("Bearer")


async def test_sdk_stream_without_key_is_authentication_error(authed: Service, http: httpx.AsyncClient) -> None:
    sid = await new_session(http)
    async with GatewayClient(authed.url, api_key="") as gw:
        with pytest.raises(AuthenticationError):
            async with Session(gw, sid).generate(TURN, stream=True) as stream:
                await stream.final()


async def test_sdk_reads_the_key_from_the_environment(authed: Service, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLIME_GATEWAY_API_KEY", KEYS[0])
    async with GatewayClient(authed.url) as gw:
        assert isinstance(await gw.list_sessions(), list)
    async with GatewayClient(authed.url, api_key="") as gw:  # "" sends no key, whatever the environment says
        with pytest.raises(AuthenticationError):
            await gw.list_sessions()


@dataclass
class DropinSample:
    """The fields slime's Sample has that the drop-in touches (no Status enum: statuses stay strings)."""

    prompt: str = ""
    tokens: list[int] | None = None
    response: str = ""
    response_length: int = 0
    loss_mask: list[int] | None = None
    weight_versions: list[str] | None = None
    rollout_log_probs: list[float] | None = None
    rollout_routed_experts: Any = None
    rollout_top_p_token_ids: Any = None
    rollout_top_p_token_offsets: Any = None
    status: str = "pending"
    session_id: str | None = None


def dropin_args(url: str, **extra: Any) -> SimpleNamespace:
    return SimpleNamespace(gateway_url=url, use_rollout_routing_replay=False, partial_rollout=False, **extra)


async def dropin_generate(args: SimpleNamespace) -> DropinSample:
    sample = DropinSample(tokens=list(PROMPT), weight_versions=[])
    try:
        return await dropin.generate(args, sample, dict(TURN))
    finally:
        await dropin.close_clients()


async def test_dropin_sends_the_key_from_the_environment(authed: Service, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLIME_GATEWAY_API_KEY", raising=False)
    with pytest.raises(AuthenticationError):
        await dropin_generate(dropin_args(authed.url))
    monkeypatch.setenv("SLIME_GATEWAY_API_KEY", KEYS[1])
    sample = await dropin_generate(dropin_args(authed.url))
    assert sample.response_length > 0 and len(sample.tokens) == len(PROMPT) + sample.response_length


async def test_dropin_key_from_args(authed: Service, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLIME_GATEWAY_API_KEY", "stale-key")
    sample = await dropin_generate(dropin_args(authed.url, gateway_api_key=KEYS[0]))  # args win
    assert sample.response_length > 0


async def test_dropin_clients_are_per_key() -> None:
    first = dropin.client_for("http://a.test", "k1")
    assert dropin.client_for("http://a.test", "k1") is first
    assert dropin.client_for("http://a.test", "k2") is not first  # a rotated key gets a client that sends it
    await dropin.close_clients()
