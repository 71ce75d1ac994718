"""The upstream wire, end to end: a real gateway process before a raw-TCP fake upstream that answers with scripted
bytes (``raw_upstream.RawUpstream``), driven over 127.0.0.1 with httpx.

Every call shape the gateway makes upstream is covered: a unary session turn, a streamed session turn and the
``/generate`` passthrough. Each broken answer must end in the documented gateway error; the session must be exactly
as before (its full view, minus ``updated_at``); ``/health`` must answer; and, the gateway having ONE upstream
connection slot, a good call right after must succeed with its own answer: a slot that was not given back would
make it wait ``POOL_TIMEOUT_S`` and fail 503, a connection left with unread bytes would hand them to it.

Every answer the fake sends carries tokens of its own (and so a text of its own, ``" w<token>"``): a byte of any
answer showing up where another answer (or an error) is expected is caught by ``check_no_foreign_bytes``.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
import pytest
from conftest import Service, run_gateway
from raw_upstream import CLOSE, RESET, RawRequest, RawUpstream, Step, chunked, http_response, sglang_answer, sse_event

from slime_wire.sse import SSEDecoder

REQUEST_TIMEOUT_S = 2.0
POOL_TIMEOUT_S = 0.5
NUM_LAYERS, TOPK = 2, 2
PROMPT = [1, 2, 3, 4]
SAMPLING = {"max_new_tokens": 2}
MODES = ("unary", "stream", "passthrough")
TURN_MODES = ("unary", "stream")
DRIP_EVERY_S = 0.2
DRIP_FOR_S = 5.0  # an answer dripped over this long would be complete long after the deadline
# Body defects come this long after the head: the head is in, so a streamed turn has begun (when the defect
# arrives with the head, the gateway may see both at once and answer a plain HTTP error instead)
HEAD_FIRST_S = 0.1
SLOW_ANSWER_S = 1.2  # holds the only connection slot well past POOL_TIMEOUT_S, and ends before REQUEST_TIMEOUT_S


# ---- the answers the fake upstream sends ----------------------------------------------------------------------------
def head(*headers: str, status_line: str = "HTTP/1.1 200 OK") -> bytes:
    return (status_line + "\r\n" + "".join(line + "\r\n" for line in headers) + "\r\n").encode()


def stream_events(answer: bytes) -> list[bytes]:
    """SGLang's cumulative stream of ``answer``: one chunk per token (``finish_reason`` null), the last one being
    the whole answer (with the routing)."""
    full = orjson.loads(answer)
    ids, meta = full["output_ids"], full["meta_info"]
    events = []
    for n in range(1, len(ids)):
        partial = {
            "id": meta["id"],
            "finish_reason": None,
            "prompt_tokens": meta["prompt_tokens"],
            "completion_tokens": n,
            "cached_tokens": 0,
            "output_token_logprobs": meta["output_token_logprobs"][:n],
        }
        text = "".join(f" w{t}" for t in ids[:n])
        events.append(orjson.dumps({"text": text, "output_ids": ids[:n], "meta_info": partial}))
    events.append(answer)
    return events


@dataclass(frozen=True)
class Answer:
    """A valid answer to one request, with tokens no other answer has."""

    first_token: int
    json: bytes  # the SGLang answer (for a streamed request: its final chunk)
    events: list[bytes] | None  # a streamed request's SSE payloads, [DONE] excluded

    @property
    def tokens(self) -> list[int]:
        return [self.first_token, self.first_token + 1]

    @property
    def marker(self) -> bytes:
        """Bytes that occur in this answer (its text) and in no other: all tokens have 7 digits."""
        return b"w%d" % self.first_token

    @property
    def content_type(self) -> str:
        return "application/json" if self.events is None else "text/event-stream"

    @property
    def body(self) -> bytes:
        if self.events is None:
            return self.json
        return b"".join(sse_event(event) for event in self.events) + sse_event(b"[DONE]")

    def head(self, *headers: str, status_line: str = "HTTP/1.1 200 OK") -> bytes:
        return head(f"Content-Type: {self.content_type}", *headers, status_line=status_line)

    def framed(self) -> bytes:
        """The well-formed HTTP/1.1 answer: a Content-Length for JSON, one chunk per event for a stream."""
        if self.events is None:
            return self.head(f"Content-Length: {len(self.json)}") + self.json
        pieces = [sse_event(event) for event in self.events] + [sse_event(b"[DONE]")]
        return self.head("Transfer-Encoding: chunked") + chunked(*pieces)

    def cut(self) -> bytes:
        """A prefix of the body that is not all of it and holds no complete stream event."""
        first = self.json if self.events is None else sse_event(self.events[0])
        return self.body[: len(first) // 2]


class Answers:
    def __init__(self) -> None:
        self.by_key: dict[str, Answer] = {}  # by the rid of the request it answers, or a made-up key (stale ones)
        self._first_tokens = itertools.count(7_000_000, 10)

    def make(self, request: RawRequest, *, meta_rid: str | None = None, key: str | None = None) -> Answer:
        asked = request.json or {}
        first = next(self._first_tokens)
        answer_json = sglang_answer(request, first_token=first, num_layers=NUM_LAYERS, topk=TOPK, rid=meta_rid)
        answer = Answer(first, answer_json, stream_events(answer_json) if asked.get("stream") else None)
        self.by_key[key or asked["rid"]] = answer
        return answer


Build = Callable[["Env", RawRequest], list[Step]]


@dataclass
class Env:
    upstream: RawUpstream
    gateway: Service
    answers: Answers

    def good(self, request: RawRequest) -> list[Step]:
        if request.path != "/generate":
            return [http_response(b"{}")]
        return [self.answers.make(request).framed()]

    def script(self, build: Build) -> None:
        """Answer the coming ``/generate`` calls with ``build``; anything else normally."""

        def reply(request: RawRequest) -> list[Step]:
            return build(self, request) if request.path == "/generate" else self.good(request)

        self.upstream.reply = reply

    def answer(self, request: RawRequest, **kwargs: Any) -> Answer:
        return self.answers.make(request, **kwargs)


def start_env(**settings: str) -> Iterator[Env]:
    env = {f"GATEWAY_{name.upper()}": value for name, value in settings.items()}
    with RawUpstream() as upstream, run_gateway(upstream.url, "--log-level", "warning", env=env) as gateway:
        scripted = Env(upstream, gateway, Answers())
        upstream.reply = scripted.good
        yield scripted


@pytest.fixture(scope="module")
def narrow() -> Iterator[Env]:
    """The gateway with ONE upstream connection: a slot not given back, or bytes left on the connection, show up
    in the very next call."""
    yield from start_env(
        max_connections="1",
        request_timeout_s=str(REQUEST_TIMEOUT_S),
        pool_timeout_s=str(POOL_TIMEOUT_S),
        connect_timeout_s="1",
    )


@pytest.fixture
async def client(narrow: Env) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=narrow.gateway.url, timeout=15) as http:
        yield http
    narrow.upstream.reply = narrow.good


# ---- calls and checks -----------------------------------------------------------------------------------------------
@dataclass
class Outcome:
    mode: str
    status: int
    raw: bytes  # the whole response body
    events: list[dict[str, Any]] | None  # a 200 streamed turn's events, [DONE] excluded
    elapsed_s: float
    sent: list[RawRequest]  # what reached the upstream during the call
    request_body: bytes

    @property
    def generate_requests(self) -> list[RawRequest]:
        return [r for r in self.sent if r.path == "/generate"]

    def error(self) -> dict[str, Any]:
        if self.events is not None:  # an error inside a stream that had begun: it is the only event
            assert [event["type"] for event in self.events] == ["error"], self.events
            assert self.events[0]["turn"] is None, self.events  # nothing was folded
            error = self.events[0]["error"]
        else:
            error = orjson.loads(self.raw)["error"]
        assert isinstance(error["message"], str) and error["message"], error
        return error


async def new_session(client: httpx.AsyncClient) -> str:
    body = {"prompt_ids": PROMPT, "num_layers": NUM_LAYERS, "moe_router_topk": TOPK}
    response = await client.post("/v1/sessions", json=body)
    assert response.status_code == 201, response.text
    return response.json()["session_id"]


async def session_state(client: httpx.AsyncClient, sid: str) -> bytes:
    """The full view (every array) without ``updated_at``, which a failed turn may touch."""
    response = await client.get(f"/v1/sessions/{sid}", params={"full": "true"})
    assert response.status_code == 200, response.text
    view = response.json()
    del view["updated_at"]
    return orjson.dumps(view, option=orjson.OPT_SORT_KEYS)


async def call(env: Env, client: httpx.AsyncClient, mode: str, sid: str) -> Outcome:
    seen = len(env.upstream.requests)
    started = time.monotonic()
    events = None
    if mode == "passthrough":
        body = {"input_ids": PROMPT, "sampling_params": SAMPLING, "return_logprob": True}
        request_body = orjson.dumps(body | {"rid": f"pt-{uuid.uuid4().hex[:12]}"})
        response = await client.post("/generate", content=request_body, headers={"content-type": "application/json"})
        raw = response.content
    else:
        request_body = orjson.dumps({"sampling_params": SAMPLING, "stream": mode == "stream"})
        url = f"/v1/sessions/{sid}/generate"
        async with client.stream("POST", url, content=request_body) as response:
            raw = await response.aread()
        if mode == "stream" and response.status_code == 200:
            assert response.headers["content-type"].startswith("text/event-stream")
            payloads = [bytes(event.data) for event in SSEDecoder().feed(raw)]
            assert payloads[-1] == b"[DONE]", raw
            events = [orjson.loads(payload) for payload in payloads[:-1]]
    elapsed = time.monotonic() - started
    return Outcome(mode, response.status_code, raw, events, elapsed, env.upstream.requests[seen:], request_body)


def check_no_foreign_bytes(env: Env, outcome: Outcome, own: str | None = None) -> None:
    """No byte of an answer to another request (an earlier one, a stale one) reached this caller. ``own``: the
    rid of the call's request (by default: what reached the upstream during the call)."""
    mine = {own} if own is not None else {request.json["rid"] for request in outcome.generate_requests}
    for key, answer in list(env.answers.by_key.items()):
        if key not in mine:
            assert answer.marker not in outcome.raw, f"bytes of the answer to {key} leaked into {outcome.raw[:300]!r}"


