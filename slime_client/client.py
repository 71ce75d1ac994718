"""``GatewayClient`` (one pooled ``httpx.AsyncClient``) and ``Session`` (one rollout sample on the gateway)."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Coroutine, Mapping, Sequence
from types import TracebackType
from typing import Any, Literal, overload
from urllib.parse import quote

import httpx
import orjson

from slime_client import _retry
from slime_client.errors import GatewayResponseError, make_status_error, translate_transport_error
from slime_client.sample import RolloutSample
from slime_client.streaming import TurnStream
from slime_client.types import SessionState, SessionSummary, TurnResult

log = logging.getLogger("slime_client")

# A model turn can legitimately take minutes; the gateway's own upstream timeout (600 s by default) should
# fire first, so the caller gets the gateway's 504 verdict rather than a client timeout that leaves the turn
# running behind its back.
DEFAULT_TIMEOUT = httpx.Timeout(900.0, connect=5.0)
DEFAULT_MAX_RETRIES = 2
# A trainer keeps hundreds of turns in flight (slime: server concurrency x engines).
DEFAULT_MAX_CONNECTIONS = 1024
# Below the gateway's (uvicorn's) 5 s keep-alive: reusing a connection the server is closing at that very
# moment fails after the request was written, and a model turn that failed that way may not be retried.
DEFAULT_KEEPALIVE_EXPIRY_S = 2.0
SAFETENSORS_MEDIA_TYPE = "application/vnd.safetensors"
JSON_HEADERS = {"content-type": "application/json"}
# The gateway's API key when ``GatewayClient`` is not given one (as openai-python reads OPENAI_API_KEY).
API_KEY_ENV = "SLIME_GATEWAY_API_KEY"


class GatewayClient:
    """Async client for the gateway's v1 API. Use as ``async with GatewayClient(url) as gw: ...``.

    ``timeout`` applies to every request (default ``DEFAULT_TIMEOUT``; with ``http_client`` given and no
    ``timeout``, that client's own timeouts apply). ``max_retries`` bounds the retries of failures that are
    safe to retry (see ``slime_client._retry``). A given ``http_client`` is used as is and never closed here.

    ``api_key`` is sent as ``Authorization: Bearer KEY`` on every request, streams included; None reads the
    ``SLIME_GATEWAY_API_KEY`` environment variable, ``""`` sends no key. A wrong or missing key raises
    ``AuthenticationError`` (401, never retried).
    """

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout: float | httpx.Timeout | None = None,
        max_retries: int = DEFAULT_MAX_RETRIES,
        http_client: httpx.AsyncClient | None = None,
    ) -> None:
        if max_retries < 0:
            raise ValueError("max_retries must be >= 0")
        self.base_url = base_url.rstrip("/")
        self.max_retries = max_retries
        key = os.environ.get(API_KEY_ENV, "") if api_key is None else api_key
        # Per request rather than on the httpx client: a caller's own ``http_client`` is not ours to change.
        self._auth_headers = {"authorization": f"Bearer {key}"} if key else {}
        self._owns_http_client = http_client is None
        if http_client is None:
            http_client = httpx.AsyncClient(
                timeout=DEFAULT_TIMEOUT if timeout is None else timeout,
                limits=httpx.Limits(
                    max_connections=DEFAULT_MAX_CONNECTIONS,
                    max_keepalive_connections=DEFAULT_MAX_CONNECTIONS,
                    keepalive_expiry=DEFAULT_KEEPALIVE_EXPIRY_S,
                ),
            )
        self._http = http_client
        self._timeout: Any = httpx.USE_CLIENT_DEFAULT if timeout is None or self._owns_http_client else timeout

    # ---- lifecycle -------------------------------------------------------------------------------------------
    async def __aenter__(self) -> GatewayClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connection pool, if this client created it."""
        if self._owns_http_client:
            await self._http.aclose()

    @property
    def is_closed(self) -> bool:
        return self._http.is_closed

    # ---- API -------------------------------------------------------------------------------------------------
    async def health(self) -> dict[str, Any]:
        """``GET /health``: status, version and ``instance_id`` (changes when the gateway restarts)."""
        return await self._json("GET", "/health", idempotent=True)

    async def create_session(
        self,
        *,
        prompt_ids: Sequence[int],
        num_layers: int | None = None,
        moe_router_topk: int | None = None,
        session_id: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        sampling_defaults: Mapping[str, Any] | None = None,
    ) -> Session:
        """Start a session from prompt token ids; give ``num_layers`` and ``moe_router_topk`` for routing replay."""
        body: dict[str, Any] = {"prompt_ids": token_list(prompt_ids)}
        optional = {
            "num_layers": num_layers,
            "moe_router_topk": moe_router_topk,
            "session_id": session_id,
            "metadata": None if metadata is None else dict(metadata),
            "sampling_defaults": None if sampling_defaults is None else dict(sampling_defaults),
        }
        body.update({key: value for key, value in optional.items() if value is not None})
        answer = await self._json("POST", "/v1/sessions", body=body, idempotent=False)
        summary = SessionSummary.from_json(answer)
        return Session(self, summary.session_id, summary=summary)

    async def session(self, session_id: str) -> Session:
        """Attach to an existing session (raises ``NotFoundError`` if the gateway does not hold it)."""
        session = Session(self, session_id)
        await session.state()
        return session

    async def list_sessions(self) -> list[SessionSummary]:
        answer = await self._json("GET", "/v1/sessions", idempotent=True)
        return [SessionSummary.from_json(item) for item in answer.get("sessions", [])]

    async def fetch_samples(self, session_ids: Sequence[str]) -> list[RolloutSample]:
        """Several sessions' samples in one round trip (``POST /v1/samples``), in the order asked."""
        if not session_ids:
            return []
        body = {"session_ids": list(session_ids)}
        content = await self._safetensors("POST", "/v1/samples", body=body)
        return RolloutSample.group_from_safetensors(content)

    # ---- transport -------------------------------------------------------------------------------------------
    async def _json(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        params: Mapping[str, str] | None = None,
        idempotent: bool,
    ) -> Any:
        response = await self._send(method, path, body=body, params=params, idempotent=idempotent)
        try:
            return orjson.loads(response.content)
        except orjson.JSONDecodeError as exc:
            raise GatewayResponseError(f"{method} {path}: the answer is not JSON: {exc}") from exc

    async def _safetensors(self, method: str, path: str, *, body: Any = None) -> bytes:
        response = await self._send(method, path, body=body, idempotent=True)
        media_type = response.headers.get("content-type", "")
        if not media_type.startswith(SAFETENSORS_MEDIA_TYPE):
            raise GatewayResponseError(f"{method} {path}: expected {SAFETENSORS_MEDIA_TYPE}, got {media_type!r}")
        return response.content

    async def _send(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        params: Mapping[str, str] | None = None,
        idempotent: bool,
        gone_is_done: bool = False,
    ) -> httpx.Response:
        """One API call with the retry policy; the only place httpx errors are translated.

        ``gone_is_done``: a 404 after a retry of a request that may already have arrived means the first
        attempt did it (DELETE), so it is success.
        """
        url = self.base_url + path
        content = None if body is None else orjson.dumps(body)
        headers = self._headers(None if body is None else JSON_HEADERS)
        attempt = 0
        may_have_arrived = False
        while True:
            try:
                response = await self._http.request(
                    method, url, content=content, params=params, headers=headers, timeout=self._timeout
                )
            except httpx.HTTPError as exc:
                if attempt >= self.max_retries or not _retry.retryable_error(exc, idempotent=idempotent):
                    raise translate_transport_error(exc, method, url) from exc
                may_have_arrived = may_have_arrived or _retry.may_have_arrived(exc)
                await self._wait_before_retry(attempt, method, url, f"{type(exc).__name__}")
                attempt += 1
                continue
            if response.is_success or (gone_is_done and may_have_arrived and response.status_code == 404):
                return response
            if attempt >= self.max_retries or not _retry.retryable_status(response.status_code, idempotent=idempotent):
                raise make_status_error(response)
            may_have_arrived = True
            await self._wait_before_retry(attempt, method, url, f"status {response.status_code}")
            attempt += 1

    def _headers(self, extra: Mapping[str, str] | None = None) -> dict[str, str] | None:
        """A request's headers: ``extra`` and the API key, if any."""
        if not self._auth_headers:
            return None if extra is None else dict(extra)
        return {**self._auth_headers, **(extra or {})}

    async def _wait_before_retry(self, attempt: int, method: str, url: str, why: str) -> None:
        delay = _retry.retry_delay(attempt)
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
        stream: Literal[False] = False,
    ) -> Coroutine[Any, Any, TurnResult]: ...

    @overload
    def generate(
        self,
        sampling_params: Mapping[str, Any] | None = None,
        *,
        return_routed_experts: bool | None = None,
        stream: Literal[True],
    ) -> TurnStream: ...

    def generate(
        self,
        sampling_params: Mapping[str, Any] | None = None,
        *,
        return_routed_experts: bool | None = None,
        stream: bool = False,
    ) -> Coroutine[Any, Any, TurnResult] | TurnStream:
        """Run one model turn on the session's tokens and fold it in.

        ``await session.generate(...)`` returns the turn summary. ``stream=True`` returns a ``TurnStream``
        instead (``async for`` over ``TurnDelta`` events, then the ``TurnResult``; see ``slime_client.streaming``).
        ``return_routed_experts`` None: whatever the session was created for (routing replay iff it has a
        MoE shape).
        """
        body: dict[str, Any] = {"sampling_params": dict(sampling_params or {})}
        if return_routed_experts is not None:
            body["return_routed_experts"] = return_routed_experts
        if stream:
            return TurnStream(self.client, f"{self._path}/generate", body | {"stream": True})
        return self._generate(body)

    async def _generate(self, body: dict[str, Any]) -> TurnResult:
        answer = await self.client._json("POST", f"{self._path}/generate", body=body, idempotent=False)
        return TurnResult.from_json(answer)

    async def abort(self) -> SessionSummary:
        """Abort the running turn (answers once it ended, its tokens folded in, status aborted)."""
        answer = await self.client._json("POST", f"{self._path}/abort", idempotent=False)
        return SessionSummary.from_json(answer)

    async def append(self, token_ids: Sequence[int], text: str | None = None) -> SessionSummary:
        """Append tool/environment tokens (not trainable: loss mask 0, log-prob 0.0)."""
        body: dict[str, Any] = {"token_ids": token_list(token_ids)}
        if text is not None:
            body["text"] = text
        answer = await self.client._json("POST", f"{self._path}/append", body=body, idempotent=False)
        return SessionSummary.from_json(answer)

    async def state(self, *, full: bool = False) -> SessionState:
        """The curl view: status, lengths, shapes, turn log; ``full=True`` adds every array as JSON lists."""
        params = {"full": "true"} if full else None
        answer = await self.client._json("GET", self._path, params=params, idempotent=True)
        return SessionState.from_json(answer)

    async def fetch(self) -> RolloutSample:
        """The compact sample (safetensors) as torch tensors."""
        content = await self.client._safetensors("GET", f"{self._path}/sample")
        return RolloutSample.from_safetensors(content)

    async def delete(self) -> None:
        await self.client._send("DELETE", self._path, idempotent=True, gone_is_done=True)


def token_list(token_ids: Sequence[int]) -> list[int]:
    """Token ids as a JSON-ready list of Python ints (accepts lists, numpy arrays and torch tensors)."""
    to_list = getattr(token_ids, "tolist", None)
    return to_list() if callable(to_list) else [int(t) for t in token_ids]
