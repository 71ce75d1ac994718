"""What the chat APIs' adapters share: the request models' base, their bounds, the checks every chat API makes of a
history, hosted tools left out, and how a refused request is reported (each API calls it ``invalid_request_error``,
status 400)."""

from __future__ import annotations

import logging

from pydantic import BaseModel, ConfigDict, StrictFloat, StrictInt, ValidationError

from gateway.chat.messages import ChatMessage
from gateway.errors import GatewayError

log = logging.getLogger("gateway.chat")

MAX_MESSAGES = 4096
MAX_TOOLS = 256
Number = StrictInt | StrictFloat


class ApiModel(BaseModel):
    # Fields the APIs have and that change nothing here (user, metadata, store, ...) are accepted and ignored; the
    # ones that would change the answer and cannot be honoured are refused by each adapter.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class ChatRequestError(GatewayError):
    """A request the chat API refuses: 400 ``invalid_request_error`` (``param``: where, when known)."""

    status_code = 400
    error_type = "invalid_request_error"


def validation_error(exc: ValidationError) -> ChatRequestError:
    first = exc.errors(include_url=False)[0]
    where = ".".join(str(p) for p in first.get("loc", ()))
    return ChatRequestError(f"invalid request: {where}: {first.get('msg')}", param=where or None)


class HostedTools:
    """Tools an API's provider runs on its own servers (web search, code execution, ...): the served model cannot
    call them here, so they are left out of the prompt. Each kind is logged once per gateway."""

    def __init__(self) -> None:
        self._seen: set[tuple[str, str]] = set()

    def left_out(self, api: str, kind: str) -> None:
        if (api, kind) in self._seen:
            return
        self._seen.add((api, kind))
        log.info("chat (%s): tools of type %r are hosted by the API's provider; left out of the prompt", api, kind)


def check_history(messages: tuple[ChatMessage, ...]) -> None:
    """A tool result for no earlier call, and a history the model would continue rather than answer (its last
    message its own), are refused."""
    calls: set[str] = set()
    for i, message in enumerate(messages):
        calls.update(c.id for c in message.tool_calls)
        if message.role == "tool" and message.tool_call_id not in calls:
            raise ChatRequestError(
                f"messages[{i}]: tool_call_id {message.tool_call_id!r} answers no earlier tool call",
                param=f"messages.{i}.tool_call_id",
            )
    if messages[-1].role == "assistant":
        raise ChatRequestError(
            "the last message is the assistant's: continuing a reply (prefill) is not supported, end with a user or "
            "tool message",
            param="messages",
        )


def error_status(exc: GatewayError) -> int:
    """Both APIs answer a bad request 400, never 422."""
    return 400 if exc.status_code == 422 else exc.status_code
