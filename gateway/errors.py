"""The gateway's one exception tree.

Every error the service reports to a caller is a ``GatewayError``; lower-layer errors (httpx, orjson,
base64, numpy) are translated into it at one boundary each, with ``raise ... from exc``.

    GatewayError                        500 internal_error
    ├── InvalidRequest                  422 invalid_request      bad JSON / fields from the caller
    │   ├── ChatTemplateError           400 chat_template_error  the chat template refuses these messages
    │   └── ContextLengthExceeded       400 context_length_exceeded  prompt + max tokens past the context
    ├── ChatNotConfigured               501 chat_not_configured  a chat route on a gateway started without a tokenizer
    ├── Unauthorized                    401 unauthorized         no / malformed / wrong API key
    ├── SessionNotFound                 404 session_not_found
    │   └── BranchNotFound              404 branch_not_found     a sample fetch names a branch the session has not
    ├── PreviousResponseNotFound        404 previous_response_not_found  the Responses API continues an unknown id
    ├── SessionConflict                 409 session_conflict
    │   ├── SessionExists               409 session_exists       create with an id already taken
    │   ├── SessionBusy                 409 session_busy         a turn is already running on it
    │   ├── SessionMismatch             409 session_mismatch     the session is not what the caller's ``sync`` says
    │   ├── HistoryMismatch             409 history_mismatch     a chat history that disagrees with the session's
    │   └── SessionClosed               409 session_closed       the session was closed (its samples being taken)
    ├── StoreUnavailable                503 store_unavailable    the shared session store (Redis) cannot be reached
    ├── TurnInterrupted                 503 turn_interrupted     the engine aborted the turn (a weight update) and it
    │                                                            was not resumed (GATEWAY_RESUME_MAX, the deadline)
    ├── TurnAborted                     503 turn_aborted         the trainer ended the turn (the session's abort route,
    │                                                            the gateway-wide abort, shutdown)
    ├── NotFound                        404 not_found            no route has this path
    ├── MethodNotAllowed                405 method_not_allowed   the path exists, not with this method (Allow header)
    ├── LimitExceeded                   413 limit_exceeded       a GATEWAY_* limit refused the request
    │   ├── RequestTooLarge             413 request_too_large    body over max_request_bytes
    │   ├── SessionTooLong              413 session_too_long     the session would pass max_session_tokens
    │   ├── TooManySessions             429 too_many_sessions    the store is at max_sessions
    │   ├── TurnLimitReached            429 turn_limit_reached   the session ran its max_turns model turns
    │   ├── StoreFull                   507 store_full           the sessions hold max_stored_bytes
    │   ├── TooManyConnections          503 too_many_connections max_client_connections open, none idle
    │   ├── HeaderTimeout               408 header_timeout       the request head did not arrive in header_timeout_s
    │   └── BodyTimeout                 408 body_timeout         the request body did not arrive in body_timeout_s
    └── UpstreamError                   502 upstream_error       anything wrong on the SGLang side
        ├── UpstreamProtocolError       502 upstream_protocol_error   answer that breaks docs/protocol.md
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

    def response_headers(self) -> dict[str, str]:
        """Headers the error response must carry besides the JSON body (e.g. ``Allow`` on a 405)."""
        return {}


class InvalidRequest(GatewayError):
    status_code = 422
    error_type = "invalid_request"


class ChatTemplateError(InvalidRequest):
    status_code = 400
    error_type = "chat_template_error"


class ContextLengthExceeded(InvalidRequest):
    """The conversation (``prompt_tokens``) and the answer asked for (``max_tokens``, None when the prompt alone is
    too long) do not fit the model's context (``context_tokens``); each chat API words it its own way."""

    status_code = 400
    error_type = "context_length_exceeded"


class PreviousResponseNotFound(GatewayError):
    status_code = 404
    error_type = "previous_response_not_found"


class ChatNotConfigured(GatewayError):
    status_code = 501
    error_type = "chat_not_configured"


class Unauthorized(GatewayError):
    """The API key is missing, malformed or wrong (``details["reason"]``: missing / malformed / invalid_key).
    The message never repeats what the caller sent."""

    status_code = 401
    error_type = "unauthorized"
    # RFC 6750 section 3.1: the challenge names the problem, except when no credentials came at all.
    _CHALLENGE_ERRORS: ClassVar[dict[str, str]] = {"malformed": "invalid_request", "invalid_key": "invalid_token"}

    def response_headers(self) -> dict[str, str]:
        challenge = 'Bearer realm="slime-gateway"'
        error = self._CHALLENGE_ERRORS.get(str(self.details.get("reason")))
        return {"www-authenticate": challenge if error is None else f'{challenge}, error="{error}"'}


class SessionNotFound(GatewayError):
    status_code = 404
    error_type = "session_not_found"


class BranchNotFound(SessionNotFound):
    error_type = "branch_not_found"


class SessionConflict(GatewayError):
    status_code = 409
    error_type = "session_conflict"


class SessionExists(SessionConflict):
    error_type = "session_exists"


