"""The SDK's one exception tree.

Every error the SDK raises is a ``GatewayError``. The transport's errors (``slime_wire.errors.TransportError``)
are translated at one boundary (``translate_transport_error``, used by the client's request loop and by streams)
with ``raise ... from exc``, and every gateway error answer becomes a typed ``GatewayStatusError`` in one function
(``make_status_error``, from the answer's status, body and headers).

    GatewayError
    ├── GatewayConnectionError       could not reach the gateway (refused, connect timeout), the connection broke
    │                                mid-request, or the answer was not valid HTTP/1.1
    ├── GatewayTimeoutError          no complete answer within the call's deadline, or no free connection in time
    │                                (client-side; the turn may still be running)
    ├── GatewayResponseError         a 2xx answer the SDK cannot read (not JSON / not safetensors / bad fields)
    └── GatewayStatusError           the gateway answered an error status: .status, .error_type, .message, .body
        ├── BadRequestError          400, 422  invalid input (fix the call; never retried)
        ├── AuthenticationError      401       missing or wrong API key (never retried)
        ├── NotFoundError            404       unknown session
        ├── ConflictError            409       session id taken, or a turn already running on the session
        ├── UpstreamError            502       SGLang answered something invalid (or dropped replay data)
        ├── ServiceUnavailableError  503       SGLang or the session store unreachable / overloaded (retried)
        └── GatewayTimeout           504       SGLang did not answer in time (the gateway's verdict)

Other statuses (429, 500, ...) are plain ``GatewayStatusError``. ``GatewayTimeoutError`` (this client gave up
waiting) and ``GatewayTimeout`` (the gateway says SGLang was too slow) are different events on purpose.
"""

from __future__ import annotations

from collections.abc import Iterable
from http import HTTPStatus
from typing import Any

import orjson

from slime_wire.errors import ConnectFailed, PoolTimeout, ResponseTimeout, SentError, TransportError


class GatewayError(Exception):
    """Base of every error raised by ``slime_client``."""


class GatewayConnectionError(GatewayError):
    """The request did not reach the gateway, or the connection broke before a full answer arrived."""


class GatewayTimeoutError(GatewayError):
    """This client stopped waiting. For a model turn the gateway may still run and fold it."""


class GatewayResponseError(GatewayError):
    """The gateway answered success with a body this SDK cannot interpret (version skew, proxy in between)."""


class GatewayStatusError(GatewayError):
    """The gateway answered an error status with (normally) ``{"error": {"type", "message", ...}}``."""

    def __init__(
        self,
        message: str,
        *,
        status: int,
        error_type: str | None = None,
        body: Any = None,
        headers: dict[str, str] | None = None,
        partial_turn: Any = None,
    ) -> None:
        super().__init__(f"{status} {error_type or 'error'}: {message}")
        self.status = status
        self.error_type = error_type
        self.message = message
        self.body = body
        self.headers = headers or {}  # the answer's headers (lower-case names; the first of repeated ones)
        # A streamed turn that failed mid-way: the ``TurnResult`` of what was folded in (status aborted).
        self.partial_turn = partial_turn

    @property
    def details(self) -> dict[str, Any]:
        """The extra fields of the error object (e.g. ``session_id``, ``upstream_status``, ``errors``)."""
        error = self.body.get("error") if isinstance(self.body, dict) else None
        if not isinstance(error, dict):
            return {}
        return {key: value for key, value in error.items() if key not in ("type", "message")}


class BadRequestError(GatewayStatusError):
    """400 / 422: the request is invalid."""


class AuthenticationError(GatewayStatusError):
    """401: the gateway wants an API key and got none, a malformed one or a wrong one (``api_key=`` or
    ``SLIME_GATEWAY_API_KEY``; ``details["reason"]`` says which)."""


class NotFoundError(GatewayStatusError):
    """404: no such session."""


class ConflictError(GatewayStatusError):
    """409: ``session_exists`` (create with a taken id) or ``session_busy`` (a turn is already running)."""


