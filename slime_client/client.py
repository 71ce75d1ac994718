"""``GatewayClient`` (one pool of keep-alive HTTP/1.1 connections) and ``Session`` (one rollout sample on the gateway).

The transport is ``slime_wire.http1.ConnectionPool``, the gateway's own: llhttp parses every answer head, a sample's
body is received straight into the buffer its tensors then view (``RolloutSample.from_safetensors``: no copy after
the kernel's), and a small call costs ~0.1 ms of CPU on a plain asyncio loop rather than the ~1 ms of httpx. It
runs on any asyncio event loop (uvloop is not needed). Why and how much: bench row 3.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import mmap
import os
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from types import TracebackType
from typing import Any, Literal, overload
from urllib.parse import quote, urlencode

import orjson

from slime_client import _retry
from slime_client.errors import GatewayResponseError, make_status_error, translate_transport_error
from slime_client.sample import RolloutSample, SampleBuffers, TurnTensors
from slime_client.staleness import StalenessBound, keep_within, within_bound
from slime_client.streaming import TurnStream
from slime_client.types import DeleteAfterTurn, SessionState, SessionSummary, SessionSync, TurnResult
from slime_wire.errors import TransportError
from slime_wire.http1 import BodyBuffers, ConnectionPool, Response
from slime_wire.memory import keep_freed_memory

log = logging.getLogger("slime_client")

# The deadline of one HTTP exchange, in seconds: connecting, sending, and the whole answer (a streamed turn: to its
# last event). A model turn can legitimately take minutes; the gateway's own upstream timeout (600 s by default)
# should fire first, so the caller gets the gateway's 504 verdict rather than a client timeout that leaves the turn
# running behind its back.
DEFAULT_TIMEOUT = 900.0
DEFAULT_CONNECT_TIMEOUT = 5.0  # opening one connection (within the call's deadline)
# Retries: enough to ride out a failover (a replica behind a load balancer, a Redis Cluster node: seconds), never
# past DEFAULT_RETRY_FOR_S after the first attempt (see ``slime_client._retry``).
DEFAULT_MAX_RETRIES = 30
DEFAULT_RETRY_FOR_S = 30.0
# A trainer keeps hundreds of turns in flight (slime: server concurrency x engines).
DEFAULT_MAX_CONNECTIONS = 1024
# Below the gateway's (uvicorn's) 5 s keep-alive: reusing a connection the server is closing at that very
# moment fails after the request was written, and a model turn that failed that way may not be retried.
DEFAULT_KEEPALIVE_EXPIRY_S = 2.0
# Pooled receive buffers for big JSON answers (``state(full=True)``, long session lists); samples never use them.
SPARE_BUFFER_BYTES = 32 << 20
SAFETENSORS_MEDIA_TYPE = "application/vnd.safetensors"
SAFETENSORS_ACCEPT = SAFETENSORS_MEDIA_TYPE.encode()
JSON_CONTENT_TYPE = (b"content-type", b"application/json")
EVENT_STREAM = b"text/event-stream"
USER_AGENT = b"slime-client"
# The gateway's API key when ``GatewayClient`` is not given one (as openai-python reads OPENAI_API_KEY).
API_KEY_ENV = "SLIME_GATEWAY_API_KEY"
RETRY_FOR_ENV = "SLIME_GATEWAY_RETRY_FOR_S"
# "0" (or false/no/off) keeps glibc's malloc settings as they are; see ``keep_freed_memory_once``.
KEEP_FREED_MEMORY_ENV = "SLIME_CLIENT_KEEP_FREED_MEMORY"


@functools.cache
def keep_freed_memory_once() -> bool:
    """Raise glibc's mmap and trim thresholds for this process (``slime_wire.memory.keep_freed_memory``), once, when
    the first ``GatewayClient`` is created; True if they were set.

    A fetched sample is received into fresh ``malloc`` memory that its tensors then view (a recycled buffer cannot
    be reused while they live). With glibc's defaults a multi-megabyte block is a fresh ``mmap`` whose pages fault
    in on first write (~1 ms per MB on a VM: more than receiving the bytes) and go back to the OS on ``free``;
    with the thresholds raised (32 MiB, trim 256 MiB) freed sample buffers are reused warm. The cost: up to 256 MiB
    of freed heap stays in the process. ``SLIME_CLIENT_KEEP_FREED_MEMORY=0`` opts out, and nothing changes where
    ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` are set, or off glibc.
    """
    if os.environ.get(KEEP_FREED_MEMORY_ENV, "").strip().lower() in ("0", "false", "no", "off"):
        return False
    return keep_freed_memory()


class GatewayClient:
    """Async client for the gateway's v1 API. Use as ``async with GatewayClient(url) as gw: ...``.

    ``timeout`` (seconds, default ``DEFAULT_TIMEOUT``: 900) is the deadline of each HTTP exchange: connecting,
    sending and the whole answer, a streamed turn to its last event; a retry gets a deadline of its own. Past it
    the call raises ``GatewayTimeoutError``. ``connect_timeout`` (default 5 s) bounds opening one connection
    within that. ``max_retries`` (default 30) and ``retry_for_s`` (no retry starts later than this after the first
    attempt; None: ``SLIME_GATEWAY_RETRY_FOR_S``, else 30 s, as long as a Redis failover takes) bound the retries of
    failures that are safe to retry, honouring the gateway's ``Retry-After`` (see ``slime_client._retry``); the slime
    drop-in and ``slime_client.agent`` make their clients this way, so the environment variable sets theirs too.
    The client holds one pool of keep-alive connections (``slime_wire.http1``), bound to the event loop that first
    uses it; creating the first client also calls ``keep_freed_memory_once`` (``SLIME_CLIENT_KEEP_FREED_MEMORY=0``
    opts out).

    ``api_key`` is sent as ``Authorization: Bearer KEY`` on every request, streams included; None reads the
    ``SLIME_GATEWAY_API_KEY`` environment variable, ``""`` sends no key. A wrong or missing key raises
    ``AuthenticationError`` (401, never retried).
    """

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout: float | None = None,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        max_retries: int = DEFAULT_MAX_RETRIES,
        retry_for_s: float | None = None,
    ) -> None:
        if retry_for_s is None:
            retry_for_s = float(os.environ.get(RETRY_FOR_ENV, "").strip() or DEFAULT_RETRY_FOR_S)
        if max_retries < 0 or retry_for_s < 0:
            raise ValueError("max_retries and retry_for_s must be >= 0")
        self.timeout = DEFAULT_TIMEOUT if timeout is None else float(timeout)
        if not (self.timeout > 0 and connect_timeout > 0):
            raise ValueError("timeout and connect_timeout must be > 0 seconds")
        self.base_url = base_url.rstrip("/")
        self.max_retries = max_retries
        self.retry_for_s = float(retry_for_s)
        key = os.environ.get(API_KEY_ENV, "") if api_key is None else api_key
        self._auth_headers: tuple[tuple[bytes, bytes], ...] = (
            ((b"authorization", f"Bearer {key}".encode("latin-1")),) if key else ()
        )
        self._pool = ConnectionPool(
            self.base_url,
            max_connections=DEFAULT_MAX_CONNECTIONS,
            connect_timeout_s=connect_timeout,
            pool_timeout_s=self.timeout,
            keepalive_expiry_s=DEFAULT_KEEPALIVE_EXPIRY_S,
            buffers=BodyBuffers(SPARE_BUFFER_BYTES),
            user_agent=USER_AGENT,
        )
        self._sample_buffers = SampleBuffers()  # where sample bodies are received (big ones: reused once free)
        self._closed = False
        keep_freed_memory_once()

    # ---- lifecycle -------------------------------------------------------------------------------------------
    async def __aenter__(self) -> GatewayClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connection pool (a stream still open closes its own connection when it ends)."""
        self._closed = True
        await self._pool.aclose()

    @property
    def is_closed(self) -> bool:
        return self._closed

    # ---- API -------------------------------------------------------------------------------------------------
    async def health(self) -> dict[str, Any]:
        """``GET /health``: status, version and ``instance_id`` (changes when the gateway restarts)."""
        return await self._json("GET", "/health", idempotent=True)

    async def create_session(
        self,
        *,
        prompt_ids: Sequence[int] | None = None,
        num_layers: int | None = None,
        moe_router_topk: int | None = None,
        session_id: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        sampling_defaults: Mapping[str, Any] | None = None,
        max_context_tokens: int | None = None,
        max_turns: int | None = None,
        resume: bool = False,
    ) -> Session:
        """Start a session from prompt token ids; give ``num_layers`` and ``moe_router_topk`` for routing replay.
        Without ``prompt_ids``: a chat session, whose first chat request renders the prompt (``openai_base_url``).
        A chat session's caps (a trainer's, slime's): ``max_context_tokens`` (no branch longer: a prompt over it is
        refused, an answer cut to what is left), ``max_turns`` (model turns; past it chat requests are 429s), and
        ``sampling_defaults["max_new_tokens"]`` (every answer's length, at most). ``resume``: its token-level turns
        resubmit an answer the engine aborts mid-way (a weight update), as its chat turns always do (docs:
        operations/weight-updates)."""
        body = session_body(prompt_ids, num_layers, moe_router_topk, session_id, metadata, sampling_defaults)
        body.update({k: v for k, v in (("max_context_tokens", max_context_tokens), ("max_turns", max_turns)) if v})
        if resume:
            body["resume"] = True
        answer = await self._json("POST", "/v1/sessions", body=body, idempotent=False)
        summary = SessionSummary.from_json(answer)
        return Session(self, summary.session_id, summary=summary)

    async def start_session(
        self,
        *,
        prompt_ids: Sequence[int],
        sampling_params: Mapping[str, Any] | None = None,
        return_routed_experts: bool | None = None,
        delete_after_turn: DeleteAfterTurn = "never",
        num_layers: int | None = None,
        moe_router_topk: int | None = None,
        session_id: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        sampling_defaults: Mapping[str, Any] | None = None,
    ) -> TurnTensors:
        """Create a session and run its first model turn in one round trip, answered with the turn's tensors.

        All or nothing on the gateway: if the turn fails no session is left, so the call is safe to repeat.
        ``delete_after_turn``: "never" keeps the session, "always" drops it after the turn (a single-turn sample
        in one request), "if_finished" drops it once completed or truncated (pending/aborted ones stay).
        """
        body = session_body(prompt_ids, num_layers, moe_router_topk, session_id, metadata, sampling_defaults)
        body["generate"] = turn_body(sampling_params, return_routed_experts, None, delete_after_turn)
        content = await self._safetensors("POST", "/v1/sessions", body=body, idempotent=False)
        return TurnTensors.from_safetensors(content)

    async def session(self, session_id: str) -> Session:
        """Attach to an existing session (raises ``NotFoundError`` if the gateway does not hold it)."""
        session = Session(self, session_id)
        await session.state()
        return session

    async def list_sessions(self) -> list[SessionSummary]:
        answer = await self._json("GET", "/v1/sessions", idempotent=True)
        return [SessionSummary.from_json(item) for item in answer.get("sessions", [])]

    async def fetch_samples(
        self, session_ids: Sequence[str], *, staleness: StalenessBound | None = None
    ) -> list[RolloutSample]:
        """Several sessions' samples in one round trip (``POST /v1/samples``), in the order asked. A chat session
        whose history was edited holds several trajectories: each is its own sample (``RolloutSample.branch``).
        ``staleness``: the bound on how old the weights of their trained tokens may be (``slime_client.staleness``):
        samples past it left out, or their too-stale tokens masked."""
        if not session_ids:
            return []
        body = {"session_ids": list(session_ids)}
        content = await self._safetensors("POST", "/v1/samples", body=body, idempotent=True)  # a read
        return keep_within(RolloutSample.group_from_safetensors(content), staleness)

    # ---- transport -------------------------------------------------------------------------------------------
    async def _json(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        params: Mapping[str, str] | None = None,
        idempotent: bool,
        resendable: bool = False,
    ) -> Any:
        _, content = await self._send(
            method, path, body=body, params=params, idempotent=idempotent, resendable=resendable
        )
        try:
            return orjson.loads(content)
        except orjson.JSONDecodeError as exc:
            raise GatewayResponseError(f"{method} {path}: the answer is not JSON: {exc}") from exc

    async def _safetensors(
        self, method: str, path: str, *, body: Any = None, idempotent: bool, resendable: bool = False
    ) -> Any:
        """A sample's safetensors body, received straight into a buffer of its own (``new_sample_buffer``) that
        the sample's tensors then view. ``idempotent``, ``resendable``: as for ``_send`` (a turn answered in tensors
        is not idempotent; with ``sync`` it is resendable)."""
        response, content = await self._send(
            method,
            path,
            body=body,
            idempotent=idempotent,
            resendable=resendable,
            into=self._sample_buffers.take,
            accept=SAFETENSORS_ACCEPT,
        )
        media_type = response.content_type or ""
        if not media_type.startswith(SAFETENSORS_MEDIA_TYPE):
            raise GatewayResponseError(f"{method} {path}: expected {SAFETENSORS_MEDIA_TYPE}, got {media_type!r}")
        return content

    async def _send(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        params: Mapping[str, str] | None = None,
        idempotent: bool,
        resendable: bool = False,
        gone_is_done: bool = False,
        into: Callable[[int], Any] | None = None,
        stream: bool = False,
        accept: bytes | None = None,
    ) -> tuple[Response, Any]:
        """One API call with the retry policy; the one place transport errors (``slime_wire.errors``) become the
        SDK's. Returns the answer (status, headers) and its body: bytes, or for a success what ``into`` allocated
        and the body was received into; with ``stream`` a success comes back unread (the caller reads it with
        ``iter_raw`` and closes it) and its body is None. ``accept``: the media type asked for (``stream`` asks
        for ``text/event-stream``). ``resendable``: a second run is refused by the gateway rather than doubled (a
        turn or append with ``sync``), so it may be sent again after it may have arrived (``_retry``).

        ``gone_is_done``: a 404 after a retry of a request that may already have arrived means the first
        attempt did it (DELETE), so it is success.
        """
        if self._closed:
            raise RuntimeError("this GatewayClient is closed")
        target = path if not params else f"{path}?{urlencode(params)}"
        url = self.base_url + target
        payload = b"" if body is None else orjson.dumps(body)
        headers = self._headers(json=body is not None, accept=EVENT_STREAM if stream else accept)
        attempt = 0
        may_have_arrived = False
        give_up_at = time.monotonic() + self.retry_for_s
        while True:
            try:
                response, content = await self._exchange(method, target.encode(), headers, payload, into, stream)
            except TransportError as exc:
                retry = _retry.retryable_error(exc, idempotent=idempotent, resendable=resendable)
                delay = _retry.retry_delay(attempt)
                if not retry or attempt >= self.max_retries or time.monotonic() + delay > give_up_at:
                    raise translate_transport_error(exc, method, url) from exc
                may_have_arrived = may_have_arrived or _retry.may_have_arrived(exc)
                await self._wait_before_retry(attempt, method, url, type(exc).__name__, delay)
                attempt += 1
                continue
            status = response.status
            if 200 <= status < 300 or (gone_is_done and may_have_arrived and status == 404):
                return response, content
            error = make_status_error(status, content, response.headers)
            retry = _retry.retryable_status(
                status,
                idempotent=idempotent,
                resendable=resendable,
                retrying=may_have_arrived,
                error_type=error.error_type,
                reason=error.details.get("reason"),
            )
            delay = _retry.retry_delay(attempt, retry_after=_retry.retry_after(error.headers))
            if not retry or attempt >= self.max_retries or time.monotonic() + delay > give_up_at:
                raise error
            may_have_arrived = True
            await self._wait_before_retry(attempt, method, url, f"status {status} {error.error_type or ''}", delay)
            attempt += 1

    async def _exchange(
        self,
        method: str,
        target: bytes,
        headers: list[tuple[bytes, bytes]],
        payload: bytes,
        into: Callable[[int], Any] | None,
        stream: bool,
    ) -> tuple[Response, Any]:
        """Send once and read the answer (all of it, or a success's head only with ``stream``). The pool's
        ``Response.read`` gives its connection back (or closes it after a failure or a cancellation)."""
        response = await self._pool.request(method, target, headers, payload, timeout=self.timeout)
        success = 200 <= response.status < 300
        if stream and success:
            return response, None
        if into is not None and success:
            return response, await response.read(into=into)
        body = await response.read()
        if isinstance(body, mmap.mmap):  # a big answer lands in a pooled buffer: copied out, the buffer given back
            body, pooled = body[:], body
            self._pool.buffers.give_back(pooled)
        return response, body

    def _headers(self, *, json: bool = False, accept: bytes | None = None) -> list[tuple[bytes, bytes]]:
        """A request's headers: the API key, if any, the body's type and what the answer may be."""
        headers = list(self._auth_headers)
        if json:
            headers.append(JSON_CONTENT_TYPE)
        if accept is not None:
            headers.append((b"accept", accept))
        return headers

    async def _wait_before_retry(self, attempt: int, method: str, url: str, why: str, delay: float) -> None:
        log.info("%s %s failed (%s); retry %d/%d in %.2fs", method, url, why, attempt + 1, self.max_retries, delay)
        await asyncio.sleep(delay)


class Session:
    """One session on the gateway (one rollout sample). Get it from ``GatewayClient.create_session`` / ``.session``."""

    def __init__(self, client: GatewayClient, session_id: str, *, summary: SessionSummary | None = None) -> None:
        self.client = client
        self.session_id = session_id
        self.summary = summary  # as of creation; ``state()`` asks the gateway for the current one
        self._path = f"/v1/sessions/{quote(session_id, safe='')}"

    def __repr__(self) -> str:
        return f"Session({self.session_id!r})"

    @overload
    def generate(
        self,
        sampling_params: Mapping[str, Any] | None = None,
        *,
        return_routed_experts: bool | None = None,
        sync: SessionSync | None = None,
        stream: Literal[False] = False,
        resume: bool | None = None,
    ) -> Coroutine[Any, Any, TurnResult]: ...

    @overload
    def generate(
        self,
        sampling_params: Mapping[str, Any] | None = None,
        *,
        return_routed_experts: bool | None = None,
        sync: SessionSync | None = None,
        stream: Literal[True],
        resume: bool | None = None,
    ) -> TurnStream: ...

    def generate(
        self,
        sampling_params: Mapping[str, Any] | None = None,
        *,
        return_routed_experts: bool | None = None,
        sync: SessionSync | None = None,
        stream: bool = False,
        resume: bool | None = None,
    ) -> Coroutine[Any, Any, TurnResult] | TurnStream:
        """Run one model turn on the session's tokens and fold it in.

        ``await session.generate(...)`` returns the turn summary. ``stream=True`` returns a ``TurnStream``
        instead (``async for`` over ``TurnDelta`` events, then the ``TurnResult``; see ``slime_client.streaming``).
        ``return_routed_experts`` None: whatever the session was created for (routing replay iff it has a
        MoE shape). ``sync``: what the caller believes the session holds (as for ``generate_turn``); with it, a turn
        whose connection died before any answer is sent again (the gateway runs it at most once). ``resume``: resubmit
        the answer if the engine aborts it mid-way (None: the session's default); ``TurnResult.resumed`` says how
        often it was.
        """
        body = turn_body(sampling_params, return_routed_experts, sync, "never")
        if resume is not None:
            body["resume"] = resume
        if stream:
            path = f"{self._path}/generate"
            return TurnStream(self.client, path, body | {"stream": True}, resendable=sync is not None)
        return self._generate(body, resendable=sync is not None)

    async def generate_turn(
        self,
        sampling_params: Mapping[str, Any] | None = None,
        *,
        return_routed_experts: bool | None = None,
        sync: SessionSync | None = None,
        delete_after_turn: DeleteAfterTurn = "never",
    ) -> TurnTensors:
        """One model turn answered with its own tensors (``TurnTensors``): what a trainer folding turns itself needs,
        without fetching the history. ``sync``: what the caller believes the session holds; otherwise the gateway
        answers 409 ``session_mismatch`` (``ConflictError``, its ``details`` say what the session holds) and
        changes nothing. ``delete_after_turn``: as for ``GatewayClient.start_session``."""
        body = turn_body(sampling_params, return_routed_experts, sync, delete_after_turn)
        content = await self.client._safetensors(
            "POST", f"{self._path}/generate", body=body, idempotent=False, resendable=sync is not None
        )
        return TurnTensors.from_safetensors(content)

    async def _generate(self, body: dict[str, Any], *, resendable: bool) -> TurnResult:
        answer = await self.client._json(
            "POST", f"{self._path}/generate", body=body, idempotent=False, resendable=resendable
        )
        return TurnResult.from_json(answer)

    async def abort(self) -> SessionSummary:
        """Abort the running turn (answers once it ended, its tokens folded in, status aborted)."""
        answer = await self.client._json("POST", f"{self._path}/abort", idempotent=False)
        return SessionSummary.from_json(answer)

    async def close(self, wait_timeout_s: float = 5.0) -> dict[str, Any]:
        """Close the session before taking its samples: every turn asked for from now on is refused; running turns get
        ``wait_timeout_s`` to end, then are aborted. Answers once they have ended (``drained``), or the abort was
        not enough (``drained`` false: a turn still holds it). Idempotent (safe to send again)."""
        body = {"wait_timeout_s": wait_timeout_s}
        return await self.client._json("POST", f"{self._path}/close", body=body, idempotent=True)

    async def append(
        self, token_ids: Sequence[int], text: str | None = None, *, sync: SessionSync | None = None
    ) -> SessionSummary:
        """Append tool/environment tokens (not trainable: loss mask 0, log-prob 0.0). ``sync``: as for
        ``generate_turn``."""
        body: dict[str, Any] = {"token_ids": token_list(token_ids)}
        if text is not None:
            body["text"] = text
        if sync is not None:
            body["sync"] = sync.to_json()
        answer = await self.client._json(
            "POST", f"{self._path}/append", body=body, idempotent=False, resendable=sync is not None
        )
        return SessionSummary.from_json(answer)

    async def state(self, *, full: bool = False) -> SessionState:
        """The curl view: status, lengths, shapes, turn log; ``full=True`` adds every array as JSON lists."""
        params = {"full": "true"} if full else None
        answer = await self.client._json("GET", self._path, params=params, idempotent=True)
        return SessionState.from_json(answer)

    @overload
    async def fetch(self, branch: int | None = None) -> RolloutSample: ...

    @overload
    async def fetch(self, branch: int | None = None, *, staleness: StalenessBound) -> RolloutSample | None: ...

    async def fetch(
        self, branch: int | None = None, *, staleness: StalenessBound | None = None
    ) -> RolloutSample | None:
        """The compact sample (safetensors) as torch tensors: the root branch's, or ``branch``'s (a chat session grows
        a tree of them: edited histories, side conversations; ``fetch_all`` gets them all). ``staleness``: the bound
        on how old the weights of its trained tokens may be (``slime_client.staleness``): None when a "drop" bound
        drops it, its too-stale tokens masked under a "mask" one."""
        params = None if branch is None else f"?branch={branch}"
        content = await self.client._safetensors("GET", f"{self._path}/sample{params or ''}", idempotent=True)
        sample = RolloutSample.from_safetensors(content)
        return sample if staleness is None else within_bound(sample, staleness)

    async def fetch_all(self, *, staleness: StalenessBound | None = None) -> list[RolloutSample]:
        """Every branch of the session, one sample each, in the order they were started (one for a session that never
        forked); each sample's metadata says where its branch stands in the tree (``parent``, ``fork_token``, ...).
        ``staleness``: as for ``fetch``, the branches a "drop" bound drops left out."""
        return await self.client.fetch_samples([self.session_id], staleness=staleness)

    @property
    def openai_base_url(self) -> str:
        """The ``base_url`` an OpenAI (or Anthropic) client uses to chat in this session."""
        return f"{self.client.base_url}{self._path}"

    async def delete(self) -> None:
        await self.client._send("DELETE", self._path, idempotent=True, gone_is_done=True)


def session_body(
    prompt_ids: Sequence[int] | None,
    num_layers: int | None,
    moe_router_topk: int | None,
    session_id: str | None,
    metadata: Mapping[str, Any] | None,
    sampling_defaults: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """The body of ``POST /v1/sessions``, unset fields left out (no ``prompt_ids``: a chat session)."""
    body: dict[str, Any] = {} if prompt_ids is None else {"prompt_ids": token_list(prompt_ids)}
    optional = {
        "num_layers": num_layers,
        "moe_router_topk": moe_router_topk,
        "session_id": session_id,
        "metadata": None if metadata is None else dict(metadata),
        "sampling_defaults": None if sampling_defaults is None else dict(sampling_defaults),
    }
    body.update({key: value for key, value in optional.items() if value is not None})
    return body


def turn_body(
    sampling_params: Mapping[str, Any] | None,
    return_routed_experts: bool | None,
    sync: SessionSync | None,
    delete_after_turn: DeleteAfterTurn,
) -> dict[str, Any]:
    body: dict[str, Any] = {"sampling_params": dict(sampling_params or {})}
    if return_routed_experts is not None:
        body["return_routed_experts"] = return_routed_experts
    if sync is not None:
        body["sync"] = sync.to_json()
    if delete_after_turn != "never":
        body["delete_after_turn"] = delete_after_turn
    return body


def token_list(token_ids: Sequence[int]) -> list[int]:
    """Token ids as a JSON-ready list of Python ints (accepts lists, numpy arrays and torch tensors)."""
    to_list = getattr(token_ids, "tolist", None)
    return to_list() if callable(to_list) else [int(t) for t in token_ids]
