"""Streamed model turns: the gateway's SSE events as typed deltas, ending with the folded ``TurnResult``.

    async with session.generate(sampling_params, stream=True) as stream:
        async for event in stream:
            if isinstance(event, TurnDelta):
                print(event.text, end="")
            else:  # the last event: the turn as folded into the session
                result = event

Leaving the loop early (``break``, an exception, cancellation) closes the connection; the gateway then aborts
the upstream request and folds every token generated so far (status ``aborted``), so the session stays
coherent and the next ``generate`` continues from it. ``async with`` makes the close immediate; a bare
``async for`` closes when the stream object is garbage collected.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any

import httpx
import orjson

from slime_client.errors import GatewayResponseError, make_status_error, make_stream_error, translate_transport_error
from slime_client.types import TurnResult
from slime_wire.sse import SSEDecoder

if TYPE_CHECKING:
    from slime_client.client import GatewayClient

SSE_DONE = b"[DONE]"


@dataclass(frozen=True, slots=True)
class TurnDelta:
    """Tokens that arrived since the previous event (not yet folded: the turn is still running)."""

    token_ids: list[int]
    text: str
    completion_tokens: int  # this turn's tokens so far


class TurnStream:
    """An async iterator of ``TurnDelta`` events and, last, the ``TurnResult``. See the module docstring."""

    def __init__(self, client: GatewayClient, path: str, body: dict[str, Any]) -> None:
        self._client = client
        self._path = path
        self._body = body
        self._events = self._iterate()
        self.result: TurnResult | None = None

    def __aiter__(self) -> AsyncIterator[TurnDelta | TurnResult]:
        return self._events

    async def __aenter__(self) -> TurnStream:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connection now (the gateway folds what was generated and marks the session aborted)."""
        await self._events.aclose()

    async def final(self) -> TurnResult:
        """Consume the rest of the stream and return the folded turn."""
        async for _ in self:
            pass
        if self.result is None:
            raise GatewayResponseError(f"POST {self._path}: the stream ended without a turn event")
        return self.result

    async def _iterate(self) -> AsyncIterator[TurnDelta | TurnResult]:
        url = self._client.base_url + self._path
        content = orjson.dumps(self._body)
        headers = self._client._headers({"content-type": "application/json", "accept": "text/event-stream"})
        http = self._client._http
        try:
            async with http.stream("POST", url, content=content, headers=headers) as response:
                if not response.is_success:
                    await response.aread()
                    raise make_status_error(response)
                async for event in _sse_events(response):
                    if event is None:
                        return
                    yield self._typed(event)
        except httpx.HTTPError as exc:
            raise translate_transport_error(exc, "POST", url) from exc

    def _typed(self, event: dict[str, Any]) -> TurnDelta | TurnResult:
        kind = event.get("type")
        if kind == "delta":
            return TurnDelta(event["token_ids"], event.get("text", ""), event.get("completion_tokens", 0))
        if kind == "turn":
            body = {key: value for key, value in event.items() if key != "type"}
            self.result = TurnResult.from_json(body)
            return self.result
        if kind == "error":
            partial = event.get("turn")
            raise make_stream_error(event.get("error"), TurnResult.from_json(partial) if partial else None)
        raise GatewayResponseError(f"POST {self._path}: unknown stream event {kind!r}")


async def _sse_events(response: httpx.Response) -> AsyncIterator[dict[str, Any] | None]:
    """``data:`` payloads as JSON objects; ``None`` for ``[DONE]``. The SSE framing is ``slime_wire.sse``, which
    scans each byte once (a rescan of the buffer per read would be quadratic in an event's size)."""
    events = SSEDecoder()
    async for chunk in response.aiter_raw():
        for event in events.feed(chunk):
            if event.data == SSE_DONE:
                yield None
                return
            try:
                yield orjson.loads(event.data)
            except orjson.JSONDecodeError as exc:
                raise GatewayResponseError(f"unreadable stream event: {bytes(event.data[:80])!r}") from exc