class UpstreamError(GatewayStatusError):
    """502: SGLang answered something that breaks the protocol (the session is left unchanged)."""


class ServiceUnavailableError(GatewayStatusError):
    """503: SGLang or the session store (Redis) could not be reached or is overloaded; nothing was written (except
    ``details["reason"] == "unconfirmed"``: written, not yet confirmed by Redis replicas)."""


class GatewayTimeout(GatewayStatusError):
    """504: the gateway gave up waiting for SGLang."""


_STATUS_ERRORS: dict[int, type[GatewayStatusError]] = {
    400: BadRequestError,
    401: AuthenticationError,
    404: NotFoundError,
    409: ConflictError,
    422: BadRequestError,
    502: UpstreamError,
    503: ServiceUnavailableError,
    504: GatewayTimeout,
}


def make_status_error(
    status: int, content: bytes | bytearray | memoryview, headers: Iterable[tuple[bytes, bytes]] = ()
) -> GatewayStatusError:
    """An error answer (its status, body and headers as received) -> the typed exception for its status
    (openai-python's ``_make_status_error``)."""
    body = _parse_error_body(content)
    error_type, message = _error_type_and_message(body, status)
    error_class = _STATUS_ERRORS.get(status, GatewayStatusError)
    named = {}
    for name, value in headers:
        named.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))
    return error_class(message, status=status, error_type=error_type, body=body, headers=named)


# The status a gateway error type maps to, for errors that arrive inside a stream (whose HTTP status was 200): the
# status the same error has on a unary turn; the others are 502 (the upstream's answer broke the protocol).
_STREAM_ERROR_STATUS = {
    "upstream_rejected": 400,
    "upstream_unavailable": 503,
    "upstream_timeout": 504,
    "store_unavailable": 503,
}


def make_stream_error(error: Any, partial_turn: Any = None) -> GatewayStatusError:
    """An ``error`` event of a streamed turn -> the same typed exception a unary turn would have raised."""
    error = error if isinstance(error, dict) else {"message": str(error)}
    error_type = error.get("type")
    status = _STREAM_ERROR_STATUS.get(str(error_type), 502)
    error_class = _STATUS_ERRORS.get(status, GatewayStatusError)
    message = str(error.get("message", ""))
    return error_class(message, status=status, error_type=error_type, body={"error": error}, partial_turn=partial_turn)


def translate_transport_error(exc: TransportError, method: str, url: str) -> GatewayError:
    """A transport failure (no complete HTTP answer) -> the SDK's error; callers ``raise ... from exc``.

    ``ResponseTimeout`` (the call's deadline passed) and ``PoolTimeout`` (no free connection in time) are
    ``GatewayTimeoutError``; ``ConnectFailed`` (refused, unreachable, connect timeout), ``ConnectionLost`` and
    ``ProtocolViolation`` are ``GatewayConnectionError``.
    """
    where = f"{method} {url}"
    if isinstance(exc, ResponseTimeout | PoolTimeout):
        return GatewayTimeoutError(f"{where}: no answer in time ({type(exc).__name__}: {exc})")
    if isinstance(exc, ConnectFailed | SentError):
        return GatewayConnectionError(f"{where}: {type(exc).__name__}: {exc or 'connection failed'}")
    return GatewayError(f"{where}: {type(exc).__name__}: {exc}")


def _parse_error_body(content: bytes | bytearray | memoryview) -> Any:
    try:
        return orjson.loads(content)
    except orjson.JSONDecodeError:
        return bytes(content).decode("utf-8", "replace")


def _error_type_and_message(body: Any, status: int) -> tuple[str | None, str]:
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        error_type = error.get("type")
        return (str(error_type) if error_type is not None else None), str(error.get("message", ""))
    # Not the gateway's own format (a proxy in between, or an old gateway): keep what there is.
    text = body if isinstance(body, str) else orjson.dumps(body).decode()
    return None, text[:500] or _reason_phrase(status)


def _reason_phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return ""
