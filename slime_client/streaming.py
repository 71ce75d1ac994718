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

The request goes through the client's retry policy up to the answer's head (a connection that failed before the
request left, or a 503, is retried; with ``sync`` also a connection that died before any answer, and a busy
session while an earlier attempt's hold lasts; nothing is once an event may have arrived). A stream that fails
after its head raises the error a unary turn would (the error event's ``turn``, as ``partial_turn``: what the
session kept of it; None: nothing, the deltas received are void and the turn may be run again, safely with ``sync``).
The client's ``timeout`` is the deadline of the whole stream, to its last event. A stream read to its end leaves its
connection to the pool.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any

import orjson

from slime_client.errors import GatewayResponseError, make_stream_error, translate_transport_error
from slime_client.types import TurnResult
from slime_wire.errors import TransportError
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

    def __init__(self, client: GatewayClient, path: str, body: dict[str, Any], *, resendable: bool = False) -> None:
        self._client = client
        self._path = path
        self._body = body
        self._resendable = resendable
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
        response, _ = await self._client._send(
            "POST", self._path, body=self._body, idempotent=False, resendable=self._resendable, stream=True
        )
        pieces = response.iter_raw()
        events = _sse_events(pieces)
        try:
            async for event in events:
                if event is None:
                    async for _ in pieces:  # the chunked body's end: the connection goes back to the pool
                        pass
                    return
                yield self._typed(event)
        except TransportError as exc:
            raise translate_transport_error(exc, "POST", self._client.base_url + self._path) from exc
        finally:
            await events.aclose()
            await pieces.aclose()
            await response.aclose()  # closes the connection unless the answer was read to its end

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


async def _sse_events(pieces: AsyncIterator[bytes]) -> AsyncIterator[dict[str, Any] | None]:
    """``data:`` payloads as JSON objects; ``None`` for ``[DONE]``. The SSE framing is ``slime_wire.sse``, which
    scans each byte once (a rescan of the buffer per read would be quadratic in an event's size)."""
    events = SSEDecoder()
    async for chunk in pieces:
        for event in events.feed(chunk):
            if event.data == SSE_DONE:
                yield None
                return
            try:
                yield orjson.loads(event.data)
            except orjson.JSONDecodeError as exc:
                raise GatewayResponseError(f"unreadable stream event: {bytes(event.data[:80])!r}") from exc