# When a client may send a request refused for a passing reason again: ``Retry-After`` (RFC 9110 section 10.2.3),
# which agent harnesses honour, and ``x-should-retry``, which the OpenAI and Anthropic SDKs read before their own rules.
RETRY_AFTER_S = 1


def retry_headers(seconds: int = RETRY_AFTER_S) -> dict[str, str]:
    return {"retry-after": str(seconds), "x-should-retry": "true"}


class SessionBusy(SessionConflict):
    """Another turn holds the session (on this replica or another): nothing ran, send it again in a moment."""

    error_type = "session_busy"

    def response_headers(self) -> dict[str, str]:
        return retry_headers()


class SessionMismatch(SessionConflict):
    """The caller's idea of the session (``sync``: its length and last tokens) is out of date; the details say
    what the session holds, so the caller can catch up without asking."""

    error_type = "session_mismatch"


class HistoryMismatch(SessionConflict):
    """A chat request's history is not an extension of the session's (edited, dropped or reordered messages) and
    the drift policy is ``reject``; ``details`` say from which message on they differ."""

    error_type = "history_mismatch"


class SessionClosed(SessionConflict):
    """``POST /v1/sessions/{id}/close`` was called (a trainer is taking the session's samples): no turn runs on it
    any more, whatever the API. Not retryable: the rollout is over."""

    error_type = "session_closed"


class StoreUnavailable(GatewayError):
    """The shared session store (Redis) did not answer, or refused: nothing was written (a turn's fold is written in
    one transaction, or not at all). Safe to retry once the store is back. Two exceptions, which a client may retry
    only with ``sync``: ``reason`` ``unconfirmed`` (``GATEWAY_REDIS_WAIT_REPLICAS``: written, but not confirmed by the
    replicas asked for, so it may or may not survive a failover) and ``unknown`` (a write sent, and Redis never
    answered again: whether it happened is unknown)."""

    status_code = 503
    error_type = "store_unavailable"
    MAYBE_WRITTEN: ClassVar[frozenset[str]] = frozenset({"unconfirmed", "unknown"})

    def response_headers(self) -> dict[str, str]:
        if self.details.get("reason") in self.MAYBE_WRITTEN:
            return {"x-should-retry": "false"}
        return retry_headers()


class TurnInterrupted(GatewayError):
    """A model turn the engine aborted mid-answer (a weight update's pause) that was not resumed: ``reason`` says
    which bound (resume_max, deadline, refused, resume_failed, max_session_tokens, off, engine_abort), ``resumed``
    how often it was. The session keeps what was generated, marked aborted: the client must not take it for the
    model's answer. 503: the harnesses' clients retry it (the retry's history, without the cut reply, forks a new
    branch from before it)."""

    status_code = 503
    error_type = "turn_interrupted"


class TurnAborted(GatewayError):
    """A model turn the trainer ended on purpose (the session's abort route, the gateway-wide ``abort_all``, the
    gateway shutting down): never resumed, kept in the session as aborted. 503, as for an interrupted turn: a client
    that retries gets a new turn, unless the trainer deleted the session (then 404)."""

    status_code = 503
    error_type = "turn_aborted"


class NotFound(GatewayError):
    status_code = 404
    error_type = "not_found"


class MethodNotAllowed(GatewayError):
    """``details["allow"]``: the methods the path takes, also sent as the ``Allow`` header (RFC 9110 15.5.6)."""

    status_code = 405
    error_type = "method_not_allowed"

    def response_headers(self) -> dict[str, str]:
        return {"allow": ", ".join(self.details.get("allow", ()))}


class LimitExceeded(GatewayError):
    """A configured limit refused the request; ``details`` name the ``setting`` and its ``limit``. Nothing was
    changed: the session (if any) is exactly as it was."""

    status_code = 413
    error_type = "limit_exceeded"


class RequestTooLarge(LimitExceeded):
    error_type = "request_too_large"


class SessionTooLong(LimitExceeded):
    error_type = "session_too_long"


class TooManySessions(LimitExceeded):
    status_code = 429
    error_type = "too_many_sessions"


class TurnLimitReached(LimitExceeded):
    """The session has run the ``max_turns`` model turns it was created with (slime's ``max_turns_per_sid``): 429,
    as slime's adapters answer it, so that a harness stuck in a loop ends."""

    status_code = 429
    error_type = "turn_limit_reached"


class StoreFull(LimitExceeded):
    """507 Insufficient Storage, not 503: the store frees up only when sessions are deleted or expire, so an
    automatic retry (the SDK retries 503s) would not help."""

    status_code = 507
    error_type = "store_full"


class TooManyConnections(LimitExceeded):
    status_code = 503
    error_type = "too_many_connections"

    def response_headers(self) -> dict[str, str]:
        return retry_headers()


class HeaderTimeout(LimitExceeded):
    status_code = 408
    error_type = "header_timeout"


class BodyTimeout(LimitExceeded):
    status_code = 408
    error_type = "body_timeout"


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

    def response_headers(self) -> dict[str, str]:
        return retry_headers()


class UpstreamTimeout(UpstreamError):
    status_code = 504
    error_type = "upstream_timeout"