async def generate_requests_since(env: Env, seen: int, timeout_s: float = 5.0) -> list[RawRequest]:
    """The ``/generate`` requests the upstream logged after its first ``seen`` requests, once there is one."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = [r for r in env.upstream.requests[seen:] if r.path == "/generate"]
        if found or time.monotonic() > deadline:
            return found
        await asyncio.sleep(0.01)


def requests_for(env: Env, rid: str) -> list[RawRequest]:
    """Every ``/generate`` the upstream received for ``rid``."""
    return [r for r in env.upstream.requests if r.path == "/generate" and (r.json or {}).get("rid") == rid]


def check_answered(env: Env, outcome: Outcome) -> RawRequest:
    """The call succeeded with exactly the answer the upstream sent for it, which it was asked once; returns
    that request."""
    assert outcome.status == 200, outcome.raw
    if outcome.mode == "passthrough":
        rid = orjson.loads(outcome.request_body)["rid"]
    elif outcome.mode == "unary":
        rid = orjson.loads(outcome.raw)["rid"]
    else:
        assert outcome.events, outcome.raw
        rid = outcome.events[-1]["rid"]
    (request,) = requests_for(env, rid)
    answer = env.answers.by_key[rid]
    if outcome.mode == "passthrough":
        assert request.body == outcome.request_body  # forwarded byte for byte, both ways
        assert outcome.raw == answer.body
    elif outcome.mode == "unary":
        summary = orjson.loads(outcome.raw)
        assert summary["new_token_ids"] == answer.tokens
        assert summary["text"] == "".join(f" w{t}" for t in answer.tokens)
    else:
        assert outcome.events is not None
        assert [event["type"] for event in outcome.events] == ["delta", "delta", "turn"], outcome.events
        assert [t for event in outcome.events[:-1] for t in event["token_ids"]] == answer.tokens
        assert outcome.events[-1]["new_token_ids"] == answer.tokens
    check_no_foreign_bytes(env, outcome, own=rid)
    return request


async def good_call(env: Env, client: httpx.AsyncClient, mode: str, sid: str) -> Outcome:
    env.upstream.reply = env.good
    outcome = await call(env, client, mode, sid)
    check_answered(env, outcome)
    return outcome


def check_failed(
    outcome: Outcome, status: int, error_type: str, *, in_band: bool = False, reason: str | None = None
) -> dict[str, Any]:
    """``in_band``: a streamed turn had begun (the upstream's head was in), so the error is its one event."""
    if outcome.mode == "stream" and in_band:
        assert outcome.status == 200, outcome.raw
        assert outcome.events is not None
    else:
        assert outcome.status == status, outcome.raw
        assert outcome.events is None
    error = outcome.error()
    assert error["type"] == error_type, error
    if reason is not None:
        assert error.get("reason") == reason, error
    return error


async def check_recovered(env: Env, client: httpx.AsyncClient, mode: str, sid: str, before: bytes) -> None:
    assert await session_state(client, sid) == before
    health = await client.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    await good_call(env, client, mode, sid)


async def failing_call(
    env: Env,
    client: httpx.AsyncClient,
    mode: str,
    build: Build,
    status: int,
    error_type: str,
    *,
    in_band: bool = False,
    reason: str | None = None,
) -> Outcome:
    """A session with an earlier answer (whose bytes must never come back), then a call answered by ``build``:
    the expected error, nothing changed, and the gateway fully usable right after."""
    sid = await new_session(client)
    await good_call(env, client, mode, sid)
    before = await session_state(client, sid)
    env.script(build)
    outcome = await call(env, client, mode, sid)
    env.upstream.reply = env.good
    check_failed(outcome, status, error_type, in_band=in_band, reason=reason)
    check_no_foreign_bytes(env, outcome)
    await check_recovered(env, client, mode, sid, before)
    return outcome


# ---- broken heads: the gateway never gets an answer (a streamed turn fails before it began) -------------------------
def bad_header(*lines: str) -> Build:
    """A head with ``lines`` (and the answer's Content-Type), then the whole valid body; the connection stays open."""

    def build(env: Env, request: RawRequest) -> list[Step]:
        answer = env.answer(request)
        return [answer.head(*lines) + answer.body]

    return build


def conflicting_lengths(env: Env, request: RawRequest) -> list[Step]:
    answer = env.answer(request)
    n = len(answer.body)
    return [answer.head(f"Content-Length: {n}", f"Content-Length: {n + 5}") + answer.body]


def short_status(env: Env, request: RawRequest) -> list[Step]:
    answer = env.answer(request)
    return [answer.head(f"Content-Length: {len(answer.body)}", status_line="HTTP/1.1 20") + answer.body]


def huge_header_line(env: Env, request: RawRequest) -> list[Step]:
    answer = env.answer(request)
    return [answer.head("X-Padding: " + "a" * (1 << 20), f"Content-Length: {len(answer.body)}") + answer.body]


def no_status_line(env: Env, request: RawRequest) -> list[Step]:
    answer = env.answer(request)
    return [f"Content-Type: {answer.content_type}\r\nContent-Length: {len(answer.body)}\r\n\r\n".encode() + answer.body]


def bare_body(env: Env, request: RawRequest) -> list[Step]:
    return [env.answer(request).body]


BROKEN_HEADS: dict[str, Build] = {
    "content_length_abc": bad_header("Content-Length: abc"),
    "content_length_list": bad_header("Content-Length: 5, 5"),
    "content_length_negative": bad_header("Content-Length: -10"),
    "content_length_underscore": bad_header("Content-Length: 1_0"),
    "content_length_plus": bad_header("Content-Length: +10"),
    "content_length_conflicting": conflicting_lengths,
    # RFC 9112 6.3: both "ought to be handled as an error" (request smuggling, response splitting)
    "content_length_with_chunked": bad_header("Content-Length: 10", "Transfer-Encoding: chunked"),
    "status_code_two_digits": short_status,
    "header_line_1mb": huge_header_line,
    "header_line_70kb": bad_header("X-Padding: " + "a" * 70_000),  # over MAX_HEAD_BYTES, yet in one read
    "no_status_line": no_status_line,
    "bare_body": bare_body,
}


@pytest.mark.parametrize("defect", list(BROKEN_HEADS))
@pytest.mark.parametrize("mode", MODES)
async def test_broken_head_is_a_protocol_error(narrow: Env, client: httpx.AsyncClient, mode: str, defect: str) -> None:
    await failing_call(
        narrow, client, mode, BROKEN_HEADS[defect], 502, "upstream_protocol_error", reason="http_framing"
    )


# ---- broken bodies: the head was good (a streamed turn had begun: the error is an event of its stream) --------------
def chunk_size_0x3(env: Env, request: RawRequest) -> list[Step]:
    answer = env.answer(request)
    return [answer.head("Transfer-Encoding: chunked"), HEAD_FIRST_S, b"0x3\r\nabc\r\n0\r\n\r\n"]


def chunk_without_crlf(env: Env, request: RawRequest) -> list[Step]:
    answer = env.answer(request)
    return [answer.head("Transfer-Encoding: chunked"), HEAD_FIRST_S, b"3\r\nabcdef\r\n0\r\n\r\n"]


@pytest.mark.parametrize("build", [chunk_size_0x3, chunk_without_crlf], ids=["chunk_size_0x3", "chunk_overrun"])
@pytest.mark.parametrize("mode", MODES)
async def test_broken_chunked_framing_is_a_protocol_error(
    narrow: Env, client: httpx.AsyncClient, mode: str, build: Build
) -> None:
    await failing_call(narrow, client, mode, build, 502, "upstream_protocol_error", in_band=True, reason="http_framing")


def truncated(env: Env, request: RawRequest) -> list[Step]:
    answer = env.answer(request)
    return [answer.head(f"Content-Length: {len(answer.body) + 100}"), HEAD_FIRST_S, answer.cut(), CLOSE]


def truncated_big(env: Env, request: RawRequest) -> list[Step]:
    """A big Content-Length (a body read into a pooled buffer), half of it sent (no complete event), then the end."""
    answer = env.answer(request)
    return [answer.head("Content-Length: 200000"), HEAD_FIRST_S, b"data: " + b"x" * 100_000, CLOSE]


def reset_mid_answer(env: Env, request: RawRequest) -> list[Step]:
    answer = env.answer(request)
    return [answer.head(f"Content-Length: {len(answer.body)}"), HEAD_FIRST_S, answer.cut(), HEAD_FIRST_S, RESET]


def reset_mid_chunk(env: Env, request: RawRequest) -> list[Step]:
    answer = env.answer(request)
    cut = b"%x\r\n" % len(answer.body) + answer.cut()
    return [answer.head("Transfer-Encoding: chunked"), HEAD_FIRST_S, cut, HEAD_FIRST_S, RESET]


@pytest.mark.parametrize(
    "build", [truncated, truncated_big, reset_mid_answer, reset_mid_chunk], ids=lambda build: build.__name__
)
@pytest.mark.parametrize("mode", MODES)
async def test_answer_cut_short_is_connection_lost(
    narrow: Env, client: httpx.AsyncClient, mode: str, build: Build
) -> None:
    await failing_call(narrow, client, mode, build, 502, "upstream_connection_lost", in_band=True)


@pytest.mark.parametrize("length", [2**64 - 1, 10**14], ids=["2^64-1", "100TB"])
@pytest.mark.parametrize("mode", MODES)
async def test_huge_content_length_cut_short_is_a_502(
    narrow: Env, client: httpx.AsyncClient, mode: str, length: int
) -> None:
    """A Content-Length no buffer can hold (llhttp accepts up to 2^64-1; 100 TB is more than mmap maps under the
    kernel's default overcommit heuristic), a few bytes, then the end. The body was cut short, or its length
    refused: a 502 either way, never the plain-text 500 of an exception escaping the transport (a unary turn and
    the passthrough read the body into a buffer presized from the Content-Length)."""

    def build(env: Env, request: RawRequest) -> list[Step]:
        answer = env.answer(request)
        return [answer.head(f"Content-Length: {length}"), HEAD_FIRST_S, answer.cut(), CLOSE]

    sid = await new_session(client)
    await good_call(narrow, client, mode, sid)
    before = await session_state(client, sid)
    narrow.script(build)
    outcome = await call(narrow, client, mode, sid)
    narrow.upstream.reply = narrow.good
    assert outcome.status == (200 if mode == "stream" else 502), outcome.raw
    assert outcome.error()["type"] in ("upstream_connection_lost", "upstream_protocol_error")
    await check_recovered(narrow, client, mode, sid, before)


# ---- no answer at all: the request may have run, so it is never sent again ------------------------------------------
@pytest.mark.parametrize("how", [CLOSE, RESET])
@pytest.mark.parametrize("mode", MODES)
async def test_closed_without_answering_is_not_resent(
    narrow: Env, client: httpx.AsyncClient, mode: str, how: str
) -> None:
    sid = await new_session(client)
    await good_call(narrow, client, mode, sid)
    # a unary call leaves its connection in the pool: the failing request goes out on a REUSED connection, the
    # one case where a client is tempted to send it again
    pooled = check_answered(narrow, await good_call(narrow, client, "unary", await new_session(client)))
    before = await session_state(client, sid)
    narrow.script(lambda env, request: [how])
    outcome = await call(narrow, client, mode, sid)
    check_failed(outcome, 502, "upstream_connection_lost")
    (sent,) = outcome.generate_requests
    assert sent.connection == pooled.connection
    if mode == "passthrough":
        assert sent.body == outcome.request_body
    check_no_foreign_bytes(narrow, outcome)
    await check_recovered(narrow, client, mode, sid, before)
    assert requests_for(narrow, sent.json["rid"]) == [sent]  # sent exactly once, never again


# ---- answers for someone else ---------------------------------------------------------------------------------------
FOREIGN_RID = "someone-else-0-12345678"


def foreign(env: Env, request: RawRequest) -> list[Step]:
    return [env.answer(request, meta_rid=FOREIGN_RID).framed()]


def foreign_stream_cut_short(env: Env, request: RawRequest) -> list[Step]:
    """A foreign stream's first chunk, then the connection dies: what came must not be folded as a partial turn."""
    answer = env.answer(request, meta_rid=FOREIGN_RID)
    assert answer.events is not None
    first = sse_event(answer.events[0])
    return [answer.head("Transfer-Encoding: chunked"), HEAD_FIRST_S, b"%x\r\n%s\r\n" % (len(first), first), 0.1, RESET]


@pytest.mark.parametrize(
    ("mode", "build"),
    [("unary", foreign), ("stream", foreign), ("stream", foreign_stream_cut_short)],
    ids=["unary", "stream", "stream_cut_short"],
)
async def test_answer_for_another_rid_is_refused(
    narrow: Env, client: httpx.AsyncClient, mode: str, build: Build
) -> None:
    """Nothing of it is folded, and (streamed) none of its tokens reach the caller as deltas."""
    outcome = await failing_call(
        narrow, client, mode, build, 502, "upstream_protocol_error", in_band=True, reason="foreign_answer"
    )
    assert FOREIGN_RID in outcome.error()["message"]


def stale_answer(env: Env, request: RawRequest) -> bytes:
    """An answer nobody asked for, with tokens of its own (registered, so its bytes are looked for everywhere)."""
    stale = env.answer(request, meta_rid=request.json["rid"], key=f"stale-{uuid.uuid4().hex[:8]}")
    return stale.framed()


def late_in_the_same_write(env: Env, request: RawRequest) -> list[Step]:
    return [env.answer(request).framed() + stale_answer(env, request)]


def late_on_the_idle_connection(env: Env, request: RawRequest) -> list[Step]:
    return [env.answer(request).framed(), 0.1, stale_answer(env, request)]


def trailing_garbage(env: Env, request: RawRequest) -> list[Step]:
    return [env.answer(request).framed() + b"garbage\r\n\r\n"]


@pytest.mark.parametrize(
    "build",
    [late_in_the_same_write, late_on_the_idle_connection, trailing_garbage],
    ids=lambda build: build.__name__,
)
@pytest.mark.parametrize("mode", MODES)
async def test_bytes_after_an_answer_never_reach_the_next_call(
    narrow: Env, client: httpx.AsyncClient, mode: str, build: Build
) -> None:
    """The answer itself stands; the connection they arrived on is never used again."""
    sid = await new_session(client)
    narrow.script(build)
    first = check_answered(narrow, await call(narrow, client, mode, sid))
    narrow.upstream.reply = narrow.good
    await asyncio.sleep(0.3)  # the late bytes are in
    second = check_answered(narrow, await good_call(narrow, client, mode, sid))
    assert second.connection != first.connection
    unary = check_answered(narrow, await good_call(narrow, client, "unary", sid))
    assert unary.connection != first.connection


async def test_late_answer_on_a_reused_connection_is_refused(narrow: Env, client: httpx.AsyncClient) -> None:
    """The upstream answers, and answers that request AGAIN once the next request is on the same keep-alive
    connection: HTTP cannot tell the late answer from the next one's; the rid check does, and nothing is folded."""
    sid = await new_session(client)
    await good_call(narrow, client, "unary", sid)
    narrow.script(lambda env, request: [env.answer(request).framed(), 0.4, stale_answer(env, request)])
    first = check_answered(narrow, await call(narrow, client, "unary", sid))
    narrow.upstream.reply = narrow.good
    before = await session_state(client, sid)
    seen = len(narrow.upstream.requests)
    second = await call(narrow, client, "unary", sid)  # right away, before the late answer
    # The fake upstream logs the second request only once its script for the first is done (the same connection),
    # which can be just after the gateway already answered 502: wait for the log, not for the gateway.
    (sent,) = await generate_requests_since(narrow, seen)
    assert sent.connection == first.connection  # the reused connection
    check_failed(second, 502, "upstream_protocol_error", reason="foreign_answer")
    assert first.json["rid"] in second.error()["message"]
    check_no_foreign_bytes(narrow, second, own=sent.json["rid"])
    # the real answer to the second request follows on that connection: it must be discarded too
    await asyncio.sleep(0.2)
    await check_recovered(narrow, client, "unary", sid, before)


# ---- valid framings that are not the everyday one -------------------------------------------------------------------
def http10_until_close(env: Env, request: RawRequest) -> list[Step]:
    answer = env.answer(request)
    return [answer.head(status_line="HTTP/1.0 200 OK") + answer.body, CLOSE]


def continue_first(env: Env, request: RawRequest) -> list[Step]:
    return [b"HTTP/1.1 100 Continue\r\n\r\n", 0.05, env.answer(request).framed()]


def early_hints_first(env: Env, request: RawRequest) -> list[Step]:
    hints = b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n"
    return [hints + env.answer(request).framed()]


def body_until_close_after_unknown_coding(env: Env, request: RawRequest) -> list[Step]:
    """``Transfer-Encoding: xchunkedx`` is not chunked: the body runs until the connection closes (RFC 9112 6.3)."""
    answer = env.answer(request)
    return [answer.head("Transfer-Encoding: xchunkedx") + answer.body, CLOSE]


@pytest.mark.parametrize(
    "build",
    [http10_until_close, continue_first, early_hints_first, body_until_close_after_unknown_coding],
    ids=lambda build: build.__name__,
)
@pytest.mark.parametrize("mode", MODES)
async def test_valid_framings_are_answers(narrow: Env, client: httpx.AsyncClient, mode: str, build: Build) -> None:
    sid = await new_session(client)
    await good_call(narrow, client, mode, sid)
    narrow.script(build)
    outcome = await call(narrow, client, mode, sid)
    narrow.upstream.reply = narrow.good
    check_answered(narrow, outcome)
    await good_call(narrow, client, mode, sid)


def chunked_under_unknown_coding(env: Env, request: RawRequest) -> list[Step]:
    """``xchunkedx`` is not chunked: what follows (chunk framing) IS the body, up to the end of the connection."""
    answer = env.answer(request)
    return [answer.head("Transfer-Encoding: xchunkedx") + chunked(answer.body), CLOSE]


async def test_unknown_coding_body_is_not_dechunked_for_a_turn(narrow: Env, client: httpx.AsyncClient) -> None:
    """The body is the chunk framing itself, which is not JSON."""
    await failing_call(narrow, client, "unary", chunked_under_unknown_coding, 502, "upstream_protocol_error")


async def test_unknown_coding_body_is_relayed_by_the_passthrough(narrow: Env, client: httpx.AsyncClient) -> None:
    sid = await new_session(client)
    narrow.script(chunked_under_unknown_coding)
    outcome = await call(narrow, client, "passthrough", sid)
    narrow.upstream.reply = narrow.good
    assert outcome.status == 200
    (sent,) = outcome.generate_requests
    assert outcome.raw == chunked(narrow.answers.by_key[sent.json["rid"]].body)  # byte for byte, framing included
    await good_call(narrow, client, "passthrough", sid)


# ---- time: the deadline covers the whole call; the pool wait is bounded ----------------------------------------------
def dripping(env: Env, request: RawRequest) -> list[Step]:
    """A valid answer, a few bytes every DRIP_EVERY_S: complete after DRIP_FOR_S, long past the deadline. A streamed
    turn gets only its final event this way (so no token arrives before the deadline)."""
    answer = env.answer(request)
    body = answer.json if answer.events is None else sse_event(answer.events[-1]) + sse_event(b"[DONE]")
    steps: list[Step] = [answer.head(f"Content-Length: {len(body)}")]
    drips = int(DRIP_FOR_S / DRIP_EVERY_S)
    size = -(-len(body) // drips)
    for at in range(0, len(body), size):
        steps += [body[at : at + size], DRIP_EVERY_S]
    return steps


@pytest.mark.parametrize("mode", MODES)
async def test_dripping_answer_times_out_at_the_deadline(narrow: Env, client: httpx.AsyncClient, mode: str) -> None:
    outcome = await failing_call(narrow, client, mode, dripping, 504, "upstream_timeout", in_band=True)
    assert REQUEST_TIMEOUT_S - 0.2 <= outcome.elapsed_s <= REQUEST_TIMEOUT_S + 1.0, outcome.elapsed_s


@pytest.mark.parametrize("mode", MODES)
async def test_held_connection_slot_is_503_after_the_pool_timeout(
    narrow: Env, client: httpx.AsyncClient, mode: str
) -> None:
    holder_sid, sid = await new_session(client), await new_session(client)
    await good_call(narrow, client, mode, sid)
    before = await session_state(client, sid)
    narrow.script(lambda env, request: [SLOW_ANSWER_S, env.answer(request).framed()])
    seen = len(narrow.upstream.requests)
    holder = asyncio.create_task(call(narrow, client, "unary", holder_sid))
    while len(narrow.upstream.requests) == seen:  # the holder's request is upstream: it holds the only slot
        await asyncio.sleep(0.01)
    outcome = await call(narrow, client, mode, sid)
    check_failed(outcome, 503, "upstream_unavailable")
    assert POOL_TIMEOUT_S - 0.1 <= outcome.elapsed_s <= POOL_TIMEOUT_S + 0.5, outcome.elapsed_s
    assert outcome.generate_requests == []  # nothing was sent: a 503 is safe to retry
    check_answered(narrow, await holder)
    narrow.upstream.reply = narrow.good
    await check_recovered(narrow, client, mode, sid, before)


# ---- many connections, each closed by the upstream right after its answer -------------------------------------------
@pytest.fixture(scope="module")
def wide() -> Iterator[Env]:
    """Fewer upstream connections than concurrent turns: connections come back to the pool, closed or closing."""
    yield from start_env(max_connections="16", request_timeout_s="20", pool_timeout_s="20")


def close_after_answering(announced: bool) -> Build:
    def build(env: Env, request: RawRequest) -> list[Step]:
        answer = env.answer(request).framed()
        if announced:
            answer = answer.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n", 1)
        return [answer, CLOSE]

    return build


@pytest.mark.parametrize(
    ("mode", "announced"),
    [
        ("unary", True),
        ("stream", True),
        # a streamed turn never leaves its connection in the pool (it stops reading at the final chunk)
        ("stream", False),
        ("unary", False),
    ],
    ids=["unary-connection_close", "stream-connection_close", "stream-silent", "unary-silent"],
)
async def test_close_after_every_answer_under_200_concurrent_turns(wide: Env, mode: str, announced: bool) -> None:
    async with httpx.AsyncClient(base_url=wide.gateway.url, timeout=30, limits=httpx.Limits()) as client:
        await new_session(client)  # a first call, alone (200 concurrent first calls of an httpx client crawl)
        sids = await asyncio.gather(*(new_session(client) for _ in range(200)))
        wide.script(close_after_answering(announced))
        try:
            outcomes = await asyncio.gather(*(call(wide, client, mode, sid) for sid in sids))
        finally:
            wide.upstream.reply = wide.good
        statuses = [outcome.status for outcome in outcomes]
        assert statuses == [200] * 200, sorted(statuses)
        requests = [check_answered(wide, outcome) for outcome in outcomes]
        assert len({request.connection for request in requests}) == 200  # each on a connection of its own
        await asyncio.sleep(0.1)  # every close is in: the pool holds only dead connections now
        await good_call(wide, client, mode, await new_session(client))
