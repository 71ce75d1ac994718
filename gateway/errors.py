"""The gateway's one exception tree.

Every error the service reports to a caller is a ``GatewayError``; lower-layer errors (httpx, orjson,
base64, numpy) are translated into it at one boundary each, with ``raise ... from exc``.

    GatewayError                        500 internal_error
    ├── InvalidRequest                  422 invalid_request      bad JSON / fields from the caller
    ├── SessionNotFound                 404 session_not_found
    ├── SessionConflict                 409 session_conflict
    │   ├── SessionExists               409 session_exists       create with an id already taken
    │   └── SessionBusy                 409 session_busy         a turn is already running on it
    ├── TooManySessions                 429 too_many_sessions    the store is at max_sessions
    └── UpstreamError                   502 upstream_error       anything wrong on the SGLang side
        ├── UpstreamProtocolError       502 upstream_protocol_error   answer that breaks PROTOCOL.md
        │   └── ReplayDataDropped       502 replay_data_dropped  asked for routing / top-p, got none
        ├── UpstreamRejected            400 upstream_rejected    SGLang/router refused the request (4xx)
        ├── UpstreamConnectionLost      502 upstream_connection_lost  dropped after the request was sent
        ├── UpstreamUnavailable         503 upstream_unavailable cannot connect, or 503/429 from upstream
        └── UpstreamTimeout             504 upstream_timeout

The JSON body of an error response is ``{"error": {"type": ..., "message": ..., **details}}``.
"""

from __future__ import annotations

from typing import Any, ClassVar


class GatewayError(Exception):
    status_code: ClassVar[int] = 500
    error_type: ClassVar[str] = "internal_error"

    def __init__(self, message: str, *, status_code: int | None = None, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details
        if status_code is not None:
            self.status_code = status_code  # type: ignore[misc]  # instance override of the class default

    def to_body(self) -> dict[str, Any]:
        return {"error": {"type": self.error_type, "message": self.message, **self.details}}


class InvalidRequest(GatewayError):
    status_code = 422
    error_type = "invalid_request"


class SessionNotFound(GatewayError):
    status_code = 404
    error_type = "session_not_found"


class SessionConflict(GatewayError):
    status_code = 409
    error_type = "session_conflict"


class SessionExists(SessionConflict):
    error_type = "session_exists"


class SessionBusy(SessionConflict):
    error_type = "session_busy"


class TooManySessions(GatewayError):
    status_code = 429
    error_type = "too_many_sessions"


class UpstreamError(GatewayError):
    status_code = 502
    error_type = "upstream_error"


class UpstreamProtocolError(UpstreamError):
    error_type = "upstream_protocol_error"


class ReplayDataDropped(UpstreamProtocolError):
    error_type = "replay_data_dropped"


class UpstreamRejected(UpstreamError):
    """The upstream answered 4xx: the request itself was refused. Always 400 to the caller (the upstream's
    status is in ``upstream_status``): an upstream 404/409 must not read as the v1 API's unknown/busy session."""

    status_code = 400
    error_type = "upstream_rejected"


class UpstreamConnectionLost(UpstreamError):
    """The connection broke after the request was sent: the turn may have run, so this is not a retryable 503."""

    error_type = "upstream_connection_lost"


class UpstreamUnavailable(UpstreamError):
    status_code = 503
    error_type = "upstream_unavailable"


class UpstreamTimeout(UpstreamError):
    status_code = 504
    error_type = "upstream_timeout"
